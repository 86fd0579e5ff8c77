"""Typed schemas of the Hydra config tree (``conf/``), registered in Hydra's ConfigStore.

``train_schema`` types the primary config ``train.yaml``; ``resolved_schema`` types a frozen
``resolved.yaml`` (the same tree, plus the ``artifact`` end marker it must carry). Importing this
module registers both; every entry point imports it before Hydra composes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

ON_DRIFT = ("error", "redetect")


@dataclass
class Decision:
    """What ``resolve_plan`` froze for one plan entry; written by autoep, never by hand."""

    source: str = MISSING  # auto | explicit
    structure: Optional[Dict[str, Any]] = None  # every MoeStructure field; null for explicit entries
    modules: List[str] = MISSING  # every matched module FQN
    num_experts: Optional[int] = None  # null only for an explicit entry whose experts cannot be counted
    classes: Dict[str, str] = MISSING  # role -> "module.Qualname@sha256:<source hash>"
    detector_version: str = MISSING
    fingerprint: str = MISSING  # "sha256:..." over everything above, match and local_compute_fn


@dataclass
class PlanEntry:
    match: str = MISSING  # fnmatch pattern over model.named_modules()
    local_compute_fn: Any = "auto"  # "auto" or {_target_: pkg.factory, **kwargs}
    decision: Optional[Decision] = None


@dataclass
class ParallelConfig:
    ep_size: int = 1
    on_drift: str = "error"  # error | redetect: what a replay does when the model's code changed
    detect: bool = True  # false: never run structure detection; every entry must name its _target_
    allowed_targets: List[str] = field(default_factory=list)  # import prefixes allowed besides autoep.recipes
    plan: List[PlanEntry] = field(default_factory=list)


@dataclass
class DataConfig:
    seq_len: int = 32
    batch_size: int = 2  # per rank
    source: str = "synthetic"  # synthetic (learnable permutation task) | text (local file, byte tokens)
    path: Optional[str] = None  # the text file for source=text


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad L2 norm; 0 disables clipping
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # cosine decays lr to lr * min_lr_ratio at the last step
    aux_loss_coef: float = 0.0  # weight of the model's own load-balancing loss, where it returns one


@dataclass
class TrainerConfig:
    steps: int = 10
    seed: int = 0
    grad_accum: int = 1  # micro-batches per optimiser step
    log_every: int = 10  # rank-0 progress line every N steps (metrics.jsonl gets every step)
    ckpt_every: int = 0  # DCP checkpoint every N steps (and at the end); 0: never
    resume: Optional[str] = None  # a step_* checkpoint dir, "latest" (newest under run_dir), or null
    device: str = "auto"  # auto (cuda if available) | cpu | cuda
    timeout_s: int = 300  # collective timeout: a dead rank makes the others fail after this, not hang
    dense_sharding: str = "replicate"  # replicate (all-reduce) | fsdp2 (fully_shard over the world; experts stay on ep)


@dataclass
class Artifact:
    """End marker of a resolved.yaml, written last: a file without it was truncated."""

    format: int = 1
    plan_hash: str = MISSING  # sha256 of the resolved parallel section (what check_plan_consistent compares)


@dataclass
class TrainConfig:
    model: Any = MISSING  # {_target_: ..., **kwargs} building an nn.Module (instantiated on meta to plan)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run_dir: Optional[str] = None  # where resolved.yaml goes; null: Hydra's run dir
    artifact: Optional[Artifact] = None


@dataclass
class ResolvedConfig(TrainConfig):
    artifact: Optional[Artifact] = MISSING  # required: its absence means the file was cut short


def hydra_run_dir(run_dir) -> str:
    """Hydra's run dir: ``run_dir`` when given (so a run keeps all its files in one place), else
    ``outputs/<date>/<time>`` as Hydra's default."""
    import datetime

    return str(run_dir) if run_dir else datetime.datetime.now().strftime("outputs/%Y-%m-%d/%H-%M-%S")


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="resolved_schema", node=ResolvedConfig)
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("autoep.run_dir", hydra_run_dir, replace=True)


register()
