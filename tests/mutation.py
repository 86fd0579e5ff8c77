"""The soundness fuzzer's engine: mutate accepted MoE blocks, detect, and hold every accepted mutant to
exact parity with its own forward and backward (issue 8, "How it is proven").

A **target** builds a fresh tiny fp32 block in train mode, seeded (transformers 5.x classes and the
hand-written v4-style blocks of ``tests/blocks.py``). A **mutant** is one operator applied at one place:

- source mutants: one function's source (the block forward and the helpers it calls on ``self``, the
  router forward, the batched experts forward and the helpers it calls, the ModuleList expert forward),
  parsed, edited by one operator at one location, unparsed and exec'd as a method of a subclass of the
  original class (``class Qwen3MoeExperts(Qwen3MoeExperts): ...``) in a copy of the function's module,
  under a fake module and file registered in ``sys.modules`` and ``linecache`` so ``inspect.getsource``
  reads the mutant (checked; a temp ``.py`` file is the fallback). The object is re-classed in place.
- run-time-state mutants: no source change; an instance ``forward``, hooks, a ``__call__`` override,
  tied / frozen / heterogeneous experts, an instance ``_apply_gate``, a non-element-wise ``act_fn``.

Verdicts (``evaluate``): the detector raising anything but ``UnsupportedModuleStructure`` is a **crash**;
a mutant whose own forward/backward raises is **invalid** (listed, not counted, whatever the detector
said); a refusal is **refused**; otherwise the recipe from ``compute_fn_config`` runs on a deep copy at
``ep_mesh=None`` and outputs, input grad and every parameter grad must equal the mutant's own (fp32,
default ``assert_close``): **accepted_exact**, else **accepted_wrong** (with the largest difference or
the exception). ``gloo_check`` repeats the comparison on 2 gloo ranks, each rank its own slice of the
batch (split [1, 1], then [2, 0]: a rank without tokens must still join every exchange).

The enumeration is fixed and ordered: target x site x operator x location, then the run-time operators
per target. ``sample(mutants, every)`` takes every ``every``-th mutant of each target, starting at its first.
"""

from __future__ import annotations

import ast
import copy
import datetime
import functools
import importlib
import inspect
import itertools
import linecache
import os
import re
import sys
import tempfile
import textwrap
import traceback
import types
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from autoep.archetypes import compute_fn_config
from autoep.errors import UnsupportedModuleStructure
from autoep.structure import detect_moe_structure

BATCH, SEQ = 2, 3
SCALE = 1.5  # what scaling operators multiply by: far above any rounding difference

# ---------------------------------------------------------------------------------------------
# Targets: fresh tiny fp32 blocks in train mode, seeded
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    build: Callable[[], nn.Module]


@functools.lru_cache(maxsize=None)
def _family_configs(family: str) -> tuple:
    from autoep.tiny import family_configs

    return tuple(family_configs(importlib.import_module(f"transformers.models.{family}")))


def _transformers_block(family: str, cls_name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from autoep.tiny import build_block
        from test_parity_hf import eager_experts_, randomize_

        cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), cls_name)
        block, _ = build_block(cls, list(_family_configs(family)), tiny=True)
        randomize_(block, 0)
        eager_experts_(block)
        return block.float().train()

    return build


def _hand_written_block(name: str, make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(sum(map(ord, name)))
        block = make()
        if hasattr(block, "e_score_correction_bias"):
            block.e_score_correction_bias.normal_(0, 0.1)  # nonzero, so choice and weight scores differ
        return block.train()

    return build


def targets() -> list[Target]:
    """Every target, in the fixed order of the enumeration."""
    from blocks import DeepseekV3StyleMoE, MixtralStyleSparseMoeBlock, MoE, Qwen2MoeStyleSparseMoeBlock

    hf = [
        ("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
        ("qwen2_moe", "Qwen2MoeSparseMoeBlock"),
        ("deepseek_v3", "DeepseekV3MoE"),
        ("gpt_oss", "GptOssMLP"),
        ("mixtral", "MixtralSparseMoeBlock"),
    ]
    v4 = {
        "mixtral": lambda: MixtralStyleSparseMoeBlock(hidden=16, num_experts=4, top_k=2),
        "mixtral_jitter": lambda: MixtralStyleSparseMoeBlock(hidden=16, num_experts=4, top_k=2, jitter_noise=0.2),
        "qwen2_moe": lambda: Qwen2MoeStyleSparseMoeBlock(hidden=16, num_experts=4, top_k=2, norm_topk_prob=True),
        "deepseek_v3": lambda: DeepseekV3StyleMoE(hidden=16, num_experts=8, top_k=2, n_group=4, topk_group=2),
        "research": lambda: MoE(hidden=16, num_experts=4, top_k=2),
    }
    return [Target(f"hf/{f}", _transformers_block(f, c)) for f, c in hf] + [
        Target(f"v4/{n}", _hand_written_block(n, make)) for n, make in v4.items()
    ]


# ---------------------------------------------------------------------------------------------
# Roles: the block, its router, its experts container, one expert
# ---------------------------------------------------------------------------------------------


def router_of(block: nn.Module) -> nn.Module | None:
    gate = getattr(block, "gate", None)
    return gate if isinstance(gate, nn.Module) else getattr(block, "router", None)


def is_module_list(block: nn.Module) -> bool:
    return isinstance(getattr(block, "experts", None), nn.ModuleList)


def role_objects(block: nn.Module, role: str) -> list[nn.Module]:
    """The modules a mutation of ``role`` re-classes: ``expert`` = every expert (a class edit is global)."""
    if role == "block":
        return [block]
    if role == "router":
        return [router_of(block)]
    if role == "experts":
        return [block.experts]
    return list(block.experts)


def roles_of(block: nn.Module) -> list[str]:
    """Roles a run-time mutation can target: the experts container only where it is called (batched)."""
    return ["block", "router", "expert" if is_module_list(block) else "experts"]


def _own_methods_called(cls: type, fn_tree: ast.FunctionDef) -> list[str]:
    """Methods of ``cls`` (defined below ``nn.Module``) that ``fn_tree`` calls on ``self``, in source order."""
    names = []
    for node in ast.walk(fn_tree):
        if isinstance(node, ast.Call) and _self_attr(node.func) and _self_attr(node.func) not in names:
            attr = _self_attr(node.func)
            owner = next((k for k in cls.__mro__ if attr in vars(k)), None)
            if owner is not None and owner is not nn.Module and inspect.isfunction(vars(owner)[attr]):
                names.append(attr)
    return names


@dataclass(frozen=True)
class SourceSite:
    """One function whose source a mutant edits: ``role`` names the object(s), ``method`` the function."""

    role: str
    method: str
    cls: type

    @property
    def function(self):
        return inspect.unwrap(getattr(self.cls, self.method))


def source_sites(block: nn.Module) -> list[SourceSite]:
    """The block forward and its own helpers; the router forward (a router module, not a bare Linear);
    the batched experts forward and its helpers, or the ModuleList expert forward."""
    sites = []
    for role in ("block", "router", "experts" if not is_module_list(block) else "expert"):
        obj = role_objects(block, role)[0]
        if obj is None or type(obj).__module__.startswith("torch."):
            continue  # a bare nn.Linear gate: torch's own code is not the model's
        cls = type(obj)
        sites.append(SourceSite(role, "forward", cls))
        tree = function_tree(inspect.unwrap(cls.forward))
        sites += [SourceSite(role, m, cls) for m in _own_methods_called(cls, tree) if m != "forward"]
    return sites


# ---------------------------------------------------------------------------------------------
# Defining a subclass from source text, with retrievable source
# ---------------------------------------------------------------------------------------------

_MODULE_SEQ = itertools.count()
_DISK_DIR = None


def function_tree(fn) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


def exec_subclass(orig: type, class_body: str, *, prelude: str = "", decorator: str = "", check: str = "") -> type:
    """A subclass of ``orig`` with the same name, defined by ``class_body`` (indented method sources)
    in a copy of ``orig``'s module globals, as a module of its own whose file is in ``linecache``
    (``inspect.getsource`` works on the class and its methods; checked on ``check``, else written to disk)."""
    src = "\n".join(
        ["from __future__ import annotations", prelude, decorator, f"class {orig.__name__}({orig.__name__}):", class_body]
    )
    cls = _define(orig, src, on_disk=False)
    if check and not _source_ok(getattr(cls, check), cls):
        cls = _define(orig, src, on_disk=True)
    return cls


def _define(orig: type, src: str, *, on_disk: bool) -> type:
    global _DISK_DIR
    n = next(_MODULE_SEQ)
    name = f"autoep_mutant_{n}"
    if on_disk:
        _DISK_DIR = _DISK_DIR or tempfile.mkdtemp(prefix="autoep-mutants-")
        filename = os.path.join(_DISK_DIR, f"{name}.py")
        with open(filename, "w") as f:
            f.write(src)
    else:
        filename = f"/autoep-mutants/{name}.py"  # never on disk: linecache serves it (mtime None: kept)
        linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
    module = types.ModuleType(name)
    base = sys.modules[orig.__module__].__dict__
    module.__dict__.update({k: v for k, v in base.items() if not k.startswith("__") or k == "__builtins__"})
    module.__dict__.update({"__file__": filename, orig.__name__: orig})
    sys.modules[name] = module
    exec(compile(src, filename, "exec"), module.__dict__)
    return module.__dict__[orig.__name__]


def _source_ok(fn, cls: type) -> bool:
    try:
        return bool(inspect.getsource(fn)) and bool(inspect.getsource(cls))
    except (OSError, TypeError):
        return False


def method_source(tree: ast.FunctionDef) -> str:
    return textwrap.indent(ast.unparse(ast.fix_missing_locations(tree)), "    ")


# ---------------------------------------------------------------------------------------------
# AST toolkit: statement slots, bindings, call shapes
# ---------------------------------------------------------------------------------------------

# Names that hold indices, masks, shapes or modules, not float activations (value operators skip them).
INDEX_LIKE = re.compile(
    r"idx|index|indices|mask|hit|selected|top_x|pos|slot|shape|size|dim|layer|residual|^expert$|^_$|"
    r"batch|sequence|^bs$|slen|orig"
)
ROUTING_LIKE = re.compile(r"logit|score|prob|weight|top_value|routing")


@dataclass
class Slot:
    """A statement and where it sits: ``body[index]``; ``in_loop`` when inside a ``for``/``while``."""

    body: list
    index: int
    stmt: ast.stmt
    in_loop: bool


def slots(node: ast.AST, in_loop: bool = False) -> list[Slot]:
    """Every statement under ``node``, in source order."""
    out = []
    for _, value in ast.iter_fields(node):
        if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
            for i, stmt in enumerate(value):
                out.append(Slot(value, i, stmt, in_loop))
                out += slots(stmt, in_loop or isinstance(stmt, (ast.For, ast.While)))
    return out


def bound_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target = stmt.targets[0]
    elif isinstance(stmt, (ast.AugAssign, ast.AnnAssign)):
        target = stmt.target
    else:
        return []
    elts = target.elts if isinstance(target, ast.Tuple) else [target]
    return [e.id for e in elts if isinstance(e, ast.Name)]


def float_names(stmt: ast.stmt) -> list[str]:
    return [n for n in bound_names(stmt) if not INDEX_LIKE.search(n)]


def _self_attr(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def dotted(node: ast.AST) -> str:
    """``torch.nn.functional.linear`` for that attribute chain; '' for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def calls(tree: ast.AST, pred: Callable[[ast.Call], bool]) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and pred(n)]


def named(*names: str) -> Callable[[ast.Call], bool]:
    """A call whose callee's last name is one of ``names`` (``torch.topk`` and ``x.topk`` alike)."""
    return lambda c: (c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "")) in names


def expr(text: str, **subst: ast.expr) -> ast.expr:
    """Parse ``text``, replacing each name in ``subst`` by (a copy of) its node."""
    tree = ast.parse(text, mode="eval").body

    class Sub(ast.NodeTransformer):
        def visit_Name(self, node):
            return copy.deepcopy(subst[node.id]) if node.id in subst else node

    return Sub().visit(tree)


def stmt(text: str) -> list[ast.stmt]:
    return ast.parse(textwrap.dedent(text)).body


def swap(tree: ast.AST, old: ast.AST, new: ast.AST) -> None:
    """Replace node ``old`` (by identity) with ``new`` inside ``tree``."""

    class Swap(ast.NodeTransformer):
        def visit(self, node):
            return new if node is old else super().visit(node)

    Swap().visit(tree)


def first_param(fn: ast.FunctionDef) -> str:
    return fn.args.args[1].arg


def loop_vars(fn: ast.FunctionDef) -> set[str]:
    out = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.For):
            target = node.target.elts[0] if isinstance(node.target, ast.Tuple) else node.target
            if isinstance(target, ast.Name):
                out.add(target.id)
    return out


def expert_loops(fn: ast.FunctionDef) -> list[tuple[Slot, str, str]]:
    """``(slot of the for, accumulator, loop variable)`` for every loop that ``acc.index_add_``s."""
    out = []
    for s in slots(fn):
        if isinstance(s.stmt, ast.For):
            adds = calls(s.stmt, lambda c: isinstance(c.func, ast.Attribute) and c.func.attr == "index_add_")
            target = s.stmt.target.elts[0] if isinstance(s.stmt.target, ast.Tuple) else s.stmt.target
            if adds and isinstance(adds[0].func.value, ast.Name) and isinstance(target, ast.Name):
                out.append((s, adds[0].func.value.id, target.id))
    return out


def experts_call_slots(fn: ast.FunctionDef) -> list[Slot]:
    """Top-level statements of a block method that call ``self.experts(...)`` or run the expert loop."""
    loops = [loop.stmt for loop, _, _ in expert_loops(fn)]
    return [s for s in slots(fn) if s.body is fn.body
            and (calls(s.stmt, lambda c: _self_attr(c.func) == "experts") or any(s.stmt is l for l in loops))]


# ---------------------------------------------------------------------------------------------
# Source operators: fn(tree, site) -> list[Edit], one Edit per location
# ---------------------------------------------------------------------------------------------


@dataclass
class Edit:
    """A mutated function, module-level source it needs, and a run-time tweak of each re-classed object."""

    tree: ast.FunctionDef
    prelude: str = ""
    tweak: Callable[[nn.Module], None] | None = None


def each(fn: ast.FunctionDef, locate, mutate, prelude: str = "", tweak=None) -> list[Edit]:
    """One edit per location ``locate`` finds: ``mutate(tree_copy, location_in_copy)``."""
    edits = []
    for k in range(len(locate(fn))):
        tree = copy.deepcopy(fn)
        result = mutate(tree, locate(tree)[k])
        edits.append(Edit(tree, prelude, result if callable(result) else tweak))
    return edits


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


def op_norm_l2(fn, site):
    """A normalisation by the L2 norm instead of the sum."""

    def mutate(tree, call):
        call.func.attr = "norm"

    return each(fn, _keepdim_sums, mutate)


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


def op_after_loop_scale(fn, site):
    return each(fn, expert_loops, lambda t, loc: loc[0].body.insert(loc[0].index + 1, stmt(f"{loc[1]} = {loc[1]} * 2.0")[0]))


def op_after_loop_inplace(fn, site):
    return each(fn, expert_loops, lambda t, loc: loc[0].body.insert(loc[0].index + 1, stmt(f"{loc[1]}.mul_(0.5)")[0]))


def op_guard_before_loop(fn, site):
    def mutate(tree, loc):
        s, acc, _ = loc
        s.body.insert(s.index, stmt(f"if self.training:\n    {acc} = {acc} + 0.5")[0])

    return each(fn, expert_loops, mutate)


def op_skip_expert(fn, site):
    return each(fn, expert_loops, lambda t, loc: loc[0].stmt.body.insert(0, stmt(f"if {loc[2]} == 1:\n    continue")[0]))


def op_acc_from_input(fn, site):
    """The accumulator initialised from the input instead of zeros."""

    def locate(tree):
        found = []
        for loop, acc, _ in expert_loops(tree):
            for s in slots(tree):
                v = getattr(s.stmt, "value", None)
                if bound_names(s.stmt) == [acc] and isinstance(v, ast.Call) and named("zeros", "zeros_like", "new_zeros")(v):
                    found.append(s)
        return found

    def mutate(tree, s):
        arg = s.stmt.value.args[0] if s.stmt.value.args else None
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
        return [n for n in ast.walk(tree) if isinstance(n, ast.Subscript) and _self_attr(n.value)
                and isinstance(n.slice, ast.Name) and n.slice.id in loop]

    def mutate(tree, node):
        node.slice = expr(f"{node.slice.id} - 1")

    return each(fn, locate, mutate)


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
            call = calls(orelse[0], lambda c: _self_attr(c.func) == "experts")[0]
            swap(orelse[0], call, expr("torch.zeros_like(__a__)", __a__=call.args[0]))
            inp = dotted(call.args[0]) or inp
        s.body[s.index] = ast.If(test=expr(f"{inp}.shape[0] > 0"), body=[s.stmt], orelse=orelse)

    return each(fn, experts_call_slots, mutate)


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
    """Tokens that chose expert 0 get the padding index ``num_experts`` (transformers' eager experts skip it)."""

    def locate(tree):
        return [(s, n) for s in slots(tree) if calls(s.stmt, named("topk"))
                for n in bound_names(s.stmt) if re.search(r"indices|selected|index", n)]

    def mutate(tree, loc):
        s, n = loc
        s.body.insert(s.index + 1, stmt(f"{n} = {n}.masked_fill({n} == 0, self.num_experts)")[0])

    return each(fn, locate, mutate)


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


SOURCE_OPERATORS: dict[str, Callable] = {
    "scale": op_scale,
    "bias": op_bias,
    "temperature": op_temperature,
    "softcap": op_softcap,
    "constant": op_constant,
    "norm_l2": op_norm_l2,
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
    "lossy_cast": op_lossy_cast,
    "expert_output_cast": op_expert_output_cast,
    "off_by_one_expert": op_off_by_one_expert,
    "helper_linear": op_helper_linear,
    "helper_silu": op_helper_silu,
    "softmax_act": op_softmax_act,
    "top_k_other_attr": op_top_k_other_attr,
    "add_keyword": op_add_keyword,
    "keyword_form": op_keyword_form,
    "bare_gather": op_bare_gather,
    "conditional_experts_call": op_conditional_experts_call,
    "early_return_empty": op_early_return_empty,
    "early_return_taken": op_early_return_taken,
    "padding_index": op_padding_index,
    "decorate": op_decorate,
}


def source_mutator(site: SourceSite, edit: Edit) -> Callable[[nn.Module], None]:
    """Re-class the site's objects with a subclass whose ``site.method`` is the edited source (defined
    once, on first use). transformers' experts-interface class decorator is re-applied to an edited
    ``forward`` it wrapped, as if the model file had been edited."""
    cache: dict[str, type] = {}

    def apply(block: nn.Module) -> None:
        if "cls" not in cache:
            wrapped = site.method == "forward" and hasattr(getattr(site.cls, "forward"), "__wrapped__")
            module = sys.modules[site.cls.__module__].__dict__
            decorator = "@use_experts_implementation" if wrapped and "use_experts_implementation" in module else ""
            cache["cls"] = exec_subclass(site.cls, method_source(edit.tree), prelude=edit.prelude,
                                         decorator=decorator, check=site.method)
        for obj in role_objects(block, site.role):
            obj.__class__ = cache["cls"]
            if edit.tweak is not None:
                edit.tweak(obj)

    return apply


# ---------------------------------------------------------------------------------------------
# Run-time-state operators: fn(block, role) -> mutator or None where it does not apply
# ---------------------------------------------------------------------------------------------


def scaled(out):
    """The output scaled by SCALE (a tuple's first element)."""
    return (out[0] * SCALE, *out[1:]) if isinstance(out, tuple) else out * SCALE


def _one(block: nn.Module, role: str) -> nn.Module:
    """The single object a run-time mutation of ``role`` touches (``expert``: expert 1)."""
    return block.experts[1] if role == "expert" else role_objects(block, role)[0]


def rt_instance_forward(block, role):
    def apply(b):
        obj = _one(b, role)
        obj.forward = types.MethodType(lambda self, *a, **k: scaled(type(self).forward(self, *a, **k)), obj)

    return apply


def rt_forward_hook(block, role):
    return lambda b: _one(b, role).register_forward_hook(lambda mod, args, out: scaled(out))


def rt_forward_pre_hook(block, role):
    return lambda b: _one(b, role).register_forward_pre_hook(lambda mod, args: (args[0] * SCALE, *args[1:]))


CALL_OVERRIDE = f"""    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        return (out[0] * {SCALE}, *out[1:]) if isinstance(out, tuple) else out * {SCALE}
"""


def rt_call_override(block, role):
    cache = {}

    def apply(b):
        obj = _one(b, role)
        if "cls" not in cache:
            cache["cls"] = exec_subclass(type(obj), CALL_OVERRIDE, check="__call__")
        obj.__class__ = cache["cls"]

    return apply


def rt_wrapped_forward(block, role):
    """A subclass whose ``forward`` is set at run time to a ``functools.wraps`` wrapper of the original."""
    cache = {}

    def apply(b):
        obj = _one(b, role)
        if "cls" not in cache:
            orig = type(obj).forward

            @functools.wraps(orig)
            def forward(self, *args, **kwargs):
                return scaled(orig(self, *args, **kwargs))

            cache["cls"] = type(type(obj).__name__, (type(obj),), {"forward": forward})
        obj.__class__ = cache["cls"]

    return apply


def _projections(expert: nn.Module) -> list[str]:
    return [n for n, m in expert.named_children() if isinstance(m, nn.Linear)]


def rt_tied_experts(block, role):
    if role != "expert":
        return None

    def apply(b):
        for n in _projections(b.experts[0]):
            getattr(b.experts[1], n).weight = getattr(b.experts[0], n).weight

    return apply


def rt_frozen_expert(block, role):
    if role == "expert":
        return lambda b: b.experts[1].requires_grad_(False)
    if role == "experts":
        return lambda b: b.experts.down_proj.requires_grad_(False)
    return None


def _set_act(role: str, make: Callable[[], nn.Module], every: bool) -> Callable | None:
    def apply(b):
        objs = [b.experts] if role == "experts" else list(b.experts) if every else [b.experts[1]]
        for obj in objs:
            obj.act_fn = make()

    return apply


def rt_expert_activation(block, role):
    """One expert (or the batched experts) with GELU instead of the configured activation."""
    if role not in ("expert", "experts") or not hasattr(_one(block, role), "act_fn"):
        return None
    return _set_act(role, nn.GELU, every=False)


def rt_act_not_elementwise(block, role):
    """Every expert's ``act_fn`` a softmax over the last dim."""
    if role not in ("expert", "experts") or not hasattr(_one(block, role), "act_fn"):
        return None
    return _set_act(role, lambda: nn.Softmax(dim=-1), every=True)


def rt_expert_sizes(block, role):
    """Expert 1 with half the intermediate size of the others."""
    if role != "expert":
        return None

    def apply(b):
        expert, hidden = b.experts[1], router_of(b).weight.shape[-1]
        torch.manual_seed(5)
        for n in _projections(expert):
            lin = getattr(expert, n)
            shrink_out, shrink_in = lin.out_features != hidden, lin.in_features != hidden
            setattr(expert, n, nn.Linear(lin.in_features // (1 + shrink_in), lin.out_features // (1 + shrink_out),
                                         bias=lin.bias is not None))

    return apply


def rt_instance_apply_gate(block, role):
    if role != "experts" or not hasattr(block.experts, "_apply_gate"):
        return None

    def apply(b):
        experts = b.experts
        experts._apply_gate = types.MethodType(lambda self, gu: type(self)._apply_gate(self, gu) * SCALE, experts)

    return apply


RUNTIME_OPERATORS: dict[str, Callable] = {
    "instance_forward": rt_instance_forward,
    "forward_hook": rt_forward_hook,
    "forward_pre_hook": rt_forward_pre_hook,
    "call_override": rt_call_override,
    "wrapped_forward": rt_wrapped_forward,
    "tied_experts": rt_tied_experts,
    "frozen_expert": rt_frozen_expert,
    "expert_activation": rt_expert_activation,
    "act_not_elementwise": rt_act_not_elementwise,
    "expert_sizes": rt_expert_sizes,
    "instance_apply_gate": rt_instance_apply_gate,
}
OPERATORS = [*SOURCE_OPERATORS, *RUNTIME_OPERATORS]

# Mutants whose failure shows only on several ranks (a rank without tokens skips a collective).
RANK_SENSITIVE = {"conditional_experts_call", "early_return_empty", "padding_index"}


# ---------------------------------------------------------------------------------------------
# Enumeration
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutant:
    name: str  # "<target>/<role>.<method>/<operator>#<location>" or "<target>/<role>/<operator>"
    target: Target
    operator: str
    mutate: Callable[[nn.Module], None] = field(compare=False, repr=False)

    @property
    def runtime(self) -> bool:
        return self.operator in RUNTIME_OPERATORS

    def build(self) -> nn.Module:
        block = self.target.build()
        self.mutate(block)
        return block


def target_mutants(target: Target) -> list[Mutant]:
    """The target's mutants in their fixed order: site x source operator x location, then run-time."""
    block = target.build()
    out = []
    for site in source_sites(block):
        tree = function_tree(site.function)
        for op_name, op in SOURCE_OPERATORS.items():
            for k, edit in enumerate(op(tree, site)):
                name = f"{target.name}/{site.role}.{site.method}/{op_name}#{k}"
                out.append(Mutant(name, target, op_name, source_mutator(site, edit)))
    for role in roles_of(block):
        for op_name, op in RUNTIME_OPERATORS.items():
            mutate = op(block, role)
            if mutate is not None:
                out.append(Mutant(f"{target.name}/{role}/{op_name}", target, op_name, mutate))
    return out


@functools.lru_cache(maxsize=1)
def all_mutants() -> tuple[Mutant, ...]:
    return tuple(m for t in targets() for m in target_mutants(t))


def unmodified(target: Target) -> Mutant:
    """The target as written (a control: it must be accepted and exact)."""
    return Mutant(f"{target.name}/unmodified", target, "none", lambda block: None)


def mutants_by_name(names) -> list[Mutant]:
    """The named mutants (or ``<target>/unmodified``), enumerating only their targets."""
    wanted = {n.rsplit("/", 2)[0] if not n.endswith("/unmodified") else n.rsplit("/", 1)[0] for n in names}
    index = {m.name: m for t in targets() if t.name in wanted for m in [unmodified(t), *target_mutants(t)]}
    return [index[n] for n in names]


def sample(mutants, every: int, offset: int = 0) -> list[Mutant]:
    """Every ``every``-th mutant of each target, from its ``offset``-th: fixed, and every target is covered."""
    out = []
    for _, group in itertools.groupby(mutants, key=lambda m: m.target.name):
        out += list(group)[offset::every]
    return out


# ---------------------------------------------------------------------------------------------
# One forward/backward and the comparison
# ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    """What one forward/backward produced: outputs, grad wrt the input, every parameter's grad."""

    outputs: tuple
    x_grad: torch.Tensor
    grads: dict


def inputs(block: nn.Module, batch: int = BATCH) -> torch.Tensor:
    hidden = router_of(block).weight.shape[-1]
    return torch.randn(batch, SEQ, hidden, generator=torch.Generator().manual_seed(7))


def cotangent(i: int, t: torch.Tensor) -> torch.Tensor:
    """The output cotangent of output ``i``: fixed per output position and shape."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(t.numel(), generator=g).reshape(t.shape).to(t.dtype)


def forward_backward(block: nn.Module, x: torch.Tensor, seed: int) -> Run:
    """The block's forward on ``x`` (RNG seeded: jitter draws match) and the backward of a loss that
    uses every returned float tensor."""
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out = block(x)
    outputs = out if isinstance(out, tuple) else (out,)
    terms = [(o * cotangent(i, o)).sum() for i, o in enumerate(outputs)
             if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad]
    if terms:
        sum(terms).backward()
    x_grad = x.grad if x.grad is not None else torch.zeros_like(x)
    return Run(tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs), x_grad, param_grads(block))


def param_grads(block: nn.Module) -> dict:
    """Every parameter's grad by its name in the model's own layout (tied names listed each): stacked
    ModuleList experts written back per expert, DTensor grads gathered (a collective on several ranks)."""
    grads = {}
    for name, p in block.named_parameters(remove_duplicate=False):
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()  # NOTE: collective (all-gather over ep)
        grads[name] = g
    if not is_module_list(block) and any(n.startswith("experts.") for n in grads) and _stacked(block):
        from autoep.recipes.module_list import unstack_module_list_experts

        has_grad = block.experts.gate_up_proj.grad is not None
        per_expert = unstack_module_list_experts(block, grad=has_grad)  # NOTE: collective over ep
        grads = {n: g for n, g in grads.items() if not n.startswith("experts.")}
        grads |= {n: g if has_grad else None for n, g in per_expert.items()}
    return grads


def _stacked(block: nn.Module) -> bool:
    return getattr(block.experts, "proj_names", None) is not None


def differences(ref: Run, got: Run) -> list[str]:
    """Every way ``got`` differs from ``ref`` (outputs, input grad, parameter grads; None grad = zeros)."""
    out = []
    if len(ref.outputs) != len(got.outputs):
        return [f"returns {len(got.outputs)} values, the block's own forward {len(ref.outputs)}"]
    pairs = [(f"output {i}", a, b) for i, (a, b) in enumerate(zip(ref.outputs, got.outputs))]
    pairs.append(("input grad", ref.x_grad, got.x_grad))
    if ref.grads.keys() != got.grads.keys():
        out.append(f"parameters differ: {sorted(ref.grads.keys() ^ got.grads.keys())[:4]}")
    for n in sorted(ref.grads.keys() & got.grads.keys()):
        a, b = ref.grads[n], got.grads[n]
        if a is None and b is None:
            continue
        pairs.append((f"grad of {n}", a if a is not None else torch.zeros_like(b), b if b is not None else torch.zeros_like(a)))
    for what, a, b in pairs:
        why = _mismatch(a, b)
        if why:
            out.append(f"{what}: {why}")
    return out


def _mismatch(a, b) -> str:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return "" if a == b else f"{a!r} != {b!r}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(b.shape)} {b.dtype} vs {tuple(a.shape)} {a.dtype}"
    try:
        torch.testing.assert_close(b, a)
    except AssertionError:
        return f"max abs diff {(b.double() - a.double()).abs().max().item():.3g}"
    return ""


# ---------------------------------------------------------------------------------------------
# Evaluation of one mutant in one process (ep_mesh=None)
# ---------------------------------------------------------------------------------------------

VERDICTS = ("refused", "accepted_exact", "accepted_wrong", "crash", "invalid")


@dataclass
class Outcome:
    name: str
    target: str
    operator: str
    verdict: str
    detail: str = ""


def short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"


def detect(block: nn.Module):
    """``(structure, None)``, ``(None, "refused: ...")`` or ``(None, "crash: ...")``; the table lookup is part
    of detection (a structure without a recipe is a refusal)."""
    try:
        structure = detect_moe_structure(block)
        compute_fn_config(structure)
        return structure, None
    except UnsupportedModuleStructure as exc:
        return None, f"refused: {exc.reason if hasattr(exc, 'reason') else exc}"
    except Exception:  # noqa: BLE001 - the verdict: the detector raised something else
        return None, "crash: " + traceback.format_exc(limit=-3).strip().replace("\n", " | ")[-400:]


def make_ep(block: nn.Module, structure, ep_mesh) -> nn.Module:
    """A deep copy of ``block`` made expert-parallel in place by the recipe the table names."""
    from autoep.apply import shard_experts

    cfg = dict(compute_fn_config(structure))
    module, _, attr = cfg.pop("_target_").rpartition(".")
    factory = getattr(importlib.import_module(module), attr)
    ep = copy.deepcopy(block)
    if ep_mesh is not None:
        shard_experts(ep, ep_mesh)
    factory(ep, ep_mesh=ep_mesh, **cfg)
    return ep


def evaluate(mutant: Mutant) -> Outcome:
    """The mutant's verdict in this process: detect, run its own forward/backward, run the recipe's, compare."""
    verdict = functools.partial(Outcome, mutant.name, mutant.target.name, mutant.operator)
    try:
        block = mutant.build()
    except Exception as exc:  # noqa: BLE001 - a mutant that cannot even be built is not a test
        return verdict("invalid", "build: " + short_error(exc))
    structure, why = detect(block)
    if why and why.startswith("crash"):
        return verdict("crash", why)
    x = inputs(block)
    try:
        ref = forward_backward(copy.deepcopy(block), x, seed=100)
    except Exception as exc:  # noqa: BLE001 - the mutant's own code does not run
        return verdict("invalid", "own forward: " + short_error(exc))
    if why:
        return verdict("refused", why[len("refused: "):])
    try:
        got = forward_backward(make_ep(block, structure, None), x, seed=100)
    except Exception as exc:  # noqa: BLE001 - accepted, and the EP path fails
        return verdict("accepted_wrong", "EP path raised " + short_error(exc))
    diffs = differences(ref, got)
    return verdict("accepted_wrong", "; ".join(diffs[:3])) if diffs else verdict("accepted_exact")


def evaluate_all(mutants, on_outcome: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    torch.set_num_threads(1)
    outcomes = []
    for m in mutants:
        outcomes.append(evaluate(m))
        if on_outcome is not None:
            on_outcome(outcomes[-1])
    return outcomes


# ---------------------------------------------------------------------------------------------
# Two gloo ranks: each rank its own slice, reference = the mutant's own forward per slice
# ---------------------------------------------------------------------------------------------

SPLITS = ([1, 1], [2, 0])  # sequences per rank: even, then one rank without tokens
HANG_S = 15  # a collective the peer never joins fails after this (per-mutant group timeout)


def _slices(x: torch.Tensor, split: list[int]) -> list[torch.Tensor]:
    bounds = list(itertools.accumulate([0] + split))
    return [x[lo:hi] for lo, hi in zip(bounds, bounds[1:])]


def _ranks_round(block, structure, x, split, rank, group, mesh) -> str | None:
    """One split: reference grads summed over every slice (each rank computes all), EP on this rank's
    slice; outputs and input grad per rank, dense grads summed, expert grads gathered. None = equal."""
    import torch.distributed as dist

    ref = copy.deepcopy(block)
    runs = [forward_backward(ref, s, seed=100 + r) for r, s in enumerate(_slices(x, split))]
    ref_run = Run(runs[rank].outputs, runs[rank].x_grad, param_grads(ref))  # grads accumulated over slices
    ep = make_ep(block, structure, mesh)
    got = forward_backward(ep, _slices(x, split)[rank], seed=100 + rank)
    for name, p in ep.named_parameters(remove_duplicate=False):
        if not hasattr(p, "full_tensor") and got.grads.get(name) is not None:
            dist.all_reduce(got.grads[name], group=group)  # NOTE: collective; dense grads sum over ranks
    diffs = differences(ref_run, got)
    return "; ".join(diffs[:3]) if diffs else None


def check_on_ranks(mutant: Mutant, rank: int, group, mesh) -> tuple[str, str, bool]:
    """``(verdict, detail, broken)`` of one mutant on this rank; ``broken``: the EP path raised on some rank,
    so ``group`` may be out of step (the caller starts fresh processes for the next mutant)."""
    import torch.distributed as dist

    block = mutant.build()
    structure, why = detect(block)
    if why:
        return why.split(":")[0], why, False
    x = inputs(block)
    try:
        for split in SPLITS:
            for r, s in enumerate(_slices(x, split)):
                forward_backward(copy.deepcopy(block), s, seed=100 + r)
    except Exception as exc:  # noqa: BLE001 - the same on every rank: every rank computes every slice
        return "invalid", "own forward on a slice: " + short_error(exc), False
    for split in SPLITS:
        try:
            why, raised = _ranks_round(block, structure, x, split, rank, group, mesh), False
        except Exception as exc:  # noqa: BLE001 - accepted, and the EP path fails (or a peer hung)
            why, raised = "EP path raised " + short_error(exc), True
        state = torch.tensor([2.0 if raised else float(why is not None)])
        # NOTE: collective on the default group: the ranks agree on the outcome and resync after a hang.
        dist.all_reduce(state, op=dist.ReduceOp.MAX)
        if state.item():
            detail = f"split {split}, rank {rank}: {why}" if why else f"split {split}: failed on another rank"
            return "accepted_wrong", detail, state.item() >= 2
    return "accepted_exact", "", False


def gloo_cases(rank: int, world_size: int, names: list[str]) -> dict[str, tuple[str, str]]:
    """Worker (``distributed.spawn``): ``{mutant name: (verdict, detail)}`` on this rank, in order, up to
    and including the first mutant whose EP path raised (the group may be out of step after it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_num_threads(1)
    # The ep group times out fast: an accepted mutant whose rank skips a collective fails, not hangs.
    group = dist.new_group(list(range(world_size)), backend="gloo", timeout=datetime.timedelta(seconds=HANG_S))
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("ep",))
    out = {}
    for m in mutants_by_name(names):
        verdict, detail, broken = check_on_ranks(m, rank, group, mesh)
        out[m.name] = (verdict, detail)
        if broken:
            break
    return out


def gloo_check(names: list[str], world_size: int = 2) -> dict[str, tuple[str, str]]:
    """Run ``names`` on ``world_size`` gloo ranks; ``{name: (verdict, detail)}`` merged over ranks (a
    failing rank's detail first). A fresh group of processes continues after a mutant whose EP path raised."""
    from distributed import spawn

    def rank(result):  # a rank's own failure, then "failed on another rank", then the rest
        return (result[0] == "accepted_wrong") + (", rank " in result[1])

    merged: dict[str, tuple[str, str]] = {}
    while len(merged) < len(names):
        todo = [n for n in names if n not in merged]
        for per_rank in spawn(world_size, "mutation:gloo_cases", todo):
            for name, result in per_rank.items():
                merged[name] = max(merged.get(name, result), result, key=rank)
    return merged


def apply_rank_results(outcomes: list[Outcome], ranks: dict[str, tuple[str, str]], world_size: int) -> None:
    """A mutant exact in one process and wrong on several ranks becomes accepted_wrong."""
    for o in outcomes:
        verdict, detail = ranks.get(o.name, (None, ""))
        if o.verdict == "accepted_exact" and verdict == "accepted_wrong":
            o.verdict, o.detail = "accepted_wrong", f"on {world_size} ranks: {detail}"


def rank_sample(outcomes: list[Outcome], every: int) -> list[str]:
    """Accepted-exact mutants to recheck on several ranks: every run-time and rank-sensitive one, and
    every ``every``-th of the others."""
    exact = [o for o in outcomes if o.verdict == "accepted_exact"]
    special = [o.name for o in exact if o.operator in RUNTIME_OPERATORS or o.operator in RANK_SENSITIVE]
    rest = [o.name for o in exact if o.name not in special]
    return special + rest[::every]


# ---------------------------------------------------------------------------------------------
# Counting
# ---------------------------------------------------------------------------------------------


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    c = {"mutants": len(outcomes)} | {v: 0 for v in VERDICTS}
    for o in outcomes:
        c[o.verdict] += 1
    return c


def summary_line(label: str, outcomes: list[Outcome]) -> str:
    return f"{label}: " + " ".join(f"{k}={v}" for k, v in counts(outcomes).items())
