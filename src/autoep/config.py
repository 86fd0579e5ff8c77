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

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from autoep.errors import ConfigError

# The packaged Hydra tree. Absolute, so the console scripts, ``python -m`` and an installed wheel all find it.
CONF_DIR = str(Path(__file__).resolve().parent / "conf")
ON_DRIFT = ("error", "redetect")
DEVICES = ("auto", "cpu", "cuda")
DENSE_SHARDING = ("replicate", "fsdp2")
ON_NONFINITE = ("error", "skip")
DATA_SOURCES = ("synthetic", "text")


@dataclass(frozen=True)
class Rule:
    """What a valid value of a field is (``need``, completing "must be ...") and one valid ``example``."""

    ok: Callable[[Any], bool]
    need: str
    example: str


def _rule(ok: Callable[[Any], bool], need: str, example) -> dict:
    return {"rule": Rule(ok, need, str(example))}


def at_least(low: int, what: str, example) -> dict:
    return _rule(lambda v: v >= low, f"an integer >= {low} ({what})", example)


def finite(what: str, example, *, low: float = 0.0, low_open: bool = False, high: float | None = None,
           high_open: bool = False) -> dict:
    """A finite number in [low, high] (``low_open``/``high_open``: the bound itself excluded)."""
    def ok(v) -> bool:
        above = v > low if low_open else v >= low
        below = high is None or (v < high if high_open else v <= high)
        return math.isfinite(v) and above and below
    span = f"{'>' if low_open else '>='} {low:g}" + (f" and {'<' if high_open else '<='} {high:g}" if high is not None else "")
    return _rule(ok, f"a finite number {span} ({what})", example)


def one_of(choices: tuple, what: str) -> dict:
    return _rule(lambda v: v in choices, f"one of {', '.join(choices)} ({what})", choices[0])


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
    skipped: List[str] = field(default_factory=list)  # moe_only: matched modules without experts (dense), left alone


@dataclass
class PlanEntry:
    match: str = MISSING  # fnmatch pattern over model.named_modules()
    local_compute_fn: Any = "auto"  # "auto" or {_target_: pkg.factory, **kwargs}
    # true: take only the matched modules that have an `experts` submodule; the others (dense MLPs of a
    # model that mixes dense and MoE layers, e.g. DeepSeek-V3's first 3) are listed in decision.skipped
    moe_only: bool = False
    decision: Optional[Decision] = None


@dataclass
class ParallelConfig:
    ep_size: int = field(default=1, metadata=at_least(1, "ranks that share one copy of the experts; 1: no EP", 2))
    on_drift: str = field(default="error", metadata=one_of(ON_DRIFT, "what a replay does when the model's code changed"))
    detect: bool = True  # false: never run structure detection; every entry must name its _target_
    allowed_targets: List[str] = field(default_factory=list)  # import prefixes allowed besides autoep.recipes
    plan: List[PlanEntry] = field(default_factory=list)


@dataclass
class DataConfig:
    seq_len: int = field(default=32, metadata=at_least(2, "tokens per row: an input and its next-token target", 32))
    batch_size: int = field(default=2, metadata=at_least(1, "rows per rank", 8))  # per rank
    # synthetic (learnable permutation task) | text (local file, byte tokens)
    source: str = field(default="synthetic", metadata=one_of(DATA_SOURCES, "where the tokens come from"))
    path: Optional[str] = None  # the text file for source=text


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
    # error: a non-finite loss or grad norm stops the run (exit 5); skip: that step is skipped and logged
    on_nonfinite: str = field(default="error", metadata=one_of(ON_NONFINITE, "what a non-finite loss does"))
    export_hf: bool = False  # at the end, write <run_dir>/hf: config.json + model.safetensors (from_pretrained)


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
    try:
        _refuse_unknown_keys(cfg, schema, "")
        cfg = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        _check_rules(cfg, schema, "")
    except OmegaConfBaseException as e:  # a wrong type, or an interpolation that does not resolve
        raise ConfigError(value_error_message(e)) from None
    _check_across(cfg)
    return cfg


def value_error_message(e: OmegaConfBaseException) -> str:
    """One line for OmegaConf's refusal of a value: the key, the problem, the type the schema declares."""
    key = (e.full_key or "config").replace("[", ".").replace("]", "")
    problem = str(e).strip().splitlines()[0]
    declared = declared_type(key)
    return f"{key}: {problem}; give {key} a value of type {declared}" if declared else f"{key}: {problem}"


def declared_type(key: str) -> str | None:
    """The type ``TrainConfig`` declares for ``key`` (``trainer.steps`` -> ``int``), or None."""
    schema, hint = TrainConfig, None
    for part in key.replace("[", ".").replace("]", "").split("."):
        if schema is None:
            return None
        if part.isdigit():
            continue
        hint = typing.get_type_hints(schema).get(part)
        if hint is None:
            return None
        schema = _field_schema(hint)
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def schema_keys(where: str) -> list[str] | None:
    """The keys the schema declares under ``where`` (``""``: the top level), or None where it is free-form."""
    schema = TrainConfig
    for part in [p for p in where.split(".") if p and not p.isdigit()]:
        hint = typing.get_type_hints(schema).get(part) if schema is not None else None
        schema = _field_schema(hint) if hint is not None else None
    return list(typing.get_type_hints(schema)) if schema is not None else None


def unknown_key_message(key: str, known: list[str]) -> str:
    """``key`` is not declared: name it, what its parent has, the closest key."""
    parent, _, name = key.rpartition(".")
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {parent + '.' if parent else ''}{close[0]}?" if close else \
        f"{parent or 'the config'} has {', '.join(known)}"
    return f"{key}: no such key; {hint} (adding it with + is refused too: nothing would read it)"


def _shown(value) -> str:
    """A value as it would be written on the command line."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_shown(v) for v in value) + "]"
    return str(value)


def _field_schema(hint) -> type | None:
    """The dataclass a field holds (through Optional[...] and List[...]), or None for a plain value."""
    if dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        found = _field_schema(arg)
        if found is not None:
            return found
    return None


def _refuse_unknown_keys(node, schema: type, where: str) -> None:
    if not isinstance(node, (DictConfig, dict)):
        return
    hints = typing.get_type_hints(schema)
    for key in node.keys():
        path = f"{where}.{key}" if where else str(key)
        if key not in hints:
            raise ConfigError(unknown_key_message(path, list(hints)))
        sub = _field_schema(hints[key])
        value = node[key] if not _is_missing(node, key) else None
        if sub is None or value is None:
            continue
        if isinstance(value, (ListConfig, list)):
            for i, item in enumerate(value):
                _refuse_unknown_keys(item, sub, f"{path}.{i}")
        else:
            _refuse_unknown_keys(value, sub, path)


def _is_missing(node, key) -> bool:
    return isinstance(node, DictConfig) and OmegaConf.is_missing(node, key)


def _check_rules(node, schema: type, where: str) -> None:
    for f in dataclasses.fields(schema):
        path = f"{where}.{f.name}" if where else f.name
        if _is_missing(node, f.name):
            continue
        value = node[f.name]
        rule: Rule | None = f.metadata.get("rule")
        if rule is not None and not rule.ok(value):
            raise ConfigError(f"{path}={_shown(value)}: must be {rule.need}; e.g. {path}={rule.example}")
        sub = _field_schema(typing.get_type_hints(schema)[f.name])
        if sub is not None and isinstance(value, DictConfig):
            _check_rules(value, sub, path)


def _check_across(cfg: DictConfig) -> None:
    """Checks that need two fields or the machine."""
    if cfg.trainer.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"trainer.device=cuda: this machine has no usable CUDA device (torch "
                              f"{torch.__version__}, torch.cuda.is_available() is False); use trainer.device=cpu "
                              f"or trainer.device=auto")
    data = cfg.data
    if data.source == "text":
        check_text_file(data.path, data.seq_len)
    elif data.path is not None:
        raise ConfigError(f"data.path={data.path} is only read with data.source=text (data.source={data.source}); "
                          f"add data.source=text, or drop data.path")


def check_text_file(path, seq_len: int) -> None:
    """``data.path`` for ``data.source=text``: a local file holding more than ``seq_len`` bytes."""
    if not path:
        raise ConfigError("data.source=text needs data.path=<a local text file>; e.g. data.path=corpus.txt")
    file = Path(path)
    if not file.is_file():
        what = "a directory" if file.is_dir() else "not found"
        raise ConfigError(f"data.path={path}: {what} (looked at {file.resolve()}); give a local text file")
    size = file.stat().st_size
    if size <= seq_len:
        raise ConfigError(f"data.path={path} holds {size} bytes, not more than data.seq_len={seq_len}: one row "
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
