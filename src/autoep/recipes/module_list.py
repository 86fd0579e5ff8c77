"""Recipe for v4-style MoE blocks: routing written in the block, a ``ModuleList`` of SwiGLU experts
called in a per-expert loop.

The block's own forward runs: autoep recompiles the method holding the proven expert loop from its own
source, globals and closure with only that loop replaced by a call into ``ep_experts_forward``
(``autoep.splice``). Routing, jitter, scaling, the shared branch, aux losses and the return structure
are the model's own code; this module holds no routing code.

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
S (token, expert) rows grouped by local expert.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from autoep.apply import shard_expert_tensor
from autoep.dispatch import ep_experts_forward, ep_grouped_forward
from autoep.errors import UnsupportedModuleStructure
from autoep.experts import glu_gate, grouped_swiglu
from autoep.module_list_proof import module_list_facts, module_list_plan
from autoep.recipes import ep_group_of, local_tensor
from autoep.source import Refusal
from autoep.splice import compile_spliced
from autoep.structure import MoeStructure


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

    def __len__(self) -> int:  # the block's own code may still read len(self.experts)
        return self.num_experts

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
    rows_T = torch.arange(top_k_index_TK.shape[0], device=acc.device)
    acc.index_add_(0, rows_T, out_TD.to(acc.dtype))


def ep_split_loop(module: nn.Module, rows_SD: Tensor, counts, *, ep_group, empty_1d: bool = False) -> Tensor:
    """What the block's argsort/split loop and concatenation did (``autoep.split_loop``): the ``counts[e]``
    contiguous rows of expert e, in expert order, each through its expert, concatenated (``sum(counts)``
    rows), with the experts spread over ``ep_group``."""
    E = module.experts.num_experts
    counts_E = torch.as_tensor(counts).to(device=rows_SD.device, dtype=torch.long)
    if counts_E.shape != (E,):
        raise RuntimeError(f"{type(module).__name__}: its expert loop iterates {tuple(counts_E.shape)} row counts "
                           f"for {E} experts; autoep's exchange needs one count per expert")
    # NOTE: .tolist() syncs the host once per layer: the rows the loop would slice must exist.
    lowest, total = torch.stack([counts_E.min(), counts_E.sum()]).tolist()
    if total > rows_SD.shape[0] or lowest < 0:
        raise RuntimeError(f"{type(module).__name__}: its row counts (sum {total}) do not fit its "
                           f"{rows_SD.shape[0]} sorted rows; the loop's slices would not be whole experts")
    out_SD = ep_grouped_forward(rows_SD, counts_E, num_experts=E, ep_group=ep_group, expert_fn=module.experts)
    return rows_SD.new_empty(0) if empty_1d and total == 0 else out_SD


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
    """Make a v4-style block EP-ready in place (factory contract: ``autoep.recipes``).

    Proves the block's expert loop (refusing what it cannot prove), stacks the experts, shards them
    ``Shard(0)`` over ``ep_mesh`` (``None``: no exchange; ``PlanError`` where ep_size does not divide the
    expert count), and binds the block's own method recompiled with only that loop replaced by the
    exchange: routing, jitter, shared branch and return are the model's own code.
    """
    structure = structure.as_dict() if isinstance(structure, MoeStructure) else dict(structure)
    plan = validate(module, structure=structure)
    stack_module_list_experts(module, structure=structure)
    shard_stacked_experts(module, ep_mesh)
    if plan.kind == "split":
        loop = functools.partial(ep_split_loop, ep_group=ep_group_of(ep_mesh), empty_1d=plan.empty_1d)
    else:
        loop = functools.partial(ep_expert_loop, ep_group=ep_group_of(ep_mesh), add_at_rows=plan.add_at_rows)
    # An instance attribute shadows the class method; nn.Module.__call__ (and its hooks) still run.
    setattr(module, plan.method, types.MethodType(compile_spliced(plan, loop), module))


def validate(module: nn.Module, *, structure: dict | MoeStructure, **_):
    """Resolve-time check (an explicit ``_target_`` included) that this recipe computes what ``module``
    computes: its expert loop and every expert are proven, and the given expert facts are the proven
    ones. Returns the splice plan; raises ``UnsupportedModuleStructure`` naming the key otherwise."""
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
        if structure.get(key) != value:
            reason = f"structure.{key}={structure.get(key)!r}, but the experts are proven {key}={value!r}"
            raise UnsupportedModuleStructure(name, reason)
    return plan
