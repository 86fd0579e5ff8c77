"""Proof that an expert module is row-local, deterministic and stateless: the property EP needs of it.

EP runs each expert on whichever (token, expert) rows reached the rank that owns it, a different batch of
rows than the model's own loop gives it. That is exact when the expert's computation is

- *row-local*: output row i reads only input row i and the expert's own parameters;
- *deterministic*: no random numbers (dropout with p > 0 while training, ``torch.rand*``);
- *stateless*: no writes to buffers or attributes, no batch statistics, no in-place edit of its input.

``prove_expert(expert, what)`` proves it by one abstract interpreter over the expert module and the ASTs of
the ``forward`` (and helper methods, user submodules, plain functions) it runs. The whitelist: containers
(``nn.Sequential`` as torch runs it, ``nn.ModuleList`` iterated), ``nn.Linear`` with or without bias, any
element-wise activation (function or module, ``autoep.detect.elementwise``), ``nn.Dropout`` with p=0 or in
eval, last-dim norms (``nn.LayerNorm``/``nn.RMSNorm`` over the last dim, or written out with reductions over
dim -1), ``nn.Identity``, user modules recursively, optional arguments the call site does not pass (their
defaults), and branches on constant instance attributes, folded at detection (``ExpertProof.folded``: the
fingerprint and the replay check read them). Anything else is a refusal naming the property that failed and
the model's line: ``MyExpert.forward line 4: `x.mean(0)` mixes rows (not row-local)``.

Values (the shared domain of ``autoep.detect.loop_values``):
  Row(("x",))     the expert's input rows (n, D), or a view of them (in-place edits are refused)
  Row(("rows",))  rows computed from them, row i from row i alone (fresh tensors)
  Row(("rows1",)) one value per row (n,): a reduction over the features without keepdim
  Obj             a Python value known at detection (numbers, flags, dtypes, modules, functions)
  Uniform         a value equal for every row but unknown at detection (a dtype, a device, the last-dim size)
  ExpertTensor    a parameter or buffer of the expert (read only)
  Bound           a plain method of a module of the expert (followed when called)
Rows are 2-D: dim 0 is the row, dim -1 (= 1) the feature dim. The proof also decides one more fact,
``ExpertProof.leading_dims_free``: the expert treats every dim before the last alike, so calling it on
``(..., D)`` equals calling it on the ``(prod(...), D)`` rows that tensor flattens to, reshaped back
(the one-pass execution moves N-D expert calls only where it holds). It is false as soon as the expert
reads anything but the last dim by a positive index or the input's rank: ``dim=1``/``.sum(1)``/``softmax``
without a dim, ``x[:, a:b]``, ``x.shape[1]``/``size(1)``, ``x.dim()``/``.ndim``, ``unsqueeze(1)``,
``view(-1, d)``; anything else the interpreter accepts is last-dim-only or element-wise (linears, last-dim
norms, activations, ``[..., a:b]``, ``dim=-1``). This module holds the proof's entry, its context (calling
modules, folding constants) and the drift check; the interpreter of one function's statements and
expressions is ``autoep.detect.row_exprs``.
"""
from __future__ import annotations

import inspect
import types
from dataclasses import dataclass

import torch
import torch.nn as nn

from autoep.detect import elementwise
from autoep.detect.loop_values import Row
from autoep.detect.row_exprs import (
    BATCH_NORMS,
    BATCH_STATS,
    INPLACE,
    INPUT,
    MAX_DEPTH,
    MISSING,
    MIXES,
    RANDOM,
    ROWS,
    TWO_D,
    Interpreter,
    aliases,
    show,
)
from autoep.detect.source import Refusal, function_tree


@dataclass(frozen=True)
class ExpertProof:
    """A proven row-local expert. ``folded``: ``(path under the expert, value)`` of every constant instance
    attribute the proof read (branches folded on them, numbers it computed with), sorted; a change of any
    of them after detection is drift. ``leading_dims_free``: the expert treats every dim before the last alike
    (module docstring), so ``expert(x)`` on ``(..., D)`` is ``expert(x.reshape(-1, D)).reshape(..., P)``;
    ``pinned_by``: where it is false, the first construct that reads a leading dim or the input's rank."""

    folded: tuple[tuple[str, str], ...] = ()
    leading_dims_free: bool = False
    pinned_by: str = ""


def prove_expert(expert: nn.Module, what: str) -> ExpertProof:
    """``expert(rows)`` on ``(n, D)`` rows is row-local, deterministic and stateless, or ``Refusal`` naming the
    property, the model's class and line."""
    ctx = _Context(what)
    out = ctx.call_module(expert, [INPUT], {}, "", None)
    if out not in TWO_D:
        raise Refusal(f"{what} ({type(expert).__name__}) does not return rows (it returns {show(out)})")
    return ExpertProof(tuple(sorted(ctx.folded.items())), not ctx.pinned_by, ctx.pinned_by)


def folded_drift(block: nn.Module, folded) -> list[str]:
    """Which recorded ``<experts_path>.<e or *>.<attr>=<repr>`` entries (``MoeStructure.folded``) no longer hold
    on ``block``: a constant a proof folded changed after detection (empty when none did). Entries ``*.<attr>``
    and ``<e>.<attr>`` hold for the experts container itself as ``block``."""
    reasons = []
    for entry in folded:
        path, _, recorded = entry.partition("=")
        container_path, star, attr = ("", "*", path[2:]) if path.startswith("*.") else path.partition(".*.")
        if star:
            container = _walk(block, container_path) if container_path else block
            members = list(container.values()) if isinstance(container, nn.ModuleDict) else list(container or ())
            targets = [(f"{container_path}.{e}.{attr}", m) for e, m in enumerate(members)]
            now = {fold_repr(_walk(m, attr)) for _, m in targets} if targets else {"<no experts>"}
        else:
            now = {fold_repr(_walk(block, path))}
        if now != {recorded}:
            reasons.append(f"{path} was {recorded} when the experts were proven, now {', '.join(sorted(now))}")
    return reasons


def fold_repr(value) -> str:
    """How a folded value is recorded: a function by its qualified name, a shape as a tuple, else ``repr``."""
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return f"{getattr(value, '__module__', None) or ''}.{value.__qualname__}"
    if isinstance(value, torch.Size):
        return repr(tuple(value))
    return repr(value)


def _walk(obj, path: str):
    """The value at a dotted path of submodules, parameters (``.shape``) and config fields; ``<missing>``."""
    for part in path.split("."):
        if isinstance(obj, (nn.ModuleList, nn.Sequential)) and part.isdigit():
            obj = obj[int(part)] if int(part) < len(obj) else MISSING
        elif isinstance(obj, nn.ModuleDict) and part in obj:
            obj = obj[part]
        elif isinstance(obj, nn.ModuleDict) and part.isdigit():  # ``_fold_entries`` numbers experts by position
            values = list(obj.values())
            obj = values[int(part)] if int(part) < len(values) else MISSING
        else:
            obj = getattr(obj, part, MISSING)
        if obj is MISSING:
            return "<missing>"
    return tuple(obj) if isinstance(obj, torch.Size) else obj



class _Context:
    """One proof: the folded attributes and the call depth, shared by every function it interprets."""

    def __init__(self, what: str):
        self.what, self.depth = what, 0
        self.folded: dict[str, str] = {}
        self.pinned_by = ""  # the first construct that reads a leading dim or the rank ("": none yet)

    def fold(self, path: str, value) -> None:
        self.folded[path] = fold_repr(value)

    def pin(self, where: str) -> None:
        """The expert reads a dim before the last by a positive index, or the input's rank: on ``(..., D)``
        it may not treat the leading dims alike (``ExpertProof.leading_dims_free`` is false)."""
        self.pinned_by = self.pinned_by or where

    # -- calling a module ---------------------------------------------------------------------------

    def call_module(self, module: nn.Module, args: list, kwargs: dict, path: str, node) -> object:
        where = f"{self.what}{'.' + path if path else ''} ({type(module).__name__})"
        elementwise.runtime_clean(module, where)
        rows = args[0] if len(args) == 1 and not kwargs else None
        cls = type(module)
        if cls is nn.Sequential:  # torch's own forward: each child in order
            for name, child in module.named_children():
                rows = self.call_module(child, [rows], {}, f"{path}.{name}" if path else name, node)
            return rows
        if cls in (nn.Linear, nn.Identity, nn.LayerNorm, nn.RMSNorm, nn.Dropout) or _is_activation(module):
            if not isinstance(rows, Row):
                raise Refusal(f"{where} is called on {show(rows)}, not on the expert's rows alone")
            return self._torch_module(module, rows, path, where)
        if cls is nn.BatchNorm1d and not module.training and module.track_running_stats and \
                module.running_mean is not None and isinstance(rows, Row):
            # In eval, its running statistics: a per-feature affine map of each (rows, features) row. Its mode is a
            # fact (``model.train()`` after apply would switch it to batch statistics); on an N-D input its channels
            # are dim 1, not the last.
            self.fold(f"{path}.training" if path else "training", False)
            self.fold(f"{path}.track_running_stats" if path else "track_running_stats", True)
            self.pin(f"{where} reads dim 1 as its channels on an N-D input")
            return ROWS
        if isinstance(module, BATCH_NORMS):
            raise Refusal(f"{where}: {cls.__name__} {BATCH_STATS}")
        if isinstance(module, nn.Dropout.__mro__[1]):  # other dropouts: random per call or per channel
            raise Refusal(f"{where}: {cls.__name__} {RANDOM}")
        if cls.__module__.startswith("torch."):
            raise Refusal(f"{where}: {cls.__name__} is a torch module the proof does not know row-local")
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise Refusal(f"{where}: modules and functions nest too deep to follow")
        try:
            return self.call_function(_plain_forward(module, where), [module] + list(args), kwargs, module, path)
        finally:
            self.depth -= 1

    def _torch_module(self, module: nn.Module, rows: Row, path: str, where: str) -> Row:
        cls = type(module)
        if getattr(module, "inplace", False) is True and aliases(rows):
            raise Refusal(f"{where} runs in place on the expert's input: it {INPLACE}")
        if cls is nn.Identity:
            return rows
        if cls is nn.Linear:
            if module.weight.dim() != 2:
                raise Refusal(f"{where}.weight is not 2-D")
            return ROWS
        if cls in (nn.LayerNorm, nn.RMSNorm):
            if len(module.normalized_shape) != 1:
                raise Refusal(f"{where} normalises over {tuple(module.normalized_shape)}, not the last dim alone: "
                              f"{MIXES}")
            return ROWS
        if cls is nn.Dropout:
            # Its probability is a fact at p=0 too: raised after apply, the model's own loop would draw masks.
            self.fold(f"{path}.p" if path else "p", module.p)
            if module.p == 0:
                return rows
            if module.training:
                raise Refusal(f"{where} is dropout with p={module.p} while training: it {RANDOM}; exact only at "
                              "p=0 or in eval (set it to 0, or opt out)")
            self.fold(f"{path}.training" if path else "training", False)
            return rows
        return ROWS  # an element-wise activation module

    # -- calling a function -------------------------------------------------------------------------

    def call_function(self, fn, args: list, kwargs: dict, owner: nn.Module | None, path: str):
        """Interpret ``fn(*args, **kwargs)`` (``args[0]``: the module for a method); optional parameters the
        call does not pass take their defaults."""
        if hasattr(fn, "__wrapped__"):
            raise Refusal(f"{self.what}: {fn.__qualname__} is wrapped by a decorator; autoep does not know what it does")
        tree = function_tree(fn)
        if tree.decorator_list:
            raise Refusal(f"{self.what}: {fn.__qualname__} is decorated; autoep does not know what the decorator does")
        interp = Interpreter(self, fn, tree, owner, path)
        interp.bind(args, kwargs)
        return interp.run()


def _is_activation(module: nn.Module) -> bool:
    try:
        elementwise.check_activation_module(module, "")
    except Refusal:
        return False
    return True


def _plain_forward(module: nn.Module, where: str):
    fn = getattr(type(module), "forward", None)
    if fn is None or fn is nn.Module.forward:
        raise Refusal(f"{where} has no forward of its own")
    if not inspect.isfunction(fn):
        raise Refusal(f"{where}: forward is not a plain function")
    return fn

