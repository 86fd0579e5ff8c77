"""Proofs for ModuleList experts and the v4-style block loop autoep splices out, from source and run-time
state, never by running them.

- ``module_list_facts(experts)``: every ModuleList expert is the same proven ``down(act(gate(x)) *
  up(x))`` with bias-free ``nn.Linear``s, equal shapes, untied, uniformly trainable; trailing
  ``nn.Identity`` experts (zero-compute experts) are counted apart.
- ``module_list_plan(block)``: a v4-style block whose forward (or a helper it calls) holds one expert
  loop over a ``ModuleList``; autoep splices out that loop and runs the rest of the block as written.

Each returns facts or raises ``Refusal`` naming what could not be proven.
"""
from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoep.detect import elementwise, regions, row_local, split_loop
from autoep.detect.expert_loop import Prover, strip_casts
from autoep.detect.genuine import genuine
from autoep.detect.loop_context import plain_method, prelude, self_reads
from autoep.detect.names import Scope, instance_attr
from autoep.detect.source import Refusal, cached_by_code, function_tree

# ---------------------------------------------------------------------------------------------
# ModuleList experts: every expert is the same proven SwiGLU
# ---------------------------------------------------------------------------------------------

# F.silu written in an expert forward runs as this module in the stacked compute.
_FUNCTION_MODULES = {F.silu: nn.SiLU, F.relu: nn.ReLU, torch.relu: nn.ReLU, F.sigmoid: nn.Sigmoid,
                     torch.sigmoid: nn.Sigmoid, F.tanh: nn.Tanh, torch.tanh: nn.Tanh}


@cached_by_code
def _swiglu_shape(forward) -> tuple[str, str, str, object, tuple[str, ...]]:
    """(gate, up, down attribute names, activation: "act_fn" or a function, dropout attribute names) of
    ``down(act(gate(x)) * up(x))``, optionally ``self.d(...)`` around it or around the product."""
    if hasattr(forward, "__wrapped__"):
        raise Refusal(f"expert {forward.__qualname__} is wrapped by a decorator")
    tree = function_tree(forward)
    if tree.decorator_list:
        raise Refusal(f"expert {forward.__qualname__} is decorated; autoep does not know what the decorator does")
    a = tree.args
    if len(a.args) != 2 or a.vararg or a.kwarg or a.kwonlyargs:
        raise Refusal(f"expert {forward.__qualname__} does not take one input")
    scope, x = Scope(forward), a.args[1].arg
    env: dict[str, tuple] = {x: ("x",)}
    body = [s for s in tree.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]

    def ev(node):
        if isinstance(node, ast.Name) and node.id in env:
            return env[node.id]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            return ("mul", ev(node.left), ev(node.right))
        if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
                return ("call", f.attr, ev(node.args[0]))
            if isinstance(f, (ast.Name, ast.Attribute)) and not (isinstance(f, ast.Name) and f.id in env):
                fn = scope.resolve(f)
                if fn in _FUNCTION_MODULES and genuine(fn):  # a patched F.silu is not nn.SiLU
                    return ("fn", fn, ev(node.args[0]))
        raise Refusal(f"expert {forward.__qualname__} line {node.lineno}: `{ast.unparse(node)[:80]}` is not understood")

    for stmt in body[:-1]:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            raise Refusal(f"expert {forward.__qualname__} line {stmt.lineno} is not an assignment to a name")
        env[stmt.targets[0].id] = ev(stmt.value)
    if not isinstance(body[-1], ast.Return) or body[-1].value is None:
        raise Refusal(f"expert {forward.__qualname__} does not end in a return")
    out, dropouts = _peel(ev(body[-1].value), (), around="call")
    try:
        kind, down, prod = out
        prod, dropouts = _peel(prod, dropouts, around="mul")
        _, left, right = prod
        assert kind == "call" and prod[0] == "mul"
        for act_side, up_side in ((left, right), (right, left)):
            if act_side[0] == "call" and act_side[1] == "act_fn" and act_side[2][0] == "call":
                act, gate = "act_fn", act_side[2]
            elif act_side[0] == "fn" and act_side[2][0] == "call":
                act, gate = act_side[1], act_side[2]
            else:
                continue
            names = {gate[1], up_side[1], down}
            if gate[2] == ("x",) and up_side[0] == "call" and up_side[2] == ("x",) and len(names) == 3 \
                    and not names & set(dropouts):
                return gate[1], up_side[1], down, act, dropouts
    except (AssertionError, ValueError, TypeError, IndexError):
        pass
    raise Refusal(f"expert {forward.__qualname__} does not return down(act(gate(x)) * up(x))")


def _peel(expr: tuple, dropouts: tuple, around: str) -> tuple[tuple, tuple]:
    """``self.d(<around>)``, around the output (``down(...)``, a call) or the product before ``down`` (a
    ``mul``): a module proven a no-op dropout per expert later (``_check_dropout``), peeled, its name kept."""
    if isinstance(expr, tuple) and expr[0] == "call" and isinstance(expr[2], tuple) and expr[2][0] == around:
        return expr[2], dropouts + (expr[1],)
    return expr, dropouts


def _check_dropout(expert: nn.Module, name: str, what: str) -> None:
    """Dropout inside an expert draws its own mask per call, which an exchange cannot reproduce; at p=0 it
    is the identity in training and eval alike, which the stacked experts compute."""
    d = getattr(expert, name, None)
    if type(d) is not nn.Dropout:
        raise Refusal(f"{what}.{name} is a {type(d).__name__}, not the nn.Dropout the proof can leave out")
    elementwise.runtime_clean(d, f"{what}.{name}")
    p = instance_attr(d, "p", f"{what}.{name}")  # a fact at p=0 too: raised after apply, it would draw masks
    if p != 0:
        raise Refusal(f"{what}.{name} is dropout with p={p}: inside the experts it draws a mask per expert "
                      "call, which EP cannot reproduce; exact only at p=0 (set it to 0, or opt out)")


def module_list_facts(experts: nn.Module, path: str = "experts", draws_on_owner: bool = False) -> dict:
    """The experts of a ``ModuleList``/``ModuleDict`` (expert e: the e-th entry), proven one of two kinds:

    - ``expert_kind="swiglu"`` (the grouped-GEMM fast path may run them): every expert the same class and
      forward ``down(act(gate(x)) * up(x))`` with bias-free exact ``nn.Linear`` projections of equal shapes,
      dtype and device, the same element-wise activation, nothing tied, nothing hooked, uniformly trainable;
    - ``expert_kind="row_local"`` (only their own forward may run them): every expert row-local, deterministic
      and stateless (``autoep.detect.row_local``), no parameter shared between experts.

    Refuses naming the property the row-local proof found broken (the SwiGLU shape is only a fast path).
    ``draws_on_owner``: ``row_local.prove_expert``'s (an element-wise dropout with p > 0 accepted, drawn on the
    owner; the SwiGLU fast path leaves dropout out, so it takes p=0 alone)."""
    if type(experts) not in (nn.ModuleList, nn.ModuleDict):
        raise Refusal(f"{path} is a {type(experts).__name__}, not a plain nn.ModuleList or nn.ModuleDict")
    if type(experts) is nn.ModuleList:
        try:
            return dict(_swiglu_facts(experts), expert_kind="swiglu")
        except Refusal:
            pass
    return row_local_facts(experts, path, draws_on_owner=draws_on_owner)


def row_local_facts(experts: nn.Module, path: str, members: list | None = None, folded_path: str | None = None,
                    draws_on_owner: bool = False) -> dict:
    """``expert_kind="row_local"``: each expert proven on its own (heterogeneous experts are fine: each runs
    its own forward), no parameter object in two experts (its gradient would be split over ranks), no global
    hooks (they would see other batches of rows). ``folded``: the constant attributes the proofs read, as
    ``<path>.<e or *>.<attr>=<value>`` (``*``: the same in every expert). ``members``: the experts, where the
    container holds more than them (default: every entry). ``folded_path``: the path the folded entries name
    the experts under where it is not ``path`` ("": experts registered on the block itself, held in a plain
    dict/list attribute; entries ``<key>.<attr>``, one per expert). ``expert_draws``: the draws accepted under
    ``draws_on_owner`` (``row_local.ExpertProof.draws``), named as ``folded`` is, ``<path>.<e or *>.<where>=<what>``."""
    if members is None:
        members = list(experts.values()) if isinstance(experts, nn.ModuleDict) else list(experts)
    if not members:
        raise Refusal(f"{path} holds no experts")
    if global_hooks():
        raise Refusal("global module hooks are registered; under EP they would see other batches of rows")
    owner: dict[int, int] = {}
    per_expert, per_expert_draws = [], []
    for e, expert in enumerate(members):
        for name, p in expert.named_parameters(remove_duplicate=False):
            if owner.setdefault(id(p), e) != e:
                raise Refusal(f"{path}[{e}].{name} is the same parameter as one of {path}[{owner[id(p)]}]: a "
                              "parameter shared between experts would get its gradient on two ranks")
        proof = row_local.prove_expert(expert, f"{path}[{e}]", draws_on_owner)
        per_expert.append(proof.folded)
        per_expert_draws.append(proof.draws)
    named = path if folded_path is None else folded_path
    return dict(expert_kind="row_local", expert_projs=(), expert_act="", identity_experts=0,
                folded=fold_entries(named, per_expert, expert_keys(experts)),
                expert_draws=fold_entries(named, per_expert_draws, expert_keys(experts)))


def expert_keys(experts: nn.Module) -> list[str]:
    """How a path names each entry of the container: a ModuleDict's keys, a ModuleList's indices."""
    return list(experts.keys()) if isinstance(experts, nn.ModuleDict) else [str(e) for e in range(len(experts))]


def fold_entries(path: str, per_expert: list, keys: list[str]) -> tuple[str, ...]:
    """The ``folded`` entries of the experts named ``<path>.<key>`` (``keys``, one per expert), their proofs' folded
    ``(attr, value)`` pairs in ``per_expert``: ``<path>.*.<attr>=<value>`` where every expert reads the same."""
    values: dict[str, dict[int, str]] = {}
    for e, folded in enumerate(per_expert):
        for attr, value in folded:
            values.setdefault(attr, {})[e] = value
    out = []
    for attr, by_expert in sorted(values.items()):
        # ``*`` reads every entry of the container: only where every entry is an expert
        # (not for experts on the block itself, path "": ``*`` there would read every child of the block)
        if path and len(by_expert) == len(per_expert) == len(keys) and len(set(by_expert.values())) == 1:
            out.append(f"{path}.*.{attr}={next(iter(by_expert.values()))}")
        else:
            out.extend(f"{path}.{keys[e]}.{attr}={v}".lstrip(".") for e, v in sorted(by_expert.items()))
    return tuple(out)


def _swiglu_facts(experts: nn.ModuleList) -> dict:
    routed, identities = _routed_and_identity(experts)
    classes = {type(e) for e in routed}
    if len(classes) != 1:
        raise Refusal(f"experts mix classes {sorted(c.__name__ for c in classes)}")
    cls = classes.pop()
    gate, up, down, act, dropouts = _swiglu_shape(cls.forward)
    first = experts[0]
    shapes = {n: tuple(getattr(first, n).weight.shape) if isinstance(getattr(first, n, None), nn.Linear) else None
              for n in (gate, up, down)}
    seen: set[int] = set()
    for e, expert in enumerate(routed):
        _check_expert(expert, e, cls, (gate, up, down), shapes, act, first, seen)
        for name in dropouts:
            _check_dropout(expert, name, f"experts[{e}] ({cls.__name__})")
    for e, expert in enumerate(identities, start=len(routed)):
        elementwise.runtime_clean(expert, f"experts[{e}] (Identity)")
    params = [p for expert in routed for p in expert.parameters()]
    if len({(p.dtype, p.device, p.requires_grad) for p in params}) != 1:
        raise Refusal("experts differ in dtype, device or requires_grad (frozen experts cannot be stacked)")
    if global_hooks():
        raise Refusal("global module hooks are registered; the stacked experts would not run them")
    return dict(expert_projs=(gate, up, down), expert_act="act_fn" if act == "act_fn" else act.__name__,
                identity_experts=len(identities))


def _routed_and_identity(experts: nn.ModuleList) -> tuple[list, list]:
    """The computing experts and the zero-compute ``nn.Identity`` experts after them (LongCat-Flash):
    an identity expert adds ``w * x``, which the recipe computes where the token is. Identities anywhere
    but at the end would renumber the stacked experts, so they are refused."""
    identities = [e for e in experts if type(e) is nn.Identity]
    routed = list(experts)[: len(experts) - len(identities)]
    if not routed:
        raise Refusal("experts ModuleList has no computing experts")
    if any(type(e) is nn.Identity for e in routed):
        raise Refusal("experts ModuleList has nn.Identity experts before computing ones (only trailing ones are taken)")
    return routed, identities


def _check_expert(expert, e, cls, names, shapes, act, first, seen) -> None:
    what = f"experts[{e}] ({cls.__name__})"
    elementwise.runtime_clean(expert, what)
    own = {n for n, _ in expert.named_parameters(remove_duplicate=False)}
    if own != {f"{n}.weight" for n in names}:
        raise Refusal(f"{what} holds parameters {sorted(own)}; its forward uses only {[f'{n}.weight' for n in names]}")
    if list(expert.buffers()):
        raise Refusal(f"{what} holds buffers its forward does not use")
    for n in names:
        lin = getattr(expert, n)
        if type(lin) is not nn.Linear or lin.bias is not None:
            raise Refusal(f"{what}.{n} is not a bias-free nn.Linear")
        elementwise.runtime_clean(lin, f"{what}.{n}")
        if tuple(lin.weight.shape) != shapes[n]:
            raise Refusal(f"{what}.{n} has shape {tuple(lin.weight.shape)}, experts[0] has {shapes[n]}")
        if id(lin.weight) in seen:
            raise Refusal(f"{what}.{n}.weight is tied to another expert's weight")
        seen.add(id(lin.weight))
    if act == "act_fn":
        elementwise.check_activation_module(expert.act_fn, f"{what}.act_fn")
        if not elementwise.same_activation(expert.act_fn, first.act_fn):
            raise Refusal(f"{what}.act_fn differs from experts[0].act_fn")


def global_hooks() -> bool:
    from torch.nn.modules import module as m

    names = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
             "_global_backward_pre_hooks")
    return any(getattr(m, n, None) for n in names)


# ---------------------------------------------------------------------------------------------
# v4-style blocks: the one expert loop to splice out
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SplicePlan:
    """One expert region and what it reads: the recipe replaces the statements ``first..last`` of the
    statement list ``path`` leads to in ``method`` (``autoep.detect.regions``) by one call into the exchange and
    runs the rest as written.

    ``kind="loop"`` (one ``for`` statement): ``__autoep_expert_loop__(self, acc, x, idx, w)`` adds
    ``w[t, k] * expert_{idx[t, k]}(x[t])`` into ``acc``. ``kind="split"`` (``split_loop``: the loop over
    per-expert row counts and the concatenation after it): ``out = __autoep_expert_loop__(self, rows,
    counts)`` gives each expert's output on its own contiguous rows, in expert order. ``kind="masked"``
    (``split_loop.masked_loop``): ``__autoep_expert_loop__(self, y, x, ids)`` sets ``y[p] =
    expert_{ids[p]}(x[p])`` for every row whose id names an expert."""

    method: str
    fn: object
    first: int
    last: int
    args: tuple[str, ...]
    out: str | None = None
    kind: str = "loop"
    add_at_rows: bool = False  # the loop wrote ``acc[tok] += ...``: exact only if no token meets an expert twice
    empty_1d: bool = False  # split: with no rows the block's own code gives ``rows.new_empty(0)``
    path: tuple = ()
    no_grad: bool = False  # the method is decorated ``@torch.no_grad()``; its spliced twin is too
    # What the region does with an expert without rows (``MoeStructure.idle_experts``): "call" it on zero rows,
    # "skip" it, "touch" it (zero gradients, not called), "touch_training" (touch only while training).
    idle: str = "call"


def _block_trees(block: nn.Module) -> dict:
    """``{method: (function, tree, no_grad)}``: the block's forward and the methods of its own it calls."""
    cls = type(block)
    if "forward" in vars(block):
        raise Refusal(f"{cls.__name__} has an instance-level forward")
    if type(block).__call__ is not nn.Module.__call__:
        raise Refusal(f"{cls.__name__} overrides __call__")
    return block_methods(block)


def expert_container(block: nn.Module) -> str | None:
    """The attribute of the ``ModuleList``/``ModuleDict`` the block's expert loop indexes by expert id, found
    by data flow (not by its name): a child container that a ``for`` loop of the forward (or a method it
    calls) indexes (``self.<name>[...]``) or enumerates. ``None`` when no loop does; refused when several
    containers are looped over that way."""
    containers = [n for n, m in block._modules.items() if type(m) in (nn.ModuleList, nn.ModuleDict)]
    if not containers:
        return None
    trees = _block_trees(block)
    found = [n for n in containers if any(_indexed_in_loop(loop, n) for _, t, _ in trees.values()
                                          for *_, loop in regions.expert_loops(t, n))]
    if len(found) > 1:
        raise Refusal(f"{type(block).__name__} loops over several module containers by index ({found}); "
                      "which one holds the experts is ambiguous")
    return found[0] if found else None


def _indexed_in_loop(loop: ast.For, attr: str) -> bool:
    """The loop reads ``self.<attr>[...]``, ``enumerate(self.<attr>)`` or ``len(self.<attr>)``: an index over
    the container (a plain ``for layer in self.layers``, or over a slice ``self.layers[:n]``, is not)."""
    for node in ast.walk(loop):
        inner = node.value if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice) else \
            node.args[0] if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
            node.func.id in ("enumerate", "len") and len(node.args) == 1 else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "enumerate" \
                and len(node.args) == 1 and isinstance(node.args[0], ast.Call) and not node.args[0].args \
                and isinstance(node.args[0].func, ast.Attribute) and node.args[0].func.attr == "values":
            inner = node.args[0].func.value  # ``enumerate(self.<attr>.values())`` (NLLB-MoE's ModuleDict)
        if isinstance(inner, ast.Attribute) and inner.attr == attr and isinstance(inner.value, ast.Name) \
                and inner.value.id == "self":
            return True
        getattr_of = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
            and len(node.args) == 2 and not isinstance(node.args[1], ast.Constant)
        if getattr_of and isinstance(node.args[0], ast.Attribute) and node.args[0].attr == attr \
                and isinstance(node.args[0].value, ast.Name) and node.args[0].value.id == "self":
            return True  # ``getattr(self.<attr>, f"expert_{e}")``: resolved to the builtin by the loop's proof
    return False


def module_list_plan(block: nn.Module, attr: str = "experts") -> tuple[SplicePlan, ...]:
    """The block's expert regions over its experts container ``self.<attr>``, each proven, with every path
    through its forward running exactly one (``autoep.detect.regions``)."""
    cls = type(block)
    trees = _block_trees(block)
    found = [(m, path, i, loop) for m, (_, t, _) in trees.items() for path, i, loop in regions.expert_loops(t, attr)]
    if not found:
        raise Refusal(f"{cls.__name__}: no `for` statement of its forward, or of the methods it calls, iterates "
                      f"self.{attr} (a comprehension, `zip` or `map` over the experts is run by record/replay only)")
    loops = {id(loop) for *_, loop in found}
    helpers = {}
    for m, (_, t, _) in trees.items():
        _experts_only_in(t, loops, f"{cls.__name__}.{m}", attr)
        if m != "forward":
            helpers[m] = regions.exchanges_on_every_path(t, loops, {}, f"{cls.__name__}.{m}")
    runs = regions.exchanges_on_every_path(trees["forward"][1], loops, {m: c for m, c in helpers.items() if c},
                                           f"{cls.__name__}.forward")
    if runs != 1:
        raise Refusal(f"{cls.__name__}.forward runs the expert region {runs} times on every path, not once")
    return tuple(_plan(block, trees[m], m, path, i, loop, attr) for m, path, i, loop in found)


def block_methods(block: nn.Module) -> dict[str, tuple]:
    """``{name: (function, tree, no_grad)}`` of the block's forward and the methods it calls on ``self``: where
    the proof checks every ``self.experts`` read statement by statement (``autoep.detect.expert_reads`` follows
    the rest)."""
    cls = type(block)
    forward = plain_method(cls, "forward", block)
    trees = {"forward": (forward, function_tree(forward), False)}
    for call in ast.walk(trees["forward"][1]):
        name = _self_method_call(call)
        if name and name not in trees and inspect.isfunction(getattr(cls, name, None)):
            fn, no_grad = _helper_method(cls, name, block)
            trees[name] = (fn, function_tree(fn), no_grad)
    return trees


def _helper_method(cls: type, name: str, owner: nn.Module):
    """A method the forward calls: plain, or decorated exactly ``@torch.no_grad()`` (DeepSeek's ``moe_infer``)."""
    fn = getattr(cls, name)
    inner = getattr(fn, "__wrapped__", None)
    if inner is None or name in vars(owner) or not inspect.isfunction(inner):
        return plain_method(cls, name, owner), False
    decorators = function_tree(inner).decorator_list
    code = getattr(fn, "__code__", None)
    known_wrapper = code is not None and code.co_filename == _NO_GRAD_WRAPPER_FILE and fn.__name__ == inner.__name__
    if not (known_wrapper and len(decorators) == 1 and _is_no_grad_call(inner, decorators[0])):
        raise Refusal(f"{cls.__name__}.{name} is decorated; autoep knows only @torch.no_grad()")
    if hasattr(inner, "__wrapped__") or name in vars(owner):
        raise Refusal(f"{cls.__name__}.{name} is wrapped twice")
    return inner, True


_NO_GRAD_WRAPPER_FILE = inspect.getsourcefile(torch.no_grad()(lambda: None))


def _is_no_grad_call(fn, node: ast.AST) -> bool:
    if not (isinstance(node, ast.Call) and not node.args and not node.keywords):
        return False
    try:
        return Scope(fn).resolve(node.func) is torch.no_grad
    except Refusal:
        return False


def _self_method_call(node) -> str | None:
    ok = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    ok = ok and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
    return node.func.attr if ok else None


def _experts_only_in(tree: ast.FunctionDef, loops: set[int], where: str, attr: str = "experts") -> None:
    """Outside the expert loops, ``self.<attr>`` is read only as ``len(self.<attr>)``."""
    in_loop = {id(n) for loop in ast.walk(tree) if id(loop) in loops for n in ast.walk(loop)}
    in_len = {id(c.args[0]) for c in ast.walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
              and c.func.id == "len" and len(c.args) == 1}
    for node in self_reads(tree, attr):
        if id(node) not in in_loop and id(node) not in in_len:
            raise Refusal(f"{where} line {node.lineno} uses self.{attr} outside the expert loop")


def _plan(block, method_tree, method: str, path: tuple, index: int, loop: ast.For, attr: str) -> SplicePlan:
    fn, tree, no_grad = method_tree
    stmts = regions.statements(tree, path)
    common = dict(path=path, no_grad=no_grad)
    _no_random_modules(block, fn, loop)
    if split_loop.is_split_loop(loop, attr):
        region = split_loop.split_region(fn, stmts, block, index, attr)
        _nothing_used_after(fn, tree, stmts[region.first:region.last + 1], keep=region.out)
        return SplicePlan(method, fn, region.first, region.last, (region.rows, region.counts), region.out,
                          kind="split", empty_1d=region.empty_1d, idle=region.idle, **common)
    if split_loop.is_masked_loop(loop):
        args = split_loop.masked_loop(fn, block, loop, attr)
        _nothing_used_after(fn, tree, [loop])
        return SplicePlan(method, fn, index, index, args, kind="masked", **common)
    experts = block._modules[attr]
    p = Prover(fn, tree, block, len(experts), batched=False, experts=experts)
    prelude(p, regions.before(tree, path, index))
    p.loop(loop)
    if p.facts.expert is None or strip_casts(p.facts.expert) != ("expert", ("x",)):
        raise Refusal(f"{p.where}: the loop adds {p.facts.expert}, not expert(x[tok]) × weight")
    stored = _nothing_used_after(fn, tree, [loop])
    names = {}
    for role in ("acc", "x", "idx", "w"):
        value = getattr(p.facts, role)
        holders = [n for n, v in p.env.items() if v is value and n not in stored]
        if not holders:
            raise Refusal(f"{p.where}: the loop's {role} is not held by a name at the loop")
        names[role] = holders[0]
    args = tuple(names[r] for r in ("acc", "x", "idx", "w"))
    return SplicePlan(method, fn, index, index, args, add_at_rows=p.facts.add_at_rows, idle=p.facts.idle, **common)


def _no_random_modules(block: nn.Module, fn, loop: ast.For) -> None:
    """The expert region calls none of the block's own dropout modules while they draw random numbers (p > 0,
    training): NLLB-MoE's ``self.token_dropout(expert_output)`` draws a mask per expert call, over rows that EP
    regroups across ranks, which no exchange can reproduce. Refused naming it, whatever else the loop does."""
    for node in ast.walk(loop):
        f = node.func if isinstance(node, ast.Call) else None
        if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self"):
            continue
        module = block._modules.get(f.attr)
        if isinstance(module, nn.Dropout.__mro__[1]) and module.p > 0 and module.training:
            raise Refusal(f"{fn.__qualname__} line {node.lineno}: `{ast.unparse(node)[:60]}` is "
                          f"{type(module).__name__} with p={module.p} while training inside the expert loop: it draws "
                          "random numbers per expert call, which EP cannot reproduce (exact only at p=0 or in eval)")


def _nothing_used_after(fn, tree: ast.FunctionDef, region: list[ast.stmt], keep: str | None = None) -> set[str]:
    """The names the region's statements bind (but ``keep``, its result) are not read after it (in line
    order, anywhere in the method: conservative for a region in an ``if`` branch)."""
    stored = {n.id for s in region for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    end = region[-1].end_lineno
    later = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and getattr(n, "lineno", 0) > end}
    used = (stored - {keep}) & later
    if used:
        raise Refusal(f"{fn.__qualname__}: {sorted(used)} from inside the expert region are used after it")
    return stored
