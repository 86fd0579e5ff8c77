"""Typed schemas of the ``parallel`` config section (what a host app's config holds for autoep) and the
resolved artifact's end marker, with the one validation pass every autoep schema uses.

Every value is checked where it is declared: a field's ``metadata`` holds its ``Rule`` (what a valid
value is, and an example); ``check_against`` refuses keys the schema does not declare, wrong types and
values that break a rule, each naming the key, the value and the fix.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from autoep.errors import ConfigError
from autoep.plan.ep_size import valid_ep_size

ON_DRIFT = ("error", "redetect")
# How a plan entry's blocks run their expert work (``MoeStructure.execution``): auto = the fastest proven one,
# grouped > spliced > replay (docs/benchmarks.md, "Execution"); any other: that one, or the entry is refused.
EXECUTIONS = ("auto", "grouped", "spliced", "replay")
# Where random draws inside module experts are made (``PlanEntry.expert_draws``): exact = nowhere (an expert that
# draws is refused); on_owner = on each expert's owner rank, equal in distribution to the model's, not bit-equal.
EXPERT_DRAWS = ("exact", "on_owner")


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
    local_compute_fn: Any = "auto"  # "auto" or {_factory_: pkg.factory, **kwargs} (errors.OPT_OUT_SPELLING)
    # true (the default, here and in the shipped entry, autoep/plan/conf/parallel/default.yaml): take only the
    # matched modules that hold experts; the others (dense MLPs of a model that mixes dense and MoE layers,
    # e.g. DeepSeek-V3's first 3) are listed in decision.skipped. false: every matched module must be an MoE
    # block (or, for an explicit factory of your own, modules autoep finds no experts in)
    moe_only: bool = True
    # true (the default): module experts whose dispatch loop no fast-path proof reads run by the one pass
    # (the block's forward once, autoep.runtime.recipes.replay; README, "Any dispatch loop"), the
    # fallback where the fast paths' proofs refuse. false: such a block is refused, as before that fallback
    record_replay: bool = True
    # auto: the fastest execution autoep proves for the blocks (grouped > spliced > replay; replay only with
    # record_replay). grouped | spliced | replay: that execution (replay: the one pass even where a
    # fast path is proven too), refused naming this key where it is not proven; kept in resolved.yaml and
    # checked against the frozen decision when the artifact is replayed.
    execution: str = field(default="auto", metadata=one_of(EXECUTIONS, "how the blocks' expert work runs"))
    # exact (the default): module experts that draw random numbers (dropout with p > 0 while training) are refused:
    # under EP an expert runs on another rank, on other rows, so its draws cannot be the model's bit for bit.
    # on_owner: an element-wise dropout (nn.Dropout, nn.AlphaDropout, F.dropout) with p > 0 is accepted and draws
    # its masks on the rank that owns the expert, from that rank's generator: equal in distribution to the model
    # (each element dropped with probability p, kept ones scaled by 1/(1-p), the backward through the same mask),
    # not bit-equal. Recorded in decision.structure.expert_draws and the plan table; at p=0 and in eval nothing
    # is drawn and the results are bit-identical to exact. README, "Randomness in experts".
    expert_draws: str = field(default="exact", metadata=one_of(EXPERT_DRAWS, "where the experts' random draws are made"))
    decision: Optional[Decision] = None


@dataclass
class ParallelConfig:
    # ranks that share one copy of the experts (1: no EP), or auto: decided once at resolve time from the world
    # size, the expert counts and memory_gb, and frozen as a number in resolved.yaml (autoep.plan.ep_size)
    ep_size: Any = field(default=1, metadata=_rule(
        valid_ep_size, "an integer >= 1 (ranks that share one copy of the experts; 1: no EP) or auto", "auto"))
    # GB (10^9 bytes) of parameters a rank may hold; with ep_size=auto the smallest degree that fits is taken,
    # with a number that number must fit; null: no limit
    memory_gb: Optional[float] = field(default=None, metadata=_rule(
        lambda v: v is None or (math.isfinite(v) and v > 0), "a finite number > 0 (GB per rank) or null", 80))
    on_drift: str = field(default="error", metadata=one_of(ON_DRIFT, "what a replay does when the model's code changed"))
    detect: bool = True  # false: never run structure detection; every entry must name its _factory_
    allowed_targets: List[str] = field(default_factory=list)  # import prefixes allowed besides autoep.runtime.recipes
    # a resolved.yaml whose frozen parallel section replaces this one (resolve_plan reads it; autoep.plan.replay)
    replay: Optional[str] = None
    plan: List[PlanEntry] = field(default_factory=list)


@dataclass
class Artifact:
    """End marker of a resolved.yaml, written last: a file without it was truncated."""

    format: int = 1
    plan_hash: str = MISSING  # sha256 of the resolved parallel section (what check_plan_consistent compares)


def check_against(cfg, schema: type) -> DictConfig:
    """``cfg`` typed by the dataclass ``schema`` with every value checked (unknown keys, types, rules);
    raises ``ConfigError`` naming the key, the value and the fix."""
    try:
        _refuse_unknown_keys(cfg, schema, "")
        cfg = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        _check_rules(cfg, schema, "")
    except OmegaConfBaseException as e:  # a wrong type, or an interpolation that does not resolve
        raise ConfigError(value_error_message(e, schema)) from None
    return cfg


def value_error_message(e: OmegaConfBaseException, root: type) -> str:
    """One line for OmegaConf's refusal of a value: the key, the problem, the type ``root`` declares."""
    key = (e.full_key or "config").replace("[", ".").replace("]", "")
    problem = str(e).strip().splitlines()[0]
    declared = declared_type(key, root)
    return f"{key}: {problem}; give {key} a value of type {declared}" if declared else f"{key}: {problem}"


def declared_type(key: str, root: type) -> str | None:
    """The type the dataclass ``root`` declares for ``key`` (``trainer.steps`` -> ``int``), or None."""
    schema, hint = root, None
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


def schema_keys(where: str, root: type) -> list[str] | None:
    """The keys ``root`` declares under ``where`` (``""``: the top level), or None where it is free-form."""
    schema = root
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
