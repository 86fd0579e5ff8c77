"""``autoep-plan``: dry run of the EP plan. Resolve on a meta model, print it, write resolved.yaml.

Builds the model under ``torch.device("meta")`` (no weights), resolves ``parallel`` with
``resolve_plan``, prints one row per matched module and writes ``<run_dir>/resolved.yaml``. Creates
no process group. Commands (any Hydra override works; see docs/overrides.md)::

    autoep-plan                                         # default model (tiny Qwen3-MoE), ep_size 1
    python -m autoep.plan model=mixtral parallel.ep_size=2
    autoep-plan model=deepseek_v3 parallel.ep_size=4 run_dir=runs/dsv3
    autoep-plan --config-dir runs/dsv3 --config-name resolved   # replay: no detection, drift check

Exit status 2 with ``autoep-plan: error: ...`` on a plan error (the message names key, value, fix).
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
import torch
import torch.nn as nn
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import autoep.config  # noqa: F401  (registers train_schema / resolved_schema before Hydra composes)
from autoep.artifact import check_complete, read_yaml, write_resolved
from autoep.errors import PlanError
from autoep.resolve import resolve_plan

# Absolute, so the console script, ``python -m`` and an installed wheel all find the packaged tree.
CONF_DIR = str(Path(__file__).resolve().parent / "conf")
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
    """Resolve ``cfg`` on a meta model, print the table, write ``<run_dir>/resolved.yaml``; returns cfg."""
    check_complete(cfg, source)
    if OmegaConf.is_missing(cfg, "model"):
        raise PlanError("model is not set; pick a model config, e.g. model=qwen3_moe")
    with torch.device("meta"):  # NOTE: parameters get shapes and dtypes only; nothing is allocated
        model = instantiate(cfg.model)
    cfg.parallel = resolve_plan(cfg.parallel, model)
    print(format_table(plan_rows(model, cfg.parallel)))
    path = write_resolved(cfg, run_dir)
    print(f"wrote {path}")
    return cfg


def _fail(e: PlanError) -> None:
    print(f"autoep-plan: error: {e}", file=sys.stderr)
    sys.exit(2)


def _flag(argv: list[str], names: tuple[str, ...]) -> str | None:
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def primary_file(argv: list[str]) -> Path | None:
    """The file ``--config-dir D --config-name N`` names, when it exists."""
    config_dir, name = _flag(argv, ("--config-dir", "-cd")), _flag(argv, ("--config-name", "-cn"))
    if config_dir and name:
        path = Path(config_dir) / (name if name.endswith(".yaml") else name + ".yaml")
        return path if path.is_file() else None
    return None


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        source = primary_file(sys.argv[1:]) or "the composed config"
        plan(cfg, cfg.run_dir or HydraConfig.get().runtime.output_dir, str(source))
    except PlanError as e:
        _fail(e)


def main() -> None:
    try:
        path = primary_file(sys.argv[1:])
        if path is not None:
            read_yaml(path)  # a file that is not YAML gets our error, not Hydra's parser traceback
    except PlanError as e:
        _fail(e)
    _hydra_main()


if __name__ == "__main__":
    main()
