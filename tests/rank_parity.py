"""EP parity of one block on gloo ranks, for tests that change something around the block between
applying the plan and running it (a closure variable rebound, a method's code swapped).

Reference = the block's own forward/backward on every rank's slice (grads summed over slices); EP = the
block made EP-ready by the recipe the real detector and table choose (``mutation.make_ep``), run on this
rank's slice. Outputs and input grad per rank, dense grads summed over ranks, expert grads gathered.
The ep group times out after ``HANG_S``: a rank left waiting in a collective fails its case, never hangs.

    from rank_parity import ep_mesh, parity; parity(block, rank, world_size, mesh, [1, 1])
"""

from __future__ import annotations

import copy
import datetime
import itertools

import torch
import torch.distributed as dist
from mutation import Run, differences, forward_backward, inputs, make_ep, param_grads

from autoep.detect.structure import detect_moe_structure
from autoep.runtime.recipes.local_experts import expert_owners

SPLITS = {1: ([2],), 2: ([1, 1], [2, 0]), 4: ([1, 0, 2, 1],)}  # sequences per rank; one rank without any
HANG_S = 10


def ep_mesh(world_size: int):
    """A 1-D ``ep`` mesh over every rank whose group times out after ``HANG_S`` (None for one process)."""
    if world_size == 1:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.new_group(list(range(world_size)), backend="gloo", timeout=datetime.timedelta(seconds=HANG_S))
    return DeviceMesh.from_group(group, "cpu", mesh_dim_names=("ep",))


def parity(block, rank: int, world_size: int, mesh, split: list[int], *, after_apply=None, flat: bool = False) -> None:
    """Raise ``AssertionError`` listing what differs between ``block``'s own forward/backward and its EP
    run on this rank; ``after_apply()`` runs once the EP copy exists, before either side runs."""
    structure = detect_moe_structure(block)
    x = inputs(block, batch=sum(split))
    bounds = list(itertools.accumulate([0, *split]))
    slices = [x[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
    ep = make_ep(block, structure, mesh)
    if after_apply is not None:
        after_apply()
    ref = copy.deepcopy(block)
    runs = [forward_backward(ref, s, seed=100 + r, flat=flat) for r, s in enumerate(slices)]
    ref_run = Run(runs[rank].outputs, runs[rank].x_grad, param_grads(ref))
    got = forward_backward(ep, slices[rank], seed=100 + rank, flat=flat)
    reduced, module_experts = set(), expert_owners(ep)
    for name, p in ep.named_parameters(remove_duplicate=False):
        if hasattr(p, "full_tensor") or name not in got.grads or name in module_experts or world_size == 1:
            continue  # expert shards and ModuleList experts: gathered from their owners by param_grads
        if got.grads[name] is None:  # every rank joins every all-reduce, with or without a grad
            got.grads[name] = torch.zeros_like(p)
        if id(got.grads[name]) not in reduced:
            reduced.add(id(got.grads[name]))
            dist.all_reduce(got.grads[name])  # NOTE: collective; dense grads sum over ranks
    diffs = differences(ref_run, got)
    assert not diffs, f"split {split}, rank {rank}: " + "; ".join(diffs[:3])
