"""Resolve the names a function's source reads to the objects they denote at run time.

Proofs never trust a spelling: ``F.silu`` is accepted because it *is* ``torch.nn.functional.silu``
through the function's own globals and closure, not because the attribute is called ``silu``. A
module-level function that happens to be named ``linear`` resolves to itself and matches nothing.
"""
from __future__ import annotations

import ast
import builtins
import inspect

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
