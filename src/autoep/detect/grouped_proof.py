"""Proof about grouped experts: ``experts(x_sorted_by_expert, num_tokens_per_expert) -> y``, never run.

``grouped_proof(experts)`` interprets the experts' forward (``autoep.detect.grouped_loops``: the accepted
per-expert loops and the whitelist) and proves that for each expert e the ``counts[e]`` contiguous rows
of group e (offset ``cumsum``) come back as the SwiGLU ``down(act(x @ gate[e]) * (x @ up[e]))`` of the
same rows, computed row-locally, from weights the experts hold and nothing else (no other parameters,
buffers, hooks or instance forwards). A projection may go through the model's own per-group autograd Function
(``Fn.apply(x, counts, w)``, its forward and backward proven per-group): the proof names it, by weight, and the
recipe runs it. Anything else is a ``Refusal`` naming what was not proven.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from autoep.detect import elementwise
from autoep.detect.grouped_loops import Rows, interpret
from autoep.detect.loop_context import plain_method
from autoep.detect.module_list_proof import global_hooks
from autoep.detect.source import Refusal, function_tree


@dataclass(frozen=True)
class GroupedProof:
    """What the recipe needs: argument names, the SwiGLU's parameters by path (relative to the experts),
    their layout, the activation, and what the experts return for rows past ``sum(counts)``."""

    x: str
    counts: str
    gate: str
    up: str  # == gate for a fused gate_up weight, chunked [gate | up]
    down: str
    transposed: bool  # weights stored (E, in, out), applied as x @ w[e]
    act: object  # the element-wise function, or the attribute name of the experts' activation module
    tail: str  # "zeros" (rows past sum(counts) are zero) | "exact" (sum(counts) must equal the rows)
    num_experts: int
    # "split": groups are the counts given (fewer than E: the last experts get none), summing to the rows |
    # "split_head": the same over x[:sum(counts)], zero rows after | "offsets": the first E counts, their
    # offsets clipped to the rows as slicing clips them | a split and offsets: exactly E counts
    loops: frozenset = frozenset()
    facts: dict = field(compare=False, default_factory=dict)
    # weights applied through the model's own per-group autograd Function (``autoep.detect.autograd_functions``),
    # by path: the recipe calls ``use.cls.apply`` on the local slice, its hand-written backward included
    functions: dict = field(compare=False, default_factory=dict)
    # a 1-D parameter of the experts' own (not an expert weight: it stays dense, replicated) their forward
    # multiplies its output by (``out * self.scale``), by path; "" for none
    scale: str = ""


def grouped_experts_facts(experts: nn.Module) -> dict:
    """Layout facts (MoeStructure fields) of proven grouped experts, or ``Refusal``."""
    return grouped_proof(experts).facts


def takes_groups(experts: nn.Module) -> bool:
    """The experts' forward takes two arguments (rows sorted by expert, tokens per expert)."""
    try:
        return len(function_tree(type(experts).forward).args.args) == 3
    except Refusal:
        return False


def grouped_proof(experts: nn.Module) -> GroupedProof:
    """The proven facts of grouped experts (not cached: run-time state is re-checked each time), or ``Refusal``."""
    cls = type(experts)
    elementwise.runtime_clean(experts, f"experts {cls.__name__}")
    fn = plain_method(cls, "forward", experts)
    names = [a.arg for a in function_tree(fn).args.args[1:]]
    out, loops, functions = interpret(experts, fn)
    if not (isinstance(out, Rows) and out.result and not out.group and not out.head):
        raise Refusal(f"{fn.__qualname__} does not return the output of its per-expert loop")
    expr, scale = (out.expr[1], out.expr[2]) if out.expr[0] == "scale" else (out.expr, "")
    gate, up, down, t, act = _swiglu(expr, fn.__qualname__)
    num_experts = _check_params(experts, (gate, up, down), t, dense=(scale,) if scale else ())
    for m in experts.modules():
        elementwise.runtime_clean(m, f"experts {cls.__name__} submodule {type(m).__name__}")
    if global_hooks():  # the experts' own submodule calls (fc1, fc2) would run them; the exchange does not
        raise Refusal("global module hooks are registered; the grouped exchange would not run them")
    facts = swiglu_facts(gate, up, down, t, act) | {"dense_params": (scale,) if scale else ()}
    tail = "exact" if "split" in loops else "zeros"
    return GroupedProof(names[0], names[1], gate, up, down, not t, act, tail, num_experts, loops=loops, facts=facts,
                        functions=functions, scale=scale)


def swiglu_facts(gate: str, up: str, down: str, t: bool, act) -> dict:
    """The MoeStructure layout facts of a proven per-group SwiGLU (``t``: weights applied transposed,
    ``x @ w[e].T``; ``gate == up``: one fused weight chunked [gate | up])."""
    return dict(
        expert_transposed=not t,
        gate_up_layout="concatenated" if gate == up else "separate",
        activation="glu",
        expert_projs=tuple(dict.fromkeys((gate, up, down))),
        expert_act=act if isinstance(act, str) else act.__name__,
    )


def _swiglu(expr: tuple, where: str):
    """(gate, up, down, t, act) of ``lin(mul(act(lin(x, gate)), lin(x, up)), down)`` (gate, up: two weights,
    or one fused weight chunked [gate | up]), every projection in the same layout ``t``."""
    what = f"{where}: each expert computes {_show(expr)}"
    if expr[0] != "lin" or expr[1][0] != "mul":
        raise Refusal(f"{what}, not down(act(gate(x)) * up(x))")
    _, inner, down, t = expr
    for a, b in ((inner[1], inner[2]), (inner[2], inner[1])):
        if a[0] != "act":
            continue
        g, act = a[1], a[2]
        if g[0] == b[0] == "lin" and g[1] == b[1] == ("x",) and g[3] == b[3] == t and g[2] != b[2]:
            return g[2], b[2], down, t, act
        if g[0] == b[0] == "chunk" and (g[2], b[2]) == (0, 1) and g[1] == b[1] and g[1][0] == "lin" \
                and g[1][1] == ("x",) and g[1][3] == t:
            return g[1][2], g[1][2], down, t, act
    raise Refusal(f"{what}, not down(act(gate(x)) * up(x)) with [gate | up] halves, in one layout")


def _show(expr) -> str:
    if not isinstance(expr, tuple):
        return getattr(expr, "__name__", str(expr))
    if expr == ("x",):
        return "x"
    if expr[0] == "lin":
        return f"({_show(expr[1])} @ {expr[2]}[e]{'.T' if expr[3] else ''})"
    head, *rest = expr
    return f"{head}({', '.join(_show(r) for r in rest)})"


def _check_params(experts: nn.Module, paths: tuple[str, str, str], t: bool, dense: tuple[str, ...] = ()) -> int:
    """The experts hold exactly the weights the SwiGLU reads, untied, 3-D, of agreeing shapes, and the
    ``dense`` per-feature parameters of their own (1-D of the hidden size), and no buffers; returns the number
    of experts."""
    name = type(experts).__name__
    named = list(experts.named_parameters(remove_duplicate=False))
    if len({id(p) for _, p in named}) != len(named):
        raise Refusal(f"experts {name} tie some weights to each other")
    for path in dense:
        if experts.get_parameter(path).dim() != 1:
            raise Refusal(f"experts {name} multiply their output by {path} {tuple(experts.get_parameter(path).shape)}"
                          f", not a 1-D per-feature scale of their own")
    extra = sorted({n for n, _ in named} - set(paths) - set(dense))
    if extra:
        raise Refusal(f"experts {name} hold parameters {extra} the proven forward does not use")
    if list(experts.buffers()):
        raise Refusal(f"experts {name} hold buffers the proven forward does not use")
    gate, up, down = (experts.get_parameter(p) for p in paths)
    if gate.dim() != 3 or up.dim() != 3 or down.dim() != 3:
        raise Refusal(f"experts {name}: the expert weights are not all 3-D")
    E = gate.shape[0]
    io = lambda w: (w.shape[2], w.shape[1]) if t else (w.shape[1], w.shape[2])  # noqa: E731 - (in, out)
    (d, f_gate), (d_up, f_up), (f_down, d_out) = io(gate), io(up), io(down)
    ffn = f_gate // 2 if gate is up else f_gate
    ok = up.shape[0] == down.shape[0] == E and d == d_up == d_out and f_gate == f_up and f_down == ffn
    if not ok or (gate is up and f_gate % 2):
        raise Refusal(f"experts {name} weight shapes {[tuple(w.shape) for w in (gate, up, down)]} do not agree")
    if any(experts.get_parameter(path).shape != (d,) for path in dense):
        raise Refusal(f"experts {name} multiply their output by {list(dense)}, not of their hidden size {d}")
    if len({p.requires_grad for _, p in named}) > 1:
        raise Refusal(f"experts {name}: some expert weights are frozen and some are not")
    return int(E)
