"""The run directory: one run per directory, and nothing in it changes before a run is accepted.

A run owns ``<run_dir>``: ``resolved.yaml``, ``.hydra/`` (the composed config, the overrides and Hydra's
settings), ``train.log``, ``metrics.jsonl`` (one line per step), ``checkpoints/step_*`` and, with
``trainer.export_hf=true``, ``hf/``. The rules (README "Run directories"):

- a fresh run (``trainer.resume=null``) refuses a directory that holds a run (metrics or checkpoints);
- ``trainer.resume=latest`` continues the run in ``run_dir`` from its newest complete checkpoint;
- ``trainer.resume=<a checkpoints/step_* dir>`` continues from that checkpoint: one of ``run_dir``'s own,
  or any run's when ``run_dir`` holds no run yet (a branch starting at that step);
- a resume with nothing left to train (``trainer.steps`` <= the checkpoint's step) is an error;
- until the run is accepted (config checked, plan resolved, weights and checkpoint loaded) nothing in
  the directory changes; then ``resolved.yaml`` and ``.hydra/`` are written (write-then-rename) and
  ``metrics.jsonl`` is cut back to the resumed step, so it never repeats or mixes steps.

Helpers take paths and plain values; ``autoep.train.trainer`` decides when to call them.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from omegaconf import OmegaConf

from autoep.errors import ConfigError
from autoep.plan.artifact import file_mode
from autoep.train.checkpoint import PREFIX, CheckpointError, latest

METRICS, LOG, CHECKPOINTS, HYDRA = "metrics.jsonl", "train.log", "checkpoints", ".hydra"
log = logging.getLogger(__name__)


def prepare(run_dir) -> Path:
    """``run_dir`` as an absolute directory that exists and takes files; a ``ConfigError`` otherwise."""
    path = Path(run_dir).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".autoep-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"run_dir={run_dir}: cannot write there ({e.strerror or e}: {e.filename or path}); "
                          f"pick a directory you can write, e.g. run_dir=runs/my-run") from None
    return path


def metrics_steps(run_dir: Path) -> list[int]:
    """The steps ``metrics.jsonl`` records (a damaged line counts as a step that was logged)."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            steps.append(-1)
    return steps


def describe_run(run_dir: Path) -> str | None:
    """What of a run ``run_dir`` holds ("metrics.jsonl with steps 1-5; checkpoints step_00000002..."), or None."""
    parts = []
    steps = metrics_steps(run_dir)
    if steps:
        parts.append(f"metrics.jsonl with {len(steps)} steps, the last {max(steps)}")
    ckpts = sorted(p.name for p in (Path(run_dir) / CHECKPOINTS).glob(f"{PREFIX}*") if p.is_dir())
    if ckpts:
        parts.append(f"checkpoints {', '.join(ckpts[-3:])}" if len(ckpts) <= 3 else
                     f"{len(ckpts)} checkpoints up to {ckpts[-1]}")
    return "; ".join(parts) or None


def checkpoint_to_resume(spec: str | None, run_dir: Path) -> Path | None:
    """The checkpoint ``trainer.resume=spec`` names under the run-dir rules, or None for a fresh run."""
    run = describe_run(run_dir)
    if not spec:
        if run:
            raise ConfigError(f"run_dir={run_dir} already holds a run ({run}); continue it with trainer.resume=latest, "
                              f"or give this run its own run_dir (a fresh run never writes into another run)")
        return None
    own = run_dir / CHECKPOINTS
    if spec == "latest":
        path = latest(own)
        if path is None:
            saved = "; that run saved none (trainer.ckpt_every=0)" if run else ""
            raise CheckpointError(f"trainer.resume=latest: no complete checkpoint under {own}{saved}; train with "
                                  f"trainer.ckpt_every=N first, or set trainer.resume=null in a new run_dir")
        return path
    path = Path(spec).expanduser().absolute()
    if run and path.parent.resolve() != own.resolve():
        raise ConfigError(f"trainer.resume={spec} is not a checkpoint of run_dir={run_dir}, which holds its own run "
                          f"({run}); continue that run with trainer.resume=latest, or branch from {spec} into a new "
                          f"run_dir")
    return path


def cut_metrics(run_dir: Path, step: int) -> int:
    """Keep the rows of ``metrics.jsonl`` up to ``step`` (write-then-rename); returns how many were dropped."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = [line for line, s in zip(lines, metrics_steps(run_dir)) if 0 < s <= step]
    if len(kept) == len(lines):
        return 0
    _write_atomic(path, "".join(line + "\n" for line in kept))
    return len(lines) - len(kept)


def write_hydra_record(run_dir: Path, composed_cfg) -> None:
    """``<run_dir>/.hydra/{config,overrides,hydra}.yaml`` as Hydra writes them, when Hydra runs this job.

    ``train.yaml`` sets ``hydra.output_subdir: null`` so Hydra writes nothing before the run is accepted;
    this writes the same three files then, replacing the directory whole."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    tmp = Path(tempfile.mkdtemp(dir=run_dir, prefix=".hydra.tmp-"))
    try:
        OmegaConf.save(composed_cfg, tmp / "config.yaml")
        OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), tmp / "hydra.yaml")
        OmegaConf.save(hydra_cfg.overrides.task, tmp / "overrides.yaml")
        tmp.chmod(file_mode(executable=True))
        final = run_dir / HYDRA
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def log_to_file(run_dir: Path, logger_name: str = "autoep"):
    """Append the ``autoep`` log to ``<run_dir>/train.log`` for the rest of the run; an error that ends the
    run is recorded there too (its one-line report goes to the console once, by the entry point)."""
    logger = logging.getLogger(logger_name)
    path = str(Path(run_dir) / LOG)
    if any(getattr(h, "baseFilename", None) == path for h in logger.handlers):
        yield
        return
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)  # the file gets the progress lines even where nothing else logs INFO
    logger.addHandler(handler)
    try:
        yield
    except BaseException as e:
        handler.handle(logging.makeLogRecord({"name": logger_name, "levelno": logging.ERROR, "levelname": "ERROR",
                                              "msg": f"run failed: {type(e).__name__}: {e}",
                                              "exc_info": (type(e), e, e.__traceback__)}))
        raise
    finally:
        logger.removeHandler(handler)
        handler.close()


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
