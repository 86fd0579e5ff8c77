"""Fingerprints that seal a frozen plan decision to the code it was decided on.

``class_hashes(modules)`` maps every class an MoE block runs (the block, its router, experts,
shared branch, activations: every submodule class outside ``torch.``) to a hash of its source:
the source of each class in its MRO plus the source of the forward actually bound (unwrapped, so a
forward patched onto the class after import counts too), and of every method whose code is not the one
its class's source defines there (a ``__code__`` swapped after import). ``seal(...)`` hashes a whole decision
record with the plan entry it belongs to, so a hand edit of any field is caught.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import types

import torch.nn as nn

from autoep.detect.source import Refusal, code_tree


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
def _class_hash(cls: type, forward, codes: tuple) -> str:
    # forward and every method's code object are part of the cache key: patching Cls.forward, or swapping
    # a method's __code__, must change the hash.
    parts = [qualified_name(k) + "\n" + _source(k) for k in cls.__mro__ if not _is_framework(k)]
    parts.append(_source(inspect.unwrap(forward)) if forward is not None else "")
    parts += [_displaced(k, name, fn) for k in cls.__mro__ if not _is_framework(k) for name, fn in _functions(k)]
    return "sha256:" + _sha256("\n".join(p for p in parts if p))[:16]


def _functions(cls: type) -> list[tuple[str, types.FunctionType]]:
    """``(name, function)`` for every function ``cls``'s own dict holds (unwrapped)."""
    out = []
    for name, value in vars(cls).items():
        fn = inspect.unwrap(getattr(value, "__func__", value)) if callable(getattr(value, "__func__", value)) else None
        if isinstance(fn, types.FunctionType):
            out.append((name, fn))
    return out


def _displaced(cls: type, name: str, fn) -> str:
    """'' when ``fn`` runs the code its class's source defines under ``name``; else what it runs (the
    source of its code, or its bytecode where that source is not the code: a ``__code__`` swapped or edited)."""
    code = fn.__code__
    try:
        lines, start = inspect.getsourcelines(cls)
        in_place = code.co_filename == inspect.getsourcefile(cls) and start <= code.co_firstlineno < start + len(lines)
    except (OSError, TypeError):
        in_place = False
    try:
        code_tree(code)
        matches = True
    except Refusal:
        matches = False
    if in_place and matches and code.co_name == name:
        return ""
    body = _source(fn) if matches else repr((code.co_code, code.co_consts, code.co_names))
    return f"{qualified_name(cls)}.{name} runs other code:\n{body}"


def class_hashes(modules: list[nn.Module]) -> dict[str, str]:
    """``{qualified class name: "sha256:<16 hex>"}`` over every non-torch class the modules run."""
    out: dict[str, str] = {}
    for module in modules:
        for sub in module.modules():
            cls = type(sub)
            if not _is_framework(cls) and qualified_name(cls) not in out:
                codes = tuple(fn.__code__ for k in cls.__mro__ if not _is_framework(k) for _, fn in _functions(k))
                out[qualified_name(cls)] = _class_hash(cls, getattr(cls, "forward", None), codes)
    return dict(sorted(out.items()))


def seal(record: dict) -> str:
    """``"sha256:..."`` over a plain-data record (match, local_compute_fn and the decision fields)."""
    return "sha256:" + _sha256(json.dumps(record, sort_keys=True, default=str))
