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
        _follow(cls, getattr(cls, "forward", None), f"{cls.__name__}.forward", set(allowed), attr, set(), depth=0)
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
    cls, followed, experts_attr = type(block), set(), experts_path.split(".")[0]
    for kind, h in block_hooks(block):
        _follow(cls, h, f"the {kind} hook {_name(h)}", set(), experts_attr, followed, depth=0)


def _name(fn) -> str:
    inner = _function(fn)
    return getattr(inner if inner is not None else fn, "__qualname__", type(fn).__name__)


def _code(fn):
    fn = _function(fn)
    return None if fn is None else fn.__code__


def _follow(cls: type, fn, where: str, allowed: set, attr: str, followed: set, depth: int) -> None:
    """Check ``fn`` (reached by the call chain ``where``) and everything it may call."""
    fn = _function(fn)
    if fn is None or fn.__code__ in followed:
        return
    if len(followed) >= _MAX_FUNCTIONS:
        raise Refusal(f"{where}: the block's code calls more than {_MAX_FUNCTIONS} functions; autoep cannot follow "
                      f"them all to check none reads the experts")
    followed.add(fn.__code__)
    if (fn.__module__ or "").split(".")[0] == "torch":
        return  # torch's own code: what it reads is named at the model's call site (checked there)
    proven = fn.__code__ in allowed
    if proven:  # the region's proof read this function's AST: whole-module reads are checked on ``self`` only
        _whole_reads_on_self(fn, where)
    for _, name, line in _names(fn.__code__):
        if name in WHOLE_MODULE_READS and not proven:
            raise Refusal(f"{where} line {line} reads `{name}`, which reaches every submodule and tensor, the "
                          f"experts autoep replaces among them")
        if name == attr and not proven:  # a proven function's reads of the experts were checked on its AST
            raise Refusal(f"{where} line {line} reads `{attr}` outside the expert region autoep proves and replaces")
        for target in _targets(cls, fn, name):
            _follow(cls, target, f"{where} -> {_name(target)}", allowed, attr, followed, depth + 1)
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        _follow(cls, value, f"{where} -> {_name(value)}", allowed, attr, followed, depth + 1)


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
    """What ``name`` may denote in ``fn``: the class's method or property of that name, a module-level
    function of ``fn``'s globals."""
    out = []
    member = inspect.getattr_static(cls, name, None)
    if isinstance(member, (types.FunctionType, property, staticmethod, classmethod, functools.partial)):
        out.append(member)
    glob = fn.__globals__.get(name)
    if isinstance(glob, (types.FunctionType, functools.partial)):
        out.append(glob)
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
