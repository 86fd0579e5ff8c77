"""Recipe for v5-style blocks (a router module or linear gate routing inside the block, batched experts
obeying ``experts(hidden_TD, top_k_index_TK, top_k_weights_TK) -> (T, D)``).

The block's own forward runs unchanged (routing, shared branch, jitter, output shape); only
``block.experts.forward`` is replaced by the token exchange + grouped local compute. The replacement
binds its arguments by the experts' own signature, honours the layout facts the detector proved
(biases, transposed weights, the experts' own gate where their forward calls it), skips padding ids as
their loop does, and equals the experts' proven forward.

Flattened experts (DBRX: ``experts.mlp.w1``/``v1``/``w2`` each ``(E*F, D)``, viewed ``(-1, F, D)`` per
expert) keep their parameters where and as they are: ``Shard(0)`` of the flat dim over ``ep`` gives each
rank whole experts (F rows each, ``ep`` dividing E), so checkpoints keep the model's own layout; the
local shard is viewed ``(L, F, D)`` and computed as the proven ``act(x @ gate[e].T) * (x @ up[e].T) @
down[e]``. Where their forward flattens its hidden states to rows and views the result back, so does this.

A post-expert norm (``MoeStructure.post_expert_norm``: a submodule of the experts that their loop applies
to each expert's output after the down projection, before the routing weight) is the block's own module,
called on the rows this rank computes; its weight stays a dense parameter (``apply_plan`` shards only the
experts' own parameters), so its grads are summed over the world like the router's.
"""

from __future__ import annotations

import contextlib

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from autoep.detect.experts_proof import BatchedRoles, batched_proof, experts_forward
from autoep.detect.flat_experts import FlatLayout
from autoep.detect.structure import MoeStructure
from autoep.detect.training_branch import check_branch, eval_gate
from autoep.errors import LiveStateError, PlanError
from autoep.runtime.adapters import check_parametrizations, local_weight
from autoep.runtime.checkpointing import guard_checkpointing
from autoep.runtime.dispatch import Idle, ep_experts_forward
from autoep.runtime.experts import glu_gate, grouped_split_glu, grouped_swiglu
from autoep.runtime.recipes import (
    as_structure,
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
class _EpExperts(AppliedSpec):
    """What the replaced experts forward needs, fixed at apply time (plain values: a deep copy of the experts
    computes with its own modules, e.g. its own activation)."""

    num_experts: int
    ep_group: object
    transposed: bool
    bias: bool
    activation: str  # MoeStructure.activation: which gate ``_gate_of`` applies ("" flattened experts)
    signature: inspect.Signature  # of the experts' own forward: the replacement binds its arguments by it
    roles: BatchedRoles
    plain: bool  # up -> act -> down experts (``up_proj``), no gate half
    fp32: bool  # the experts compute in float32 whatever their weights' dtype
    post_norm: str = ""  # the experts' submodule applied to each expert's output rows before weighting ("" none)
    sharded: tuple[str, ...] = ()  # the expert parameters apply made Shard(0) DTensors (checked at every call)


def ep_batched_experts(module: nn.Module, *, ep_mesh=None, structure: dict | MoeStructure) -> None:
    """Bind the EP experts forward on ``module.experts`` (factory contract: ``autoep.runtime.recipes``)."""
    facts = as_structure(structure)
    experts = module.experts
    with watching_facts(module):
        roles = validate(module, structure=facts)
    watching_under(module, "experts")  # and at the experts' replaced call, after every hook
    join_backward_exchanges(module, ep_mesh)
    guard_checkpointing(module, ep_mesh)
    own_forward = experts_forward(type(experts))
    if roles.flat is not None:
        shard_flat_experts(experts, roles.flat, ep_mesh, name=type(module).__name__)
        bind_experts_forward(experts, _EpExperts(
            num_experts=roles.flat.num_experts, ep_group=ep_group_of(ep_mesh), transposed=False, bias=False,
            activation="", signature=inspect.signature(own_forward), roles=roles, plain=False, fp32=False,
            sharded=_sharded(experts)), _ep_forward)
        return
    plain = facts.activation == "plain"
    spec = _EpExperts(
        num_experts=int(experts.down_proj.shape[0]),  # global count: a DTensor reports the global shape
        ep_group=ep_group_of(ep_mesh),
        transposed=facts.expert_transposed,
        bias=facts.expert_bias,
        activation=_checked_activation(experts, facts.activation, roles),
        signature=inspect.signature(own_forward),
        roles=roles,
        plain=plain,
        fp32=facts.expert_dtype == "float32",
        post_norm=facts.post_expert_norm,
        sharded=_sharded(experts),
    )
    bind_experts_forward(experts, spec, _ep_forward)


def _sharded(experts: nn.Module) -> tuple[str, ...]:
    return tuple(n for n, p in experts.named_parameters() if isinstance(p, DTensor))


def validate(module: nn.Module, *, structure: dict | MoeStructure, **_) -> BatchedRoles:
    """Resolve-time check (an explicit ``_target_`` included) that this recipe computes what ``module``'s
    experts compute: their forward is proven and its layout facts are the ones given."""
    _, roles = proven_experts(module, structure, batched_proof, recipe="batched",
                              needs="an experts module with 3-D parameters", facts_of=lambda proof: proof[0])
    return roles


def shard_flat_experts(experts: nn.Module, flat: FlatLayout, ep_mesh, *, name: str) -> None:
    """Make each flattened ``(E*F, D)`` weight a ``Shard(0)`` DTensor over ``ep_mesh`` where it lives (local
    slice, no communication): whole experts per rank exactly when ``ep_size`` divides E."""
    if ep_mesh is None:
        return
    ep_size, E = ep_mesh.size(), flat.num_experts
    if E % ep_size:
        divisors = [d for d in range(1, E + 1) if E % d == 0]
        raise PlanError(f"parallel.ep_size={ep_size} does not divide num_experts={E} of {name}; pick one of {divisors}")
    shard_weights_at(experts, (flat.gate, flat.up, flat.down), ep_mesh, name=name)


def _checked_activation(experts: nn.Module, activation: str, roles: BatchedRoles) -> str:
    _gate_of(experts, activation, roles)  # raises at apply where the proven gate cannot be applied
    return activation


def _gate_of(experts: nn.Module, activation: str, roles: BatchedRoles) -> Callable[[Tensor], Tensor]:
    """The gate the proven forward computes: its own ``_apply_gate`` only where it calls it, the element-wise
    expression its loop writes inline (``inline_gate``: computed operation by operation as written), else
    ``act_fn(gate) * up`` on the concatenated halves, as it writes it."""
    if activation == "inline_gate":
        if roles.gate is None:
            raise PlanError(f"{type(experts).__name__}: structure.activation=inline_gate, but its forward's gate "
                            "was not proven inline; re-detect the structure")
        expr, path = roles.gate
        act = experts.get_submodule(path) if path else None
        return lambda h: eval_gate(expr, h, act)
    if activation in ("own_gate", "clamped_glu"):
        return experts._apply_gate
    if activation == "plain":
        return experts.act_fn
    return glu_gate(experts.act_fn)


def _autocast_as_the_kernel(experts: nn.Module, x_SD: Tensor):
    """Autocast as the experts' own kernel sees it: transformers' ``grouped_mm`` implementation runs
    ``torch._grouped_mm``, which CPU autocast does not cast (fp32 rows stay fp32), so there the grouped GEMMs run
    with autocast off; every other kernel (eager ``F.linear``, ``batched_mm``'s ``bmm``) is cast as autocast casts
    it (``autoep.runtime.experts.autocast_operands``). CUDA: as autocast casts (unmeasured, no GPU here)."""
    kernel = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    off = kernel == "grouped_mm" and x_SD.device.type == "cpu" and torch.is_autocast_enabled("cpu")
    return torch.autocast("cpu", enabled=False) if off else contextlib.nullcontext()


def _ep_forward(self: nn.Module, *args, **kwargs):
    spec: _EpExperts = self._autoep_ep
    # Before any parameter is read: reading one runs a parametrization on this rank's shard (PEFT's LoRA, known,
    # is applied per expert by ``local_weight``).
    check_parametrizations(self)
    _check_still_sharded(self, spec)
    # Bound exactly as the experts' own forward binds them: unknown keywords fail as they would there.
    bound = spec.signature.bind(self, *args, **kwargs)
    bound.apply_defaults()
    hidden_states = bound.arguments[spec.roles.hidden]
    top_k_index = bound.arguments[spec.roles.index]
    top_k_weights = bound.arguments[spec.roles.weights]
    if spec.roles.branch:  # raises where their own forward would take its dense branch
        check_branch(self, spec.roles.branch, hidden_states, spec.roles.branch_line)
    if spec.roles.dense_weights:
        top_k_weights = _routed_weights(self, spec, top_k_index, top_k_weights)
    dtype_of = {"hidden": hidden_states.dtype, "float32": torch.float32, "weights": top_k_weights.dtype}
    dtypes = dict(out_dtype=dtype_of[spec.roles.out_dtype], acc_dtype=dtype_of[spec.roles.acc_dtype])
    if spec.roles.flat is not None:
        return _ep_flat_forward(self, spec, hidden_states, top_k_index, top_k_weights, dtypes)

    def expert_fn(x_SD: Tensor, tokens_per_local_expert: Tensor) -> Tensor:
        # float32 experts (their forward upcasts rows and weights): the same upcasts, before the grouped GEMMs.
        cast = (lambda t: t.float()) if spec.fp32 else (lambda t: t)
        with _autocast_as_the_kernel(self, x_SD):
            y_SD = grouped_swiglu(
                cast(x_SD),
                tokens_per_local_expert,
                cast(local_weight(self, "up_proj" if spec.plain else "gate_up_proj")),
                cast(local_weight(self, "down_proj")),
                gate_up_bias=cast(local_weight(self, "gate_up_proj_bias")) if spec.bias else None,
                down_bias=cast(local_weight(self, "down_proj_bias")) if spec.bias else None,
                transposed=spec.transposed,
                apply_gate=_gate_of(self, spec.activation, spec.roles),
            )
        # The experts' own post-expert norm (a dense module, proven row-local): on this rank's rows of all
        # its local experts at once, as their loop applies it to each expert's rows.
        return self.get_submodule(spec.post_norm)(y_SD) if spec.post_norm else y_SD

    roles = spec.roles
    if roles.unpacked and hidden_states.dim() != roles.unpacked:  # their ``b, s, h = hidden.shape`` raises here
        raise ValueError(f"experts got hidden states of shape {tuple(hidden_states.shape)}; their forward unpacks "
                         f"{roles.unpacked} dims")
    hidden_TD = hidden_states.reshape(-1, hidden_states.shape[-1] if roles.rows == -1 else roles.rows) \
        if roles.rows else hidden_states
    out_TD = ep_experts_forward(
        hidden_TD,
        top_k_index,
        top_k_weights,
        num_experts=spec.num_experts,
        ep_group=spec.ep_group,
        expert_fn=expert_fn,
        **dtypes,  # a bf16 accumulator is summed as the loop sums it
        idle=Idle(spec.roles.idle),  # a loop over the experts hit leaves 3-D weights no rank ran without a grad
    )
    out_TD = _like_the_accumulator(out_TD, hidden_TD)
    if roles.view_out == "lead":
        return out_TD.view(hidden_states.shape[0], -1, out_TD.shape[-1])
    return out_TD.reshape(hidden_states.shape) if roles.view_out == "shape" else out_TD


def _check_still_sharded(experts: nn.Module, spec: _EpExperts) -> None:
    """Every expert parameter apply sharded is a shard still: one replaced after apply by a plain tensor
    (``experts.gate_up_proj = nn.Parameter(full)``, a full tensor or any other) would be read as this rank's
    experts. Raised before the exchange, on every rank alike (each replaced it: the same user code)."""
    for name in spec.sharded:
        path, _, attr = name.rpartition(".")
        # Read where it is registered (a parametrized one, PEFT's LoRA, keeps its shard as ``original``: not run).
        p = experts.get_submodule(path)._parameters.get(attr)
        # A plain nn.Parameter is what an assignment puts there; FSDP2 (expert_sharding=fsdp2) holds the experts'
        # unsharded tensors there during the forward, which are no Parameters.
        if isinstance(p, nn.Parameter) and not isinstance(p, DTensor):
            raise LiveStateError(
                f"{type(experts).__name__}.{name} was replaced after apply_plan by a plain tensor of shape "
                f"{tuple(p.shape)}; under expert parallelism each rank holds a Shard(0) slice of it (its own experts), "
                f"which the exchange computes with. Load new values with model.load_state_dict (it cuts a full tensor "
                f"to this rank's slice) or initialise the parameter in place (nn.init.*, drawn as on the model)")


def _routed_weights(self: nn.Module, spec: _EpExperts, top_k_index: Tensor, weights_TE: Tensor) -> Tensor:
    """``w[t, k] = W[t, idx[t, k]]``: what the loop reads as ``W[tok, e, None]`` for each of expert e's (token,
    slot) pairs, for the ids that name an expert (others, e.g. their padding id E, are skipped by the exchange
    as by their loop, and read nothing here)."""
    E = spec.num_experts
    if weights_TE.dim() != 2 or (spec.roles.weights_cols and weights_TE.shape[1] != E):
        raise ValueError(f"{type(self).__name__}: routing weights of shape {tuple(weights_TE.shape)}; its loop reads "
                         f"them as (tokens, {E} experts)")
    valid_TK = (top_k_index >= 0) & (top_k_index < E)
    safe_TK = torch.where(valid_TK, top_k_index, torch.zeros_like(top_k_index))
    # Indexing as their loop does (not gather, whose backward would save W itself: the block may edit W in
    # place after the experts call, as their loop's indexed copies allow).
    rows_T1 = torch.arange(safe_TK.shape[0], device=safe_TK.device).unsqueeze(1)
    picked_TK = weights_TE[rows_T1, safe_TK]
    return torch.where(valid_TK, picked_TK, torch.zeros_like(picked_TK))


def _like_the_accumulator(out_TD: Tensor, hidden_TD: Tensor) -> Tensor:
    if out_TD.shape[0] == hidden_TD.shape[0]:
        return out_TD
    # The experts' own loop adds into zeros shaped like the hidden states: rows the expert ids do not
    # reach stay zero (more ids than rows fails in index_select above, as it does in their loop).
    acc = out_TD.new_zeros((hidden_TD.shape[0], out_TD.shape[1]))
    return acc.index_add(0, torch.arange(out_TD.shape[0], device=acc.device), out_TD)


def _ep_flat_forward(self: nn.Module, spec: _EpExperts, hidden_states: Tensor, top_k_index: Tensor,
                     top_k_weights: Tensor, dtypes: dict) -> Tensor:
    """Flattened experts (module docstring): their rows, the exchange, their output view."""
    flat, roles = spec.roles.flat, spec.roles
    if roles.unpacked and hidden_states.dim() != roles.unpacked:  # their ``b, s, h = hidden.shape`` raises here
        raise ValueError(f"experts got hidden states of shape {tuple(hidden_states.shape)}; their forward unpacks "
                         f"{roles.unpacked} dims")
    cols = hidden_states.shape[-1] if roles.rows == -1 else roles.rows
    hidden_TD = hidden_states.reshape(-1, cols) if roles.rows else hidden_states
    F, D = flat.rows_per_expert, flat.hidden
    act = self.get_submodule(flat.act)

    def expert_fn(x_SD: Tensor, tokens_per_local_expert: Tensor) -> Tensor:
        # Layout change (views, no copy): this rank's (L*F, D) shard is L whole experts of F rows.
        gate_LFD, up_LFD, down_LFD = (local_weight(self, p).view(-1, F, D)
                                      for p in (flat.gate, flat.up, flat.down))
        return grouped_split_glu(x_SD, tokens_per_local_expert, gate_LFD.transpose(-2, -1),
                                 up_LFD.transpose(-2, -1), down_LFD, act_fn=act)

    out_TD = ep_experts_forward(hidden_TD, top_k_index, top_k_weights, num_experts=spec.num_experts,
                                ep_group=spec.ep_group, expert_fn=expert_fn, idle=Idle(spec.roles.idle), **dtypes)
    out_TD = _like_the_accumulator(out_TD, hidden_TD)
    if roles.view_out == "lead":
        return out_TD.view(hidden_states.shape[0], -1, D)
    return out_TD.reshape(hidden_states.shape) if roles.view_out == "shape" else out_TD
