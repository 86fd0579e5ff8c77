"""Run directories (autoep.train.rundir, README "Run directories"): one run per directory; resume continues this
run and never repeats a step in metrics.jsonl; a run that is refused changes nothing already written; the
README's resume example runs as written.

Single-process runs of the tiny default model through the Python API (a second each); the README example
through the real ``autoep-train``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from autoep.errors import ConfigError
from autoep.train.checkpoint import CheckpointError
from autoep.train.config import CONF_DIR

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["optim.warmup_steps=2", "trainer.log_every=100", "data.seq_len=16", "data.batch_size=2", "trainer.device=cpu"]


def train(run_dir, *overrides: str) -> dict:
    from autoep.train.trainer import train as run

    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[*SMALL, f"run_dir={run_dir}", *overrides])
    return run(cfg)


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones included) and a hash of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """A finished run: 5 steps, checkpoints at 2, 4 and 5."""
    run_dir = tmp_path_factory.mktemp("runs") / "a"
    train(run_dir, "trainer.steps=5", "trainer.ckpt_every=2")
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run_dir, tmp_path / run_dir.name))


def test_a_fresh_run_refuses_a_used_run_dir_and_changes_nothing(done, tmp_path):
    run_dir = copy_of(done, tmp_path)
    before = snapshot(run_dir)
    with pytest.raises(ConfigError, match=rf"run_dir={run_dir} already holds a run \(metrics.jsonl with 5 steps, "
                                          r"the last 5; checkpoints step_00000002, step_00000004, step_00000005\); "
                                          r"continue it with trainer.resume=latest, or give this run its own run_dir"):
        train(run_dir, "trainer.steps=3")
    assert snapshot(run_dir) == before


def test_resume_cuts_metrics_back_to_the_checkpoint_and_repeats_no_step(done, tmp_path):
    """A crash after step 5 was logged but with step 4 the last checkpoint: resuming from step 4 drops row 5
    and trains it again, equal to the first time."""
    run_dir = copy_of(done, tmp_path)
    first = losses(run_dir)
    train(run_dir, "trainer.steps=5", f"trainer.resume={run_dir}/checkpoints/step_00000004")
    assert steps(run_dir) == [1, 2, 3, 4, 5]
    assert losses(run_dir) == pytest.approx(first, rel=1e-6)
    assert "resumed from" in (run_dir / "train.log").read_text()


def test_resume_latest_continues_this_run_and_reports_what_changed(done, tmp_path, caplog):
    run_dir = copy_of(done, tmp_path)
    with caplog.at_level(logging.INFO, logger="autoep"):
        train(run_dir, "trainer.steps=7", "trainer.resume=latest", "data.batch_size=4")
    assert steps(run_dir) == [1, 2, 3, 4, 5, 6, 7]
    text = caplog.text
    assert "resumed from" in text and "step_00000005 at step 5" in text
    assert "resuming with trainer.steps 5 -> 7" in text
    assert "resuming with global batch 2 -> 4; the data stream differs" in text


def test_resume_with_nothing_left_to_train_is_an_error_and_changes_nothing(done, tmp_path):
    run_dir = copy_of(done, tmp_path)
    before = snapshot(run_dir)
    with pytest.raises(ConfigError, match=r"trainer.resume=latest: step_00000005 is at step 5 and trainer.steps=5, "
                                          r"so nothing is left to train; raise trainer.steps \(e.g. trainer.steps=10\)"):
        train(run_dir, "trainer.steps=5", "trainer.resume=latest")
    assert snapshot(run_dir) == before


def test_resume_with_another_model_changes_nothing(done, tmp_path):
    run_dir = copy_of(done, tmp_path)
    before = snapshot(run_dir)
    with pytest.raises(CheckpointError, match=r"different model \(model.moe_intermediate_size: 16 -> 8\)"):
        train(run_dir, "trainer.steps=9", "trainer.resume=latest", "model.moe_intermediate_size=8")
    assert snapshot(run_dir) == before  # resolved.yaml still holds the plan of the model that was trained


def test_a_used_run_dir_resumes_only_its_own_checkpoints(done, tmp_path):
    other = copy_of(done, tmp_path / "other")
    run_dir = copy_of(done, tmp_path)
    before = snapshot(run_dir)
    with pytest.raises(ConfigError, match=r"is not a checkpoint of run_dir=.*which holds its own run"):
        train(run_dir, "trainer.steps=9", f"trainer.resume={other}/checkpoints/step_00000002")
    assert snapshot(run_dir) == before
    branch = tmp_path / "branch"  # a fresh run_dir may start from any run's checkpoint
    train(branch, "trainer.steps=5", f"trainer.resume={other}/checkpoints/step_00000004")
    assert steps(branch) == [5]


def test_resume_latest_where_no_checkpoint_was_saved(tmp_path):
    train(tmp_path / "r", "trainer.steps=2")
    with pytest.raises(CheckpointError, match=r"no complete checkpoint under .*; that run saved none "
                                              r"\(trainer.ckpt_every=0\)"):
        train(tmp_path / "r", "trainer.steps=4", "trainer.resume=latest")


def test_readme_resume_example_runs_as_written(tmp_path):
    """README "Run directories": the two commands, literally, in a fresh working directory."""
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^(autoep-train run_dir=runs/a .*?)\s*(?:#.*)?$", readme, flags=re.M)
    assert len(commands) == 2 and "trainer.resume=latest" in commands[1] and "trainer.resume" not in commands[0]
    script = Path(sys.executable).parent / "autoep-train"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = []
    for command in commands:
        args = shlex.split(command)[1:]
        proc = subprocess.run([str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stderr == "", proc.stderr[-3000:]  # no warnings in a normal run
        out.append(proc.stdout)
    run_dir = tmp_path / "runs" / "a"
    first_steps = int(re.search(r"trainer.steps=(\d+)", commands[0]).group(1))
    total = int(re.search(r"trainer.steps=(\d+)", commands[1]).group(1))
    assert f"resumed from {run_dir}/checkpoints/step_{first_steps:08d} at step {first_steps}" in out[1]
    assert steps(run_dir) == list(range(1, total + 1))
    assert sorted(p.name for p in (run_dir / ".hydra").iterdir()) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    assert "trainer.resume=latest" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert oct((run_dir / "resolved.yaml").stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    log = (run_dir / "train.log").read_text()
    assert f"step {total:>5}/{total}" in log and log.count("resumed from") == 1


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
