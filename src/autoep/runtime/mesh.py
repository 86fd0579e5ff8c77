"""The ``(edp, ep)`` device mesh over the world: ``ep`` ranks split the experts, ``edp`` replicas of them.

Built by autoep's trainer (``autoep.train.trainer``) and by the handle other trainers use
(``autoep.integrations.handle``); both refuse a world the plan does not fit rather than run unsharded.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autoep.errors import PlanError


def world_of() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_world(ep_size: int, world: int) -> None:
    if ep_size < 1 or world % ep_size:
        fits = [d for d in range(1, world + 1) if world % d == 0]
        raise PlanError(f"parallel.ep_size={ep_size} does not divide the world size {world} (processes launched); "
                        f"pick parallel.ep_size from {fits} or launch a multiple of {ep_size} processes "
                        f"(torchrun --nproc-per-node)")


def check_distributed(ep_size: int) -> None:
    """``ep_size > 1`` needs the ranks it shards over: without a process group it would train unsharded."""
    if ep_size > 1 and not (dist.is_available() and dist.is_initialized()):
        raise PlanError(f"parallel.ep_size={ep_size} but torch.distributed is not initialised (one process): the "
                        f"experts would not be sharded. Launch {ep_size} or a multiple of {ep_size} processes "
                        f"(torchrun --nproc-per-node {ep_size} ...) and call torch.distributed.init_process_group() "
                        f"first, or set parallel.ep_size=1")


def make_mesh(world: int, ep_size: int, device: torch.device):
    """The ``(edp, ep)`` mesh (a collective: new process groups), or None for one process."""
    if world == 1:
        return None  # single process: recipes run without exchange, params stay plain tensors
    return init_device_mesh(device.type, (world // ep_size, ep_size), mesh_dim_names=("edp", "ep"))


def check_mesh(mesh, ep_size: int, world: int) -> None:
    """A mesh the caller built: dims ``("edp", "ep")`` or ``("ep",)``, its ``ep`` size ``ep_size``, the whole world."""
    names = tuple(mesh.mesh_dim_names or ())
    if names not in (("edp", "ep"), ("ep",)):
        raise PlanError(f"mesh dims {names} are not ('edp', 'ep') or ('ep',); build it with "
                        f"init_device_mesh(device, (world // ep_size, ep_size), mesh_dim_names=('edp', 'ep')), or "
                        f"pass mesh=None to let autoep build it")
    ep = mesh["ep"].size() if mesh.ndim > 1 else mesh.size()
    if ep != ep_size:
        raise PlanError(f"parallel.ep_size={ep_size} but the mesh's 'ep' dim has {ep} ranks; make them agree")
    if mesh.size() != world:
        raise PlanError(f"the mesh spans {mesh.size()} ranks but the world has {world}; build it over the whole "
                        f"world (or pass mesh=None)")
