"""Recognise what kind of MoE block a module is by reading its source, never by running it.

``detect_moe_structure(module)`` returns a ``MoeStructure`` or raises ``UnsupportedModuleStructure``.
Rules: never call a forward, never allocate, never read a model's or class's name; refuse rather
than guess. Source parsing and proofs are cached per class.
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import asdict, dataclass

import torch.nn as nn

from autoep.errors import UnsupportedModuleStructure

DETECTOR_VERSION = "1"

ROUTER_KINDS = ("softmax_topk", "sigmoid_group", "topk_router_module")
SHARED_KINDS = ("none", "gated", "additive")
STORAGE_KINDS = ("module_list", "batched_parameters")


@dataclass(frozen=True)
class MoeStructure:
    """What a recipe needs to know about an MoE block, every field proven from source and attributes."""

    router: str  # softmax_topk | sigmoid_group | topk_router_module
    shared_experts: str  # none | gated | additive
    expert_storage: str  # module_list | batched_parameters
    jitter: bool  # the block has ``jitter_noise`` (multiplicative input noise in training)
    # Expert layout facts (batched_parameters; module_list experts are stacked to the default layout).
    expert_bias: bool = False  # gate_up_proj_bias / down_proj_bias are added
    expert_transposed: bool = False  # weights stored (E, in, out) and applied as x @ w
    gate_up_layout: str = "concatenated"  # concatenated [gate | up] | interleaved [g0, u0, g1, u1, ...]
    # glu: act_fn(gate) * up | clamped_glu: a clamped gate (GPT-OSS) | own_gate: another row-local gate;
    # for clamped_glu and own_gate the recipe calls the experts' own proven-row-local ``_apply_gate``.
    activation: str = "glu"
    # Routing facts for whole-block recipes (module_list). "router" when a router module computes them.
    topk_norm: str = "router"  # router | always | never | norm_topk_prob
    returns_router_logits: bool = False  # the block's forward returns (hidden, router_logits)
    # module_list experts: attribute names of the gate, up and down projections (comma-separated,
    # e.g. "gate_proj,up_proj,down_proj" or "w1,w3,w2"), and how the gate is activated:
    # "act_fn" = the expert's own ``act_fn`` module, "silu" = F.silu written in the expert's forward.
    expert_projs: str = ""
    expert_act: str = ""

    def as_dict(self) -> dict:
        return asdict(self)



class _Refusal(Exception):
    """A proof failed; carries the reason. Turned into UnsupportedModuleStructure at the API edge."""


# ---------------------------------------------------------------------------------------------
# Source access (cached per function object, i.e. per class that defines it)
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _function_tree(fn) -> ast.FunctionDef:
    """The AST of ``fn``'s own source (decorator wrappers such as transformers' experts interface are unwrapped)."""
    fn = inspect.unwrap(fn)
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise _Refusal(f"the source of {getattr(fn, '__qualname__', fn)} is not available ({exc})") from None
    tree = ast.parse(src).body[0]
    if not isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise _Refusal(f"{getattr(fn, '__qualname__', fn)} is not a plain function")
    return tree


def forward_tree(cls: type) -> ast.FunctionDef:
    return _function_tree(cls.forward)


def _last_name(node: ast.AST) -> str:
    """``torch.nn.functional.linear`` -> ``linear``; ``self.act_fn`` -> ``act_fn``; else ''."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _self_attr(node: ast.AST) -> str | None:
    """``self.x`` -> ``x``; anything else -> None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _self_attrs_read(tree: ast.AST) -> set[str]:
    return {a for n in ast.walk(tree) if (a := _self_attr(n))}


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def _call_names(tree: ast.AST) -> set[str]:
    return {_last_name(c.func) for c in _calls(tree)}


def _params(tree: ast.FunctionDef) -> list[str]:
    return [a.arg for a in tree.args.args]


# ---------------------------------------------------------------------------------------------
# Symbolic inlining: a straight-line body becomes one expression per name
# ---------------------------------------------------------------------------------------------


class _Inliner(ast.NodeTransformer):
    def __init__(self, env: dict[str, ast.AST]):
        self.env = env

    def visit_Name(self, node):
        return self.env.get(node.id, node)


def _inline(expr: ast.AST, env: dict[str, ast.AST]) -> ast.AST:
    import copy

    return _Inliner(env).visit(copy.deepcopy(expr))


def _bind(stmt: ast.Assign | ast.AugAssign, env: dict[str, ast.AST]) -> None:
    """Record what each assigned name holds, as an expression over the function's inputs."""
    if isinstance(stmt, ast.AugAssign):
        if not isinstance(stmt.target, ast.Name):
            raise _Refusal(f"line {stmt.lineno}: in-place update of a non-name")
        value = ast.BinOp(left=ast.Name(id=stmt.target.id, ctx=ast.Load()), op=stmt.op, right=stmt.value)
        env[stmt.target.id] = _inline(value, env)
        return
    value = _inline(stmt.value, env)
    for target in stmt.targets:
        if isinstance(target, ast.Name):
            env[target.id] = value
        elif isinstance(target, ast.Tuple) and all(isinstance(e, ast.Name) for e in target.elts):
            literal = isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts)
            for i, elt in enumerate(target.elts):
                env[elt.id] = value.elts[i] if literal else ast.Subscript(value=value, slice=ast.Constant(i), ctx=ast.Load())
        else:
            raise _Refusal(f"line {stmt.lineno}: assignment to {ast.unparse(target)} cannot be followed")


def _is_call_to(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and _last_name(node.func) == name


def _is_self_call(node: ast.AST, attr: str) -> bool:
    return isinstance(node, ast.Call) and _self_attr(node.func) == attr


# ---------------------------------------------------------------------------------------------
# Router
# ---------------------------------------------------------------------------------------------

SIGMOID_MARKERS = ("routed_scaling_factor", "n_group", "topk_group")
TOP_K_NAMES = ("top_k", "num_experts_per_tok")


def _find_router(module: nn.Module) -> tuple[str, nn.Module]:
    for name in ("gate", "router"):
        sub = getattr(module, name, None)
        if isinstance(sub, nn.Module):
            return name, sub
    raise _Refusal("no `gate` or `router` submodule to route tokens")


def _explicit(module: nn.Module, names: tuple[str, ...]) -> dict[str, object]:
    """The attributes in ``names`` set on the module itself or on its ``config`` (module wins)."""
    found = {}
    config = getattr(module, "config", None)
    for name in names:
        if name in vars(module) or hasattr(type(module), name) and not callable(getattr(type(module), name)):
            found[name] = getattr(module, name)
        elif config is not None and getattr(config, name, None) is not None:
            found[name] = getattr(config, name)
    return found


def _returns_topk_indices(tree: ast.FunctionDef) -> bool:
    """Every ``return`` is a 3-tuple whose last item is the index half of a ``topk`` result."""
    env: dict[str, list[ast.AST]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    env.setdefault(target.id, []).append(node.value)
                elif isinstance(target, ast.Tuple):
                    for i, elt in enumerate(target.elts):
                        if isinstance(elt, ast.Name):
                            env.setdefault(elt.id, []).append(
                                ast.Subscript(value=node.value, slice=ast.Constant(i), ctx=ast.Load())
                            )
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            env.setdefault(node.target.id, []).append(node)  # never a topk index

    def is_topk_index(expr: ast.AST) -> bool:
        if isinstance(expr, ast.Name):
            bound = env.get(expr.id, [])
            return bool(bound) and all(is_topk_index(v) for v in bound)
        return (
            isinstance(expr, ast.Subscript)
            and _is_call_to(expr.value, "topk")
            and isinstance(expr.slice, ast.Constant)
            and expr.slice.value == 1
        )

    returns = [n for n in ast.walk(tree) if isinstance(n, ast.Return)]
    return bool(returns) and all(
        isinstance(r.value, ast.Tuple) and len(r.value.elts) == 3 and is_topk_index(r.value.elts[-1]) for r in returns
    )


@functools.lru_cache(maxsize=None)
def _router_module_proof(router_cls: type) -> None:
    tree = forward_tree(router_cls)
    names = _call_names(tree)
    missing = [n for n in ("linear", "topk") if n not in names]
    if missing:
        raise _Refusal(f"router {router_cls.__name__}.forward does not call {' and '.join(missing)}")
    if not _returns_topk_indices(tree):
        raise _Refusal(
            f"router {router_cls.__name__}.forward does not return (logits, scores, indices) "
            "with indices taken from a topk call"
        )


def _router_kind(module: nn.Module) -> str:
    _, gate = _find_router(module)
    if type(gate) is nn.Linear:  # exact type: a subclass may override forward
        if not _explicit(module, TOP_K_NAMES):
            raise _Refusal(
                "bare nn.Linear gate but no explicit `top_k` or `num_experts_per_tok` on the module or its config"
            )
        return "sigmoid_group" if _explicit(module, SIGMOID_MARKERS) else "softmax_topk"
    _router_module_proof(type(gate))
    return "topk_router_module"


def _refuse(module: nn.Module, exc: _Refusal) -> UnsupportedModuleStructure:
    return UnsupportedModuleStructure(type(module).__name__, str(exc))


def detect_router_kind(module: nn.Module) -> str:
    """``softmax_topk`` | ``sigmoid_group`` | ``topk_router_module``, proven from source; never calls the gate."""
    try:
        return _router_kind(module)
    except _Refusal as exc:
        raise _refuse(module, exc) from None


# ---------------------------------------------------------------------------------------------
# Batched experts: prove the per-expert loop computes  w * down(gate_fn(gate_up(x)))  per (token, k)
# ---------------------------------------------------------------------------------------------

BATCHED_EXPERT_ATTRS = {"num_experts", "gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"}
BATCHED_EXPERT_ATTRS |= {"act_fn", "_apply_gate"}


def _flatten(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements in order, ``with`` blocks (e.g. ``torch.no_grad()``) opened in place."""
    out = []
    for stmt in body:
        if isinstance(stmt, ast.With):
            out.extend(_flatten(stmt.body))
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # docstring
        else:
            out.append(stmt)
    return out


def _is_continue_guard(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.If) and not stmt.orelse and all(isinstance(s, ast.Continue) for s in stmt.body)


def _strip_casts(expr: ast.AST) -> ast.AST:
    while isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "to":
        expr = expr.func.value
    return expr


def _expert_weight(expr: ast.AST, loop_var: str) -> str | None:
    """``self.P[<expression of the loop variable only>]`` -> ``P``."""
    if not (isinstance(expr, ast.Subscript) and (attr := _self_attr(expr.value))):
        return None
    names = {n.id for n in ast.walk(expr.slice) if isinstance(n, ast.Name)}
    return attr if names == {loop_var} else None


def _match_proj(expr: ast.AST, loop_var: str) -> tuple[str, ast.AST, bool, str | None]:
    """One expert projection -> (weight name, input, transposed, bias name)."""
    bias = None
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        bias = _expert_weight(expr.right, loop_var)
        if bias is None:
            raise _Refusal(f"expert projection adds {ast.unparse(expr.right)}, not a per-expert bias")
        expr = expr.left
    if _is_call_to(expr, "linear") and len(expr.args) == 2 and not expr.keywords:
        weight = _expert_weight(expr.args[1], loop_var)
        if weight:
            return weight, expr.args[0], False, bias
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.MatMult):
        weight = _expert_weight(expr.right, loop_var)
        if weight:
            return weight, expr.left, True, bias
    raise _Refusal(f"cannot read `{ast.unparse(expr)[:80]}` as x·W[e] (+ bias[e]) of one expert")


def _is_chunk_half(expr: ast.AST, index: int) -> ast.AST | None:
    """``X.chunk(2, dim=-1)[index]`` -> X."""
    if not (isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant) and expr.slice.value == index):
        return None
    call = expr.value
    if not (_is_call_to(call, "chunk") and isinstance(call.func, ast.Attribute)):
        return None
    args = [ast.unparse(a) for a in call.args] + [ast.unparse(k) for k in call.keywords]
    return call.func.value if args in (["2", "dim=-1"], ["2", "-1"]) else None


def _match_glu(expr: ast.AST) -> ast.AST | None:
    """``act_fn(X.chunk(2,-1)[0]) * X.chunk(2,-1)[1]`` -> X."""
    if not (isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mult)):
        return None
    if not _is_self_call(expr.left, "act_fn") or len(expr.left.args) != 1:
        return None
    gate_src, up_src = _is_chunk_half(expr.left.args[0], 0), _is_chunk_half(expr.right, 1)
    if gate_src is None or up_src is None or ast.dump(gate_src) != ast.dump(up_src):
        return None
    return gate_src


# Calls that act element by element (or on the last dim only): a gate built from them is row-local.
ELEMENTWISE_CALLS = {"clamp", "sigmoid", "silu", "gelu", "tanh", "relu", "act_fn", "float", "to", "type_as"}


def _row_local(expr: ast.AST, x: str) -> set[str]:
    """Prove ``expr`` computes each row of its output from the same row of ``x`` alone; return how ``x``
    is split into gate/up ("chunk" or "strided"). Raises _Refusal on any other construct."""
    if isinstance(expr, ast.Constant) or _self_attr(expr) or (
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
    if isinstance(expr, ast.Call) and _last_name(expr.func) in ELEMENTWISE_CALLS:
        parts = [expr.func.value] if isinstance(expr.func, ast.Attribute) and not _self_attr(expr.func) else []
        parts = [p for p in parts if not (isinstance(p, ast.Name) and p.id in ("torch", "F", "nn"))]
        parts = [p for p in parts if not (isinstance(p, ast.Attribute) and _last_name(p) in ("functional", "nn"))]
        parts += list(expr.args) + [k.value for k in expr.keywords]
        return set().union(*(_row_local(p, x) for p in parts)) if parts else set()
    return _row_local_fail(expr)


def _row_local_fail(expr: ast.AST) -> set[str]:
    raise _Refusal(f"_apply_gate uses `{ast.unparse(expr)[:80]}`, which is not proven row-local")


@functools.lru_cache(maxsize=None)
def _apply_gate_facts(fn) -> tuple[str, str]:
    """Prove an experts ``_apply_gate`` is row-local (so running it on any subset of rows, as EP does,
    is exact) and name its layout and activation. The recipe then calls this very function."""
    tree = _function_tree(fn)
    params = _params(tree)
    body = _flatten(tree.body)
    env: dict[str, ast.AST] = {}
    for stmt in body[:-1]:
        if not isinstance(stmt, (ast.Assign, ast.AugAssign)):
            raise _Refusal(f"_apply_gate line {stmt.lineno} is not an assignment")
        _bind(stmt, env)
    if len(params) != 2 or not body or not isinstance(body[-1], ast.Return):
        raise _Refusal("_apply_gate is not `(self, gate_up) -> return ...`")
    result = _inline(body[-1].value, env)
    if _match_glu(result) is not None:
        return "concatenated", "glu"
    splits = _row_local(result, params[1])
    if len(splits) != 1:
        raise _Refusal(f"_apply_gate computes `{ast.unparse(result)[:100]}`, not one gate/up split")
    layout = "concatenated" if splits == {"chunk"} else "interleaved"
    return layout, "clamped_glu" if "clamp" in _call_names(result) else "own_gate"


def _batched_forward_facts(cls: type) -> dict:
    """Facts proven from the experts class's forward; cached per class."""
    return _batched_forward_facts_cached(cls.forward, cls)


@functools.lru_cache(maxsize=None)
def _batched_forward_facts_cached(forward, cls: type) -> dict:
    tree = _function_tree(forward)
    params = _params(tree)
    if len(params) != 4:
        raise _Refusal(f"{cls.__name__}.forward takes {params[1:]}, not (hidden_states, top_k_index, top_k_weights)")
    _, hidden, index, weights = params
    unknown = _self_attrs_read(tree) - BATCHED_EXPERT_ATTRS
    if unknown:
        raise _Refusal(f"{cls.__name__}.forward also uses {sorted(unknown)}, which no recipe reproduces")
    body = _flatten(tree.body)
    loops = [s for s in body if isinstance(s, ast.For)]
    if len(loops) != 1 or not isinstance(loops[0].target, ast.Name):
        raise _Refusal(f"{cls.__name__}.forward is not one loop over experts")
    loop = loops[0]
    env: dict[str, ast.AST] = {}
    for stmt in body[: body.index(loop)]:
        if isinstance(stmt, (ast.Assign, ast.AugAssign)):
            _bind(stmt, env)
        elif not _is_continue_guard(stmt) and not isinstance(stmt, ast.If):
            raise _Refusal(f"{cls.__name__}.forward line {stmt.lineno} before the loop cannot be followed")
    acc_adds = []
    for stmt in loop.body:
        if isinstance(stmt, (ast.Assign, ast.AugAssign)):
            _bind(stmt, env)
        elif isinstance(stmt, ast.Expr) and _is_call_to(stmt.value, "index_add_"):
            acc_adds.append(stmt.value)
        elif not _is_continue_guard(stmt):
            raise _Refusal(f"{cls.__name__}.forward loop line {stmt.lineno} cannot be followed")
    if len(acc_adds) != 1 or len(acc_adds[0].args) != 3:
        raise _Refusal(f"{cls.__name__}.forward does not accumulate with exactly one index_add_")
    add = acc_adds[0]
    token_idx = _inline(add.args[1], env)
    contribution = _strip_casts(_inline(add.args[2], env))
    facts = _match_contribution(cls, contribution, token_idx, hidden, index, weights, loop.target.id)
    ret = [s for s in body if isinstance(s, ast.Return)]
    if len(ret) != 1 or not isinstance(_strip_casts(ret[0].value), ast.Name):
        raise _Refusal(f"{cls.__name__}.forward does not return its accumulator")
    if ret[0].value is not None and _strip_casts(ret[0].value).id != _last_name(add.func.value):
        raise _Refusal(f"{cls.__name__}.forward returns something other than its accumulator")
    return facts


def _match_contribution(cls, contribution, token_idx, hidden, index, weights, loop_var) -> dict:
    if not (isinstance(contribution, ast.BinOp) and isinstance(contribution.op, ast.Mult)):
        raise _Refusal(f"{cls.__name__}: expert output is not scaled by the routing weight after the experts")
    out, weight = contribution.left, contribution.right
    # The routing weight of this (token, k): weights[token_idx, top_k_pos, None], positions from
    # torch.where(one_hot(top_k_index).permute(2, 1, 0)[e]).
    if not (isinstance(weight, ast.Subscript) and isinstance(weight.value, ast.Name) and weight.value.id == weights):
        raise _Refusal(f"{cls.__name__}: routing weight `{ast.unparse(weight)[:60]}` is not top_k_weights[token, k]")
    where = _where_of_mask(cls, token_idx, index)
    expected = ast.Tuple(elts=[token_idx, ast.Subscript(value=where, slice=ast.Constant(0)), ast.Constant(None)])
    if ast.unparse(weight.slice) != ast.unparse(expected):
        raise _Refusal(f"{cls.__name__}: routing weight is indexed as [{ast.unparse(weight.slice)[:60]}]")
    down, gated, down_t, down_b = _match_proj(out, loop_var)
    if down != "down_proj":
        raise _Refusal(f"{cls.__name__}: the last projection uses `{down}`, not down_proj")
    layout, activation = "concatenated", "glu"
    if _is_self_call(gated, "_apply_gate") and len(gated.args) == 1:
        layout, activation = _apply_gate_facts(cls._apply_gate)
        up_expr = gated.args[0]
    else:
        up_expr = _match_glu(gated)
        if up_expr is None:
            raise _Refusal(f"{cls.__name__}: `{ast.unparse(gated)[:80]}` is not act_fn(gate) * up")
    up, x, up_t, up_b = _match_proj(up_expr, loop_var)
    if up != "gate_up_proj":
        raise _Refusal(f"{cls.__name__}: the first projection uses `{up}`, not gate_up_proj")
    if ast.unparse(x) != f"{hidden}[{ast.unparse(token_idx)}]":
        raise _Refusal(f"{cls.__name__}: experts read `{ast.unparse(x)[:60]}`, not the routed tokens of hidden_states")
    if up_t != down_t:
        raise _Refusal(f"{cls.__name__}: gate_up and down projections use different weight layouts")
    if (up_b is None) != (down_b is None) or (up_b and (up_b, down_b) != ("gate_up_proj_bias", "down_proj_bias")):
        raise _Refusal(f"{cls.__name__}: biases {up_b}, {down_b} are not gate_up_proj_bias and down_proj_bias")
    return dict(
        expert_bias=up_b is not None, expert_transposed=up_t, gate_up_layout=layout, activation=activation
    )


def _where_of_mask(cls, token_idx: ast.AST, index: str) -> ast.AST:
    """``torch.where(one_hot(top_k_index, ...).permute(2, 1, 0)[e])[1]`` -> the where call."""
    if not (isinstance(token_idx, ast.Subscript) and isinstance(token_idx.slice, ast.Constant)):
        raise _Refusal(f"{cls.__name__}: token positions `{ast.unparse(token_idx)[:60]}` are not from torch.where")
    where = token_idx.value
    ok = token_idx.slice.value == 1 and _is_call_to(where, "where") and len(where.args) == 1
    mask = where.args[0].value if ok and isinstance(where.args[0], ast.Subscript) else None
    ok = ok and _is_call_to(mask, "permute") and [ast.unparse(a) for a in mask.args] == ["2", "1", "0"]
    one_hot = mask.func.value if ok else None
    ok = ok and _is_call_to(one_hot, "one_hot") and ast.unparse(one_hot.args[0]) == index
    if not ok:
        raise _Refusal(f"{cls.__name__}: token positions are not torch.where(one_hot(top_k_index).permute(2, 1, 0)[e])")
    return where


def _batched_experts_facts(experts: nn.Module) -> dict:
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == down.dim() == 3):
        raise _Refusal(f"experts {type(experts).__name__} has no 3-D nn.Parameters gate_up_proj and down_proj")
    facts = _batched_forward_facts(type(experts))
    allowed = {"gate_up_proj", "down_proj"} | ({"gate_up_proj_bias", "down_proj_bias"} if facts["expert_bias"] else set())
    extra = sorted({n for n, _ in experts.named_parameters()} - allowed)
    if extra:
        raise _Refusal(f"experts {type(experts).__name__} hold parameters {extra} its forward does not use")
    E, a, b = gate_up.shape
    d_shape = tuple(down.shape)
    # (E, 2F, D) and (E, D, F); transposed: (E, D, 2F) and (E, F, D).
    ok = d_shape == ((E, b // 2, a) if facts["expert_transposed"] else (E, b, a // 2))
    two_f = b if facts["expert_transposed"] else a
    if not ok or two_f % 2:
        raise _Refusal(f"experts {type(experts).__name__} weight shapes {tuple(gate_up.shape)}, {d_shape} do not agree")
    return facts


# ---------------------------------------------------------------------------------------------
# ModuleList experts: prove  down(act(gate(x)) * up(x))  from the expert's forward
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _swiglu_expert_proof(forward, cls_name: str) -> tuple[str, str, str, str]:
    """-> (gate, up, down, act) attribute names / activation, or refuse."""
    tree = _function_tree(forward)
    params = _params(tree)
    if len(params) != 2:
        raise _Refusal(f"expert {cls_name}.forward takes {params[1:]}, not one input")
    body = _flatten(tree.body)
    env: dict[str, ast.AST] = {}
    for stmt in body[:-1]:
        if not isinstance(stmt, (ast.Assign, ast.AugAssign)):
            raise _Refusal(f"expert {cls_name}.forward line {stmt.lineno} cannot be followed")
        _bind(stmt, env)
    if not isinstance(body[-1], ast.Return):
        raise _Refusal(f"expert {cls_name}.forward does not end in a return")
    expr = _inline(body[-1].value, env)
    x = params[1]

    def proj(node) -> str | None:
        ok = isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords
        ok = ok and isinstance(node.args[0], ast.Name) and node.args[0].id == x
        return _self_attr(node.func) if ok else None

    down = _self_attr(expr.func) if isinstance(expr, ast.Call) and len(expr.args) == 1 else None
    inner = expr.args[0] if down else None
    if not (down and isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Mult)):
        raise _Refusal(f"expert {cls_name}.forward returns `{ast.unparse(expr)[:80]}`, not down(act(gate(x)) * up(x))")
    act_call, up_call = inner.left, inner.right
    act = None
    if isinstance(act_call, ast.Call) and len(act_call.args) == 1 and not act_call.keywords:
        if _self_attr(act_call.func) == "act_fn":
            act = "act_fn"
        elif _last_name(act_call.func) == "silu" and _self_attr(act_call.func) is None:
            act = "silu"
    gate = proj(act_call.args[0]) if act else None
    up = proj(up_call)
    if not (act and gate and up and len({gate, up, down}) == 3):
        raise _Refusal(f"expert {cls_name}.forward returns `{ast.unparse(expr)[:80]}`, not down(act(gate(x)) * up(x))")
    return gate, up, down, act


def _module_list_facts(experts: nn.ModuleList) -> dict:
    if len(experts) == 0:
        raise _Refusal("experts ModuleList is empty")
    classes = {type(e) for e in experts}
    if len(classes) != 1:
        raise _Refusal(f"experts mix classes {sorted(c.__name__ for c in classes)}")
    cls = classes.pop()
    gate, up, down, act = _swiglu_expert_proof(cls.forward, cls.__name__)
    first = experts[0]
    for name in (gate, up, down):
        lin = getattr(first, name)
        if type(lin) is not nn.Linear or lin.bias is not None:
            raise _Refusal(f"expert {cls.__name__}.{name} is not a bias-free nn.Linear")
    extra = sorted({n for n, _ in first.named_parameters()} - {f"{p}.weight" for p in (gate, up, down)})
    if extra:
        raise _Refusal(f"expert {cls.__name__} holds parameters {extra} its forward does not use")
    return dict(expert_projs=f"{gate},{up},{down}", expert_act=act)


# ---------------------------------------------------------------------------------------------
# Shared branch and the block's own forward
# ---------------------------------------------------------------------------------------------

SHARED_ATTRS = ("shared_expert", "shared_expert_gate", "shared_experts")


def _shared_kind(module: nn.Module) -> str:
    found = tuple(a for a in SHARED_ATTRS if getattr(module, a, None) is not None)
    kinds = {(): "none", ("shared_expert", "shared_expert_gate"): "gated", ("shared_experts",): "additive"}
    if found not in kinds:
        raise _Refusal(f"ambiguous shared branch: found attributes {list(found)}")
    return kinds[found]


def _experts_only_called(tree: ast.FunctionDef, cls_name: str) -> None:
    """The block touches ``self.experts`` only by calling it (the experts contract), so it can be replaced."""
    calls = {id(c.func) for c in _calls(tree)}
    for node in ast.walk(tree):
        if _self_attr(node) == "experts" and id(node) not in calls:
            raise _Refusal(f"{cls_name}.forward uses self.experts other than by calling it (line {node.lineno})")
    if not any(_is_self_call(c, "experts") for c in _calls(tree)):
        raise _Refusal(f"{cls_name}.forward never calls self.experts")


BLOCK_ATTRS = {"gate", "experts", "top_k", "num_experts", "num_experts_per_tok", "num_local_experts", "n_routed_experts"}
BLOCK_ATTRS |= {"config"}
BLOCK_ATTRS |= {"norm_topk_prob", "jitter_noise", "training", "hidden_dim", "ffn_dim", "hidden_size"}
BLOCK_ATTRS |= {"routed_scaling_factor", "n_group", "topk_group", "e_score_correction_bias"}
BLOCK_ATTRS |= set(SHARED_ATTRS)


def _divides_by_sum(node: ast.BinOp | ast.AugAssign, assigned: dict[str, list[ast.AST]]) -> bool:
    """``w / w.sum(...)`` or ``w /= denominator`` where ``denominator`` was assigned from a sum."""
    right = node.right if isinstance(node, ast.BinOp) else node.value
    exprs = [right] + [v for n in ast.walk(right) if isinstance(n, ast.Name) for v in assigned.get(n.id, [])]
    return isinstance(node.op, ast.Div) and any(_is_call_to(c, "sum") for e in exprs for c in ast.walk(e))


def _topk_norm(tree: ast.FunctionDef) -> str:
    conditional = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "norm_topk_prob" in ast.unparse(node.test):
            conditional |= {id(n) for s in node.body for n in ast.walk(s)}
    assigned: dict[str, list[ast.AST]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)
    norms = [
        n for n in ast.walk(tree) if isinstance(n, (ast.BinOp, ast.AugAssign)) and _divides_by_sum(n, assigned)
    ]
    if not norms:
        return "never"
    if all(id(n) in conditional for n in norms):
        return "norm_topk_prob"
    if not any(id(n) in conditional for n in norms):
        return "always"
    raise _Refusal("top-k weights are normalised both conditionally and unconditionally")


def _block_trees(cls: type) -> list[ast.FunctionDef]:
    """The block's forward plus every method of its own that the forward calls as ``self.name(...)``."""
    trees, seen = [forward_tree(cls)], {"forward"}
    for tree in trees:
        for call in _calls(tree):
            name = _self_attr(call.func)
            if name and name not in seen and inspect.isfunction(getattr(cls, name, None)):
                seen.add(name)
                trees.append(_function_tree(getattr(cls, name)))
    return trees


@functools.lru_cache(maxsize=None)
def _routing_facts(cls: type, router: str) -> dict:
    """Whole-block recipes re-run the block's routing: prove it is the one they reproduce."""
    trees = _block_trees(cls)
    methods = {t.name for t in trees}
    unknown = set().union(*(_self_attrs_read(t) for t in trees)) - BLOCK_ATTRS - methods
    if unknown:
        raise _Refusal(f"{cls.__name__}.forward also uses {sorted(unknown)}, which the block recipe does not reproduce")
    score_fn = "softmax" if router == "softmax_topk" else "sigmoid"
    names = set().union(*(_call_names(t) for t in trees))
    if score_fn not in names or "topk" not in names:
        raise _Refusal(f"{cls.__name__}.forward does not take {score_fn} of the gate logits and then topk")
    for tree in trees:  # within one function, the scores come before the top-k
        first = {}
        for call in sorted(_calls(tree), key=lambda c: (c.lineno, c.col_offset)):
            first.setdefault(_last_name(call.func), call.lineno)
        if score_fn in first and "topk" in first and first[score_fn] > first["topk"]:
            raise _Refusal(f"{cls.__name__}.{tree.name} takes topk before {score_fn}")
    if router == "sigmoid_group":
        _sigmoid_group_reads(cls, trees)
    _routing_constants(cls, trees, router)
    _gate_input_not_cast(cls, trees)
    returns = [r.value for r in ast.walk(trees[0]) if isinstance(r, ast.Return)]
    pairs = {isinstance(v, ast.Tuple) and len(v.elts) == 2 for v in returns}
    if len(pairs) != 1:
        raise _Refusal(f"{cls.__name__}.forward returns both tuples and tensors")
    norms = {_topk_norm(t) for t in trees} - {"never"}
    if len(norms) > 1:
        raise _Refusal(f"{cls.__name__} normalises top-k weights in more than one way")
    return dict(topk_norm=norms.pop() if norms else "never", returns_router_logits=pairs.pop())


CASTS = {"float", "to", "type", "half", "bfloat16", "double"}


def _assignments(trees: list[ast.FunctionDef]) -> dict[str, list[ast.AST]]:
    out: dict[str, list[ast.AST]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        out.setdefault(target.id, []).append(node.value)
    return out


def _gate_input_not_cast(cls: type, trees: list[ast.FunctionDef]) -> None:
    """The recipe feeds the gate the block's hidden states as they are; a cast before it is not reproduced."""
    assigned = _assignments(trees)
    for tree in trees:
        for call in _calls(tree):
            if _self_attr(call.func) != "gate":
                continue
            for arg in call.args:
                seen = [arg] + (assigned.get(arg.id, []) if isinstance(arg, ast.Name) else [])
                if any(isinstance(v, ast.Call) and _last_name(v.func) in CASTS for v in seen):
                    raise _Refusal(f"{cls.__name__} casts the hidden states before its gate, which the recipe does not")


def _routing_constants(cls: type, trees: list[ast.FunctionDef], router: str) -> None:
    """The constants the recipe hard-codes: sigmoid_group masks dropped groups with 0.0, scores groups by
    their top-2 sum and normalises with +1e-20; softmax_topk normalises with no epsilon."""
    text = "\n".join(ast.unparse(t) for t in trees)
    if router == "sigmoid_group":
        fills = [c for t in trees for c in _calls(t) if _last_name(c.func) == "masked_fill"]
        values = {ast.unparse(c.args[1]) if len(c.args) > 1 else "?" for c in fills}
        if values != {"0.0"}:
            raise _Refusal(f"{cls.__name__} masks dropped expert groups with {sorted(values)}; the recipe fills 0.0")
        if ".topk(2, dim=-1)[0].sum(dim=-1)" not in text:
            raise _Refusal(f"{cls.__name__} does not score expert groups by their top-2 sum")
    expected = {1e-20} if router == "sigmoid_group" else set()
    assigned = _assignments(trees)
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.BinOp, ast.AugAssign)) and _divides_by_sum(node, assigned):
                right = node.right if isinstance(node, ast.BinOp) else node.value
                exprs = [right] + [v for n in ast.walk(right) if isinstance(n, ast.Name) for v in assigned.get(n.id, [])]
                eps = {c.value for e in exprs for c in ast.walk(e) if isinstance(c, ast.Constant)
                       and isinstance(c.value, float)}
                if eps != expected:
                    raise _Refusal(f"{cls.__name__} normalises its top-k weights with epsilon {sorted(eps) or 'none'}; "
                                   f"the {router} recipe uses {sorted(expected) or 'none'}")


def _sigmoid_group_reads(cls: type, trees: list[ast.FunctionDef]) -> None:
    """Group-limited routing must read every group/bias/scale attribute it is configured with."""
    text = "\n".join(ast.unparse(t) for t in trees)
    for name in ("n_group", "topk_group", "routed_scaling_factor", "e_score_correction_bias"):
        if name not in text:
            raise _Refusal(f"{cls.__name__} is group-routed but its forward never reads `{name}`")


# ---------------------------------------------------------------------------------------------
# The public detector
# ---------------------------------------------------------------------------------------------


def _structure(module: nn.Module) -> MoeStructure:
    cls = type(module)
    router = _router_kind(module)
    shared = _shared_kind(module)
    experts = getattr(module, "experts", None)
    if isinstance(experts, nn.ModuleList):
        storage = "module_list"
        facts = _module_list_facts(experts)
        if router == "topk_router_module":
            raise _Refusal("a router module with ModuleList experts has no recipe (routing lives in the block)")
        facts |= _routing_facts(cls, router)
        if shared == "gated" and "sigmoid" not in _call_names(forward_tree(cls)):
            raise _Refusal(f"{cls.__name__}.forward does not gate the shared expert with a sigmoid")
    elif isinstance(experts, nn.Module):
        storage = "batched_parameters"
        facts = _batched_experts_facts(experts)
        _experts_only_called(forward_tree(cls), cls.__name__)
    else:
        raise _Refusal("no `experts` submodule")
    structure = MoeStructure(
        router=router, shared_experts=shared, expert_storage=storage, jitter=hasattr(module, "jitter_noise"), **facts
    )
    from autoep.archetypes import TABLE  # the table imports this module

    if (router, storage) not in TABLE:
        raise _Refusal(f"no recipe for router={router} with expert_storage={storage}")
    return structure


def detect_moe_structure(module: nn.Module) -> MoeStructure:
    """What kind of MoE block ``module`` is, proven from its source and attributes.

    Never calls a forward and allocates nothing (works on ``torch.device("meta")`` modules).
    Raises ``UnsupportedModuleStructure`` naming the class, the failed proof and the opt-out hint.
    """
    try:
        return _structure(module)
    except _Refusal as exc:
        raise _refuse(module, exc) from None


def count_experts(module: nn.Module) -> int:
    """Number of routed experts of an MoE block (from the experts' shapes; reads no data)."""
    experts = getattr(module, "experts", None)
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    p = getattr(experts, "gate_up_proj", None)
    if isinstance(p, nn.Parameter) and p.dim() == 3:
        return int(p.shape[0])
    raise UnsupportedModuleStructure(type(module).__name__, "cannot count experts: no ModuleList or 3-D gate_up_proj")


def clear_caches() -> None:
    """Forget every per-class proof (benchmarks measure a cold detection with this)."""
    for fn in (_function_tree, _router_module_proof, _apply_gate_facts, _batched_forward_facts_cached,
               _swiglu_expert_proof, _routing_facts):
        fn.cache_clear()
