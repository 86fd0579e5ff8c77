"""A model's own ``torch.autograd.Function`` that applies expert weights per group (the ScatterMoE / JetMoE-era
``ParallelLinear.apply(x, counts, W)`` with a hand-written backward), read from its source, never run.

What the grouped-experts proof (``autoep.detect.grouped_loops``) needs to know before it reads such a Function's
``forward`` and ``backward`` as per-group loops: the class runs exactly those two static methods and nothing
torch would call instead (``apply``, ``vjp``/``backward`` aliases, ``setup_context``, ``jvp``, vmap rules are
torch's own), and ``ctx`` is used only to save tensors and plain values for the backward. Where both methods are
per-group (group e of the rows reads only expert e's weight slice, and the weight gradient's entry e reads only
group e), the Function computes on a rank's local experts what it computes on all of them, its own backward
included: the grouped recipe runs it there, on the local slice (``autoep.runtime.recipes.grouped``).
"""
from __future__ import annotations

import ast
import inspect

from torch.autograd import Function

from autoep.detect.source import Refusal, function_tree

# Attributes torch reads on a Function class besides forward/backward: each must be torch's own.
_TORCH_OWN = ("apply", "vjp", "jvp", "setup_context", "vmap", "_compiled_autograd_key", "__call__")


def is_function_class(obj: object) -> bool:
    return inspect.isclass(obj) and issubclass(obj, Function) and obj is not Function


def checked_function(cls: type) -> tuple:
    """``(forward, backward)``, the plain functions of ``cls``'s own static methods, or ``Refusal`` naming what
    else ``cls`` defines that torch would run."""
    name = cls.__qualname__
    if type(cls) is not type(Function):
        raise Refusal(f"custom autograd Function {name} has a metaclass of its own")
    ours = [k for k in cls.__mro__ if k not in inspect.getmro(Function) and k is not object]
    for attr in _TORCH_OWN:
        if any(attr in vars(k) for k in ours):
            raise Refusal(f"custom autograd Function {name} defines {attr}; autoep reads only a Function whose "
                          "forward(ctx, ...) and backward(ctx, grad) are its own and everything else is torch's")
    if getattr(cls, "generate_vmap_rule", False):
        raise Refusal(f"custom autograd Function {name} sets generate_vmap_rule")
    fns = []
    for method in ("forward", "backward"):
        owner = next((k for k in ours if method in vars(k)), None)
        raw = vars(owner).get(method) if owner is not None else None
        if not isinstance(raw, staticmethod) or not inspect.isfunction(raw.__func__):
            raise Refusal(f"custom autograd Function {name}.{method} is not a static method it defines")
        fn = raw.__func__
        if hasattr(fn, "__wrapped__") or any(not _is_staticmethod(fn, d) for d in function_tree(fn).decorator_list):
            raise Refusal(f"custom autograd Function {name}.{method} is decorated beyond @staticmethod (e.g. "
                          "once_differentiable, custom_fwd); autoep does not know what the decorator does")
        fns.append(fn)
    return tuple(fns)


def _is_staticmethod(fn, node) -> bool:
    return isinstance(node, ast.Name) and _resolve(fn, node.id) is staticmethod


def _resolve(fn, name: str):
    if name in fn.__globals__:
        return fn.__globals__[name]
    builtins = fn.__globals__.get("__builtins__", {})
    return builtins.get(name) if isinstance(builtins, dict) else getattr(builtins, name, None)


def genuine_autograd() -> None:
    """``torch.autograd.Function.apply`` is torch's own (a patch would run instead of the proven methods)."""
    if not inspect.ismethod(Function.apply) or getattr(Function.apply, "__func__", None) is not _APPLY:
        raise Refusal("torch.autograd.Function.apply is patched; autoep proves only torch's own")


_APPLY = getattr(Function.apply, "__func__", None)
