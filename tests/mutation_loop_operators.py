"""Source operators on the expert loop and the experts call (see ``mutation_operators``).

A statement after the loop or a guard before it, a skipped expert, an accumulator initialised from the
input, ``index_add_(..., alpha=)``, an off-by-one expert index; the accumulation (``acc.index_add_(0, i, v)``
or ``acc[i] += v``) made an overwrite or a subtraction, indexed by another index of the loop, or spelled
the other way; in the block: the experts call made conditional, an early return before it, a padding
expert index, the experts called by keyword or with one keyword more.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import re
from typing import Callable

from mutation_source import (
    accumulated_index,
    accumulations,
    accumulator,
    bound_names,
    calls,
    dotted,
    each,
    expert_counts,
    expert_loops,
    experts_call_slots,
    expr,
    first_param,
    function_tree,
    loop_vars,
    named,
    self_attr,
    slots,
    stmt,
    swap,
    with_method,
)
from torch import nn


def _after_loop(statement: str) -> Callable:
    """An operator adding ``statement`` (``{acc}`` = the accumulator) right after each expert loop."""

    def op(fn, site):
        def mutate(tree, loc):
            loop, acc, _ = loc
            loop.body.insert(loop.index + 1, stmt(statement.format(acc=acc))[0])

        return each(fn, expert_loops, mutate)

    return op


op_after_loop_scale = _after_loop("{acc} = {acc} * 2.0")
op_after_loop_inplace = _after_loop("{acc}.mul_(0.5)")


def op_guard_before_loop(fn, site):
    """``if self.training: acc = acc + 0.5`` before the expert loop."""

    def mutate(tree, loc):
        s, acc, _ = loc
        s.body.insert(s.index, stmt(f"if self.training:\n    {acc} = {acc} + 0.5")[0])

    return each(fn, expert_loops, mutate)


def op_skip_expert(fn, site):
    """``if expert_idx == 1: continue`` first in the expert loop."""

    def mutate(tree, loc):
        loop, _, expert_idx = loc
        loop.stmt.body.insert(0, stmt(f"if {expert_idx} == 1:\n    continue")[0])

    return each(fn, expert_loops, mutate)


def op_acc_from_input(fn, site):
    """The accumulator initialised from the input instead of zeros."""

    def locate(tree):
        found = []
        for loop, acc, _ in expert_loops(tree):
            for s in slots(tree):
                v = getattr(s.stmt, "value", None)
                zeros = isinstance(v, ast.Call) and named("zeros", "zeros_like", "new_zeros")(v)
                if zeros and bound_names(s.stmt) == [acc]:
                    found.append(s)
        return found

    def mutate(tree, s):
        call = s.stmt.value
        arg = call.args[0] if call.args else None
        if isinstance(call.func, ast.Attribute) and call.func.attr == "new_zeros":
            arg = call.func.value  # ``x.new_zeros(x.shape)``: x
        src = arg.id if isinstance(arg, ast.Name) else first_param(tree)
        s.stmt.value = expr(f"{src}.clone()")

    return each(fn, locate, mutate)


def op_index_add_alpha(fn, site):
    def mutate(tree, call):
        call.keywords.append(ast.keyword(arg="alpha", value=ast.Constant(0.5)))

    return each(fn, lambda t: calls(t, named("index_add_")), mutate)


def op_off_by_one_expert(fn, site):
    """``self.gate_up_proj[expert_idx]`` becomes ``self.gate_up_proj[expert_idx - 1]``."""

    def locate(tree):
        loop = loop_vars(tree)
        return [n for n in ast.walk(tree) if isinstance(n, ast.Subscript) and self_attr(n.value)
                and isinstance(n.slice, ast.Name) and n.slice.id in loop]

    def mutate(tree, node):
        node.slice = expr(f"{node.slice.id} - 1")

    return each(fn, locate, mutate)


def _loop_accumulations(tree) -> list[ast.AST]:
    """Every accumulation inside an expert loop (once, however deep the loops nest)."""
    found = {id(a): a for loop, _, _ in expert_loops(tree) for a in accumulations(loop.stmt)}
    return sorted(found.values(), key=lambda a: (a.lineno, a.col_offset))


def op_acc_overwrite(fn, site):
    """The accumulation overwrites: ``acc[i] += v`` becomes ``acc[i] = v``, ``index_add_`` ``index_copy_``
    (a token's earlier experts are lost)."""

    def mutate(tree, acc):
        if isinstance(acc, ast.Call):
            acc.func.attr = "index_copy_"
            return
        s = next(s for s in slots(tree) if s.stmt is acc)
        s.body[s.index] = ast.Assign(targets=[acc.target], value=acc.value, lineno=acc.lineno)

    return each(fn, _loop_accumulations, mutate)


def op_acc_subtract(fn, site):
    """The accumulation subtracts: ``acc[i] -= v``, ``acc.index_add_(0, i, v, alpha=-1.0)``."""

    def mutate(tree, acc):
        if isinstance(acc, ast.Call):
            acc.keywords.append(ast.keyword(arg="alpha", value=ast.Constant(-1.0)))
        else:
            acc.op = ast.Sub()

    return each(fn, _loop_accumulations, mutate)


def op_acc_other_index(fn, site):
    """The accumulation indexed by another index the loop binds with it (``acc[nth_expert] += ...``,
    ``index_add_(0, top_k_pos, ...)``)."""

    def locate(tree):
        found = []
        for acc in _loop_accumulations(tree):
            index = accumulated_index(acc)
            if not isinstance(index, ast.Name):
                continue
            for s in slots(tree):
                names = bound_names(s.stmt)
                if index.id in names and len(names) > 1:
                    found += [(index, other) for other in names if other != index.id]
                    break
        return found

    def mutate(tree, loc):
        index, other = loc
        index.id = other

    return each(fn, locate, mutate)


def _index_add_on_rows(call: ast.Call) -> bool:
    """``acc.index_add_(0, index, value)``: positional, along dim 0, nothing else."""
    dim = call.args[0] if call.args else None
    return len(call.args) == 3 and not call.keywords and isinstance(dim, ast.Constant) and dim.value == 0


def op_acc_respelled(fn, site):
    """The same accumulation spelled the other way (same meaning: a token meets an expert once):
    ``acc.index_add_(0, i, v)`` as ``acc[i] += v``, and ``acc[i] += v`` as ``acc.index_add_(0, i, v)``."""

    def locate(tree):
        return [s for s in slots(tree) for acc in _loop_accumulations(tree)
                if (s.stmt is acc or (isinstance(s.stmt, ast.Expr) and s.stmt.value is acc))
                and (not isinstance(acc, ast.Call) or _index_add_on_rows(acc))]

    def mutate(tree, s):
        if isinstance(s.stmt, ast.AugAssign):
            acc, index, value = s.stmt.target.value.id, s.stmt.target.slice, s.stmt.value
            s.body[s.index] = ast.Expr(expr(f"{acc}.index_add_(0, __i__, __v__)", __i__=index, __v__=value))
        else:
            call = s.stmt.value
            target = ast.Subscript(value=ast.Name(accumulator(call), ast.Store()), slice=call.args[1], ctx=ast.Store())
            s.body[s.index] = ast.AugAssign(target=target, op=ast.Add(), value=call.args[2])

    return each(fn, locate, mutate)


def _block_method(site) -> bool:
    return site.role == "block"


def op_conditional_experts_call(fn, site):
    """The experts call (or the expert loop) runs only when there are tokens."""
    if not _block_method(site):
        return []

    def mutate(tree, s):
        inp = first_param(tree)
        orelse = []
        if not isinstance(s.stmt, ast.For):
            orelse = [copy.deepcopy(s.stmt)]
            call = calls(orelse[0], lambda c: self_attr(c.func) == "experts")[0]
            swap(orelse[0], call, expr("torch.zeros_like(__a__)", __a__=call.args[0]))
            inp = dotted(call.args[0]) or inp
        s.body[s.index] = ast.If(test=expr(f"{inp}.shape[0] > 0"), body=[s.stmt], orelse=orelse)

    return each(fn, experts_call_slots, mutate)


def _flag_guards(tree: ast.FunctionDef) -> list:
    """``if self.<flag>:`` statements of a block method whose body calls the experts (Gemma-4's
    ``if self.enable_moe_block:``), in source order."""
    return [s for s in slots(tree) if isinstance(s.stmt, ast.If) and self_attr(s.stmt.test)
            and any(calls(b, lambda c: self_attr(c.func) == "experts") for b in s.stmt.body)]


def flag_guard(test: str) -> Callable:
    """The flag's test rewritten (``{flag}``: the original ``self.<flag>``, ``{x}``: the first parameter)."""

    def op(fn, site):
        if not _block_method(site):
            return []

        def mutate(tree, s):
            s.stmt.test = expr(test.format(flag=ast.unparse(s.stmt.test), x=first_param(tree)))

        return each(fn, _flag_guards, mutate)

    return op


op_flag_negated = flag_guard("not {flag}")  # the experts never run (on every rank alike)
op_flag_training = flag_guard("self.training")  # a mode, not a constant: it changes in eval
op_flag_and_tokens = flag_guard("{flag} and {x}.shape[0] > 0")  # a rank without tokens would skip the exchange


def early_return(condition: str) -> Callable:
    def op(fn, site):
        if not _block_method(site):
            return []

        def mutate(tree, s):
            inp = first_param(tree)
            s.body.insert(s.index, stmt(f"if {condition.format(x=inp)}:\n    return {inp}")[0])

        return each(fn, experts_call_slots, mutate)

    return op


op_early_return_empty = early_return("{x}.shape[0] == 0")
op_early_return_taken = early_return("self.training")


def op_padding_index(fn, site):
    """Tokens that chose expert 0 get the padding index ``num_experts`` (transformers' eager experts skip
    it), spelled as the function reads the expert count (``self.num_experts`` if it reads none; a block's
    ``len(self.experts)`` or ``self.experts.num_experts``)."""
    counts = expert_counts(fn)
    if counts:
        count = ast.unparse(counts[0])
    elif site.role == "block":
        count = "self.experts.num_experts" if site.experts_params else "len(self.experts)"
    else:
        count = "self.num_experts"

    def locate(tree):
        return [(s, n) for s in slots(tree) if calls(s.stmt, named("topk"))
                for n in bound_names(s.stmt) if re.search(r"indices|selected|index|chosen", n)]

    def mutate(tree, loc):
        s, n = loc
        s.body.insert(s.index + 1, stmt(f"{n} = {n}.masked_fill({n} == 0, {count})")[0])

    return each(fn, locate, mutate)


def _experts_calls(tree):
    return calls(tree, lambda c: self_attr(c.func) == "experts" and not c.keywords)


def op_experts_call_by_keyword(fn, site):
    """The block calls its batched experts with keywords, by their forward's own parameter names."""
    if site.role != "block" or not site.experts_params:
        return []

    def mutate(tree, call):
        call.keywords, call.args = [ast.keyword(p, a) for p, a in zip(site.experts_params, call.args)], []

    return each(fn, _experts_calls, mutate)


EXTRA_KEYWORD = "routed_scale"


def op_experts_call_extra_keyword(fn, site):
    """The block passes its experts one more keyword (``routed_scale=2.0``), which their forward (edited
    as the same model file would be) takes and multiplies its result by."""
    if site.role != "block" or not site.experts_params:
        return []

    def mutate(tree, call):
        call.keywords.append(ast.keyword(EXTRA_KEYWORD, ast.Constant(2.0)))
        return _experts_take_extra_keyword

    return each(fn, _experts_calls, mutate)


def _experts_take_extra_keyword(block: nn.Module) -> None:
    block.experts.__class__ = _experts_taking_keyword(type(block.experts))


@functools.lru_cache(maxsize=None)
def _experts_taking_keyword(cls: type) -> type:
    tree = function_tree(inspect.unwrap(cls.forward))
    tree.args.kwonlyargs.append(ast.arg(EXTRA_KEYWORD))
    tree.args.kw_defaults.append(ast.Constant(1.0))
    for ret in [n for n in ast.walk(tree) if isinstance(n, ast.Return) and n.value is not None]:
        ret.value = expr(f"__v__ * {EXTRA_KEYWORD}", __v__=ret.value)
    return with_method(cls, "forward", tree)
