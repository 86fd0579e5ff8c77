"""Expert FSDP: each rank's local experts sharded over ``edp`` with FSDP2 (``trainer.expert_sharding=fsdp2``).

``replicate`` (the default): every ``edp`` replica holds its ``ep`` rank's experts whole, with their gradients and
optimizer state; ``grads.reduce_grads`` sums expert grads over ``edp``. ``fsdp2``: each planned block is one FSDP2
unit over ``edp`` holding only its local expert parameters (everything else in the block is ``ignored_params``),
so a rank keeps ``1/(ep * edp)`` of every expert tensor, gathers its ``ep`` rank's experts over ``edp`` at the
block's forward (and again in backward) and reduce-scatters their gradients over ``edp`` after it; the expert grads
are then finished, and ``reduce_grads`` leaves them alone (``sharded_over_edp``). torchtitan shards experts over its
``efsdp`` mesh the same way.

Why the block and not each expert: the block's forward runs on every rank in every step, so the all-gather and the
reduce-scatter are reached by every ``edp`` peer in the same order; an expert module is called only where tokens
reached it, which differs across ranks. Why zero gradients for unused experts
(``set_reduce_scatter_unused_params``): the reduce-scatter needs the same tensors on every peer, and an expert one
rank's tokens missed may be reached by its peer's. An expert no rank reached thus gets a zero gradient, not
``None`` as under ``replicate`` (AdamW then still moves it by its moments; SGD without momentum does not).

Layouts, per kind of expert storage:
  - batched 3-D experts (``Shard(0)`` DTensors on the ``(edp, ep)`` mesh, ``Replicate()`` on ``edp``): FSDP2's
    SPMD path (``dp_mesh_dims=shard edp``); the shard is ``_StridedShard(0)`` on ``edp`` and ``Shard(0)`` on ``ep``.
  - flattened experts (DBRX; ``Shard(0)`` on the 1-D ``ep`` mesh): FSDP2's EP path on the ``edp`` sub-mesh
    (not yet covered by a test).
  - module experts (plain tensors of this rank's experts, ``meta`` stand-ins of the others): FSDP2 on the ``edp``
    sub-mesh; each becomes a ``Shard(0)`` DTensor on ``edp`` between steps, keeping its name.

Gradient scale: as ``autoep.runtime.dense`` (each rank backpropagates ``loss_r / (W * accum)``): sums, no divide.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from autoep.errors import PlanError
from autoep.runtime.dense import is_expert
from autoep.runtime.recipes.local_experts import expert_owners


def sharded_over_edp(p: torch.Tensor) -> bool:
    """An expert parameter FSDP2 shards over ``edp`` (``shard_experts_over_edp``): its grad is reduce-scattered by
    FSDP in backward, not summed by ``grads.reduce_grads``."""
    if not isinstance(p, DTensor):
        return False
    names = p.device_mesh.mesh_dim_names or ()
    return "edp" in names and not isinstance(p.placements[names.index("edp")], Replicate)


def shard_experts_over_edp(model: nn.Module, block_names: list[str], mesh) -> nn.Module:
    """``fully_shard`` each planned block over ``edp``, managing only its local expert parameters; in place.

    A collective (FSDP2's init). Call after ``apply_plan`` and after the weights are final, before
    ``dense.shard_dense`` (FSDP2 goes bottom-up) and before the optimiser is built (FSDP2 replaces the expert
    parameters). No-op without a mesh or with ``edp`` of 1 (nothing to shard over)."""
    if mesh is None or mesh.ndim < 2 or mesh["edp"].size() == 1:
        return model
    local_modules = {n for n, place in expert_owners(model).items() if place.local}
    for name in block_names:
        block = model.get_submodule(name)
        prefix = f"{name}." if name else ""
        experts = [p for n, p in block.named_parameters() if is_expert(p) or prefix + n in local_modules]
        if not experts:
            continue
        managed = {id(p) for p in experts}
        ignored = {p for p in block.parameters() if id(p) not in managed}  # router, shared experts, stand-ins
        fully_shard(block, **_placement(experts, mesh, name), ignored_params=ignored)
        _sum_not_mean(block)
    return model


def _placement(experts: list[torch.Tensor], mesh, name: str) -> dict:
    """FSDP2's mesh arguments for a block's expert parameters (module docstring: one layout per block)."""
    meshes = {p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else None for p in experts}
    if len(meshes) > 1:
        raise PlanError(f"trainer.expert_sharding=fsdp2: the experts of {name} live on different meshes "
                        f"({sorted(map(str, meshes))}), so one FSDP2 unit cannot shard them; use "
                        f"trainer.expert_sharding=replicate")
    names = meshes.pop()
    if names == tuple(mesh.mesh_dim_names):  # batched experts on the (edp, ep) mesh: FSDP2's SPMD path
        # The parameters' own mesh object: FSDP2 wants that very object, and DTensor may hold an equal one
        # interned from an earlier mesh over the same ranks.
        return {"mesh": experts[0].device_mesh, "dp_mesh_dims": DataParallelMeshDims(shard="edp")}
    return {"mesh": mesh["edp"]}  # plain module experts, or DTensors on the 1-D ep mesh (FSDP2's EP path)


def _sum_not_mean(block: nn.Module) -> None:
    block.set_gradient_divide_factor(1.0)  # sum, not mean: the loss is already scaled by 1/W
    block.set_force_sum_reduction_for_comms(True)  # gloo has neither AVG nor PREMUL_SUM
    block.set_reduce_scatter_unused_params(True)  # every edp peer reduces the same tensors (module docstring)
