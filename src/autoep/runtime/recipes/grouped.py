"""Recipe for blocks whose experts take rows already sorted by expert:
``experts(x_SD sorted by expert, num_tokens_per_expert_E) -> y_SD`` (torchtitan/torchtune
``GroupedExperts``, transformers 4.x Aria's ``AriaGroupedExpertsMLP``).

The block's own forward runs unchanged (routing, sorting, scores before or after the experts, the
scatter back, shared experts); only ``block.experts.forward`` is replaced. The rows of group e (the
``counts[e]`` contiguous rows at offset ``cumsum``) go to the rank owning expert e, are computed there
in grouped form with the proven SwiGLU (``autoep.detect.grouped_proof``), and come back in place: each row
is a (token, expert) pair with weight 1 and top_k 1 for the shared token exchange. A projection the experts apply
through their own per-group autograd Function (ScatterMoE's ``ParallelLinear.apply(x, counts, W)``) runs that
Function on the owner, on the local weight slice and local counts: its forward and hand-written backward are the
model's own.

Shape legend: S rows passed to the experts, R rows the counts cover (sum of counts), D hidden, F
expert intermediate size, E routed experts, L local experts.

Parameters: every expert weight (also on nested submodules, ``experts.fc1.weight``) becomes a
``Shard(0)`` DTensor over ``ep`` under its own name, so checkpoints keep the model's layout.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from autoep.detect.grouped_proof import GroupedProof, grouped_proof
from autoep.detect.structure import MoeStructure
from autoep.runtime.adapters import check_parametrizations, local_weight, parameter
from autoep.runtime.checkpointing import guard_checkpointing
from autoep.runtime.dispatch import ep_experts_forward
from autoep.runtime.experts import glu_gate, grouped_linear, grouped_swiglu
from autoep.runtime.recipes import (
    bind_experts_forward,
    ep_group_of,
    join_backward_exchanges,
    proven_experts,
    shard_weights_at,
    watching_facts,
    watching_under,
)
from autoep.runtime.shared import AppliedSpec


@dataclass(frozen=True)
class _EpGrouped(AppliedSpec):
    """What the replaced experts forward needs, fixed at apply time (weights by path, never by object:
    a deep copy of the block must run its own weights)."""

    proof: GroupedProof
    ep_group: object
    signature: inspect.Signature  # of the experts' own forward: the replacement binds its arguments by it


def ep_grouped_experts(module: nn.Module, *, ep_mesh=None, structure: dict | MoeStructure) -> None:
    """Shard the expert weights and bind the EP experts forward on ``module.experts`` (factory contract:
    ``autoep.runtime.recipes``)."""
    with watching_facts(module):
        proof = validate(module, structure=structure)
    watching_under(module, "experts")  # and at the experts' replaced call, after every hook
    experts = module.experts
    own_forward = type(experts).forward
    shard_grouped_weights(experts, proof, ep_mesh, name=type(module).__name__)
    bind_experts_forward(experts, _EpGrouped(proof, ep_group_of(ep_mesh), inspect.signature(own_forward)), _ep_forward)
    join_backward_exchanges(module, ep_mesh)
    guard_checkpointing(module, ep_mesh)


def validate(module: nn.Module, *, structure: dict | MoeStructure, **_) -> GroupedProof:
    """Resolve-time check (an explicit ``_target_`` included) that this recipe computes what ``module``'s
    experts compute: their forward is proven and its layout facts are the ones given."""
    return proven_experts(module, structure, grouped_proof, recipe="grouped",
                          needs="an experts module called as experts(x_sorted, num_tokens_per_expert)")


def shard_grouped_weights(experts: nn.Module, proof: GroupedProof, ep_mesh, *, name: str) -> None:
    """Make each expert weight a ``Shard(0)`` DTensor over ``ep_mesh`` where it lives (``shard_weights_at``)."""
    shard_weights_at(experts, (proof.gate, proof.up, proof.down), ep_mesh, name=name)


def _ep_forward(self: nn.Module, *args, **kwargs) -> Tensor:
    spec: _EpGrouped = self._autoep_ep
    proof = spec.proof
    check_parametrizations(self)  # before any parameter is read (PEFT's LoRA: ``local_weight``)
    # Bound exactly as the experts' own forward binds them: unknown keywords fail as they would there.
    bound = spec.signature.bind(self, *args, **kwargs)
    x_SD, counts = bound.arguments[proof.x], bound.arguments[proof.counts]
    counts_E, routed = _group_sizes(self, proof, x_SD, counts)
    E = proof.num_experts
    # One (token, expert) pair per row: its group's expert, weight 1 (the block applies its own scores).
    expert_of_row_R1 = torch.repeat_interleave(torch.arange(E, device=x_SD.device), counts_E, output_size=routed)
    ones_R1 = torch.ones((routed, 1), dtype=torch.float32, device=x_SD.device)
    y_RD = ep_experts_forward(
        x_SD[:routed], expert_of_row_R1.unsqueeze(1), ones_R1, num_experts=E, ep_group=spec.ep_group,
        expert_fn=lambda x, tokens_per_local_expert: _local_experts(self, proof, x, tokens_per_local_expert),
        out_dtype="experts",  # as their own forward returns them (the autocast dtype under autocast)
    )
    if routed == x_SD.shape[0]:
        return y_RD
    # Rows past the groups (offset loops only, see _group_sizes): the experts' own loop leaves them zero.
    return torch.cat([y_RD, y_RD.new_zeros((x_SD.shape[0] - routed, y_RD.shape[1]))])


def _group_sizes(experts: nn.Module, proof: GroupedProof, x_SD, counts) -> tuple[Tensor, int]:
    """The rows each of the E experts computes (groups in order from row 0) and how many rows they cover,
    as the experts' own loops read ``counts``; raises where their forward raises or would compute
    something the exchange does not (negative counts)."""
    weight = parameter(experts, proof.down)
    if not isinstance(x_SD, Tensor) or x_SD.dim() != 2 or x_SD.dtype != weight.dtype:
        raise ValueError(f"grouped experts got rows {getattr(x_SD, 'shape', x_SD)!r}; they need a 2-D tensor of "
                         f"their weights' dtype {weight.dtype}")
    if not isinstance(counts, Tensor) or counts.dim() != 1 or counts.is_floating_point() or counts.is_complex() \
            or counts.dtype == torch.bool:
        raise ValueError(f"grouped experts got {proof.counts}={counts!r}; they need a 1-D integer tensor")
    E, rows, loops = proof.num_experts, x_SD.shape[0], proof.loops
    split = bool(loops & {"split", "split_head"})
    # NOTE: .tolist() syncs the host once per layer for the group sizes (the experts' own forward syncs
    # for them too: counts.tolist() or counts.cpu()).
    given = counts.tolist()
    if min(given, default=0) < 0 or len(given) > E and split or len(given) < E and "offsets" in loops:
        raise ValueError(f"grouped experts got {len(given)} {proof.counts} (min {min(given, default=0)}) for {E} "
                         f"experts; their forward needs non-negative counts, {_how_many(split, loops)}")
    if proof.functions and len(given) != E:
        # the experts' own Function's backward stacks one weight gradient per group: autograd refuses fewer than E
        raise ValueError(f"grouped experts got {len(given)} {proof.counts} for {E} experts; their autograd Function "
                         f"({', '.join(sorted({u.cls.__qualname__ for u in proof.functions.values()}))}) needs one "
                         f"per expert (its backward returns a weight gradient per group)")
    # torch.split raises unless the counts add up to the rows it splits (all, or x[:sum(counts)])
    if "split" in loops and sum(given) != rows or "split_head" in loops and sum(given) > rows:
        raise ValueError(f"grouped experts got {proof.counts} summing to {sum(given)} for {rows} rows")
    sizes = given + [0] * (E - len(given))  # split loop: experts past the groups get no rows
    if "offsets" in loops:
        # The offset loop reads the first E counts; its row slices stop at the last row.
        offsets = [min(o, rows) for o in itertools.accumulate(given[:E], initial=0)]
        sizes = [b - a for a, b in zip(offsets, offsets[1:])]
    # NOTE: host-to-device copy of E sizes (layout of the exchange).
    return torch.tensor(sizes, dtype=torch.long, device=x_SD.device), sum(sizes)


def _how_many(split: bool, loops: frozenset) -> str:
    if "offsets" not in loops:
        return "at most one per expert"
    return "one per expert" if split else "at least one per expert"


def _local_experts(experts: nn.Module, proof: GroupedProof, x_SD: Tensor, tokens_per_local_expert: Tensor) -> Tensor:
    """What the experts' forward computes for this rank's experts, rows grouped by local expert: the proven
    SwiGLU, times their own dense per-feature scale where their forward multiplies its output by one."""
    y_SD = _local_swiglu(experts, proof, x_SD, tokens_per_local_expert)
    # NOTE: the scale is dense (replicated): its gradient here covers the rows this rank computed, for every
    # rank's tokens; summed over ranks (dense gradients are), it is the model's
    return y_SD * experts.get_parameter(proof.scale) if proof.scale else y_SD


def _local_swiglu(experts: nn.Module, proof: GroupedProof, x_SD: Tensor, tokens_per_local_expert: Tensor) -> Tensor:
    """The proven SwiGLU on this rank's experts, rows grouped by local expert."""
    act = experts.get_submodule(proof.act) if isinstance(proof.act, str) else proof.act
    if proof.functions:
        return _local_swiglu_own_functions(experts, proof, act, x_SD, tokens_per_local_expert)
    down_LDF = local_weight(experts, proof.down)
    if proof.gate == proof.up:  # one fused weight, chunked [gate | up]
        gate_up = local_weight(experts, proof.gate)
        return grouped_swiglu(x_SD, tokens_per_local_expert, gate_up, down_LDF, transposed=proof.transposed,
                              apply_gate=glu_gate(act))
    as_lio = (lambda w: w) if proof.transposed else (lambda w: w.transpose(-2, -1))  # noqa: E731 - (L, in, out)
    gate_SF = grouped_linear(x_SD, tokens_per_local_expert, as_lio(local_weight(experts, proof.gate)))
    up_SF = grouped_linear(x_SD, tokens_per_local_expert, as_lio(local_weight(experts, proof.up)))
    return grouped_linear(act(gate_SF) * up_SF, tokens_per_local_expert, as_lio(down_LDF))


def _local_swiglu_own_functions(experts: nn.Module, proof: GroupedProof, act, x_SD: Tensor,
                                tokens_per_local_expert: Tensor) -> Tensor:
    """The proven SwiGLU where the experts apply their weights through their own per-group autograd Function:
    that Function runs here, forward and hand-written backward, on the local weight slice and the local counts
    (proven per-group: ``autoep.detect.autograd_functions``); the products and activation as proven."""

    def linear(rows_SI: Tensor, path: str) -> Tensor:
        weight = local_weight(experts, path)
        use = proof.functions.get(path)
        if use is None:  # applied by the experts' own code: the grouped GEMM in its proven layout
            as_lio = (lambda w: w) if proof.transposed else (lambda w: w.transpose(-2, -1))  # noqa: E731
            return grouped_linear(rows_SI, tokens_per_local_expert, as_lio(weight))
        given = {"x": rows_SI, "counts": tokens_per_local_expert, "weight": weight}
        return use.cls.apply(*(given[role] for role in use.roles))

    if proof.gate == proof.up:  # one fused weight, chunked [gate | up]
        gate_SF, up_SF = linear(x_SD, proof.gate).chunk(2, dim=-1)
    else:
        gate_SF, up_SF = linear(x_SD, proof.gate), linear(x_SD, proof.up)
    return linear(act(gate_SF) * up_SF, proof.down)
