"""Experts held in a plain ``dict`` or ``list`` attribute of the block (issue 21):

    for i in range(E):
        self.add_module(f"expert_{i}", FeedForward())
    self.expert_by_id = {i: getattr(self, f"expert_{i}") for i in range(E)}   # or a list

Each value is a module registered on the block itself (its state-dict keys stay the model's:
``expert_3.w1.weight``); the attribute is only the map from expert id (its order) to those modules, which the
forward reads. ``MoeStructure.experts_path`` is the attribute's name (``expert_by_id``); an expert is named
``expert_by_id[3]`` in messages and plans. Refused, naming the attribute and the fix: a value that is not a
registered child of the block (its parameters are not the model's: the optimizer and the checkpoint would miss
them), and one module at two entries (one expert would be placed and answered twice).

``holder(block, attr)`` returns the ``PlainExperts`` record or raises ``Refusal``; ``candidates(block)`` the
attributes that could be one (a non-empty dict/list of modules); ``resolve(block, path)`` the experts at a
structure's ``experts_path`` as a module and the prefix of their names in the block, whichever the storage.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from autoep.detect.source import Refusal

_TORCH_ATTRS = frozenset(vars(nn.Module()))  # nn.Module's own instance state (``_modules``, hook dicts, ...)


@dataclass(frozen=True)
class PlainExperts:
    """A plain dict/list attribute of the block mapping expert ids to registered children (plain values only:
    a deep copy stays consistent)."""

    attr: str  # the attribute: ``expert_by_id``
    keys: tuple | None  # the dict's keys in insertion order (the expert ids' order); None for a list
    names: tuple[str, ...]  # per entry, the name the block registers its module under: ``expert_3``

    def label(self, i: int) -> str:
        """How the model names entry ``i``: ``expert_by_id[3]``, ``expert_by_id['a']``."""
        return f"{self.attr}[{i if self.keys is None else self.keys[i]!r}]"

    def entries(self, block: nn.Module) -> list:
        """The attribute's values now, in order (``[]`` where it is gone or no longer a dict/list)."""
        value = vars(block).get(self.attr)
        if isinstance(value, dict):
            return list(value.values())
        return list(value) if isinstance(value, list) else []

    def drift(self, block: nn.Module) -> str:
        """"" where the attribute still maps the same keys, in order, to the modules registered under ``names``
        (one object each); else what changed: the placed experts are the registered ones, so a replaced or added
        entry, or a registered expert replaced with the entry still holding the old one, would not be placed."""
        value = vars(block).get(self.attr)
        if not isinstance(value, dict if self.keys is not None else list):
            return f"{self.attr} is now a {type(value).__name__}"
        keys = tuple(value) if self.keys is not None else tuple(range(len(value)))
        if keys != (self.keys if self.keys is not None else tuple(range(len(self.names)))):
            return f"{self.attr} now holds the entries {list(keys)}, not the {len(self.names)} it held at apply"
        for i, (entry, name) in enumerate(zip(self.entries(block), self.names)):
            if entry is not block._modules.get(name):
                return f"{self.label(i)} is no longer the module registered as {type(block).__name__}.{name}"
        return ""


def candidates(block: nn.Module) -> list[str]:
    """The block's plain attributes holding a non-empty dict or list of modules only (nn.Module's own state
    excluded)."""
    return [name for name, value in vars(block).items()
            if name not in _TORCH_ATTRS and not name.startswith("_autoep") and isinstance(value, (dict, list))
            and value and all(isinstance(v, nn.Module) for v in (value.values() if isinstance(value, dict) else value))]


def holder(block: nn.Module, attr: str) -> PlainExperts:
    """The ``PlainExperts`` record of ``block.<attr>`` (module docstring), or ``Refusal`` naming the entry."""
    cls, value = type(block).__name__, vars(block).get(attr)
    if not isinstance(value, (dict, list)) or not value:
        raise Refusal(f"{cls}.{attr} is not a non-empty plain dict or list of modules")
    keys = tuple(value) if isinstance(value, dict) else None
    if keys is not None and not all(type(k) in (int, str) for k in keys):
        raise Refusal(f"{cls}.{attr} has a key that is neither an int nor a str ({keys}); autoep names each expert "
                      f"by its key")
    registered = {id(m): name for name, m in block._modules.items() if m is not None}
    record = PlainExperts(attr, keys, ())
    names: list[str] = []
    for i, module in enumerate(value.values() if isinstance(value, dict) else value):
        where = record.label(i)
        if id(module) not in registered:
            raise Refusal(f"{cls}.{where} holds a {type(module).__name__} that is not a registered submodule of "
                          f"{cls}: its parameters are not the model's (state_dict, the optimizer and autoep's "
                          f"placement miss them). Register it on the block (self.add_module(name, module)) and keep "
                          f"that module in {attr}, or hold the experts in an nn.ModuleDict/nn.ModuleList")
        name = registered[id(module)]
        if name in names:
            raise Refusal(f"{cls}.{attr} holds the module {cls}.{name} at {record.label(names.index(name))} and at "
                          f"{where}: one module is one expert; give each entry its own registered module")
        names.append(name)
    return PlainExperts(attr, keys, tuple(names))


def resolve(block: nn.Module, path: str) -> tuple[nn.Module, str] | None:
    """The experts at ``path`` as a module, and the prefix their names take in the block: the submodule at
    ``path`` and ``path``; for a plain dict/list attribute, a view ``nn.ModuleDict`` {registered name: module}
    (never registered anywhere) and "" (``expert_3.w1.weight`` is the block's own name). None where neither."""
    try:
        return block.get_submodule(path), path
    except AttributeError:
        pass
    if "." in path or path not in candidates(block):
        return None
    try:
        found = holder(block, path)
    except Refusal:
        return None
    return nn.ModuleDict({name: block._modules[name] for name in found.names}), ""
