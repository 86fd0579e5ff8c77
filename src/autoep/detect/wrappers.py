"""Wrappers transformers puts around a block's ``forward``, known by the code they run, peeled off.

A block's ``forward`` as its class holds it may not be the function its source defines: transformers 5.x
wraps every ``GradientCheckpointingLayer`` subclass's forward in ``forward_with_checkpointing``
(``transformers/modeling_layers.py``, ``__init_subclass__``), and ``@deprecate_kwarg`` renames an old
keyword before the call (``transformers/utils/deprecation.py``). Both were read and understood:

- ``kwarg_rename``: calls the wrapped function once, with a deprecated keyword renamed (or raises
  ``ValueError``/warns about it, before the call); touches nothing else.
- ``checkpointing``: calls the wrapped function once, as is, unless ``self.gradient_checkpointing and
  self.training and torch.is_grad_enabled()`` on the outermost wrapper; then drops caches from the keyword
  arguments and runs ``self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)``, which
  runs the forward again in backward. Whether EP is exact then depends on that function, which is run-time
  state: ``autoep.runtime.checkpointing`` checks it at every call.

A wrapper is recognised by the code object it runs, which must be the one defined at its known place in its
own module (a wrapper defined elsewhere that copies the names with ``functools.wraps`` is not), whose source
must be the text read here (its AST digest: a transformers version that changes the wrapper is refused until
it is read again), with the function it calls held in its closure, and that function must be its
``__wrapped__`` (the forward the proofs read). Anything else is refused, naming the wrapper.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import sys
import types
from dataclasses import dataclass

from autoep.detect.names import Scope, closure_vars
from autoep.detect.source import Refusal, code_tree


@dataclass(frozen=True)
class KnownWrapper:
    """A wrapper function whose behaviour autoep knows (module docstring)."""

    kind: str  # checkpointing | kwarg_rename
    module: str  # the module whose source defines its code
    where: tuple[str, ...]  # attribute path to the function defining it in that module, then nested code names
    digest: str  # sha256 (16 hex) of ``ast.dump`` of its source, as read
    calls: str  # the closure variable holding the function it calls
    factory: str = ""  # the decorator factory of ``module`` that applies it ("": applied by a base class)
    # Globals its code reads that decide what it runs: (global name, what it must be: "module" or "module.attr").
    reads: tuple[tuple[str, str], ...] = ()


KNOWN = (
    KnownWrapper("checkpointing", "transformers.modeling_layers",
                 ("GradientCheckpointingLayer", "__init_subclass__", "forward_with_checkpointing"),
                 "8cb2d9b2cebe9b30", "forward",
                 reads=(("partial", "functools.partial"), ("torch", "torch"))),
    KnownWrapper("kwarg_rename", "transformers.utils.deprecation", ("deprecate_kwarg", "wrapper", "wrapped_func"),
                 "22e496069ee0a7a5", "func", factory="deprecate_kwarg"),
)


@dataclass(frozen=True)
class Peeled:
    """A class's forward with the known wrappers taken off: the function the proofs read, the wrappers'
    kinds outermost first, and which of them its source applies as decorators (their factories)."""

    forward: types.FunctionType
    kinds: tuple[str, ...]
    factories: tuple[str, ...]


def peel_forward(cls: type) -> Peeled:
    """``cls.forward`` through the wrappers in ``KNOWN`` (any number, outermost first); another wrapper is a
    ``Refusal`` naming it."""
    fn, kinds, factories = cls.forward, [], []
    what = f"{cls.__name__}.forward"
    while hasattr(fn, "__wrapped__"):
        known = _known(fn, what)
        kinds.append(known.kind)
        if known.factory:
            factories.append(known.factory)
        fn = fn.__wrapped__
    if not isinstance(fn, types.FunctionType):
        raise Refusal(f"{what} is not a plain function")
    return Peeled(fn, tuple(kinds), tuple(factories))


def _known(fn, what: str) -> KnownWrapper:
    code = getattr(fn, "__code__", None)
    defined = (getattr(fn, "__globals__", {}).get("__name__", "?"), getattr(code, "co_qualname", "?"))
    for known in KNOWN:
        if code is not None and code is _known_code(known):
            break
    else:
        raise Refusal(f"{what} is wrapped by {'.'.join(defined)}, which autoep does not know")
    home = sys.modules[known.module]
    if fn.__globals__ is not vars(home):
        raise Refusal(f"{what} is wrapped by code of {known.module} running in other globals")
    if _digest(code) != known.digest:
        raise Refusal(f"{what} is wrapped by {'.'.join(defined)}, whose code is not the one autoep read (this "
                      f"transformers version changed it); autoep does not know what it does")
    if closure_vars(fn).get(known.calls, None) is not fn.__wrapped__:
        raise Refusal(f"{what}: the wrapper {defined[1]} calls another function than its __wrapped__ (the forward "
                      "the proofs read)")
    for name, path in known.reads:
        module, _, attr = path.partition(".")
        genuine = sys.modules.get(module)
        genuine = getattr(genuine, attr, None) if attr else genuine
        if genuine is None or fn.__globals__.get(name) is not genuine:
            raise Refusal(f"{what}: the wrapper {defined[1]} reads `{name}`, which is not {path}")
    return known


@functools.lru_cache(maxsize=None)
def _digest(code: types.CodeType) -> str:
    return hashlib.sha256(ast.dump(code_tree(code)).encode()).hexdigest()[:16]


def _known_code(known: KnownWrapper) -> types.CodeType | None:
    """The code object defined at ``known``'s place in its module now (``None`` before it is imported)."""
    home = sys.modules.get(known.module)
    if home is None:
        return None
    attr, *nested = known.where
    obj = inspect.getattr_static(home, attr, None)
    while nested and isinstance(obj, type):
        obj = inspect.getattr_static(obj, nested.pop(0), None)
    obj = getattr(obj, "__func__", obj)  # a classmethod (``__init_subclass__``)
    code = getattr(inspect.unwrap(obj) if callable(obj) else obj, "__code__", None)
    for name in nested:
        code = next((c for c in getattr(code, "co_consts", ()) if isinstance(c, types.CodeType) and c.co_name == name),
                    None)
    return code


def check_decorators(peeled: Peeled, what: str) -> None:
    """The decorators written in the forward's source are exactly the known factories whose wrappers were
    peeled, in order: a decorator that returned something else (or added an effect) is refused."""
    tree = code_tree(peeled.forward.__code__)
    scope = Scope(peeled.forward)
    written = []
    for dec in tree.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        try:
            obj = scope.resolve(target)
        except Refusal:
            obj = None
        written.append(next((k.factory for k in KNOWN if k.factory and obj is not None
                             and obj is getattr(sys.modules.get(k.module), k.factory, None)), None))
    if None in written or tuple(written) != peeled.factories:
        raise Refusal(f"{what} is decorated; autoep does not know what the decorator does")


def checkpointing_wrapped(cls: type) -> bool:
    """Whether ``cls.forward`` runs through transformers' activation-checkpointing wrapper (proven known)."""
    try:
        return "checkpointing" in peel_forward(cls).kinds
    except Refusal:
        return False

