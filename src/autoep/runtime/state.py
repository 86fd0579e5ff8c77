"""Model and optimiser state that keeps every expert: sharded (DCP) directories and full state dicts.

Expert parameters are ``Shard(0)`` DTensors over ``ep`` (``autoep.runtime.apply``), so a plain
``model.state_dict()`` on rank 0 holds only rank 0's experts. Two ways that keep all of them:

- ``save_sharded`` / ``load_sharded``: a ``torch.distributed.checkpoint`` (DCP) directory. Every rank writes
  its own shards into ``.tmp-<name>`` and rank 0 renames it to ``<name>`` once every rank finished, so a
  directory under the final name is always complete; a load at another ``ep_size`` reshards.
- ``full_model_state`` / ``full_optim_state`` (and their ``load_*``): every tensor gathered to its full shape,
  under the model's own names, on every rank; loading slices each expert back to the rank's shard. For trainers
  that save one file from rank 0 (Lightning, HF ``Trainer``).

All of them are collectives: every rank calls them, in the same order.
"""
from __future__ import annotations

import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from autoep.errors import CheckpointError
from autoep.runtime.recipes.local_experts import (
    expert_owners,
    gather_expert_optim_state,
    gather_experts,
    owned_optim_state,
    remote_experts_hidden,
    spec_of,
)

FULL = StateDictOptions(full_state_dict=True)


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if _dist() else 0


def barrier() -> None:
    if _dist():
        dist.barrier()  # NOTE: collective; orders the rename after every rank's writes


@contextmanager
def single_process_quiet():
    """DCP warns on every save and load without a process group that it assumes one process: that is
    exactly the single-process case, so the warning is dropped there (and only that warning)."""
    with warnings.catch_warnings():
        if not _dist():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_sharded(path, model: nn.Module, optimizer=None, *, per_rank: Callable[[], dict] | None = None,
                 per_rank_name: str = "rank{rank}.pt") -> Path:
    """Write ``path`` (a DCP directory: model, and optimiser if given) atomically; what ``per_rank()`` returns
    (small, picklable; asked for after the shards are written) goes to ``per_rank_name`` of each rank. Returns
    ``path`` on every rank."""
    final = Path(path)
    tmp = final.with_name(".tmp-" + final.name)
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crashed save
        tmp.mkdir(parents=True)
    barrier()
    with remote_experts_hidden(model):  # ModuleList experts: each saved by the ranks owning it (DCP dedups edp)
        state = {"model": get_model_state_dict(model)} if optimizer is None else dict(
            zip(("model", "optim"), get_state_dict(model, optimizer)))
    with single_process_quiet():
        dcp.save(state, checkpoint_id=str(tmp))
    if per_rank is not None:
        torch.save(per_rank(), tmp / per_rank_name.format(rank=rank()))
    barrier()
    if rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # atomic: the final name appears only once every file is in place
    barrier()
    return final


def load_sharded(path, model: nn.Module, optimizer=None, *, key: str = "path", fix: str = "") -> None:
    """Load a ``save_sharded`` directory into ``model`` (and ``optimizer``), resharding experts to this run's
    ``ep_size``. A missing, incomplete or damaged directory is a ``CheckpointError`` naming ``key`` and ``fix``."""
    path = Path(path)
    fix = fix or "pass a complete checkpoint directory"
    if not (path / ".metadata").is_file():
        what = "no such checkpoint directory" if not path.is_dir() else "incomplete (no DCP .metadata)"
        raise CheckpointError(f"{key}={str(path)!r}: {what}; {fix}")
    with remote_experts_hidden(model):  # ModuleList experts: each rank reads the ones it owns now
        if optimizer is None:
            state = {"model": get_model_state_dict(model)}
        else:
            state = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
    try:
        with single_process_quiet():
            dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's own error is a BaseException
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise CheckpointError(f"{key}={str(path)!r}: DCP load failed, the checkpoint is damaged or of another model "
                              f"or optimiser ({type(e).__name__}: {first}); {fix}") from None
    with remote_experts_hidden(model):
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full_model_state(model: nn.Module) -> dict:
    """Every parameter and buffer at its full shape (experts gathered; ModuleList experts each from the rank
    owning it), the model's own names, on every rank. A collective."""
    with remote_experts_hidden(model):
        state = get_model_state_dict(model, options=FULL)
    for name, block in model.named_modules():
        if spec_of(block) is not None:
            prefix = f"{name}." if name else ""
            state.update({prefix + k: v for k, v in gather_experts(block).items()})  # NOTE: collective over ep
    return {k: state[k] for k in model.state_dict()}  # the model's own key order


def load_full_model_state(model: nn.Module, state: dict) -> None:
    """The inverse of ``full_model_state``: each expert tensor sliced back to this rank's shard, ModuleList
    experts other ranks own skipped (strict: every other key must be there, nothing else)."""
    remote = {k for k, place in expert_owners(model).items() if not place.local}
    with remote_experts_hidden(model):
        set_model_state_dict(model, {k: v for k, v in state.items() if k not in remote}, options=FULL)


def full_optim_state(model: nn.Module, optimizer) -> dict:
    """The optimiser's state keyed by parameter name, expert moments gathered to full shape (ModuleList experts'
    from the rank owning them), on every rank. A collective."""
    with remote_experts_hidden(model):
        state = get_optimizer_state_dict(model, optimizer, options=FULL)
    return gather_expert_optim_state(model, state)


def load_full_optim_state(model: nn.Module, optimizer, state: dict) -> None:
    with remote_experts_hidden(model):
        set_optimizer_state_dict(model, optimizer, owned_optim_state(model, state), options=FULL)
