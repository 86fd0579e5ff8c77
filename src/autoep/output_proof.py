"""Proof that a v4-style block's forward returns exactly what the whole-block recipe returns:

    out = reshape( sum_k w[t, k] * expert_{e(t,k)}(x[t])  (+ the shared branch) )

followed through the block's own helper methods. Anything else applied to the routed output, to one
expert's contribution or to the accumulator (a scale, a norm, a clamp, an in-place update) is refused:
the recipe would silently compute something different.
"""
from __future__ import annotations

import ast

from autoep.source import Refusal, flatten_body, inline, is_call_to, self_attr

SHAPE_ONLY = {"reshape", "view", "to", "type", "contiguous", "squeeze", "unsqueeze"}


def _strip_shape(expr: ast.AST) -> ast.AST:
    """Drop layout and dtype changes (``.reshape``/``.view``/``.to``/...) around an expression."""
    while isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr in SHAPE_ONLY:
        expr = expr.func.value
    return expr


class _Body:
    """One function's top-level statements, for flow-sensitive lookups of a name's last value."""

    def __init__(self, tree: ast.FunctionDef):
        self.tree = tree
        self.stmts = flatten_body(tree.body)

    def last_value(self, name: str, before: int) -> tuple[ast.AST | None, int]:
        """The value of the last top-level ``name = ...`` before statement ``before`` (and its index)."""
        for i in range(before - 1, -1, -1):
            stmt = self.stmts[i]
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
                return stmt.value, i
            if isinstance(stmt, (ast.AugAssign, ast.AnnAssign)) and getattr(stmt.target, "id", None) == name:
                raise Refusal(f"{self.tree.name} updates `{name}` in place (line {stmt.lineno})")
            if not isinstance(stmt, ast.Assign) and any(
                isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in ast.walk(stmt)
            ):
                if isinstance(stmt, ast.If) and not _is_shape_guard(stmt):
                    raise Refusal(f"{self.tree.name} assigns `{name}` conditionally (line {stmt.lineno})")
        return None, -1


def _is_shape_guard(stmt: ast.If) -> bool:
    """The jitter guard (``if self.training and self.jitter_noise > 0``) is reproduced by the recipe."""
    return "jitter_noise" in ast.unparse(stmt.test)


def prove_block_output(cls: type, trees: list[ast.FunctionDef]) -> None:
    """Raise ``Refusal`` unless ``cls.forward`` (``trees[0]``) returns the routed sum (+ shared), reshaped."""
    methods = {t.name: t for t in trees}
    body = _Body(trees[0])
    for i, stmt in enumerate(body.stmts):
        if isinstance(stmt, ast.Return):
            value = stmt.value.elts[0] if isinstance(stmt.value, ast.Tuple) else stmt.value
            _output(cls, methods, body, value, i)


def _output(cls, methods: dict, body: _Body, expr: ast.AST, pos: int, shared_seen: bool = False) -> None:
    expr = _strip_shape(expr)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add) and not shared_seen:
        for routed, shared in ((expr.left, expr.right), (expr.right, expr.left)):
            if _is_shared(body, shared, pos):
                return _output(cls, methods, body, routed, pos, shared_seen=True)
        raise Refusal(f"{cls.__name__} adds `{ast.unparse(expr)[:80]}` to its routed output, not the shared branch")
    if isinstance(expr, ast.Name):
        value, at = body.last_value(expr.id, pos)
        if value is None:
            raise Refusal(f"{cls.__name__}.{body.tree.name} returns `{expr.id}`, which cannot be followed")
        if _is_zeros(value):
            return _accumulator(cls, body, expr.id)
        return _output(cls, methods, body, value, at, shared_seen)
    if isinstance(expr, ast.Call) and self_attr(expr.func) in methods:
        helper = _Body(methods[self_attr(expr.func)])
        for i, stmt in enumerate(helper.stmts):
            if isinstance(stmt, ast.Return):
                _output(cls, methods, helper, stmt.value, i, shared_seen)
        return None
    raise Refusal(f"{cls.__name__} returns `{ast.unparse(expr)[:80]}`, not the sum of its routed experts")


def _is_zeros(expr: ast.AST) -> bool:
    return is_call_to(expr, "zeros") or is_call_to(expr, "zeros_like")


def _is_shared(body: _Body, expr: ast.AST, pos: int) -> bool:
    """``shared_experts(x)`` or ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (names followed)."""
    expr = _resolve(body, expr, pos)
    if isinstance(expr, ast.Call) and self_attr(expr.func) == "shared_experts":
        return True
    if not (isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mult)):
        return False
    for gate, branch in ((expr.left, expr.right), (expr.right, expr.left)):
        gated = is_call_to(gate, "sigmoid") and len(gate.args) == 1 and isinstance(gate.args[0], ast.Call)
        if gated and self_attr(gate.args[0].func) == "shared_expert_gate" and isinstance(branch, ast.Call) \
                and self_attr(branch.func) == "shared_expert":
            return True
    return False


def _resolve(body: _Body, expr: ast.AST, pos: int, depth: int = 0) -> ast.AST:
    """``expr`` with each name replaced by its last top-level value before ``pos``, recursively."""
    if depth > 20:
        raise Refusal(f"{body.tree.name}: the shared branch cannot be followed")
    env = {}
    for node in ast.walk(expr):
        if isinstance(node, ast.Name) and node.id not in env:
            value, at = body.last_value(node.id, pos)
            if value is not None and not _is_zeros(value):
                env[node.id] = _resolve(body, value, at, depth + 1)
    return inline(expr, env)


def _loop_env(stmts: list[ast.stmt], env: dict[str, ast.AST]) -> dict[str, ast.AST]:
    """Assignments of a loop body in source order, ``if`` blocks opened (no ``else`` is followed)."""
    for stmt in stmts:
        if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets):
            env.update({t.id: inline(stmt.value, env) for t in stmt.targets})
        elif isinstance(stmt, ast.If):
            _loop_env(stmt.body, env)
    return env


def _accumulator(cls, body: _Body, name: str) -> None:
    """Every update of the accumulator is ``index_add_(0, tokens, expert(x[tokens]) * w[tokens, k])``."""
    adds = 0
    for node in ast.walk(body.tree):
        if isinstance(node, ast.AugAssign) and getattr(node.target, "id", None) == name:
            raise Refusal(f"{cls.__name__} updates its expert accumulator in place (line {node.lineno})")
        call = node if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
        if call is None or not (isinstance(call.func.value, ast.Name) and call.func.value.id == name):
            continue
        if call.func.attr != "index_add_":
            if call.func.attr.endswith("_"):
                raise Refusal(f"{cls.__name__} changes its expert accumulator with {call.func.attr} (line {call.lineno})")
            continue
        _contribution(cls, body, call)
        adds += 1
    if adds == 0:
        raise Refusal(f"{cls.__name__} returns `{name}` but never adds expert outputs into it")


def _contribution(cls, body: _Body, call: ast.Call) -> None:
    loop = next((s for s in ast.walk(body.tree) if isinstance(s, ast.For) and call in list(ast.walk(s))), None)
    if loop is None or len(call.args) != 3:
        raise Refusal(f"{cls.__name__} adds expert outputs outside a loop over experts (line {call.lineno})")
    value = _strip_shape(inline(call.args[2], _loop_env(loop.body, {})))
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult)):
        raise Refusal(f"{cls.__name__} adds `{ast.unparse(value)[:80]}`, not expert(x) * routing weight")
    for expert, weight in ((value.left, value.right), (value.right, value.left)):
        if _is_expert_call(expert, loop) and isinstance(_strip_shape(weight), ast.Subscript):
            return
    raise Refusal(f"{cls.__name__} adds `{ast.unparse(value)[:80]}`, not expert(x) * routing weight")


def _is_expert_call(expr: ast.AST, loop: ast.For) -> bool:
    """A call of one element of ``self.experts`` (indexed, or the loop's ``enumerate(self.experts)`` item)."""
    if not (isinstance(expr, ast.Call) and len(expr.args) == 1):
        return False
    fn = expr.func
    if isinstance(fn, ast.Subscript) and self_attr(fn.value) == "experts":
        return True
    iterated = ast.unparse(loop.iter)
    target = loop.target.elts[-1] if isinstance(loop.target, ast.Tuple) else loop.target
    return isinstance(fn, ast.Name) and isinstance(target, ast.Name) and fn.id == target.id and (
        iterated in ("self.experts", "enumerate(self.experts)"))

