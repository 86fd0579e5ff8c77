"""``_target_`` strings: where autoep's own callables live, and importing one by its dotted path.

Shared by every layer (like ``autoep.errors``). autoep's modules moved into packages (detect, plan,
runtime, train, tools); a config or resolved artifact still naming an old path is refused by name, with
the new path to write instead, never with an import traceback.
"""
from __future__ import annotations

import importlib

from autoep.errors import PlanError

RECIPES = "autoep.runtime.recipes"  # the compute-fn factories the archetype table names

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


def import_object(path: str):
    """``pkg.mod.Name`` -> the object; raises ImportError/AttributeError naming the path (``PlanError`` for
    an old autoep path, naming the new one)."""
    check_not_moved(path, "_target_")
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ImportError(f"{path!r} is not a dotted path like pkg.module.Name")
    return getattr(importlib.import_module(module_name), attr)
