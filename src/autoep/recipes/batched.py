"""Recipe for v5-style blocks (a router module or linear gate routing inside the block, batched experts
obeying ``experts(hidden_TD, top_k_index_TK, top_k_weights_TK) -> (T, D)``).

The block's own forward runs unchanged (routing, shared branch, jitter, output shape); only
``block.experts.forward`` is replaced by the token exchange + grouped local compute. The replacement
honours the layout facts the detector proved (biases, transposed weights, interleaved gate/up, the
experts' own gate) and equals the experts' eager forward.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

from torch import Tensor, nn

from autoep.dispatch import ep_experts_forward
from autoep.experts import glu_gate, grouped_swiglu
from autoep.recipes import ep_group_of, local_tensor
from autoep.structure import MoeStructure


@dataclass(frozen=True)
class _EpExperts:
    """What the replaced experts forward needs, fixed at apply time."""

    num_experts: int
    ep_group: object
    transposed: bool
    bias: bool
    apply_gate: Callable[[Tensor], Tensor]


def ep_batched_experts(module: nn.Module, *, ep_mesh=None, structure: dict | MoeStructure) -> None:
    """Bind the EP experts forward on ``module.experts`` (factory contract: ``autoep.recipes``)."""
    facts = structure if isinstance(structure, MoeStructure) else MoeStructure(**structure)
    experts = module.experts
    _check_supported(experts, facts)
    experts._autoep_ep = _EpExperts(
        num_experts=int(experts.gate_up_proj.shape[0]),  # global count: a DTensor reports the global shape
        ep_group=ep_group_of(ep_mesh),
        transposed=facts.expert_transposed,
        bias=facts.expert_bias,
        apply_gate=_gate_of(experts, facts),
    )
    experts.forward = types.MethodType(_ep_forward, experts)


def _check_supported(experts: nn.Module, facts: MoeStructure) -> None:
    name = type(experts).__name__
    for attr in ("gate_up_proj", "down_proj") + (("gate_up_proj_bias", "down_proj_bias") if facts.expert_bias else ()):
        if not isinstance(getattr(experts, attr, None), nn.Parameter | Tensor):
            raise ValueError(f"{name}.{attr} is missing; the batched recipe needs it (structure={facts.as_dict()})")
    if getattr(experts, "has_post_expert_norm", False):
        raise ValueError(f"{name} applies a post-expert norm, which the batched recipe does not reproduce")


def _gate_of(experts: nn.Module, facts: MoeStructure) -> Callable[[Tensor], Tensor]:
    """The experts' own gate where they define one (always for clamped/interleaved), else act_fn(gate)*up."""
    own = getattr(experts, "_apply_gate", None)
    if own is not None:
        return own
    if facts.activation != "glu" or facts.gate_up_layout != "concatenated":
        raise ValueError(
            f"{type(experts).__name__} has activation={facts.activation}, layout={facts.gate_up_layout} "
            "but no _apply_gate to reproduce it"
        )
    return glu_gate(experts.act_fn)


def _ep_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor = None, top_k_weights: Tensor = None, **aliases):
    # transformers calls experts positionally; GPT-OSS's signature names them router_indices/routing_weights.
    top_k_index = aliases.pop("router_indices", top_k_index)
    top_k_weights = aliases.pop("routing_weights", top_k_weights)
    spec: _EpExperts = self._autoep_ep

    def expert_fn(x_SD: Tensor, tokens_per_local_expert: Tensor) -> Tensor:
        return grouped_swiglu(
            x_SD,
            tokens_per_local_expert,
            local_tensor(self.gate_up_proj),
            local_tensor(self.down_proj),
            gate_up_bias=local_tensor(self.gate_up_proj_bias) if spec.bias else None,
            down_bias=local_tensor(self.down_proj_bias) if spec.bias else None,
            transposed=spec.transposed,
            apply_gate=spec.apply_gate,
        )

    return ep_experts_forward(
        hidden_states, top_k_index, top_k_weights, num_experts=spec.num_experts, ep_group=spec.ep_group, expert_fn=expert_fn
    )
