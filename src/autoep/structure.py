"""Recognise what kind of MoE block a module is by reading its source, never by running it.

``detect_moe_structure(module)`` returns a ``MoeStructure`` or raises ``UnsupportedModuleStructure``.
Rules: never call a forward, never allocate, never read a model's or class's name; refuse rather
than guess. Source parsing and proofs are cached per class.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch.nn as nn

from autoep import experts_proof, routing_proof, source
from autoep.errors import UnsupportedModuleStructure
from autoep.source import Refusal

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
    # glu: act_fn(gate) * up | clamped_glu: a clamped gate (GPT-OSS) | own_gate: another row-local gate;
    # for clamped_glu and own_gate the recipe calls the experts' own proven-row-local ``_apply_gate``.
    activation: str = "glu"
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



def _refuse(module: nn.Module, exc: Refusal) -> UnsupportedModuleStructure:
    return UnsupportedModuleStructure(type(module).__name__, str(exc))


def detect_router_kind(module: nn.Module) -> str:
    """``softmax_topk`` | ``sigmoid_group`` | ``topk_router_module``, proven from source; never calls the gate."""
    try:
        return routing_proof.router_kind(module)
    except Refusal as exc:
        raise _refuse(module, exc) from None


# ---------------------------------------------------------------------------------------------
# The public detector
# ---------------------------------------------------------------------------------------------


def _structure(module: nn.Module) -> MoeStructure:
    cls = type(module)
    router = routing_proof.router_kind(module)
    shared = routing_proof.shared_kind(module)
    experts = getattr(module, "experts", None)
    if isinstance(experts, nn.ModuleList):
        storage = "module_list"
        facts = experts_proof.module_list_facts(experts)
        if router == "topk_router_module":
            raise Refusal("a router module with ModuleList experts has no recipe (routing lives in the block)")
        facts |= routing_proof.routing_facts(cls, router)
        if shared == "gated" and "sigmoid" not in source.call_names(source.forward_tree(cls)):
            raise Refusal(f"{cls.__name__}.forward does not gate the shared expert with a sigmoid")
    elif isinstance(experts, nn.Module):
        storage = "batched_parameters"
        facts = experts_proof.batched_experts_facts(experts)
        routing_proof.experts_only_called(source.forward_tree(cls), cls.__name__)
    else:
        raise Refusal("no `experts` submodule")
    structure = MoeStructure(
        router=router, shared_experts=shared, expert_storage=storage, jitter=hasattr(module, "jitter_noise"), **facts
    )
    from autoep.archetypes import TABLE  # the table imports this module

    if (router, storage) not in TABLE:
        raise Refusal(f"no recipe for router={router} with expert_storage={storage}")
    return structure


def detect_moe_structure(module: nn.Module) -> MoeStructure:
    """What kind of MoE block ``module`` is, proven from its source and attributes.

    Never calls a forward and allocates nothing (works on ``torch.device("meta")`` modules).
    Raises ``UnsupportedModuleStructure`` naming the class, the failed proof and the opt-out hint.
    """
    try:
        return _structure(module)
    except Refusal as exc:
        raise _refuse(module, exc) from None


def count_experts(module: nn.Module) -> int:
    """Number of routed experts of an MoE block (from the experts' shapes; reads no data)."""
    experts = getattr(module, "experts", None)
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    p = getattr(experts, "gate_up_proj", None)
    if isinstance(p, nn.Parameter) and p.dim() == 3:
        return int(p.shape[0])
    raise UnsupportedModuleStructure(type(module).__name__, "cannot count experts: no ModuleList or 3-D gate_up_proj")


def clear_caches() -> None:
    """Forget every per-class proof (benchmarks measure a cold detection with this)."""
    caches = (source.function_tree, routing_proof._router_module_proof, routing_proof.routing_facts,
              experts_proof._apply_gate_facts, experts_proof._batched_forward_facts_cached,
              experts_proof._swiglu_expert_proof)
    for fn in caches:
        fn.cache_clear()

