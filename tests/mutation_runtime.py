"""Run-time-state operators of the soundness fuzzer (no source change), and the roles they touch.

``op(block, role) -> mutate(block) | None`` (None where the operator does not apply to that role):
an instance ``forward``, forward and pre hooks, a ``__call__`` override, a ``functools.wraps``ed
forward set at run time, tied / frozen / differently sized experts, another or a non-element-wise
``act_fn``, an instance ``_apply_gate``, a doubled or learnable constant of the experts' gate. Roles:
``block``, ``router`` (the gate or router module), ``experts`` (batched experts: the container is
called), ``expert`` (ModuleList experts), ``act`` (the experts' ``act_fn`` where the model defines its
class, e.g. a soft-capped SwiGLU); source sites also use ``act:<Class>`` (the model-defined modules
inside it, every instance of that class: a class edit is global).
"""

from __future__ import annotations

import functools
import types
from typing import Callable

import torch
from mutation_source import SCALE, exec_subclass
from torch import nn

# ---------------------------------------------------------------------------------------------
# Roles: the block, its router, its experts container, one expert
# ---------------------------------------------------------------------------------------------


def router_of(block: nn.Module) -> nn.Module | None:
    gate = getattr(block, "gate", None)
    return gate if isinstance(gate, nn.Module) else getattr(block, "router", None)


def is_module_list(block: nn.Module) -> bool:
    return isinstance(getattr(block, "experts", None), nn.ModuleList)


def model_defined(obj) -> bool:
    """A module whose class the model's own code defines (not torch's, not transformers' activations)."""
    return isinstance(obj, nn.Module) and not type(obj).__module__.startswith(("torch.", "transformers.activations"))


def act_modules(block: nn.Module) -> list[nn.Module]:
    """The experts' ``act_fn`` modules whose class the model defines (every expert's, for a ModuleList)."""
    holders = list(block.experts) if is_module_list(block) else [block.experts]
    return [h.act_fn for h in holders if model_defined(getattr(h, "act_fn", None))]


def act_roles(block: nn.Module) -> list[str]:
    """``act``, then ``act:<Class>`` for each model-defined class inside it, in module order ([] without one)."""
    acts = act_modules(block)
    if not acts:
        return []
    inner = [type(m).__name__ for m in acts[0].modules() if m is not acts[0] and model_defined(m)]
    return ["act", *(f"act:{name}" for name in dict.fromkeys(inner))]


def experts_sub_roles(block: nn.Module) -> list[str]:
    """``experts:<Class>`` for each model-defined class of module inside batched/grouped experts (Aria's
    grouped-GEMM modules), not activations (``act`` roles), in module order."""
    if is_module_list(block) or not isinstance(getattr(block, "experts", None), nn.Module):
        return []
    acts = {id(m) for a in act_modules(block) for m in a.modules()}
    inner = [type(m).__name__ for m in block.experts.modules()
             if m is not block.experts and id(m) not in acts and model_defined(m)]
    return [f"experts:{name}" for name in dict.fromkeys(inner)]


def role_objects(block: nn.Module, role: str) -> list[nn.Module]:
    """The modules a mutation of ``role`` re-classes: ``expert`` = every expert, ``act:<Class>`` = every
    instance of that class (a class edit is global)."""
    if role == "block":
        return [block]
    if role == "router":
        return [router_of(block)]
    if role == "experts":
        return [block.experts]
    if role == "act":
        return act_modules(block)
    if role.startswith("experts:"):
        return [m for m in block.experts.modules() if m is not block.experts and type(m).__name__ == role[len("experts:"):]]
    if role.startswith("act:"):
        return [m for a in act_modules(block) for m in a.modules() if type(m).__name__ == role[len("act:"):]]
    return list(block.experts)


def roles_of(block: nn.Module) -> list[str]:
    """Roles a run-time mutation can target: the experts container only where it is called (batched), the
    experts' model-defined activation module where there is one."""
    return ["block", "router", "expert" if is_module_list(block) else "experts", *act_roles(block)[:1]]


# ---------------------------------------------------------------------------------------------
# Operators
# ---------------------------------------------------------------------------------------------


def scaled(out):
    """The output scaled by SCALE (a tuple's first element)."""
    return (out[0] * SCALE, *out[1:]) if isinstance(out, tuple) else out * SCALE


def _one(block: nn.Module, role: str) -> nn.Module:
    """The single object a run-time mutation of ``role`` touches (``expert``: expert 1)."""
    return block.experts[1] if role == "expert" else role_objects(block, role)[0]


def rt_instance_forward(block, role):
    """An instance-level ``forward`` that scales what the class forward returns."""
    def apply(b):
        obj = _one(b, role)
        obj.forward = types.MethodType(lambda self, *a, **k: scaled(type(self).forward(self, *a, **k)), obj)

    return apply


def rt_forward_hook(block, role):
    """A forward hook that scales the output."""
    return lambda b: _one(b, role).register_forward_hook(lambda mod, args, out: scaled(out))


def rt_forward_pre_hook(block, role):
    """A forward pre-hook that scales the first input."""
    return lambda b: _one(b, role).register_forward_pre_hook(lambda mod, args: (args[0] * SCALE, *args[1:]))


CALL_OVERRIDE = f"""    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        return (out[0] * {SCALE}, *out[1:]) if isinstance(out, tuple) else out * {SCALE}
"""


def rt_call_override(block, role):
    """A subclass (with source) whose ``__call__`` scales what ``nn.Module.__call__`` returns."""
    cache = {}

    def apply(b):
        obj = _one(b, role)
        if "cls" not in cache:
            cache["cls"] = exec_subclass(type(obj), CALL_OVERRIDE, check="__call__")
        obj.__class__ = cache["cls"]

    return apply


def rt_wrapped_forward(block, role):
    """A subclass whose ``forward`` is set at run time to a ``functools.wraps`` wrapper of the original."""
    cache = {}

    def apply(b):
        obj = _one(b, role)
        if "cls" not in cache:
            orig = type(obj).forward

            @functools.wraps(orig)
            def forward(self, *args, **kwargs):
                return scaled(orig(self, *args, **kwargs))

            cache["cls"] = type(type(obj).__name__, (type(obj),), {"forward": forward})
        obj.__class__ = cache["cls"]

    return apply


def _projections(expert: nn.Module) -> list[str]:
    return [n for n, m in expert.named_children() if isinstance(m, nn.Linear)]


def rt_tied_experts(block, role):
    """Expert 1's projections are expert 0's Parameters."""
    if role != "expert":
        return None

    def apply(b):
        for n in _projections(b.experts[0]):
            getattr(b.experts[1], n).weight = getattr(b.experts[0], n).weight

    return apply


def rt_frozen_expert(block, role):
    """Expert 1 (batched: the ``down_proj`` of all) with ``requires_grad=False``."""
    if role == "expert":
        return lambda b: b.experts[1].requires_grad_(False)
    if role == "experts":  # grouped experts may hold no ``down_proj`` (w2, fc2.weight): their last weight
        return lambda b: getattr(b.experts, "down_proj", [*b.experts.parameters()][-1]).requires_grad_(False)
    return None


def _set_act(role: str, make: Callable[[], nn.Module], every: bool) -> Callable:
    def apply(b):
        objs = [b.experts] if role == "experts" else list(b.experts) if every else [b.experts[1]]
        for obj in objs:
            obj.act_fn = make()

    return apply


def rt_expert_activation(block, role):
    """One expert (or the batched experts) with GELU instead of the configured activation."""
    if role not in ("expert", "experts") or not hasattr(_one(block, role), "act_fn"):
        return None
    return _set_act(role, nn.GELU, every=False)


def rt_act_not_elementwise(block, role):
    """Every expert's ``act_fn`` a softmax over the last dim."""
    if role not in ("expert", "experts") or not hasattr(_one(block, role), "act_fn"):
        return None
    return _set_act(role, lambda: nn.Softmax(dim=-1), every=True)


def rt_expert_sizes(block, role):
    """Expert 1 with half the intermediate size of the others."""
    if role != "expert":
        return None

    def apply(b):
        expert, hidden = b.experts[1], router_of(b).weight.shape[-1]
        torch.manual_seed(5)
        for n in _projections(expert):
            lin = getattr(expert, n)
            shrink_out, shrink_in = lin.out_features != hidden, lin.in_features != hidden
            setattr(expert, n, nn.Linear(lin.in_features // (1 + shrink_in), lin.out_features // (1 + shrink_out),
                                         bias=lin.bias is not None))

    return apply


def rt_instance_apply_gate(block, role):
    """An instance-level ``_apply_gate`` on batched experts that scales the class's."""
    if role != "experts" or not hasattr(block.experts, "_apply_gate"):
        return None

    def apply(b):
        experts = b.experts
        experts._apply_gate = types.MethodType(lambda self, gu: type(self)._apply_gate(self, gu) * SCALE, experts)

    return apply


def _float_constants(block: nn.Module, role: str) -> list[tuple[nn.Module, str]]:
    """``(module, attribute)`` of each plain float the experts' gate reads: on the batched experts
    container itself (``experts``: gpt-oss's ``alpha``, ``limit``) or anywhere inside the model-defined
    activation module (``act``: Inkling2's soft caps)."""
    if role == "experts":
        owners = [block.experts]
    elif role == "act":
        owners = [m for a in act_modules(block)[:1] for m in a.modules()]
    else:
        return []
    return [(m, k) for m in owners for k, v in vars(m).items() if type(v) is float]


def _located(b: nn.Module, block: nn.Module, found: list[tuple[nn.Module, str]]) -> list[tuple[nn.Module, str]]:
    """``found`` (modules of ``block``) as the same modules of the fresh build ``b``."""
    names = {id(m): n for n, m in block.named_modules()}
    return [(b.get_submodule(names[id(m)]), k) for m, k in found]


def rt_gate_constant(block, role):
    """Every float constant of the experts' gate doubled (a soft cap, a clamp limit, a sigmoid's alpha)."""
    found = _float_constants(block, role)
    if not found:
        return None

    def apply(b):
        for m, k in _located(b, block, found):
            setattr(m, k, getattr(m, k) * 2)

    return apply


def rt_gate_learnable(block, role):
    """The first float constant of the experts' gate made a learnable 0-dim Parameter (state the gate reads)."""
    found = _float_constants(block, role)[:1]
    if not found:
        return None

    def apply(b):
        for m, k in _located(b, block, found):
            value = getattr(m, k)
            delattr(m, k)
            m.register_parameter(k, nn.Parameter(torch.tensor(value)))

    return apply


RUNTIME_OPERATORS: dict[str, Callable] = {
    "instance_forward": rt_instance_forward,
    "forward_hook": rt_forward_hook,
    "forward_pre_hook": rt_forward_pre_hook,
    "call_override": rt_call_override,
    "wrapped_forward": rt_wrapped_forward,
    "tied_experts": rt_tied_experts,
    "frozen_expert": rt_frozen_expert,
    "expert_activation": rt_expert_activation,
    "act_not_elementwise": rt_act_not_elementwise,
    "expert_sizes": rt_expert_sizes,
    "instance_apply_gate": rt_instance_apply_gate,
    "gate_constant": rt_gate_constant,
    "gate_learnable": rt_gate_learnable,
}
