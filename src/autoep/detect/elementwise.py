"""The element-wise activations a proof may accept, by object identity.

EP runs an expert's activation on whatever subset of rows reached the rank, so an activation is
exact under EP only if each output element depends on the same input element alone. These are the
ones known to be: torch's own activation modules and functions, and transformers' activation
classes. A subclass, a patched ``forward``, parameters or hooks make a module unknown.
"""
from __future__ import annotations

import functools

import torch.nn as nn

from autoep.detect import genuine
from autoep.detect.source import Refusal

TORCH_ACTIVATIONS = (nn.SiLU, nn.GELU, nn.ReLU, nn.ReLU6, nn.Tanh, nn.Sigmoid, nn.Mish, nn.ELU, nn.LeakyReLU,
                  nn.Softplus, nn.Identity)
_TRANSFORMERS_MODULES = (
    "SiLUActivation", "GELUActivation", "NewGELUActivation", "FastGELUActivation", "QuickGELUActivation",
    "PytorchGELUTanh", "GELUTanh", "AccurateGELUActivation", "ClippedGELUActivation", "ReLUSquaredActivation",
    "LaplaceActivation", "MishActivation", "LinearActivation", "SqrtSoftplusActivation",
)


@functools.lru_cache(maxsize=1)
def activation_classes() -> tuple[type, ...]:
    """The known activation classes (their forwards are checked genuine where used: ``autoep.detect.genuine``)."""
    classes = list(TORCH_ACTIVATIONS)
    try:
        from transformers import activations
    except ImportError:
        activations = None
    for name in _TRANSFORMERS_MODULES if activations is not None else ():
        cls = getattr(activations, name, None)
        if isinstance(cls, type):
            classes.append(cls)
    return tuple(classes)


def runtime_clean(module: nn.Module, what: str) -> None:
    """Refuse a module whose call would not run its class's forward: an instance-level ``forward``,
    an overridden ``__call__``, or forward/backward hooks on it."""
    if "forward" in vars(module):
        raise Refusal(f"{what} has an instance-level forward")
    if type(module).__call__ is not nn.Module.__call__:
        raise Refusal(f"{what} overrides __call__")
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    found = [h.strip("_") for h in hooks if getattr(module, h, None)]
    if found:
        raise Refusal(f"{what} has {', '.join(found)} registered")


def check_activation_module(act: object, what: str) -> None:
    """``act`` is an element-wise activation: a known torch function, or a module of a known class, as
    shipped, stateless."""
    if not isinstance(act, nn.Module) and known_function(act):
        return
    if not isinstance(act, nn.Module):
        raise Refusal(f"{what} is {type(act).__name__}, not an activation module")
    if type(act) not in activation_classes():
        raise Refusal(f"{what} is {type(act).__name__}, not a known element-wise activation")
    if not genuine.genuine_forward(type(act)):
        raise Refusal(f"{what}: {type(act).__name__}.forward was patched")
    runtime_clean(act, what)
    if any(True for _ in act.parameters()) or any(True for _ in act.buffers()):
        raise Refusal(f"{what} ({type(act).__name__}) holds parameters or buffers")


def same_activation(a: nn.Module, b: nn.Module) -> bool:
    """Two activation modules compute the same function (same class and same settings)."""
    plain = lambda m: {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training"}  # noqa: E731
    return type(a) is type(b) and plain(a) == plain(b)


def known_function(fn: object) -> bool:
    """``fn`` is one of the element-wise torch functions (by identity with the genuine one, looked up now:
    a patched ``F.silu`` is not known)."""
    return any(fn is known for known in genuine.elementwise_functions())
