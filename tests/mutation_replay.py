"""Source operators for the one-pass execution's own obligations (issues 21 item 6, 30 item 7; see
``mutation_operators``).

The one-pass execution of module experts (``autoep.runtime.recipes.replay``, ``deferred``) runs a block's forward
once: each expert call answers a pending tensor, torch calls on pending values are taped and run after the token
exchange, chained calls travel in further exchanges, host reads of pending values raise naming the line. It is
exact only when what the forward does now (Python side effects, hooks, random draws) and what it defers (the
tensor work on expert outputs) together compute what the model computes. Each operator breaks or stresses this,
at each expert call of a function that calls experts (the block's forward, its helpers, an experts container's
own forward):

- ``chain_expert_input``: an expert's rows shifted by the sum of the previous expert call's output;
- ``branch_on_output``: the next expert call skipped when the previous output sums positive, or an expert's
  output doubled when it sums positive (a host read of a pending value: a ``ReplayError`` naming the line);
- ``state_write``: a counter or buffer written in the forward (an attribute, a buffer, a plain tensor attribute,
  an ``OrderedDict``, a ``defaultdict``, a list inside a dict, a plain object's attribute, a module global, a
  closure variable of a module-level function, a class attribute), the block's output scaled by the count;
- ``rng_between_calls``: a random number drawn after each expert call and scaling its output (torch's global
  generator, Python's, numpy's, a ``torch.Generator`` / ``random.Random`` the block holds);
- ``block_input_inplace``: the block's input edited in place at the top of the forward (unchanged or scaled);
- ``cache_order``: the loop around an expert call runs reversed on the first call, as a Python-side cache
  (a dict on the block, an ``OrderedDict``, a class attribute, an attribute created on first call) records;
- ``nd_expert_call``: an expert called on its rows with leading dims added (``expert(rows[None])[0]``, a 3-D or
  4-D call): exact where the expert is proven to treat leading dims alike (moved as its rows), else a
  ``ReplayError`` naming the construct.

The doors of the one pass (issue 30 item 7), each inserted at each expert call, what it counts or draws scaling
the call's output (so a write made twice, missed, made on other rows or read after later writes changes it);
the state outside the block lives in ``mutation_side_effects`` (another module of the user's project):

- ``side_effects``: a list in another module (holding the outputs), a mutable default argument of the forward, a
  helper object's class-level list, nested dicts of stats, a ``collections.Counter``, a ``__slots__`` object,
  ``itertools.count``, a logging handler (its record counted; or formatting the output's norm: a host read); a
  buffer the output is scaled by, edited after the call through ``.data`` or in place, a CPU tensor written
  through a numpy view;
- ``expert_hooks``: forward pre-hooks (counting rows, scaling the input), forward hooks (scaling the output) and a
  full backward hook on every expert, registered after apply; pre-hooks and forward hooks registered inside the
  forward around the call and removed after it; a forward hook on the gate collecting logits (the call sites read
  them); a tensor hook on the expert's output; a hook on a module inside each expert (a ``ReplayError``);
- ``rng_held_elsewhere``: a ``torch.Generator`` or numpy ``Generator`` in another module drawing at each call (a
  scalar, a mask by the output's shape, a mask drawn on ``full_like(output)``);
- ``matching_chain``: an expert's input from the previous call's output with forward values that match its rows
  (a ReZero scale initialised at 0, a learned parameter; a straight-through ``a + (rows - a).detach()``);
- ``call_context`` / ``autocast_call``: the call made under ``torch.no_grad()`` / ``torch.enable_grad()`` / ``torch.
  autocast('cpu', dtype=torch.bfloat16)`` entered inside the forward around it.

State that lives across calls is reset before each call of the block by a forward pre-hook registered after
apply (``Edit.after_apply``, on the reference and the EP copy alike): every call of the block then computes the
same (each slice of the per-rank reference as the EP rank's one call), while a write made twice within the one
call still shows. Global generators are seeded the same way.
"""

from __future__ import annotations

import ast
import collections
import copy
import dataclasses
import inspect
import random
import types

import numpy as np
import torch
from mutation_source import Edit, expr, slots, stmt
from torch import nn

from autoep.detect.built_lists import family_ref

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


# ---------------------------------------------------------------------------------------------
# The one-pass doors (issue 30 item 7): state outside the block, hooks, generators held elsewhere, chains whose
# forward values match, contexts entered around a call. Each is inserted at each expert call; what it counts or
# draws scales the call's output, so a write made twice, missed, made on other rows or read late changes it.
# ---------------------------------------------------------------------------------------------

FX = "_autoep_fx"  # ``mutation_side_effects`` (another module of the user's project) as the mutants import it
DOORS_PRELUDE = f'''
import mutation_side_effects as {FX}


def _autoep_under(ctx, thunk):
    with ctx:
        return thunk()


def _autoep_rezero(seen, rows, alpha):
    return rows + alpha * seen[-1].mean().to(rows.dtype) if seen else rows


def _autoep_straight_through(seen, rows):
    if not seen:
        return rows
    a = rows * (1.0 + seen[-1].mean().to(rows.dtype))
    return a + (rows - a).detach()
'''


def _fx_reset(block: nn.Module) -> None:
    """``after_apply``: ``mutation_side_effects.reset()`` before each call of the block."""
    import mutation_side_effects

    block.register_forward_pre_hook(lambda module, args: mutation_side_effects.reset())


def _and_fx_reset(reset):
    """``after_apply``: reset ``mutation_side_effects`` and each module (``reset(m)``) before each call."""
    per_module = _reset_before_each_call(reset) if reset is not None else (lambda block: None)

    def after_apply(block: nn.Module) -> None:
        _fx_reset(block)
        per_module(block)

    return after_apply


def _door_edits(fn, site, variants: dict, mutate) -> list[Edit]:
    """``_per_call`` with the doors' prelude; ``mutate(tree, call, variant)`` returns ``(tweak, after_apply)``."""
    return [dataclasses.replace(e, prelude=PRELUDE + DOORS_PRELUDE) for e in _per_call(fn, site, list(variants), mutate)]


def _attr_reset(attr: str, reset):
    return lambda m: reset(m.__dict__[attr]) if attr in m.__dict__ else None


def _kwdefaults_reset(method: str, name: str):
    def reset(m: nn.Module) -> None:
        fn = inspect.unwrap(getattr(type(m), method, None) or (lambda: None))
        store = (getattr(fn, "__kwdefaults__", None) or {}).get(name)
        if isinstance(store, list):
            store.clear()

    return reset


def _set_counts(stats: dict) -> None:
    for entry in stats["experts"].values():
        entry["n"] = 0


def _slots_zero(s) -> None:
    s.calls, s.rows = 0, 0


def _mutable_default(tree: ast.FunctionDef, site) -> tuple:
    """The function gains a keyword-only ``_autoep_calls=[]`` (a mutable default argument, shared by every call)."""
    tree.args.kwonlyargs.append(ast.arg("_autoep_calls"))
    tree.args.kw_defaults.append(ast.List([], ast.Load()))
    return None, _and_fx_reset(_kwdefaults_reset(site.method, "_autoep_calls"))


def _buffer(obj: nn.Module) -> None:
    obj.register_buffer("autoep_scale", torch.ones(()), persistent=False)


def _buffer_reset(m: nn.Module) -> None:
    if "autoep_scale" in m._buffers:
        m._buffers["autoep_scale"].data.fill_(1.0)


def _host_reset(m: nn.Module) -> None:
    if "autoep_host" in m.__dict__:
        m.__dict__["autoep_host"].numpy()[:] = 1.0


# variant -> (the call ``__c__`` replaced by, tweak, reset of one module before each call); a callable in place of
# the triple edits the tree itself (``(tree, site) -> (tweak, after_apply)``) besides the replacement it gives.
SIDE_EFFECTS = {
    # a list in another module holding the outputs (kept pending until the block returns)
    "other_module_list": (f"{FX}.kept_in_list(__c__)", None, None),
    "mutable_default": (f"{FX}.counted(_autoep_calls, __c__)", _mutable_default, None),
    # a helper object whose list is its class's: deep copies share it
    "class_list": (f"{FX}.counted(self.autoep_stats.calls, __c__)",
                   _holder("autoep_stats", lambda: __import__("mutation_side_effects").Stats()), None),
    "nested_dicts": (f"{FX}.nested(self.autoep_stats, __c__)",
                     _holder("autoep_stats", lambda: {"experts": {"calls": {"n": 0}, "rows": {"n": 0}}}),
                     _attr_reset("autoep_stats", _set_counts)),
    "counter": (f"{FX}.hits(self.autoep_hits, __c__)", _holder("autoep_hits", collections.Counter),
                _attr_reset("autoep_hits", collections.Counter.clear)),
    "slots_object": (f"{FX}.slot_counted(self.autoep_slots, __c__)",
                     _holder("autoep_slots", lambda: __import__("mutation_side_effects").Slots()),
                     _attr_reset("autoep_slots", _slots_zero)),
    "itertools_count": (f"{FX}.ticketed(__c__)", None, None),
    "logging_handler": (f"{FX}.logged(__c__)", None, None),
    # the handler formats the record, reading the output's norm on the host: raises where it is pending
    "logging_value": (f"{FX}.logged_value(__c__)", None, None),
    # a buffer the output is scaled by, edited after the call: through ``.data`` (no version counter moves) ...
    "buffer_data": (f"{FX}.data_bumped(self, __c__)", _buffer, _buffer_reset),
    # ... and in place under no_grad (the version counter moves: the read would be late, a clear error)
    "buffer_inplace": (f"{FX}.inplace_bumped(self, __c__)", _buffer, _buffer_reset),
    "numpy_view": (f"{FX}.numpy_bumped(self, __c__)", _holder("autoep_host", lambda: torch.ones(1)), _host_reset),
}


def op_side_effects(fn, site):
    """State outside the block (another module, a mutable default, a class-level list, nested dicts, a Counter, a
    ``__slots__`` object, ``itertools.count``, a logging handler) or outside autograd's view (a buffer written
    through ``.data`` or in place, a CPU tensor written through numpy) written at an expert call, its output scaled by
    what was counted."""

    def mutate(tree, call, variant):
        replacement, tweak, reset = SIDE_EFFECTS[variant]
        _replace(tree, call, expr(replacement, __c__=call))
        if tweak is _mutable_default:
            return _mutable_default(tree, site)
        return tweak, _and_fx_reset(reset)

    return _door_edits(fn, site, SIDE_EFFECTS, mutate)


def _expert_modules(block: nn.Module) -> list[nn.Module]:
    """The block's experts: those autoep placed (an EP copy; stand-ins for other ranks' experts included), else
    those the fuzzer finds on the model."""
    from autoep.runtime.recipes.local_experts import placed_experts, spec_of
    from mutation_runtime import expert_list

    spec = spec_of(block)
    # One expert of several modules (``lora_A[i]``, ``lora_B[i]``): its first, as the model's container (the
    # fuzzer's ``experts_attr``) holds them; every member would hook modules the model's run does not.
    return placed_experts(block, spec)[:spec.num_experts:spec.members] if spec is not None else expert_list(block)


def _gate_of(block: nn.Module) -> nn.Module | None:
    """The block's gate: its first ``nn.Linear`` child (``gate``, ``router``, ``classifier``)."""
    return next((m for m in block.children() if isinstance(m, nn.Linear)), None)


def _on_experts(register):
    """``after_apply``: ``register(expert)`` on each expert, then the side-effects module reset before each call."""

    def after_apply(block: nn.Module) -> None:
        for expert in _expert_modules(block):
            register(expert)
        _fx_reset(block)  # after the experts' hooks: registered on the block, it runs first anyway

    return after_apply


def _inner_hook(expert: nn.Module) -> None:
    import mutation_side_effects as fx

    inner = next((m for name, m in expert.named_modules() if name), None)
    if inner is not None:
        inner.register_forward_hook(fx.scale_output_hook)


def _gate_hook(block: nn.Module) -> None:
    import mutation_side_effects as fx

    gate = _gate_of(block)
    if gate is not None:
        gate.register_forward_hook(fx.collect_logits_hook)
    _fx_reset(block)


def _fx_hook(name: str, kind: str):
    import mutation_side_effects as fx

    return lambda expert: getattr(expert, kind)(getattr(fx, name))


# variant -> (the call replaced by (``__f__``: the called expert), after_apply)
HOOKS = {
    # registered after apply, on every expert (the call sites read what they counted)
    "pre_hook_rows": (f"{FX}.by_hook_rows(__c__)", _on_experts(_fx_hook("count_rows_pre_hook",
                                                                         "register_forward_pre_hook"))),
    "pre_hook_scale_input": ("__c__", _on_experts(_fx_hook("scale_input_pre_hook", "register_forward_pre_hook"))),
    "forward_hook_scale_output": ("__c__", _on_experts(_fx_hook("scale_output_hook", "register_forward_hook"))),
    "backward_hook": ("__c__", _on_experts(_fx_hook("scale_grad_input_hook", "register_full_backward_hook"))),
    # on the gate, collecting its logits; the call sites read them
    "gate_logits": (f"{FX}.by_gate_logits(__c__)", _gate_hook),
    # registered inside the forward, around the call, and removed after it
    "pre_hook_in_forward": (f"{FX}.removed(__f__.register_forward_pre_hook({FX}.scale_input_pre_hook), __c__)",
                            _fx_reset),
    "forward_hook_in_forward": (f"{FX}.removed(__f__.register_forward_hook({FX}.scale_output_hook), __c__)",
                                _fx_reset),
    # a tensor hook on the expert's output scaling its gradient
    "tensor_hook": (f"{FX}.grad_scaled(__c__)", _fx_reset),
    # on a module inside each expert: it would run on the owner's rows (a clear error)
    "inner_module_hook": ("__c__", _on_experts(_inner_hook)),
}


def op_expert_hooks(fn, site):
    """Hooks of each kind: forward pre-hooks and forward hooks on the experts (counting rows, scaling the input or
    the output) and a full backward hook, registered after apply or inside the forward around the call; a forward
    hook on the gate collecting logits; a tensor hook on an expert's output; a hook on a module inside an expert."""

    def mutate(tree, call, variant):
        replacement, after_apply = HOOKS[variant]
        if replacement != "__c__":
            _replace(tree, call, expr(replacement, __c__=call, __f__=call.func))
        return None, after_apply

    return _door_edits(fn, site, HOOKS, mutate)


# variant -> the call replaced by
GENERATORS_ELSEWHERE = {
    "torch_generator": f"{FX}.torch_drawn(__c__)",
    "numpy_generator": f"{FX}.numpy_drawn(__c__)",
    "torch_generator_mask": f"{FX}.masked(__c__)",  # a mask by the output's shape, then a scalar
    "torch_generator_like": f"{FX}.bernoulli_like(__c__)",  # a mask drawn on full_like(output), then a scalar
}


def op_rng_held_elsewhere(fn, site):
    """A ``torch.Generator`` or numpy ``Generator`` held in another module drawing at each expert call (a scalar,
    a mask by the output's shape, a mask drawn on a tensor made from the output), scaling its output."""

    def mutate(tree, call, variant):
        _replace(tree, call, expr(GENERATORS_ELSEWHERE[variant], __c__=call))
        return None, _fx_reset

    return _door_edits(fn, site, GENERATORS_ELSEWHERE, mutate)


def _alpha(obj: nn.Module) -> None:
    obj.register_parameter("autoep_alpha", nn.Parameter(torch.zeros(())))


def op_matching_chain(fn, site):
    """An expert's input computed from the previous call's output with forward values that match the rows: a
    learned scale initialised at 0 (ReZero: ``rows + alpha * prev.mean()``, alpha's gradient nonzero), or a
    straight-through ``a + (rows - a).detach()`` with ``a`` from the previous output."""

    def mutate(tree, call, variant):
        if variant == "rezero":
            call.args[0] = expr(f"_autoep_rezero({SEEN}, __a__, self.autoep_alpha)", __a__=call.args[0])
            return _alpha, None
        call.args[0] = expr(f"_autoep_straight_through({SEEN}, __a__)", __a__=call.args[0])
        return None, None

    return _door_edits(fn, site, {"rezero": 0, "straight_through": 0}, mutate)


# variant -> the grad mode entered around the call inside the forward
GRAD_MODES = {
    "no_grad": "_autoep_under(torch.no_grad(), lambda: __c__)",
    "enable_grad": "_autoep_under(torch.enable_grad(), lambda: __c__)",
}


def op_call_context(fn, site):
    """The expert call made under ``torch.no_grad()`` or ``torch.enable_grad()`` entered inside the forward
    around it."""

    def mutate(tree, call, variant):
        _replace(tree, call, expr(GRAD_MODES[variant], __c__=call))

    return _door_edits(fn, site, GRAD_MODES, mutate)


def op_autocast_call(fn, site):
    """The expert call made under ``torch.autocast('cpu', dtype=torch.bfloat16)`` entered inside the forward around
    it, its output cast back to fp32. Judged at one bf16 ulp (``mutation_ranks.LOW_PRECISION``): the owner runs one
    bf16 GEMM over every call's rows of an expert where the model runs one per call."""

    def mutate(tree, call, _):
        _replace(tree, call, expr("_autoep_under(torch.autocast('cpu', dtype=torch.bfloat16), lambda: __c__).float()",
                                  __c__=call))

    return _door_edits(fn, site, {"bf16": 0}, mutate)


REPLAY_OPERATORS |= {
    "side_effects": op_side_effects,
    "expert_hooks": op_expert_hooks,
    "rng_held_elsewhere": op_rng_held_elsewhere,
    "matching_chain": op_matching_chain,
    "call_context": op_call_context,
    "autocast_call": op_autocast_call,
}


# ---------------------------------------------------------------------------------------------
# Experts by role (issue 31): aligned containers misaligned, a shared list reached by routed rows
# ---------------------------------------------------------------------------------------------

ROLES_PRELUDE = '''
import torch


def _autoep_pick(rows):
    return torch.where(rows[:, 0] > 0)[0]


def _autoep_scatter(rows, pick, out):
    return out.new_zeros(rows.shape[0], out.shape[-1]).index_add(0, pick, out)
'''


def _indexed_calls(tree: ast.AST) -> dict[str, list[tuple[ast.Call, str]]]:
    """Calls ``self.<container>[<name>](...)`` and reads ``getattr(self, f"<prefix>{<name>}")`` of numbered
    attributes, by the index name: ``{name: [(call or read, container or prefix), ...]}``."""
    out: dict[str, list[tuple[ast.Call, str]]] = {}
    for node in ast.walk(tree):
        f = node.func if isinstance(node, ast.Call) else None
        if isinstance(f, ast.Subscript) and isinstance(f.slice, ast.Name) and isinstance(f.value, ast.Attribute) \
                and isinstance(f.value.value, ast.Name) and f.value.value.id == "self":
            out.setdefault(f.slice.id, []).append((node, f.value.attr))
        ref = family_ref(node)
        if ref is not None and isinstance(ref[1], ast.Name):
            out.setdefault(ref[1].id, []).append((node, ref[0]))
    return out


def _aligned_calls(tree: ast.AST) -> list[tuple[ast.Call, str]]:
    """Each call of a container indexed by a name that indexes another container too: ``(call, container)``."""
    return [pair for calls in _indexed_calls(tree).values() if len({c for _, c in calls}) > 1 for pair in calls]


def _resized(container: str, change: str):
    def tweak(obj: nn.Module) -> None:
        entries = getattr(obj, container)
        if change == "longer":
            entries.append(copy.deepcopy(entries[-1]))
        else:
            del entries[-1]

    return tweak


def _renumbered(prefix: str, change: str):
    """Numbered attributes ``<prefix>0..<prefix>{n-1}`` one longer (a copy of the last, ``<prefix>{n}``) or shorter."""

    def tweak(obj: nn.Module) -> None:
        n = sum(1 for name in obj._modules if name[len(prefix):].isdigit() and name.startswith(prefix))
        if change == "longer":
            obj.add_module(f"{prefix}{n}", copy.deepcopy(obj._modules[f"{prefix}{n - 1}"]))
        else:
            del obj._modules[f"{prefix}{n - 1}"]

    return tweak


def op_misalign_containers(fn, site):
    """Containers indexed by one expert id (``lora_A[i]``, ``lora_B[i]``) misaligned: one of them indexed by the
    next id (``lora_B[(i + 1) % len(self.lora_B)]``), or one entry longer or shorter than the others."""
    if not _experts_calling(site):
        return []
    edits = []
    for k, (_, container) in enumerate(_aligned_calls(fn)):
        numbered = family_ref(_aligned_calls(fn)[k][0]) is not None
        for variant in ("shift", "longer", "shorter"):
            tree = copy.deepcopy(fn)
            call, _ = _aligned_calls(tree)[k]
            if variant == "shift" and numbered:  # getattr(self, f"lora_B{(i + 1) % <how many lora_B*>}")
                formatted = call.args[1].values[1]
                formatted.value = expr(f"(__i__ + 1) % sum(1 for n in self._modules if n.startswith({container!r}))",
                                       __i__=formatted.value)
                edits.append(Edit(tree, ROLES_PRELUDE))
            elif variant == "shift":
                index = call.func.slice
                call.func.slice = expr(f"(__i__ + 1) % len(self.{container})", __i__=index)
                edits.append(Edit(tree, ROLES_PRELUDE))
            elif numbered:
                edits.append(Edit(tree, ROLES_PRELUDE, tweak=_renumbered(container, variant)))
            else:
                edits.append(Edit(tree, ROLES_PRELUDE, tweak=_resized(container, variant)))
    return edits


def _whole_calls(tree: ast.AST) -> list[tuple[ast.Call, str]]:
    """Calls ``s(a)`` of a name a loop binds from ``self.<container>`` with no id (``for s in self.shared``):
    ``(call, container)``."""
    out = []
    for node in ast.walk(tree):
        for g in _generators(node):
            it = g.iter
            if isinstance(g.target, ast.Name) and isinstance(it, ast.Attribute) and isinstance(it.value, ast.Name) \
                    and it.value.id == "self":
                body = node.body if isinstance(node, ast.For) else [node]
                out += [(c, it.attr) for part in body for c in ast.walk(part) if isinstance(c, ast.Call)
                        and isinstance(c.func, ast.Name) and c.func.id == g.target.id and len(c.args) == 1]
    return sorted(out, key=lambda pair: (pair[0].lineno, pair[0].col_offset))


def op_route_shared(fn, site):
    """A list every row reaches (``for s in self.shared_experts: y = y + s(x)``) reached by routed rows: its first
    entry added to each routed expert call on that call's rows (refused: not selected by the expert id), or each of
    its calls made on some rows only (those with a positive first feature, scattered back: still every row's
    business, exact where it stays where the token is)."""
    if not _experts_calling(site) or not _whole_calls(fn):
        return []
    edits = []
    for k in range(len(expert_calls(fn))):
        tree = copy.deepcopy(fn)
        _, container = _whole_calls(tree)[0]
        call = expert_calls(tree)[k]
        if isinstance(call.func, ast.Name) and call.func.id in {c.func.id for c, _ in _whole_calls(tree)}:
            continue  # a call of the shared list itself
        _replace(tree, call, expr(f"(__c__ + self.{container}[0](__a__))", __c__=call, __a__=call.args[0]))
        edits.append(Edit(tree, ROLES_PRELUDE))
    for k in range(len(_whole_calls(fn))):
        tree = copy.deepcopy(fn)
        call, _ = _whole_calls(tree)[k]
        rows = call.args[0]
        picked = copy.deepcopy(call)
        picked.args[0] = expr("__a__[_autoep_pick(__a__)]", __a__=rows)
        _replace(tree, call, expr("_autoep_scatter(__a__, _autoep_pick(__a__), __c__)", __a__=rows, __c__=picked))
        edits.append(Edit(tree, ROLES_PRELUDE))
    return edits


REPLAY_OPERATORS |= {
    "misalign_containers": op_misalign_containers,
    "route_shared": op_route_shared,
}
