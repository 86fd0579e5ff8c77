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

The sources a use selects from: a ``ModuleList``/``ModuleDict`` child of the block (``self.<name>``, its
``.values()``/``.items()``), and a list the forward builds of the block's modules (``experts = [self.base_layer] +
list(self.adapters)``; literals, ``+``, ``*`` unpacking, ``list(...)``, ``[m for m in ...]``, one assignment of its
name), evaluated here from the source to the modules' paths. ``roles(block, fns, candidates)`` returns each
source's role (``Roles``) or raises ``Refusal``; it never runs anything.

Why this is enough for exactness: the one-pass execution moves every call of a placed module to its owner and
runs every other call where the token is, so a role decides only placement (what is sharded, what lies together
on one owner), never a value; misaligned uses are refused so that placement is never a guess.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field

import torch.nn as nn

from autoep.detect.source import Refusal, function_tree

ROUTED, WHOLE = "routed", "whole"


class Misplaced(Refusal):
    """Experts found by role whose placement would be a guess (a misaligned use, aligned containers that differ, two
    sources of routed calls): the detector names it rather than the fast paths' reason alone."""


@dataclass(frozen=True)
class Roles:
    """Each source's role: ``routed`` (``{source: role}``, a source a container's name or ``list:<local>``), the
    module paths of each forward-built list (``{"list:<local>": (paths, ...)}``), and the lines of routed uses."""

    role: dict = field(default_factory=dict)
    lists: dict = field(default_factory=dict)
    lines: dict = field(default_factory=dict)  # source -> "Class.method line N" of its first routed use
    loops: dict = field(default_factory=dict)  # source -> the loops routing its uses ("Class.method line N", ...)

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


def roles(block: nn.Module, fns: list, candidates: list[str]) -> Roles:
    """The role of each of ``candidates`` (the block's container children the forward reads) and of each list the
    forward builds of the block's modules and calls entries of, from every use in ``fns`` (the block's forward and
    the methods it calls). ``Refusal`` naming the line of a misaligned use."""
    found = Roles()
    for fn in fns:
        tree = function_tree(fn)
        where = getattr(fn, "__qualname__", getattr(fn, "__name__", "forward"))
        lists = _local_lists(block, tree)
        # A name holding every entry of a container, in order (``experts = self.experts``), is that container.
        names = {n: _alias(block, paths, candidates) or f"list:{n}" for n, paths in lists.items()}
        found.lists.update({names[n]: paths for n, paths in lists.items() if names[n].startswith("list:")})
        # Iterating a ModuleDict itself gives its keys (expert ids), its ``.values()`` the entries.
        dicts = {c for c in candidates if isinstance(block._modules[c], nn.ModuleDict)}
        loops = _loops(tree, set(candidates), names, dicts)
        for call, enclosing in _calls(tree, loops):
            use = _use(call, enclosing, set(candidates), names, f"{where} line {call.lineno}")
            if use is None:
                continue
            source, kind, loop = use
            before = found.role.get(source)
            if kind == ROUTED:
                found.lines.setdefault(source, f"{where} line {call.lineno}")
                found.loops.setdefault(source, set()).add(f"{where} line {loop.node.lineno}")
            found.role[source] = ROUTED if ROUTED in (before, kind) else WHOLE
    return found


# ---------------------------------------------------------------------------------------------
# Lists the forward builds of the block's modules
# ---------------------------------------------------------------------------------------------


def _local_lists(block: nn.Module, tree: ast.FunctionDef) -> dict[str, tuple[str, ...]]:
    """``{name: module paths}`` for each name the function assigns once, from a list of the block's modules it
    builds (module docstring); names assigned more than once, or from anything else, are left out."""
    assigned: dict[str, list[ast.AST]] = {}
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.comprehension, ast.NamedExpr)) else []
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    assigned.setdefault(n.id, []).append(node)
    lists: dict[str, tuple[str, ...]] = {}
    for name, nodes in assigned.items():
        node = nodes[0]
        if len(nodes) != 1 or not isinstance(node, ast.Assign) or len(node.targets) != 1 \
                or not isinstance(node.targets[0], ast.Name):
            continue
        paths = _module_paths(block, node.value, lists)
        if paths:
            lists[name] = tuple(paths)
    return lists


def _alias(block: nn.Module, paths: tuple[str, ...], candidates: list[str]) -> str | None:
    for name in candidates:
        child = block._modules[name]
        keys = list(child.keys()) if isinstance(child, nn.ModuleDict) else [str(i) for i in range(len(child))]
        if paths == tuple(f"{name}.{k}" for k in keys):
            return name
    return None


def _module_paths(block: nn.Module, expr: ast.AST, lists: dict) -> list[str] | None:
    """The paths of the modules ``expr`` lists, in order, or None where it is not such a list."""
    if isinstance(expr, (ast.List, ast.Tuple)):
        out: list[str] = []
        for elt in expr.elts:
            part = _module_paths(block, elt.value, lists) if isinstance(elt, ast.Starred) else _one_module(block, elt)
            if part is None:
                return None
            out += part
        return out
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        left, right = _module_paths(block, expr.left, lists), _module_paths(block, expr.right, lists)
        return None if left is None or right is None else left + right
    if isinstance(expr, ast.Name):
        return list(lists[expr.id]) if expr.id in lists else None
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "list" \
            and len(expr.args) == 1 and not expr.keywords:
        return _module_paths(block, expr.args[0], lists)
    if isinstance(expr, ast.ListComp) and len(expr.generators) == 1:
        gen = expr.generators[0]
        if not gen.ifs and not gen.is_async and isinstance(gen.target, ast.Name) and isinstance(expr.elt, ast.Name) \
                and expr.elt.id == gen.target.id:
            return _module_paths(block, gen.iter, lists)
        return None
    container = _container_attr(expr)
    child = block._modules.get(container) if container else None
    if isinstance(child, nn.ModuleDict) and _self_attr(expr):
        return None  # ``list(self.<ModuleDict>)`` lists its keys
    if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
        keys = list(child.keys()) if isinstance(child, nn.ModuleDict) else [str(i) for i in range(len(child))]
        return [f"{container}.{k}" for k in keys]
    return None


def _one_module(block: nn.Module, expr: ast.AST) -> list[str] | None:
    """``self.<child>`` or ``self.<container>[<constant>]``: that module's path."""
    if _self_attr(expr) and isinstance(block._modules.get(expr.attr), nn.Module):
        return [expr.attr]
    if isinstance(expr, ast.Subscript) and _self_attr(expr.value) and isinstance(expr.slice, ast.Constant):
        child, key = block._modules.get(expr.value.attr), expr.slice.value
        if isinstance(child, nn.ModuleList) and type(key) is int and -len(child) <= key < len(child):
            return [f"{expr.value.attr}.{key % len(child)}"]
        if isinstance(child, nn.ModuleDict) and isinstance(key, str) and key in child:
            return [f"{expr.value.attr}.{key}"]
    return None


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


def _loops(tree: ast.FunctionDef, containers: set[str], lists: dict[str, str], dicts: set[str]) -> list[_Loop]:
    loops = []
    for node in ast.walk(tree):
        if isinstance(node, ast.For):
            loop = _Loop(node, set(), {}, body=list(node.body), lists=lists,
                         containers=containers, dicts=dicts)
            _bind(node.target, node.iter, loop, containers, lists)
            loops.append(loop)
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            loop = _Loop(node, set(), {}, body=[node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt],
                         lists=lists, containers=containers, dicts=dicts)
            for gen in node.generators:
                _bind(gen.target, gen.iter, loop, containers, lists)
                loop.body += gen.ifs
            loops.append(loop)
    for loop in loops:
        _taint(loop)
    return loops


def _source(expr: ast.AST, containers: set[str], lists: dict[str, str]) -> str | None:
    """The source whose entries iterating ``expr`` gives: a container child, or a forward-built list (``lists``:
    each local name's source)."""
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
    # ``expert = self.experts[i]`` in the body: an entry selected by the id.
    for targets, value in assigns:
        if len(targets) == 1 and isinstance(targets[0], ast.Name) and isinstance(value, ast.Subscript) \
                and isinstance(value.slice, ast.Name) and value.slice.id in loop.ids:
            source = _container_attr(value.value) if _container_attr(value.value) in loop.containers else (
                loop.lists.get(value.value.id) if isinstance(value.value, ast.Name) else None)
            if source is not None:
                loop.members.setdefault(targets[0].id, source)
                loop.tainted.discard(targets[0].id)


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
        _self_attr(func.value) or isinstance(func.value, ast.Name))


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


def _use(call: ast.Call, loops: list[_Loop], containers: set[str], lists: dict[str, str], where: str
         ) -> tuple[str, str, _Loop | None] | None:
    """``(source, routed | whole, the routing loop or None)`` for a call of an entry of a source; None for any other
    call. ``Refusal`` for a misaligned one (module docstring)."""
    func, selected = call.func, None
    if isinstance(func, ast.Subscript):
        source = func.value.attr if _self_attr(func.value) and func.value.attr in containers else (
            lists.get(func.value.id) if isinstance(func.value, ast.Name) else None)
        if source is None:
            return None
        index = func.slice
        selected = next((loop for loop in reversed(loops) if isinstance(index, ast.Name) and index.id in loop.ids),
                        None)
    elif isinstance(func, ast.Name):
        binding = next((loop for loop in reversed(loops) if func.id in loop.members), None)
        if binding is None:
            return None
        source = binding.members[func.id]
        selected = binding if binding.ids else None
    else:
        return None
    rows = _reads(ast.Tuple([*call.args, *(k.value for k in call.keywords)], ast.Load()))
    picking = [loop for loop in loops if rows & loop.tainted and loop.ids]
    if not picking:
        return source, WHOLE, None
    if selected is not None and selected in picking and all(loop is selected or not loop.ids - set(loop.members)
                                                            for loop in picking):
        return source, ROUTED, selected
    shown = ast.unparse(call)
    raise Misplaced(f"{where}: `{shown[:80]}` calls an entry of {_named(source)} on rows a loop's expert id picks, but "
                  "the entry is not selected by that id (which expert it belongs to would be a guess); index it by "
                  "the loop's id, or opt out")


def _named(source: str) -> str:
    return f"the list {source[5:]} built in the forward" if source.startswith("list:") else f"self.{source}"
