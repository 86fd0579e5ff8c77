"""A rank that dies mid-step: the other rank exits with an error within ``trainer.timeout_s`` (no hang), and
resuming from the last checkpoint loses no completed step and continues the same loss curve.

Two ``python -m autoep.train`` processes are launched the way torchrun launches them (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR/PORT``), but without torchrun, whose agent would kill the survivor itself
and hide what the trainer does. The test-only hook ``AUTOEP_FAULT_STEP=<rank>:<step>`` (autoep.train.trainer)
makes rank 1 ``os._exit(1)`` after its forward of step 3, while rank 0 waits in the backward's exchange
(``1:3:hang``: rank 1 stays alive but silent, so only the collective timeout can end rank 0's wait).
Launch failures: a missing peer fails fast saying how many ranks joined (exit 4); an error every rank
finds alike is printed once. No assertion depends on timing: time limits only guard against a hang.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
from distributed import free_port
from hydra import compose, initialize_config_dir

from autoep.train.config import CONF_DIR

TIMEOUT_S = 10
COMMON = ["trainer.steps=5", "optim.warmup_steps=2", "data.seq_len=16", "trainer.device=cpu", "trainer.log_every=100"]


def launch(run_dir, *overrides: str, fault: str | None = None, ranks=(0, 1)) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in ranks:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env.pop("AUTOEP_FAULT_STEP", None)
        if fault:
            env["AUTOEP_FAULT_STEP"] = fault
        cmd = [sys.executable, "-m", "autoep.train", *COMMON, "parallel.ep_size=2", "data.batch_size=2",
               f"trainer.timeout_s={TIMEOUT_S}", f"run_dir={run_dir}", *overrides]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def wait_all(procs, limit_s: float) -> list[float]:
    """Exit time of each process (monotonic); kills every one still running after ``limit_s``."""
    deadline, done = time.monotonic() + limit_s, [None] * len(procs)
    while None in done and time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if done[i] is None and p.poll() is not None:
                done[i] = time.monotonic()
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return done


def test_dead_rank_fails_the_other_within_timeout_and_resume_loses_no_step(tmp_path):
    run_dir = tmp_path / "run"
    procs = launch(run_dir, "trainer.ckpt_every=1", fault="1:3")
    exited = wait_all(procs, limit_s=120)
    logs = [p.stderr.read() for p in procs]
    assert exited[1] is not None and procs[1].returncode == 1, logs[1][-2000:]
    assert exited[0] is not None, "rank 0 hung after rank 1 died"  # it left on its own, not killed by wait_all
    assert "remote worker" in logs[0] or "timed out" in logs[0].lower(), logs[0][-2000:]  # gloo: peer closed or reset
    assert procs[0].returncode == 3 and "autoep-train: error: rank 0 failed in step 3" in logs[0], logs[0][-2000:]
    assert "resume with trainer.resume=latest" in logs[0] and "Traceback" not in logs[0]
    assert logs[0].count("autoep-train: error:") == 1 and logs[1] == ""  # rank 1 was killed: it printed nothing
    # Steps 1 and 2 completed (and were checkpointed); step 3 was not: nothing of it is logged or saved.
    metrics = run_dir / "metrics.jsonl"
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000001", "step_00000002"]

    resumed = launch(run_dir, "trainer.resume=latest")
    wait_all(resumed, limit_s=120)
    assert [p.returncode for p in resumed] == [0, 0], resumed[0].stderr.read()[-2000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]

    from autoep.train.trainer import train

    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[*COMMON, "data.batch_size=4", f"run_dir={tmp_path}/uninterrupted"])
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows]), torch.tensor(train(cfg)["losses"]))


def test_hung_rank_fails_the_other_after_the_configured_timeout(tmp_path):
    procs = launch(tmp_path / "run", fault="1:3:hang")
    try:
        exited = wait_all(procs[:1], limit_s=120)
        log = procs[0].stderr.read()
        assert exited[0] is not None and procs[0].returncode != 0, log[-2000:]
        assert procs[1].poll() is None  # rank 1 is still stuck: rank 0 gave up on its own
        assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in log, log[-2000:]  # trainer.timeout_s, not a default
    finally:
        wait_all(procs, limit_s=0)


def test_missing_peer_fails_fast_saying_how_many_ranks_joined(tmp_path):
    """WORLD_SIZE=2 with only rank 0 (or only rank 1) started: exit 4 after trainer.join_timeout_s, not a silent
    wait of trainer.timeout_s; one line saying how many ranks joined, nothing written."""
    only_rank0 = launch(tmp_path / "a", "trainer.join_timeout_s=2", ranks=(0,))
    only_rank1 = launch(tmp_path / "b", "trainer.join_timeout_s=2", ranks=(1,))
    procs = only_rank0 + only_rank1
    exited = wait_all(procs, limit_s=120)
    logs = [p.stderr.read() for p in procs]
    assert None not in exited, "a rank waited for a missing peer past the hang guard"
    assert [p.returncode for p in procs] == [4, 4], logs
    assert logs[0].splitlines() == [logs[0].strip()] and "Traceback" not in logs[0] + logs[1]
    assert "autoep-train: error: only 1 of WORLD_SIZE=2 ranks joined within trainer.join_timeout_s=2" in logs[0]
    assert "autoep-train: error: rank 1 of 2: no rendezvous at MASTER_ADDR:MASTER_PORT=127.0.0.1:" in logs[1], logs[1]
    assert not (tmp_path / "a" / "resolved.yaml").exists() and not (tmp_path / "b" / "resolved.yaml").exists()


def test_an_error_every_rank_finds_is_printed_once(tmp_path):
    procs = launch(tmp_path / "run", "trainer.steps=0")
    wait_all(procs, limit_s=120)
    logs = [p.stderr.read() for p in procs]
    assert [p.returncode for p in procs] == [2, 2], logs
    assert logs[0].strip() == ("autoep-train: error: trainer.steps=0: must be an integer >= 1 (optimiser steps of "
                               "the whole run); e.g. trainer.steps=150")
    assert logs[1] == ""
