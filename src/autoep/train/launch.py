"""Joining the ranks of a launch: a rendezvous that fails fast, the process group (the ``(edp, ep)`` mesh:
``autoep.runtime.mesh``).

``torchrun`` (or any launcher that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) starts
one process per rank. Before the process group is built every rank checks in at rank 0's TCP store and
waits at most ``trainer.join_timeout_s`` for the others, so a missing peer ends the launch with how many
ranks joined (``LaunchError``, exit 4) instead of a silent wait of ``trainer.timeout_s``. Collectives
after that use ``trainer.timeout_s``: a rank that dies or hangs mid-run fails the others (``PeerFailure``).
"""
from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from autoep.errors import LaunchError

ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(device: str, timeout_s: int, join_timeout_s: int) -> tuple[int, int, torch.device, bool]:
    """(rank, world size, device, whether this call created the process group).

    Joins a group a caller already initialised (tests), or the launcher's (``WORLD_SIZE`` > 1); else
    single process.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    created = False
    world_env = _env_int("WORLD_SIZE", 1)
    if not dist.is_initialized() and world_env > 1:
        rank = _env_int("RANK", None)
        store = rendezvous(rank, world_env, join_timeout_s)
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_env,
                                timeout=datetime.timedelta(seconds=timeout_s))
        created = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))))
        return rank, world, torch.device("cuda", torch.cuda.current_device()), created
    return rank, world, torch.device(device), created


def rendezvous(rank: int, world: int, join_timeout_s: int):
    """Rank 0's TCP store, once all ``world`` ranks checked in; ``LaunchError`` saying how many did.

    Under torchrun the store is its agent's (``TORCHELASTIC_USE_AGENT_STORE``), prefixed per restart as
    ``torch.distributed`` does; otherwise rank 0 serves it (``MASTER_ADDR:MASTER_PORT``).
    """
    missing = [k for k in ENV if k not in os.environ]
    if missing:
        raise LaunchError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: launch with torchrun "
                          f"--nproc-per-node {world} -m autoep.train ..., which sets them")
    addr, port = os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", None)
    timeout = datetime.timedelta(seconds=join_timeout_s)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        # NOTE: wait_for_workers=False: rank 0 does not block here; the count below says who came.
        store = dist.TCPStore(addr, port, world, is_master=rank == 0 and not agent, timeout=timeout,
                              wait_for_workers=False, multi_tenant=not agent)
    except (RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        error = LaunchError(f"rank {rank} of {world}: no rendezvous at MASTER_ADDR:MASTER_PORT={addr}:{port} "
                            f"within trainer.join_timeout_s={join_timeout_s} ({first}); start rank 0 (torchrun "
                            f"starts every rank), or check the address and port")
        error.every_rank = False  # only this rank knows it could not reach rank 0
        raise error from None
    if agent:
        store = dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    joined = store.add("autoep/joined", 1)  # NOTE: one round trip to rank 0's store per poll
    deadline = time.monotonic() + join_timeout_s
    while joined < world:
        if time.monotonic() > deadline:
            raise LaunchError(f"only {joined} of WORLD_SIZE={world} ranks joined within trainer.join_timeout_s="
                              f"{join_timeout_s} at {addr}:{port}; start all {world} ranks (torchrun --nproc-per-node "
                              f"{world}), or raise trainer.join_timeout_s if they start slowly")
        time.sleep(0.05)
        joined = store.add("autoep/joined", 0)
    return store


def _env_int(name: str, default):
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer; the launcher (torchrun) sets it") from None


def agree_run_dir(run_dir: Path) -> Path:
    """Rank 0's run directory, on every rank (Hydra's per-process timestamps may differ)."""
    chosen = [str(run_dir)]
    if dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0)  # NOTE: collective; one small pickle from rank 0
    return Path(chosen[0])
