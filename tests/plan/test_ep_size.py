"""``parallel.ep_size: auto`` (autoep/plan/ep_size.py): the degree resolve_plan decides, its log line, the
memory limit, the refusals, and the number a resolved.yaml freezes (a replay never decides again)."""
import logging
import math

import pytest
import torch.nn as nn
from omegaconf import OmegaConf
from test_resolve import meta_model

from autoep.errors import ConfigError, PlanError
from autoep.plan.artifact import load_plan, write_plan
from autoep.plan.resolve import resolve_plan
from autoep.plan.table import param_bytes
from autoep.train.config import TrainConfig, check_config

WORLDS = (1, 2, 3, 4, 6, 8, 12, 16)


class TwoModels(nn.Module):
    """Two tiny Qwen3-MoE models, one planned entry each, so blocks with different expert counts meet."""

    def __init__(self, *counts: int):
        super().__init__()
        self.parts = nn.ModuleList(meta_model("qwen3_moe", num_experts=n) for n in counts)


def auto_plan(model, **parallel):
    entries = [{"match": f"parts.{i}.model.layers.*.mlp"} for i in range(len(model.parts))]
    return {"ep_size": "auto", "plan": entries, **parallel}


@pytest.mark.parametrize("counts", [(8,), (8, 12), (6, 4)])
def test_auto_is_the_largest_common_divisor_of_the_world_and_every_expert_count(counts, caplog):
    model = TwoModels(*counts)
    for world in WORLDS:
        with caplog.at_level(logging.INFO, logger="autoep.plan.ep_size"):
            resolved = resolve_plan(auto_plan(model), model, world_size=world)
        expected = math.gcd(world, *counts)  # the largest degree dividing all of them, by definition
        assert resolved.ep_size == expected, (world, counts)
        assert [e.decision.num_experts for e in resolved.plan] == list(counts)
        line = caplog.records[-1]
        assert line.getMessage().startswith(f"parallel.ep_size=auto -> {expected}: divides world {world}")
        # one process: 1 is the only degree (info); several ranks that share no factor with the counts: a warning
        assert line.levelno == (logging.WARNING if expected == 1 and world > 1 else logging.INFO)
        caplog.clear()


def test_memory_gb_takes_the_smallest_degree_whose_parameters_fit():
    model = TwoModels(8)
    resolved = resolve_plan(auto_plan(model), model, world_size=8)
    expert, dense = param_bytes(model, resolved)
    assert expert > 0 and dense > 0
    per_rank = {d: dense + expert // d for d in (1, 2, 4, 8)}
    for d, (low, high) in {1: (per_rank[1], per_rank[1] * 2), 2: (per_rank[2], per_rank[1] - 1),
                           8: (per_rank[8], per_rank[4] - 1)}.items():
        for budget in (low, high):
            got = resolve_plan(auto_plan(model, memory_gb=budget / 1e9), model, world_size=8)
            assert got.ep_size == d, (budget, per_rank)
    with pytest.raises(PlanError, match=r"parallel.memory_gb=.*even 8, the largest degree.*raise parallel.memory_gb"):
        resolve_plan(auto_plan(model, memory_gb=(per_rank[8] - 1) / 1e9), model, world_size=8)
    # a number must fit too: the error says which way to go
    fixed = auto_plan(model, memory_gb=(per_rank[2]) / 1e9) | {"ep_size": 1}
    with pytest.raises(PlanError, match=r"parallel.ep_size=1 leaves .* over parallel.memory_gb=.*raise parallel.ep_size"):
        resolve_plan(fixed, model)
    assert resolve_plan(fixed | {"ep_size": 2}, model).ep_size == 2


def test_refusals_name_the_key_and_the_fix():
    model = TwoModels(8)
    with pytest.raises(PlanError, match=r"ep_size=auto needs the world size.*world_size=N"):
        resolve_plan(auto_plan(model), model)
    with pytest.raises(PlanError, match=r"parallel.ep_size='most' must be a positive integer or auto"):
        resolve_plan(auto_plan(model) | {"ep_size": "most"}, model, world_size=2)
    base = OmegaConf.merge(OmegaConf.structured(TrainConfig), {"model": {"_target_": "x.y"}})
    assert check_config(OmegaConf.merge(base, {"parallel": {"ep_size": "auto"}})).parallel.ep_size == "auto"
    for bad in ("most", 0, True):
        with pytest.raises(ConfigError, match=r"parallel.ep_size=.*: must be an integer >= 1 .* or auto"):
            check_config(OmegaConf.merge(base, {"parallel": {"ep_size": bad}}))
    with pytest.raises(ConfigError, match=r"parallel.memory_gb=-1.0: must be a finite number > 0"):
        check_config(OmegaConf.merge(base, {"parallel": {"memory_gb": -1}}))


def test_the_artifact_freezes_the_number_and_a_replay_keeps_it(tmp_path):
    model = TwoModels(8)
    resolved = resolve_plan(auto_plan(model), model, world_size=2)
    assert resolved.ep_size == 2
    path = write_plan(resolved, tmp_path)
    assert OmegaConf.load(path).parallel.ep_size == 2  # the number, as written in the file
    # replayed at world 4 (edp=2), where a fresh auto would take 4: the frozen number stands
    assert resolve_plan(auto_plan(model), model, world_size=4).ep_size == 4
    for replayed in (load_plan(path), {"replay": str(path)}):
        again = resolve_plan(replayed, model, world_size=4)
        assert again.ep_size == 2
        assert OmegaConf.to_container(again.plan) == OmegaConf.to_container(resolved.plan)
