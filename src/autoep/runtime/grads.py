"""Gradients under EP: which parameters are experts, how their gradients are summed, scaled and clipped.

Shared by autoep's own trainer (``autoep.train``) and the handle other trainers use (``autoep.integrations``).

Why the sums (what makes EP training equal single-process training on the concatenated batch): let rank r
back-propagate its loss ``loss_r``. A dense parameter's grad on rank r is then the gradient of ``loss_r`` alone,
so dense grads are *summed* over the world. An expert shard's grad already holds the contributions of every
rank of its ``ep`` group (the all-to-all backward brought them home), so expert grads are *summed* over
``edp`` only; averaging over ``edp`` instead would be ``ep`` times too large. Under
``trainer.expert_sharding=fsdp2`` FSDP2 does that sum itself (a reduce-scatter over ``edp``,
``autoep.runtime.expert_fsdp``) and ``reduce_grads`` skips those experts.

The gradient convention says what the global loss is (``finish_grads``):
  - ``"sum"``: the global loss is the sum of what the ranks back-propagated (autoep's trainer back-propagates
    ``loss_r / W``, so the sum is the mean loss): the sums above are the gradient, nothing is scaled.
  - ``"mean"``: the global loss is the mean over ranks of what they back-propagated, as DDP assumes when it
    averages dense grads: the sums are divided by the world size W.
A wrong scale (W times too large) is invisible to Adam-like optimizers, which normalise the gradient; SGD
shows it, so the tests train with SGD.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from autoep.runtime.apply import unsharded_expert_names
from autoep.runtime.dense import is_expert
from autoep.runtime.expert_fsdp import sharded_over_edp
from autoep.runtime.recipes import local_tensor
from autoep.runtime.recipes.local_experts import expert_owners

CONVENTIONS = ("mean", "sum")


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense, expert) trainable parameters; experts are the DTensors ``apply_plan`` sharded on ``ep`` and this
    rank's own module experts (plain tensors, ``autoep.runtime.recipes.local_experts``; the other ranks' are
    ``meta`` stand-ins, left out whatever their ``requires_grad``: ``model.requires_grad_(True)`` reaches them
    too, and they never compute). Dense ones are plain tensors, or DTensors on FSDP2's ``dp`` mesh under
    ``trainer.dense_sharding=fsdp2``. In one process, without a mesh, the
    experts ``apply_plan`` left whole count as experts too: the groups have one layout at every ep size."""
    owners = expert_owners(model)
    unsharded = unsharded_expert_names(model)  # one process: experts left whole (one group layout at every ep size)
    dense, expert = [], []
    for name, p in model.named_parameters():
        place = owners.get(name)
        if not p.requires_grad or (place is not None and not place.local):
            continue
        (expert if is_expert(p) or place is not None or name in unsharded else dense).append(p)
    return dense, expert


def reduce_grads(dense: list[nn.Parameter], expert: list[nn.Parameter], world_group, edp_group) -> None:
    """Sum dense grads over the world and expert grads over ``edp`` (one flat bucket each).

    Dense parameters FSDP2 sharded (``trainer.dense_sharding=fsdp2``, ``autoep.runtime.dense``) are skipped: FSDP
    already reduce-scattered their grads over the world in backward. Replicated dense params (the
    default, and the only choice for one process) take the plain all-reduce here. Likewise expert parameters
    FSDP2 shards over ``edp`` (``trainer.expert_sharding=fsdp2``, ``autoep.runtime.expert_fsdp``).
    """
    dense = [p for p in dense if not isinstance(p, DTensor)]
    expert = [p for p in expert if not sharded_over_edp(p)]
    for params, group in ((dense, world_group), (expert, edp_group)):
        if not params or group is None or dist.get_world_size(group) == 1:
            continue
        had = [p.grad is not None for p in params]
        grads = []
        for p in params:
            if p.grad is None:  # a parameter no token reached still joins the collective, with zeros
                p.grad = torch.zeros_like(p)
            grads.append(local_tensor(p.grad))
        # One more entry per parameter counts the ranks that had a gradient: a parameter none had keeps
        # ``grad is None``, as in the model (an optimizer then leaves it alone: no momentum, no weight decay).
        flat = _flatten_dense_tensors([*grads, torch.tensor(had, dtype=grads[0].dtype, device=grads[0].device)])
        # NOTE: collective. One all-reduce per parameter kind and step; every rank calls both in order.
        dist.all_reduce(flat, group=group)
        counts = flat[-len(params):].tolist()  # NOTE: syncs the host once per parameter kind and step
        for p, g, reduced, n in zip(params, grads, _unflatten_dense_tensors(flat, grads), counts):
            g.copy_(reduced)
            if n == 0:
                p.grad = None


@torch.no_grad()
def finish_grads(dense: list[nn.Parameter], expert: list[nn.Parameter], *, world_group, edp_group, world_size: int,
                 convention: str, dense_synced: bool) -> None:
    """After backward, before the optimiser step: expert grads summed over ``edp``, dense grads summed over the
    world unless another layer did it already (``dense_synced``: DDP averaged them, FSDP reduced them), and both
    scaled to ``convention`` (module docstring). A collective: every rank calls it, in the same order."""
    if convention not in CONVENTIONS:
        raise ValueError(f"grad_convention={convention!r} is not one of {list(CONVENTIONS)}")
    reduce_grads([] if dense_synced else dense, expert, world_group, edp_group)
    if convention == "mean" and world_size > 1:
        for p in expert + ([] if dense_synced else dense):
            if p.grad is not None:
                local_tensor(p.grad).div_(world_size)


@torch.no_grad()
def dense_grads_agree(dense: list[nn.Parameter], world_group, rtol: float = 1e-5) -> bool:
    """Whether every rank holds the same replicated dense gradients (what DDP leaves behind), judged by one
    checksum per rank; FSDP2 shards (DTensors) differ by design and are not counted. A collective (two scalars)."""
    if world_group is None or dist.get_world_size(world_group) == 1:
        return True
    total = torch.zeros((), dtype=torch.float64)
    for p in dense:
        if p.grad is not None and not isinstance(p.grad, DTensor):
            g = p.grad.detach().double()
            total += g.sum() + g.abs().sum()
    bounds = torch.stack([total, -total])
    # NOTE: collective; MAX of (s, -s) gives every rank the largest and the smallest checksum at once.
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=world_group)
    high, low = float(bounds[0]), -float(bounds[1])
    return high - low <= rtol * max(abs(high), abs(low), 1e-30)


@torch.no_grad()
def grad_norm(dense: list[nn.Parameter], expert: list[nn.Parameter], ep_group, norm_type: float = 2.0) -> torch.Tensor:
    """The global gradient norm (float64, the same on every rank): replicated dense grads counted once, FSDP2
    dense shards combined over their ``dp`` mesh, expert shards combined over ``ep`` (over the whole world where
    FSDP2 also shards them over ``edp``). ``norm_type`` 2 or inf."""
    norm_type = float(norm_type)
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type={norm_type} is not supported by the EP gradient norm; use 2.0 or inf")
    inf = norm_type == math.inf
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM

    def part(g: torch.Tensor) -> torch.Tensor:
        g = local_tensor(g).double()
        return (g.abs().max() if g.numel() else g.new_zeros(())) if inf else g.pow(2).sum()

    def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.maximum(a, b) if inf else a + b

    replicated = sharded = experts = torch.zeros((), dtype=torch.float64)
    sharded_group = None
    for p in dense:
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):  # an FSDP2 shard (Shard(0) on the 1-D dp mesh; padding excluded)
            sharded, sharded_group = combine(sharded, part(p.grad)), p.grad.device_mesh.get_group()
        else:
            replicated = combine(replicated, part(p.grad))
    if sharded_group is not None:
        dist.all_reduce(sharded, op=op, group=sharded_group)  # NOTE: collective; each rank holds 1/W of every dense grad
    edp_sharded = torch.zeros((), dtype=torch.float64)
    for p in expert:
        if p.grad is not None and sharded_over_edp(p):
            edp_sharded = combine(edp_sharded, part(p.grad))
        elif p.grad is not None:
            experts = combine(experts, part(p.grad))
    if ep_group is not None and dist.get_world_size(ep_group) > 1:
        dist.all_reduce(experts, op=op, group=ep_group)  # NOTE: collective; each ep rank holds other experts
    if any(sharded_over_edp(p) for p in expert):  # the same on every rank: FSDP2 sharded the same blocks
        # NOTE: collective; each rank holds 1/(ep * edp) of the experts (the (edp, ep) mesh spans the world)
        dist.all_reduce(edp_sharded, op=op)
    total = combine(combine(combine(replicated, sharded), experts), edp_sharded)
    return total if inf else total.sqrt()


@torch.no_grad()
def clip_grad_norm(dense: list[nn.Parameter], expert: list[nn.Parameter], max_norm: float, ep_group,
                   norm_type: float = 2.0) -> float:
    """Clip to the global norm (``grad_norm``) when ``max_norm`` > 0; returns the norm, the same on every rank."""
    norm = float(grad_norm(dense, expert, ep_group, norm_type))
    if max_norm and max_norm > 0:
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for p in dense + expert:
                if p.grad is not None:
                    local_tensor(p.grad).mul_(coef)
    return norm
