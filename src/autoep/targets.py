"""``_target_`` strings: where autoep's own callables live, and importing one by its dotted path.

Shared by every layer (like ``autoep.errors``). autoep's modules moved into packages (detect, plan,
runtime, train, tools); a config or resolved artifact still naming an old path is refused by name, with
the new path to write instead, never with an import traceback.
"""
from __future__ import annotations

import functools
import importlib

from autoep.errors import OPT_OUT_SPELLING, PlanError

RECIPES = "autoep.runtime.recipes"  # the compute-fn factories the archetype table names

# How a plan entry names its compute-fn factory: ``local_compute_fn: {_factory_: pkg.fn, **kwargs}``.
# ``_factory_`` is what autoep writes (resolve_plan, resolved.yaml): a host app that runs Hydra's recursive
# ``instantiate`` over its whole config calls every mapping holding a ``_target_``, and a compute-fn
# factory must never be called that way (it needs the module and the mesh). Hydra's own spelling,
# ``{_target_: pkg.fn, _partial_: true, **kwargs}``, is safe there too: ``instantiate`` turns it into a
# ``functools.partial`` without calling it, and autoep reads either form back (``factory_mapping``).
# A bare ``_target_`` stays valid input (autoep's own command line, artifacts written before
# ``_factory_``), read the same way, but a host's recursive ``instantiate`` calls it.
FACTORY_KEY = "_factory_"
FACTORY_KEYS = (FACTORY_KEY, "_target_")
PARTIAL_KEY = "_partial_"  # Hydra's: with ``_target_``, ``instantiate`` returns a partial instead of calling

# Old prefix -> new prefix, for paths that a config or a resolved.yaml may hold (recipes, model builders,
# the tiny-model builder the docs show).
MOVED = {
    "autoep.recipes.": "autoep.runtime.recipes.",
    "autoep.models.": "autoep.train.models.",
    "autoep.tiny.": "autoep.tools.tiny.",
    "autoep.experts.": "autoep.runtime.experts.",
    "autoep.dispatch.": "autoep.runtime.dispatch.",
}


def moved_to(path: str) -> str | None:
    """The current path of ``path`` if it names where an autoep callable used to live, else None."""
    for old, new in MOVED.items():
        if isinstance(path, str) and path.startswith(old):
            return new + path[len(old):]
    return None


def check_not_moved(path: str, key: str) -> None:
    """Refuse an old autoep path, naming the key, the value and the path to write instead."""
    new = moved_to(path)
    if new is not None:
        raise PlanError(f"{key}={path!r}: autoep's modules moved into packages and this path is gone; write "
                        f"{key}={new!r} (a resolved.yaml written before the move: regenerate it with autoep-plan)")


def factory_key(fn, where: str = "local_compute_fn") -> str | None:
    """The key of the mapping ``fn`` that names its factory (``_factory_`` or ``_target_``); None when it has
    neither (``fn`` is ``auto``, or not a mapping). Both at once is a ``PlanError``: which one runs is unclear."""
    if not hasattr(fn, "keys"):
        return None
    present = [k for k in FACTORY_KEYS if k in fn.keys()]
    if len(present) > 1:
        raise PlanError(f"{where} names its factory twice ({FACTORY_KEY}={fn[FACTORY_KEY]!r} and "
                        f"_target_={fn['_target_']!r}); keep one of them")
    return present[0] if present else None


def factory_spec(fn, where: str = "local_compute_fn") -> tuple[str, str, dict]:
    """``(key, dotted path, kwargs)`` of a ``local_compute_fn`` mapping naming its factory with ``_factory_``
    or ``_target_`` (``factory_key``); the kwargs are every other key but Hydra's ``_partial_``."""
    key = factory_key(fn, where)
    if key is None:
        raise PlanError(f"{where}={fn!r} names no factory: give it a {FACTORY_KEY} (or _target_ with _partial_: true)")
    return key, fn[key], {k: v for k, v in fn.items() if k not in (key, PARTIAL_KEY)}


def factory_mapping(fn, where: str = "local_compute_fn"):
    """``fn`` as a plan entry's mapping: a ``functools.partial`` (what a host's recursive ``instantiate`` made
    of ``{_target_: pkg.fn, _partial_: true, **kwargs}``) becomes ``{_factory_: pkg.fn, **kwargs}``; anything
    else is returned as it is. A partial whose function has no import path that leads back to it (a lambda, a
    local function, a method), or that holds positional arguments, is a ``PlanError``: the plan records a
    factory by its path and keywords."""
    if not isinstance(fn, functools.partial):
        return fn
    func = fn.func
    path = f"{getattr(func, '__module__', None)}.{getattr(func, '__qualname__', None)}"
    try:
        found = import_object(path)
    except (ImportError, AttributeError, ValueError):
        found = None
    if found is not func or fn.args:
        why = "positional arguments" if found is func else f"no import path that leads back to {func!r}"
        raise PlanError(f"{where} is a functools.partial with {why}; name the factory by its dotted path "
                        f"and its keyword arguments: {where}: {OPT_OUT_SPELLING}")
    return {FACTORY_KEY: path, **(fn.keywords or {})}


def import_object(path: str):
    """``pkg.mod.Name`` -> the object; raises ImportError/AttributeError naming the path (``PlanError`` for
    an old autoep path, naming the new one)."""
    check_not_moved(path, "_target_")
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ImportError(f"{path!r} is not a dotted path like pkg.module.Name")
    return getattr(importlib.import_module(module_name), attr)
