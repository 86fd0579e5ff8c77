"""Experts several wrappers down (issue 31): the matched block holds a wrapper that holds an MoE that holds the
experts (``self.ffn.moe.experts``), each level's forward calling the next. Proven from source, never run.

``descend(block, name, child)`` follows a child of the block whose forward the block reads: a child holding a module
container its forward reads is the MoE (its containers are returned, ``moe.experts``: the one-wrapper-down case the
replay proof reads as before); a child holding no such container but another user module it reads is a *wrapper
level*, followed down to any depth, each level proven a plain call chain (``prove_level``) before its containers
are taken (``ffn.moe.experts``, ``mlp.ffn.moe.experts``). The replay proof descends only where nothing nearer is
found (no container of the block, none one child down, no plain dict/list of experts), so a block whose experts
are nearer keeps its decision whatever its other children hold. An MoE below a wrapper level reading several
containers (routed ``experts`` beside ``shared_experts`` run on every row) has them told apart by role as a block
holding them would (``replay_proof.find_experts`` on the MoE): the routed ones are the experts, the shared ones stay
where the token is; experts spread over several modules each (aligned containers) are refused there for now.

A wrapper level is a plain call chain when its forward, read by the row-local interpreter (``autoep.detect.
row_local``; dropout draws accepted: a wrapper runs where the token is, as written), calls the next level

- once (one call in its source, outside any loop or comprehension, and one call when interpreted),
- on rows: each argument a row-local function of the wrapper's own per-row inputs (``self.moe(self.norm(x))``;
  ``self.moe(h - h.mean(0))`` mixes rows and is refused),
- and reads nothing else of it (``self.moe.experts[0].fc1.weight``: another rank's expert is a stand-in there),
- assigning only plain Python state of its own it never reads back (``self.calls += 1``, ``self.aux_loss = aux``;
  a submodule, parameter, buffer or property assigned changes what the model computes; a value read back is the
  previous call's at run time, not the one the proof sees, ``if self.calls > 1:``, in the forward or a method of
  the wrapper it calls),

and returns rows, or a tuple of them first and what else it keeps. What a call of the next level returns is read
from it: a wrapper's as proven, the MoE's from its ``return`` statements (every one a tuple of one length,
``return out, aux_loss``: rows first, the rest opaque values the wrapper may keep or return but never hand to the
experts, which it reaches only through its one call; else rows).

Why this suffices for exactness: the one-pass execution runs every level's forward as written where the token is
and moves only the experts' calls; what the chain proof adds is that the modules found at the
bottom are reached only through those calls, on the rows the levels above hand down. A level that cannot be read
this way (aux loss returned in place of the rows, a helper the interpreter does not follow, two candidates) is a
refusal naming it.
"""
from __future__ import annotations

import ast
import inspect

import torch.nn as nn

from autoep.detect import expert_roles, row_local
from autoep.detect.loop_context import plain_method, self_reads
from autoep.detect.loop_values import Opaque, Row
from autoep.detect.row_exprs import INPUT, ROWS, SelfModule, show
from autoep.detect.source import Refusal, function_tree

MAX_LEVELS = 8  # wrapper levels followed below the block


class Unfollowed(expert_roles.Misplaced):
    """Module containers found below a wrapper level that is not a plain call chain: the detector names the level
    rather than the fast paths' reason alone (as for experts found by role whose placement would be a guess)."""


def is_container(m) -> bool:
    """A non-empty ``ModuleList``/``ModuleDict`` whose entries are modules, not containers themselves."""
    return isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) > 0 and not any(
        isinstance(e, (nn.ModuleList, nn.ModuleDict)) for e in (m.values() if isinstance(m, nn.ModuleDict) else m))


def _user_module(m) -> bool:
    return isinstance(m, nn.Module) and not isinstance(m, (nn.ModuleList, nn.ModuleDict)) and \
        type(m).forward is not nn.Module.forward and not type(m).__module__.startswith("torch.")


def descend(block: nn.Module, name: str, child: nn.Module, find, depth: int = 0, deep: bool = True) -> list[str]:
    """The container paths under the block's child ``name`` (``child``) its forward reads (module docstring):
    ``name.sub`` where ``child`` holds them; else (``deep``), through the one user module ``child``'s forward reads
    (a wrapper level, proven by ``prove_level``), that module's. ``[]`` where none is found; ``Refusal`` where a
    level is not a plain call chain or two modules of one level lead to containers. ``find``: how the experts of an
    MoE reading several containers are told apart (``replay_proof.find_experts``, handed down by its caller: this
    module sits below it)."""
    return _descend(block, name, child, find, depth, deep)[0]


def _descend(block: nn.Module, name: str, child: nn.Module, find, depth: int,
             deep: bool) -> tuple[list[str], object]:
    """``descend``'s paths, and what ``child`` returns as its caller's interpreter sees it (``_returned``)."""
    try:
        forward = [plain_method(type(child), "forward", child)]
    except Refusal:
        return [], ROWS
    found = [f"{name}.{sub}" for sub, g in child._modules.items() if is_container(g) and _reads(forward, sub)]
    through_super(child, forward, found, f"{name}.")
    if len(found) > 1 and depth > 0:
        # An MoE below a wrapper level reading several containers (routed ``experts`` beside ``shared_experts``):
        # told apart by role on the MoE itself, as for a block holding them (``replay_proof.find_experts``).
        experts = find(child)
        if experts.members:
            raise Unfollowed(f"{type(child).__name__} ({name}) keeps each expert across several modules "
                             f"({experts.members[0]}); autoep follows wrapper levels down to experts of one "
                             "container only")
        return [f"{name}.{experts.path}"], _returned(child)
    if found or depth >= MAX_LEVELS or not deep:
        return found, _returned(child)
    below = {}
    for sub, g in child._modules.items():
        if _user_module(g) and _reads(forward, sub):
            deeper = _descend(child, sub, g, find, depth + 1, True)
            if deeper[0]:
                below[sub] = deeper
    if len(below) > 1:
        raise Unfollowed(f"{type(child).__name__} ({name}) holds module containers under several modules its forward "
                      f"calls ({sorted(below)}); which one holds the experts is ambiguous")
    if not below:
        return [], ROWS
    (sub, (deeper, inner_out)), = below.items()
    try:
        out = prove_level(child, sub, name, inner_out)
    except Refusal as exc:
        raise Unfollowed(str(exc)) from None
    return [f"{name}.{path}" for path in deeper], _as_called(out)


def _returned(moe: nn.Module) -> object:
    """What the MoE at the bottom of a chain returns, as the level calling it sees it: rows, or, where every
    ``return`` of its forward is a tuple of one length (``return out, aux_loss``), rows first and an ``Opaque``
    per other item (an auxiliary loss, router logits: the wrapper may keep or return them, never hand them to the
    experts, which it reaches only through this one call)."""
    tree = function_tree(plain_method(type(moe), "forward", moe))
    returns = [n.value for n in _own_nodes(tree) if isinstance(n, ast.Return)]
    sizes = {len(v.elts) if isinstance(v, ast.Tuple) else 0 for v in returns}
    if len(sizes) != 1 or 0 in sizes:
        return ROWS
    n, = sizes
    return (ROWS, *(Opaque(f"item {k} of what {type(moe).__name__}.forward returns") for k in range(1, n)))


def _own_nodes(tree: ast.AST):
    """The nodes of a function's body, not of functions defined inside it."""
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _as_called(out: object) -> object:
    """A proven level's output as the level above sees a call of it: fresh rows for rows, items alike."""
    if isinstance(out, Row):
        return ROWS
    if isinstance(out, tuple):
        return tuple(_as_called(v) for v in out)
    return out if isinstance(out, Opaque) else Opaque(show(out))


def through_super(module: nn.Module, fns, found: list[str], prefix: str = "") -> None:
    """``Refusal`` where a method ``fns`` holds calls ``super().<method>(...)`` and the parent's method reads a module
    container of ``module`` that ``found`` (paths, under ``prefix``) lacks: the experts' loop there is not followed,
    and the container read in the subclass alone (a shared list beside routed experts the parent loops over) would
    be taken for the experts."""
    cls = type(module)
    for fn in fns:
        owner = next((c for c in cls.__mro__ if any(v is fn for v in vars(c).values())), cls)
        mro = cls.__mro__[cls.__mro__.index(owner) + 1:]
        for node in ast.walk(function_tree(fn)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Call) and isinstance(node.func.value.func, ast.Name)
                    and node.func.value.func.id == "super"):
                continue
            parent = next((vars(c)[node.func.attr] for c in mro if node.func.attr in vars(c)), None)
            if parent is None or not callable(parent) or getattr(parent, "__module__", "").startswith("torch."):
                continue
            try:
                tree = function_tree(parent)
            except Refusal:
                continue
            hidden = [sub for sub, g in module._modules.items()
                      if is_container(g) and f"{prefix}{sub}" not in found and self_reads(tree, sub)]
            if hidden:
                raise Unfollowed(f"{cls.__name__}: super().{node.func.attr}(...) (line {node.lineno}) reads "
                                 f"self.{hidden[0]}, which autoep does not follow into a parent's method; call the "
                                 f"loop over self.{hidden[0]} in {cls.__name__}'s own forward (or opt out)")


def _reads(fns, attr: str) -> bool:
    return any(self_reads(function_tree(fn), attr) for fn in fns)


def prove_level(wrapper: nn.Module, inner: str, path: str, inner_out: object = ROWS) -> object:
    """``wrapper.forward`` calls ``self.<inner>`` once, on rows, reads nothing else of it, and returns rows (or a
    tuple whose first item is rows); the attributes it writes are plain Python state it never reads back (module
    docstring). Returns what it returns as interpreted; ``Refusal`` naming the construct otherwise. ``path``: the
    wrapper's path under the block; ``inner_out``: what a call of ``self.<inner>`` returns (``_returned``)."""
    cls = type(wrapper)
    what = f"{cls.__name__} ({path}, a wrapper around self.{inner})"
    tree = function_tree(plain_method(cls, "forward", wrapper))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _self_attr(n.func, inner)]
    if len(calls) != 1:
        raise Refusal(f"{what}: its forward calls self.{inner} {len(calls)} times in its source; autoep follows a "
                      "wrapper that calls the module it wraps once")
    for loop in ast.walk(tree):
        if isinstance(loop, (ast.For, ast.While, ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)) \
                and any(n is calls[0] for n in ast.walk(loop)):
            raise Refusal(f"{what}: its forward calls self.{inner} in a loop (line {calls[0].lineno}); autoep follows "
                          "a wrapper that calls the module it wraps once")
    written = _written_state(wrapper, tree, what)
    ctx = _Chain(what, wrapper, getattr(wrapper, inner), inner_out, written)
    try:
        out = ctx.call_module(wrapper, [INPUT] * row_local.row_arity(wrapper), {}, "", None)
    except Refusal as exc:
        raise Refusal(f"{what}: {exc}") from None
    if ctx.calls != 1:
        raise Refusal(f"{what}: its forward calls self.{inner} {ctx.calls} times; autoep follows a wrapper that calls "
                      "the module it wraps once")
    if not (isinstance(out, Row) or isinstance(out, tuple) and out and isinstance(out[0], Row)):
        raise Refusal(f"{what} does not return rows (it returns {show(out)}); autoep follows wrappers that return "
                      "what the module they wrap returns, per row (or a tuple of it first and what else they keep)")
    return out


def _written_state(wrapper: nn.Module, tree: ast.AST, what: str) -> set[str]:
    """The attributes of ``self`` the wrapper's forward assigns (``self.calls += 1``, ``self.aux = aux``): each
    must be plain Python state (not a submodule, parameter, buffer or a property of the class: assigning those
    changes what the model computes) and never read in the forward (a value read back is the one of the call
    before at run time, not the one seen at detection: ``if self.calls > 1:`` would decide a branch wrongly)."""
    stores = {n.attr: n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
              and isinstance(n.value, ast.Name) and n.value.id == "self"}
    trees = _called_methods(type(wrapper), tree) if stores else []
    for attr, node in stores.items():
        if attr in wrapper._modules or attr in wrapper._parameters or attr in wrapper._buffers \
                or isinstance(getattr(type(wrapper), attr, None), (property, nn.Module)):
            raise Refusal(f"{what}: its forward assigns self.{attr} (line {node.lineno}), a submodule, parameter, "
                          "buffer or property; a wrapper level may keep plain Python state only")
        reads = [n for t in trees for n in ast.walk(t) if isinstance(n, ast.Attribute) and n.attr == attr
                 and isinstance(n.ctx, ast.Load) and isinstance(n.value, ast.Name) and n.value.id == "self"]
        if reads:
            raise Refusal(f"{what}: its forward reads self.{attr} (line {reads[0].lineno}), which it also writes: at "
                          "run time that value is the previous call's, not the one seen at detection; keep state a "
                          "wrapper reads back out of its forward (or opt out)")
    return set(stores)


def _called_methods(cls: type, tree: ast.AST) -> list[ast.AST]:
    """``tree`` and the trees of the methods of ``cls`` it calls on ``self`` (``self.helper(h)``), transitively:
    where a value the forward writes could be read back during the call."""
    trees, seen, todo = [], set(), [tree]
    while todo:
        t = todo.pop()
        trees.append(t)
        for n in ast.walk(t):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) \
                    and n.func.value.id == "self" and n.func.attr not in seen:
                fn = getattr(cls, n.func.attr, None)
                if inspect.isfunction(fn) and not fn.__module__.startswith("torch."):
                    seen.add(n.func.attr)
                    try:
                        todo.append(function_tree(fn))
                    except Refusal:
                        continue  # a method not read here is refused by the interpreter if the forward calls it
    return trees


def _self_attr(expr: ast.AST, attr: str) -> bool:
    return isinstance(expr, ast.Attribute) and expr.attr == attr and isinstance(expr.value, ast.Name) \
        and expr.value.id == "self"


class _Chain(row_local.Context):
    """The row-local interpreter's context for one wrapper level: the wrapped module ``inner`` is opaque, a call of
    it on rows answers ``inner_out`` (counted), any other read of it is refused (``Interpreter`` asks ``opaque``);
    the wrapper's own ``written`` attributes may be assigned (``_written_state`` proved them plain state)."""

    def __init__(self, what: str, wrapper: nn.Module, inner: nn.Module, inner_out: object, written: set[str]):
        super().__init__(what, draws_on_owner=True)  # the wrapper's own draws are made where the token is
        self.wrapper, self.inner, self.inner_out, self.written, self.calls = wrapper, inner, inner_out, written, 0

    def opaque(self, module: nn.Module) -> bool:
        return module is self.inner

    def writes_attribute(self, interp, target) -> bool:
        base = interp.eval(target.value)
        return isinstance(base, SelfModule) and base.module is self.wrapper and target.attr in self.written

    def call_module(self, module: nn.Module, args: list, kwargs: dict, path: str, node) -> object:
        if module is not self.inner:
            return super().call_module(module, args, kwargs, path, node)
        self.calls += 1
        given = [*args, *kwargs.values()]
        bad = next((v for v in given if not isinstance(v, Row)), None)
        if bad is not None or not given:
            raise Refusal(f"{self.what}: self.{path or 'inner'} is called on {show(bad) if given else 'nothing'}, not "
                          "on rows of the wrapper's input")
        return self.inner_out
