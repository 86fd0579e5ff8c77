"""Recipe for v4-style MoE blocks: routing written in the block, a ``ModuleList`` (or ``ModuleDict``) of expert
modules called in a per-expert loop.

The block's own forward runs: autoep recompiles the method holding the proven expert loop from its own
source, globals and closure with only that loop replaced by a call into ``ep_experts_forward``
(``autoep.detect.splice``). Routing, jitter, scaling, the shared branch, aux losses and the return structure
are the model's own code; this module holds no routing code.

The experts stay the model's own modules (``autoep.runtime.recipes.local_experts``): parameter names and
``state_dict()`` keys are unchanged, each rank keeps its local experts' own parameter objects and holds
``meta`` stand-ins for the others, and after the exchange each local expert's own forward runs on its rows,
or, where the experts are proven bias-free SwiGLUs, the grouped-GEMM fast path on their own weights.

Agreement with ``apply_plan``: it shards only parameters registered directly on ``block.experts``, and a
ModuleList has none, so it shards nothing here; this factory places the experts itself (no communication).

Shape legend: T tokens on this rank, K top-k, D hidden, F expert intermediate size, E routed experts,
S (token, expert) rows grouped by local expert.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch import Tensor

from autoep.detect.module_list_proof import module_list_facts, module_list_plan
from autoep.detect.source import Refusal
from autoep.detect.splice import compile_spliced
from autoep.detect.structure import MoeStructure
from autoep.errors import UnsupportedModuleStructure
from autoep.runtime.dispatch import ep_experts_forward, ep_grouped_forward
from autoep.runtime.recipes import (
    checking_proven,
    ep_group_of,
    experts_of,
    join_backward_exchanges,
    watching_facts,
    watching_folded,
)
from autoep.runtime.recipes.local_experts import _ACTIVATIONS, local_expert_fn, local_idle, place_experts, spec_of
from autoep.runtime.shared import InstanceMethod

# ---------------------------------------------------------------------------------------------
# The spliced expert loop and the factory
# ---------------------------------------------------------------------------------------------


def ep_expert_loop(module: nn.Module, acc: Tensor, x_TD: Tensor, top_k_index_TK: Tensor, top_k_weights_TK: Tensor,
                   *, ep_group, add_at_rows: bool = False, idle: str = "call") -> None:
    """What the block's own expert loop did: ``acc[t] += sum_k w[t, k] * expert_{idx[t, k]}(x[t])`` for
    every id in [0, E) (others, e.g. padding, add nothing), with the experts spread over ``ep_group``; an expert
    without rows is treated as the loop treats it (``idle``: call, skip, touch, or touch only while training)."""
    _check_no_alias(module, acc, x_TD, top_k_index_TK, top_k_weights_TK)
    if add_at_rows:
        _check_each_expert_once(module, top_k_index_TK)
    spec = spec_of(module)
    out_TD = ep_experts_forward(
        x_TD,
        top_k_index_TK,
        top_k_weights_TK,
        num_experts=spec.num_experts,
        ep_group=ep_group,
        expert_fn=local_expert_fn(module),
        out_dtype=torch.float32 if acc.dtype == torch.float32 else acc.dtype,
        acc_dtype=acc.dtype,  # a narrower accumulator is summed as the loop sums it (expert order, rounding)
        idle=local_idle(module, _idle_mode(module, idle)),
    )
    if spec.identity_experts:
        out_TD = out_TD + _identity_experts(module, acc, x_TD, top_k_index_TK, top_k_weights_TK)
    rows_T = torch.arange(top_k_index_TK.shape[0], device=acc.device)
    acc.index_add_(0, rows_T, out_TD.to(acc.dtype))


def _idle_mode(module: nn.Module, idle: str) -> str:
    """``touch_training``: the loop touches an expert without rows only under ``if self.training:``."""
    return ("touch" if module.training else "skip") if idle == "touch_training" else idle


def ep_split_loop(module: nn.Module, rows_SD: Tensor, counts, *, ep_group, empty_1d: bool = False,
                  idle: str = "call") -> Tensor:
    """What the block's argsort/split loop and concatenation did (``autoep.detect.split_loop``): the ``counts[e]``
    contiguous rows of expert e, in expert order, each through its expert, concatenated, with the experts
    spread over ``ep_group``. Python's slicing is kept: slices past the last row are cut short, and rows
    past the last slice are not in the result."""
    E = spec_of(module).num_experts
    counts_C = torch.as_tensor(counts).to(device=rows_SD.device, dtype=torch.long)
    counts_E = _slice_counts(module, counts_C, rows_SD.shape[0], E)
    # The loop calls expert e for each count it iterates (``if n == 0: continue`` skips a zero count), on the
    # rows its slice holds, which may be none.
    visited_E = torch.arange(E, device=rows_SD.device) < counts_C.shape[0]
    if idle == "skip":
        visited_E = visited_E & (torch.cat([counts_C[:E], counts_C.new_zeros(max(E - counts_C.shape[0], 0))]) != 0)
    out_SD = ep_grouped_forward(rows_SD, counts_E, num_experts=E, ep_group=ep_group, expert_fn=local_expert_fn(module),
                                idle=local_idle(module, "call", visited_E))
    if empty_1d and out_SD.shape[0] == 0:
        # The block's own ``rows.new_empty(0)``, as a view of the exchange's output: a rank without rows
        # must stay in the autograd graph, or it would skip the exchange's backward and hang its peers.
        return out_SD.reshape(-1)
    return out_SD


def ep_masked_loop(module: nn.Module, y_SD: Tensor, x_SD: Tensor, ids_S: Tensor, *, ep_group) -> None:
    """What the block's masked-assignment loop did (``split_loop.masked_loop``): ``y[p] =
    expert_{ids[p]}(x[p])`` for every row whose id names an expert (an identity expert: ``x[p]``), other
    rows left as they were, with the experts spread over ``ep_group``."""
    if ids_S.dim() != 1 or x_SD.dim() != 2 or ids_S.shape[0] != x_SD.shape[0]:
        raise RuntimeError(f"{type(module).__name__}: its masked expert loop reads ids {tuple(ids_S.shape)} for "
                           f"rows {tuple(x_SD.shape)}; autoep's exchange needs one id per row of (rows, hidden)")
    _check_no_alias(module, y_SD, x_SD, ids_S)
    spec = spec_of(module)
    E = spec.num_experts
    # ``ids == e`` holds for an integer-valued id of any dtype (2.0 == 2), never for 2.5 or nan.
    ids_long_S = ids_S.long()
    whole_S = ids_long_S == ids_S
    routed_S = whole_S & (ids_long_S >= 0) & (ids_long_S < E)
    send_S1 = torch.where(routed_S, ids_long_S, torch.full_like(ids_long_S, E)).unsqueeze(1)  # E: padding
    ones_S1 = torch.ones((ids_S.shape[0], 1), dtype=torch.float32, device=x_SD.device)
    out_SD = ep_experts_forward(x_SD, send_S1, ones_S1, num_experts=E, ep_group=ep_group,
                                expert_fn=local_expert_fn(module), out_dtype=x_SD.dtype,
                                idle=local_idle(module, "call"))  # the loop calls every expert
    # y * 1.0 in fp32 and back is exact: out_SD holds each routed row's own expert output.
    y_SD[routed_S] = out_SD[routed_S]
    if spec.identity_experts:
        identity_S = whole_S & (ids_long_S >= E) & (ids_long_S < E + spec.identity_experts)
        y_SD[identity_S] = x_SD[identity_S]




def _slice_counts(module: nn.Module, counts_C: Tensor, num_rows: int, E: int) -> Tensor:
    """Rows each expert's slice ``rows[start:start + n]`` really holds (cut at ``num_rows``), one per expert:
    counts past the experts must be zero (the loop would index a missing expert), missing ones are zero."""
    if counts_C.dim() != 1:
        raise RuntimeError(f"{type(module).__name__}: its expert loop iterates row counts of shape "
                           f"{tuple(counts_C.shape)}; autoep needs one count per expert")
    extra = counts_C[E:]
    counts_E = torch.cat([counts_C[:E], counts_C.new_zeros(max(E - counts_C.shape[0], 0))])
    # NOTE: .tolist() syncs the host once per layer: offsets that move backwards have no exchange form.
    lowest, extra_rows = torch.stack([counts_E.min(), extra.abs().sum()]).tolist()
    if lowest < 0 or extra_rows:
        raise RuntimeError(f"{type(module).__name__}: its expert loop's row counts are negative or name "
                           f"experts past its {E}; autoep cannot reproduce those slices")
    ends_E = counts_E.cumsum(0)
    return ends_E.clamp(max=num_rows) - (ends_E - counts_E).clamp(max=num_rows)


def _identity_experts(module: nn.Module, acc: Tensor, x_TD: Tensor, top_k_index_TK: Tensor,
                      top_k_weights_TK: Tensor) -> Tensor:
    """``sum_k w[t, k] * x[t]`` over the slots routed to a trailing ``nn.Identity`` expert, as the loop adds
    them (product in the promoted dtype), computed where the token is (nothing to exchange)."""
    if acc.dtype != torch.float32:
        # The loop would round each identity product into the narrow accumulator in expert order.
        raise RuntimeError(f"{type(module).__name__}: identity experts with a {acc.dtype} accumulator; autoep "
                           "sums identity experts only into a float32 accumulator")
    spec = spec_of(module)
    E = spec.num_experts
    is_identity_TK = (top_k_index_TK >= E) & (top_k_index_TK < E + spec.identity_experts)
    # The loop reads x at the ids' token rows, which are the first T rows (as the exchange does). Copies:
    # the product saves them for backward, and the model may edit its own tensors in place after the loop.
    contrib_TKD = x_TD[: top_k_index_TK.shape[0]].clone().unsqueeze(1) * top_k_weights_TK.clone().unsqueeze(-1)
    # where, not a multiply by the mask: a slot of a computing expert must add nothing, not 0 * x.
    contrib_TKD = torch.where(is_identity_TK.unsqueeze(-1), contrib_TKD, torch.zeros_like(contrib_TKD))
    return contrib_TKD.sum(dim=1).float()


def _check_each_expert_once(module: nn.Module, top_k_index_TK: Tensor) -> None:
    """``acc[tok] += v`` writes a row once even if ``tok`` repeats it; the exchange adds every pair. They
    agree while no token routes to one expert twice (always so for a top-k); otherwise fail loudly."""
    ids_TK = top_k_index_TK.sort(dim=-1).values
    # NOTE: .item() syncs the host once per layer (only for blocks written with ``acc[tok] += ...``).
    if ids_TK.shape[-1] > 1 and bool((ids_TK[:, 1:] == ids_TK[:, :-1]).any().item()):
        raise RuntimeError(f"{type(module).__name__}: a token is routed to the same expert twice; its loop "
                           "(`acc[tok] += ...`) counts such a pair once, which the exchange cannot reproduce")


def _check_no_alias(module: nn.Module, acc: Tensor, *read: Tensor) -> None:
    """The loop added into ``acc`` while reading x, ids and weights; if ``acc`` shared their memory, later
    experts would have read earlier experts' sums, which one exchange cannot reproduce: fail loudly."""
    if acc.device.type == "meta" or acc.numel() == 0:
        return  # nothing to alias (empty tensors of a rank without tokens all report address 0)
    base = acc.untyped_storage().data_ptr()
    if any(t.numel() and t.device.type != "meta" and t.untyped_storage().data_ptr() == base for t in read):
        raise RuntimeError(f"{type(module).__name__}: the expert loop's accumulator shares memory with what the loop "
                           "reads (x, expert ids or weights); autoep cannot run that loop as an exchange")


def ep_module_list_block(module: nn.Module, *, ep_mesh, structure: dict | MoeStructure, fast_path: bool = True) -> None:
    """Make a v4-style block EP-ready in place (factory contract: ``autoep.runtime.recipes``).

    Proves the block's expert loop (refusing what it cannot prove), places the experts (this rank keeps its
    own, the others become ``meta`` stand-ins; ``PlanError`` where ep_size does not divide the expert count;
    ``ep_mesh=None``: no exchange), and binds the block's own method recompiled with only that loop replaced by
    the exchange: routing, jitter, shared branch and return are the model's own code. ``fast_path=False``
    runs the experts' own forward even where the grouped GEMM is proven to compute the same.
    """
    structure = structure.as_dict() if isinstance(structure, MoeStructure) else dict(structure)
    with watching_facts(module):
        plans = validate(module, structure=structure)
    identities = int(structure.get("identity_experts", 0))
    container = experts_of(module, structure)
    place_experts(module, path=structure.get("experts_path", "experts"), num_experts=len(container) - identities,
                  identity_experts=identities,
                  ep_mesh=ep_mesh, swiglu=_swiglu(module, structure), act=str(structure.get("expert_act") or ""),
                  fast_path=fast_path, name=type(module).__name__)
    ep_group = ep_group_of(ep_mesh)
    join_backward_exchanges(module, ep_mesh)
    watching_folded(module, structure.get("folded", ()))  # e.g. an expert's dropout proven idle in eval
    for method in dict.fromkeys(plan.method for plan in plans):
        mine = tuple(plan for plan in plans if plan.method == method)
        # An instance attribute shadows the class method; nn.Module.__call__ (and its hooks) still run. A pickle
        # of the block compiles the method again from the same plans where it is loaded.
        setattr(module, method, InstanceMethod(module, _spliced(mine, ep_group), rebuild=(_spliced, (mine, ep_group))))


def _spliced(plans: tuple, ep_group):
    """The block's method holding ``plans``' regions, recompiled with each region replaced by its exchange."""
    spliced = compile_spliced(list(plans), [checking_proven(_region_fn(plan, ep_group)) for plan in plans])
    if plans[0].no_grad:
        spliced = torch.no_grad()(spliced)  # the method's own (only) decorator, proven by the detector
    return spliced


def _swiglu(module: nn.Module, structure: dict) -> tuple[str, str, str] | None:
    """(gate, up, down) where the grouped-GEMM fast path may run: the experts are proven bias-free SwiGLUs
    (``expert_kind`` "swiglu", three projections, an activation the fast path can apply), else None."""
    names = tuple(structure.get("expert_projs") or ())
    act = structure.get("expert_act")
    if structure.get("expert_kind", "swiglu") != "swiglu" or len(names) != 3 or not all(names):
        return None
    if act == "act_fn":
        act_fn = getattr(next(iter(experts_of(module, structure).children())), "act_fn", None)
        # A learnable activation differs per expert: only their own forwards apply it. A plain function
        # (``self.act_fn = F.silu``) holds nothing. The fast path re-checks every expert's at each call.
        if isinstance(act_fn, nn.Module) and any(True for _ in act_fn.parameters()):
            return None
        return names
    return names if act in _ACTIVATIONS else None


def _region_fn(plan, ep_group):
    """The exchange that replaces one proven region (``SplicePlan.kind``)."""
    if plan.kind == "split":
        return functools.partial(ep_split_loop, ep_group=ep_group, empty_1d=plan.empty_1d, idle=plan.idle)
    if plan.kind == "masked":
        return functools.partial(ep_masked_loop, ep_group=ep_group)
    return functools.partial(ep_expert_loop, ep_group=ep_group, add_at_rows=plan.add_at_rows, idle=plan.idle)


def validate(module: nn.Module, *, structure: dict | MoeStructure, **_):
    """Resolve-time check (an explicit ``_target_`` included) that this recipe computes what ``module``
    computes: its expert loop and every expert are proven, and the given expert facts are the proven
    ones (random draws accepted where ``structure.expert_draws`` records them: ``PlanEntry.expert_draws=on_owner``).
    Returns the splice plans (one per expert region); raises ``UnsupportedModuleStructure`` naming the key otherwise."""
    structure = structure.as_dict() if isinstance(structure, MoeStructure) else dict(structure)
    name = type(module).__name__
    if spec_of(module) is not None:
        raise UnsupportedModuleStructure(name, "the block is already EP-ready (apply_plan ran on it)")
    path = structure.get("experts_path", "experts")
    experts = getattr(module, path, None)
    if type(experts) not in (nn.ModuleList, nn.ModuleDict):
        raise UnsupportedModuleStructure(name, f"the module_list recipe needs a ModuleList/ModuleDict of experts at "
                                               f"structure.experts_path={path!r}")
    try:
        proven = module_list_facts(experts, path, bool(structure.get("expert_draws")))
        plan = module_list_plan(module, path)
    except Refusal as exc:
        raise UnsupportedModuleStructure(name, str(exc)) from None
    for key, value in proven.items():
        given = structure.get(key, () if key == "expert_draws" else None)  # a structure resolved before it: none
        if (tuple(given) if isinstance(given, list) else given) != value:  # YAML gives the names back as a list
            reason = f"structure.{key}={structure.get(key)!r}, but the experts are proven {key}={value!r}"
            raise UnsupportedModuleStructure(name, reason)
    return plan
