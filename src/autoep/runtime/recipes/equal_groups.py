"""Recipe for blocks whose experts take E equal groups of rows: ``experts(rows_ND) -> y_ND``, group e
the ``T = N // E`` rows ``[e*T, (e+1)*T)`` (transformers' Llama-4 ``Llama4TextExperts``, proven by
``autoep.detect.equal_groups_proof``).

The block's own forward runs unchanged (its router, the repeat of every token once per expert, the
pre-scale by the router's scores, the sum over experts, the shared expert); only ``block.experts.forward``
is replaced: the rows go through the grouped exchange (``autoep.runtime.dispatch.ep_grouped_forward``, each group
to the rank owning its expert) and come back in place.

Rows sent: where the proven expert is zero at zero with a zero Jacobian there (``zero_at_zero``: a
bias-free SwiGLU whose activation has act(0) == 0), only the rows that are not all zero travel; the others
come back as exact zeros with zero gradients, which is what the experts compute for them. Llama-4
pre-scales every row of an expert a token did not pick by sigmoid(-inf) = 0, so T * top_k rows are sent
instead of T * E (the minimum of the exchange). Otherwise every row is sent.

Shape legend: N rows given (E*T), D hidden, E routed experts, S rows sent.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from autoep.detect.equal_groups_proof import EqualGroupsProof, equal_groups_proof
from autoep.detect.structure import MoeStructure
from autoep.runtime.adapters import check_parametrizations, parameter
from autoep.runtime.checkpointing import guard_checkpointing
from autoep.runtime.dispatch import ep_grouped_forward
from autoep.runtime.recipes import (
    bind_experts_forward,
    ep_group_of,
    join_backward_exchanges,
    proven_experts,
    watching_facts,
    watching_under,
)
from autoep.runtime.recipes.grouped import _local_swiglu, shard_grouped_weights
from autoep.runtime.shared import AppliedSpec


@dataclass(frozen=True)
class _EpEqualGroups(AppliedSpec):
    """What the replaced experts forward needs, fixed at apply time (weights by path, never by object)."""

    equal: EqualGroupsProof
    ep_group: object
    signature: inspect.Signature  # of the experts' own forward: the replacement binds its argument by it


def ep_equal_group_experts(module: nn.Module, *, ep_mesh=None, structure: dict | MoeStructure) -> None:
    """Shard the expert weights and bind the EP experts forward on ``module.experts`` (factory contract:
    ``autoep.runtime.recipes``)."""
    with watching_facts(module):
        proof = validate(module, structure=structure)
    watching_under(module, "experts")  # and at the experts' replaced call, after every hook
    experts = module.experts
    own_forward = type(experts).forward
    shard_grouped_weights(experts, proof.grouped, ep_mesh, name=type(module).__name__)
    bind_experts_forward(experts, _EpEqualGroups(proof, ep_group_of(ep_mesh), inspect.signature(own_forward)),
                         _ep_forward)
    join_backward_exchanges(module, ep_mesh)
    guard_checkpointing(module, ep_mesh)


def validate(module: nn.Module, *, structure: dict | MoeStructure, **_) -> EqualGroupsProof:
    """Resolve-time check (an explicit ``_target_`` included) that this recipe computes what ``module``'s
    experts compute: their forward is proven and its layout facts are the ones given."""
    return proven_experts(module, structure, equal_groups_proof, recipe="equal-groups",
                          needs="an experts module called as experts(rows) on num_experts equal groups of rows",
                          facts_of=lambda proof: proof.grouped.facts)


def _ep_forward(self: nn.Module, *args, **kwargs) -> Tensor:
    spec: _EpEqualGroups = self._autoep_ep
    proof = spec.equal.grouped
    check_parametrizations(self)  # before any parameter is read (PEFT's LoRA: ``local_weight`` in grouped's SwiGLU)
    # Bound exactly as the experts' own forward binds it: unknown keywords fail as they would there.
    x = spec.signature.bind(self, *args, **kwargs).arguments[proof.x]
    E, D = _check_rows(self, spec.equal, x)
    x_ND = x.reshape(-1, D)
    T = x_ND.shape[0] // E
    expert_fn = lambda x_SD, tokens_per_local_expert: _local_swiglu(self, proof, x_SD, tokens_per_local_expert)  # noqa: E731
    if not spec.equal.zero_at_zero:
        counts_E = torch.full((E,), T, dtype=torch.long, device=x_ND.device)
        return ep_grouped_forward(x_ND, counts_E, num_experts=E, ep_group=spec.ep_group, expert_fn=expert_fn)
    # Only rows that are not all zero travel (see the module docstring: zero rows give exact zeros).
    sent_N = (x_ND != 0).any(dim=-1)
    # NOTE: nonzero() syncs the host once per layer for the number of rows sent.
    rows_S = sent_N.nonzero().squeeze(1)
    counts_E = sent_N.view(E, T).sum(dim=1)
    y_SD = ep_grouped_forward(x_ND.index_select(0, rows_S), counts_E, num_experts=E, ep_group=spec.ep_group,
                              expert_fn=expert_fn)
    # Layout change: the computed rows back in place, zeros elsewhere (their gradient is zero too).
    return y_SD.new_zeros((E * T, D)).index_copy(0, rows_S, y_SD)


def _check_rows(experts: nn.Module, equal: EqualGroupsProof, x) -> tuple[int, int]:
    """(E, D) as the experts' own forward reads them now; raises where that forward raises or would mix
    rows across groups (rows of another width, a group count or width changed since the proof)."""
    proof = equal.grouped
    weight = parameter(experts, proof.down)
    E = proof.num_experts
    D = int(weight.shape[2] if proof.transposed else weight.shape[1])  # down's output width
    now = {_read(experts, s) for s in equal.widths}
    if _read(experts, equal.groups) != E or now - {D}:
        raise ValueError(f"{type(experts).__name__} now views its rows as {_read(experts, equal.groups)} groups of "
                         f"width {sorted(map(repr, now))}; autoep proved {E} groups of width {D} (re-run detection)")
    if not isinstance(x, Tensor) or x.dim() < 2 or x.shape[-1] != D or x.dtype != weight.dtype:
        raise ValueError(f"{type(experts).__name__} got rows {getattr(x, 'shape', x)!r}; they need (N, {D}) "
                         f"rows of their weights' dtype {weight.dtype}")
    if (x.numel() // D) % E:
        raise ValueError(f"{type(experts).__name__} got {x.numel() // D} rows, not a multiple of num_experts={E}")
    return E, D


def _read(experts: nn.Module, source: tuple) -> int:
    """The number the forward reads, read the same way now (a weight's global shape: DTensors included)."""
    if source[0] == "weight":
        return int(parameter(experts, source[1]).shape[source[2]])
    if source[0] == "attr":
        return getattr(experts, source[1])
    return source[1]
