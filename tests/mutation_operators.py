"""Source operators of the soundness fuzzer: ``op(tree, site) -> [Edit]``, one edit per location
(``SOURCE_OPERATORS``, in enumeration order; the expert-loop and experts-call ones live in
``mutation_loop_operators``).

Each operator is one kind of realistic edit issue 8 lists (a scale, bias, temperature or soft-cap; a
changed constant or normalisation; ``no_grad``/``autocast`` around a statement; a statement after the
expert loop or a guard before it; a skipped expert; a cast, a dropped or rounding upcast; a keyword; a
helper named like torch's; a value mixed across the expert's rows; the expert count off by one; ...).
``tree`` is the function's own AST (never modified: each edit works on a copy); ``site.role`` says
whose function it is (``block``, ``router``, ``experts``, ``expert``, ``act`` or ``act:<Class>``: the
model-defined activation module the experts call, and the model-defined modules inside it).
"""

from __future__ import annotations

import ast
import copy
import functools
import re
from typing import Callable

import torch
from mutation_live_operators import LIVE_OPERATORS
from mutation_loop_operators import (
    op_acc_from_input,
    op_acc_other_index,
    op_acc_overwrite,
    op_acc_respelled,
    op_acc_subtract,
    op_after_loop_inplace,
    op_after_loop_scale,
    op_conditional_experts_call,
    op_early_return_empty,
    op_early_return_taken,
    op_experts_call_by_keyword,
    op_experts_call_extra_keyword,
    op_flag_and_tokens,
    op_flag_negated,
    op_flag_training,
    op_guard_before_loop,
    op_index_add_alpha,
    op_off_by_one_expert,
    op_padding_index,
    op_skip_expert,
)
from mutation_source import (
    ROUTING_LIKE,
    SCALE,
    Edit,
    bound_names,
    calls,
    dotted,
    each,
    expert_counts,
    expr,
    float_names,
    named,
    slots,
    stmt,
    swap,
)


def value_sites(fn: ast.FunctionDef, *, names=None, in_loop=None, returns=True) -> list[tuple]:
    """``(slot, name)`` after each float binding, ``(slot, None)`` for each non-trivial returned value."""
    out = []
    for s in slots(fn):
        if in_loop is not None and s.in_loop != in_loop:
            continue
        for n in float_names(s.stmt):
            if names is None or names.search(n):
                out.append((s, n))
        if returns and isinstance(s.stmt, ast.Return) and s.stmt.value is not None:
            value = s.stmt.value.elts[0] if isinstance(s.stmt.value, ast.Tuple) else s.stmt.value
            if not isinstance(value, ast.Name):
                out.append((s, None))
    return out


def transform_value(template: str, **kw) -> Callable:
    """An operator writing ``name = template(name)`` after a binding, or the same on a returned value."""

    def op(fn, site):
        def locate(tree):
            return value_sites(tree, **kw)

        def mutate(tree, loc):
            s, name = loc
            if name is not None:
                s.body.insert(s.index + 1, stmt(f"{name} = {template.format(x=name)}")[0])
                return
            ret = s.stmt.value
            old = ret.elts[0] if isinstance(ret, ast.Tuple) else ret
            swap(tree, old, expr(template.format(x="__x__"), __x__=old))

        return each(fn, locate, mutate)

    return op


op_scale = transform_value(f"{{x}} * {SCALE}")
op_bias = transform_value("{x} + 0.25")
op_temperature = transform_value("{x} / 0.7", names=ROUTING_LIKE, returns=False)
op_softcap = transform_value("torch.tanh({x} / 2.0) * 2.0")
op_lossy_cast = transform_value("{x}.to(torch.bfloat16).float()", in_loop=True, returns=False)


def op_expert_output_cast(fn, site):
    """A lossy bf16 round trip on an expert module's returned output."""
    if site.role != "expert":
        return []
    return transform_value("{x}.to(torch.bfloat16).float()")(fn, site)


def _expert_side(site) -> bool:
    """The experts' own code: batched experts, a ModuleList expert, the activation module they call."""
    return site.role in ("experts", "expert") or site.role.startswith(("act", "experts:"))


def op_mix_rows(fn, site):
    """A value of the experts' code centred over its rows (``x - x.mean(0)``): no longer row-local, so an
    expert that sees other rows (another rank's tokens) computes another thing."""
    if not _expert_side(site):
        return []
    return transform_value("{x} - {x}.mean(0, keepdim=True)")(fn, site)


FLOAT32 = ("torch.float32", "torch.float")


def _upcasts(tree) -> list[ast.Call]:
    """``x.float()``, ``x.to(torch.float32)``, ``x.type(torch.float32)``."""
    return calls(tree, lambda c: isinstance(c.func, ast.Attribute) and (
        (c.func.attr == "float" and not c.args and not c.keywords)
        or (c.func.attr in ("to", "type") and len(c.args) == 1 and dotted(c.args[0]) in FLOAT32)))


def op_drop_float(fn, site):
    """One upcast of the experts' code dropped: ``x.float()`` becomes ``x``, ``dtype=torch.float32`` goes
    (float32 experts are proven all-or-nothing)."""
    if not _expert_side(site):
        return []

    def locate(tree):
        keywords = [(c, k) for c in calls(tree, lambda c: True) for k in c.keywords
                    if k.arg == "dtype" and dotted(k.value) in FLOAT32]
        return [*_upcasts(tree), *keywords]

    def mutate(tree, loc):
        if isinstance(loc, tuple):
            call, keyword = loc
            call.keywords.remove(keyword)
        else:
            swap(tree, loc, loc.func.value)

    return each(fn, locate, mutate)


def op_upcast_through_bf16(fn, site):
    """One upcast of the experts' code rounds through bfloat16 first: ``x.to(torch.bfloat16).float()``."""
    if not _expert_side(site):
        return []

    def mutate(tree, call):
        call.func.value = expr("__x__.to(torch.bfloat16)", __x__=call.func.value)

    return each(fn, _upcasts, mutate)


def op_expert_count_off_by_one(fn, site):
    """One read of the expert count (``self.num_experts``, ``len(self.experts)``, ...) one less or one
    more: a padding id that lands on the last expert, a loop or one-hot short of it, a skip of another id."""

    def locate(tree):
        return [(n, op) for n in expert_counts(tree) for op in ("-", "+")]

    def mutate(tree, loc):
        node, op = loc
        swap(tree, node, expr(f"__n__ {op} 1", __n__=node))

    return each(fn, locate, mutate)


def op_constant(fn, site):
    """Change one numeric constant: ints + 1, floats x 2 (0.0 -> 0.5)."""

    def locate(tree):
        return [n for s in tree.body for n in ast.walk(s) if isinstance(n, ast.Constant)
                and type(n.value) in (int, float)]

    def mutate(tree, node):
        node.value = node.value + 1 if type(node.value) is int else (node.value * 2 or 0.5)

    return each(fn, locate, mutate)


def _keepdim_sums(tree):
    return calls(tree, lambda c: named("sum")(c) and any(k.arg == "keepdim" for k in c.keywords))


def _out_of_place(tree, call) -> None:
    """``x /= ...`` becomes ``x = x / ...`` where ``call`` normalises ``x``: a norm's backward needs the
    ``x`` an in-place division would overwrite (the model's author would have had to write it so)."""
    x = dotted(call.func.value)
    for s in slots(tree):
        if isinstance(s.stmt, ast.AugAssign) and dotted(s.stmt.target) == x:
            target = copy.deepcopy(s.stmt.target)
            target.ctx = ast.Load()
            s.body[s.index] = ast.Assign(targets=[s.stmt.target], value=ast.BinOp(target, s.stmt.op, s.stmt.value))


def op_norm_l2(fn, site):
    """A normalisation by the L2 norm instead of the sum."""

    def mutate(tree, call):
        call.func.attr = "norm"
        _out_of_place(tree, call)

    return each(fn, _keepdim_sums, mutate)


def op_norm_l1(fn, site):
    """A normalisation by the sum of absolute values (the L1 norm) instead of the sum."""

    def mutate(tree, call):
        _out_of_place(tree, call)
        call.func.value = expr("__x__.abs()", __x__=call.func.value)

    return each(fn, lambda t: [c for c in _keepdim_sums(t) if dotted(c.func) != "torch.sum"], mutate)


def op_norm_eps(fn, site):
    """An epsilon added to a normalising sum."""
    return each(fn, _keepdim_sums, lambda tree, call: swap(tree, call, expr("__c__ + 1e-3", __c__=call)))


def op_drop_norm(fn, site):
    """A ``x /= denominator`` statement dropped."""

    def locate(tree):
        return [s for s in slots(tree) if isinstance(s.stmt, ast.AugAssign) and isinstance(s.stmt.op, ast.Div)]

    def mutate(tree, s):
        s.body[s.index] = ast.Pass()

    return each(fn, locate, mutate)


def _topk_input(call: ast.Call) -> ast.expr | None:
    if isinstance(call.func, ast.Attribute) and dotted(call.func) not in ("torch.topk",):
        return call.func.value
    return call.args[0] if call.args else None


def op_softmax_after_topk(fn, site):
    """``p = softmax(l); v, i = topk(p)`` becomes ``p = l; v, i = topk(p); v = softmax(v)``."""

    def locate(tree):
        found = []
        for s in slots(tree):
            if isinstance(s.stmt, ast.Assign) and isinstance(s.stmt.value, ast.Call) and named("softmax")(s.stmt.value):
                p = bound_names(s.stmt)
                for later in s.body[s.index + 1:]:
                    tk = calls(later, named("topk"))
                    inp = _topk_input(tk[0]) if tk else None
                    if p and isinstance(inp, ast.Name) and inp.id == p[0] and isinstance(later, ast.Assign) \
                            and isinstance(later.targets[0], ast.Tuple):
                        found.append((s, later))
                        break
        return found

    def mutate(tree, loc):
        s, later = loc
        softmax = s.stmt.value
        s.stmt.value = softmax.args[0] if softmax.args else softmax.func.value
        v = later.targets[0].elts[0].id
        s.body.insert(s.body.index(later) + 1, stmt(f"{v} = torch.nn.functional.softmax({v}, dim=-1)")[0])

    return each(fn, locate, mutate)


def op_sub_for_add(fn, site):
    """One ``a + b`` becomes ``a - b`` (a bias subtracted, a shared branch subtracted, ...)."""

    def locate(tree):
        return [n for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add)]

    def mutate(tree, node):
        node.op = ast.Sub()

    return each(fn, locate, mutate)


def _gathers(tree):
    out = []
    for c in calls(tree, named("gather")):
        src = c.args[0] if dotted(c.func) == "torch.gather" else getattr(c.func, "value", None)
        if isinstance(src, ast.Name):
            out.append((c, src))
    return out


def op_gather_other(fn, site):
    """Weights gathered from another routing tensor bound earlier (e.g. the biased scores)."""

    def locate(tree):
        found = []
        for c, src in _gathers(tree):
            earlier = [n for s in slots(tree) if s.stmt.lineno < c.lineno for n in float_names(s.stmt)]
            found += [(c, src, n) for n in dict.fromkeys(earlier) if n != src.id and ROUTING_LIKE.search(n)]
        return found

    def mutate(tree, loc):
        _, src, other = loc
        src.id = other

    return each(fn, locate, mutate)


def _wrap_sites(tree):
    """Statements worth wrapping: float bindings, loops, in-place accumulations, returns."""
    out = []
    for s in slots(tree):
        adds = isinstance(s.stmt, ast.Expr) and calls(s.stmt, named("index_add_", "index_add"))
        adds = adds or (isinstance(s.stmt, ast.AugAssign) and isinstance(s.stmt.target, ast.Subscript))
        if float_names(s.stmt) or isinstance(s.stmt, (ast.For, ast.Return)) or adds:
            out.append(s)
    return out


def wrap_in(context: str) -> Callable:
    def op(fn, site):
        def mutate(tree, s):
            s.body[s.index] = ast.With(items=[ast.withitem(context_expr=expr(context))], body=[s.stmt])

        return each(fn, _wrap_sites, mutate)

    return op


op_no_grad = wrap_in("torch.no_grad()")
op_autocast = wrap_in('torch.autocast("cpu", dtype=torch.bfloat16)')


LINEAR_NAMES = {"F.linear", "nn.functional.linear", "torch.nn.functional.linear", "functional.linear"}
ACT_NAMES = {"self.act_fn", "F.silu", "nn.functional.silu", "torch.nn.functional.silu"}
HELPER_LINEAR = '''
def linear(input, weight, bias=None):
    """This module's own linear (it also rescales)."""
    out = torch.matmul(input, weight.transpose(-1, -2)) * 1.01
    return out if bias is None else out + bias
'''
HELPER_SILU = '''
def silu(x):
    """This module's own 'silu' (the quick-GELU curve)."""
    return x * torch.sigmoid(1.702 * x)
'''


def _rename_calls(names: set[str], new: str, prelude: str) -> Callable:
    """Every call of one of ``names`` becomes a call of the module-level helper ``new`` (one edit)."""

    def op(fn, site):
        tree = copy.deepcopy(fn)
        found = calls(tree, lambda c: dotted(c.func) in names)
        for c in found:
            c.func = ast.Name(id=new, ctx=ast.Load())
        return [Edit(tree, prelude)] if found else []

    return op


op_helper_linear = _rename_calls(LINEAR_NAMES, "linear", HELPER_LINEAR)
op_helper_silu = _rename_calls(ACT_NAMES, "silu", HELPER_SILU)


def op_softmax_act(fn, site):
    """The activation replaced by a softmax over the last dim (not element-wise)."""

    def mutate(tree, call):
        swap(tree, call, expr("torch.nn.functional.softmax(__a__, dim=-1)", __a__=call.args[0]))

    return each(fn, lambda t: calls(t, lambda c: dotted(c.func) in ACT_NAMES and len(c.args) == 1), mutate)


K_ATTRS = ("top_k", "num_experts_per_tok")


def op_top_k_other_attr(fn, site):
    """``top_k`` read from another attribute of the module, which holds a different value."""

    def locate(tree):
        found = []
        for c in calls(tree, named("topk")):
            k = next((kw.value for kw in c.keywords if kw.arg == "k"), None)
            k = k or (c.args[1] if dotted(c.func) == "torch.topk" and len(c.args) > 1 else None)
            k = k or (c.args[0] if dotted(c.func) != "torch.topk" and c.args else None)
            if k is not None and dotted(k).split(".")[-1] in K_ATTRS and dotted(k).startswith("self."):
                found.append(k)
        return found

    def mutate(tree, k):
        path = dotted(k).split(".")[1:]
        other = K_ATTRS[1] if path[-1] == K_ATTRS[0] else K_ATTRS[0]
        swap(tree, k, expr(f"self.{other}"))

        def tweak(owner):
            setattr(owner, other, int(functools.reduce(getattr, path, owner)) + 1)

        return tweak

    return each(fn, locate, mutate)


KEYWORD_EDITS = {"topk": ("largest", "False"), "softmax": ("dtype", "torch.bfloat16")}


def op_add_keyword(fn, site):
    """A keyword added to (or changed in) a call: ``topk(..., largest=False)``, ``softmax(..., dtype=bf16)``."""

    def mutate(tree, call):
        key, value = KEYWORD_EDITS[call.func.attr if isinstance(call.func, ast.Attribute) else call.func.id]
        call.keywords = [k for k in call.keywords if k.arg != key] + [ast.keyword(arg=key, value=expr(value))]

    return each(fn, lambda t: calls(t, named(*KEYWORD_EDITS)), mutate)


def op_keyword_form(fn, site):
    """A call spelled with keywords (same meaning): ``one_hot(input=...)``, ``torch.topk(input=..., k=...)``,
    ``torch.gather(x, dim=, index=)`` for ``x.gather``, ``torch.where(condition=...)``."""

    def locate(tree):
        return calls(tree, lambda c: (named("one_hot")(c) and c.args)
                     or (dotted(c.func) == "torch.topk" and len(c.args) >= 2)
                     or (named("gather")(c) and isinstance(c.func, ast.Attribute) and dotted(c.func) != "torch.gather")
                     or (dotted(c.func) == "torch.where" and len(c.args) == 1))

    def mutate(tree, call):
        d = dotted(call.func)
        if d == "torch.topk":
            call.keywords = [ast.keyword("input", call.args[0]), ast.keyword("k", call.args[1])] + call.keywords
            call.args = call.args[2:]
        elif d == "torch.where":
            call.keywords, call.args = [ast.keyword("condition", call.args[0])], []
        elif named("gather")(call):
            src = call.func.value
            call.func = expr("torch.gather")
            call.keywords = [ast.keyword(k, v) for k, v in zip(("dim", "index"), call.args)] + call.keywords
            call.args = [src]
        else:
            call.keywords, call.args = [ast.keyword("input", call.args[0])] + call.keywords, call.args[1:]

    return each(fn, locate, mutate)


def op_bare_gather(fn, site):
    """``x.gather(d, i)`` spelled ``gather(x, d, i)`` with ``from torch import gather`` (same meaning)."""

    def mutate(tree, loc):
        call, src = loc
        args = call.args[1:] if dotted(call.func) == "torch.gather" else call.args
        swap(tree, call, ast.Call(func=ast.Name("gather", ast.Load()), args=[src] + args, keywords=call.keywords))

    return each(fn, _gathers, mutate, prelude="from torch import gather")


SCALE_OUTPUT = f'''
import functools as _functools


def scale_output(forward):
    """Scales what the wrapped method returns (its first element for a tuple)."""
    @_functools.wraps(forward)
    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        return (out[0] * {SCALE}, *out[1:]) if isinstance(out, tuple) else out * {SCALE}
    return scaled
'''


def op_decorate(fn, site):
    """An unknown decorator on the function (``functools.wraps``: unwrapping shows the original source)."""
    tree = copy.deepcopy(fn)
    tree.decorator_list.insert(0, ast.Name("scale_output", ast.Load()))
    return [Edit(tree, SCALE_OUTPUT)]


# --- breaking the expert property (issue 16): row-local, deterministic, stateless ----------------------


def _expert_value_op(template: str) -> Callable:
    """``transform_value(template)`` on the experts' own code only."""

    def op(fn, site):
        return transform_value(template)(fn, site) if _expert_side(site) else []

    return op


op_cumsum_rows = _expert_value_op("{x}.cumsum(0)")  # a scan over the rows
op_sort_rows = _expert_value_op("{x}.sort(dim=0).values")  # rows reordered by value
op_rng_noise = _expert_value_op("{x} + 0.01 * torch.randn_like({x})")  # random numbers
op_dropout_training = _expert_value_op("torch.nn.functional.dropout({x}, p=0.1, training=True)")
op_batch_stats = _expert_value_op("torch.nn.functional.batch_norm({x}, None, None, training=True)")


def _expert_return_op(template: str) -> Callable:
    """``template`` on each value the experts' own code returns (one site per function: few mutants)."""

    def op(fn, site):
        return transform_value(template, names=re.compile(r"(?!)"))(fn, site) if _expert_side(site) else []

    return op


# Issue 20: the dim given by numpy's keyword, which torch accepts too (read as the last dim, these were accepted).
op_cumsum_axis = _expert_return_op("{x}.cumsum(axis=0)")
op_sort_axis = _expert_return_op("{x}.sort(axis=0).values")


def _first_arg(fn: ast.FunctionDef) -> str | None:
    args = fn.args.args
    return args[1].arg if len(args) > 1 and args[0].arg == "self" else None


def op_inplace_input(fn, site):
    """The expert edits its input rows in place before using them (``x.mul_(1.5)``)."""
    if not _expert_side(site) or site.method != "forward" or _first_arg(fn) is None:
        return []

    def mutate(tree, _):
        tree.body.insert(0, stmt(f"{_first_arg(tree)}.mul_(1.5)")[0])

    return each(fn, lambda tree: [0], mutate)


def _count_calls(module) -> None:
    module.register_buffer("calls", torch.zeros(()), persistent=False)


def op_buffer_write(fn, site):
    """The expert counts its calls in a buffer (``self.calls += 1``) and scales by it: module state."""
    if not _expert_side(site) or site.method != "forward" or _first_arg(fn) is None:
        return []

    def mutate(tree, _):
        x = _first_arg(tree)
        tree.body[:0] = stmt(f"self.calls += 1\n{x} = {x} * (1.0 + 0.1 * self.calls)")
        return _count_calls

    return each(fn, lambda tree: [0], mutate)


SOURCE_OPERATORS: dict[str, Callable] = {
    "scale": op_scale,
    "bias": op_bias,
    "temperature": op_temperature,
    "softcap": op_softcap,
    "constant": op_constant,
    "norm_l2": op_norm_l2,
    "norm_l1": op_norm_l1,
    "norm_eps": op_norm_eps,
    "drop_norm": op_drop_norm,
    "softmax_after_topk": op_softmax_after_topk,
    "sub_for_add": op_sub_for_add,
    "gather_other": op_gather_other,
    "no_grad": op_no_grad,
    "autocast": op_autocast,
    "after_loop_scale": op_after_loop_scale,
    "after_loop_inplace": op_after_loop_inplace,
    "guard_before_loop": op_guard_before_loop,
    "skip_expert": op_skip_expert,
    "acc_from_input": op_acc_from_input,
    "index_add_alpha": op_index_add_alpha,
    "acc_overwrite": op_acc_overwrite,
    "acc_subtract": op_acc_subtract,
    "acc_other_index": op_acc_other_index,
    "acc_respelled": op_acc_respelled,
    "lossy_cast": op_lossy_cast,
    "expert_output_cast": op_expert_output_cast,
    "drop_float": op_drop_float,
    "upcast_through_bf16": op_upcast_through_bf16,
    "mix_rows": op_mix_rows,
    "off_by_one_expert": op_off_by_one_expert,
    "expert_count_off_by_one": op_expert_count_off_by_one,
    "helper_linear": op_helper_linear,
    "helper_silu": op_helper_silu,
    "softmax_act": op_softmax_act,
    "top_k_other_attr": op_top_k_other_attr,
    "add_keyword": op_add_keyword,
    "keyword_form": op_keyword_form,
    "bare_gather": op_bare_gather,
    "conditional_experts_call": op_conditional_experts_call,
    "flag_negated": op_flag_negated,
    "flag_training": op_flag_training,
    "flag_and_tokens": op_flag_and_tokens,
    "early_return_empty": op_early_return_empty,
    "early_return_taken": op_early_return_taken,
    "padding_index": op_padding_index,
    "experts_call_by_keyword": op_experts_call_by_keyword,
    "experts_call_extra_keyword": op_experts_call_extra_keyword,
    "decorate": op_decorate,
    "cumsum_rows": op_cumsum_rows,
    "sort_rows": op_sort_rows,
    "rng_noise": op_rng_noise,
    "dropout_training": op_dropout_training,
    "batch_stats": op_batch_stats,
    "cumsum_axis": op_cumsum_axis,
    "sort_axis": op_sort_axis,
    "inplace_input": op_inplace_input,
    "buffer_write": op_buffer_write,
    **LIVE_OPERATORS,  # issue 17: splice fidelity and autograd around the exchange
}
