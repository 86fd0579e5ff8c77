"""The plan table: one row per matched module (structure, compute fn, experts and expert bytes per rank),
then the per-rank totals. ``autoep-plan`` prints it, the trainer and the integrations log it."""
from __future__ import annotations

import torch.nn as nn
from omegaconf import DictConfig

from autoep.detect import adapters, plain_experts
from autoep.targets import factory_spec

COLUMNS = ("module", "structure", "execution", "compute fn", "experts/rank", "expert bytes/rank")


def structure_label(decision) -> str:
    """``router/shared/storage`` plus the facts that differ from the defaults; ``explicit`` if not detected."""
    s = decision.structure
    if s is None:
        return "explicit"
    flags = [k for k in ("jitter", "expert_bias", "expert_transposed") if s.get(k)]
    flags += [f"{k}={s[k]}" for k, default in (("gate_up_layout", "concatenated"), ("activation", "glu"))
              if s.get(k, default) != default]
    if s.get("expert_draws"):  # PlanEntry.expert_draws=on_owner, and an expert draws: not bit-equal to the model
        flags.append("expert_draws=on_owner (equal in distribution, not bit-equal)")
    return "/".join([s["router"], s["shared_experts"], s["expert_storage"], *flags])


def plan_rows(model: nn.Module, parallel: DictConfig) -> list[tuple]:
    """One row per matched module (skipped dense ones say so), then the per-rank totals; bytes are of the
    parameters as built (dtype as built): expert ones split over ep, every other one replicated. A PEFT LoRA chain
    around experts (``autoep.detect.adapters``): its adapter is dense."""
    with adapters.peeled(model):
        return _plan_rows(model, parallel)


def _plan_rows(model: nn.Module, parallel: DictConfig) -> list[tuple]:
    rows, expert_ids = [], set()
    for entry in parallel.plan:
        decision, n = entry.decision, entry.decision.num_experts
        s = decision.structure
        execution = s.get("execution", "spliced") if s is not None else "explicit"
        for name in decision.modules:
            params = _expert_params(model.get_submodule(name), s)
            expert_ids |= {id(p) for p in params}
            total = sum(p.numel() * p.element_size() for p in params)
            per_rank = n // parallel.ep_size if n else "?"
            rows.append((name, structure_label(decision), execution, factory_spec(entry.local_compute_fn)[1],
                         per_rank, total // parallel.ep_size))
        rows += [(name, "skipped: no experts (dense, moe_only)", "-", "-", "-", "-")
                 for name in decision.get("skipped") or []]
    expert_bytes, dense_bytes = _split_bytes(model, expert_ids)
    rows.append(("total per rank", f"dense bytes {dense_bytes} (replicated)", "-", "-", "-",
                 expert_bytes // parallel.ep_size))
    return rows


def param_bytes(model: nn.Module, parallel: DictConfig) -> tuple[int, int]:
    """(expert bytes, dense bytes) of the parameters as built: the planned blocks' experts, and every other one.
    A rank holds ``dense + expert // ep_size`` (what ``parallel.ep_size: auto`` weighs against ``memory_gb``)."""
    expert_ids = set()
    for entry in parallel.plan:
        for name in entry.decision.modules:
            expert_ids |= {id(p) for p in _expert_params(model.get_submodule(name), entry.decision.structure)}
    return _split_bytes(model, expert_ids)


def _expert_params(block: nn.Module, s) -> list:
    """The parameters of a planned block's experts: those under ``experts_path`` (a submodule, or a plain dict/list
    of registered experts), or of every module ``expert_members`` names, or the 3-D weights ``expert_projs`` names
    (``block_weights``)."""
    members = (s.get("expert_members") or ()) if s is not None else ()
    if s is not None and s.get("expert_storage") == "block_weights":  # the 3-D weights alone (``""``: the block's)
        holder = block.get_submodule(s.get("experts_path") or "")
        return [holder.get_parameter(w) for w in s.get("expert_projs") or ()]
    if members:
        return [p for expert in members for path in expert for p in block.get_submodule(path).parameters()]
    found = plain_experts.resolve(block, s.get("experts_path", "experts") if s is not None else "experts")
    return list(found[0].parameters()) if found is not None else []


def _split_bytes(model: nn.Module, expert_ids: set[int]) -> tuple[int, int]:
    expert_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) in expert_ids)
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_ids)
    return expert_bytes, dense_bytes


def format_table(rows: list[tuple]) -> str:
    cells = [COLUMNS, *[tuple(str(c) for c in row) for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)
