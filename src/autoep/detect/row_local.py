"""Proof that an expert module is row-local, deterministic and stateless: the property EP needs of it.

EP runs each expert on whichever (token, expert) rows reached the rank that owns it, a different batch of
rows than the model's own loop gives it. That is exact when the expert's computation is

- *row-local*: output row i reads only input row i and the expert's own parameters;
- *deterministic*: no random numbers (dropout with p > 0 while training, ``torch.rand*``);
- *stateless*: no writes to buffers or attributes, no batch statistics, no in-place edit of its input.

``prove_expert(expert, what)`` proves it by one abstract interpreter over the expert module and the ASTs of
the ``forward`` (and helper methods, user submodules, plain functions) it runs. The whitelist: containers
(``nn.Sequential`` as torch runs it, ``nn.ModuleList`` iterated), ``nn.Linear`` with or without bias, any
element-wise activation (function or module, ``autoep.detect.elementwise``), dropout (every ``nn`` dropout module,
``F.dropout`` and kin) with p=0 or in eval, last-dim norms (``nn.LayerNorm``/``nn.RMSNorm`` over the last dim, or
written out with reductions over dim -1), ``nn.GroupNorm``, ``nn.Identity``, user modules recursively, optional
arguments the call site does not pass (their defaults), and branches on constant instance attributes, folded at detection (``ExpertProof.folded``: the
fingerprint and the replay check read them). Anything else is a refusal naming the property that failed and
the model's line: ``MyExpert.forward line 4: `x.mean(0)` mixes rows (not row-local)``.

Mode-aware: a module whose row-locality depends on ``training`` is proven for the mode it is in, and that mode
is folded (re-checked before each call after apply, ``runtime.recipes.check_facts``): ``nn.BatchNorm1d`` and
``nn.SyncBatchNorm`` in eval with running statistics (and ``F.batch_norm`` with ``training=False`` and the expert's
running statistics) are a per-feature affine map of each row; in training they normalise by the statistics of
the batch an expert's owner gathers from every rank (batch statistics mix rows across ranks) and are refused
saying so; a dropout in eval is the identity; a branch on ``self.training`` is folded as any constant. A mode read
that decides nothing (``F.dropout(x, 0.0, self.training)``) is released, not recorded (``_Context.release``).
Random draws: under ``draws_on_owner`` (``PlanEntry.expert_draws=on_owner``) an element-wise dropout with p > 0
is accepted in either mode, its masks drawn wherever the expert runs (equal in distribution to the model's, not
bit-equal), recorded in ``ExpertProof.draws`` with neither its p nor its mode folded.

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

import collections
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
    BATCH_STATS_WHY,
    DROPOUTS,
    ELEMENTWISE_DROPOUTS,
    INPLACE,
    INPUT,
    MAX_DEPTH,
    MISSING,
    MIXES,
    RANDOM,
    ROWS,
    TWO_D,
    VIEW,
    Interpreter,
    aliases,
    show,
    uses_batch_statistics,
)
from autoep.detect.source import Refusal, function_tree
from autoep.errors import DRAWS_OPT_IN


@dataclass(frozen=True)
class ExpertProof:
    """A proven row-local expert. ``folded``: ``(path under the expert, value)`` of every constant instance
    attribute the proof read (branches folded on them, numbers it computed with), sorted; a change of any
    of them after detection is drift. ``leading_dims_free``: the expert treats every dim before the last alike
    (module docstring), so ``expert(x)`` on ``(..., D)`` is ``expert(x.reshape(-1, D)).reshape(..., P)``;
    ``pinned_by``: where it is false, the first construct that reads a leading dim or the input's rank.
    ``draws``: ``(where under the expert, what)`` of each random draw accepted under ``draws_on_owner`` (an
    element-wise dropout with p > 0: made on the expert's owner, equal in distribution, not bit-equal), sorted."""

    folded: tuple[tuple[str, str], ...] = ()
    leading_dims_free: bool = False
    pinned_by: str = ""
    draws: tuple[tuple[str, str], ...] = ()


def prove_expert(expert: nn.Module, what: str, draws_on_owner: bool = False) -> ExpertProof:
    """``expert(rows)`` on ``(n, D)`` rows is row-local, deterministic and stateless, or ``Refusal`` naming the
    property, the model's class and line. ``draws_on_owner`` (``PlanEntry.expert_draws=on_owner``): an
    element-wise dropout with p > 0 is accepted in either mode, its draws made wherever the expert runs
    (``ExpertProof.draws``); without it such a dropout is exact only at p=0 or in eval."""
    ctx = _Context(what, draws_on_owner)
    try:
        out = ctx.call_module(expert, [INPUT] * row_arity(expert), {}, "", None)
    except Refusal as exc:
        exc.args = (f"{exc}{_defaulted_hint(expert, str(exc))}",)
        raise
    if out not in TWO_D:
        raise Refusal(f"{what} ({type(expert).__name__}) does not return rows (it returns {show(out)})")
    folded = {k: v for k, v in ctx.folded.items() if ctx.reads[k] > 0}
    return ExpertProof(tuple(sorted(folded.items())), not ctx.pinned_by, ctx.pinned_by, tuple(sorted(ctx.draws.items())))


def _defaulted_hint(expert: nn.Module, why: str) -> str:
    """Where the refusal names a parameter of the expert's forward whose default is None (``pos_emb.cos``): the proof
    took that default, as a call not passing it; a block passing it per row by keyword (``expert(x[tok],
    pos_emb=pos[tok])``) needs it without a default to have it moved with the rows. Empty otherwise."""
    fn = getattr(type(expert), "forward", None)
    if not inspect.isfunction(fn):
        return ""
    names = [name for name, p in inspect.signature(fn).parameters.items() if p.default is None]
    name = next((n for n in names if f"`{n}." in why or f"`{n}`" in why or f"`{n}[" in why), None)
    if name is None:
        return ""
    return (f" ({type(expert).__name__}.forward's `{name}` defaults to None, which the proof takes: autoep moves per-row "
            f"extras with the rows only for the forward's parameters without a default; where the block passes "
            f"`{name}=<rows>`, drop its default so that it is proven and moved as the rows' extra)")


def row_arity(expert: nn.Module) -> int:
    """How many per-row tensors ``expert`` takes: its class forward's positional parameters without a default (the
    rows, then extras such as a position table's rows or each row's routing probability: ``expert(x[tok],
    pos[tok])``), at least 1. The proof binds each to rows (``(n, ·)``, row i of each read with row i of the others,
    never written); the one-pass execution moves them together (passed by position or by their parameters' names)
    and raises on a call passing another number of arguments or another keyword (an optional parameter the proof
    took at its default would be given a value)."""
    fn = getattr(type(expert), "forward", None)
    if type(expert).__module__.startswith("torch.") or not inspect.isfunction(fn):
        return 1
    code = fn.__code__
    required = code.co_argcount - 1 - len(fn.__defaults__ or ())
    return max(required, 1)


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

    def __init__(self, what: str, draws_on_owner: bool = False):
        self.what, self.depth, self.draws_on_owner = what, 0, draws_on_owner
        self.folded: dict[str, str] = {}
        self.reads: collections.Counter = collections.Counter()  # reads of each folded value not released since
        self.draws: dict[str, str] = {}  # where -> what, the draws accepted under ``draws_on_owner``
        self.pinned_by = ""  # the first construct that reads a leading dim or the rank ("": none yet)

    def opaque(self, module: nn.Module) -> bool:
        """Whether ``module`` is one whose attributes the proof must not read (``call_chain``: the module a wrapper
        wraps); none here."""
        return False

    def writes_attribute(self, interp, target) -> bool:
        """Whether ``<target> = ...`` (an ``ast.Attribute``) is accepted: a wrapper level's plain Python state
        (``call_chain``); never an expert's."""
        return False

    def fold(self, path: str, value) -> None:
        self.folded[path] = fold_repr(value)
        self.reads[path] += 1

    def release(self, path: str) -> None:
        """One read of the folded ``path`` decided nothing (``F.dropout(x, 0.0, self.training)``: the identity in
        either mode): it is recorded only if another read remains."""
        self.reads[path] -= 1

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
        if cls in (nn.Linear, nn.Identity, nn.LayerNorm, nn.RMSNorm) or _is_activation(module):
            if not isinstance(rows, Row):
                raise Refusal(f"{where} is called on {show(rows)}, not on the expert's rows alone")
            return self._torch_module(module, rows, path, where)
        if isinstance(module, BATCH_NORMS):
            return self._norm_module(module, rows, path, where)
        if cls in DROPOUTS:
            if not isinstance(rows, Row):
                raise Refusal(f"{where} is called on {show(rows)}, not on the expert's rows alone")
            return self._dropout_module(module, rows, path, where)
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
        return ROWS  # an element-wise activation module

    def _norm_module(self, module: nn.Module, rows, path: str, where: str) -> Row:
        """A BatchNorm, InstanceNorm, GroupNorm or LocalResponseNorm: row-local where it is a per-feature map of
        each row. BatchNorm1d and SyncBatchNorm in eval with running statistics are (an affine map per feature,
        their mode folded and watched: ``train()`` after apply raises); GroupNorm is in either mode (each row
        normalised over groups of its own features). On an N-D call their channels are dim 1, not the last."""
        cls = type(module)
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and uses_batch_statistics(module):
            raise Refusal(f"{where}: {cls.__name__} {BATCH_STATS}: {BATCH_STATS_WHY}")
        if not isinstance(rows, Row):
            raise Refusal(f"{where} is called on {show(rows)}, not on the expert's rows alone")
        if isinstance(module, nn.modules.lazy.LazyModuleMixin):
            raise Refusal(f"{where}: {cls.__name__} is lazy: its parameters' shapes are set at its first call")
        if cls in (nn.BatchNorm1d, nn.SyncBatchNorm, nn.GroupNorm):
            if cls is not nn.GroupNorm:  # in eval, its running statistics: ``model.train()`` would switch them off
                self.fold(f"{path}.training" if path else "training", False)
                self.fold(f"{path}.track_running_stats" if path else "track_running_stats", module.track_running_stats)
            self.pin(f"{where} reads dim 1 as its channels on an N-D input")
            return ROWS
        if isinstance(module, nn.modules.instancenorm._InstanceNorm):
            raise Refusal(f"{where}: {cls.__name__} reads the expert's (n, D) rows as one instance whose channels are "
                          f"the rows (statistics, running statistics and affine weights indexed by a row's position): "
                          f"{MIXES}; a LayerNorm over the last dim normalises each row alone")
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise Refusal(f"{where}: {cls.__name__} takes (N, C, ...) input of more dims than the expert's (n, D) rows")
        raise Refusal(f"{where}: {cls.__name__} is a norm across features and rows the proof does not follow")

    def _dropout_module(self, module: nn.Module, rows: Row, path: str, where: str) -> Row:
        cls = type(module)
        if module.inplace and aliases(rows):
            raise Refusal(f"{where} runs in place on the expert's input: it {INPLACE}")
        training = f"{path}.training" if path else "training"
        self.fold(training, module.training)  # released where the mode decides nothing (p=0, or drawn on the owner)
        return self.dropout(where, f"{path}.p" if path else "p", module.p, training, cls in ELEMENTWISE_DROPOUTS,
                            f"{cls.__name__}(p={module.p})", path or "(expert)", rows)

    def dropout(self, where: str, p_path: str | None, p: float, training: str | bool, elementwise: bool, what: str,
                at: str, rows: Row) -> Row:
        """A dropout's value on ``rows``: the identity at p=0 or in eval, its probability (and, at p > 0, its mode)
        folded, so a change after apply raises; at p > 0 while training a refusal naming ``DRAWS_OPT_IN``. Under
        ``draws_on_owner`` an element-wise dropout with p > 0 is a draw made wherever the expert runs, in either
        mode (recorded at ``at``; neither folded). ``training``: the folded path the mode was read from (released
        where it decides nothing), or the mode itself."""
        mode = training if isinstance(training, bool) else self.folded.get(training) == "True"
        drawn = p != 0 and self.draws_on_owner and elementwise
        if isinstance(training, str) and (p == 0 or drawn):
            self.release(training)
        if drawn:
            self.draws[at] = f"{self.draws[at]} + {what}" if at in self.draws else what
            return VIEW if aliases(rows) else ROWS  # the identity in eval, a fresh tensor while training
        if p_path is not None:
            self.fold(p_path, p)  # a fact at p=0 too: raised after apply, the model's own loop would draw masks
        if p == 0 or not mode:
            return rows
        opt_in = (f"or set {DRAWS_OPT_IN} on its plan entry to draw its masks on each expert's owner (equal in "
                  "distribution to the model's, not bit-equal)") if elementwise else \
            f"{DRAWS_OPT_IN} takes element-wise dropout only (nn.Dropout, nn.AlphaDropout, F.dropout), not {what}"
        raise Refusal(f"{where} is dropout with p={p} while training: it {RANDOM}; exact only at p=0 or in eval (set "
                      f"it to 0, or opt out); {opt_in}")

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


Context = _Context  # for interpreters of other regions that share its calling of modules (``call_chain``)


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

