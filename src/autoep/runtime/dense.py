"""How dense (non-expert) parameters live across ranks: replicated, or sharded with FSDP2.

``replicate``: every rank holds every dense parameter; ``grads.reduce_grads`` sums their grads over the
world with one all-reduce after backward. ``fsdp2``: ``fully_shard`` each decoder layer (the parent of
every planned MoE block) and then the root over a 1-D ``dp`` mesh of the whole world; dense parameters
become ``Shard(0)`` DTensors on ``dp``, gathered per layer for forward/backward and reduce-scattered in
backward. Expert parameters (``Shard(0)`` on ``ep``, or ModuleList experts placed by ``apply_plan``) are handed
to FSDP as ``ignored_params``: this FSDP never gathers or reduces them; ``grads.reduce_grads`` sums their grads
over ``edp``, or, under ``trainer.expert_sharding=fsdp2``, their own FSDP2 units over ``edp`` reduce-scatter them
(``autoep.runtime.expert_fsdp``; those blocks are sharded first and this FSDP leaves nested units alone, so a
block's router and shared-expert parameters stay replicated there and are summed by ``grads.reduce_grads``).

Gradient scale: each rank backpropagates ``loss_r / (W * accum)`` (see ``autoep.runtime.grads``), so dense grads
must be *summed* over the world, not averaged. FSDP2 averages by default; the divide factor is set to 1
and comms forced to plain ``SUM`` (gloo has neither ``AVG`` nor ``PREMUL_SUM``; NCCL runs the same).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def is_expert(p: torch.Tensor) -> bool:
    """An expert parameter: a DTensor on a mesh with an ``ep`` dim (``apply_plan``'s sharding)."""
    return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())


def shard_dense(model: nn.Module, block_names: list[str], world: int, device: torch.device,
                mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """``fully_shard`` the decoder layers holding ``block_names`` and the root, experts ignored; in place.
    ``mp_policy``: FSDP2's mixed precision for the dense shards (None: gathered and reduced in their own dtype).

    Collective (builds the ``dp`` mesh). Call after ``apply_plan`` and after the weights are final
    (seeded or loaded), before the optimiser is built: FSDP2 replaces the dense parameters.
    """
    # NOTE: collective; a 1-D mesh over the world (one new process group) for the dense shards.
    dp_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    from autoep.runtime.recipes.local_experts import expert_owners

    module_experts = expert_owners(model)  # ModuleList experts: this rank's own and the meta stand-ins of others
    ignored = {p for n, p in model.named_parameters() if is_expert(p) or n in module_experts}
    layers = {name.rpartition(".")[0] for name in block_names if "." in name}
    policy = mp_policy or MixedPrecisionPolicy()
    for name in sorted(layers):
        fully_shard(model.get_submodule(name), mesh=dp_mesh, ignored_params=ignored, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, ignored_params=ignored, mp_policy=policy)  # the rest: embeddings, norm, lm_head
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum, not mean: the loss is already scaled by 1/W
            module.set_force_sum_reduction_for_comms(True)
    return model


def set_grad_sync(model: nn.Module, sync: bool) -> None:
    """FSDP2: reduce-scatter grads in this backward (the last micro-batch) or keep accumulating them unsharded
    (earlier micro-batches), in every FSDP2 unit (dense layers, and experts under ``expert_sharding=fsdp2``).
    No-op for a replicated model."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(sync, recurse=False)
