"""Freeze a parallel plan: every entry's compute fn decided once and recorded with its evidence.

``resolve_plan(parallel_cfg, model)`` takes the ``parallel`` section (DictConfig or plain dict; keys
it omits take ``autoep.plan.schema.ParallelConfig``'s defaults) and a model (on meta is enough: nothing
here runs a forward or allocates) and returns the typed section with every plan entry carrying a
``decision``. An entry that already carries one (a replay of resolved.yaml) is not decided again:
its seal and its code fingerprint are recomputed and compared.
"""
from __future__ import annotations

import difflib
import fnmatch
import importlib
import inspect
import logging
import re
from collections.abc import Mapping

import torch.nn as nn
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from autoep.detect import adapters, row_local, sharing, structure
from autoep.errors import (DRAWS_OPT_IN, OPT_OUT_HINT, OPT_OUT_SPELLING, DriftError, PlanError,
                           UnsupportedModuleStructure, UnsupportedPlanEntry)
from autoep.plan import archetypes, replay
from autoep.plan import ep_size as auto_ep
from autoep.plan.artifact import load_plan
from autoep.plan.fingerprint import class_hashes, seal
from autoep.plan.schema import EXECUTIONS, EXPERT_DRAWS, ON_DRIFT, ParallelConfig, PlanEntry
from autoep.plan.table import param_bytes
from autoep.targets import FACTORY_KEY, check_not_moved, factory_key, factory_mapping, factory_spec, import_object

log = logging.getLogger(__name__)

AUTO = "auto"
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
SEALED_FIELDS = ("source", "structure", "modules", "num_experts", "classes", "detector_version")


def resolve_plan(parallel_cfg, model: nn.Module, *, world_size: int | None = None) -> DictConfig:
    """The ``parallel`` section with every plan entry frozen; raises ``PlanError`` naming key, value, fix.
    ``world_size``: the ranks the run has, needed only where ``parallel.ep_size`` is ``auto`` (which becomes
    the number ``autoep.plan.ep_size`` decides). PEFT's LoRA wrappers around batched experts are seen through
    (``autoep.detect.adapters``): the proofs read the experts they call."""
    with adapters.peeled(model):
        return _resolve_plan(parallel_cfg, model, world_size)


def _resolve_plan(parallel_cfg, model: nn.Module, world_size: int | None) -> DictConfig:
    cfg = typed_parallel(parallel_cfg)
    if not auto_ep.valid_ep_size(cfg.ep_size):
        raise PlanError(f"parallel.ep_size={cfg.ep_size!r} must be a positive integer or auto; use 1 to run "
                        f"without EP")
    if cfg.on_drift not in ON_DRIFT:
        raise PlanError(f"parallel.on_drift={cfg.on_drift!r} is not one of {list(ON_DRIFT)}")
    modules = dict(model.named_modules())
    owner: dict[str, int] = {}
    plan = []
    for i, entry in enumerate(cfg.plan):
        resolved = resolve_entry(f"parallel.plan.{i}", _plain(entry), cfg, modules)
        for name in resolved["decision"]["modules"]:
            if name in owner:
                raise PlanError(f"{name} is matched by parallel.plan.{owner[name]} and parallel.plan.{i}; "
                                f"narrow one of the match patterns so each module has one entry")
            owner[name] = i
        plan.append(resolved)
    check_sharing(model, modules, {n: _expert_paths(entry["decision"].get("structure") or {})
                                   for entry in plan for n in entry["decision"]["modules"]})
    resolved = OmegaConf.merge(cfg, {"plan": plan})  # merge, not assignment: validates the dicts as PlanEntry
    per_rank = _bytes_per_rank(model, resolved)
    if auto_ep.is_auto(cfg.ep_size):
        counts = {e["decision"]["modules"][0]: e["decision"]["num_experts"] for e in plan}
        resolved.ep_size = auto_ep.decide(world_size, counts, per_rank, cfg.memory_gb)
    else:
        auto_ep.check_fits(cfg.ep_size, per_rank, cfg.memory_gb)
    return resolved


def _bytes_per_rank(model: nn.Module, parallel: DictConfig):
    """``d -> parameter bytes one rank holds at ep_size=d`` (the plan table's count, computed once)."""
    expert_bytes, dense_bytes = param_bytes(model, parallel)
    return lambda d: dense_bytes + expert_bytes // d


def _expert_paths(structure: dict) -> list[str]:
    """The children of a block holding its experts: ``experts_path``, or those of ``expert_members``."""
    members = structure.get("expert_members") or ()
    return list(dict.fromkeys(p.split(".")[0] for expert in members for p in expert)) if members else [
        structure.get("experts_path") or "experts"]


def check_sharing(model: nn.Module, modules: dict, experts_paths: dict[str, str | list[str]]) -> None:
    """Every expert tensor of the matched blocks (``{name: experts path, or the paths holding them}``) is reached
    by one name in the whole model (``autoep.detect.sharing``): tied to a shared expert's, shared by two blocks, a
    block registered twice."""
    paths = sharing.tensor_paths(model)
    for name, held_at in experts_paths.items():
        shared = [line for experts_path in ([held_at] if isinstance(held_at, str) else held_at)
                  for line in sharing.shared_expert_tensors(model, {name: modules[name]}, experts_path, paths)]
        if shared:
            cls = type(modules[name]).__name__
            raise UnsupportedPlanEntry(f"parallel.plan matches {name} ({cls}), whose {shared[0]}: "
                                       f"{sharing.SHARING_FIX}", cls, shared[0])


def typed_parallel(parallel_cfg) -> DictConfig:
    """Merge onto the schema: unknown keys and wrong types become a ``PlanError`` naming the key. A section
    with ``replay: <resolved.yaml>`` becomes that file's frozen section (``autoep.plan.replay``)."""
    cfg = _typed(parallel_cfg)
    frozen = replay.replayed(cfg, load_plan)
    return cfg if frozen is None else _typed(frozen)


def _typed(parallel_cfg) -> DictConfig:
    raw = _plain(parallel_cfg if parallel_cfg is not None else {}, "parallel")
    plan = raw.pop("plan", None) or []
    cfg = _merge_typed(ParallelConfig, raw, "parallel")
    if not isinstance(plan, (list, tuple)):
        raise PlanError(f"parallel.plan={plan!r} must be a list of {{match, local_compute_fn}} entries")
    entries = [_merge_typed(PlanEntry, _entry(e, f"parallel.plan.{i}"), f"parallel.plan.{i}") for i, e in enumerate(plan)]
    for i, entry in enumerate(entries):
        if OmegaConf.is_missing(entry, "match"):
            raise PlanError(f"parallel.plan.{i}.match is required: an fnmatch pattern such as 'model.layers.*.mlp'")
    return OmegaConf.merge(cfg, {"plan": entries})


def _merge_typed(schema: type, raw: dict, where: str) -> DictConfig:
    try:
        return OmegaConf.merge(OmegaConf.structured(schema), raw)
    except OmegaConfBaseException as e:
        key = f"{where}.{e.full_key}" if getattr(e, "full_key", None) else where
        first_line = str(getattr(e, "msg", e)).splitlines()[0]
        fields = schema.__dataclass_fields__
        fix = (f"valid keys of {where}: {', '.join(fields)}" if isinstance(e, ConfigKeyError)
               else f"give a value of the type autoep.plan.schema.{schema.__name__} declares")
        raise PlanError(f"{key}: {first_line}; {fix}") from None


def _entry(node, where: str) -> dict:
    """A plan entry as a plain dict; a ``functools.partial`` compute fn (a host's recursive ``instantiate`` of
    ``{_target_: pkg.fn, _partial_: true}``) read back as the mapping it was instantiated from."""
    entry = _plain(node, where)
    if "local_compute_fn" in entry:
        entry["local_compute_fn"] = factory_mapping(entry["local_compute_fn"], f"{where}.local_compute_fn")
    return entry


def _plain(node, where: str = "plan entry") -> dict:
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)
    if not isinstance(node, Mapping):
        raise PlanError(f"{where} must be a mapping, got {type(node).__name__}: {node!r}")
    return dict(node)


def resolve_entry(key: str, entry: dict, parallel: DictConfig, modules: dict[str, nn.Module]) -> dict:
    check_execution(key, entry)
    check_expert_draws(key, entry)
    matched = match_modules(key, entry["match"], modules)
    skipped: list[str] = []
    if entry.get("moe_only"):
        matched, skipped = split_moe(key, entry["match"], matched, modules)
    if entry.get("decision") is not None:
        return replay_entry(key, entry, parallel, modules, matched, skipped)
    return decide_entry(key, entry, parallel, modules, matched, skipped)


def _draws_on_owner(entry: Mapping) -> bool:
    """The entry's ``expert_draws`` is on_owner (``PlanEntry``: exact unless the entry says so)."""
    return entry.get("expert_draws", "exact") == "on_owner"


def _record_replay(entry: Mapping) -> bool:
    """The entry's ``record_replay`` (``PlanEntry``: true unless the entry says false)."""
    return bool(entry.get("record_replay", True))


def split_moe(key: str, pattern: str, matched: list[str], modules: dict) -> tuple[list[str], list[str]]:
    """(modules with experts, found by data flow as the detector finds them, the others): what a ``moe_only``
    entry takes and skips. The experts containers the one-pass execution finds count whatever the entry's
    ``record_replay``: with false, such a block is refused naming why no fast path takes it, not skipped."""
    moe = [n for n in matched if structure.has_experts(modules[n])]
    if not moe:
        raise PlanError(f"{key}.match={pattern!r} with moe_only=true matches {len(matched)} modules and none has an "
                        f"`experts` submodule; {_where_the_experts_are(pattern, modules)} (or set {key}.moe_only=false "
                        f"for an explicit factory of your own over modules without experts)")
    return moe, [n for n in matched if n not in moe]


def match_modules(key: str, pattern: str, modules: dict[str, nn.Module]) -> list[str]:
    """Module names ``pattern`` matches (fnmatch), or a ``PlanError`` suggesting globs that do match MoE blocks."""
    matched = [name for name in modules if fnmatch.fnmatchcase(name, pattern)]
    if matched:
        return matched
    raise PlanError(f"{key}.match={pattern!r} matches no module of the model (fnmatch over model.named_modules()); "
                    f"{_where_the_experts_are(pattern, modules)}")


def _where_the_experts_are(pattern: str, modules: dict[str, nn.Module]) -> str:
    """A suggestion for a pattern that missed the MoE blocks: globs over the innermost modules holding experts
    (found by data flow, as ``moe_only`` and the detector find them; layer indices written as ``*``), closest
    to ``pattern`` first, each matching at least one block; or the closest module names when none has experts."""
    holders = [n for n, m in modules.items() if n and structure.has_experts(m)]
    # NOTE: has_experts is also true of a module it cannot read (a decoder, the model itself), so only the
    # innermost holders are MoE blocks.
    blocks = [n for n in holders if not any(h.startswith(n + ".") for h in holders)]
    globs = list(dict.fromkeys(".".join("*" if part.isdigit() else part for part in n.split(".")) for n in blocks))
    if not globs:
        close = difflib.get_close_matches(pattern, [n for n in modules if n], n=5, cutoff=0.0)
        return f"no module of the model holds experts; closest module names: {close}"
    globs.sort(key=lambda g: -difflib.SequenceMatcher(None, pattern, g).ratio())
    return f"globs that match its MoE blocks: {globs[:5]}; e.g. match: {globs[0]!r}"


def decide_entry(key: str, entry: dict, parallel: DictConfig, modules: dict, matched: list[str],
                 skipped: list[str] | None = None) -> dict:
    fn = entry.get("local_compute_fn", AUTO)
    if fn == AUTO:
        if not parallel.detect:
            raise PlanError(f"{key}.local_compute_fn=auto but parallel.detect=false, so nothing may be detected. "
                            f"Name the factory ('{key}.local_compute_fn={{{FACTORY_KEY}:pkg.fn}}') or remove the entry")
        structure_dict, num_experts = _detect_group(key, entry["match"], modules, matched,
                                                   replay=_record_replay(entry),
                                                   execution=entry.get("execution", AUTO),
                                                   draws_on_owner=_draws_on_owner(entry))
        cls_name = type(modules[matched[0]]).__name__
        fn = archetypes.compute_fn_config(structure.MoeStructure(**structure_dict), cls_name)
        source = "auto"
    else:
        structure_dict, num_experts, source = None, _count_explicit(modules, matched), "explicit"
    check_compute_fn(key, fn, parallel.allowed_targets)
    check_ep_size(parallel.ep_size, num_experts, matched)
    if source == "explicit":
        check_recipe_fits(key, fn, modules, matched)
    fn = as_factory(fn)
    decision = {
        "source": source,
        "structure": structure_dict,
        "modules": matched,
        "num_experts": num_experts,
        "classes": class_hashes([modules[n] for n in matched]),
        "detector_version": structure.DETECTOR_VERSION,
        "skipped": list(skipped or []),
    }
    decision["fingerprint"] = seal_entry(entry["match"], fn, decision)
    out = {"match": entry["match"], "local_compute_fn": fn, "decision": decision}
    # record_replay is written as given (false must survive a replay of the file: its default is true)
    flags = {"moe_only": True} if entry.get("moe_only") else {}
    if entry.get("execution", AUTO) != AUTO:
        flags["execution"] = entry["execution"]
    if _draws_on_owner(entry):  # the opt-in, kept in resolved.yaml (a replay checks it against the decision)
        flags["expert_draws"] = entry["expert_draws"]
    return out | flags | {"record_replay": _record_replay(entry)}


def check_execution(key: str, entry: dict) -> None:
    """``execution`` is one of ``schema.EXECUTIONS``, and other than auto only where autoep decides (an explicit
    factory runs as it is written); a frozen decision's execution is the one the entry asks for."""
    execution = entry.get("execution", AUTO)
    if execution not in EXECUTIONS:
        raise PlanError(f"{key}.execution={execution!r} is not one of {list(EXECUTIONS)}; e.g. {key}.execution=auto "
                        f"(the fastest execution autoep proves)")
    fn, decision = entry.get("local_compute_fn", AUTO), entry.get("decision")
    if execution != AUTO and fn != AUTO and (decision is None or decision.get("source") != "auto"):
        raise PlanError(f"{key}.execution={execution} chooses among autoep's own executions, but "
                        f"{key}.local_compute_fn names a factory, which runs as written; set {key}.execution=auto or "
                        f"{key}.local_compute_fn=auto")
    frozen = ((decision or {}).get("structure") or {}).get("execution")
    if execution != AUTO and frozen is not None and frozen != execution:
        raise PlanError(f"{key}.execution={execution}, but its frozen decision runs execution={frozen}; a resolved "
                        f"plan keeps the execution it was resolved with: drop the decision ({key}.decision=null) "
                        f"to decide afresh, or set {key}.execution={frozen}")


def check_expert_draws(key: str, entry: dict) -> None:
    """``expert_draws`` is one of ``schema.EXPERT_DRAWS``, on_owner only where autoep decides (an explicit factory
    runs as it is written), and a frozen decision that draws on the owner is replayed with the opt-in."""
    draws = entry.get("expert_draws", "exact")
    if draws not in EXPERT_DRAWS:
        raise PlanError(f"{key}.expert_draws={draws!r} is not one of {list(EXPERT_DRAWS)}; e.g. "
                        f"{key}.expert_draws=exact (experts that draw random numbers are refused) or "
                        f"{key}.expert_draws=on_owner (their draws made on each expert's owner: equal in distribution, "
                        "not bit-equal)")
    fn, decision = entry.get("local_compute_fn", AUTO), entry.get("decision")
    if draws != "exact" and fn != AUTO and (decision is None or decision.get("source") != "auto"):
        raise PlanError(f"{key}.expert_draws={draws} is a choice of autoep's own executions, but "
                        f"{key}.local_compute_fn names a factory, which runs as written; set {key}.expert_draws=exact "
                        f"or {key}.local_compute_fn=auto")
    frozen = ((decision or {}).get("structure") or {}).get("expert_draws")
    if frozen and draws == "exact":
        raise PlanError(f"{key}.expert_draws=exact, but its frozen decision draws on the experts' owners "
                        f"({list(frozen)[0]}{' ...' if len(frozen) > 1 else ''}); set {key}.{DRAWS_OPT_IN} as it was "
                        f"resolved, or drop the decision ({key}.decision=null) to decide afresh")


def as_factory(fn: Mapping) -> dict:
    """``fn`` with its factory under ``_factory_`` (the key Hydra's ``instantiate`` never calls), first."""
    _, target, kwargs = factory_spec(fn)
    return {FACTORY_KEY: target, **kwargs}


def seal_entry(match: str, fn, decision: Mapping) -> str:
    sealed = {"match": match, "local_compute_fn": fn, **{k: decision.get(k) for k in SEALED_FIELDS}}
    if decision.get("skipped"):  # sealed only when present, so plans resolved before it replay unchanged
        sealed["skipped"] = list(decision["skipped"])
    return seal(sealed)


def _detect_group(key: str, pattern: str, modules: dict, matched: list[str], *,
                  replay: bool = True, execution: str = AUTO, draws_on_owner: bool = False) -> tuple[dict, int]:
    """One (structure, expert count) for every matched module, or an error naming the groups (``replay``: the
    the one-pass execution fallback for module experts is allowed, ``PlanEntry.record_replay``, the default;
    ``execution``: ``PlanEntry.execution``, auto or the one asked for; ``draws_on_owner``: ``PlanEntry.expert_draws``
    is on_owner)."""
    groups: dict[tuple[structure.MoeStructure, int], list[str]] = {}
    for name in matched:
        try:
            found = _detect_execution(key, name, modules[name], replay, execution, draws_on_owner)
            n = structure.count_experts(modules[name], found)
        except UnsupportedModuleStructure as e:
            reason = e.reason.replace(DRAWS_OPT_IN, f"{key}.{DRAWS_OPT_IN}")  # the opt-in this entry would set
            raise UnsupportedPlanEntry(
                f"{key}.match={pattern!r} matched {name} ({e.cls_name}), which auto cannot take: {reason}"
                f"{adapters.tuner_layers_hint(modules[name])}. Narrow the match to MoE blocks, or opt out. "
                f"{OPT_OUT_HINT}", e.cls_name, e.reason) from e
        groups.setdefault((found, n), []).append(name)
    if len(groups) > 1:
        shown = "; ".join(f"{names[:3]}{' ...' if len(names) > 3 else ''} -> {s.as_dict()} with {n} experts"
                          for (s, n), names in groups.items())
        raise PlanError(f"{key}.match={pattern!r} matches modules that resolve differently: {shown}. "
                        f"Split the glob into one entry per group, or declare {key}.local_compute_fn explicitly")
    (found, n), = groups
    return found.as_dict(), n


def _detect_execution(key: str, name: str, module: nn.Module, replay: bool, execution: str,
                      draws_on_owner: bool = False) -> structure.MoeStructure:
    """The block's structure under ``execution``: auto, the fastest proven one (the detector's order, grouped or
    spliced where a fast path is proven, else replay where ``replay`` allows it: docs/benchmarks.md says why);
    replay, the one-pass execution even where a fast path is proven too; grouped | spliced, the fast path's
    structure if it is that execution, else a ``PlanError`` naming the key."""
    if execution == "replay":
        return structure.replay_structure(module, draws_on_owner=draws_on_owner)
    found = structure.detect_moe_structure(module, replay=replay and execution == AUTO, draws_on_owner=draws_on_owner)
    if execution not in (AUTO, found.execution):
        raise PlanError(f"{key}.execution={execution}: {name} ({type(module).__name__}) is proven for "
                        f"execution={found.execution} (expert_storage={found.expert_storage}), not {execution}; set "
                        f"{key}.execution={found.execution}, or auto")
    return found


def _count_explicit(modules: dict, matched: list[str]) -> int | None:
    """Expert count of an explicit entry's modules; None when they are not countable (the user's own)."""
    counts = set()
    for name in matched:
        try:
            counts.add(structure.count_experts(modules[name]))
        except UnsupportedModuleStructure:
            return None
    return counts.pop() if len(counts) == 1 else None


def check_ep_size(ep_size, num_experts: int | None, matched: list[str]) -> None:
    if num_experts is None or auto_ep.is_auto(ep_size) or num_experts % ep_size == 0:
        return
    valid = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
    raise PlanError(f"parallel.ep_size={ep_size} does not divide num_experts={num_experts} of {matched[0]}; "
                    f"pick one of {valid}")


def check_compute_fn(key: str, fn, allowed_targets) -> None:
    """A well-formed, allowed factory path (``_factory_`` or ``_target_``) whose kwargs bind to the factory;
    nothing disallowed is imported."""
    name = factory_key(fn, f"{key}.local_compute_fn") if isinstance(fn, Mapping) else None
    if name is None:
        raise PlanError(f"{key}.local_compute_fn={fn!r} must be 'auto' or a mapping naming its factory: "
                        f"{key}.local_compute_fn: {OPT_OUT_SPELLING}")
    _, target, kwargs = factory_spec(fn)
    where = f"{key}.local_compute_fn.{name}"
    check_not_moved(target, where)
    if not isinstance(target, str) or not DOTTED.fullmatch(target):
        raise PlanError(f"{where}={target!r} is not a dotted import path like 'my_pkg.module.factory'")
    prefixes = [archetypes.RECIPES, *allowed_targets]
    if not any(target == p or target.startswith(p.rstrip(".") + ".") for p in prefixes):
        raise PlanError(f"{where}={target!r} is not under an allowed prefix {prefixes}; "
                        f"add its package to parallel.allowed_targets (e.g. 'parallel.allowed_targets="
                        f"[{target.rsplit('.', 1)[0]}]') if you trust that code")
    _check_binds(where, target, kwargs)


def _check_binds(where: str, target: str, kwargs: dict) -> None:
    try:
        factory = import_object(target)
    except (ImportError, AttributeError) as e:
        if target in archetypes.known_targets():
            # The table names it but the runtime has not shipped it in this install; apply_plan will say so.
            log.debug("%s: cannot import %s yet (%s); skipping the kwargs check", where, target, e)
            return
        raise PlanError(f"{where}={target!r} cannot be imported ({e}); "
                        f"check the spelling and that its package is installed") from None
    try:
        inspect.signature(factory).bind(nn.Module(), ep_mesh=None, **kwargs)
    except (TypeError, ValueError) as e:
        raise PlanError(f"{where.rpartition('.')[0]}: keys {sorted(kwargs)} do not bind to "
                        f"{target}{_signature(factory)} ({e}); the factory contract is factory(module, *, ep_mesh, "
                        f"**kwargs): make the keys next to {where.rpartition('.')[2]} its keyword parameters") from None


def check_recipe_fits(key: str, fn: Mapping, modules: dict, matched: list[str]) -> None:
    """An explicit shipped recipe must fit every module it will bind to (proofs, facts, parameters), so
    a misfit is an error here, naming the module, not a traceback at run time."""
    key_name, target, kwargs = factory_spec(fn)
    if not target.startswith(archetypes.RECIPES + "."):
        return  # the user's own factory: their contract
    validate = getattr(importlib.import_module(target.rsplit(".", 1)[0]), "validate", None)
    if validate is None:
        return
    for name in matched:
        try:
            validate(modules[name], **kwargs)
        except (UnsupportedModuleStructure, TypeError, ValueError, KeyError) as e:
            raise PlanError(f"{key}.local_compute_fn.{key_name}={target!r} does not fit {name} "
                            f"({type(modules[name]).__name__}): {getattr(e, 'reason', e)}. Use "
                            f"'{key}.local_compute_fn=auto' to let autoep decide, or name a factory that fits") from None


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(?)"


def replay_entry(key: str, entry: dict, parallel: DictConfig, modules: dict, matched: list[str],
                 skipped: list[str]) -> dict:
    """Keep a recorded decision if its seal holds and its code has not drifted; else error or redetect."""
    decision, fn = entry["decision"], entry["local_compute_fn"]
    name = factory_key(fn, f"{key}.local_compute_fn") if isinstance(fn, Mapping) else None
    if name is not None:  # an artifact from before the move; one from before _factory_ replays as written
        check_not_moved(fn[name], f"{key}.local_compute_fn.{name}")
    if seal_entry(entry["match"], fn, decision) != decision["fingerprint"]:
        raise PlanError(f"{key}: match/local_compute_fn/decision were changed after the plan was resolved "
                        f"(decision.fingerprint no longer matches them); a decision is written by autoep, never "
                        f"by hand. To change the plan, drop the decision so it is decided afresh "
                        f"({key}.decision=null on the command line, or delete the block), or restore the file")
    drift = drift_reasons(decision, modules, matched, skipped)
    if drift:
        where = f"{key} ({decision['modules'][0]}{' ...' if len(decision['modules']) > 1 else ''})"
        if parallel.on_drift == "error":
            raise DriftError(f"{where}: the model's code changed since this plan was resolved: {'; '.join(drift)}. "
                             f"Run the code it was resolved against, or set parallel.on_drift=redetect to decide afresh")
        log.warning("%s: drift (%s); parallel.on_drift=redetect, deciding afresh", where, "; ".join(drift))
        fresh = {"match": entry["match"], "local_compute_fn": AUTO if decision["source"] == "auto" else fn,
                 "moe_only": entry.get("moe_only", False), "record_replay": _record_replay(entry),
                 **({"execution": entry["execution"]} if "execution" in entry else {}),
                 **({"expert_draws": entry["expert_draws"]} if "expert_draws" in entry else {})}
        return decide_entry(key, fresh, parallel, modules, matched, skipped)
    check_compute_fn(key, fn, parallel.allowed_targets)
    check_ep_size(parallel.ep_size, decision["num_experts"], matched)
    return entry


def drift_reasons(decision: Mapping, modules: dict, matched: list[str], skipped: list[str] = ()) -> list[str]:
    """What differs between a recorded decision and the model now; empty when nothing does."""
    reasons = []
    if list(decision.get("skipped") or []) != list(skipped):
        reasons.append(f"dense modules skipped by moe_only changed ({list(decision.get('skipped') or [])} -> "
                       f"{list(skipped)})")
    if decision["modules"] != matched:
        added = sorted(set(matched) - set(decision["modules"]))
        removed = sorted(set(decision["modules"]) - set(matched))
        reasons.append(f"matched modules changed (added {added}, removed {removed})")
    now = class_hashes([modules[n] for n in matched])
    before = decision["classes"]
    for cls in sorted(set(now) | set(before)):
        if cls not in now:
            reasons.append(f"class {cls} is no longer used")
        elif cls not in before:
            reasons.append(f"class {cls} is new")
        elif now[cls] != before[cls]:
            reasons.append(f"source of {cls} changed ({before[cls]} -> {now[cls]})")
    if decision["source"] == "auto" and decision["detector_version"] != structure.DETECTOR_VERSION:
        reasons.append(f"detector version {decision['detector_version']} -> {structure.DETECTOR_VERSION} (the recorded "
                       f"structure is in an older vocabulary: regenerate the resolved config with autoep-plan)")
    recorded = structure.MoeStructure(**decision["structure"]) if decision.get("structure") else None
    if recorded is not None and recorded.folded and not reasons:
        for n in matched:  # constants the expert proofs folded (branches, numbers): a change is drift
            reasons += [f"{n}: {r}" for r in row_local.folded_drift(modules[n], recorded.folded)]
    if decision["num_experts"] is not None and not reasons:
        counts = {structure.count_experts(modules[n], recorded) for n in matched}
        if counts != {decision["num_experts"]}:
            reasons.append(f"num_experts {decision['num_experts']} -> {sorted(counts)}")
    return reasons
