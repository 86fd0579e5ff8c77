"""``autoep-plan``: dry run of the EP plan. Resolve on a meta model, print it, write resolved.yaml.

Builds the model under ``torch.device("meta")`` (no weights), resolves ``parallel`` with
``resolve_plan``, prints one row per matched module and writes ``<run_dir>/resolved.yaml``. Creates
no process group. Commands (any Hydra override works; see docs/overrides.md)::

    autoep-plan                                         # default model (tiny Qwen3-MoE), ep_size 1
    python -m autoep.plan model=mixtral parallel.ep_size=2
    autoep-plan model=deepseek_v3 parallel.ep_size=4 run_dir=runs/dsv3
    autoep-plan --config-dir runs/dsv3 --config-name resolved   # replay: no detection, drift check

Exit status 2 with ``autoep-plan: error: ...`` on a config or plan error (the message names key, value,
fix); the other codes as ``autoep.cli`` documents. It refuses a run_dir holding a training run (its
resolved.yaml is that run's record) and changes nothing before the plan is resolved.
"""
from __future__ import annotations

import copy
import logging

import hydra
import torch
import torch.nn as nn
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import autoep.config  # noqa: F401  (registers train_schema / resolved_schema before Hydra composes)
from autoep.artifact import check_complete, write_resolved
from autoep.config import CONF_DIR, check_config  # noqa: F401  (CONF_DIR: importers read it from here too)
from autoep.errors import ConfigError

PROG = "autoep-plan"
log = logging.getLogger("autoep.plan")  # not __name__: under `python -m` that is __main__

COLUMNS = ("module", "structure", "compute fn", "experts/rank", "expert bytes/rank")


def structure_label(decision) -> str:
    """``router/shared/storage`` plus the facts that differ from the defaults; ``explicit`` if not detected."""
    s = decision.structure
    if s is None:
        return "explicit"
    flags = [k for k in ("jitter", "expert_bias", "expert_transposed") if s.get(k)]
    flags += [f"{k}={s[k]}" for k, default in (("gate_up_layout", "concatenated"), ("activation", "glu"))
              if s.get(k, default) != default]
    return "/".join([s["router"], s["shared_experts"], s["expert_storage"], *flags])


def plan_rows(model: nn.Module, parallel: DictConfig) -> list[tuple]:
    """One row per matched module (skipped dense ones say so), then the per-rank totals; bytes are of the
    parameters as built (dtype as built): expert ones split over ep, every other one replicated."""
    rows, expert_ids = [], set()
    for entry in parallel.plan:
        decision, n = entry.decision, entry.decision.num_experts
        for name in decision.modules:
            experts = getattr(model.get_submodule(name), "experts", None)
            params = list(experts.parameters()) if experts is not None else []
            expert_ids |= {id(p) for p in params}
            total = sum(p.numel() * p.element_size() for p in params)
            per_rank = n // parallel.ep_size if n else "?"
            rows.append((name, structure_label(decision), entry.local_compute_fn._target_, per_rank,
                         total // parallel.ep_size))
        rows += [(name, "skipped: no experts (dense, moe_only)", "-", "-", "-") for name in decision.get("skipped") or []]
    expert_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) in expert_ids)
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_ids)
    rows.append(("total per rank", f"dense bytes {dense_bytes} (replicated)", "-", "-",
                 expert_bytes // parallel.ep_size))
    return rows


def format_table(rows: list[tuple]) -> str:
    cells = [COLUMNS, *[tuple(str(c) for c in row) for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def plan(cfg: DictConfig, run_dir: str, source: str = "the composed config") -> DictConfig:
    """Resolve ``cfg`` on a meta model, print the table, write ``<run_dir>/resolved.yaml``; returns cfg.

    Every value is checked first (``check_config``), and a run_dir that holds a training run is refused:
    nothing is written unless the plan resolves."""
    from autoep import rundir
    from autoep.models import check_model_config, check_top_k, instantiate_model
    from autoep.resolve import resolve_plan

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
    cfg.parallel = resolve_plan(cfg.parallel, model)
    check_top_k(model, cfg.parallel.plan)
    log.info("%s", format_table(plan_rows(model, cfg.parallel)))
    path = write_resolved(cfg, out)
    rundir.write_hydra_record(out, composed)
    log.info("wrote %s", path)
    return cfg


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    import sys

    from autoep import cli

    source = cli.primary_file(sys.argv[1:]) or "the composed config"
    cli.task(PROG, lambda: plan(cfg, cfg.run_dir or HydraConfig.get().runtime.output_dir, str(source)))


def main() -> None:
    """``autoep-plan [overrides]``: one-line errors and exit codes as ``autoep.cli`` documents."""
    from autoep import cli

    cli.main(PROG, _hydra_main)


if __name__ == "__main__":
    main()
