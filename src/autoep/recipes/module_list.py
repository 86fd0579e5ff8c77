"""Whole-block recipe for v4-style MoE blocks: bare ``nn.Linear`` gate, routing written in the block
forward, a ``ModuleList`` of SwiGLU experts.

The block's forward is replaced by one that reproduces the block's own routing (softmax top-k or
DeepSeek-V3 sigmoid group-limited top-k, as the detector proved), training-time jitter, the shared
branch and the return structure, and sends the expert work through ``ep_experts_forward``.

Expert storage changes once, at apply time: the ``ModuleList`` is replaced by ``StackedSwiGLUExperts``
holding ``experts.gate_up_proj`` (E, 2F, D) = [gate | up] and ``experts.down_proj`` (E, D, F), the
transformers v5 names and layout. After apply these stacked parameters are the trained ones (the
per-expert ``experts.{e}.gate_proj.weight`` names no longer exist); their gradients equal the
per-expert gradients of the original layout, stacked. ``unstack_module_list_experts`` writes them
back in the model's own layout for checkpoints; ``load_module_list_experts`` reads that layout in.

Agreement with ``apply_plan``: it shards only parameters registered directly on ``block.experts``, and
a ModuleList has none, so it shards nothing here; this factory stacks the experts and shards the
stacked parameters itself with ``autoep.apply.shard_expert_tensor`` (local slice, no communication).

Shape legend: T tokens on this rank, K top-k, D hidden, F expert intermediate size, E routed experts,
G expert groups (sigmoid_group), S (token, expert) rows grouped by local expert.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from autoep.apply import shard_expert_tensor
from autoep.dispatch import ep_experts_forward
from autoep.errors import UnsupportedModuleStructure
from autoep.experts import glu_gate, grouped_swiglu
from autoep.recipes import ep_group_of, local_tensor
from autoep.structure import MoeStructure

TOP_K_NAMES = ("top_k", "num_experts_per_tok")


class StackedSwiGLUExperts(nn.Module):
    """The block's experts stacked once: ``down(act(gate(x)) * up(x))`` per expert, grouped compute.

    ``gate_up_proj`` (E, 2F, D) and ``down_proj`` (E, D, F) are the expert parameters (dim 0 = expert,
    sharded ``Shard(0)`` over ep). ``proj_names`` and ``act_fn`` remember the original layout.
    """

    def __init__(self, gate_up_EFD: Tensor, down_EDF: Tensor, act_fn: nn.Module, proj_names: tuple[str, ...]):
        super().__init__()
        self.num_experts = gate_up_EFD.shape[0]
        self.gate_up_proj = nn.Parameter(gate_up_EFD, requires_grad=gate_up_EFD.requires_grad)
        self.down_proj = nn.Parameter(down_EDF, requires_grad=down_EDF.requires_grad)
        self.act_fn = act_fn
        self.proj_names = proj_names

    def forward(self, x_SD: Tensor, tokens_per_local_expert: Tensor) -> Tensor:
        """Rows of ``x_SD`` grouped by this rank's local experts -> their outputs (S, D)."""
        return grouped_swiglu(
            x_SD,
            tokens_per_local_expert,
            local_tensor(self.gate_up_proj),
            local_tensor(self.down_proj),
            apply_gate=glu_gate(self.act_fn),
        )


# ---------------------------------------------------------------------------------------------
# Stacking (apply time) and unstacking (checkpoints)
# ---------------------------------------------------------------------------------------------


def _proj_names(module: nn.Module, structure: dict) -> tuple[str, str, str]:
    """(gate, up, down) projection names the detector proved, e.g. ``gate_proj,up_proj,down_proj``."""
    names = tuple(structure.get("expert_projs", "").split(","))
    if len(names) != 3 or not all(names):
        reason = f"structure.expert_projs={structure.get('expert_projs')!r}; expected 'gate,up,down' names"
        raise UnsupportedModuleStructure(type(module).__name__, reason)
    return names


def _act_fn(module: nn.Module, structure: dict) -> nn.Module:
    """The experts' activation the detector proved: their own ``act_fn`` module, or ``F.silu``."""
    act = structure.get("expert_act")
    if act == "silu":
        return nn.SiLU()
    if act != "act_fn":
        reason = f"structure.expert_act={act!r}; expected act_fn or silu"
        raise UnsupportedModuleStructure(type(module).__name__, reason)
    act_fn = module.experts[0].act_fn
    if any(True for _ in act_fn.parameters()):
        # A learnable activation would be a dense parameter under `experts`, which is sharded as expert.
        raise UnsupportedModuleStructure(type(module).__name__, "the experts' act_fn has parameters")
    return act_fn


def stack_module_list_experts(module: nn.Module, *, structure: dict) -> None:
    """Replace ``module.experts`` (a ModuleList of SwiGLU experts) by ``StackedSwiGLUExperts``.

    Works on meta (no allocation beyond the stacked tensors' own). Idempotent: already stacked
    experts are left alone. ``structure`` supplies ``expert_projs`` and ``expert_act`` as the
    detector proved them; biased or non-Linear projections raise ``UnsupportedModuleStructure``.
    """
    experts = module.experts
    if isinstance(experts, StackedSwiGLUExperts):
        return
    names = _proj_names(module, structure)
    for e, expert in enumerate(experts):
        for n in names:
            lin = getattr(expert, n, None)
            if type(lin) is not nn.Linear or lin.bias is not None:
                reason = f"experts[{e}].{n} is not a bias-free nn.Linear"
                raise UnsupportedModuleStructure(type(module).__name__, reason)
            if isinstance(lin.weight, DTensor):
                raise UnsupportedModuleStructure(
                    type(module).__name__, "ModuleList experts are already DTensors; stack them before sharding"
                )
    gate, up, down = names
    # Layout change, once: [gate | up] along the output dim, then experts along a new dim 0.
    with torch.no_grad():
        gate_up_EFD = torch.stack([torch.cat([getattr(x, gate).weight, getattr(x, up).weight]) for x in experts])
        down_EDF = torch.stack([getattr(x, down).weight for x in experts])
    grad = any(p.requires_grad for p in experts.parameters())
    module.experts = StackedSwiGLUExperts(
        gate_up_EFD.requires_grad_(grad), down_EDF.requires_grad_(grad), _act_fn(module, structure), names
    )


def _full(t: Tensor) -> Tensor:
    # NOTE: collective over ep for a DTensor (all-gather of the expert shards); every ep rank must call.
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if full_tensor is not None else t


def unstack_module_list_experts(module: nn.Module, *, grad: bool = False) -> dict[str, Tensor]:
    """The stacked experts (or, ``grad=True``, their gradients) in the model's own ModuleList layout:
    ``{"experts.{e}.{gate_proj|up_proj|down_proj}.weight": full tensor}`` relative to the block.

    Gathers the expert shards (a collective: every rank of the ep group must call it).
    """
    experts: StackedSwiGLUExperts = module.experts
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if grad:
        gate_up, down = gate_up.grad, down.grad
    gate_up_EFD, down_EDF = _full(gate_up).detach(), _full(down).detach()
    gate, up, down_name = experts.proj_names
    F_ = down_EDF.shape[-1]
    out = {}
    for e in range(experts.num_experts):
        out[f"experts.{e}.{gate}.weight"] = gate_up_EFD[e, :F_]
        out[f"experts.{e}.{up}.weight"] = gate_up_EFD[e, F_:]
        out[f"experts.{e}.{down_name}.weight"] = down_EDF[e]
    return out


def _stacked_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """``{state-dict key prefix of the block: block}`` for every block whose experts this recipe stacked."""
    blocks = {}
    for name, sub in model.named_modules():
        if isinstance(sub, StackedSwiGLUExperts):
            parent = name.rpartition(".")[0]
            blocks[f"{parent}." if parent else ""] = model.get_submodule(parent)
    return blocks


def module_list_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with every stacked block's experts back in the model's own ModuleList
    layout (full tensors): what a checkpoint in the model's own format holds. A collective over ep."""
    blocks = _stacked_blocks(model)
    state = {
        k: v for k, v in model.state_dict().items() if not any(k.startswith(p + "experts.") for p in blocks)
    }
    for prefix, block in blocks.items():
        state.update({prefix + k: v for k, v in unstack_module_list_experts(block).items()})
    return state


def load_module_list_state_dict(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Fill every stacked block's experts (this rank's shard) from a state dict in the model's own
    layout; return the remaining entries for ``model.load_state_dict(rest, strict=False)``."""
    rest = dict(state)
    for prefix, block in _stacked_blocks(model).items():
        mine = {k[len(prefix) :]: rest.pop(k) for k in list(rest) if k.startswith(prefix + "experts.")}
        load_module_list_experts(block, mine)
    return rest


def load_module_list_experts(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy ModuleList-layout expert weights (keys as ``unstack_module_list_experts`` writes them)
    into the stacked parameters; a sharded parameter takes only this rank's experts."""
    experts: StackedSwiGLUExperts = module.experts
    gate, up, down = experts.proj_names
    weight = [{n: state[f"experts.{e}.{n}.weight"] for n in (gate, up, down)} for e in range(experts.num_experts)]
    gate_up_EFD = torch.stack([torch.cat([w[gate], w[up]]) for w in weight])
    down_EDF = torch.stack([w[down] for w in weight])
    for param, full in ((experts.gate_up_proj, gate_up_EFD), (experts.down_proj, down_EDF)):
        if isinstance(param, DTensor):
            # This rank's slice under the parameter's own placements; local, no communication.
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        with torch.no_grad():
            local_tensor(param).copy_(full)


def shard_stacked_experts(module: nn.Module, ep_mesh) -> None:
    """Make the stacked expert parameters ``Shard(0)`` DTensors over ``ep_mesh`` unless they already are
    (``apply_plan`` shards only parameters registered directly on ``block.experts``; a ModuleList has none)."""
    experts = module.experts
    for name in ("gate_up_proj", "down_proj"):
        param = getattr(experts, name)
        if ep_mesh is not None and not isinstance(param, DTensor):
            setattr(experts, name, shard_expert_tensor(param, ep_mesh, name=f"{type(module).__name__}.experts.{name}"))


# ---------------------------------------------------------------------------------------------
# Routing, as the block's own forward computes it
# ---------------------------------------------------------------------------------------------


def _explicit(module: nn.Module, name: str):
    """``name`` on the module, else on its ``config``; None where neither sets it."""
    value = getattr(module, name, None)
    if value is None and getattr(module, "config", None) is not None:
        value = getattr(module.config, name, None)
    return value


def _required(module: nn.Module, names: tuple[str, ...], what: str):
    for name in names:
        value = _explicit(module, name)
        if value is not None:
            return value
    raise UnsupportedModuleStructure(
        type(module).__name__, f"{what}: none of {', '.join(names)} is set on the module or its config"
    )


@dataclass(frozen=True)
class Routing:
    """The routing facts of one block, read once at apply time from the module and its config."""

    kind: str  # softmax_topk | sigmoid_group
    top_k: int
    normalize: bool  # renormalise the top-k weights to sum to 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1

    @classmethod
    def of(cls, module: nn.Module, structure: dict) -> Routing:
        kind, norm = structure["router"], structure.get("topk_norm", "always")
        if kind not in ("softmax_topk", "sigmoid_group"):
            reason = f"structure.router={kind!r} is not a bare-gate router"
            raise UnsupportedModuleStructure(type(module).__name__, reason)
        if norm not in ("always", "never", "norm_topk_prob"):
            raise UnsupportedModuleStructure(type(module).__name__, f"structure.topk_norm={norm!r} for a bare gate")
        normalize = norm == "always" or (norm == "norm_topk_prob" and bool(_explicit(module, "norm_topk_prob")))
        top_k = int(_required(module, TOP_K_NAMES, "top-k"))
        if kind == "softmax_topk":
            return cls(kind, top_k, normalize)
        return cls(
            kind,
            top_k,
            normalize,
            float(_required(module, ("routed_scaling_factor",), "sigmoid_group")),
            int(_required(module, ("n_group",), "sigmoid_group")),
            int(_required(module, ("topk_group",), "sigmoid_group")),
        )


def _correction_bias(module: nn.Module) -> Tensor | None:
    # Read per call: aux-loss-free balancing updates the bias during training.
    for owner in (module, module.gate):
        bias = getattr(owner, "e_score_correction_bias", None)
        if bias is not None:
            return bias
    return None


def route_softmax_topk(logits_TE: Tensor, r: Routing, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Mixtral / Qwen2-MoE: softmax in fp32, top-k, optional renormalisation, cast to ``dtype``."""
    weights_TE = F.softmax(logits_TE, dim=1, dtype=torch.float)
    top_k_weights_TK, top_k_index_TK = torch.topk(weights_TE, r.top_k, dim=-1)
    if r.normalize:
        top_k_weights_TK = top_k_weights_TK / top_k_weights_TK.sum(dim=-1, keepdim=True)
    return top_k_index_TK, top_k_weights_TK.to(dtype)


def route_sigmoid_group(logits_TE: Tensor, r: Routing, bias_E: Tensor | None) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3: sigmoid scores; top-k among the best ``topk_group`` of ``n_group`` groups chosen on
    bias-corrected scores; weights from the un-biased scores, optionally renormalised, scaled."""
    scores_TE = logits_TE.sigmoid()
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E
    T, E = choice_TE.shape
    group_scores_TG = choice_TE.view(T, r.n_group, E // r.n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores_TG, k=r.topk_group, dim=-1, sorted=False)[1]
    group_mask_TG = torch.zeros_like(group_scores_TG).scatter_(1, group_idx, 1)
    score_mask_TE = group_mask_TG.unsqueeze(-1).expand(T, r.n_group, E // r.n_group).reshape(T, E)
    masked_TE = choice_TE.masked_fill(~score_mask_TE.bool(), 0.0)
    top_k_index_TK = torch.topk(masked_TE, k=r.top_k, dim=-1, sorted=False)[1]
    top_k_weights_TK = scores_TE.gather(1, top_k_index_TK)
    if r.normalize:
        top_k_weights_TK = top_k_weights_TK / (top_k_weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return top_k_index_TK, top_k_weights_TK * r.routed_scaling_factor


# ---------------------------------------------------------------------------------------------
# The block forward and the factory
# ---------------------------------------------------------------------------------------------


def _shared_output(module: nn.Module, x_TD: Tensor, kind: str) -> Tensor | None:
    if kind == "gated":
        return F.sigmoid(module.shared_expert_gate(x_TD)) * module.shared_expert(x_TD)
    if kind == "additive":
        return module.shared_experts(x_TD)
    return None


def ep_block_forward(module: nn.Module, hidden_states: Tensor, *, routing: Routing, structure: dict, ep_group):
    """The block's own computation with the routed experts exchanged over ``ep_group``."""
    shape = hidden_states.shape
    jitter_noise = getattr(module, "jitter_noise", 0.0) if structure.get("jitter") else 0.0
    if module.training and jitter_noise > 0:
        # Same RNG draw (shape, order) as the block's own forward, so the same seed gives the same noise.
        hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - jitter_noise, 1.0 + jitter_noise)
    x_TD = hidden_states.reshape(-1, shape[-1])
    router_logits_TE = module.gate(x_TD)
    if routing.kind == "softmax_topk":
        top_k_index_TK, top_k_weights_TK = route_softmax_topk(router_logits_TE, routing, x_TD.dtype)
    else:
        top_k_index_TK, top_k_weights_TK = route_sigmoid_group(router_logits_TE, routing, _correction_bias(module))
    out_TD = ep_experts_forward(
        x_TD,
        top_k_index_TK,
        top_k_weights_TK,
        num_experts=module.experts.num_experts,
        ep_group=ep_group,
        expert_fn=module.experts,
    )
    shared_TD = _shared_output(module, x_TD, structure.get("shared_experts", "none"))
    if shared_TD is not None:
        out_TD = out_TD + shared_TD
    out = out_TD.reshape(shape)
    return (out, router_logits_TE) if structure.get("returns_router_logits") else out


def ep_module_list_block(module: nn.Module, *, ep_mesh, structure: dict | MoeStructure) -> None:
    """Make a v4-style block EP-ready in place (factory contract: ``autoep.recipes``).

    Stacks the experts, shards them ``Shard(0)`` over ``ep_mesh`` (``None``: no exchange; ``PlanError``
    where ep_size does not divide the expert count), and binds a forward computing exactly the block's
    own routing, jitter, experts and shared branch, with the block's own return structure.
    """
    structure = structure.as_dict() if isinstance(structure, MoeStructure) else dict(structure)
    stack_module_list_experts(module, structure=structure)
    shard_stacked_experts(module, ep_mesh)
    routing = Routing.of(module, structure)
    # An instance attribute shadows the class forward; nn.Module.__call__ (and its hooks) still run.
    module.forward = functools.partial(
        ep_block_forward, module, routing=routing, structure=structure, ep_group=ep_group_of(ep_mesh)
    )
