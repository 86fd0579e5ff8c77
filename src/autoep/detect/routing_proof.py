"""The routing vocabulary: router kind and shared branch, read from data flow.

These facts are recorded in the decision for people (and the plan table); no recipe depends on
them. The block's own routing code always runs (autoep moves only the expert work), so a router is
never re-implemented and a fact recorded here cannot make a result wrong.

- a bare ``nn.Linear`` gate (exact type): ``softmax_topk`` if top-k reads a softmax of the gate's
  output, ``sigmoid_group`` if it reads a sigmoid of it (followed through the block's forward and the
  helper methods it calls);
- any other gate/router module: ``topk_router_module`` if its forward returns the index half of a
  ``topk`` among its returned items, else classified by the block's data flow as above;
- ``other`` for routing none of these names (a hash router, a sparse mixer, no router submodule).
"""
from __future__ import annotations

import ast
import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoep.detect.names import NOT_FACTS, Scope, instance_attr
from autoep.detect.source import Refusal, cached_by_code, function_tree

SHARED_ATTRS = ("shared_expert", "shared_expert_gate", "shared_experts")
_SCORES = {F.softmax: "softmax", torch.softmax: "softmax", F.sigmoid: "sigmoid", torch.sigmoid: "sigmoid"}
_TOPK = {torch.topk}


def _find_router(module: nn.Module) -> tuple[str, nn.Module]:
    for name in ("gate", "router"):
        sub = getattr(module, name, None)
        if isinstance(sub, nn.Module):
            return name, sub
    raise Refusal("no `gate` or `router` submodule to route tokens")


def router_kind(module: nn.Module) -> str:
    """The router's kind, named honestly: ``topk_router_module`` if the gate/router module returns top-k
    indices; else ``softmax_topk``/``sigmoid_group`` if the block's top-k reads a softmax/sigmoid of its
    output; else ``other`` (the block routes some other way). Never a reason to refuse: routing runs as
    the block writes it."""
    try:
        name, gate = _find_router(module)
    except Refusal:
        return "other"
    if type(gate) is not nn.Linear:  # exact type: a Linear subclass may override forward
        try:
            _router_module_proof(type(gate).forward, type(gate).__name__)
            return "topk_router_module"
        except Refusal:
            pass
    try:
        return _bare_gate_kind(type(module), name)
    except Refusal:
        return "other"


@cached_by_code
def _router_module_proof(forward, cls_name: str) -> None:
    tree = function_tree(forward)
    scope = Scope(forward)
    topk_results = _flow(tree, scope, lambda call: "topk" if _is_topk(call, scope) else None)
    returns = [n for n in ast.walk(tree) if isinstance(n, ast.Return)]

    def index_half(expr) -> bool:
        if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant) and expr.slice.value == 1:
            return _is_topk(expr.value, scope)
        return isinstance(expr, ast.Name) and topk_results.get(expr.id) == "topk_index"

    ok = bool(returns) and all(
        isinstance(r.value, ast.Tuple) and any(index_half(e) for e in r.value.elts) for r in returns
    )
    if not ok:
        raise Refusal(f"router {cls_name}.forward does not return the indices of a topk")


def _is_topk(call, scope: Scope) -> bool:
    if not isinstance(call, ast.Call):
        return False
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr == "topk":
        try:
            return scope.resolve(func) in _TOPK
        except Refusal:
            return True  # ``tensor.topk(...)``: a method of a local tensor
    try:
        return scope.resolve(func) in _TOPK
    except Refusal:
        return False


def _topk_input(call: ast.Call, scope: Scope) -> ast.AST | None:
    """What a top-k call ranks: ``x.topk(k)`` -> x; ``torch.topk(x, k)`` / ``torch.topk(input=x, ...)`` -> x."""
    if not _is_topk(call, scope):
        return None
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr == "topk":
        try:
            scope.resolve(func)
        except Refusal:
            return func.value  # a method of a local tensor
    if call.args:
        return call.args[0]
    return next((k.value for k in call.keywords if k.arg == "input"), None)


def _flow(tree: ast.FunctionDef, scope: Scope, mark) -> dict[str, str]:
    """``{name: tag}`` for names assigned from a ``topk`` (tuple targets: the index half is tagged)."""
    tags: dict[str, str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        value = node.value
        if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant) and value.slice.value == 1 \
                and mark(value.value) is not None:
            tags.update({t.id: "topk_index" for t in node.targets if isinstance(t, ast.Name)})
            continue
        if mark(value) is None:
            continue
        for target in node.targets:
            if isinstance(target, ast.Tuple) and len(target.elts) == 2 and isinstance(target.elts[1], ast.Name):
                tags[target.elts[1].id] = "topk_index"
    return tags


def _bare_gate_kind(cls: type, gate_name: str) -> str:
    """Which score function the top-k of the gate's output reads, followed by name through the block."""
    fns = _block_functions(cls)
    derived: dict[str, set[str]] = {}  # name -> tags: "gate", "softmax", "sigmoid"
    kinds: set[str] = set()
    for _ in range(3):  # helper parameters learn their tags from call sites; a few passes suffice
        for fn, tree in fns:
            scope = Scope(fn)
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign):
                    tags = _tags(node.value, derived, scope, gate_name)
                    for t in node.targets:
                        for n in ast.walk(t):
                            if isinstance(n, ast.Name):
                                derived.setdefault(n.id, set()).update(tags)
                if isinstance(node, ast.Call):
                    _helper_args(node, derived, fns, scope, gate_name)
                    source = _topk_input(node, scope)
                    if source is not None:
                        kinds |= _tags(source, derived, scope, gate_name) & {"softmax", "sigmoid"}
    if len(kinds) != 1:
        raise Refusal(f"{cls.__name__}: cannot tell from data flow whether top-k reads a softmax or a sigmoid "
                      f"of the gate's output (found {sorted(kinds) or 'neither'})")
    return "softmax_topk" if kinds == {"softmax"} else "sigmoid_group"


def _tags(expr: ast.AST, derived: dict, scope: Scope, gate_name: str) -> set[str]:
    tags: set[str] = set()
    for node in ast.walk(expr):
        if isinstance(node, ast.Name):
            tags |= derived.get(node.id, set())
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" and f.attr == gate_name:
                tags.add("gate")
            kind = _score_kind(node, scope)
            inner = set().union(*(_tags(a, derived, scope, gate_name) for a in node.args)) if node.args else set()
            if isinstance(f, ast.Attribute):
                inner |= _tags(f.value, derived, scope, gate_name)
            if kind and "gate" in inner:
                tags.add(kind)
    return tags


def _score_kind(call: ast.Call, scope: Scope) -> str | None:
    func = call.func
    try:
        kind = _SCORES.get(scope.resolve(func))
    except (Refusal, TypeError):
        kind = None
    if kind is None and isinstance(func, ast.Attribute) and func.attr in ("softmax", "sigmoid"):
        try:
            scope.resolve(func)
        except Refusal:
            kind = func.attr  # a method of a local tensor
    return kind


def _helper_args(call: ast.Call, derived: dict, fns, scope: Scope, gate_name: str) -> None:
    func = call.func
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"):
        return
    for _fn, tree in fns:
        if tree.name == func.attr:
            params = [a.arg for a in tree.args.args[1:]]
            for p, a in zip(params, call.args):
                derived.setdefault(p, set()).update(_tags(a, derived, scope, gate_name))


def _block_functions(cls: type) -> list[tuple[object, ast.FunctionDef]]:
    """The block's forward and every method of its own that the forward calls as ``self.name(...)``."""
    out = [(cls.forward, function_tree(cls.forward))]
    seen = {"forward"}
    for _fn, tree in out:
        for call in ast.walk(tree):
            f = getattr(call, "func", None)
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
                method = getattr(cls, f.attr, None)
                if f.attr not in seen and inspect.isfunction(method):
                    seen.add(f.attr)
                    out.append((method, function_tree(method)))
    return out


def shared_kind(module: nn.Module) -> str:
    found = tuple(a for a in SHARED_ATTRS if getattr(module, a, None) is not None)
    kinds = {(): "none", ("shared_expert", "shared_expert_gate"): "gated", ("shared_experts",): "additive",
             ("shared_expert",): "additive"}
    if found not in kinds:
        raise Refusal(f"ambiguous shared branch: found attributes {list(found)}")
    return kinds[found]


def experts_call(module: nn.Module, attr: str = "experts") -> tuple[str, ...]:
    """The block calls ``self.<attr>`` (its experts, found by data flow) exactly once, always (a rank that
    skipped the call would hang its peers in the exchange), and touches it no other way (its weights are
    sharded under EP). A call under ``if self.<flag>:`` is always reached where the flag is the constant
    ``True`` on this instance; returns those flags as ``MoeStructure.folded`` entries (``<flag>=True``)."""
    from autoep.detect.wrappers import check_decorators, peel_forward

    cls = type(module)
    if "forward" in vars(module):
        raise Refusal(f"{cls.__name__} has an instance-level forward")
    if cls.__call__ is not nn.Module.__call__:
        raise Refusal(f"{cls.__name__} overrides __call__")
    # The block's forward runs as written; its source must show the one experts call. transformers' layer
    # wrappers (activation checkpointing, kwarg deprecation) are looked through where their code is the one
    # autoep knows (``autoep.detect.wrappers``); any other wrapper or decorator is refused. Under activation
    # checkpointing the forward runs again in backward: ``autoep.runtime.checkpointing`` checks that at each call.
    peeled = peel_forward(cls)
    check_decorators(peeled, f"{cls.__name__}.forward")
    guards = _experts_call_source(peeled.forward, cls.__name__, attr)
    folded = []
    for name in guards:  # ``if self.<name>:`` around the call: folded on this instance, watched per call
        if name in NOT_FACTS:
            raise Refusal(f"{cls.__name__}.forward: the experts call runs under `if self.{name}:`, a mode that "
                          f"changes by design (train/eval), not a constant autoep can fold and watch")
        value = instance_attr(module, name, f"{cls.__name__}.forward")
        if value is not True:
            raise Refusal(f"{cls.__name__}.forward: the experts call runs under `if self.{name}:`, and "
                          f"self.{name} is {value!r}, not the constant True; a rank may skip it and hang its peers")
        folded.append(f"{name}=True")
    return tuple(folded)



@cached_by_code
def _experts_call_source(forward, cls_name: str, attr: str = "experts") -> tuple[str, ...]:
    """The source half of ``experts_call``: cached per forward function (a patched class is re-proven).
    Returns the attribute names of the ``if self.<name>:`` statements around the call."""
    from autoep.detect.loop_context import always_reached, self_reads

    tree = function_tree(forward)
    reads = self_reads(tree, attr)
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and c.func in reads]
    if len(reads) != 1 or len(calls) != 1:
        raise Refusal(f"{cls_name}.forward uses self.{attr} {len(reads)} times, {len(calls)} of them calls; "
                      "the experts contract is one call")
    guards: list[str] = []
    always_reached(tree, calls[0], "the experts call", guards)
    return tuple(guards)
