"""Recipe for experts containers whose own forward is the expert loop (``autoep.detect.container_loop``:
transformers 5.x Switch Transformers' and NLLB-MoE's ``ModuleDict`` subclasses).

The block's forward runs as written (routing, capacity, the call of its experts, the output shape); only the
container's forward is replaced, by the token exchange and each local expert's own forward on its rows
(``autoep.runtime.recipes.local_experts``: the container keeps every expert module, parameter names and
``state_dict()`` keys stay the model's own, e.g. ``experts.expert_0.wi.weight``; other ranks' experts are
``meta`` stand-ins). The container is where the experts are placed (``spec_of(container)``, path ``""``).

The replacement binds its arguments by the container's own signature and computes what its proven loop
computes: ``sum`` over the routed (token, slot) pairs of ``w[t, k] * expert_e(x[t])``, in its accumulator's
dtype. Routing given as expert ids (``one_hot(ids).permute(...)``) goes to the exchange as it is; routing
given as a (T, K, E) dispatch mask is turned into ids exactly as the loop reads it, for any mask: the
experts it hits are those whose mask sum is > 0, each nonzero entry of a hit expert is one routed
(token, slot, expert) triple (a slot with none adds nothing: a token over Switch's capacity gets 0; a slot
with several gets one id per entry, its weight repeated).

Shape legend: T tokens, K slots of the routing argument, E experts, M the most experts one slot meets, D hidden.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoep.detect import routing_proof, sharing
from autoep.detect.container_loop import ContainerLoop, container_loop, has_own_loop
from autoep.detect.experts_proof import BatchedRoles, experts_forward
from autoep.detect.source import Refusal
from autoep.detect.structure import MoeStructure, own_loop_facts
from autoep.errors import UnsupportedModuleStructure
from autoep.runtime.dispatch import ep_experts_forward
from autoep.runtime.recipes import (
    as_structure,
    bind_experts_forward,
    experts_of,
    join_backward_exchanges,
    watching_facts,
    watching_folded,
    watching_under,
)
from autoep.runtime.recipes.local_experts import GROUP, local_expert_fn, local_idle, place_experts, spec_of
from autoep.runtime.shared import AppliedSpec

_LAYOUT_DIMS = {"EKT": (2, 1, 0), "ETK": (2, 0, 1)}


@dataclass(frozen=True)
class _EpContainer(AppliedSpec):
    """What the replaced container forward needs, fixed at apply time."""

    signature: inspect.Signature  # of the container's own forward: the replacement binds its arguments by it
    roles: BatchedRoles
    mask_dims: tuple[int, ...] | None  # the loop's permute of its dispatch-mask argument; None: expert ids


def ep_container_experts(module: nn.Module, *, ep_mesh, structure: dict | MoeStructure, fast_path: bool = True) -> None:
    """Make a block whose experts container loops over itself EP-ready in place (factory contract:
    ``autoep.runtime.recipes``; reached through ``module_list.ep_module_list_block``)."""
    with watching_facts(module):  # the container's folded numbers (its expert count, NLLB's token dropout)
        loop = validate(module, structure=structure)
    container = experts_of(module, structure)
    place_experts(container, path="", num_experts=loop.num_experts, identity_experts=0, ep_mesh=ep_mesh,
                  swiglu=None, act="", fast_path=fast_path, name=type(module).__name__)
    join_backward_exchanges(module, ep_mesh)
    watching_folded(module, as_structure(structure).folded)  # e.g. an expert's dropout proven idle in eval
    watching_under(module, as_structure(structure).experts_path)  # and at the container's call, after hooks
    spec = _EpContainer(inspect.signature(experts_forward(type(container))), loop.roles,
                        _LAYOUT_DIMS[loop.layout] if loop.mask else None)
    bind_experts_forward(container, spec, _ep_forward)


def validate(module: nn.Module, *, structure: dict | MoeStructure, **_) -> ContainerLoop:
    """Resolve-time check (an explicit ``_target_`` included) that this recipe computes what ``module``
    computes: the block calls its container once, the container's forward is the proven loop, its experts are
    proven row-local, and the given expert facts are the proven ones."""
    structure = structure.as_dict() if isinstance(structure, MoeStructure) else dict(structure)
    name, path = type(module).__name__, structure.get("experts_path", "experts")
    container = module._modules.get(path)
    if spec_of(container) is not None:
        raise UnsupportedModuleStructure(name, "the block is already EP-ready (apply_plan ran on it)")
    if not has_own_loop(container):
        raise UnsupportedModuleStructure(name, f"structure.experts_path={path!r} is no ModuleDict/ModuleList subclass "
                                               "with a forward of its own")
    try:
        guards = routing_proof.experts_call(module, path)  # the block's flags its call runs under (watched)
        loop = container_loop(container)
        proven = own_loop_facts(container, path)
        proven["folded"] = proven["folded"] + guards
        tied = sharing.shared_expert_tensors(module, {"": module}, path)
    except Refusal as exc:
        raise UnsupportedModuleStructure(name, str(exc)) from None
    if tied:
        raise UnsupportedModuleStructure(name, f"{tied[0]}: {sharing.SHARING_FIX}")
    for key, value in proven.items():
        given = structure.get(key)
        if (tuple(given) if isinstance(given, list) else given) != value:  # YAML gives the names back as a list
            raise UnsupportedModuleStructure(name, f"structure.{key}={given!r}, but the experts are proven "
                                                   f"{key}={value!r}")
    return loop


def _ep_forward(self: nn.Module, *args, **kwargs) -> Tensor:
    spec: _EpContainer = self._autoep_ep
    # Bound exactly as the container's own forward binds them: unknown keywords fail as they would there.
    bound = spec.signature.bind(self, *args, **kwargs)
    bound.apply_defaults()
    hidden_TD = bound.arguments[spec.roles.hidden]
    routing, weights = bound.arguments[spec.roles.index], bound.arguments[spec.roles.weights]
    placed = spec_of(self)
    if hidden_TD.dim() != 2:  # the loop's zeros_like(hidden).index_add_(0, tok, rows) needs (T, D) hidden states
        raise ValueError(f"{type(self).__name__} got hidden states of shape {tuple(hidden_TD.shape)}; its expert loop "
                         "adds (rows, hidden) into them, so it needs (tokens, hidden)")
    T = hidden_TD.shape[0]
    if spec.mask_dims is not None:
        ids_TK, weights_TK = dispatch_ids(routing, weights, spec.mask_dims, placed.num_experts, T)
    else:
        ids_TK = _rows(routing, T, fill=-1)
        weights_TK = _fit(weights, ids_TK.shape)
    # A slot that routes nowhere adds nothing in the loop, which never reads its weight (it may be inf or nan).
    routed_TK = (ids_TK >= 0) & (ids_TK < placed.num_experts)
    weights_TK = torch.where(routed_TK, weights_TK, torch.zeros_like(weights_TK))
    dtype_of = {"hidden": hidden_TD.dtype, "float32": torch.float32, "weights": weights.dtype}
    return ep_experts_forward(
        hidden_TD,
        ids_TK,
        weights_TK,
        num_experts=placed.num_experts,
        ep_group=getattr(self, GROUP).value if placed.ep_size > 1 else None,
        expert_fn=local_expert_fn(self),
        out_dtype=dtype_of[spec.roles.out_dtype],
        acc_dtype=dtype_of[spec.roles.acc_dtype],  # a narrower accumulator is summed as the loop sums it
        idle=local_idle(self, spec.roles.idle),  # e.g. Switch's loop over the experts hit skips the others
    )


def dispatch_ids(mask: Tensor, weights: Tensor, dims: tuple[int, ...], num_experts: int, T: int) -> tuple[Tensor, Tensor]:
    """``(ids (T, K*M), weights (T, K*M))`` that route exactly the (token, slot, expert) triples the loop over
    ``mask.permute(*dims)`` routes: each nonzero entry of an expert whose mask sum is > 0 (the loop's
    ``greater(sum, 0)``, computed the same way), at most M per slot (ascending expert ids, -1 padding), each
    with its slot's weight. Raises where the loop would: an expert it lacks, a token row it lacks."""
    if mask.dim() != 3:
        raise ValueError(f"the experts' dispatch mask has shape {tuple(mask.shape)}; their loop permutes it as "
                         "(tokens, slots, experts)")
    hit_E = mask.permute(*dims).sum(dim=(-1, -2)) > 0
    nz_TKE = (mask != 0) & hit_E
    E = mask.shape[-1]
    per_slot = nz_TKE.sum(dim=-1).reshape(-1)
    # NOTE: .tolist() syncs the host once per layer: the most experts one slot meets, and whether the mask
    # routes to an expert the container lacks or a token row the hidden states lack (the loop raises there).
    most, missing_expert, missing_row = torch.stack([
        torch.cat([per_slot, per_slot.new_zeros(1)]).max(),
        hit_E[num_experts:].any().long(),
        nz_TKE[T:].any().long(),
    ]).tolist()
    if missing_expert or missing_row:
        what = f"an expert past its {num_experts}" if missing_expert else f"a token past its {T} rows"
        raise RuntimeError(f"the experts' dispatch mask {tuple(mask.shape)} routes to {what}; their own loop "
                           "would fail there")
    nz_TKE = _rows(nz_TKE, T, fill=False)
    M = max(int(most), 1)
    # Layout change: each slot's routed expert ids, ascending, padded with -1 to M per slot.
    order_TKE = torch.where(nz_TKE, torch.arange(E, device=mask.device), torch.full_like(nz_TKE, E, dtype=torch.long))
    ids_TKM = order_TKE.sort(dim=-1).values[..., :M]
    ids_TKM = torch.where(ids_TKM == E, torch.full_like(ids_TKM, -1), ids_TKM)
    K = mask.shape[1]
    weights_TKM = _fit(weights, (T, K)).unsqueeze(-1).expand(T, K, M)
    return ids_TKM.reshape(T, K * M), weights_TKM.reshape(T, K * M)


def _rows(t: Tensor, T: int, fill) -> Tensor:
    """``t`` with exactly T rows: rows past T cut (the caller checked none routes), missing ones ``fill``
    (routing nowhere, as the loop's untouched accumulator rows)."""
    if t.shape[0] >= T:
        return t[:T]
    return torch.cat([t, torch.full((T - t.shape[0], *t.shape[1:]), fill, dtype=t.dtype, device=t.device)])


def _fit(weights: Tensor, shape) -> Tensor:
    """The routing weights the loop reads (``w[tok, slot]``) as a ``shape`` (T, K) tensor: entries past it are
    never read, missing ones are zeros (read only by a routed slot, where the loop itself would fail)."""
    if weights.dim() != 2:
        raise ValueError(f"the experts' routing weights have shape {tuple(weights.shape)}; their loop reads "
                         "w[tok, slot, None] of (tokens, slots) weights")
    T, K = shape
    cut = weights[:T, :K]
    return F.pad(cut, (0, K - cut.shape[1], 0, T - cut.shape[0]))
