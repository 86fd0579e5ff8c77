"""Source operators for the model as a live object (issue 17; see ``mutation_operators``).

Splice fidelity: a block attribute read as a private ``self.__x`` (set, mangled, on the instance); a
routed scale given as a default argument, positional or keyword-only, whose global is rebound after the
class is defined (the default keeps the old value); a routed scale read from a closure variable that a
forward pre-hook rebinds on every call (from the seed the call runs under: the model's method and its
spliced twin must share the cell). Autograd: the routing weights edited in place after the expert loop
or experts call; the statement that adds the experts' output back run only ``if out.numel() > 0``
(torchtune's ``MoE.forward``: a rank without tokens drops the exchange's output from its graph).

Facts re-checked where they can change (issue 20), each guarding rows mixed in the experts' forward: a default
argument whose global is rebound after the class is defined; a module global and a plain settings class's
attribute set after apply (around each forward); an instance flag set by a user pre-hook registered on the
block after apply (after autoep's own per-call check).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import inspect

import torch
from torch import nn
from mutation_source import (
    INDEX_LIKE,
    ROUTING_LIKE,
    Edit,
    bound_names,
    each,
    expert_loops,
    experts_call_slots,
    expr,
    self_attr,
    slots,
    stmt,
    swap,
)

MAX_PER_SITE = 3  # private-name edits per function: enough kinds of attribute, few mutants


def _block(site) -> bool:
    return site.role == "block"


def _mangled(obj, name: str) -> str:
    return f"_{type(obj).__name__.lstrip('_')}__{name}"


def op_private_attr(fn, site):
    """Every read of one block attribute ``self.x`` spelled ``self.__x``; the instance holds the value under
    the mangled name too (``object.__setattr__``: a module is not registered twice). Benign."""
    if not _block(site):
        return []

    def locate(tree):
        names = []
        for node in ast.walk(tree):
            attr = self_attr(node)
            if attr and isinstance(node.ctx, ast.Load) and not attr.startswith("_") and attr not in names \
                    and attr not in ("experts", "training") and not callable(getattr(site.cls, attr, None)):
                names.append(attr)
        return sorted(names)[:MAX_PER_SITE]

    def mutate(tree, name):
        for node in ast.walk(tree):
            if self_attr(node) == name and isinstance(node.ctx, ast.Load):
                node.attr = f"__{name}"

        def tweak(obj):
            if hasattr(obj, name):
                object.__setattr__(obj, _mangled(obj, name), getattr(obj, name))

        return tweak

    return each(fn, locate, mutate)


ROUTED_SCALE = "AUTOEP_ROUTED_SCALE"


def _returned(tree) -> list[ast.expr]:
    """The first returned value of each ``return`` (a tuple's first element)."""
    out = []
    for s in slots(tree):
        if isinstance(s.stmt, ast.Return) and s.stmt.value is not None:
            value = s.stmt.value
            out.append(value.elts[0] if isinstance(value, ast.Tuple) and value.elts else value)
    return out


def _scaled_by_default(keyword_only: bool):
    def op(fn, site):
        a = fn.args
        if not _block(site) or site.method != "forward" or not _returned(fn) or (a.vararg and not keyword_only):
            return []
        tree = copy.deepcopy(fn)
        if keyword_only:
            tree.args.kwonlyargs.append(ast.arg(arg="routed_scale"))
            tree.args.kw_defaults.append(expr(ROUTED_SCALE))
        else:
            tree.args.args.append(ast.arg(arg="routed_scale"))
            tree.args.defaults.append(expr(ROUTED_SCALE))
        for value in _returned(tree):
            swap(tree, value, expr("__v__ * routed_scale", __v__=value))

        def tweak(obj):
            # After the class is defined: its default stays 1.5, a re-evaluated one would read 3.0.
            type(obj).forward.__globals__[ROUTED_SCALE] = 3.0

        return [Edit(tree, f"{ROUTED_SCALE} = 1.5", tweak)]

    return op


op_default_arg = _scaled_by_default(keyword_only=False)
op_kwdefault_arg = _scaled_by_default(keyword_only=True)


def op_closure_rebound(fn, site):
    """The returned value scaled by the closure variable ``routed_scale``, which a forward pre-hook on the
    block rebinds before every call to a value of the seed the call runs under (the same for the model's
    run and the EP run of one slice; a copy of the value taken at apply would be another slice's)."""
    if not _block(site) or site.method != "forward" or not _returned(fn):
        return []
    tree = copy.deepcopy(fn)
    for value in _returned(tree):
        swap(tree, value, expr("__v__ * routed_scale", __v__=value))

    def tweak(obj):
        method = type(obj).forward
        cell = method.__closure__[method.__code__.co_freevars.index("routed_scale")]

        def rebind(module, args):
            cell.cell_contents = 1.0 + (torch.initial_seed() % 7) / 4

        obj.register_forward_pre_hook(rebind)

    return [Edit(tree, tweak=tweak, closure={"routed_scale": 1.0})]


def _routing_reads(s, tree) -> list[str]:
    """Routing-weight names the statement reads that were bound before it."""
    before = {n for t in slots(tree) if t.stmt.lineno < s.stmt.lineno for n in bound_names(t.stmt)}
    reads = {n.id for n in ast.walk(s.stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return sorted(r for r in reads & before if ROUTING_LIKE.search(r) and not INDEX_LIKE.search(r))


def op_inplace_weights_after_loop(fn, site):
    """``weights.mul_(0.5)`` right after the expert loop or the experts call, for each routing-weight name
    it reads: the model's loop saved indexed copies of them; what the exchange saved must be its own."""
    if not _block(site):
        return []

    def locate(tree):
        regions = {id(r.stmt): r for r in [loop for loop, _, _ in expert_loops(tree)] + experts_call_slots(tree)}
        return [(s, w) for s in regions.values() for w in _routing_reads(s, tree)]

    def mutate(tree, loc):
        s, w = loc
        s.body.insert(s.index + 1, stmt(f"{w}.mul_(0.5)")[0])

    return each(fn, locate, mutate)


def op_drop_empty_output(fn, site):
    """The first statement reading the experts' output runs only ``if out.numel() > 0`` (torchtune's
    ``MoE.forward``), where the names it binds were bound before it (so both paths define them)."""
    if not _block(site):
        return []

    def locate(tree):
        found = []
        for s in experts_call_slots(tree):
            outs = bound_names(s.stmt) if isinstance(s.stmt, ast.Assign) else []
            if len(outs) != 1:
                continue
            for later in s.body[s.index + 1:]:
                reads = {n.id for n in ast.walk(later) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
                if outs[0] not in reads:
                    continue
                before = {n for t in s.body[:s.body.index(later)] for n in bound_names(t)}
                if not isinstance(later, (ast.Return, ast.If, ast.For, ast.While)) and set(bound_names(later)) <= before:
                    found.append((s, later, outs[0]))
                break
        return found

    def mutate(tree, loc):
        s, later, out = loc
        i = s.body.index(later)
        s.body[i] = ast.If(test=expr(f"{out}.numel() > 0"), body=[later], orelse=[])

    return each(fn, locate, mutate)


# --- issue 20: every fact a proof uses is re-checked where it can change -----------------------------------

EXPERT_MIX = "AUTOEP_EXPERT_MIX"  # a global of the edited module, read as a default or as a flag
MIXED = "{x} = {x} - {x}.mean(0, keepdim=True)"  # the rows centred over the batch: not row-local


def _expert_forward_input(fn, site) -> str | None:
    """The input name of the experts' own ``forward`` (batched, ModuleList or activation module); None elsewhere."""
    args = fn.args.args
    expert_side = site.role in ("experts", "expert") or site.role.startswith(("act", "experts:"))
    if not expert_side or site.method != "forward" or site.helper is not None or len(args) < 2 or args[0].arg != "self":
        return None
    return args[1].arg


def _mixing_under(fn, site, condition: str, **edit) -> list[Edit]:
    """``if <condition>: x = x - x.mean(0)`` first in the experts' forward: row-local only while it is false."""
    x = _expert_forward_input(fn, site)
    if x is None:
        return []
    tree = copy.deepcopy(fn)
    tree.body[:0] = stmt(f"if {condition}:\n    {MIXED.format(x=x)}")
    return [Edit(tree, **edit)]


@contextlib.contextmanager
def _set(obj, name: str, value, *, item: bool = False):
    """``obj[name]`` (``item``) or ``obj.name`` set to ``value`` inside, restored after."""
    old = obj[name] if item else getattr(obj, name)
    obj.__setitem__(name, value) if item else setattr(obj, name, value)
    try:
        yield
    finally:
        obj.__setitem__(name, old) if item else setattr(obj, name, old)


def op_expert_default_global(fn, site):
    """The experts' forward takes ``mix=AUTOEP_EXPERT_MIX`` (True when the class is defined, rebound to False
    after): its calls run with the default the function object holds (True: rows mixed), not today's global."""
    x = _expert_forward_input(fn, site)
    if x is None or fn.args.vararg:
        return []
    tree = copy.deepcopy(fn)
    tree.args.args.append(ast.arg(arg="autoep_mix"))
    tree.args.defaults.append(expr(EXPERT_MIX))
    tree.body[:0] = stmt(f"if autoep_mix:\n    {MIXED.format(x=x)}")

    def tweak(obj):
        inspect.unwrap(type(obj).forward).__globals__[EXPERT_MIX] = False

    return [Edit(tree, f"{EXPERT_MIX} = True", tweak)]


def op_expert_global_flag(fn, site):
    """``if AUTOEP_EXPERT_MIX:`` (a module global, False at detection and apply) mixes the experts' rows; the
    global is set True after apply (around each forward)."""
    return _mixing_under(fn, site, EXPERT_MIX, prelude=f"{EXPERT_MIX} = False",
                         around=lambda space: _set(space, EXPERT_MIX, True, item=True))


SETTINGS = "class AutoepExpertSettings:\n    mix = False\n"


def op_expert_class_flag(fn, site):
    """``if AutoepExpertSettings.mix:`` (a plain settings class's attribute, False at detection and apply) mixes
    the experts' rows; set True after apply (around each forward)."""
    return _mixing_under(fn, site, "AutoepExpertSettings.mix", prelude=SETTINGS,
                         around=lambda space: _set(space["AutoepExpertSettings"], "mix", True))


def _flip_by_pre_hook(block: nn.Module) -> None:
    """A forward pre-hook on the block, registered after apply (after autoep's own), setting ``autoep_mix`` on
    every module that has it before each call."""
    flagged = [m for m in block.modules() if "autoep_mix" in vars(m)]

    def flip(module, args):
        for m in flagged:
            m.autoep_mix = True

    block.register_forward_pre_hook(flip)


def op_expert_flag_by_hook(fn, site):
    """``if self.autoep_mix:`` (an instance flag, False at detection and apply) mixes the experts' rows; a user
    pre-hook registered on the block after apply sets it True before each call."""

    def tweak(obj):
        obj.autoep_mix = False

    return _mixing_under(fn, site, "self.autoep_mix", tweak=tweak, after_apply=_flip_by_pre_hook)


LIVE_OPERATORS = {
    "private_attr": op_private_attr,
    "default_arg": op_default_arg,
    "kwdefault_arg": op_kwdefault_arg,
    "closure_rebound": op_closure_rebound,
    "inplace_weights_after_loop": op_inplace_weights_after_loop,
    "drop_empty_output": op_drop_empty_output,
    "expert_default_global": op_expert_default_global,  # issue 20: facts re-checked where they can change
    "expert_global_flag": op_expert_global_flag,
    "expert_class_flag": op_expert_class_flag,
    "expert_flag_by_hook": op_expert_flag_by_hook,
}
