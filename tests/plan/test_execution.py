"""The plan entry's ``execution`` key (``autoep.plan.resolve``): auto takes the fastest proven execution (the
detector's order: grouped or spliced where a fast path is proven, replay only as the fallback); an explicit one
is that execution or a ``PlanError`` naming the key; the resolved plan keeps it, a replay of the artifact checks
it against the frozen decision, and ``on_drift=redetect`` decides afresh under it."""
from __future__ import annotations

import blocks
import pytest
import replay_blocks as rb
from omegaconf import OmegaConf
from torch import nn

from autoep.errors import PlanError, UnsupportedPlanEntry
from autoep.plan import resolve as resolve_mod
from autoep.plan.resolve import resolve_plan
from autoep.plan.table import plan_rows

BLOCKS = {"module_list": blocks.MixtralStyleSparseMoeBlock, "grouped": blocks.TitanMoE,
          "comprehension": rb.ComprehensionMoE}


def _resolve(block: str, **entry):
    model = nn.ModuleDict({"mlp": BLOCKS[block]()})
    return model, resolve_plan({"ep_size": 2, "plan": [{"match": "mlp", **entry}]}, model)


@pytest.mark.parametrize("block, entry, execution", [
    ("module_list", {}, "spliced"),
    ("module_list", {"record_replay": True}, "spliced"),  # the fast path is proven: auto keeps it
    ("module_list", {"execution": "spliced"}, "spliced"),
    ("module_list", {"execution": "replay"}, "replay"),  # forced, although the fast path is proven
    ("grouped", {}, "grouped"),
    ("grouped", {"execution": "grouped"}, "grouped"),
    ("comprehension", {"record_replay": True}, "replay"),  # no fast path proven: the fallback
    ("comprehension", {"execution": "replay"}, "replay"),
])
def test_the_execution_each_entry_gets(block, entry, execution):
    model, resolved = _resolve(block, **entry)
    assert resolved.plan[0].decision.structure.execution == execution
    assert resolved.plan[0].execution == entry.get("execution", "auto")  # what was asked, in resolved.yaml
    assert plan_rows(model, resolved)[0][2] == execution
    assert resolved.plan[0].local_compute_fn._factory_.endswith(
        "replay.ep_replay_block" if execution == "replay" else "ep_module_list_block" if execution == "spliced"
        else "ep_grouped_experts")


@pytest.mark.parametrize("block, entry, error, message", [
    ("module_list", {"execution": "grouped"}, PlanError,
     r"parallel\.plan\.0\.execution=grouped: mlp \(MixtralStyleSparseMoeBlock\) is proven for execution=spliced "
     r"\(expert_storage=module_list\), not grouped; set parallel\.plan\.0\.execution=spliced, or auto"),
    ("grouped", {"execution": "spliced"}, PlanError, r"parallel\.plan\.0\.execution=spliced: mlp \(TitanMoE\) is "
                                                     r"proven for execution=grouped"),
    ("grouped", {"execution": "replay"}, UnsupportedPlanEntry,
     r"mlp \(TitanMoE\), which auto cannot take: execution=replay needs module experts"),
    ("comprehension", {"execution": "spliced"}, UnsupportedPlanEntry,
     r"mlp \(ComprehensionMoE\), which auto cannot take"),  # no fast path proven
    ("module_list", {"execution": "fastest"}, PlanError,
     r"parallel\.plan\.0\.execution='fastest' is not one of \['auto', 'grouped', 'spliced', 'replay'\]"),
    ("module_list", {"execution": "replay", "local_compute_fn": {"_factory_": "my_pkg.ep.fn"}}, PlanError,
     r"parallel\.plan\.0\.execution=replay chooses among autoep's own executions, but parallel\.plan\.0\."
     r"local_compute_fn names a factory"),
])
def test_an_execution_that_is_not_proven_is_refused_naming_the_key(block, entry, error, message):
    with pytest.raises(error, match=message):
        _resolve(block, **entry)


def test_the_artifact_replays_and_its_execution_is_rechecked():
    model, resolved = _resolve("module_list", execution="replay")
    frozen = OmegaConf.to_container(resolved)
    assert OmegaConf.to_container(resolve_plan(frozen, model)) == frozen  # replayed as frozen
    frozen["plan"][0]["execution"] = "spliced"
    with pytest.raises(PlanError, match=r"parallel\.plan\.0\.execution=spliced, but its frozen decision runs "
                                        r"execution=replay.*parallel\.plan\.0\.decision=null"):
        resolve_plan(frozen, model)
    frozen["plan"][0]["execution"] = "auto"  # auto replays whatever was frozen
    assert resolve_plan(frozen, model).plan[0].decision.structure.execution == "replay"


def test_redetect_decides_afresh_under_the_same_execution(monkeypatch):
    model, resolved = _resolve("module_list", execution="replay")
    frozen = OmegaConf.to_container(resolved)
    frozen["on_drift"] = "redetect"
    monkeypatch.setattr(resolve_mod, "drift_reasons", lambda *a, **k: ["(a drift)"])
    again = resolve_plan(frozen, model)
    assert again.plan[0].execution == "replay" and again.plan[0].decision.structure.execution == "replay"
