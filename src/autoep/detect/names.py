"""Resolve the names a function's source reads to the objects they denote at run time.

Proofs never trust a spelling: ``F.silu`` is accepted because it *is* ``torch.nn.functional.silu``
through the function's own globals and closure, not because the attribute is called ``silu``. A
module-level function that happens to be named ``linear`` resolves to itself and matches nothing.
"""
from __future__ import annotations

import ast
import builtins
import contextlib
import contextvars
import functools
import inspect
import types

from autoep.detect.source import Refusal

_MISSING = object()


def closure_vars(fn) -> dict[str, object]:
    """``{free variable: value}`` of ``fn``'s closure (empty cells are left out)."""
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return {}
    out = {}
    for name, cell in zip(code.co_freevars, fn.__closure__):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell (e.g. ``__class__`` before the class exists)
            continue
    return out


def mangled(fn, name: str) -> str:
    """``name`` as ``fn``'s code reads it: a private ``__x`` written in a class body is ``_Class__x``."""
    if not name.startswith("__") or name.endswith("__"):
        return name
    code = getattr(inspect.unwrap(fn), "__code__", None)
    parts = code.co_qualname.split(".") if code is not None else []
    cls = parts[-2].lstrip("_") if len(parts) >= 2 and parts[-2] != "<locals>" else ""
    return f"_{cls}{name}" if cls else name


# ---------------------------------------------------------------------------------------------
# Attributes a proof folds as facts
# ---------------------------------------------------------------------------------------------

_RECORD: contextvars.ContextVar = contextvars.ContextVar("autoep_folded_facts", default=None)
NOT_FACTS = ("training",)  # changes by design (train/eval); proofs that read it say what they do with it


def instance_attr(owner, name: str, where: str):
    """``owner.<name>`` as a proof reads it. Refused where it is computed on each read (a property, a
    descriptor): a value folded at detection could differ at a later call (e.g. in eval). A plain number
    is recorded (``recording``), so the runtime can check it is still that value."""
    static = inspect.getattr_static(type(owner), name, _MISSING)
    cached = isinstance(static, functools.cached_property) and name in vars(owner)
    if static is not _MISSING and _computed(static) and not cached:
        raise Refusal(f"{where}: self.{name} is a {type(static).__name__} of {type(owner).__name__}, computed on "
                      f"each read; autoep folds the values a block reads at detection, and this one may differ "
                      f"later (e.g. in eval). Store it as a plain attribute")
    value = getattr(owner, name, None)
    record = _RECORD.get()
    if record is not None and type(value) in (bool, int, float) and name not in NOT_FACTS:
        record.setdefault((id(owner), name), (owner, name, value))
    return value


def _computed(static) -> bool:
    """A class attribute whose value is computed on each read of the instance's attribute."""
    if isinstance(static, (types.FunctionType, staticmethod, classmethod, types.MemberDescriptorType,
                           types.GetSetDescriptorType, types.BuiltinFunctionType, types.MethodDescriptorType,
                           types.WrapperDescriptorType)):
        return False
    return isinstance(static, (property, functools.cached_property)) or hasattr(type(static), "__get__")


@contextlib.contextmanager
def recording():
    """Collect ``{(id(module), name): (module, name, value)}`` of the plain numbers proofs fold inside."""
    facts: dict = {}
    token = _RECORD.set(facts)
    try:
        yield facts
    finally:
        _RECORD.reset(token)


class Scope:
    """How a function's free names resolve: its closure, then its globals, then builtins."""

    def __init__(self, fn):
        fn = inspect.unwrap(fn)
        self.fn = fn
        self.closure = closure_vars(fn)
        self.globals = getattr(fn, "__globals__", {})

    def lookup(self, name: str):
        for space in (self.closure, self.globals, vars(builtins)):
            if name in space:
                return space[name]
        raise Refusal(f"{self.fn.__qualname__} reads `{name}`, which is not defined")

    def resolve(self, node: ast.AST):
        """The object a dotted global path (``torch.nn.functional.linear``, ``F.silu``) denotes."""
        if isinstance(node, ast.Name):
            return self.lookup(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            value = getattr(base, node.attr, _MISSING)
            if value is _MISSING:
                raise Refusal(f"`{ast.unparse(node)}` does not exist")
            return value
        raise Refusal(f"`{ast.unparse(node)[:60]}` is not a dotted name")


def is_global_path(node: ast.AST) -> bool:
    """``a`` or ``a.b.c`` (a name with attribute accesses), the shape of a module-level reference."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)
