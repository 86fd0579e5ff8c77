"""Process-wide patches: whether the torch objects an expert computation reaches are torch's own.

The model's experts look ``F.linear``, ``nn.Linear.forward`` and their activation up at run time, so a
patch (a fake-quant ``F.linear``, a logging ``nn.Linear.forward``, a patched ``SiLU``) changes what they
compute; autoep's grouped GEMM would not. A proof compares against the genuine objects, found where torch
defines them (``torch._C`` builtins; Python functions by the file and name they were defined under), never
against a snapshot taken when autoep was imported, which a patch made before that import would poison.
"""
from __future__ import annotations

import sys
import types

import torch
import torch.nn as nn

# (module, name) of the element-wise torch functions a proof may accept; looked up when asked, so a
# function patched later is not the one in the table.
ELEMENTWISE_NAMES = (
    ("torch.nn.functional", "silu"), ("torch.nn.functional", "gelu"), ("torch.nn.functional", "relu"),
    ("torch.nn.functional", "relu6"), ("torch.nn.functional", "elu"), ("torch.nn.functional", "leaky_relu"),
    ("torch.nn.functional", "mish"), ("torch.nn.functional", "softplus"), ("torch.nn.functional", "sigmoid"),
    ("torch.nn.functional", "tanh"), ("torch", "sigmoid"), ("torch", "tanh"), ("torch", "relu"),
    ("torch", "square"), ("torch", "exp"), ("torch", "abs"),
)
# Other torch functions the proven regions compute with (matched by identity there, so a patch of one would
# be matched as torch's own).
COMPUTE_NAMES = (("torch", "matmul"), ("torch", "bmm"), ("torch", "zeros_like"), ("torch", "where"),
                 ("torch", "greater"), ("torch.nn.functional", "one_hot"))
# Where torch's C++ builtins live: a builtin is genuine if one of these holds it under its own name.
_BUILTIN_HOMES = (torch._C._VariableFunctions, torch._C._nn, torch._C._special, torch._C._linalg)


def genuine(fn: object, qualname: str | None = None) -> bool:
    """``fn`` is what torch (or the library that defines it) shipped: a ``torch._C`` builtin under its own
    name, or a Python function whose code was compiled from the file of the module it claims, under the
    name (``qualname`` when given) that module still holds it by. A wrapper (``functools.wraps`` copies the
    names, not the code), a partial or a function defined elsewhere is not."""
    if isinstance(fn, types.BuiltinFunctionType):
        return any(getattr(home, fn.__name__, None) is fn for home in _BUILTIN_HOMES)
    code, module = getattr(fn, "__code__", None), sys.modules.get(getattr(fn, "__module__", None) or "")
    if not isinstance(fn, types.FunctionType) or code is None or module is None:
        return False
    name = fn.__qualname__
    if qualname is not None and name != qualname:
        return False
    held: object = module
    for part in name.split("."):
        held = vars(held).get(part) if isinstance(held, (type, types.ModuleType)) else None
    return held is fn and code.co_filename == getattr(module, "__file__", None)


def current(module: str, name: str) -> object:
    """What ``module.name`` is now (a patch included)."""
    return getattr(sys.modules[module], name, None)


def elementwise_functions() -> list[object]:
    """The element-wise torch functions as they are now, the genuine ones only."""
    return [f for f in (current(m, n) for m, n in ELEMENTWISE_NAMES) if genuine(f)]


def genuine_linear() -> object:
    """``torch.nn.functional.linear`` as torch ships it (a ``torch._C._nn`` builtin)."""
    return torch._C._nn.linear


def genuine_forward(cls: type) -> bool:
    """``cls.forward`` is the forward its defining class shipped (for the class in its MRO that defines
    one, under ``<that class>.forward``)."""
    owner = next((k for k in cls.__mro__ if "forward" in vars(k)), None)
    return owner is not None and genuine(vars(owner)["forward"], f"{owner.__qualname__}.forward")


_VERDICTS: dict[tuple, tuple] = {}  # by the identity (and code) of every object checked: a patch is a new key


def patched_torch_objects(activation_classes=(), module_call: bool = True) -> list[str]:
    """Every torch object an expert computation reaches that is not torch's own now: ``F.linear``,
    ``nn.Linear.forward``, ``nn.Module.__call__`` (unless ``module_call`` is false: detection, which calls no
    module, leaves it to apply), the element-wise functions and ``activation_classes``' forwards. Each entry
    names the object. Cheap when nothing changed (it runs at each fast-path call)."""
    objects = (torch.nn.functional.linear, vars(nn.Linear).get("forward"), vars(nn.Module).get("__call__"),
               vars(nn.Module).get("_call_impl"), *(current(m, n) for m, n in ELEMENTWISE_NAMES + COMPUTE_NAMES),
               *(getattr(cls, "forward", None) for cls in activation_classes))
    key = tuple((id(o), id(getattr(o, "__code__", None))) for o in objects) + tuple(map(id, activation_classes))
    held = _VERDICTS.get(key)
    if held is None:  # the objects are kept with the verdict, so the ids in the key are not reused
        held = _VERDICTS[key] = ((objects, tuple(activation_classes)), _patched(activation_classes))
    return [name for name in held[1] if module_call or not name.startswith("torch.nn.Module.")]


def _patched(activation_classes) -> list[str]:
    found = []
    if torch.nn.functional.linear is not genuine_linear():
        found.append("torch.nn.functional.linear")
    if not genuine(vars(nn.Linear)["forward"], "Linear.forward"):
        found.append("torch.nn.Linear.forward")
    for attr in ("__call__", "_call_impl"):
        if not genuine(vars(nn.Module).get(attr)):  # __call__ is held as Module._wrapped_call_impl too
            found.append(f"torch.nn.Module.{attr}")
    for module, name in ELEMENTWISE_NAMES + COMPUTE_NAMES:
        if not genuine(current(module, name)):
            found.append(f"{module}.{name}")
    for cls in activation_classes:
        if not genuine_forward(cls):
            found.append(f"{cls.__module__}.{cls.__qualname__}.forward")
    return found
