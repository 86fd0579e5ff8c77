"""Every read of the experts from a block's code outside the proven region, found by following calls.

autoep replaces the experts (stacked, sharded into DTensors, spliced out of the forward). Code of the block
that reads them elsewhere (an L2 penalty over ``self.parameters()``, a helper of a helper indexing
``self.experts``, a module-level function given ``self``, ``getattr(self, "experts")``, a hook on the block
renorming every expert weight) would see the replaced objects: DTensors mixed with tensors, a stacked
module that is not iterable, or weights that no longer get gradients. The proofs of the region check the
forward (and, for ModuleList experts, the methods it calls) statement by statement; this module follows
everything else those functions can reach, any depth: methods and properties of the block's class,
module-level functions, closures and nested functions, by the names their bytecode uses (a superset of
what they call, so nothing is missed; torch's own functions are not entered). It also scans the run-time
state: a plain attribute of any module of the block that holds the experts, one of their tensors, or the
block itself (a router caching a list of experts, a back-reference to the block).

Reads, not reachability: a whole-module read (``.parameters()``, ``.modules``, ``vars``) refuses only in a
function the experts can reach, one that *carries* them: the block's forward and hooks (given the block), its
methods, a helper the block hands something that may hold the experts (``helper(self.experts)``,
``helper(self)``, an expert's weight, a value computed from one by a method), a function passed around as a
value, a closure of a carrying function, and any function whose globals or closure hold a module. A helper
given only the routing's tensors (``einops.reduce(router_logits, ...)``, whose backend lookup reads
``sys.modules``) cannot reach the experts through what it is given: its whole-module reads are of something
else. Which values may hold the experts is a flow-insensitive taint over the caller's AST (``_carried``):
names bound from the block (or a carrying argument), attribute and index chains on them, the results of
methods called on them; the output of a submodule's call (``self.gate(x)``) or of a function of untainted
values is the module's or the function's result, not the experts. A carrying function that stores such a
value where another function may find it (an attribute or item of something not local, a ``global``) makes
every function it reaches carrying, as before. Reading the experts' attribute by name (``.experts``) refuses
in any function.

``experts_read_elsewhere(block, allowed, experts_path)`` raises ``Refusal`` naming the function, the line
and what it reads.
"""
from __future__ import annotations

import ast
import dis
import functools
import inspect
import types
from collections.abc import Iterable
from dataclasses import dataclass

import torch.nn as nn

from autoep.detect import plain_experts
from autoep.detect.source import Refusal, function_tree

# Names whose use reads every submodule or tensor of a module (the experts with them).
WHOLE_MODULE_READS = frozenset({
    "parameters", "named_parameters", "buffers", "named_buffers", "modules", "named_modules", "children",
    "named_children", "state_dict", "load_state_dict", "get_submodule", "get_parameter", "get_buffer",
    "_modules", "_parameters", "_buffers", "__dict__", "vars",
})
_MAX_FUNCTIONS = 200  # functions followed from one block before the proof gives up (refuses)
# nn.Module internals in vars(module) that hold the module tree itself (read by torch, not the model).
_INTERNAL = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


def experts_read_elsewhere(block: nn.Module, allowed: Iterable = (), experts_path: str = "experts") -> None:
    """Refuse a read of the experts (or of every submodule) reachable from the block's forward, its hooks
    and the methods they call, outside ``allowed`` (the functions whose ``self.<experts>`` reads the
    region's proof already checked), and a plain attribute of the block's modules holding the experts."""
    cls, experts_attr = type(block), experts_path.split(".")[0]
    why = _class_reads(cls, frozenset({_code(f) for f in allowed} - {None}), experts_attr)
    if why:
        raise Refusal(why)
    hook_reads(block, experts_path)
    cached_experts(block, experts_path)


@functools.lru_cache(maxsize=None)
def _class_reads(cls: type, allowed: frozenset, attr: str) -> str:
    """The refusal for a read reachable from ``cls.forward`` ("" for none): a fact of the class and its code,
    cached by them (a patched class or a swapped method is a new key or a new code object to follow)."""
    try:
        _follow(cls, getattr(cls, "forward", None), f"{cls.__name__}.forward", set(allowed), attr, {}, depth=0,
                carries=_ENTRY)
    except Refusal as exc:
        return str(exc)
    return ""


def block_hooks(block: nn.Module) -> list[tuple[str, object]]:
    """The block's own forward and backward hooks and pre-hooks (``(kind, hook)``): they run as the model's code,
    with the block (and so its experts) as their first argument."""
    kinds = (("forward pre", "_forward_pre_hooks"), ("forward", "_forward_hooks"), ("backward", "_backward_hooks"),
             ("backward pre", "_backward_pre_hooks"))
    return [(kind, h) for kind, attr in kinds for h in (getattr(block, attr, None) or {}).values()]


def hook_reads(block: nn.Module, experts_path: str = "experts") -> None:
    """Only the block's hooks followed (at apply time: hooks registered after detection)."""
    cls, followed, experts_attr = type(block), {}, experts_path.split(".")[0]
    for kind, h in block_hooks(block):
        # every argument: a partial's own arguments come first, the block after them
        _follow(cls, h, f"the {kind} hook {_name(h)}", set(), experts_attr, followed, depth=0, carries=_ALL)


def _name(fn) -> str:
    inner = _function(fn)
    return getattr(inner if inner is not None else fn, "__qualname__", type(fn).__name__)


def _code(fn):
    fn = _function(fn)
    return None if fn is None else fn.__code__


# How a followed function may hold the experts (``carries``): None, it cannot (given nothing that may hold them);
# _ENTRY, through its first argument (the block's forward: the block; its other arguments are the block's caller's);
# _ALL, through any of its arguments (the block's hooks, its methods, a helper handed something that may hold them).
_ENTRY, _ALL = "entry", "all"


def _follow(cls: type, fn, where: str, allowed: set, attr: str, followed: dict, depth: int,
            carries: str | None = _ALL) -> None:
    """Check ``fn`` (reached by the call chain ``where``, given the experts as ``carries`` says) and everything it
    may call."""
    fn = _function(fn)
    if fn is None:
        return
    carries = carries or (_ALL if _holds_modules(fn) else None)
    if fn.__code__ in followed and (followed[fn.__code__] is not None or carries is None):
        return  # followed already, carrying at least as much
    if len(followed) >= _MAX_FUNCTIONS:
        raise Refusal(f"{where}: the block's code calls more than {_MAX_FUNCTIONS} functions; autoep cannot follow "
                      f"them all to check none reads the experts")
    followed[fn.__code__] = carries
    if (fn.__module__ or "").split(".")[0] == "torch":
        return  # torch's own code: what it reads is named at the model's call site (checked there)
    proven = fn.__code__ in allowed
    if proven:  # the region's proof read this function's AST: whole-module reads are checked on ``self`` only
        _whole_reads_on_self(fn, where)
    for _, name, line in _names(fn.__code__):
        if name in WHOLE_MODULE_READS and not proven and carries is not None:
            raise Refusal(f"{where} line {line} reads `{name}`, which reaches every submodule and tensor, the "
                          f"experts autoep replaces among them")
        if name == attr and not proven:  # a proven function's reads of the experts were checked on its AST
            raise Refusal(f"{where} line {line} reads `{attr}` outside the expert region autoep proves and replaces")
        for target, member in _targets(cls, fn, name):
            given = _ALL if member else _handed(cls, fn, carries, name)
            _follow(cls, target, f"{where} -> {_name(target)}", allowed, attr, followed, depth + 1, given)
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        _follow(cls, value, f"{where} -> {_name(value)}", allowed, attr, followed, depth + 1,
                _ALL if carries is not None else None)


def _handed(cls: type, fn, carries: str | None, name: str) -> str | None:
    """How the module-level function ``name`` that ``fn`` reaches may hold the experts: through its arguments
    (``_ALL``) where ``fn`` carries them and may hand them over (module docstring), else None."""
    if carries is None:
        return None
    taint = _carried(fn, cls, carries)
    return _ALL if taint is None or taint.escapes or name in taint.handed else None


def _holds_modules(fn) -> bool:
    """A global ``fn`` reads, or a cell of its closure, holds a module (directly or in a list, tuple or dict):
    what it reaches through it is not what it was given."""
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:
            continue
    values = [fn.__globals__.get(n) for n in _global_names(fn.__code__)] + cells
    for value in values:
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        if any(isinstance(v, nn.Module) for v in items):
            return True
    return False


@functools.lru_cache(maxsize=None)
def _global_names(code: types.CodeType) -> frozenset:
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return frozenset(names)


# Methods that put their argument into the object they are called on (``cache.append(self.experts)``).
_STORES = frozenset({"append", "extend", "insert", "add", "update", "setdefault", "__setitem__"})


@dataclass(frozen=True)
class _Taint:
    """What a carrying function may hand over: ``handed``, the names of the functions it calls with (or passes
    around) a value that may hold the experts; ``escapes``, it stores such a value where another function may
    find it."""

    handed: frozenset
    escapes: bool


@functools.lru_cache(maxsize=None)
def _carried(fn, cls: type, carries: str) -> _Taint | None:
    """``_Taint`` of ``fn`` given the experts as ``carries`` says; None where its source cannot be read (every
    function it reaches then carries)."""
    try:
        tree = function_tree(fn)
    except Refusal:
        return None
    space = fn.__globals__
    params = [a.arg for a in tree.args.posonlyargs + tree.args.args + tree.args.kwonlyargs]
    params += [a.arg for a in (tree.args.vararg, tree.args.kwarg) if a is not None]
    method = _function(inspect.getattr_static(cls, fn.__name__, None)) is fn
    me = params[0] if params and (carries == _ENTRY or method) else None  # ``self``, where it is the block
    tainted = set(params[:1] if carries == _ENTRY else params)
    declared = {n for node in ast.walk(tree) if isinstance(node, (ast.Global, ast.Nonlocal)) for n in node.names}
    local = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} - declared
    for node in ast.walk(tree):  # a nested function's or lambda's arguments: whatever its caller gives it
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and node is not tree:
            tainted |= {a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
            local |= {a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
    local |= set(params)
    escapes, changed = False, True
    while changed:  # flow-insensitive: a name bound anywhere from a carrying value carries everywhere
        changed = False
        for targets, value in _bindings(tree):
            if not _carries(value, tainted, me, cls, space):
                continue
            for target in targets:
                for name, stored_into in _bound_names(target):
                    if stored_into and (name not in local) and _refers(value, tainted):
                        escapes = True
                    if name is not None and name not in tainted and (name in local or not stored_into):
                        tainted.add(name)
                        changed = True
    handed, called = set(), {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            given = any(_carries(a, tainted, me, cls, space) for a in [*node.args, *(k.value for k in node.keywords)])
            receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
            if given and receiver is not None and node.func.attr in _STORES and _root(receiver) not in local:
                escapes = True
            if given and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                escapes = True
            if given or receiver is not None and _carries(receiver, tainted, me, cls, space):
                handed.add(node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and id(node) not in called:
            handed.add(node.id)  # a function passed around as a value: whoever calls it may give it anything
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            handed.add(node.value)  # ``getattr(module, "helper")``
    return _Taint(frozenset(handed), escapes)


def _bindings(tree: ast.AST):
    """``(targets, value)`` of every binding in ``tree``: assignments, loops and comprehensions (their iterable),
    ``with ... as``, the walrus."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            yield node.targets, node.value
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            yield [node.target], node.value
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            yield [node.target], node.iter
        elif isinstance(node, ast.NamedExpr):
            yield [node.target], node.value
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            yield [node.optional_vars], node.context_expr


def _bound_names(target: ast.AST):
    """``(name, stored_into)``: each name a target binds (``x``, ``a, b``), or the root name of an attribute or
    item it stores into (``y[m]``, ``self.cache``: stored_into), ``None`` for a root that is no name."""
    if isinstance(target, ast.Name):
        yield target.id, False
    elif isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            yield from _bound_names(t)
    elif isinstance(target, ast.Starred):
        yield from _bound_names(target.value)
    elif isinstance(target, (ast.Attribute, ast.Subscript)):
        yield _root(target), True


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_member(cls: type, name: str) -> bool:
    member = inspect.getattr_static(cls, name, None)
    return isinstance(member, (types.FunctionType, property, staticmethod, classmethod, functools.partial))


def _carries(node: ast.AST | None, tainted: set, me: str | None, cls: type, space: dict) -> bool:
    """The value of ``node`` may hold the experts (or a module or tensor of the block): a tainted name, a chain of
    attributes or items on one, a method's result called on one, a call given one. Not: a constant, the result of
    a function of untainted values, of torch's own functions (tensors: ``torch.topk(scores, self.config.top_k)``),
    the output of a submodule called on untainted values (``self.gate(x)``: ``self.<name>`` that is no method of
    the class). ``space``: the function's globals, where a call's name is looked up."""
    if node is None or isinstance(node, ast.Constant):
        return False
    if isinstance(node, ast.Name):
        return node.id in tainted
    if isinstance(node, ast.Call):
        if _root(node.func) not in tainted and _torch_function(node.func, space):
            return False  # tensors (a view of a weight at most): no module to read through
        if any(_carries(a, tainted, me, cls, space) for a in [*node.args, *(k.value for k in node.keywords)]):
            return True
        func = node.func
        if isinstance(func, ast.Attribute):
            if isinstance(func.value, ast.Name) and func.value.id == me and not _is_member(cls, func.attr):
                return False  # ``self.gate(x)``: the submodule's output
            return _carries(func.value, tainted, me, cls, space)
        return _carries(func, tainted, me, cls, space)
    if isinstance(node, (ast.Lambda, ast.FunctionDef)):
        return True  # a function made here may close over anything
    return any(_carries(child, tainted, me, cls, space) for child in ast.iter_child_nodes(node)
               if isinstance(child, ast.expr))


def _torch_function(func: ast.AST, space: dict) -> bool:
    """``func`` names one of torch's own functions through the globals ``space`` (``torch.topk``, ``F.softmax``):
    not a class (``nn.ModuleList(...)`` would hold what it is given), not a name a local could shadow."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name) or not parts or func.id not in space:
        return False
    obj = space[func.id]
    for part in reversed(parts):
        obj = getattr(obj, part, None)
    module = getattr(obj, "__module__", None) or ""
    return callable(obj) and not isinstance(obj, type) and module.split(".")[0] == "torch"


def _refers(node: ast.AST, tainted: set) -> bool:
    """``node`` may be the experts (or the block, a tensor of theirs) themselves, not a result computed from them: a
    tainted name, attribute and item chains on one, or a container literal of such."""
    if isinstance(node, ast.Name):
        return node.id in tainted
    if isinstance(node, (ast.Attribute, ast.Subscript)):
        return _refers(node.value, tainted)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_refers(e, tainted) for e in node.elts)
    if isinstance(node, ast.Dict):
        return any(_refers(v, tainted) for v in node.values if v is not None)
    return isinstance(node, ast.Call) and any(_refers(a, tainted) for a in node.args)


def _whole_reads_on_self(fn, where: str) -> None:
    """``self.parameters()``, ``self.state_dict()``, ... in a function whose AST the region's proof read (an
    expert's own ``expert.parameters()`` inside the proven loop is the region's, not a read of every expert)."""
    found = _self_whole_reads(fn)
    if found:
        raise Refusal(f"{where} line {found[0]} reads `{found[1]}`, which reaches every submodule and tensor, the "
                      f"experts autoep replaces among them")


@functools.lru_cache(maxsize=None)
def _self_whole_reads(fn) -> tuple:
    """``(line, what)`` of the first whole-module read on the function's first argument, ``()`` for none."""
    tree = function_tree(fn)
    me = tree.args.args[0].arg if tree.args.args else "self"
    for node in ast.walk(tree):
        line = fn.__code__.co_firstlineno + getattr(node, "lineno", 1) - 1
        if isinstance(node, ast.Attribute) and node.attr in WHOLE_MODULE_READS and isinstance(node.value, ast.Name) \
                and node.value.id == me:
            return line, f"{me}.{node.attr}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars":
            return line, "vars(...)"
    return ()


def _function(fn):
    """The plain Python function behind ``fn`` (a partial, a bound method, a wrapper), else ``None``."""
    for _ in range(8):
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif isinstance(fn, (types.MethodType, staticmethod, classmethod)):
            fn = fn.__func__
        elif isinstance(fn, property):
            fn = fn.fget
        elif hasattr(fn, "__wrapped__") and not isinstance(fn, type):
            fn = fn.__wrapped__
        else:
            break
    return fn if isinstance(fn, types.FunctionType) else None


@functools.lru_cache(maxsize=None)
def _names(code: types.CodeType) -> tuple:
    """``(code, name, line)`` for every global or attribute name the code (and its nested functions) uses,
    and every string constant equal to an attribute name (``getattr(self, "experts")``)."""
    out, line = [], code.co_firstlineno
    for ins in dis.get_instructions(code):
        line = ins.positions.lineno if ins.positions and ins.positions.lineno else line
        if ins.opname in ("LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD", "LOAD_NAME", "STORE_ATTR", "LOAD_SUPER_ATTR",
                          "DELETE_ATTR"):
            out.append((code, ins.argval, line))
        elif ins.opname == "LOAD_CONST" and isinstance(ins.argval, str) and ins.argval.isidentifier():
            out.append((code, ins.argval, line))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out += _names(const)
    return tuple(out)


def _targets(cls: type, fn, name: str) -> list:
    """What ``name`` may denote in ``fn``: ``(the class's method or property of that name, True)``, ``(a
    module-level function of ``fn``'s globals, False)``."""
    out = []
    if _is_member(cls, name):
        out.append((inspect.getattr_static(cls, name), True))
    glob = fn.__globals__.get(name)
    if isinstance(glob, (types.FunctionType, functools.partial)):
        out.append((glob, False))
    return out


# ---------------------------------------------------------------------------------------------
# Run-time state: plain attributes holding the experts
# ---------------------------------------------------------------------------------------------


def cached_experts(block: nn.Module, experts_path: str = "experts") -> None:
    """Refuse a plain (unregistered) attribute of any module of ``block`` that holds the experts container
    (at ``experts_path``), one expert, one of their tensors, or the block itself (directly or in a list, tuple,
    set or dict)."""
    found = plain_experts.resolve(block, experts_path)
    if found is None:
        return
    experts, prefix = found
    # A plain dict/list attribute of the block that maps expert ids to its registered experts is their container
    # (``plain_experts``, checked per call by replay); any other reference is a cache.
    container_attr = experts_path if not prefix else None
    protected = {id(block): "the block itself"}
    for n, m in experts.named_modules(remove_duplicate=False):
        protected[id(m)] = f"{prefix}.{n}".strip(".")
    for n, t in [*experts.named_parameters(remove_duplicate=False), *experts.named_buffers(remove_duplicate=False)]:
        protected[id(t)] = f"{prefix}.{n}".strip(".")
    for path, module in block.named_modules(remove_duplicate=False):
        for key, value in vars(module).items():
            if key in _INTERNAL or (module is block and key == container_attr):
                continue
            held = _held(value, protected)
            if held is not None:
                owner = f"{type(block).__name__}.{path}.{key}" if path else f"{type(block).__name__}.{key}"
                raise Refusal(f"{owner} holds {held} outside the module tree (a cached reference autoep cannot "
                              f"update when it replaces the experts)")


def _held(value, protected: dict) -> str | None:
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple, set,
                                                                                         frozenset)) else (value,)
    for item in items:
        if id(item) in protected and (isinstance(item, nn.Module) or hasattr(item, "grad")):
            return protected[id(item)]
    return None
