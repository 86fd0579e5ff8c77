"""Recipe for v4-style MoE blocks: routing written in the block, a ``ModuleList`` of SwiGLU experts
called in a per-expert loop.

The block's own forward runs: autoep recompiles the method holding the proven expert loop from its own
source, globals and closure with only that loop replaced by a call into ``ep_experts_forward``
(``autoep.detect.splice``). Routing, jitter, scaling, the shared branch, aux losses and the return structure
are the model's own code; this module holds no routing code.

Expert storage changes once, at apply time: the ``ModuleList`` is replaced by ``StackedSwiGLUExperts``
holding ``experts.gate_up_proj`` (E, 2F, D) = [gate | up] and ``experts.down_proj`` (E, D, F), the
transformers v5 names and layout. After apply these stacked parameters are the trained ones (the
per-expert ``experts.{e}.gate_proj.weight`` names no longer exist); their gradients equal the
per-expert gradients of the original layout, stacked. ``unstack_module_list_experts`` writes them
back in the model's own layout for checkpoints; ``load_module_list_experts`` reads that layout in.

Agreement with ``apply_plan``: it shards only parameters registered directly on ``block.experts``, and
a ModuleList has none, so it shards nothing here; this factory stacks the experts and shards the
stacked parameters itself with ``autoep.runtime.apply.shard_expert_tensor`` (local slice, no communication).

Shape legend: T tokens on this rank, K top-k, D hidden, F expert intermediate size, E routed experts,
S (token, expert) rows grouped by local expert.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from autoep.detect.module_list_proof import module_list_facts, module_list_plan
from autoep.detect.source import Refusal
from autoep.detect.splice import compile_spliced
from autoep.detect.structure import MoeStructure
from autoep.errors import UnsupportedModuleStructure
from autoep.runtime.apply import shard_expert_tensor
from autoep.runtime.dispatch import ep_experts_forward, ep_grouped_forward
from autoep.runtime.experts import glu_gate, grouped_swiglu
from autoep.runtime.recipes import ep_group_of, join_backward_exchanges, local_tensor, watching_facts


class StackedSwiGLUExperts(nn.Module):
    """The block's experts stacked once: ``down(act(gate(x)) * up(x))`` per expert, grouped compute.

    ``gate_up_proj`` (E, 2F, D) and ``down_proj`` (E, D, F) are the expert parameters (dim 0 = expert,
    sharded ``Shard(0)`` over ep). ``proj_names`` and ``act_fn`` remember the original layout.
    """

    def __init__(self, gate_up_EFD: Tensor, down_EDF: Tensor, act_fn: nn.Module, proj_names: tuple[str, ...],
                 identity_experts: int = 0):
        super().__init__()
        self.num_experts = gate_up_EFD.shape[0]
        self.identity_experts = identity_experts  # trailing zero-compute experts: ids [E, E + this) add w * x
        self.gate_up_proj = nn.Parameter(gate_up_EFD, requires_grad=gate_up_EFD.requires_grad)
        self.down_proj = nn.Parameter(down_EDF, requires_grad=down_EDF.requires_grad)
        self.act_fn = act_fn
        self.proj_names = proj_names

    def __len__(self) -> int:  # the block's own code may still read len(self.experts)
        return self.num_experts + self.identity_experts

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
    names = tuple(structure.get("expert_projs") or ())
    if len(names) != 3 or not all(names):
        reason = f"structure.expert_projs={structure.get('expert_projs')!r}; expected [gate, up, down] names"
        raise UnsupportedModuleStructure(type(module).__name__, reason)
    return names


_ACT_MODULES = {"silu": nn.SiLU, "relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}


def _act_fn(module: nn.Module, structure: dict) -> nn.Module:
    """The experts' activation the detector proved: their own ``act_fn`` module, or ``F.silu``."""
    act = structure.get("expert_act")
    if act in _ACT_MODULES:
        return _ACT_MODULES[act]()
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
    identities = int(structure.get("identity_experts", 0))
    experts = list(experts)[: len(experts) - identities]
    if any(type(e) is nn.Identity for e in experts) or not all(type(e) is nn.Identity for e in module.experts[len(experts):]):
        reason = f"structure.identity_experts={identities} does not match the trailing nn.Identity experts"
        raise UnsupportedModuleStructure(type(module).__name__, reason)
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
    grad = any(p.requires_grad for x in experts for p in x.parameters())
    module.experts = StackedSwiGLUExperts(
        gate_up_EFD.requires_grad_(grad), down_EDF.requires_grad_(grad), _act_fn(module, structure), names,
        identity_experts=identities,
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
# The spliced expert loop and the factory
# ---------------------------------------------------------------------------------------------


def ep_expert_loop(module: nn.Module, acc: Tensor, x_TD: Tensor, top_k_index_TK: Tensor, top_k_weights_TK: Tensor,
                   *, ep_group, add_at_rows: bool = False) -> None:
    """What the block's own expert loop did: ``acc[t] += sum_k w[t, k] * expert_{idx[t, k]}(x[t])`` for
    every id in [0, E) (others, e.g. padding, add nothing), with the experts spread over ``ep_group``."""
    _check_no_alias(module, acc, x_TD, top_k_index_TK, top_k_weights_TK)
    if add_at_rows:
        _check_each_expert_once(module, top_k_index_TK)
    out_TD = ep_experts_forward(
        x_TD,
        top_k_index_TK,
        top_k_weights_TK,
        num_experts=module.experts.num_experts,
        ep_group=ep_group,
        expert_fn=module.experts,
        out_dtype=torch.float32 if acc.dtype == torch.float32 else acc.dtype,
        acc_dtype=acc.dtype,  # a narrower accumulator is summed as the loop sums it (expert order, rounding)
    )
    if module.experts.identity_experts:
        out_TD = out_TD + _identity_experts(module, acc, x_TD, top_k_index_TK, top_k_weights_TK)
    rows_T = torch.arange(top_k_index_TK.shape[0], device=acc.device)
    acc.index_add_(0, rows_T, out_TD.to(acc.dtype))


def ep_split_loop(module: nn.Module, rows_SD: Tensor, counts, *, ep_group, empty_1d: bool = False) -> Tensor:
    """What the block's argsort/split loop and concatenation did (``autoep.detect.split_loop``): the ``counts[e]``
    contiguous rows of expert e, in expert order, each through its expert, concatenated, with the experts
    spread over ``ep_group``. Python's slicing is kept: slices past the last row are cut short, and rows
    past the last slice are not in the result."""
    E = module.experts.num_experts
    counts_E = _slice_counts(module, torch.as_tensor(counts).to(device=rows_SD.device, dtype=torch.long),
                             rows_SD.shape[0], E)
    out_SD = ep_grouped_forward(rows_SD, counts_E, num_experts=E, ep_group=ep_group, expert_fn=module.experts)
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
    E = module.experts.num_experts
    # ``ids == e`` holds for an integer-valued id of any dtype (2.0 == 2), never for 2.5 or nan.
    ids_long_S = ids_S.long()
    whole_S = ids_long_S == ids_S
    routed_S = whole_S & (ids_long_S >= 0) & (ids_long_S < E)
    send_S1 = torch.where(routed_S, ids_long_S, torch.full_like(ids_long_S, E)).unsqueeze(1)  # E: padding
    ones_S1 = torch.ones((ids_S.shape[0], 1), dtype=torch.float32, device=x_SD.device)
    out_SD = ep_experts_forward(x_SD, send_S1, ones_S1, num_experts=E, ep_group=ep_group,
                                expert_fn=module.experts, out_dtype=x_SD.dtype)
    # y * 1.0 in fp32 and back is exact: out_SD holds each routed row's own expert output.
    y_SD[routed_S] = out_SD[routed_S]
    if module.experts.identity_experts:
        identity_S = whole_S & (ids_long_S >= E) & (ids_long_S < E + module.experts.identity_experts)
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
    E = module.experts.num_experts
    is_identity_TK = (top_k_index_TK >= E) & (top_k_index_TK < E + module.experts.identity_experts)
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


def ep_module_list_block(module: nn.Module, *, ep_mesh, structure: dict | MoeStructure) -> None:
    """Make a v4-style block EP-ready in place (factory contract: ``autoep.runtime.recipes``).

    Proves the block's expert loop (refusing what it cannot prove), stacks the experts, shards them
    ``Shard(0)`` over ``ep_mesh`` (``None``: no exchange; ``PlanError`` where ep_size does not divide the
    expert count), and binds the block's own method recompiled with only that loop replaced by the
    exchange: routing, jitter, shared branch and return are the model's own code.
    """
    structure = structure.as_dict() if isinstance(structure, MoeStructure) else dict(structure)
    with watching_facts(module):
        plans = validate(module, structure=structure)
    stack_module_list_experts(module, structure=structure)
    shard_stacked_experts(module, ep_mesh)
    ep_group = ep_group_of(ep_mesh)
    join_backward_exchanges(module, ep_mesh)
    for method in dict.fromkeys(plan.method for plan in plans):
        mine = [plan for plan in plans if plan.method == method]
        spliced = compile_spliced(mine, [_region_fn(plan, ep_group) for plan in mine])
        if mine[0].no_grad:
            spliced = torch.no_grad()(spliced)  # the method's own (only) decorator, proven by the detector
        # An instance attribute shadows the class method; nn.Module.__call__ (and its hooks) still run.
        setattr(module, method, types.MethodType(spliced, module))


def _region_fn(plan, ep_group):
    """The exchange that replaces one proven region (``SplicePlan.kind``)."""
    if plan.kind == "split":
        return functools.partial(ep_split_loop, ep_group=ep_group, empty_1d=plan.empty_1d)
    if plan.kind == "masked":
        return functools.partial(ep_masked_loop, ep_group=ep_group)
    return functools.partial(ep_expert_loop, ep_group=ep_group, add_at_rows=plan.add_at_rows)


def validate(module: nn.Module, *, structure: dict | MoeStructure, **_):
    """Resolve-time check (an explicit ``_target_`` included) that this recipe computes what ``module``
    computes: its expert loop and every expert are proven, and the given expert facts are the proven
    ones. Returns the splice plans (one per expert region); raises ``UnsupportedModuleStructure`` naming the key otherwise."""
    structure = structure.as_dict() if isinstance(structure, MoeStructure) else dict(structure)
    name = type(module).__name__
    if isinstance(getattr(module, "experts", None), StackedSwiGLUExperts):
        raise UnsupportedModuleStructure(name, "the block is already EP-ready (experts stacked)")
    if not isinstance(getattr(module, "experts", None), nn.ModuleList):
        raise UnsupportedModuleStructure(name, "the module_list recipe needs a ModuleList of experts")
    try:
        proven = module_list_facts(module.experts)
        plan = module_list_plan(module)
    except Refusal as exc:
        raise UnsupportedModuleStructure(name, str(exc)) from None
    for key, value in proven.items():
        given = structure.get(key)
        if (tuple(given) if isinstance(given, list) else given) != value:  # YAML gives the names back as a list
            reason = f"structure.{key}={structure.get(key)!r}, but the experts are proven {key}={value!r}"
            raise UnsupportedModuleStructure(name, reason)
    return plan
