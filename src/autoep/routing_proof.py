"""Proofs about routing: the router kind from the gate/router submodule, and for whole-block recipes
the routing a v4-style block's own forward performs. Cached per class.
"""
from __future__ import annotations

import ast
import functools
import inspect

import torch.nn as nn

from autoep.output_proof import prove_block_output
from autoep.source import (
    CASTS, Refusal, all_calls, assignments, call_names, forward_tree, function_tree, is_call_to, is_self_call,
    last_name, self_attr, self_attrs_read,
)

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
    raise Refusal("no `gate` or `router` submodule to route tokens")


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
    env = assignments([tree])

    def is_topk_index(expr: ast.AST) -> bool:
        if isinstance(expr, ast.Name):
            bound = env.get(expr.id, [])
            return bool(bound) and all(is_topk_index(v) for v in bound)
        return (
            isinstance(expr, ast.Subscript)
            and is_call_to(expr.value, "topk")
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
    names = call_names(tree)
    missing = [n for n in ("linear", "topk") if n not in names]
    if missing:
        raise Refusal(f"router {router_cls.__name__}.forward does not call {' and '.join(missing)}")
    if not _returns_topk_indices(tree):
        raise Refusal(
            f"router {router_cls.__name__}.forward does not return (logits, scores, indices) "
            "with indices taken from a topk call"
        )


def router_kind(module: nn.Module) -> str:
    _, gate = _find_router(module)
    if type(gate) is nn.Linear:  # exact type: a subclass may override forward
        if not _explicit(module, TOP_K_NAMES):
            raise Refusal(
                "bare nn.Linear gate but no explicit `top_k` or `num_experts_per_tok` on the module or its config"
            )
        return "sigmoid_group" if _explicit(module, SIGMOID_MARKERS) else "softmax_topk"
    _router_module_proof(type(gate))
    return "topk_router_module"


# ---------------------------------------------------------------------------------------------
# Shared branch and the block's own forward
# ---------------------------------------------------------------------------------------------

SHARED_ATTRS = ("shared_expert", "shared_expert_gate", "shared_experts")


def shared_kind(module: nn.Module) -> str:
    found = tuple(a for a in SHARED_ATTRS if getattr(module, a, None) is not None)
    kinds = {(): "none", ("shared_expert", "shared_expert_gate"): "gated", ("shared_experts",): "additive"}
    if found not in kinds:
        raise Refusal(f"ambiguous shared branch: found attributes {list(found)}")
    return kinds[found]


def experts_only_called(tree: ast.FunctionDef, cls_name: str) -> None:
    """The block touches ``self.experts`` only by calling it (the experts contract), so it can be replaced."""
    calls = {id(c.func) for c in all_calls(tree)}
    for node in ast.walk(tree):
        if self_attr(node) == "experts" and id(node) not in calls:
            raise Refusal(f"{cls_name}.forward uses self.experts other than by calling it (line {node.lineno})")
    if not any(is_self_call(c, "experts") for c in all_calls(tree)):
        raise Refusal(f"{cls_name}.forward never calls self.experts")


BLOCK_ATTRS = {"gate", "experts", "top_k", "num_experts", "num_experts_per_tok", "num_local_experts", "n_routed_experts"}
BLOCK_ATTRS |= {"config"}
BLOCK_ATTRS |= {"norm_topk_prob", "jitter_noise", "training", "hidden_dim", "ffn_dim", "hidden_size"}
BLOCK_ATTRS |= {"routed_scaling_factor", "n_group", "topk_group", "e_score_correction_bias"}
BLOCK_ATTRS |= set(SHARED_ATTRS)


def _divides_by_sum(node: ast.BinOp | ast.AugAssign, assigned: dict[str, list[ast.AST]]) -> bool:
    """``w / w.sum(...)`` or ``w /= denominator`` where ``denominator`` was assigned from a sum."""
    right = node.right if isinstance(node, ast.BinOp) else node.value
    exprs = [right] + [v for n in ast.walk(right) if isinstance(n, ast.Name) for v in assigned.get(n.id, [])]
    return isinstance(node.op, ast.Div) and any(is_call_to(c, "sum") for e in exprs for c in ast.walk(e))


def _topk_norm(tree: ast.FunctionDef) -> str:
    conditional = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "norm_topk_prob" in ast.unparse(node.test):
            conditional |= {id(n) for s in node.body for n in ast.walk(s)}
    assigned = assignments([tree])
    norms = [
        n for n in ast.walk(tree) if isinstance(n, (ast.BinOp, ast.AugAssign)) and _divides_by_sum(n, assigned)
    ]
    if not norms:
        return "never"
    if all(id(n) in conditional for n in norms):
        return "norm_topk_prob"
    if not any(id(n) in conditional for n in norms):
        return "always"
    raise Refusal("top-k weights are normalised both conditionally and unconditionally")


def _block_trees(cls: type) -> list[ast.FunctionDef]:
    """The block's forward plus every method of its own that the forward calls as ``self.name(...)``."""
    trees, seen = [forward_tree(cls)], {"forward"}
    for tree in trees:
        for call in all_calls(tree):
            name = self_attr(call.func)
            if name and name not in seen and inspect.isfunction(getattr(cls, name, None)):
                seen.add(name)
                trees.append(function_tree(getattr(cls, name)))
    return trees


@functools.lru_cache(maxsize=None)
def routing_facts(cls: type, router: str) -> dict:
    """Whole-block recipes re-run the block's routing: prove it is the one they reproduce."""
    trees = _block_trees(cls)
    methods = {t.name for t in trees}
    unknown = set().union(*(self_attrs_read(t) for t in trees)) - BLOCK_ATTRS - methods
    if unknown:
        raise Refusal(f"{cls.__name__}.forward also uses {sorted(unknown)}, which the block recipe does not reproduce")
    score_fn = "softmax" if router == "softmax_topk" else "sigmoid"
    names = set().union(*(call_names(t) for t in trees))
    if score_fn not in names or "topk" not in names:
        raise Refusal(f"{cls.__name__}.forward does not take {score_fn} of the gate logits and then topk")
    for tree in trees:  # within one function, the scores come before the top-k
        first = {}
        for call in sorted(all_calls(tree), key=lambda c: (c.lineno, c.col_offset)):
            first.setdefault(last_name(call.func), call.lineno)
        if score_fn in first and "topk" in first and first[score_fn] > first["topk"]:
            raise Refusal(f"{cls.__name__}.{tree.name} takes topk before {score_fn}")
    if router == "sigmoid_group":
        _sigmoid_group_reads(cls, trees)
    _routing_constants(cls, trees, router)
    _gate_input_not_cast(cls, trees)
    prove_block_output(cls, trees)
    returns = [r.value for r in ast.walk(trees[0]) if isinstance(r, ast.Return)]
    pairs = {isinstance(v, ast.Tuple) and len(v.elts) == 2 for v in returns}
    if len(pairs) != 1:
        raise Refusal(f"{cls.__name__}.forward returns both tuples and tensors")
    norms = {_topk_norm(t) for t in trees} - {"never"}
    if len(norms) > 1:
        raise Refusal(f"{cls.__name__} normalises top-k weights in more than one way")
    return dict(topk_norm=norms.pop() if norms else "never", returns_router_logits=pairs.pop())


def _gate_input_not_cast(cls: type, trees: list[ast.FunctionDef]) -> None:
    """The recipe feeds the gate the block's hidden states as they are; a cast before it is not reproduced."""
    assigned = assignments(trees)
    for tree in trees:
        for call in all_calls(tree):
            if self_attr(call.func) != "gate":
                continue
            for arg in call.args:
                seen = [arg] + (assigned.get(arg.id, []) if isinstance(arg, ast.Name) else [])
                if any(isinstance(v, ast.Call) and last_name(v.func) in CASTS for v in seen):
                    raise Refusal(f"{cls.__name__} casts the hidden states before its gate, which the recipe does not")


def _routing_constants(cls: type, trees: list[ast.FunctionDef], router: str) -> None:
    """The constants the recipe hard-codes: sigmoid_group masks dropped groups with 0.0, scores groups by
    their top-2 sum and normalises with +1e-20; softmax_topk normalises with no epsilon."""
    text = "\n".join(ast.unparse(t) for t in trees)
    if router == "sigmoid_group":
        fills = [c for t in trees for c in all_calls(t) if last_name(c.func) == "masked_fill"]
        values = {ast.unparse(c.args[1]) if len(c.args) > 1 else "?" for c in fills}
        if values != {"0.0"}:
            raise Refusal(f"{cls.__name__} masks dropped expert groups with {sorted(values)}; the recipe fills 0.0")
        if ".topk(2, dim=-1)[0].sum(dim=-1)" not in text:
            raise Refusal(f"{cls.__name__} does not score expert groups by their top-2 sum")
        _weights_from_unbiased_scores(cls, trees)
    expected = {1e-20} if router == "sigmoid_group" else set()
    assigned = assignments(trees)
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.BinOp, ast.AugAssign)) and _divides_by_sum(node, assigned):
                right = node.right if isinstance(node, ast.BinOp) else node.value
                exprs = [right] + [v for n in ast.walk(right) if isinstance(n, ast.Name) for v in assigned.get(n.id, [])]
                eps = {c.value for e in exprs for c in ast.walk(e) if isinstance(c, ast.Constant)
                       and isinstance(c.value, float)}
                if eps != expected:
                    raise Refusal(f"{cls.__name__} normalises its top-k weights with epsilon {sorted(eps) or 'none'}; "
                                   f"the {router} recipe uses {sorted(expected) or 'none'}")


def _weights_from_unbiased_scores(cls: type, trees: list[ast.FunctionDef]) -> None:
    """The recipe gathers the top-k weights from the sigmoid scores without the correction bias."""
    gathers = [(t, c) for t in trees for c in all_calls(t) if last_name(c.func) == "gather"]
    if not gathers:
        raise Refusal(f"{cls.__name__} does not gather its top-k weights from the scores")
    for tree, call in gathers:
        # What the gathered tensor was built from, in this function, before this line.
        earlier: dict[str, list[ast.AST]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and node.lineno < call.lineno:
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        earlier.setdefault(target.id, []).append(node.value)

        def uses_bias(expr: ast.AST, seen: frozenset = frozenset()) -> bool:
            if "e_score_correction_bias" in ast.unparse(expr):
                return True
            names = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)} - seen
            return any(uses_bias(v, seen | names) for n in names for v in earlier.get(n, []))

        if uses_bias(call.func.value):
            raise Refusal(f"{cls.__name__} gathers its top-k weights from bias-corrected scores "
                          f"(line {call.lineno}); the recipe gathers from the sigmoid scores")


def _sigmoid_group_reads(cls: type, trees: list[ast.FunctionDef]) -> None:
    """Group-limited routing must read every group/bias/scale attribute it is configured with."""
    text = "\n".join(ast.unparse(t) for t in trees)
    for name in ("n_group", "topk_group", "routed_scaling_factor", "e_score_correction_bias"):
        if name not in text:
            raise Refusal(f"{cls.__name__} is group-routed but its forward never reads `{name}`")


