"""Lists of the block's modules its forward builds (issue 31, read by ``autoep.detect.expert_roles``), evaluated from
the source to the modules' paths, never run.

A local name is such a list where the function assigns it once (``experts = ...``) from

- list literals of modules (``[self.base_layer, self.adapters[0]]``, ``*`` unpacking), ``+``, ``list(...)``,
  ``[m for m in ...]``, another such list;
- a ``ModuleList``/``ModuleDict`` (its ``.values()``) of the block, an entry of one that is itself a container
  (``self.task_experts[t]``), or a slice of a ModuleList (``self.experts[: self.num_active]``),

with indices and slice bounds that are int constants, int attributes of the block (folded: the fingerprint holds the
forward's source), ``len(self.<container>)`` or the counter of an enclosing loop of known range (``for t in
range(self.num_tasks)``, ``for t, gate in enumerate(self.gates)``). Where the list reads such a counter it is
evaluated once per value (its *variants*: each task's experts). After the assignment it may change only by
``<name>.extend(...)``, ``<name>.append(<module>)`` or ``<name> += ...`` statements in the same block of statements;
such a statement may also sit directly in the body of a loop ``for i in range(...)`` of that block of statements that
no iteration leaves early (``_counted_loop``: ``for i in range(self.num_experts): experts.append(getattr(self,
f"expert_{i}"))``, unrolled over the range, in order); every other read of the name iterates or copies it (``for``, ``enumerate``, ``zip``, ``len``, ``list``, ``tuple``,
``name[i]``, ``name + ...``, ``*name``). A name read any other way (``.insert``, ``.pop``, handed to a function,
aliased, changed in a branch or another loop) is left out, with the statement that stops it (``unread``): which
module an id selects would be a guess.

Flow-insensitive on purpose: an ``extend`` after a use of the list counts for that use too. That can only place one
more module, never a module wrongly: the one-pass execution moves every call of a placed module to its owner,
wherever the call is (``autoep.runtime.recipes.replay``).

The same expressions iterated where they are built (``for i, expert in enumerate(self.task_experts[t])``) are lists
too, named by their source and line (``inline_key``). ``lists(block, tree, where)`` returns ``({name: variants},
{name: why it is not read})``; a variant is the tuple of the modules' paths in list order.
"""
from __future__ import annotations

import ast
import itertools

import torch.nn as nn

_MAX_VARIANTS = 64  # products of enclosing loops' ranges beyond this are not evaluated (left out)
_READ_BY = frozenset({"enumerate", "zip", "len", "list", "tuple"})


def lists(block: nn.Module, tree: ast.FunctionDef, where: str) -> tuple[dict, dict]:
    """``({name: variants}, {name: why not})`` for the lists of the block's modules ``tree`` builds (module
    docstring)."""
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    stores: dict[str, list[ast.AST]] = {}
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.comprehension, ast.NamedExpr)) else []
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    stores.setdefault(n.id, []).append(node)
    found: dict[str, tuple[tuple[str, ...], ...]] = {}
    unread: dict[str, str] = {}
    # in source order: a list built of an earlier one (``experts = shared + routed``) reads it
    for name, nodes in sorted(stores.items(), key=lambda item: min(_line(n) for n in item[1])):
        assigns = [n for n in nodes if isinstance(n, ast.Assign)]
        if len(assigns) != 1 or len(assigns[0].targets) != 1 or not isinstance(assigns[0].targets[0], ast.Name):
            continue
        assign = assigns[0]
        body = _body_of(assign, parents)
        changes = [n for n in nodes if n is not assign]
        other = next((n for n in changes if not (isinstance(n, ast.AugAssign) and isinstance(n.op, ast.Add)
                                                 and _after(n, assign, body, parents))), None)
        if other is not None:
            if any(_variants(block, assign.value, [], found, _domains(block, assign, parents)) or [()]):
                unread[name] = (f"{where}: `{ast.unparse(other)[:80]}` (line {_line(other)}) changes {name} away "
                                "from the statements of its assignment")
            continue
        mutations, stop = _mutations(tree, name, assign, body, parents)
        mutations += [(n.lineno, "extend", n.value, None) for n in changes]
        mutations.sort(key=lambda m: m[0])
        variants = _variants(block, assign.value, mutations, found, _domains(block, assign, parents))
        if variants is None or not any(variants):  # no list of modules (``outputs = []`` and its appends)
            added = [stop] if stop is not None and _adds_module(block, stop, name) else []
            added += [] if variants is not None else [
                parents[id(arg)] for _, _, arg, _ in mutations if _names_module(block, arg) and id(arg) in parents]
            if added:  # ``experts.append(getattr(self, f"expert_{i + 1}"))``: a module, which one not known
                stmt = _statement(added[0], parents)
                unread[name] = (f"{where}: `{ast.unparse(stmt)[:80]}` (line {stmt.lineno}) adds a module of the "
                                f"block to {name} in a way autoep does not follow")
            continue
        if stop is not None:
            unread[name] = (f"{where}: `{ast.unparse(stop)[:80]}` (line {stop.lineno}) reads {name} in a way autoep "
                            "does not follow")
            continue
        found[name] = variants
    for node in ast.walk(tree):  # iterated where built: ``enumerate(list(self.task_experts[t]) + list(self.shared))``
        if isinstance(node, (ast.For, ast.comprehension)):
            it = node.iter
            for expr in it.args if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id in (
                    "enumerate", "zip") else [it]:
                if isinstance(expr, (ast.Subscript, ast.BinOp, ast.List, ast.Tuple, ast.ListComp, ast.Call)):
                    variants = _variants(block, expr, [], found, _domains(block, _statement(node, parents), parents))
                    if variants and any(variants):
                        found[inline_key(expr)] = variants
    return found, unread


def inline_key(expr: ast.AST) -> str:
    """The name a list built where a loop iterates it goes by (``lists``): its source and line."""
    return f"`{ast.unparse(expr)[:60]}` (line {expr.lineno})"


def _line(node: ast.AST) -> int:
    return node.lineno if hasattr(node, "lineno") else node.target.lineno  # a comprehension: its target's


def _body_of(stmt: ast.AST, parents: dict) -> list | None:
    """The statement list holding ``stmt``."""
    parent = parents.get(id(stmt))
    for field in ("body", "orelse", "finalbody", "handlers"):
        part = getattr(parent, field, None)
        if isinstance(part, list) and any(s is stmt for s in part):
            return part
    return None


def _statement(node: ast.AST, parents: dict) -> ast.AST:
    while not isinstance(node, ast.stmt) and id(node) in parents:
        node = parents[id(node)]
    return node


def _after(stmt: ast.AST, assign: ast.Assign, body: list | None, parents: dict) -> bool:
    """``stmt`` is a statement of ``body`` (the assignment's) after the assignment."""
    if body is None or not any(s is stmt for s in body):
        return False
    index = {id(s): i for i, s in enumerate(body)}
    return index[id(stmt)] > index[id(assign)]


def _mutations(tree, name: str, assign: ast.Assign, body, parents) -> tuple[list, ast.AST | None]:
    """The ``extend``/``append`` statements of ``name`` (``(line, kind, argument, the counted loop around it or
    None)``) and the first read of it that is
    neither one nor a read that iterates or copies it (None where there is none)."""
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load)):
            continue
        parent = parents.get(id(node))
        call = parents.get(id(parent))
        changes = isinstance(parent, ast.Attribute) and parent.attr in ("extend", "append") and isinstance(
            call, ast.Call) and call.func is parent and len(call.args) == 1 and not call.keywords and isinstance(
            parents.get(id(call)), ast.Expr)
        if changes and _after(parents[id(call)], assign, body, parents):
            out.append((call.lineno, parent.attr, call.args[0], None))
        elif changes and _counted_loop(parents[id(call)], assign, body, parents) is not None:
            out.append((call.lineno, parent.attr, call.args[0], parents[id(parents[id(call)])]))
        elif not _copied_or_iterated(node, parent, parents):
            return out, _statement(node, parents)
    return out, None


def _adds_module(block: nn.Module, stmt: ast.AST, name: str) -> bool:
    """``stmt`` is ``<name>.append(<module>)``/``<name>.extend(<modules>)`` (``_names_module``)."""
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    return isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in (
        "append", "extend") and isinstance(call.func.value, ast.Name) and call.func.value.id == name and len(
        call.args) == 1 and _names_module(block, call.args[0])


def _names_module(block: nn.Module, expr: ast.AST) -> bool:
    """``expr`` is spelled as a module of the block or entries of one: ``self.<child>``, a subscript or slice of it,
    ``getattr(self, f"<prefix>{...}")`` where children ``<prefix><n>`` exist, ``list(...)`` of those."""
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in ("list", "tuple") \
            and len(expr.args) == 1:
        return _names_module(block, expr.args[0])
    while isinstance(expr, ast.Subscript):
        expr = expr.value
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self":
        return isinstance(block._modules.get(expr.attr), nn.Module)
    ref = family_ref(expr)
    return ref is not None and any(k.startswith(ref[0]) and k[len(ref[0]):].isdigit() for k in block._modules)


def _counted_loop(stmt: ast.AST, assign: ast.Assign, body, parents: dict) -> ast.For | None:
    """The loop ``for <i> in range(...)`` whose body holds ``stmt`` (an ``append``/``extend``) directly, itself a
    statement of the assignment's ``body`` after it, with no ``else``, no statement that leaves an iteration early
    (``break``, ``continue``, ``return``, ``raise``) and no other store of ``<i>``: the statement then runs once for
    each value of the range, in order (the range itself is evaluated in ``_variants``); None otherwise."""
    loop = parents.get(id(stmt))
    if not (isinstance(loop, ast.For) and any(s is stmt for s in loop.body) and not loop.orelse
            and isinstance(loop.target, ast.Name) and _after(loop, assign, body, parents)):
        return None
    inner = [n for s in loop.body for n in ast.walk(s)]
    if any(isinstance(n, (ast.Break, ast.Continue, ast.Return, ast.Raise, ast.Yield, ast.YieldFrom, ast.Await,
                          ast.FunctionDef, ast.Lambda)) for n in inner) or any(
            isinstance(n, ast.Name) and n.id == loop.target.id and not isinstance(n.ctx, ast.Load) for n in inner):
        return None
    return loop


def _copied_or_iterated(node: ast.Name, parent: ast.AST, parents: dict) -> bool:
    if isinstance(parent, (ast.For, ast.comprehension)):
        return parent.iter is node
    if isinstance(parent, ast.Call):
        return isinstance(parent.func, ast.Name) and parent.func.id in _READ_BY and any(a is node for a in parent.args)
    if isinstance(parent, ast.Subscript):
        return parent.value is node and isinstance(parent.ctx, ast.Load)
    if isinstance(parent, ast.BinOp):
        return isinstance(parent.op, ast.Add)
    if isinstance(parent, ast.Starred):
        return isinstance(parents.get(id(parent)), (ast.List, ast.Tuple))
    return False


# ---------------------------------------------------------------------------------------------
# Enclosing loops' counters
# ---------------------------------------------------------------------------------------------


def _domains(block: nn.Module, stmt: ast.AST, parents: dict) -> dict[str, range]:
    """The counters of the loops around ``stmt`` whose range is known: ``{name: range}``."""
    out: dict[str, range] = {}
    node = stmt
    while id(node) in parents:
        parent = parents[id(node)]
        if isinstance(parent, ast.For) and any(s is node for s in parent.body):
            target, it = parent.target, parent.iter
            if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate" \
                    and len(it.args) == 1 and isinstance(target, ast.Tuple) and len(target.elts) == 2:
                child = _resolve(block, it.args[0], {})
                if isinstance(target.elts[0], ast.Name) and child is not None and isinstance(
                        child[1], (nn.ModuleList, nn.ModuleDict)):
                    out.setdefault(target.elts[0].id, range(len(child[1])))
            elif isinstance(target, ast.Name) and _range(block, it, {}) is not None:
                out.setdefault(target.id, _range(block, it, {}))
        node = parent
    return out


def _variants(block, value, mutations, found, domains) -> tuple[tuple[str, ...], ...] | None:
    """The list's paths for each value of the enclosing counters it reads (one variant where it reads none); None
    where any of them is not a list of the block's modules."""
    parts = [value, *(loop or arg for _, _, arg, loop in mutations)]
    names = sorted({n.id for part in parts for n in ast.walk(part) if isinstance(n, ast.Name)} & set(domains))
    ranges = [domains[n] for n in names]
    if len(list(itertools.islice(itertools.product(*ranges), _MAX_VARIANTS + 1))) > _MAX_VARIANTS:
        return None
    out = []
    for values in itertools.product(*ranges):
        env = dict(zip(names, values))
        paths = _paths(block, value, found, env)
        for _, kind, arg, loop in mutations:
            if paths is None:
                break
            counter = [None] if loop is None else _range(block, loop.iter, env)
            if counter is None:
                return None
            for k in counter:  # ``for i in range(self.num_experts): experts.append(getattr(self, f"expert_{i}"))``
                at = env if loop is None else {**env, loop.target.id: k}
                more = _paths(block, arg, found, at) if kind == "extend" else _module(block, arg, at)
                paths = None if more is None or paths is None else paths + more
        if paths is None:
            return None
        out.append(tuple(paths))
    return tuple(dict.fromkeys(out)) or None


# ---------------------------------------------------------------------------------------------
# Expressions
# ---------------------------------------------------------------------------------------------


def _paths(block: nn.Module, expr: ast.AST, found: dict, env: dict) -> list[str] | None:
    """The paths of the modules ``expr`` lists, in order, or None where it is not such a list."""
    if isinstance(expr, (ast.List, ast.Tuple)):
        out: list[str] = []
        for elt in expr.elts:
            part = _paths(block, elt.value, found, env) if isinstance(elt, ast.Starred) else _module(block, elt, env)
            if part is None:
                return None
            out += part
        return out
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        left, right = _paths(block, expr.left, found, env), _paths(block, expr.right, found, env)
        return None if left is None or right is None else left + right
    if isinstance(expr, ast.Name):
        variants = found.get(expr.id, ())
        return list(variants[0]) if len(variants) == 1 else None
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in ("list", "tuple") \
            and len(expr.args) == 1 and not expr.keywords:
        return _paths(block, expr.args[0], found, env)
    if isinstance(expr, ast.ListComp) and len(expr.generators) == 1:
        gen = expr.generators[0]
        if gen.ifs or gen.is_async or not isinstance(gen.target, ast.Name):
            return None
        if isinstance(expr.elt, ast.Name) and expr.elt.id == gen.target.id:
            return _paths(block, gen.iter, found, env)
        counter = _range(block, gen.iter, env)  # ``[getattr(self, f"expert_{i}") for i in range(self.num_experts)]``
        if counter is None:
            return None
        out = [_module(block, expr.elt, {**env, gen.target.id: k}) for k in counter]
        return None if None in out else [p for part in out for p in part]
    if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Slice):
        held = _resolve(block, expr.value, env)
        bounds = [None if b is None else _int(block, b, env) for b in (expr.slice.lower, expr.slice.upper,
                                                                           expr.slice.step)]
        if held is None or not isinstance(held[1], nn.ModuleList) or any(
                b is None and part is not None for b, part in zip(bounds, (expr.slice.lower, expr.slice.upper,
                                                                           expr.slice.step))):
            return None
        return [f"{held[0]}.{k}" for k in range(len(held[1]))[slice(*bounds)]]
    values = isinstance(expr, ast.Call) and not expr.args and not expr.keywords and isinstance(
        expr.func, ast.Attribute) and expr.func.attr == "values"
    held = _resolve(block, expr.func.value if values else expr, env)
    if held is None:
        return None
    path, child = held
    if isinstance(child, nn.ModuleDict) and not values:
        return None  # ``list(self.<ModuleDict>)`` lists its keys
    if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
        keys = list(child.keys()) if isinstance(child, nn.ModuleDict) else [str(i) for i in range(len(child))]
        return [f"{path}.{k}" for k in keys]
    return None


def _module(block: nn.Module, expr: ast.AST, env: dict) -> list[str] | None:
    """``self.<child>``, ``self.<container>[<index>]`` (nested too): that module's path."""
    held = _resolve(block, expr, env)
    return None if held is None else [held[0]]


def _resolve(block: nn.Module, expr: ast.AST, env: dict) -> tuple[str, nn.Module] | None:
    """The path and module ``expr`` denotes: ``self.<child>``, or an entry of a ModuleList (an int index) or a
    ModuleDict (a str constant) it denotes; None otherwise."""
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self":
        child = block._modules.get(expr.attr)
        return (expr.attr, child) if isinstance(child, nn.Module) else None
    ref = family_ref(expr)
    if ref is not None:  # ``getattr(self, f"expert_{i}")`` with a known ``i``
        key = _int(block, ref[1], env)
        child = block._modules.get(f"{ref[0]}{key}") if key is not None and key >= 0 else None
        return (f"{ref[0]}{key}", child) if isinstance(child, nn.Module) else None
    if not isinstance(expr, ast.Subscript) or isinstance(expr.slice, ast.Slice):
        return None
    held = _resolve(block, expr.value, env)
    if held is None:
        return None
    path, container = held
    if isinstance(container, nn.ModuleList):
        key = _int(block, expr.slice, env)
        if key is None or not -len(container) <= key < len(container):
            return None
        key %= len(container)
        return f"{path}.{key}", container[key]
    if isinstance(container, nn.ModuleDict) and isinstance(expr.slice, ast.Constant) \
            and isinstance(expr.slice.value, str) and expr.slice.value in container:
        return f"{path}.{expr.slice.value}", container[expr.slice.value]
    return None


def family_ref(expr: ast.AST) -> tuple[str, ast.AST] | None:
    """``getattr(self, f"<prefix>{<index>}")``: ``(prefix, index)``; the index is the formatted value itself
    (``FormattedValue``, no Name) where it has a conversion or a format spec."""
    if not (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "getattr"
            and len(expr.args) == 2 and not expr.keywords and isinstance(expr.args[0], ast.Name)
            and expr.args[0].id == "self" and isinstance(expr.args[1], ast.JoinedStr)):
        return None
    parts = expr.args[1].values
    if len(parts) != 2 or not isinstance(parts[0], ast.Constant) or not isinstance(parts[1], ast.FormattedValue):
        return None
    value = parts[1]
    return parts[0].value, value.value if value.conversion == -1 and value.format_spec is None else value


def _range(block: nn.Module, expr: ast.AST, env: dict) -> range | None:
    """``range(a)``, ``range(a, b)`` with known bounds (``_int``)."""
    if not (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "range"
            and 1 <= len(expr.args) <= 2 and not expr.keywords):
        return None
    bounds = [_int(block, a, env) for a in expr.args]
    return None if None in bounds else range(*bounds)


def _int(block: nn.Module, expr: ast.AST, env: dict) -> int | None:
    """An int constant, an int attribute of the block, ``len(self.<container>)``, a known counter (``env``)."""
    if isinstance(expr, ast.Constant) and type(expr.value) is int:
        return expr.value
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub):
        inner = _int(block, expr.operand, env)
        return None if inner is None else -inner
    if isinstance(expr, ast.Name):
        return env.get(expr.id)
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self":
        value = vars(block).get(expr.attr)
        return value if type(value) is int else None
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "len" \
            and len(expr.args) == 1 and not expr.keywords:
        held = _resolve(block, expr.args[0], env)
        return len(held[1]) if held is not None and isinstance(held[1], (nn.ModuleList, nn.ModuleDict)) else None
    return None
