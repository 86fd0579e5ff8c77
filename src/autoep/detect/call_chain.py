"""Experts several wrappers down (issue 31): the matched block holds a wrapper that holds an MoE that holds the
experts (``self.ffn.moe.experts``), each level's forward calling the next. Proven from source, never run.

``descend(block, name, child)`` follows a child of the block whose forward the block reads: a child holding a module
container its forward reads is the MoE (its containers are returned, ``moe.experts``: the one-wrapper-down case the
replay proof reads as before); a child holding no such container but another user module it reads is a *wrapper
level*, followed down to any depth, each level proven a plain call chain (``prove_level``) before its containers
are taken (``ffn.moe.experts``, ``mlp.ffn.moe.experts``). The replay proof descends only where nothing nearer is
found (no container of the block, none one child down, no plain dict/list of experts), so a block whose experts
are nearer keeps its decision whatever its other children hold.

A wrapper level is a plain call chain when its forward, read by the row-local interpreter (``autoep.detect.
row_local``; dropout draws accepted: a wrapper runs where the token is, as written), calls the next level

- once (one call in its source, outside any loop or comprehension, and one call when interpreted),
- on rows: each argument a row-local function of the wrapper's own per-row inputs (``self.moe(self.norm(x))``;
  ``self.moe(h - h.mean(0))`` mixes rows and is refused),
- and reads nothing else of it (``self.moe.experts[0].fc1.weight``: another rank's expert is a stand-in there),

and returns rows. Why this suffices for exactness: the one-pass execution runs every level's forward as written
where the token is and moves only the experts' calls; what the chain proof adds is that the modules found at the
bottom are reached only through those calls, on the rows the levels above hand down. A level that cannot be read
this way (a tuple returned, a helper the interpreter does not follow, two candidates) is a refusal naming it.
"""
from __future__ import annotations

import ast

import torch.nn as nn

from autoep.detect import expert_roles, row_local
from autoep.detect.loop_context import plain_method, self_reads
from autoep.detect.loop_values import Row
from autoep.detect.row_exprs import INPUT, ROWS, show
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


def descend(block: nn.Module, name: str, child: nn.Module, depth: int = 0, deep: bool = True) -> list[str]:
    """The container paths under the block's child ``name`` (``child``) its forward reads (module docstring):
    ``name.sub`` where ``child`` holds them; else (``deep``), through the one user module ``child``'s forward reads
    (a wrapper level, proven by ``prove_level``), that module's. ``[]`` where none is found; ``Refusal`` where a
    level is not a plain call chain or two modules of one level lead to containers."""
    try:
        forward = [plain_method(type(child), "forward", child)]
    except Refusal:
        return []
    found = [f"{name}.{sub}" for sub, g in child._modules.items() if is_container(g) and _reads(forward, sub)]
    if found or depth >= MAX_LEVELS or not deep:
        return found
    below = {}
    for sub, g in child._modules.items():
        if _user_module(g) and _reads(forward, sub):
            deeper = descend(child, sub, g, depth + 1)
            if deeper:
                below[sub] = deeper
    if len(below) > 1:
        raise Unfollowed(f"{type(child).__name__} ({name}) holds module containers under several modules its forward "
                      f"calls ({sorted(below)}); which one holds the experts is ambiguous")
    if not below:
        return []
    (sub, deeper), = below.items()
    try:
        prove_level(child, sub, name)
    except Refusal as exc:
        raise Unfollowed(str(exc)) from None
    return [f"{name}.{path}" for path in deeper]


def _reads(fns, attr: str) -> bool:
    return any(self_reads(function_tree(fn), attr) for fn in fns)


def prove_level(wrapper: nn.Module, inner: str, path: str) -> None:
    """``wrapper.forward`` calls ``self.<inner>`` once, on rows, reads nothing else of it, and returns rows
    (module docstring); ``Refusal`` naming the construct otherwise. ``path``: the wrapper's path under the block."""
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
    ctx = _Chain(what, getattr(wrapper, inner))
    try:
        out = ctx.call_module(wrapper, [INPUT] * row_local.row_arity(wrapper), {}, "", None)
    except Refusal as exc:
        raise Refusal(f"{what}: {exc}") from None
    if ctx.calls != 1:
        raise Refusal(f"{what}: its forward calls self.{inner} {ctx.calls} times; autoep follows a wrapper that calls "
                      "the module it wraps once")
    if not isinstance(out, Row):
        raise Refusal(f"{what} does not return rows (it returns {show(out)}); autoep follows wrappers that return "
                      "what the module they wrap returns, per row")


def _self_attr(expr: ast.AST, attr: str) -> bool:
    return isinstance(expr, ast.Attribute) and expr.attr == attr and isinstance(expr.value, ast.Name) \
        and expr.value.id == "self"


class _Chain(row_local.Context):
    """The row-local interpreter's context for one wrapper level: the wrapped module ``inner`` is opaque, a call of
    it on rows answers rows (counted), any other read of it is refused (``Interpreter`` asks ``opaque``)."""

    def __init__(self, what: str, inner: nn.Module):
        super().__init__(what, draws_on_owner=True)  # the wrapper's own draws are made where the token is
        self.inner, self.calls = inner, 0

    def opaque(self, module: nn.Module) -> bool:
        return module is self.inner

    def call_module(self, module: nn.Module, args: list, kwargs: dict, path: str, node) -> object:
        if module is not self.inner:
            return super().call_module(module, args, kwargs, path, node)
        self.calls += 1
        given = [*args, *kwargs.values()]
        bad = next((v for v in given if not isinstance(v, Row)), None)
        if bad is not None or not given:
            raise Refusal(f"{self.what}: self.{path or 'inner'} is called on {show(bad) if given else 'nothing'}, not "
                          "on rows of the wrapper's input")
        return ROWS
