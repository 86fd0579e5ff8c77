"""Recognise what kind of MoE block a module is by reading its source, never by running it.

``detect_moe_structure(module)`` returns a ``MoeStructure`` or raises ``UnsupportedModuleStructure``.
Rules: never call a forward, never allocate, never read a model's or class's name; refuse rather
than guess. Source parsing and proofs are cached per class.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from autoep.errors import OPT_OUT_HINT, UnsupportedModuleStructure

DETECTOR_VERSION = "1"

ROUTER_KINDS = ("softmax_topk", "sigmoid_group", "topk_router_module")
SHARED_KINDS = ("none", "gated", "additive")
STORAGE_KINDS = ("module_list", "batched_parameters")


@dataclass(frozen=True)
class MoeStructure:
    """What a recipe needs to know about an MoE block, every field proven from source and attributes."""

    router: str  # softmax_topk | sigmoid_group | topk_router_module
    shared_experts: str  # none | gated | additive
    expert_storage: str  # module_list | batched_parameters
    jitter: bool  # the block has ``jitter_noise`` (multiplicative input noise in training)
    # Expert layout facts (batched_parameters; module_list experts are stacked to the default layout).
    expert_bias: bool = False  # gate_up_proj_bias / down_proj_bias are added
    expert_transposed: bool = False  # weights stored (E, in, out) and applied as x @ w
    gate_up_layout: str = "concatenated"  # concatenated [gate | up] | interleaved [g0, u0, g1, u1, ...]
    activation: str = "glu"  # glu: act_fn(gate) * up | clamped_glu: the experts' own _apply_gate (GPT-OSS)
    # Routing facts for whole-block recipes (module_list). "router" when a router module computes them.
    topk_norm: str = "router"  # router | always | never | norm_topk_prob
    returns_router_logits: bool = False  # the block's forward returns (hidden, router_logits)
    # module_list experts: attribute names of the gate, up and down projections (comma-separated,
    # e.g. "gate_proj,up_proj,down_proj" or "w1,w3,w2"), and how the gate is activated:
    # "act_fn" = the expert's own ``act_fn`` module, "silu" = F.silu written in the expert's forward.
    expert_projs: str = ""
    expert_act: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def detect_router_kind(module) -> str:  # filled in by the detection work (issue 2)
    raise NotImplementedError


def detect_moe_structure(module) -> MoeStructure:  # filled in by the detection work (issue 2)
    raise NotImplementedError


def count_experts(module) -> int:
    """Number of routed experts of an MoE block (from the experts' shapes; reads no data)."""
    import torch.nn as nn

    experts = getattr(module, "experts", None)
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    for name in ("gate_up_proj", "w1", "down_proj"):
        p = getattr(experts, name, None)
        if isinstance(p, nn.Parameter) and p.dim() == 3:
            return int(p.shape[0])
    raise UnsupportedModuleStructure(type(module).__name__, "cannot count experts: no ModuleList or 3-D expert weights")
