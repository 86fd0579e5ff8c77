"""The trainer beyond 2 ranks of the default model: a module_list (v4-style) model trained at ep_size=2 on 2
ranks equals one process (losses, final weights, expert load), and 4 ranks at ep_size=2 (edp=2, what
``torchrun --nproc-per-node 4 -m autoep.train parallel.ep_size=2`` runs) equal one process, and resume
of its checkpoint at ep_size=4 reshards the experts and continues the same curve; FSDP2 dense sharding at
edp=2 with gradient accumulation equals one process too.

Each spawned group runs its cases once; the single-process references run in the test process.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import spawn
from hydra import compose, initialize_config_dir
from module_list_lm import model_config
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from autoep.runtime.recipes.local_experts import expert_owners, full_state_dict_of_experts
from autoep.train.config import CONF_DIR

SMALL = ["trainer.steps=5", "optim.warmup_steps=2", "trainer.log_every=100", "data.seq_len=16", "trainer.device=cpu"]
GLOBAL_ROWS = 4


def run(*overrides: str, model: dict | None = None) -> dict:
    from autoep.train.trainer import train

    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[*SMALL, *overrides])
    if model is not None:
        cfg.model = OmegaConf.create(model)  # a _target_ model of the tests' own, as a user's repo would give
    result = train(cfg)
    model_ = result.pop("model")
    result["weights"] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                         for n, p in model_.named_parameters()}  # NOTE: gathers expert shards (collective)
    experts = full_state_dict_of_experts(model_)  # NOTE: collective; ModuleList experts, each from its owner
    result["weights"] |= {n: experts[n] for n in expert_owners(model_)}
    metrics = Path(result["run_dir"]) / "metrics.jsonl"
    result["expert_load"] = [json.loads(line)["expert_load"] for line in metrics.read_text().splitlines()]
    return result


def module_list_worker(rank: int, world_size: int, tmp: str) -> dict:
    rows = f"data.batch_size={GLOBAL_ROWS // world_size}"
    out = run("parallel.ep_size=2", rows, "trainer.ckpt_every=2", f"run_dir={tmp}/ml_ep2", model=model_config())
    # Resume at ep_size=1 (edp=2): every rank now owns every expert, read from the keys each owner wrote.
    out["ep1"] = run("parallel.ep_size=1", rows, f"trainer.resume={tmp}/ml_ep2/checkpoints/step_00000002",
                     f"run_dir={tmp}/ml_ep1_resumed", model=model_config())
    out["fsdp2"] = run("parallel.ep_size=2", rows, "trainer.dense_sharding=fsdp2", f"run_dir={tmp}/ml_fsdp2",
                       model=model_config())
    return out


def four_rank_worker(rank: int, world_size: int, tmp: str) -> dict:
    rows = f"data.batch_size={GLOBAL_ROWS // world_size}"
    out = {"edp2": run("parallel.ep_size=2", rows, "trainer.ckpt_every=2", f"run_dir={tmp}/edp2")}
    out["ep4"] = run("parallel.ep_size=4", rows, f"run_dir={tmp}/ep4",
                     f"trainer.resume={tmp}/edp2/checkpoints/step_00000002")
    out["fsdp2_accum"] = run("parallel.ep_size=2", rows, "trainer.dense_sharding=fsdp2", "trainer.grad_accum=2",
                             "trainer.steps=3", f"run_dir={tmp}/fsdp2_accum")
    return out


def assert_same_training(a: dict, b: dict) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]))
    assert a["weights"].keys() == b["weights"].keys()
    for name in a["weights"]:
        torch.testing.assert_close(a["weights"][name], b["weights"][name], msg=lambda m, n=name: f"{n}: {m}")


def test_module_list_model_ep2_equals_single_process(tmp_path):
    ep2 = spawn(2, "test_train_worlds:module_list_worker", str(tmp_path))
    single = run(f"data.batch_size={GLOBAL_ROWS}", f"run_dir={tmp_path}/ml_ep1", model=model_config())
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in single["weights"]  # the ModuleList keeps its own names
    assert single["losses"][-1] < single["losses"][0]
    resumed = {"losses": single["losses"][2:], "weights": single["weights"]}
    for rank in (0, 1):
        assert_same_training(ep2[rank], single)
        assert_same_training(ep2[rank]["ep1"], resumed)
        assert_same_training(ep2[rank]["fsdp2"], single)
    # Router load is counted for replaced-forward blocks too: every (token, top-k) pair of both layers, each step.
    pairs = GLOBAL_ROWS * 16 * 2 * 2
    assert [sum(step) for step in single["expert_load"]] == [pairs] * 5
    assert ep2[0]["expert_load"] == single["expert_load"]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("edp2")
    return tmp, spawn(4, "test_train_worlds:four_rank_worker", str(tmp))


def test_four_ranks_edp2_equal_single_process_and_reshard_to_ep4(four_ranks):
    tmp, ranks = four_ranks
    single = run(f"data.batch_size={GLOBAL_ROWS}", f"run_dir={tmp}/ep1")
    for r in ranks:
        assert_same_training(r["edp2"], single)
        assert r["edp2"]["expert_load"] == single["expert_load"]
    resumed = {"losses": single["losses"][2:], "weights": single["weights"]}
    for r in ranks:
        assert_same_training(r["ep4"], resumed)


def test_four_ranks_edp2_fsdp2_with_grad_accum_equal_single_process(four_ranks):
    """FSDP2 dense shards over 4 ranks, experts summed over edp=2, two micro-batches per step (one reduce-scatter)."""
    tmp, ranks = four_ranks
    single = run(f"data.batch_size={GLOBAL_ROWS}", "trainer.grad_accum=2", "trainer.steps=3", f"run_dir={tmp}/accum1")
    for r in ranks:
        assert_same_training(r["fsdp2_accum"], single)
