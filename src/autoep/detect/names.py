"""Resolve the names a function's source reads to the objects they denote at run time.

Proofs never trust a spelling: ``F.silu`` is accepted because it *is* ``torch.nn.functional.silu``
through the function's own globals and closure, not because the attribute is called ``silu``. A
module-level function that happens to be named ``linear`` resolves to itself and matches nothing.

The plain values a proof folds (an instance attribute, a global, a module's or a class's attribute) can
change after the proof: inside ``recording()`` (a recipe's ``validate`` at apply) each read is recorded as a
fact (``AttrFact``, ``GlobalFact``, ``ClassFact``) that the runtime checks again before each call.
"""
from __future__ import annotations

import ast
import builtins
import contextlib
import contextvars
import functools
import inspect
import sys
import types
from dataclasses import dataclass

import torch

from autoep.detect import adapters
from autoep.detect.source import Refusal


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


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
# Facts: the values a proof folds, recorded so that the runtime re-checks them before each call
# ---------------------------------------------------------------------------------------------

_RECORD: contextvars.ContextVar = contextvars.ContextVar("autoep_folded_facts", default=None)
NOT_FACTS = ("training",)  # changes by design (train/eval); proofs that read it say what they do with it
_PLAIN = (bool, int, float, str, type(None), torch.dtype)
# Libraries whose module-level constants (``torch.float32``, ``math.pi``) nobody rebinds: not recorded.
_LIBRARIES = ("torch", "math", "numpy", "builtins", "typing", "functools", "operator")


@dataclass(frozen=True)
class AttrFact:
    """An attribute of a module under the block (``path`` under it, ``""``: the block itself) a proof read."""

    path: str
    name: str
    value: object

    def now(self, root):
        try:
            owner = adapters.submodule(root, self.path)  # what the proof read, under a PEFT wrapper chain too
        except AttributeError:  # a submodule the recipe replaced (ModuleList experts stacked): it went with them
            return self.value
        return getattr(owner, self.name, None)

    def spelled(self) -> str:
        return f"{self.path + '.' if self.path else ''}{self.name}"

    def label(self, root) -> str:
        return f"{type(root).__name__}.{self.spelled()}"


@dataclass(frozen=True)
class GlobalFact:
    """A module-level name a proof read: a global of the code it proved (``if USE_GATE:``, a default's global),
    or an attribute of a module that code reads (``settings.SCALE``). Held by the module's name (plain data:
    a copy or a pickle of the model holds it as it is)."""

    module: str
    name: str
    value: object

    def now(self, root):
        module = sys.modules.get(self.module)
        return vars(module).get(self.name, _MISSING) if module is not None else _MISSING

    def spelled(self) -> str:
        return f"{self.module}.{self.name}"

    def label(self, root) -> str:
        return f"the global {self.spelled()}"


@dataclass(frozen=True)
class ClassFact:
    """A class attribute a proof read off the class itself (a plain settings class: ``Settings.use_gate``)."""

    cls: type
    name: str
    value: object

    def now(self, root):
        return getattr(self.cls, self.name, _MISSING)

    def spelled(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}.{self.name}"

    def label(self, root) -> str:
        return f"the class attribute {self.spelled()}"


Fact = AttrFact | GlobalFact | ClassFact


def holds(fact: Fact, root) -> bool:
    """The value ``fact`` recorded is the value it has now (the same object, or an equal one of the same type)."""
    now = fact.now(root)
    return now is fact.value or (type(now) is type(fact.value) and now == fact.value)


def _watched(value, functions: bool = False) -> bool:
    """A value a proof folds and the runtime can compare: a plain constant (or a tuple of them); with
    ``functions``, also a Python function (compared by identity)."""
    if type(value) is tuple:
        return all(_watched(v) for v in value)
    # a model's own autograd Function class (compared by identity): the recipe runs the one it proved
    function_class = isinstance(value, type) and issubclass(value, torch.autograd.Function)
    return isinstance(value, _PLAIN) or functions and (isinstance(value, types.FunctionType) or function_class)


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


def fold_attr(owner, name: str) -> None:
    """Record ``owner.<name>``, read by ``instance_attr`` for the test of an ``if`` a proof folded, whatever plain
    value it holds (``None`` too, which ``instance_attr`` does not record): the runtime checks it still holds."""
    record = _RECORD.get()
    value = getattr(owner, name, None)
    if record is not None and _watched(value) and name not in NOT_FACTS:
        record.setdefault((id(owner), name), (owner, name, value))


def attribute(base, name: str):
    """``base.<name>`` of a module or class a proof reads (``settings.SCALE``, ``Settings.use_gate``,
    ``torch.float32``); a plain constant of one that is not a library's is recorded (``recording``)."""
    value = getattr(base, name)
    record = _RECORD.get()
    if record is None or not _watched(value):
        return value
    if isinstance(base, types.ModuleType) and base.__name__.split(".")[0] not in _LIBRARIES:
        record.setdefault(("global", base.__name__, name), GlobalFact(base.__name__, name, value))
    elif isinstance(base, type) and (base.__module__ or "").split(".")[0] not in _LIBRARIES:
        record.setdefault((id(base), name), ClassFact(base, name, value))
    return value


def watch_methods(cls: type, methods: tuple[str, ...]) -> None:
    """Record ``cls.<method>`` for each method a proof read the source of (a model's own autograd Function's
    ``forward`` and ``backward``): one patched on the class after apply raises at the next call instead of
    running unproven code."""
    record = _RECORD.get()
    if record is None or (cls.__module__ or "").split(".")[0] in _LIBRARIES:
        return
    for name in methods:
        record.setdefault((id(cls), name), ClassFact(cls, name, getattr(cls, name)))


def _record_global(space: dict, name: str, value, where: str) -> None:
    record = _RECORD.get()
    if record is None or not _watched(value, functions=True):
        return
    module = space.get("__name__")
    if module is None or vars(sys.modules.get(module, types.ModuleType("?"))) is not space:
        raise Refusal(f"{where} reads the global `{name}` from a namespace that is no loaded module's; autoep "
                      "re-checks the globals a proof reads before each call and could not find this one again")
    if module.split(".")[0] not in _LIBRARIES:
        record.setdefault(("global", module, name), GlobalFact(module, name, value))


def _computed(static) -> bool:
    """A class attribute whose value is computed on each read of the instance's attribute."""
    if isinstance(static, (types.FunctionType, staticmethod, classmethod, types.MemberDescriptorType,
                           types.GetSetDescriptorType, types.BuiltinFunctionType, types.MethodDescriptorType,
                           types.WrapperDescriptorType)):
        return False
    return isinstance(static, (property, functools.cached_property)) or hasattr(type(static), "__get__")


@contextlib.contextmanager
def recording():
    """Collect what the proofs run inside read and fold: instance attributes (``instance_attr``), globals
    (``Scope.lookup``) and plain constants of modules and classes (``attribute``)."""
    facts: dict = {}
    token = _RECORD.set(facts)
    try:
        yield facts
    finally:
        _RECORD.reset(token)


def facts_under(root, reads: dict) -> tuple[Fact, ...]:
    """The facts of ``recording``'s reads as ``root`` checks them: instance attributes by their path under
    ``root`` (those of modules outside it are left out), globals and class attributes as they are."""
    paths = {id(m): p for p, m in root.named_modules()}
    out = []
    for read in reads.values():
        if isinstance(read, tuple):
            owner, name, value = read
            if id(owner) in paths:
                out.append(AttrFact(paths[id(owner)], name, value))
        else:
            out.append(read)
    return tuple(out)


class Scope:
    """How a function's free names resolve: its closure, then its globals, then builtins."""

    def __init__(self, fn):
        fn = inspect.unwrap(fn)
        self.fn = fn
        self.closure = closure_vars(fn)
        self.globals = getattr(fn, "__globals__", {})

    def lookup(self, name: str):
        if name in self.closure:
            return self.closure[name]
        if name in self.globals:
            value = self.globals[name]
            _record_global(self.globals, name, value, self.fn.__qualname__)
            return value
        if name in vars(builtins):
            return vars(builtins)[name]
        raise Refusal(f"{self.fn.__qualname__} reads `{name}`, which is not defined")

    def resolve(self, node: ast.AST):
        """The object a dotted global path (``torch.nn.functional.linear``, ``F.silu``) denotes."""
        if isinstance(node, ast.Name):
            return self.lookup(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            if not hasattr(base, node.attr):
                raise Refusal(f"`{ast.unparse(node)}` does not exist")
            return attribute(base, node.attr)
        raise Refusal(f"`{ast.unparse(node)[:60]}` is not a dotted name")


def is_global_path(node: ast.AST) -> bool:
    """``a`` or ``a.b.c`` (a name with attribute accesses), the shape of a module-level reference."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)
