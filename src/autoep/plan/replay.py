"""Replaying a frozen plan in the app that wrote it, when that app is not autoep's own trainer.

A host app (someone else's training repo) keeps its own config; autoep writes only the frozen
``parallel`` section to ``<run_dir>/resolved.yaml`` (``autoep.plan.artifact``). The host replays it with
its own command plus one override, which every Hydra app accepts whether or not its config declares
the key (``++`` adds or sets)::

    python train.py trainer.max_steps=5 ++parallel.replay=/abs/run/resolved.yaml

``resolve_plan`` sees ``parallel.replay`` and takes the file's section (checked: end marker, plan hash,
and then every entry's fingerprint against the model, as any replay) instead of the composed one; the
resolved section it returns has ``replay: null``, so a replayed run records the same plan hash. From
Python the same is ``autoep.ExpertParallel(model, autoep.load_plan(path))``.

``host_header(path)`` is the comment block that opens such a file: the exact replay command of the
process that writes it (launcher, script or ``-m`` module, Hydra's ``--config-name``/``--config-dir``
and its task overrides, minus ``parallel.*``, which the file holds), and the Python form.
"""
from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path

from omegaconf import DictConfig

from autoep.errors import PlanError

log = logging.getLogger(__name__)

REPLAY_KEY = "parallel.replay"


def host_header(path) -> str:
    """The comment lines that open a host app's ``resolved.yaml`` at ``path``: how to replay it."""
    path = Path(path).resolve()
    lines = ["# autoep resolved plan: the frozen `parallel` section of a run, written by autoep; decisions are "
             "never edited by hand.",
             "# Replay it in the app that wrote it (no detection; fingerprints re-checked, drift is an error):"]
    command = host_command()
    if command is not None:
        lines.append(f"#   {command} {shlex.quote(f'++{REPLAY_KEY}={path}')}")
    lines.append(f"#   from Python: autoep.ExpertParallel(model, autoep.load_plan({str(path)!r}))")
    return "\n".join(lines) + "\n"


def host_command() -> str | None:
    """The command line that re-runs this process's app with its Hydra overrides minus ``parallel.*``;
    None when the app is not a Hydra app (its arguments mean nothing autoep can rewrite)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    words = [*_launcher(), *_program(), "--config-name", hc.job.config_name]
    for source in hc.runtime.config_sources:
        if source.provider == "command-line" and source.schema == "file":
            words += ["--config-dir", source.path]
    words += [o for o in hc.overrides.task if not _sets_parallel(o)]
    return " ".join(shlex.quote(str(w)) for w in words)


def _sets_parallel(override: str) -> bool:
    key = override.lstrip("~+").split("=", 1)[0].split("@", 1)[0]
    return key == "parallel" or key.startswith("parallel.")


def _launcher() -> list[str]:
    """``torchrun --nproc-per-node N`` when torchrun started this process, else ``python``."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return ["python"]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    world = int(os.environ.get("WORLD_SIZE", str(local)))
    nodes = ["--nnodes", str(world // local)] if world != local else []
    return ["torchrun", *nodes, "--nproc-per-node", str(local)]


def _program() -> list[str]:
    """``-m pkg.mod`` for ``python -m``, else the script as it was given."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        name = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return ["-m", name]
    return [sys.argv[0]]


def replayed(cfg: DictConfig, load_plan) -> DictConfig | None:
    """The frozen section ``cfg.replay`` names (read with ``load_plan``, which checks it), or None when
    ``cfg`` replays nothing. The composed section is then not used: that is logged, never silent."""
    path = cfg.get("replay")
    if path is None:
        return None
    path = _absolute(path)
    if not path.is_file():
        raise PlanError(f"{REPLAY_KEY}={path}: no such file; give the resolved.yaml of the run to replay "
                        f"(its header shows the line), or drop {REPLAY_KEY}")
    section = load_plan(path)
    if section.get("replay") is not None:
        raise PlanError(f"{path}: its parallel section has replay={section.replay!r}; a resolved plan records "
                        f"replay: null. Regenerate the file, or restore it")
    log.info("%s=%s: replaying its frozen plan (%d entries, ep_size %s); the composed parallel section is not used",
             REPLAY_KEY, path, len(section.plan), section.ep_size)
    return section


def _absolute(path) -> Path:
    """``path`` against the directory the app was started in (Hydra may have changed into its run dir)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized() and not os.path.isabs(str(path)):
        from hydra.utils import to_absolute_path

        return Path(to_absolute_path(str(path)))
    return Path(path).resolve()

