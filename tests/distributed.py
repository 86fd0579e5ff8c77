"""Spawn gloo process groups on CPU for multi-rank tests.

Every rank is a fresh process, forked from a fork server that imported torch, transformers and autoep once
(``PRELOAD``): a rank starts in a fraction of a second, where a spawned interpreter spent seconds on those imports
(5-20 s per 2-rank group on 2 cores, paid by every spawn of the suite). The fork server is started once per test
session; what it cannot know, the caller's environment, working directory and ``sys.path`` at the time of the
call, each rank takes from the caller first (``_entry``), as a spawned rank would. Nothing else is carried over:
the caller's own state (monkeypatches, caches, RNG) stays in the caller, as with spawn.

Tests still group many cases into one process group: ``run_cases(world_size, "module:function", ...)`` runs
``function(rank, world_size)`` on every rank inside one gloo group; the function returns
``{case_name: error_text_or_None}``; the merged result per case lists the ranks that failed. Use ``guarded``
inside the worker so one failing case records its error and the next case still runs (collectives stay in step:
compute first, compare last).

``run_command`` runs a console script's entry function (``autoep.cli:train_main``) with an argv in a process forked
from the same server: the CLI's own code from its first line, exit code and one error line as a subprocess gives
them, without the seconds of interpreter start and imports (tests/train/test_bad_input.py).
"""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import socket
import sys
import multiprocessing
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the fork server; every rank is forked from it with these loaded (none touches a device at import:
# CUDA is initialised in the rank, after the fork). An import that fails there is left to the rank, as before.
PRELOAD = ["torch", "torch.distributed.tensor", "transformers", "transformers.modeling_utils", "autoep.runtime.apply",
           "autoep.plan.resolve", "autoep.train.trainer", "distributed"]
multiprocessing.set_forkserver_preload(PRELOAD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, target: str, out_dir: str, args: tuple, backend: str = "gloo",
           caller: dict | None = None) -> None:
    if caller is not None:  # the fork server's view is that of its start: take the caller's, as spawn gives it
        os.environ.clear()
        os.environ.update(caller["environ"])
        os.chdir(caller["cwd"])
        sys.path[:] = caller["sys_path"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank (tests marked gpu)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        module_name, _, fn_name = target.partition(":")
        fn = getattr(importlib.import_module(module_name), fn_name)
        result = fn(rank, world_size, *args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    # NOTE: leave without interpreter finalization. The result is on disk and the group destroyed; what
    # is left is the teardown of C++ thread pools, where a rank aborted twice in this project's runs
    # ("terminate called without an active exception", the symptom pytorch/pytorch#190489 describes for
    # gloo threads outliving the interpreter). A rank that fails before this point still fails the test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(world_size: int, target: str, *args, backend: str = "gloo") -> list:
    """Run ``target`` ("module:function", importable from the tests dir) on ``world_size`` gloo ranks (``backend``:
    nccl for the gpu-marked tests, one GPU per rank); return each rank's return value."""
    caller = {"environ": dict(os.environ), "cwd": os.getcwd(), "sys_path": list(sys.path)}
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_entry, args=(world_size, free_port(), target, out_dir, args, backend, caller),
                           nprocs=world_size, join=True, start_method="forkserver")
        results = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def _command_entry(target: str, argv: list[str], caller: dict, stdout_path: str, stderr_path: str) -> None:
    """A forked child as the console script's process: the caller's environment, cwd and sys.path, ``sys.argv``,
    stdout and stderr on files (fds 1 and 2, so C-level writes land there too); ``SystemExit`` is its exit code."""
    os.environ.clear()
    os.environ.update(caller["environ"])
    os.chdir(caller["cwd"])
    sys.path[:] = caller["sys_path"]
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    sys.argv = list(argv)
    module_name, _, fn_name = target.partition(":")
    getattr(importlib.import_module(module_name), fn_name)()
    # NOTE: falling off the end is exit 0, as a script's; multiprocessing's bootstrap maps SystemExit to the exit
    # code, prints any other exception's traceback to stderr (exit 1) and flushes stdout and stderr.


def run_command(target: str, argv: list[str], env: dict, cwd: str, timeout: float) -> dict:
    """``{"rc", "stdout", "stderr"}`` of the console-script function ``target`` ("module:function") run with
    ``sys.argv = argv`` in a process forked from the fork server (rc None: still running after ``timeout`` s,
    then killed)."""
    caller = {"environ": dict(env), "cwd": str(cwd), "sys_path": list(sys.path)}
    with tempfile.TemporaryDirectory() as out_dir:
        paths = [os.path.join(out_dir, name) for name in ("stdout", "stderr")]
        process = multiprocessing.get_context("forkserver").Process(
            target=_command_entry, args=(target, argv, caller, *paths))
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            return {"rc": None, "stdout": "", "stderr": ""}
        with open(paths[0]) as out, open(paths[1]) as err:
            return {"rc": process.exitcode, "stdout": out.read(), "stderr": err.read()}


def run_cases(world_size: int, target: str, *args, backend: str = "gloo") -> dict[str, list[str]]:
    """Spawn once; return ``{case: [error texts of failing ranks]}`` (empty list = passed on all ranks)."""
    merged: dict[str, list[str]] = {}
    for rank, cases in enumerate(spawn(world_size, target, *args, backend=backend)):
        for name, err in cases.items():
            merged.setdefault(name, [])
            if err is not None:
                merged[name].append(f"rank {rank}: {err}")
    return merged


def guarded(results: dict, name: str, fn, *args) -> None:
    """Run one case, recording ``None`` or its traceback under ``name``."""
    try:
        fn(*args)
        results[name] = None
    except Exception:  # noqa: BLE001 - recorded and re-raised by the test that reads it
        results[name] = traceback.format_exc()
