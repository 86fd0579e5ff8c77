"""Proofs about experts: what a batched experts forward or a ModuleList expert computes.

Each proof returns the layout facts a recipe needs (as a dict of MoeStructure fields) or raises
``Refusal`` naming what could not be proven. Cached per class.
"""
from __future__ import annotations

import ast
import functools

import torch.nn as nn

from autoep.source import (
    Refusal, arg_names, bind, call_names, flatten_body, function_tree, inline, is_call_to,
    is_continue_guard, is_self_call, last_name, self_attr, self_attrs_read, straight_line_result, strip_casts,
)

# ---------------------------------------------------------------------------------------------
# Batched experts: prove the per-expert loop computes  w * down(gate_fn(gate_up(x)))  per (token, k)
# ---------------------------------------------------------------------------------------------

BATCHED_EXPERT_ATTRS = {"num_experts", "gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"}
BATCHED_EXPERT_ATTRS |= {"act_fn", "_apply_gate"}


def _expert_weight(expr: ast.AST, loop_var: str) -> str | None:
    """``self.P[<expression of the loop variable only>]`` -> ``P``."""
    if not (isinstance(expr, ast.Subscript) and (attr := self_attr(expr.value))):
        return None
    names = {n.id for n in ast.walk(expr.slice) if isinstance(n, ast.Name)}
    return attr if names == {loop_var} else None


def _match_proj(expr: ast.AST, loop_var: str) -> tuple[str, ast.AST, bool, str | None]:
    """One expert projection -> (weight name, input, transposed, bias name)."""
    bias = None
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        bias = _expert_weight(expr.right, loop_var)
        if bias is None:
            raise Refusal(f"expert projection adds {ast.unparse(expr.right)}, not a per-expert bias")
        expr = expr.left
    if is_call_to(expr, "linear") and len(expr.args) == 2 and not expr.keywords:
        weight = _expert_weight(expr.args[1], loop_var)
        if weight:
            return weight, expr.args[0], False, bias
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.MatMult):
        weight = _expert_weight(expr.right, loop_var)
        if weight:
            return weight, expr.left, True, bias
    raise Refusal(f"cannot read `{ast.unparse(expr)[:80]}` as x·W[e] (+ bias[e]) of one expert")


def _is_chunk_half(expr: ast.AST, index: int) -> ast.AST | None:
    """``X.chunk(2, dim=-1)[index]`` -> X."""
    if not (isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant) and expr.slice.value == index):
        return None
    call = expr.value
    if not (is_call_to(call, "chunk") and isinstance(call.func, ast.Attribute)):
        return None
    args = [ast.unparse(a) for a in call.args] + [ast.unparse(k) for k in call.keywords]
    return call.func.value if args in (["2", "dim=-1"], ["2", "-1"]) else None


def _match_glu(expr: ast.AST) -> ast.AST | None:
    """``act_fn(X.chunk(2,-1)[0]) * X.chunk(2,-1)[1]`` -> X."""
    if not (isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mult)):
        return None
    if not is_self_call(expr.left, "act_fn") or len(expr.left.args) != 1:
        return None
    gate_src, up_src = _is_chunk_half(expr.left.args[0], 0), _is_chunk_half(expr.right, 1)
    if gate_src is None or up_src is None or ast.dump(gate_src) != ast.dump(up_src):
        return None
    return gate_src


# Calls that act element by element (or on the last dim only): a gate built from them is row-local.
ELEMENTWISE_CALLS = {"clamp", "sigmoid", "silu", "gelu", "tanh", "relu", "act_fn", "float", "to", "type_as"}


def _row_local(expr: ast.AST, x: str) -> set[str]:
    """Prove ``expr`` computes each row of its output from the same row of ``x`` alone; return how ``x``
    is split into gate/up ("chunk" or "strided"). Raises Refusal on any other construct."""
    if isinstance(expr, ast.Constant) or self_attr(expr) or (
        isinstance(expr, ast.Attribute) and expr.attr == "dtype"
    ):
        return set()
    if _is_chunk_half(expr, 0) is not None or _is_chunk_half(expr, 1) is not None:
        src = _is_chunk_half(expr, 0) or _is_chunk_half(expr, 1)
        return {"chunk"} if isinstance(src, ast.Name) and src.id == x else _row_local_fail(expr)
    if isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Name) and expr.value.id == x:
        return {"strided"} if ast.unparse(expr.slice) in ("(..., ::2)", "(..., 1::2)") else _row_local_fail(expr)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        return _row_local(expr.left, x) | _row_local(expr.right, x)
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub):
        return _row_local(expr.operand, x)
    if isinstance(expr, ast.Call) and last_name(expr.func) in ELEMENTWISE_CALLS:
        parts = [expr.func.value] if isinstance(expr.func, ast.Attribute) and not self_attr(expr.func) else []
        parts = [p for p in parts if not (isinstance(p, ast.Name) and p.id in ("torch", "F", "nn"))]
        parts = [p for p in parts if not (isinstance(p, ast.Attribute) and last_name(p) in ("functional", "nn"))]
        parts += list(expr.args) + [k.value for k in expr.keywords]
        return set().union(*(_row_local(p, x) for p in parts)) if parts else set()
    return _row_local_fail(expr)


def _row_local_fail(expr: ast.AST) -> set[str]:
    raise Refusal(f"_apply_gate uses `{ast.unparse(expr)[:80]}`, which is not proven row-local")


@functools.lru_cache(maxsize=None)
def _apply_gate_facts(fn) -> tuple[str, str]:
    """Prove an experts ``_apply_gate`` is row-local (so running it on any subset of rows, as EP does,
    is exact) and name its layout and activation. The recipe then calls this very function."""
    tree = function_tree(fn)
    params = arg_names(tree)
    if len(params) != 2:
        raise Refusal("_apply_gate is not `(self, gate_up) -> return ...`")
    result = straight_line_result(tree, "_apply_gate")
    if _match_glu(result) is not None:
        return "concatenated", "glu"
    splits = _row_local(result, params[1])
    if len(splits) != 1:
        raise Refusal(f"_apply_gate computes `{ast.unparse(result)[:100]}`, not one gate/up split")
    layout = "concatenated" if splits == {"chunk"} else "interleaved"
    return layout, "clamped_glu" if "clamp" in call_names(result) else "own_gate"


def _batched_forward_facts(cls: type) -> dict:
    """Facts proven from the experts class's forward; cached per class."""
    return _batched_forward_facts_cached(cls.forward, cls)


@functools.lru_cache(maxsize=None)
def _batched_forward_facts_cached(forward, cls: type) -> dict:
    tree = function_tree(forward)
    params = arg_names(tree)
    if len(params) != 4:
        raise Refusal(f"{cls.__name__}.forward takes {params[1:]}, not (hidden_states, top_k_index, top_k_weights)")
    _, hidden, index, weights = params
    unknown = self_attrs_read(tree) - BATCHED_EXPERT_ATTRS
    if unknown:
        raise Refusal(f"{cls.__name__}.forward also uses {sorted(unknown)}, which no recipe reproduces")
    body = flatten_body(tree.body)
    loops = [s for s in body if isinstance(s, ast.For)]
    if len(loops) != 1 or not isinstance(loops[0].target, ast.Name):
        raise Refusal(f"{cls.__name__}.forward is not one loop over experts")
    loop = loops[0]
    env: dict[str, ast.AST] = {}
    for stmt in body[: body.index(loop)]:
        if isinstance(stmt, (ast.Assign, ast.AugAssign)):
            bind(stmt, env)
        elif not is_continue_guard(stmt) and not isinstance(stmt, ast.If):
            raise Refusal(f"{cls.__name__}.forward line {stmt.lineno} before the loop cannot be followed")
    acc_adds = []
    for stmt in loop.body:
        if isinstance(stmt, (ast.Assign, ast.AugAssign)):
            bind(stmt, env)
        elif isinstance(stmt, ast.Expr) and is_call_to(stmt.value, "index_add_"):
            acc_adds.append(stmt.value)
        elif not is_continue_guard(stmt):
            raise Refusal(f"{cls.__name__}.forward loop line {stmt.lineno} cannot be followed")
    if len(acc_adds) != 1 or len(acc_adds[0].args) != 3:
        raise Refusal(f"{cls.__name__}.forward does not accumulate with exactly one index_add_")
    add = acc_adds[0]
    token_idx = inline(add.args[1], env)
    contribution = strip_casts(inline(add.args[2], env))
    facts = _match_contribution(cls, contribution, token_idx, hidden, index, weights, loop.target.id)
    ret = [s for s in body if isinstance(s, ast.Return)]
    if len(ret) != 1 or not isinstance(strip_casts(ret[0].value), ast.Name):
        raise Refusal(f"{cls.__name__}.forward does not return its accumulator")
    if ret[0].value is not None and strip_casts(ret[0].value).id != last_name(add.func.value):
        raise Refusal(f"{cls.__name__}.forward returns something other than its accumulator")
    return facts


def _match_contribution(cls, contribution, token_idx, hidden, index, weights, loop_var) -> dict:
    if not (isinstance(contribution, ast.BinOp) and isinstance(contribution.op, ast.Mult)):
        raise Refusal(f"{cls.__name__}: expert output is not scaled by the routing weight after the experts")
    out, weight = contribution.left, contribution.right
    # The routing weight of this (token, k): weights[token_idx, top_k_pos, None], positions from
    # torch.where(one_hot(top_k_index).permute(2, 1, 0)[e]).
    if not (isinstance(weight, ast.Subscript) and isinstance(weight.value, ast.Name) and weight.value.id == weights):
        raise Refusal(f"{cls.__name__}: routing weight `{ast.unparse(weight)[:60]}` is not top_k_weights[token, k]")
    where = _where_of_mask(cls, token_idx, index)
    expected = ast.Tuple(elts=[token_idx, ast.Subscript(value=where, slice=ast.Constant(0)), ast.Constant(None)])
    if ast.unparse(weight.slice) != ast.unparse(expected):
        raise Refusal(f"{cls.__name__}: routing weight is indexed as [{ast.unparse(weight.slice)[:60]}]")
    down, gated, down_t, down_b = _match_proj(out, loop_var)
    if down != "down_proj":
        raise Refusal(f"{cls.__name__}: the last projection uses `{down}`, not down_proj")
    layout, activation = "concatenated", "glu"
    if is_self_call(gated, "_apply_gate") and len(gated.args) == 1:
        layout, activation = _apply_gate_facts(cls._apply_gate)
        up_expr = gated.args[0]
    else:
        up_expr = _match_glu(gated)
        if up_expr is None:
            raise Refusal(f"{cls.__name__}: `{ast.unparse(gated)[:80]}` is not act_fn(gate) * up")
    up, x, up_t, up_b = _match_proj(up_expr, loop_var)
    if up != "gate_up_proj":
        raise Refusal(f"{cls.__name__}: the first projection uses `{up}`, not gate_up_proj")
    if ast.unparse(x) != f"{hidden}[{ast.unparse(token_idx)}]":
        raise Refusal(f"{cls.__name__}: experts read `{ast.unparse(x)[:60]}`, not the routed tokens of hidden_states")
    if up_t != down_t:
        raise Refusal(f"{cls.__name__}: gate_up and down projections use different weight layouts")
    if (up_b is None) != (down_b is None) or (up_b and (up_b, down_b) != ("gate_up_proj_bias", "down_proj_bias")):
        raise Refusal(f"{cls.__name__}: biases {up_b}, {down_b} are not gate_up_proj_bias and down_proj_bias")
    return dict(
        expert_bias=up_b is not None, expert_transposed=up_t, gate_up_layout=layout, activation=activation
    )


def _where_of_mask(cls, token_idx: ast.AST, index: str) -> ast.AST:
    """``torch.where(one_hot(top_k_index, ...).permute(2, 1, 0)[e])[1]`` -> the where call."""
    if not (isinstance(token_idx, ast.Subscript) and isinstance(token_idx.slice, ast.Constant)):
        raise Refusal(f"{cls.__name__}: token positions `{ast.unparse(token_idx)[:60]}` are not from torch.where")
    where = token_idx.value
    ok = token_idx.slice.value == 1 and is_call_to(where, "where") and len(where.args) == 1
    mask = where.args[0].value if ok and isinstance(where.args[0], ast.Subscript) else None
    ok = ok and is_call_to(mask, "permute") and [ast.unparse(a) for a in mask.args] == ["2", "1", "0"]
    one_hot = mask.func.value if ok else None
    ok = ok and is_call_to(one_hot, "one_hot") and ast.unparse(one_hot.args[0]) == index
    if not ok:
        raise Refusal(f"{cls.__name__}: token positions are not torch.where(one_hot(top_k_index).permute(2, 1, 0)[e])")
    return where


def batched_experts_facts(experts: nn.Module) -> dict:
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == down.dim() == 3):
        raise Refusal(f"experts {type(experts).__name__} has no 3-D nn.Parameters gate_up_proj and down_proj")
    facts = _batched_forward_facts(type(experts))
    allowed = {"gate_up_proj", "down_proj"} | ({"gate_up_proj_bias", "down_proj_bias"} if facts["expert_bias"] else set())
    extra = sorted({n for n, _ in experts.named_parameters()} - allowed)
    if extra:
        raise Refusal(f"experts {type(experts).__name__} hold parameters {extra} its forward does not use")
    E, a, b = gate_up.shape
    d_shape = tuple(down.shape)
    # (E, 2F, D) and (E, D, F); transposed: (E, D, 2F) and (E, F, D).
    ok = d_shape == ((E, b // 2, a) if facts["expert_transposed"] else (E, b, a // 2))
    two_f = b if facts["expert_transposed"] else a
    if not ok or two_f % 2:
        raise Refusal(f"experts {type(experts).__name__} weight shapes {tuple(gate_up.shape)}, {d_shape} do not agree")
    return facts


# ---------------------------------------------------------------------------------------------
# ModuleList experts: prove  down(act(gate(x)) * up(x))  from the expert's forward
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _swiglu_expert_proof(forward, cls_name: str) -> tuple[str, str, str, str]:
    """-> (gate, up, down, act) attribute names / activation, or refuse."""
    tree = function_tree(forward)
    params = arg_names(tree)
    if len(params) != 2:
        raise Refusal(f"expert {cls_name}.forward takes {params[1:]}, not one input")
    expr = straight_line_result(tree, f"expert {cls_name}.forward")
    x = params[1]

    def proj(node) -> str | None:
        ok = isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords
        ok = ok and isinstance(node.args[0], ast.Name) and node.args[0].id == x
        return self_attr(node.func) if ok else None

    down = self_attr(expr.func) if isinstance(expr, ast.Call) and len(expr.args) == 1 else None
    inner = expr.args[0] if down else None
    if not (down and isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Mult)):
        raise Refusal(f"expert {cls_name}.forward returns `{ast.unparse(expr)[:80]}`, not down(act(gate(x)) * up(x))")
    act_call, up_call = inner.left, inner.right
    act = None
    if isinstance(act_call, ast.Call) and len(act_call.args) == 1 and not act_call.keywords:
        if self_attr(act_call.func) == "act_fn":
            act = "act_fn"
        elif last_name(act_call.func) == "silu" and self_attr(act_call.func) is None:
            act = "silu"
    gate = proj(act_call.args[0]) if act else None
    up = proj(up_call)
    if not (act and gate and up and len({gate, up, down}) == 3):
        raise Refusal(f"expert {cls_name}.forward returns `{ast.unparse(expr)[:80]}`, not down(act(gate(x)) * up(x))")
    return gate, up, down, act


def module_list_facts(experts: nn.ModuleList) -> dict:
    if len(experts) == 0:
        raise Refusal("experts ModuleList is empty")
    classes = {type(e) for e in experts}
    if len(classes) != 1:
        raise Refusal(f"experts mix classes {sorted(c.__name__ for c in classes)}")
    cls = classes.pop()
    gate, up, down, act = _swiglu_expert_proof(cls.forward, cls.__name__)
    first = experts[0]
    for name in (gate, up, down):
        lin = getattr(first, name)
        if type(lin) is not nn.Linear or lin.bias is not None:
            raise Refusal(f"expert {cls.__name__}.{name} is not a bias-free nn.Linear")
    extra = sorted({n for n, _ in first.named_parameters()} - {f"{p}.weight" for p in (gate, up, down)})
    if extra:
        raise Refusal(f"expert {cls.__name__} holds parameters {extra} its forward does not use")
    return dict(expert_projs=f"{gate},{up},{down}", expert_act=act)


