"""Source operators for record/exchange/replay's own obligations (issue 21 item 6; see ``mutation_operators``).

Record/exchange/replay (``autoep.runtime.recipes.replay``) runs a block's forward twice inside one call and
answers its expert calls; it is exact only when pass 2 makes pass 1's calls with bit-identical inputs and pass 1
leaves nothing behind. Each operator breaks or stresses one of these, at each expert call of a function that
calls experts (the block's forward, its helpers, an experts container's own forward):

- ``chain_expert_input``: an expert's rows shifted by the sum of the previous expert call's output;
- ``branch_on_output``: the next expert call skipped when the previous output sums positive, or an expert's
  output doubled when it sums positive (a branch on a value only: exact under replay);
- ``state_write``: a counter or buffer written in the forward (an attribute, a buffer, a plain tensor attribute,
  an ``OrderedDict``, a ``defaultdict``, a list inside a dict, a plain object's attribute, a module global, a
  closure variable of a module-level function, a class attribute),
  the block's output scaled by the count: exact where pass 1's write is undone, else a refusal;
- ``rng_between_calls``: a random number drawn after each expert call and scaling its output (torch's global
  generator, Python's, numpy's, a ``torch.Generator`` / ``random.Random`` the block holds);
- ``block_input_inplace``: the block's input edited in place at the top of the forward (unchanged or scaled):
  exact, pass 1 running on a copy of the input and pass 2 making the edit once;
- ``cache_order``: the loop around an expert call runs reversed on the first call, as a Python-side cache
  (a dict on the block, an ``OrderedDict``, a class attribute, an attribute created on first call) records;
- ``nd_expert_call``: an expert called on its rows with leading dims added (``expert(rows[None])[0]``, a 3-D or
  4-D call): exact where the expert is proven to treat leading dims alike (moved as its rows), else a
  ``ReplayError`` naming the construct.

State that lives across calls is reset before each call of the block by a forward pre-hook registered after
apply (``Edit.after_apply``, on the reference and the EP copy alike): every call of the block then computes the
same (each slice of the per-rank reference as the EP rank's one call), while a write of pass 1 that replay does
not undo is still seen by pass 2, within the one call. Global generators are seeded the same way.
"""

from __future__ import annotations

import ast
import collections
import copy
import inspect
import random
import types

import numpy as np
import torch
from mutation_source import Edit, expr, slots, stmt
from torch import nn

SEEN = "_autoep_seen"  # the function's list of expert outputs, in call order
PRELUDE = '''
import collections, random, types
import numpy as np


def _autoep_keep(seen, out):
    seen.append(out)
    return out


def _autoep_chain(seen, rows):
    return rows + 0.5 * seen[-1].sum().to(rows.dtype) if seen else rows


def _autoep_positive(seen):
    return bool(seen) and bool(seen[-1].sum() > 0)


def _autoep_doubled(out):
    return out * 2 if bool(out.sum() > 0) else out


def _autoep_order(cache, items):
    items = list(items)
    if "order" not in cache:
        cache["order"] = "reversed"
        return items[::-1]
    return items


def _autoep_cache_of(owner):
    if not hasattr(owner, "autoep_lazy_cache"):
        owner.autoep_lazy_cache = {}
    return owner.autoep_lazy_cache


def _autoep_closure_counter():
    calls = [0]

    def step():
        calls[0] += 1
        return calls[0]

    return step


_autoep_step = _autoep_closure_counter()
_AUTOEP_CALLS = [0]
'''


# ---------------------------------------------------------------------------------------------
# Where the experts are called
# ---------------------------------------------------------------------------------------------


def _generators(node: ast.AST) -> list:
    if isinstance(node, ast.For):
        return [node]
    if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp, ast.DictComp)):
        return node.generators
    return []


def _expert_names(tree: ast.AST) -> set[str]:
    """Names a loop or comprehension binds from an iterable that reads ``self`` (``expert`` in ``for e, expert in
    enumerate(self.experts)``, ``zip(chunks, self.experts)``, ``self.expert_by_id.items()``)."""
    names = set()
    for node in ast.walk(tree):
        for g in _generators(node):
            if any(isinstance(n, ast.Name) and n.id == "self" for n in ast.walk(g.iter)):
                names |= {n.id for n in ast.walk(g.target) if isinstance(n, ast.Name)}
    return names


def expert_calls(tree: ast.AST) -> list[ast.Call]:
    """One-argument calls of an expert: ``self.<container>[i](rows)`` or ``expert(rows)`` for a name bound from
    ``self``'s experts, in source order."""
    names = _expert_names(tree)

    def is_expert(c: ast.Call) -> bool:
        f = c.func
        by_index = isinstance(f, ast.Subscript) and isinstance(f.value, ast.Attribute) and \
            isinstance(f.value.value, ast.Name) and f.value.value.id == "self"
        return (by_index or (isinstance(f, ast.Name) and f.id in names)) and len(c.args) == 1 and not c.keywords

    found = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and is_expert(n)]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def _enclosing_iters(tree: ast.AST, call: ast.Call) -> list[ast.AST]:
    """The loops and comprehension generators around ``call`` (outermost first; their ``iter`` is replaced)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and any(n is call for part in node.body for n in ast.walk(part)):
            out.append(node)
        for g in node.generators if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)) else ():
            if any(n is call for n in ast.walk(node)) and not any(n is call for n in ast.walk(g.iter)):
                out.append(g)
    return out


def _replace(tree: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
            elif isinstance(value, list):
                for i, v in enumerate(value):
                    if v is old:
                        value[i] = new


def _kept(tree: ast.FunctionDef) -> list[ast.Call]:
    """``tree`` with ``_autoep_seen = []`` first and every expert call ``c`` written ``_autoep_keep(seen, c)``;
    returns the expert calls (now inside the wrappers), in source order."""
    found = expert_calls(tree)
    for c in found:
        _replace(tree, c, ast.Call(ast.Name("_autoep_keep", ast.Load()), [ast.Name(SEEN, ast.Load()), c], []))
    tree.body.insert(_after_docstring(tree), stmt(f"{SEEN} = []")[0])
    return found


def _after_docstring(tree: ast.FunctionDef) -> int:
    first = tree.body[0]
    return int(isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str))


def _experts_calling(site) -> bool:
    return site.role in ("block", "experts") and site.helper is None


def _per_call(fn, site, variants: list, mutate) -> list[Edit]:
    """One edit per (expert call, variant): ``mutate(tree, call, variant)`` on a copy whose calls are kept,
    returning ``(tweak, after_apply)`` or None."""
    if not _experts_calling(site):
        return []
    edits = []
    for k in range(len(expert_calls(fn))):
        for variant in variants:
            tree = copy.deepcopy(fn)
            call = _kept(tree)[k]
            tweak, after_apply = mutate(tree, call, variant) or (None, None)
            edits.append(Edit(tree, PRELUDE, tweak=tweak, after_apply=after_apply))
    return edits


def _scale_returns(tree: ast.FunctionDef, factor: str) -> None:
    """Every returned tensor (a tuple's first) times ``factor``."""
    for s in slots(tree):
        if isinstance(s.stmt, ast.Return) and s.stmt.value is not None:
            ret = s.stmt.value
            old = ret.elts[0] if isinstance(ret, ast.Tuple) else ret
            _replace(tree, old, expr(f"__r__ * ({factor})", __r__=old))


def _reset_before_each_call(reset):
    """``after_apply``: a forward pre-hook on the block that calls ``reset(module)`` on every module where
    ``reset`` applies (returns True), before each call."""

    def after_apply(block: nn.Module) -> None:
        def hook(module, args):
            for m in block.modules():
                reset(m)

        block.register_forward_pre_hook(hook)

    return after_apply


# ---------------------------------------------------------------------------------------------
# The operators
# ---------------------------------------------------------------------------------------------


def op_chain_expert_input(fn, site):
    def mutate(tree, call, _):
        call.args[0] = expr(f"_autoep_chain({SEEN}, __a__)", __a__=call.args[0])

    return _per_call(fn, site, [None], mutate)


def op_branch_on_output(fn, site):
    def mutate(tree, call, variant):
        if variant == "skip":
            rows = call.args[0]
            _replace(tree, call, expr(f"(__a__ * 0 if _autoep_positive({SEEN}) else __c__)", __a__=rows, __c__=call))
        else:
            _replace(tree, call, expr("_autoep_doubled(__c__)", __c__=call))

    return _per_call(fn, site, ["skip", "value"], mutate)


def _holder(attr: str, make):
    """A tweak giving each re-classed module a fresh plain attribute ``attr = make()`` (not a buffer)."""

    def tweak(obj: nn.Module) -> None:
        setattr(obj, attr, make())

    return tweak


# variant -> (statement, the count it reads, tweak, reset of one module before each call)
STATE_WRITES = {
    "attribute": ("self.autoep_calls = getattr(self, 'autoep_calls', 0) + 1", "self.autoep_calls", None,
                  lambda m: m.__dict__.pop("autoep_calls", None)),
    "buffer": ("self.autoep_count += 1", "self.autoep_count",
               lambda obj: obj.register_buffer("autoep_count", torch.zeros(()), persistent=False),
               lambda m: m._buffers["autoep_count"].zero_() if "autoep_count" in m._buffers else None),
    "tensor_attribute": ("self.autoep_stats += 1", "self.autoep_stats", _holder("autoep_stats", lambda: torch.zeros(())),
                         lambda m: m.__dict__["autoep_stats"].zero_() if "autoep_stats" in m.__dict__ else None),
    "ordered_dict": ("self.autoep_counts['calls'] = self.autoep_counts.get('calls', 0) + 1",
                     "self.autoep_counts['calls']", _holder("autoep_counts", collections.OrderedDict),
                     lambda m: m.__dict__["autoep_counts"].clear() if "autoep_counts" in m.__dict__ else None),
    "defaultdict": ("self.autoep_counts['calls'] += 1", "self.autoep_counts['calls']",
                    _holder("autoep_counts", lambda: collections.defaultdict(int)),
                    lambda m: m.__dict__["autoep_counts"].clear() if "autoep_counts" in m.__dict__ else None),
    "nested_list": ("self.autoep_counts['calls'].append(1)", "len(self.autoep_counts['calls'])",
                    _holder("autoep_counts", lambda: {"calls": []}),
                    lambda m: m.__dict__["autoep_counts"]["calls"].clear() if "autoep_counts" in m.__dict__ else None),
    "object_attribute": ("self.autoep_state.calls += 1", "self.autoep_state.calls",
                         _holder("autoep_state", lambda: types.SimpleNamespace(calls=0)),
                         lambda m: setattr(m.__dict__["autoep_state"], "calls", 0) if "autoep_state" in m.__dict__
                         else None),
    "module_global": ("_AUTOEP_CALLS[0] += 1", "_AUTOEP_CALLS[0]", None, lambda m: _reset_global_counter(m)),
    "closure": ("_autoep_count = _autoep_step()", "_autoep_count", None, lambda m: _reset_closure_counter(m)),
    "class_attribute": ("type(self).autoep_total = getattr(type(self), 'autoep_total', 0) + 1", "type(self).autoep_total",
                        None, lambda m: type(m).__dict__.get("autoep_total") and delattr(type(m), "autoep_total")),
}


def _reset_closure_counter(m: nn.Module) -> None:
    g = getattr(inspect.unwrap(type(m).forward), "__globals__", {})
    if "_autoep_step" in g:
        g["_autoep_step"].__closure__[0].cell_contents[0] = 0


def _reset_global_counter(m: nn.Module) -> None:
    g = getattr(inspect.unwrap(type(m).forward), "__globals__", {})
    if "_AUTOEP_CALLS" in g:
        g["_AUTOEP_CALLS"][0] = 0


def op_state_write(fn, site):
    """A counter or buffer written at the top of the forward, the output scaled by ``1 + 0.1 * count``."""
    if not _experts_calling(site) or not expert_calls(fn):
        return []
    edits = []
    for variant, (write, count, tweak, reset) in STATE_WRITES.items():
        tree = copy.deepcopy(fn)
        tree.body.insert(_after_docstring(tree), stmt(write)[0])
        _scale_returns(tree, f"1.0 + 0.1 * {count}")
        edits.append(Edit(tree, PRELUDE, tweak=tweak, after_apply=_reset_before_each_call(reset)))
    return edits


def _seed_globals(block: nn.Module) -> None:
    def hook(module, args):
        random.seed(0)
        np.random.seed(0)

    block.register_forward_pre_hook(hook)


# variant -> (the draw, tweak, reset of one module before each call)
DRAWS = {
    "torch": ("torch.rand(())", None, None),
    "python": ("random.random()", None, None),
    "numpy": ("float(np.random.rand())", None, None),
    "torch_generator": ("torch.rand((), generator=self.autoep_gen)",
                        _holder("autoep_gen", lambda: torch.Generator().manual_seed(0)),
                        lambda m: m.__dict__["autoep_gen"].manual_seed(0) if "autoep_gen" in m.__dict__ else None),
    "python_generator": ("self.autoep_random.random()", _holder("autoep_random", lambda: random.Random(0)),
                         lambda m: m.__dict__["autoep_random"].seed(0) if "autoep_random" in m.__dict__ else None),
}


def op_rng_between_calls(fn, site):
    """A random number drawn after an expert call, scaling its output: between two expert calls."""

    def mutate(tree, call, variant):
        draw, tweak, reset = DRAWS[variant]
        _replace(tree, call, expr(f"__c__ * (1.0 + 0.01 * {draw})", __c__=call))
        after_apply = _reset_before_each_call(reset) if reset is not None else _seed_globals
        return tweak, after_apply

    return _per_call(fn, site, list(DRAWS), mutate)


def op_block_input_inplace(fn, site):
    """The block's input edited in place at the top of its forward (under ``no_grad``: the input is a leaf
    that requires grad), keeping or changing its values."""
    args = fn.args.args
    if site.role != "block" or site.method != "forward" or len(args) < 2 or not expert_calls(fn):
        return []
    edits = []
    for edit in ("mul_(1.0)", "add_(0.5)"):
        tree = copy.deepcopy(fn)
        tree.body[_after_docstring(tree):_after_docstring(tree)] = stmt(f"with torch.no_grad():\n    {args[1].arg}.{edit}")
        edits.append(Edit(tree, PRELUDE))
    return edits


# variant -> (the cache expression, tweak, reset of one module before each call)
CACHES = {
    "dict": ("self.autoep_cache", _holder("autoep_cache", dict),
             lambda m: m.__dict__["autoep_cache"].clear() if "autoep_cache" in m.__dict__ else None),
    "ordered_dict": ("self.autoep_cache", _holder("autoep_cache", collections.OrderedDict),
                     lambda m: m.__dict__["autoep_cache"].clear() if "autoep_cache" in m.__dict__ else None),
    "class_attribute": ("self.autoep_class_cache", lambda obj: setattr(type(obj), "autoep_class_cache", {}),
                        lambda m: vars(type(m)).get("autoep_class_cache", {}).clear()),
    "created_on_first_call": ("_autoep_cache_of(self)", None, lambda m: m.__dict__.pop("autoep_lazy_cache", None)),
}


def op_cache_order(fn, site):
    """The loop around an expert call runs its items reversed on the block's first call (a cache records it)."""

    def mutate(tree, call, variant):
        loops = _enclosing_iters(tree, call)
        if not loops:
            return None
        cache, tweak, reset = CACHES[variant]
        loops[-1].iter = expr(f"_autoep_order({cache}, __i__)", __i__=loops[-1].iter)  # the innermost
        return tweak, _reset_before_each_call(reset)

    return [e for e in _per_call(fn, site, list(CACHES), mutate) if "_autoep_order" in ast.unparse(e.tree)]


def op_nd_expert_call(fn, site):
    """Each expert call made on its input with one or two leading dims added, the output indexed back."""

    def mutate(tree, call, variant):
        if len(call.args) != 1 or call.keywords or isinstance(call.args[0], ast.Starred):
            return None
        call.args[0] = expr(f"__a__{'[None]' * variant}", __a__=call.args[0])
        _replace(tree, call, expr(f"__c__{'[0]' * variant}", __c__=call))

    return [e for e in _per_call(fn, site, [1, 2], mutate) if "[None]" in ast.unparse(e.tree)]


REPLAY_OPERATORS = {
    "chain_expert_input": op_chain_expert_input,
    "branch_on_output": op_branch_on_output,
    "state_write": op_state_write,
    "rng_between_calls": op_rng_between_calls,
    "block_input_inplace": op_block_input_inplace,
    "cache_order": op_cache_order,
    "nd_expert_call": op_nd_expert_call,
}
