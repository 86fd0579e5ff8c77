"""The frozen artifact: ``<run_dir>/resolved.yaml``, the complete config a run was planned with.

The file is a Hydra primary config of its own (``defaults: [resolved_schema, _self_]``, no groups),
so ``autoep-plan --config-dir <run_dir> --config-name resolved`` replays it without detecting again.
Its last key, ``artifact``, is an end marker holding the plan hash: a file cut short lacks it and
is refused. Writing is rank-0 only and atomic (temp file in the same directory, then ``os.replace``).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from autoep.errors import PlanError
from autoep.plan import replay

RESOLVED_NAME = "resolved.yaml"
HEADER = ("# autoep resolved config: written by autoep, decisions are never edited by hand.\n"
          "# Replay: autoep-plan --config-dir {run_dir} --config-name resolved\n")


def plan_hash(parallel_cfg) -> str:
    """``"sha256:..."`` of a resolved ``parallel`` section (interpolations resolved, key order ignored)."""
    data = OmegaConf.to_container(parallel_cfg, resolve=True) if isinstance(parallel_cfg, DictConfig) else parallel_cfg
    return "sha256:" + hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def artifact_text(cfg: DictConfig) -> str:
    """The YAML of a resolved.yaml for ``cfg``: resolved, location-free, end marker last."""
    data = OmegaConf.to_container(cfg, resolve=True)
    data.pop("artifact", None)
    if "run_dir" in data:
        data["run_dir"] = None  # the artifact is location-free: a replay writes to its own run dir (no key is added)
    body = {"defaults": ["resolved_schema", "_self_"], **data,
            "artifact": {"format": 1, "plan_hash": plan_hash(data["parallel"])}}
    return yaml.safe_dump(body, sort_keys=False)


def file_mode(executable: bool = False) -> int:
    """The mode ``open()`` would give a new file (0644 under the usual umask 022), or a directory's."""
    mask = os.umask(0)  # NOTE: the only way to read the umask is to set it; restored at once
    os.umask(mask)
    return (0o777 if executable else 0o666) & ~mask


def write_resolved(cfg: DictConfig, run_dir) -> Path:
    """Write ``<run_dir>/resolved.yaml`` on rank 0 (write-then-rename, mode as ``open()`` would give it,
    e.g. 0644); every rank gets the path back."""
    path = Path(run_dir) / RESOLVED_NAME
    return write_atomic(path, HEADER.format(run_dir=path.parent) + artifact_text(cfg))


def write_plan(parallel_cfg, run_dir) -> Path:
    """Write ``<run_dir>/resolved.yaml`` holding only a resolved ``parallel`` section and its end marker (what a
    foreign app's ``autoep.ExpertParallel(..., run_dir=...)`` records; ``load_plan`` reads it back). Rank 0 only,
    write-then-rename; every rank gets the path back."""
    path = Path(run_dir) / RESOLVED_NAME
    parallel = OmegaConf.to_container(parallel_cfg, resolve=True) if isinstance(parallel_cfg, DictConfig) else parallel_cfg
    body = {"parallel": parallel, "artifact": {"format": 1, "plan_hash": plan_hash(parallel)}}
    return write_atomic(path, replay.host_header(path) + yaml.safe_dump(body, sort_keys=False))


def write_atomic(path: Path, text: str) -> Path:
    """``path`` gets ``text`` on rank 0 only (temp file in the same directory, fsync, ``os.replace``)."""
    if _rank() != 0:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".resolved.", suffix=".yaml.tmp")
    try:
        os.fchmod(fd, file_mode())  # mkstemp creates 0600: readable by its owner only
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the whole new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_plan(path) -> DictConfig:
    """The resolved ``parallel`` section of a ``resolved.yaml`` (autoep's own, or any app's ``write_plan``),
    checked: a YAML mapping with a ``parallel`` section and its ``artifact`` end marker whose plan hash matches.
    Replaying it (``resolve_plan`` / ``autoep.ExpertParallel``) re-checks each decision's fingerprint."""
    path = Path(path)
    fix = "regenerate it (autoep-plan, or a run with run_dir=...) or restore the file"
    if not path.is_file():
        raise PlanError(f"{path}: no such resolved.yaml; {fix}")
    data = read_yaml(path)
    if data is None:
        raise PlanError(f"{path} is empty, so it holds no resolved plan (a write was cut short, or the file was "
                        f"emptied); {fix}")
    if not isinstance(data, dict) or not isinstance(data.get("parallel"), dict):
        what = f"keys {sorted(data)[:6]}" if isinstance(data, dict) else type(data).__name__
        raise PlanError(f"{path} holds no `parallel:` section ({what}); it is not a resolved.yaml autoep wrote; {fix}")
    marker = data.get("artifact")
    if not isinstance(marker, dict) or "plan_hash" not in marker:
        raise PlanError(f"{path}: the resolved config ends before its `artifact:` end marker, so it was truncated; {fix}")
    written = plan_hash(data["parallel"])
    if marker["plan_hash"] != written:
        raise PlanError(f"{path}: artifact.plan_hash={str(marker['plan_hash'])[:19]}... does not match its parallel "
                        f"section ({written[:19]}...), so the file was edited or damaged after autoep wrote it; {fix}")
    missing = [i for i, e in enumerate(data["parallel"].get("plan") or []) if not (e or {}).get("decision")]
    if missing:
        raise PlanError(f"{path}: parallel.plan.{missing[0]} has no decision, so this is not a resolved plan; {fix}")
    return OmegaConf.create(data["parallel"])


def check_complete(cfg: DictConfig, source: str = "the config") -> None:
    """Refuse a replayed config whose end marker is missing (the file was cut short)."""
    # NOTE: `"artifact" in cfg` is False for a MISSING value; ask the keys instead.
    if "artifact" in cfg.keys() and OmegaConf.is_missing(cfg, "artifact"):
        raise PlanError(f"{source}: the resolved config ends before its `artifact:` end marker, so it was "
                        f"truncated; regenerate it with autoep-plan (or restore the file)")


def read_yaml(path):
    """The YAML document in ``path``, or a ``PlanError`` naming the file when it is not YAML."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise PlanError(f"{path}: not valid YAML{at} ({problem}); it is not a config "
                        f"autoep wrote, or it was truncated: regenerate it with autoep-plan") from None


def load_resolved(path, schema: type) -> DictConfig:
    """Read a resolved.yaml back, typed by the dataclass ``schema`` (the app's resolved schema, e.g.
    ``autoep.train.config.ResolvedConfig``); a clear ``PlanError`` names a broken file."""
    path = Path(path)
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise PlanError(f"{path}: holds {type(data).__name__}, not a resolved config mapping; regenerate "
                        f"it with autoep-plan")
    data.pop("defaults", None)
    written_hash = plan_hash(data.get("parallel"))  # over the text as written, before schema defaults fill in
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(schema), data)
    except OmegaConfBaseException as e:
        raise PlanError(f"{path}: {str(e).splitlines()[0]} (key {e.full_key}); regenerate it with "
                        f"autoep-plan") from None
    check_complete(cfg, str(path))
    if cfg.artifact.plan_hash != written_hash:
        raise PlanError(f"{path}: artifact.plan_hash={cfg.artifact.plan_hash[:19]}... does not match its parallel "
                        f"section ({written_hash[:19]}...), so the file was edited or damaged after autoep wrote it; "
                        f"restore it, or regenerate it with autoep-plan (overrides on the command line are fine)")
    return cfg


def check_plan_consistent(parallel_cfg) -> str:
    """Every rank calls this: all ranks must hold the same resolved plan; returns the plan hash.

    Collective on the default group when torch.distributed is initialised; a no-op otherwise.
    """
    import torch.distributed as dist

    mine = plan_hash(parallel_cfg)
    if not (dist.is_available() and dist.is_initialized()):
        return mine
    hashes: list = [None] * dist.get_world_size()
    # NOTE: all_gather_object pickles through the default group (gloo or NCCL); one small message per rank.
    dist.all_gather_object(hashes, mine)
    if len(set(hashes)) > 1:
        by_hash: dict = {}
        for rank, h in enumerate(hashes):
            by_hash.setdefault(h, []).append(rank)
        groups = "; ".join(f"ranks {ranks}: {h[:19]}" for h, ranks in by_hash.items())
        raise PlanError(f"ranks hold different parallel plans ({groups}); every rank must compose the same "
                        f"config and model code: resolve once and give every rank the same resolved.yaml")
    return mine
