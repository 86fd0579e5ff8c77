"""``autoep-plan``: dry run of the EP plan. Resolve on a meta model, print it, write resolved.yaml.

Builds the model under ``torch.device("meta")`` (no weights), resolves ``parallel`` with
``resolve_plan``, prints one row per matched module and writes ``<run_dir>/resolved.yaml``. Creates
no process group. Commands (any Hydra override works; see docs/overrides.md)::

    autoep-plan                                         # default model (tiny Qwen3-MoE), ep_size 1
    python -m autoep.train.dry_run model=mixtral parallel.ep_size=2
    autoep-plan model=deepseek_v3 parallel.ep_size=4 run_dir=runs/dsv3
    WORLD_SIZE=8 autoep-plan model=deepseek_v3 parallel.ep_size=auto   # auto: decided for 8 ranks
    autoep-plan --config-dir runs/dsv3 --config-name resolved   # replay: no detection, drift check

Exit status 2 with ``autoep-plan: error: ...`` on a config or plan error (the message names key, value,
fix); the other codes as ``autoep.train.command`` documents. It refuses a run_dir holding a training run (its
resolved.yaml is that run's record) and changes nothing before the plan is resolved.
"""
from __future__ import annotations

import copy
import logging
import os

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import autoep.train.config  # noqa: F401  (registers train_schema / resolved_schema before Hydra composes)
from autoep.errors import ConfigError
from autoep.plan.artifact import check_complete, write_resolved
from autoep.plan.table import format_table, plan_rows
from autoep.train.config import CONF_DIR, check_config  # noqa: F401  (CONF_DIR: importers read it from here too)

PROG = "autoep-plan"
log = logging.getLogger("autoep.train.dry_run")  # not __name__: under `python -m` that is __main__

def plan(cfg: DictConfig, run_dir: str, source: str = "the composed config") -> DictConfig:
    """Resolve ``cfg`` on a meta model, print the table, write ``<run_dir>/resolved.yaml``; returns cfg.

    Every value is checked first (``check_config``), and a run_dir that holds a training run is refused:
    nothing is written unless the plan resolves."""
    from autoep.plan.resolve import resolve_plan
    from autoep.train import rundir
    from autoep.train.models import check_model_config, check_top_k, instantiate_model

    composed = copy.deepcopy(cfg)
    check_complete(cfg, source)
    cfg = check_config(cfg)
    check_model_config(cfg)
    out = rundir.prepare(run_dir)
    run = rundir.describe_run(out)
    if run:
        raise ConfigError(f"run_dir={out} holds a training run ({run}); its resolved.yaml is that run's record, "
                          f"so autoep-plan does not replace it: plan into another run_dir")
    with torch.device("meta"):  # NOTE: parameters get shapes and dtypes only; nothing is allocated
        model = instantiate_model(cfg.model)
    # parallel.ep_size=auto is decided for the world a launcher would give (WORLD_SIZE, as torchrun sets it)
    cfg.parallel = resolve_plan(cfg.parallel, model, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    check_top_k(model, cfg.parallel.plan)
    log.info("%s", format_table(plan_rows(model, cfg.parallel)))
    path = write_resolved(cfg, out)
    rundir.write_hydra_record(out, composed)
    log.info("wrote %s", path)
    return cfg


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    import sys

    from autoep.train import command as cli

    source = cli.primary_file(sys.argv[1:]) or "the composed config"
    cli.task(PROG, lambda: plan(cfg, cfg.run_dir or HydraConfig.get().runtime.output_dir, str(source)))


def main() -> None:
    """``autoep-plan [overrides]``: one-line errors and exit codes as ``autoep.train.command`` documents."""
    from autoep.train import command as cli

    cli.main(PROG, _hydra_main)


if __name__ == "__main__":
    main()
