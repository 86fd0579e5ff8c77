"""Experts by role (issue 31): which modules a block's forward calls are its experts, found by data flow from the
routing, across containers, never by attribute names.

An expert is what one expert id selects and routed rows reach: the modules called, in a loop (a ``for`` statement
or a comprehension) whose target holds an expert id (``for i in range(E)``, ``for i, expert in enumerate(...)``,
``for e in selected.unique().tolist()``), with that entry selected by that id (``self.lora_A[i]``, the ``expert``
of ``enumerate(self.experts)``, the pair of ``enumerate(zip(self.lora_A, self.lora_B))``), on rows the id picks
(the call's argument reads a name the loop derived from the id: ``tok, slot = torch.where(selected == i)``,
``x[tok]``, or another such call's output: ``self.lora_B[i](self.lora_A[i](x[tok]))``). Each call is one *use*:

- **routed**: selected by the id of the loop whose id picks its rows;
- **whole**: its rows are picked by no loop's id (``shared(x)``, ``sum(e(x) for e in self.shared_experts)``):
  every row reaches it, and it stays where the token is, as the rest of the block (shared experts, per-adapter
  routers), never sharded;
- **misaligned** (refused, naming the line): routed rows reach an entry some other way (``self.lora_B[i + 1]``, a
  list iterated inside the routed loop, ``self.shared[0](x[tok])``): which expert the entry belongs to would be a
  guess.

Rows may also be picked by loops around the selecting one (a task loop around each task's routed loop: ``for t``,
then ``for i`` over task t's experts on rows ``selected_t == i``): the entry is still the one the innermost routing's
id selects. An entry bound to a local by another index than the id (``lora_a = getattr(self, f"lora_A{i + 1}")``) and
called on routed rows is misaligned, as the direct call is.

The sources a use selects from:

- a ``ModuleList``/``ModuleDict`` child of the block (``self.<name>``, its ``.values()``/``.items()``);
- numbered attributes (``attr:<prefix>``): ``getattr(self, f"<prefix>{i}")``, the f-string's one value the loop's id
  itself (``f"expert_{i + 1}"`` is misaligned), its entries the block's children ``<prefix>0 .. <prefix>{n-1}``,
  resolved from the block's children: refused (``Misplaced``) where a name of that form is no module, the numbers
  have a gap, or the forward reads a member by its name (``self.expert_0``, ``getattr(self, "expert_0")``, the string
  anywhere: a module used by name is the block's own code, not only an expert). Several families indexed by one id
  are aligned as containers are (a LoRA mixture's ``lora_A{i}``, ``lora_B{i}``: one expert across both);
- a list the forward builds of the block's modules (``experts = [self.base_layer] + list(self.adapters)``,
  ``list(self.shared_experts)`` then ``.extend(self.task_experts[t])``, ``self.experts[:k]``), evaluated from the
  source to the modules' paths, per value of the enclosing loop counters it reads (``autoep.detect.built_lists``).

Multi-task lists: a module that loops with different id numberings reach (a shared expert that task t's list holds
at ``len(task_experts[t]) + j``) is one expert with one owner, not one per numbering: ``replay_proof`` places every
module some list routes, once. That is consistent because the one-pass execution moves each *call* of a placed
module to its owner, whichever loop and id make it; the ids only ever pick rows, never an owner.

``roles(block, fns, candidates)`` returns each source's role (``Roles``) or raises ``Refusal``; it never runs
anything.

Why this is enough for exactness: the one-pass execution moves every call of a placed module to its owner and
runs every other call where the token is, so a role decides only placement (what is sharded, what lies together
on one owner), never a value; misaligned uses are refused so that placement is never a guess.
"""
from __future__ import annotations

import ast
import builtins
import re
from dataclasses import dataclass, field

import torch.nn as nn

from autoep.detect import built_lists
from autoep.detect.built_lists import family_ref
from autoep.detect.source import Refusal, function_tree

ROUTED, WHOLE, ROUTER = "routed", "whole", "router"


class Misplaced(Refusal):
    """Experts found by role whose placement would be a guess (a misaligned use, aligned containers that differ, two
    sources of routed calls): the detector names it rather than the fast paths' reason alone."""


@dataclass(frozen=True)
class Roles:
    """Each source's role (``{source: role}``, a source a container's name, ``attr:<prefix>`` for numbered
    attributes or ``list:<local>``), the module paths of each forward-built list per value of the loop counters it
    reads (``{"list:<local>": ((paths, ...), ...)}``: its variants), and the lines of routed uses."""

    role: dict = field(default_factory=dict)
    lists: dict = field(default_factory=dict)
    lines: dict = field(default_factory=dict)  # source -> "Class.method line N" of its first routed use
    loops: dict = field(default_factory=dict)  # source -> the loops routing its uses ("Class.method line N", ...)
    families: dict = field(default_factory=dict)  # "attr:<prefix>" -> the numbered children (expert_0, ...)
    unread: dict = field(default_factory=dict)  # local name -> why a list of modules it holds is not read
    # source -> the index expressions selecting its entries by several loops' ids (two-level routing: ``[g][j]``,
    # ``[g * self.per_group + j]``), as source text: aligned containers must select alike
    selectors: dict = field(default_factory=dict)

    def routed(self) -> list[str]:
        return [s for s, r in self.role.items() if r == ROUTED]


@dataclass
class _Loop:
    node: ast.AST  # the For or the comprehension
    ids: set[str]  # names holding the loop's expert id
    members: dict[str, str]  # name -> source its value is an entry of
    tainted: set[str] = field(default_factory=set)  # names the loop derived from its id
    body: list[ast.AST] = field(default_factory=list)
    lists: dict[str, str] = field(default_factory=dict)  # local name -> the source it holds
    containers: set[str] = field(default_factory=set)  # the container children that are sources
    dicts: set[str] = field(default_factory=set)  # those that are ModuleDicts (iterated, they give their keys)
    families: set[str] = field(default_factory=set)  # prefixes of numbered attributes (``getattr(self, f"p{i}")``)
    shifted: set[str] = field(default_factory=set)  # members bound to an entry another index than the id selects


def roles(block: nn.Module, fns: list, candidates: list[str]) -> Roles:
    """The role of each of ``candidates`` (the block's container children the forward reads), of each family of
    numbered attributes the forward reaches by ``getattr`` and of each list the forward builds of the block's
    modules, from every use in ``fns`` (the block's forward and the methods it calls). ``Refusal`` naming the line of
    a misaligned use, a family with a gap or a member read by its name."""
    found = Roles()
    families, problems = _families(block, fns)
    found.families.update({f"attr:{prefix}": names for prefix, names in families.items()})
    for fn in fns:
        tree = function_tree(fn)
        where = getattr(fn, "__qualname__", getattr(fn, "__name__", "forward"))
        lists, unread = built_lists.lists(block, tree, where)
        found.unread.update(unread)
        # A name holding every entry of a container, in order (``experts = self.experts``), is that container.
        names = {n: _alias(block, variants, candidates) or f"list:{n}" for n, variants in lists.items()}
        found.lists.update({names[n]: variants for n, variants in lists.items() if names[n].startswith("list:")})
        # Iterating a ModuleDict itself gives its keys (expert ids), its ``.values()`` the entries.
        dicts = {c for c in candidates if isinstance(block._modules[c], nn.ModuleDict)}
        loops = _loops(tree, set(candidates), names, dicts, set(families))
        nested = {c for c in candidates if isinstance(block._modules[c], nn.ModuleList) and len(block._modules[c])
                  and all(isinstance(e, (nn.ModuleList, nn.ModuleDict)) for e in block._modules[c])}
        for call, enclosing in _calls(tree, loops):
            use = _use(call, enclosing, set(candidates), names, set(families), f"{where} line {call.lineno}",
                       nested)
            if use is None:
                continue
            source, kind, loop = use
            if kind == ROUTED and _indexes(call.func):
                found.selectors.setdefault(source, set()).add(" ".join(ast.unparse(i) for i in _indexes(call.func)))
            before = found.role.get(source)
            if kind == ROUTED and _picks_rows(tree, call, loop, loops):
                kind = ROUTER
            if kind == ROUTED:
                found.lines.setdefault(source, f"{where} line {call.lineno}")
                found.loops.setdefault(source, set()).add(f"{where} line {loop.node.lineno}")
            found.role[source] = next(r for r in (ROUTER, ROUTED, WHOLE) if r in (before, kind))
    for prefix, problem in problems.items():  # a numbered family no routed loop reaches runs where the token is
        if found.role.get(f"attr:{prefix}") == ROUTED:
            raise Misplaced(problem)
    return found


def _picks_rows(tree: ast.FunctionDef, call: ast.Call, loop: _Loop, loops: list[_Loop]) -> bool:
    """Whether the output of ``call`` (a routed use in ``loop``) decides which rows another loop's id picks: a
    per-group router in two-level routing (``w, idx = self.expert_gates[g](xg).softmax(-1).max(-1)``, then
    ``tok = torch.where(idx == j)[0]`` in the loop over the group's experts). Such a module routes, it is no expert:
    it stays where the token is (placing it would leave the rows of the next level pending on the host)."""
    derived = _derived(tree, call)
    for other in loops:
        if other is loop or not other.ids:
            continue
        for part in other.body:
            for node in ast.walk(part):
                if isinstance(node, ast.Assign) and _reads(node.value) & derived and _reads(node.value) & other.ids:
                    return True
    return False


def _derived(tree: ast.FunctionDef, call: ast.Call) -> set[str]:
    """The names assigned from ``call``'s output in ``tree``, and from those, to a fixpoint (flow-insensitive)."""
    assigns = [node for node in ast.walk(tree) if isinstance(node, ast.Assign)]
    names: set[str] = set()
    for node in assigns:
        if any(n is call for n in ast.walk(node.value)):
            names |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    changed = bool(names)
    while changed:
        changed = False
        for node in assigns:
            if _reads(node.value) & names:
                new = {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)} - names
                if new:
                    names |= new
                    changed = True
    return names


def _alias(block: nn.Module, variants: tuple[tuple[str, ...], ...], candidates: list[str]) -> str | None:
    for name in candidates:
        child = block._modules[name]
        keys = list(child.keys()) if isinstance(child, nn.ModuleDict) else [str(i) for i in range(len(child))]
        if variants == (tuple(f"{name}.{k}" for k in keys),):
            return name
    return None


# ---------------------------------------------------------------------------------------------
# Numbered attributes: ``getattr(self, f"expert_{i}")``
# ---------------------------------------------------------------------------------------------


def _families(block: nn.Module, fns: list) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    """``({prefix: (f"{prefix}0", ..., f"{prefix}{n-1}")}, {prefix: problem})`` for each prefix the forward formats
    an index into (``getattr(self, f"expert_{i}")``) that names children of the block. A problem (the family holds a
    name that is no module, its numbers have a gap, or the forward reads a member by its name: ``self.expert_0``,
    ``getattr(self, "expert_0")``, the string anywhere) refuses the block only where the family is routed
    (``roles``): which modules the id reaches would be a guess."""
    cls = type(block).__name__
    refs = [(fn, node) for fn in fns if _builtin_getattr(fn) for node in ast.walk(function_tree(fn))
            if family_ref(node) is not None]
    out: dict[str, tuple[str, ...]] = {}
    problems: dict[str, str] = {}
    for prefix in dict.fromkeys(family_ref(node)[0] for _, node in refs):
        pattern = re.compile(re.escape(prefix) + r"(0|[1-9][0-9]*)")
        names = [n for n in dict.fromkeys([*block._modules, *block._parameters, *block._buffers, *vars(block)])
                 if pattern.fullmatch(n)]
        if not names:
            continue
        shown = f'getattr(self, f"{prefix}{{...}}")'
        numbers = sorted(int(pattern.fullmatch(n).group(1)) for n in names)
        out[prefix] = tuple(f"{prefix}{k}" for k in numbers)
        other = [n for n in names if not isinstance(block._modules.get(n), nn.Module)]
        if other:
            problems[prefix] = (f"{cls}: the forward reaches self.{prefix}<id> by {shown}, and self.{other[0]} is a "
                                f"{type(getattr(block, other[0], None)).__name__}, not a module; keep only the experts "
                                f"under the names {prefix}0..{prefix}<E-1>")
        elif numbers != list(range(len(numbers))):
            gap = next(k for k in range(len(numbers) + 1) if k not in numbers)
            problems[prefix] = (f"{cls}: the forward reaches self.{prefix}<id> by {shown}, but the block's children "
                                f"{prefix}{numbers[0]}..{prefix}{numbers[-1]} have a gap at {prefix}{gap}; which "
                                f"modules the expert id reaches would be a guess; number the experts "
                                f"{prefix}0..{prefix}<E-1>")
    member_of = {name: prefix for prefix, names in out.items() for name in names}
    for fn in fns:
        for node in ast.walk(function_tree(fn)):
            name = node.attr if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "self" else node.value if isinstance(node, ast.Constant) else None
            if isinstance(name, str) and name in member_of:
                where = getattr(fn, "__qualname__", "forward")
                problems.setdefault(member_of[name], f"{where} line {node.lineno} reads self.{name} by its name, "
                                    "besides reaching it by the expert id; an expert is called by the id only (keep a "
                                    "module used by name, a shared expert, under another name)")
    return out, problems


def _builtin_getattr(fn) -> bool:
    """``getattr`` in ``fn`` is the builtin (not shadowed by a global of its module)."""
    return getattr(fn, "__globals__", {}).get("getattr", builtins.getattr) is builtins.getattr


def _self_attr(expr: ast.AST) -> bool:
    return isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self"


def _container_attr(expr: ast.AST) -> str | None:
    """``self.<c>``, ``self.<c>.values()``: ``c``."""
    if isinstance(expr, ast.Call) and not expr.args and not expr.keywords and isinstance(expr.func, ast.Attribute) \
            and expr.func.attr == "values":
        expr = expr.func.value
    return expr.attr if _self_attr(expr) else None


# ---------------------------------------------------------------------------------------------
# Loops: what their target binds, what they derive from their id
# ---------------------------------------------------------------------------------------------


def _loops(tree: ast.FunctionDef, containers: set[str], lists: dict[str, str], dicts: set[str],
           families: set[str]) -> list[_Loop]:
    loops = []
    for node in ast.walk(tree):
        if isinstance(node, ast.For):
            loop = _Loop(node, set(), {}, body=list(node.body), lists=lists,
                         containers=containers, dicts=dicts, families=families)
            _bind(node.target, node.iter, loop, containers, lists)
            loops.append(loop)
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            loop = _Loop(node, set(), {}, body=[node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt],
                         lists=lists, containers=containers, dicts=dicts, families=families)
            for gen in node.generators:
                _bind(gen.target, gen.iter, loop, containers, lists)
                loop.body += gen.ifs
            loops.append(loop)
    for loop in loops:
        _taint(loop)
    return loops


def id_loops(tree: ast.FunctionDef) -> list[_Loop]:
    """Every loop of ``tree`` (``for`` statements and comprehensions) with the names holding its expert id and the
    names it derives from them (``_Loop.ids``, ``_Loop.tainted``), no sources of entries (``block_weights``' sites)."""
    return _loops(tree, set(), {}, set(), set())


def _source(expr: ast.AST, containers: set[str], lists: dict[str, str]) -> str | None:
    """The source whose entries iterating ``expr`` gives: a container child, or a forward-built list (``lists``:
    each local name's source)."""
    if hasattr(expr, "lineno") and built_lists.inline_key(expr) in lists:  # a list built where it is iterated
        return lists[built_lists.inline_key(expr)]
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "list" and len(expr.args) == 1:
        expr = expr.args[0]
    if isinstance(expr, ast.Name) and expr.id in lists:
        return lists[expr.id]
    container = _container_attr(expr)
    return container if container in containers else None


def _bind(target: ast.AST, it: ast.AST, loop: _Loop, containers: set[str], lists: dict[str, str]) -> None:
    """What ``for <target> in <it>`` binds: entries of a source (``loop.members``), and expert ids (every other
    plain name: ``range``'s, ``enumerate``'s counter, ``.items()``' key, a tensor's ``tolist()``)."""
    call = it if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) else None
    if call is not None and call.func.id == "enumerate" and call.args and isinstance(target, ast.Tuple) \
            and len(target.elts) == 2:
        _ids(target.elts[0], loop)
        _bind(target.elts[1], call.args[0], loop, containers, lists)
        return
    if call is not None and call.func.id == "zip" and isinstance(target, ast.Tuple) \
            and len(target.elts) == len(call.args):
        for t, a in zip(target.elts, call.args):
            _bind(t, a, loop, containers, lists)
        return
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "items" \
            and isinstance(target, ast.Tuple) and len(target.elts) == 2:
        container = _container_attr(it.func.value)
        if container in containers:
            _ids(target.elts[0], loop)
            if isinstance(target.elts[1], ast.Name):
                loop.members[target.elts[1].id] = container
            return
    source = _source(it, containers, lists)
    if source in loop.dicts and _self_attr(it.args[0] if isinstance(it, ast.Call) and it.args else it):
        source = None  # ``for key in self.<ModuleDict>``: expert ids
    if source is not None and isinstance(target, ast.Name):
        loop.members[target.id] = source
        return
    _ids(target, loop)


def _ids(target: ast.AST, loop: _Loop) -> None:
    loop.ids |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _taint(loop: _Loop) -> None:
    """The names the loop derives from its id, anywhere in its body (flow-insensitive, to a fixpoint: more names
    than the data flow can only refuse more or call more uses routed, never place a module wrongly)."""
    loop.tainted = set(loop.ids)
    assigns = []
    for stmt in loop.body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Assign):
                assigns.append((node.targets, node.value))
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                assigns.append(([node.target], node.value))
            elif isinstance(node, (ast.For, ast.comprehension)):
                assigns.append(([node.target], node.iter))
    changed = True
    while changed:
        changed = False
        for targets, value in assigns:
            if _reads(value) & loop.tainted:
                new = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)} - loop.tainted
                if new:
                    loop.tainted |= new
                    changed = True
    # An entry of the source is no row: ``expert`` of ``enumerate(self.experts)`` carries no routed rows itself.
    loop.tainted -= set(loop.members) - loop.ids
    # ``expert = self.experts[i]``, ``expert = getattr(self, f"expert_{i}")`` in the body: an entry selected by the id.
    for targets, value in assigns:
        if len(targets) != 1 or not isinstance(targets[0], ast.Name):
            continue
        ref, source, index = family_ref(value), None, None
        if ref is not None and ref[0] in loop.families:
            source, index = f"attr:{ref[0]}", ref[1]
        elif isinstance(value, ast.Subscript) and not isinstance(value.slice, ast.Slice):
            source = _container_attr(value.value) if _container_attr(value.value) in loop.containers else (
                loop.lists.get(value.value.id) if isinstance(value.value, ast.Name) else None)
            index = value.slice
        if source is not None:
            loop.members.setdefault(targets[0].id, source)
            loop.tainted.discard(targets[0].id)
            if not (isinstance(index, ast.Name) and index.id in loop.ids):  # ``a = getattr(self, f"lora_A{i + 1}")``
                loop.shifted.add(targets[0].id)


def _reads(expr: ast.AST) -> set[str]:
    """Names ``expr`` reads as data: not inside the callee of a call it makes (``self.lora_A[i](rows)`` reads
    ``rows``; which entry ``i`` selects is the use's own question)."""
    out: set[str] = set()
    stack = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Call):
            stack += [*node.args, *(k.value for k in node.keywords)]
            if not _entry_callee(node.func):
                stack.append(node.func)
            continue
        if isinstance(node, ast.Name):
            out.add(node.id)
        stack += list(ast.iter_child_nodes(node))
    return out


def _entry_callee(func: ast.AST) -> bool:
    return isinstance(func, ast.Name) or isinstance(func, ast.Subscript) and (
        _self_attr(func.value) or isinstance(func.value, ast.Name)) or family_ref(func) is not None


# ---------------------------------------------------------------------------------------------
# Uses
# ---------------------------------------------------------------------------------------------


def _calls(tree: ast.FunctionDef, loops: list[_Loop]):
    """Every call in ``tree`` with the loops around it, innermost last."""
    inside: dict[int, list[_Loop]] = {}
    for loop in loops:
        for part in loop.body:
            for node in ast.walk(part):
                inside.setdefault(id(node), []).append(loop)
    depth = {id(loop.node): sum(1 for other in loops for part in other.body for n in ast.walk(part)
                                if n is loop.node) for loop in loops}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, sorted(inside.get(id(node), []), key=lambda loop: depth[id(loop.node)])


def _use(call: ast.Call, loops: list[_Loop], containers: set[str], lists: dict[str, str], families: set[str],
         where: str, nested: set[str] = frozenset()) -> tuple[str, str, _Loop | None] | None:
    """``(source, routed | whole, the routing loop or None)`` for a call of an entry of a source (``nested``: the
    containers of containers, whose entries' entries are called, ``self.experts[g][j]``); None for any other call.
    ``Refusal`` for a misaligned one (module docstring)."""
    func, selected, ref, indexes = call.func, None, family_ref(call.func), []
    if isinstance(func, ast.Subscript) or ref is not None and ref[0] in families:
        if ref is not None:
            source, index = f"attr:{ref[0]}", ref[1]
        else:
            while isinstance(func, ast.Subscript) and isinstance(func.value, ast.Subscript):  # ``self.experts[g][j]``
                indexes.insert(0, func.slice)
                func = func.value
            source = func.value.attr if _self_attr(func.value) and func.value.attr in containers else (
                lists.get(func.value.id) if isinstance(func.value, ast.Name) else None)
            if source is not None and bool(indexes) != (source in nested):
                return None  # ``self.experts[i][0]`` of flat experts: a part of one, not a use (as before two levels)
            index = func.slice
            indexes.insert(0, index)
        if source is None:
            return None
        selected = None if len(indexes) > 1 else next(
            (loop for loop in reversed(loops) if isinstance(index, ast.Name) and index.id in loop.ids), None)
    elif isinstance(func, ast.Name):
        binding = next((loop for loop in reversed(loops) if func.id in loop.members), None)
        if binding is None:
            return None
        source = binding.members[func.id]
        selected = binding if binding.ids and func.id not in binding.shifted else None
    else:
        return None
    rows = _reads(ast.Tuple([*call.args, *(k.value for k in call.keywords)], ast.Load()))
    picking = [loop for loop in loops if rows & loop.tainted and loop.ids]
    if not picking:
        return source, WHOLE, None
    if selected is None and indexes and _by_every_id(indexes, picking, loops):
        return source, ROUTED, picking[-1]
    # Other loops may pick the rows too where they enclose the selecting one (a task loop around each task's routed
    # loop: ``for t``, then ``for i`` over task t's experts on rows ``selected_t == i``): the entry is still the one
    # the id of the innermost routing selects.
    if selected is not None and selected in picking and all(
            loop is selected or not loop.ids - set(loop.members) or loops.index(loop) < loops.index(selected)
            for loop in picking):
        return source, ROUTED, selected
    shown = ast.unparse(call)
    raise Misplaced(f"{where}: `{shown[:80]}` calls an entry of {_named(source)} on rows a loop's expert id picks, but "
                  "the entry is not selected by that id (which expert it belongs to would be a guess); index it by "
                  "the loop's id, or opt out")


def _indexes(func: ast.AST) -> list[ast.AST]:
    """The index expressions of ``self.<c>[a][b]`` where there are several or one is not a plain name (two-level
    routing), else ``[]``."""
    out = []
    while isinstance(func, ast.Subscript):
        out.insert(0, func.slice)
        func = func.value
    return out if len(out) > 1 or out and not isinstance(out[0], ast.Name) else []


def _by_every_id(indexes: list[ast.AST], picking: list[_Loop], loops: list[_Loop]) -> bool:
    """Two-level routing: an entry selected by the ids of every loop picking its rows, and by nothing else (no row
    value), where two or more loops pick them: one id per level of a container of containers (``self.experts[g][j]``,
    each index an id), or one index computed from the ids and constants (``self.experts[g * self.per_group + j]``)."""
    if len(picking) < 2:
        return False
    ids = {i for loop in loops for i in loop.ids}
    if len(indexes) > 1 and not all(isinstance(i, ast.Name) and i.id in ids for i in indexes):
        return False
    for index in indexes:
        for node in ast.walk(index):
            if isinstance(node, ast.Name) and node.id not in ids and node.id != "self":
                return False
            if not isinstance(node, (ast.Name, ast.Constant, ast.BinOp, ast.Attribute, ast.Load, ast.operator)):
                return False
    read = {n.id for index in indexes for n in ast.walk(index) if isinstance(n, ast.Name)}
    return {id(loop) for loop in loops if loop.ids & read} == {id(loop) for loop in picking}


def _named(source: str) -> str:
    if source.startswith("attr:"):
        return f"the numbered attributes self.{source[5:]}<id>"
    return f"the list {source[5:]} built in the forward" if source.startswith("list:") else f"self.{source}"
