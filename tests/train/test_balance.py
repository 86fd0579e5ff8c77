"""balance.py through the trainer: the aux loss on global counts and the router z-loss under EP (2 and 4 ranks)
equal one process on the whole global batch (its reference aux loss is the model's own, ``aux_loss_scope=local``),
the aux-loss-free bias update keeps DeepSeek-V3's ``e_score_correction_bias`` equal on every rank and to one
process, moves it by ``rate * sign(mean - load)`` of the logged global counts, and survives a DCP resume at
another ``(edp, ep)``; and the refusals, each before a step.

SGD, no clipping, lr 0.1: a wrong gradient scale of either loss changes the weights (Adam would hide it).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from distributed import spawn
from hydra import compose, initialize_config_dir
from torch.distributed.tensor import DTensor

from autoep.errors import ConfigError
from autoep.train.balance import RouterLosses
from autoep.train.config import CONF_DIR
from autoep.train.models import build_hf_causal_lm

SMALL = ["trainer.steps=3", "optim.warmup_steps=0", "optim.grad_clip=0", "optim.lr=0.1", "trainer.log_every=1",
         "data.seq_len=16", "trainer.device=cpu"]
GLOBAL_ROWS = 4
ROUTER = ["optim.aux_loss_coef=1.0", "optim.z_loss_coef=0.1"]
BIAS = ["model=deepseek_v3", "optim.bias_update_rate=0.01", "trainer.steps=4"]
BIAS_NAME = "e_score_correction_bias"


def sgd(params, lr, **_):
    """The trainer's AdamW replaced by plain SGD (what its step does to the weights is then the gradient)."""
    return torch.optim.SGD(params, lr=lr, foreach=False)


def run(*overrides: str) -> dict:
    from autoep.train.trainer import train

    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[*SMALL, *overrides])
    result = train(cfg)
    model = result.pop("model")
    result["weights"] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                         for n, p in model.named_parameters()}  # NOTE: gathers expert shards (collective)
    result["biases"] = {n: b.clone() for n, b in model.named_buffers() if n.endswith(BIAS_NAME)}
    metrics = Path(result["run_dir"]) / "metrics.jsonl"
    result["rows"] = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return result


def worker(rank: int, world_size: int, tmp: str) -> dict:
    torch.optim.AdamW = sgd  # this spawned process only
    rows = f"data.batch_size={GLOBAL_ROWS // world_size}"
    out = {"router": run("parallel.ep_size=2", rows, *ROUTER, f"run_dir={tmp}/router")}
    out["bias"] = run("parallel.ep_size=2", rows, *BIAS, "trainer.ckpt_every=2", f"run_dir={tmp}/bias")
    if world_size == 2:  # resume at another (edp, ep): (1, 2) -> (2, 1)
        out["resumed"] = run("parallel.ep_size=1", rows, *BIAS, f"run_dir={tmp}/resumed",
                             f"trainer.resume={tmp}/bias/checkpoints/step_00000002")
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process on the whole global batch; the aux loss is the model's own on it (scope local)."""
    tmp = tmp_path_factory.mktemp("single")
    rows = f"data.batch_size={GLOBAL_ROWS}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.optim, "AdamW", sgd)
        return {"router": run(rows, *ROUTER, "optim.aux_loss_scope=local", f"run_dir={tmp}/router"),
                "plain": run(rows, f"run_dir={tmp}/plain"),
                "bias": run(rows, *BIAS, f"run_dir={tmp}/bias")}


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request, tmp_path_factory):
    return spawn(request.param, "test_balance:worker", str(tmp_path_factory.mktemp(f"ep{request.param}")))


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=lambda m, n=name: f"{n}: {m}")


def test_global_aux_and_z_loss_under_ep_equal_one_process_on_the_global_batch(ranks, single):
    ref = single["router"]
    # the router losses move the routers: without them the same run ends elsewhere
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(ref["weights"][gate], single["plain"]["weights"][gate])
    assert ref["losses"][0] > single["plain"]["losses"][0]  # aux (>= 1) and z-loss (> 0) are in the loss
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["router"]["losses"]), torch.tensor(ref["losses"]))
        assert_same(r["router"]["weights"], ref["weights"])


def test_bias_update_equal_on_every_rank_and_to_one_process(ranks, single):
    ref = single["bias"]
    assert len(ref["biases"]) == 2 and all(b.abs().sum() > 0 for b in ref["biases"].values())
    for r in ranks:
        assert_same(r["bias"]["biases"], ref["biases"])
        assert_same(r["bias"]["weights"], ref["weights"])


def test_bias_moves_by_rate_times_sign_of_mean_minus_logged_load(single):
    ref = single["bias"]
    expected = torch.zeros(2, 8)
    for row in ref["rows"]:  # log_every=1: each row holds that step's global counts per block
        load = torch.tensor(row["layer_load"], dtype=torch.float64)
        expected += (0.01 * torch.sign(load.mean(dim=1, keepdim=True) - load)).float()
    torch.testing.assert_close(torch.stack([ref["biases"][f"model.layers.{i}.mlp.gate.{BIAS_NAME}"] for i in (0, 1)]),
                               expected)


def test_bias_survives_a_dcp_resume_at_another_ep(ranks):
    if len(ranks) != 2:
        pytest.skip("resumed on 2 ranks only (CI time)")
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["resumed"]["losses"]), torch.tensor(r["bias"]["losses"][2:]))
        assert_same(r["resumed"]["biases"], r["bias"]["biases"])
        assert_same(r["resumed"]["weights"], r["bias"]["weights"])


# ------------------------------------------------------------------------------------------------------------
# One process: the formulas against the model's own, and the refusals
# ------------------------------------------------------------------------------------------------------------


def tiny_qwen3():
    torch.manual_seed(0)
    return build_hf_causal_lm(config_class="transformers.Qwen3MoeConfig", vocab_size=64, hidden_size=32,
                              intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2)


def test_global_aux_on_one_rank_is_the_models_own_aux_loss_value_and_gradient():
    model = tiny_qwen3()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    gate = model.model.layers[0].mlp.gate.weight
    out = model(input_ids=ids, use_cache=False, output_router_logits=True)
    (own_grad,) = torch.autograd.grad(out.aux_loss, gate, retain_graph=True)
    ours = RouterLosses(aux_loss_coef=1.0, z_loss_coef=0.0, top_k=2, group=None)(out)
    torch.testing.assert_close(ours, out.aux_loss)
    (our_grad,) = torch.autograd.grad(ours, gate)
    torch.testing.assert_close(our_grad, own_grad)


def test_z_loss_is_the_mean_squared_logsumexp_of_every_router_row():
    model = tiny_qwen3()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    out = model(input_ids=ids, use_cache=False, output_router_logits=True)
    z = torch.cat([torch.logsumexp(t, dim=-1) for t in out.router_logits]).square().mean()
    torch.testing.assert_close(RouterLosses(aux_loss_coef=0.0, z_loss_coef=0.5, top_k=2, group=None)(out), 0.5 * z)


def test_global_aux_refuses_a_model_whose_aux_loss_is_another_formula_or_absent():
    model = tiny_qwen3()
    out = model(input_ids=torch.zeros(1, 6, dtype=torch.long), use_cache=False, output_router_logits=True)
    for aux, why in ((2 * out.aux_loss, "not the Switch/Mixtral loss"), (None, "returns no aux_loss")):
        losses = RouterLosses(aux_loss_coef=0.1, z_loss_coef=0.0, top_k=2, group=None)
        with pytest.raises(ConfigError, match=rf"optim.aux_loss_coef=0.1 .*{why}.*set optim.aux_loss_scope=local"):
            losses(SimpleNamespace(router_logits=out.router_logits, aux_loss=aux))


def test_router_losses_refuse_a_model_that_returns_no_router_logits():
    losses = RouterLosses(aux_loss_coef=0.0, z_loss_coef=0.01, top_k=2, group=None)
    with pytest.raises(ConfigError, match=r"optim.z_loss_coef=0.01 need the router logits.*set optim.z_loss_coef=0"):
        losses(SimpleNamespace(logits=torch.zeros(1, 2, 3)))


def test_bias_update_on_a_model_without_router_bias_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigError, match=rf"optim.bias_update_rate=0.001: model.layers.0.mlp has no {BIAS_NAME} "
                                          r"buffer.*set optim.bias_update_rate=0"):
        run("optim.bias_update_rate=0.001", f"run_dir={tmp_path}")
    assert not (tmp_path / "metrics.jsonl").exists()



def test_bias_update_refuses_blocks_it_cannot_count_or_hold_no_single_bias():
    from torch import nn

    from autoep.train.balance import router_biases

    def block(biases: int) -> nn.Module:
        gates = nn.ModuleList(nn.Module() for _ in range(biases))
        for gate in gates:
            gate.register_buffer(BIAS_NAME, torch.zeros(4))
        return nn.ModuleDict({"gates": gates})

    model = nn.ModuleDict({"one": block(1), "two": block(2)})
    assert router_biases(model, ["one"], [True], 0.1)[0] is model["one"].gates[0].get_buffer(BIAS_NAME)
    for names, counted, why in ((["one"], [False], "cannot count the tokens routed to each expert of one"),
                                (["two"], [True], f"two has 2 {BIAS_NAME} buffers"),
                                ([], [], "parallel.plan holds no MoE block")):
        with pytest.raises(ConfigError, match=rf"optim.bias_update_rate=0.1: .*{why}.*set optim.bias_update_rate=0"):
            router_biases(model, names, counted, 0.1)
