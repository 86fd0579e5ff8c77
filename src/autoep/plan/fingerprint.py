"""Fingerprints that seal a frozen plan decision to the code it was decided on.

``class_hashes(modules)`` maps every class an MoE block runs (the block, its router, experts,
shared branch, activations: every submodule class outside ``torch.``) to a hash of its source:
the source of each class in its MRO plus the source of the forward actually bound (unwrapped, so a
forward patched onto the class after import counts too). ``seal(...)`` hashes a whole decision
record with the plan entry it belongs to, so a hand edit of any field is caught.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json

import torch.nn as nn


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _source(obj) -> str:
    """Source text of a class or function; bytecode when the source is not on disk (exec, REPL)."""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        code = getattr(obj, "__code__", None)
        if code is None:
            return repr(sorted(k for k in vars(obj) if not k.startswith("__")))
        return repr((code.co_code, code.co_consts, code.co_names))


def _is_framework(cls: type) -> bool:
    return cls.__module__.startswith("torch.") or cls is object


@functools.lru_cache(maxsize=None)
def _class_hash(cls: type, forward) -> str:
    # forward is part of the cache key: patching Cls.forward must change the hash.
    parts = [qualified_name(k) + "\n" + _source(k) for k in cls.__mro__ if not _is_framework(k)]
    parts.append(_source(inspect.unwrap(forward)) if forward is not None else "")
    return "sha256:" + _sha256("\n".join(parts))[:16]


def class_hashes(modules: list[nn.Module]) -> dict[str, str]:
    """``{qualified class name: "sha256:<16 hex>"}`` over every non-torch class the modules run."""
    out: dict[str, str] = {}
    for module in modules:
        for sub in module.modules():
            cls = type(sub)
            if not _is_framework(cls):
                out.setdefault(qualified_name(cls), _class_hash(cls, getattr(cls, "forward", None)))
    return dict(sorted(out.items()))


def seal(record: dict) -> str:
    """``"sha256:..."`` over a plain-data record (match, local_compute_fn and the decision fields)."""
    return "sha256:" + _sha256(json.dumps(record, sort_keys=True, default=str))
