"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): model, optimiser, schedule, data position, RNG.

Layout: ``<run_dir>/checkpoints/step_00000010/`` holds DCP's files (model and optimiser, expert
params as ``Shard(0)`` DTensors, so a load at another ``ep_size`` reshards) and one
``trainer_rank<r>.pt`` per rank (step, scheduler, data position, RNG, model signature). Every rank
writes into ``.tmp-step_...`` first; rank 0 renames it to ``step_...`` after all ranks finished, so
a directory named ``step_*`` is always complete and a crash mid-save leaves only a ``.tmp-`` dir
(``autoep.runtime.state.save_sharded``, shared with ``autoep.integrations``).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from autoep.errors import CheckpointError  # noqa: F401  (raised here; importers read it from here too)
from autoep.runtime.state import load_sharded, rank, save_sharded

PREFIX = "step_"


def model_signature(model: nn.Module) -> dict[str, list[int]]:
    """Global shape of every parameter (DTensors report the global shape): what a resume must match."""
    return {name: list(p.shape) for name, p in model.named_parameters()}


def step_dir(root, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:08d}"


def latest(root) -> Path | None:
    """The newest complete checkpoint under ``root`` (``.tmp-`` dirs are never complete), or None."""
    root = Path(root)
    steps = sorted(p for p in root.glob(f"{PREFIX}*") if p.is_dir()) if root.is_dir() else []
    return steps[-1] if steps else None


def save(root, step: int, model: nn.Module, optimizer, trainer_state: dict) -> Path:
    """Collective: every rank writes its shards and its trainer state; returns the final directory."""
    def state() -> dict:
        return {**trainer_state, "rng": torch.get_rng_state(), "signature": model_signature(model)}

    return save_sharded(step_dir(root, step), model, optimizer, per_rank=state, per_rank_name="trainer_rank{rank}.pt")


def load(path, model: nn.Module, optimizer) -> dict:
    """Load ``path`` into ``model``/``optimizer`` (resharding experts to this run's ``ep_size``).

    Returns this rank's trainer state (rank 0's when the checkpoint had fewer ranks). Raises
    ``CheckpointError`` for a missing, incomplete or corrupt checkpoint or one of another model.
    """
    path = Path(path)
    state = read_state(path)
    mine, saved = model_signature(model), state.get("signature") or {}
    if saved != mine:
        diff = [f"{k}: {saved.get(k)} -> {mine.get(k)}" for k in sorted(set(mine) | set(saved)) if mine.get(k) != saved.get(k)]
        raise CheckpointError(f"trainer.resume={str(path)!r} was saved from a different model ({len(diff)} parameters "
                              f"differ, e.g. {diff[:2]}); resume with the model config it was trained with, or start fresh")
    load_sharded(path, model, optimizer, key="trainer.resume", fix=FIX)
    return state


FIX = "pass trainer.resume=<a complete step_* checkpoint dir>, trainer.resume=latest, or trainer.resume=null"


def read_state(path) -> dict:
    """This rank's trainer state of checkpoint ``path`` (rank 0's when it had fewer ranks), without loading
    any weights; a ``CheckpointError`` for a missing, incomplete or unreadable checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"trainer.resume={str(path)!r}: no such checkpoint directory; {FIX}")
    if not (path / ".metadata").is_file() or not (path / "trainer_rank0.pt").is_file():
        raise CheckpointError(f"trainer.resume={str(path)!r} is incomplete (no DCP .metadata or trainer_rank0.pt); {FIX}")
    own = path / f"trainer_rank{rank()}.pt"
    try:
        state = torch.load(own if own.is_file() else path / "trainer_rank0.pt", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is damaged
        raise CheckpointError(f"trainer.resume={str(path)!r}: trainer state unreadable ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); {FIX}") from None
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"trainer.resume={str(path)!r}: trainer state holds no step; {FIX}")
    return state
