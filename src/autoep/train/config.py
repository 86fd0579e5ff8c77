"""Typed schemas of the Hydra config tree (``conf/``), registered in Hydra's ConfigStore.

``train_schema`` types the primary config ``train.yaml``; ``resolved_schema`` types a frozen
``resolved.yaml`` (the same tree, plus the ``artifact`` end marker it must carry). Importing this
module registers both; every entry point imports it before Hydra composes.

Every value is checked where it is declared: a field's ``metadata`` holds its ``Rule`` (what a valid
value is, and an example), and ``check_config`` applies them all in one pass before any work, with the
checks that need more than one field or the machine (``data.path`` for text, ``trainer.device=cuda``).
Keys the schema does not declare are refused there too, also when added with ``+`` on the command line.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from autoep.errors import ConfigError
from autoep.plan import schema as plan_schema
from autoep.plan.schema import Artifact, ParallelConfig, _rule, at_least, finite, one_of, unknown_key_message  # noqa: F401

# The packaged Hydra tree. Absolute, so the console scripts, ``python -m`` and an installed wheel all find it.
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
# The `parallel` group lives with the plan (host apps put pkg://autoep.plan.conf on their search path);
# train.yaml's hydra.searchpath draws it from there.
PLAN_CONF_DIR = str(Path(__file__).resolve().parents[1] / "plan" / "conf")
DEVICES = ("auto", "cpu", "cuda")
DENSE_SHARDING = ("replicate", "fsdp2")
PRECISIONS = ("fp32", "bf16-mixed", "bf16")  # autoep.train.precision says what each computes in
EXPERT_SHARDING = ("replicate", "fsdp2")
ON_NONFINITE = ("error", "skip")
DATA_SOURCES = ("synthetic", "text", "tokens")
AUX_SCOPES = ("global", "local")


@dataclass
class DataConfig:
    seq_len: int = field(default=32, metadata=at_least(2, "tokens per row: an input and its next-token target", 32))
    batch_size: int = field(default=2, metadata=at_least(1, "rows per rank", 8))  # per rank
    # synthetic (learnable permutation task) | text (local file) | tokens (packed .bin/.npy, autoep.train.tokens)
    source: str = field(default="synthetic", metadata=one_of(DATA_SOURCES, "where the tokens come from"))
    path: Optional[str] = None  # the text file (source=text) or packed token file (source=tokens)
    tokenizer_path: Optional[str] = None  # a local HF tokenizer dir: tokenizes text; checks a packed file's vocab
    val_path: Optional[str] = None  # validation data, of the same kind as path
    val_fraction: float = field(default=0.0, metadata=finite("share of path held out for validation", 0.01,
                                                             high=1.0, high_open=True))


def _betas(v) -> bool:
    return len(v) == 2 and all(math.isfinite(b) and 0 <= b < 1 for b in v)


@dataclass
class OptimConfig:
    lr: float = field(default=1e-3, metadata=finite("peak learning rate", 3e-3, low_open=True))
    weight_decay: float = field(default=0.0, metadata=finite("AdamW decoupled weight decay", 0.0))
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95],
                               metadata=_rule(_betas, "two numbers in [0, 1) (AdamW's beta1, beta2)", "[0.9,0.95]"))
    eps: float = field(default=1e-8, metadata=finite("AdamW's epsilon", 1e-8, low_open=True))
    # max global grad L2 norm; 0 disables clipping
    grad_clip: float = field(default=1.0, metadata=finite("max global grad norm; 0: no clipping", 1.0))
    warmup_steps: int = field(default=10, metadata=at_least(0, "linear warmup steps", 10))
    # cosine decays lr to lr * min_lr_ratio at the last step
    min_lr_ratio: float = field(default=0.1, metadata=finite("final lr / peak lr", 0.1, high=1.0))
    # weight of the model's own load-balancing loss, where it returns one
    aux_loss_coef: float = field(default=0.0, metadata=finite("weight of the model's aux loss", 0.01))
    # global: the aux loss on token counts summed over every rank (== one process on the global batch);
    # local: the model's own aux loss on each rank's tokens (autoep.train.balance)
    aux_loss_scope: str = field(default="global", metadata=one_of(AUX_SCOPES, "where the aux loss counts tokens"))
    # weight of the router z-loss: mean over every rank's router rows of logsumexp(router logits)**2
    z_loss_coef: float = field(default=0.0, metadata=finite("weight of the router z-loss", 1e-3))
    # DeepSeek-V3's aux-loss-free balancing: after each step, e_score_correction_bias += rate * sign(mean - load)
    bias_update_rate: float = field(default=0.0, metadata=finite("router bias step per optimiser step; 0: off", 1e-3))


@dataclass
class TrainerConfig:
    steps: int = field(default=10, metadata=at_least(1, "optimiser steps of the whole run", 150))
    seed: int = field(default=0, metadata=at_least(0, "seed of the weights and the data", 0))
    grad_accum: int = field(default=1, metadata=at_least(1, "micro-batches per optimiser step", 2))
    # rank-0 progress line every N steps (metrics.jsonl gets every step)
    log_every: int = field(default=10, metadata=at_least(1, "steps between progress lines", 10))
    # DCP checkpoint every N steps (and at the end); 0: never
    ckpt_every: int = field(default=0, metadata=at_least(0, "steps between checkpoints; 0: never", 50))
    # a step_* checkpoint dir, "latest" (newest under run_dir), or null
    resume: Optional[str] = field(default=None, metadata=_rule(
        lambda v: v is None or bool(str(v).strip()), "latest, a checkpoints/step_* directory, or null", "latest"))
    # auto (cuda if available) | cpu | cuda
    device: str = field(default="auto", metadata=one_of(DEVICES, "where the model runs; auto: cuda if available"))
    # collective timeout: a dead rank makes the others fail after this, not hang
    timeout_s: int = field(default=300, metadata=at_least(1, "seconds a collective may wait for a peer", 300))
    # how long the ranks of a launch wait for each other to join before failing with how many did
    join_timeout_s: int = field(default=60, metadata=at_least(1, "seconds the ranks wait for each other at launch", 60))
    # replicate (all-reduce) | fsdp2 (fully_shard over the world; experts stay on ep)
    dense_sharding: str = field(default="replicate", metadata=one_of(DENSE_SHARDING, "how dense params live"))
    # fp32 | bf16-mixed (autocast, fp32 weights) | bf16 (bf16 copies of the weights); fp32 masters in all
    precision: str = field(default="fp32", metadata=one_of(PRECISIONS, "what forward and backward compute in"))
    # replicate (experts whole on each edp replica) | fsdp2 (each rank's experts FSDP2-sharded over edp)
    expert_sharding: str = field(default="replicate", metadata=one_of(EXPERT_SHARDING, "how expert params live"))
    # error: a non-finite loss or grad norm stops the run (exit 5); skip: that step is skipped and logged
    on_nonfinite: str = field(default="error", metadata=one_of(ON_NONFINITE, "what a non-finite loss does"))
    # validation loss every N steps (and at the last); 0: never. Needs data.val_fraction or data.val_path
    val_every: int = field(default=0, metadata=at_least(0, "steps between validation losses; 0: never", 50))
    val_batches: int = field(default=8, metadata=at_least(0, "global batches per validation; 0: the whole split", 8))
    export_hf: bool = False  # at the end, write <run_dir>/hf: config.json + model.safetensors (from_pretrained)
    # true: torch.compile each decoder layer's dense modules (attention, norms); EP blocks stay eager
    # (autoep.runtime.compile)
    compile: bool = False
    compile_backend: str = "inductor"  # torch.compile backend of trainer.compile (aot_eager: fast, no fusion)


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


# ---------------------------------------------------------------------------------------------
# One validation pass, before any work
# ---------------------------------------------------------------------------------------------


def check_config(cfg, schema: type = None) -> DictConfig:
    """The config typed by ``schema`` (default: ``TrainConfig``, ``ResolvedConfig`` for a replayed file) with
    every value checked; raises ``ConfigError`` naming the key, the value and the fix.

    Unknown keys (a typo, or one added with ``+`` that nothing reads) and wrong types are refused, then
    every field's ``Rule``, then the checks across fields. Reads nothing but the config and the machine.
    """
    if schema is None:
        typed = isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is ResolvedConfig
        schema = ResolvedConfig if typed else TrainConfig
    cfg = plan_schema.check_against(cfg, schema)
    _check_across(cfg)
    return cfg


def value_error_message(e: OmegaConfBaseException) -> str:
    """One line for OmegaConf's refusal of a value in the trainer's config (``TrainConfig`` declares the types)."""
    return plan_schema.value_error_message(e, TrainConfig)


def declared_type(key: str) -> str | None:
    """The type ``TrainConfig`` declares for ``key`` (``trainer.steps`` -> ``int``), or None."""
    return plan_schema.declared_type(key, TrainConfig)


def schema_keys(where: str) -> list[str] | None:
    """The keys ``TrainConfig`` declares under ``where`` (``""``: the top level), or None where it is free-form."""
    return plan_schema.schema_keys(where, TrainConfig)


def _check_across(cfg: DictConfig) -> None:
    """Checks that need two fields or the machine."""
    if cfg.trainer.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"trainer.device=cuda: this machine has no usable CUDA device (torch "
                              f"{torch.__version__}, torch.cuda.is_available() is False); use trainer.device=cpu "
                              f"or trainer.device=auto")
    t = cfg.trainer
    if t.expert_sharding == "fsdp2" and t.precision != "fp32":
        # bf16 weight copies (autoep.train.precision) and FSDP2's own gathers of the experts were never run together
        raise ConfigError(f"trainer.expert_sharding=fsdp2 with trainer.precision={t.precision} is not supported yet; "
                          f"use trainer.precision=fp32, or trainer.expert_sharding=replicate for {t.precision}")
    if t.compile:
        from autoep.runtime.compile import check_backend

        check_backend("trainer.compile_backend", t.compile_backend)
        if t.precision != "fp32":  # bf16 weight copies swap the parameters a compiled module guards on: never run
            raise ConfigError(f"trainer.compile=true with trainer.precision={t.precision} is not supported yet; use "
                              f"trainer.precision=fp32, or trainer.compile=false for {t.precision}")
    _check_data(cfg.data, t.val_every)


def _check_data(data: DictConfig, val_every: int) -> None:
    """The files ``data.*`` names exist and fit ``data.source``; a validation split where one is asked for."""
    from autoep.train.tokens import check_tokenizer_dir, read_sidecar

    if data.source == "synthetic":
        for key in ("path", "tokenizer_path", "val_path", "val_fraction"):
            if data[key]:
                raise ConfigError(f"data.{key}={data[key]} is only read with data.source=text or data.source=tokens "
                                  f"(data.source={data.source}); add data.source=text, or drop data.{key}")
    check = {"text": lambda p, k: check_text_file(p, data.seq_len, k), "tokens": read_sidecar}.get(data.source)
    for key in ("path", "val_path") if check else ():
        if key == "path" or data.val_path is not None:
            check(data[key], f"data.{key}")
    if data.tokenizer_path is not None:
        check_tokenizer_dir(data.tokenizer_path)
    if data.val_path is not None and data.val_fraction:
        raise ConfigError(f"data.val_path={data.val_path} and data.val_fraction={data.val_fraction}: give one "
                          f"validation split, not both")
    if val_every and data.val_path is None and not data.val_fraction:
        raise ConfigError(f"trainer.val_every={val_every} needs a validation split: data.val_fraction=0.01 (held out "
                          f"of data.path) or data.val_path=<a file like data.path>; or trainer.val_every=0")


def check_text_file(path, seq_len: int, key: str = "data.path") -> None:
    """``data.path`` for ``data.source=text``: a local file holding more than ``seq_len`` bytes."""
    if not path:
        raise ConfigError(f"data.source=text needs {key}=<a local text file>; e.g. {key}=corpus.txt")
    file = Path(path)
    if not file.is_file():
        what = "a directory" if file.is_dir() else "not found"
        raise ConfigError(f"{key}={path}: {what} (looked at {file.resolve()}); give a local text file")
    size = file.stat().st_size
    if size <= seq_len:
        raise ConfigError(f"{key}={path} holds {size} bytes, not more than data.seq_len={seq_len}: one row "
                          f"needs seq_len + 1 bytes; use a longer file or a smaller data.seq_len")


def hydra_run_dir(run_dir) -> str:
    """Hydra's run dir: ``run_dir`` when given (so a run keeps all its files in one place), else
    ``outputs/<date>/<time>`` as Hydra's default.

    Hydra creates its run dir before the app runs, so a ``run_dir`` that cannot be created would end in
    Hydra's traceback; Hydra then gets the temp dir instead (it writes nothing there: ``output_subdir``
    and job logging are off) and autoep's own check reports ``run_dir`` in one line."""
    import datetime
    import tempfile

    if not run_dir:
        return datetime.datetime.now().strftime("outputs/%Y-%m-%d/%H-%M-%S")
    try:
        Path(str(run_dir)).expanduser().mkdir(parents=True, exist_ok=True)
    except OSError:
        return tempfile.gettempdir()
    return str(run_dir)


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="resolved_schema", node=ResolvedConfig)
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("autoep.run_dir", hydra_run_dir, replace=True)


register()
