"""``trainer.precision`` (``autoep.train.precision``): bf16-mixed and bf16 runs with EP equal the same run without EP
under the same precision, on 2 ranks (ep 2) and 4 ranks (ep 4; and (edp, ep) = (2, 2) with FSDP2 dense shards),
checkpoints resume exactly, and the exchange carries bf16 under bf16; an unknown precision, a model built in bf16
(no fp32 masters) and a CUDA device without bf16 are refused before a step.

References: one process on the whole global batch (the trainer's data gives it the same rows), except for
FSDP2 + bf16-mixed, where FSDP gathers the dense weights in bf16 (its MixedPrecisionPolicy) and one process has no
FSDP: there the reference is the same 4 ranks at ep_size=1. SGD with momentum replaces the trainer's AdamW (Adam
would hide a wrong gradient scale; the test swaps the class the trainer builds), no clipping, a large lr so every
weight moves.

Tolerance (derived, then measured). The first step's loss is compared at fp32 defaults: the forward is exact
under EP in every precision (the exchange moves bf16 rows bit for bit, each row's expert computation is
row-local). What differs afterwards is the gradient: the gradient of a bf16 weight (bf16, or under autocast) is
rounded to bf16 once per rank's partial sum (half an ulp, 2^-9 relative to that partial) before the fp32 sum over
ranks, where one process rounds the total once; under EP the owner of an expert also sums its rows from every
rank in one bf16 GEMM. Without cancellation that is <= 2^-8 (0.4%) of each update; where the partials cancel
(the router's logit gradients sum to ~0 over experts) the error of the total is that times the cancellation.
Measured, per tensor, ||w - w_ref|| / ||w_ref - w_init|| (Frobenius) after 4 steps, worst tensor: bf16 7.3% on 2 and
on 4 ranks (a router gate; the same 7.3% at ep_size=1 on 2 ranks: data-parallel rounding, not EP), bf16-mixed 1.1%
on 2 ranks (5.2% on 4, not run here), FSDP2 (2,2) against (4,1) 0.9%; a wrong expert gradient scale (W x, the bug
this parity exists for) gives 100% (``test_the_tolerance_catches_a_wrong_expert_grad_scale``). WEIGHT_TOL = 25%
sits 3.4x above the noise and 4x below that bug. Losses after the first step: within 2^-8 relative, the resolution
of the bf16 logits the loss reads (measured worst 1.8e-4).
"""
from __future__ import annotations

import pytest
import torch
from distributed import spawn
from hydra import compose, initialize_config_dir
from module_list_lm import model_config
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from autoep.errors import ConfigError
from autoep.train.config import CONF_DIR

STEPS, ROWS = 4, 4  # ROWS: the global batch; each of W ranks takes ROWS // W rows
SMALL = [f"trainer.steps={STEPS}", "optim.warmup_steps=1", "trainer.log_every=100", "data.seq_len=16",
         "trainer.device=cpu", "optim.grad_clip=0", "optim.lr=0.5"]
WEIGHT_TOL = 0.25  # per tensor: ||w - w_ref|| <= WEIGHT_TOL * ||w_ref - w_init|| (module docstring)
LOSS_RTOL = 2.0 ** -8


def sgd(params, lr, betas, eps, weight_decay, foreach):
    """What the test builds in place of the trainer's ``torch.optim.AdamW`` (same call)."""
    return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=foreach)


def compose_cfg(*overrides: str):
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return compose("train", overrides=[*SMALL, *overrides])


def run(*overrides: str, model: dict | None = None) -> dict:
    from autoep.runtime.recipes.local_experts import expert_owners, full_state_dict_of_experts
    from autoep.train.trainer import train

    cfg = compose_cfg(*overrides)
    if model is not None:
        cfg.model = OmegaConf.create(model)  # a _target_ model of the tests' own
    result = train(cfg)
    model = result.pop("model")
    result["weights"] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                         for n, p in model.named_parameters()}  # NOTE: gathers expert shards (collective)
    experts = full_state_dict_of_experts(model)  # NOTE: collective; ModuleList experts, each from its owner
    result["weights"] |= {n: experts[n] for n in expert_owners(model)}
    result["dtypes"] = {p.dtype for p in model.parameters()}
    return result


def recording_exchange() -> set:
    """Record the dtype of every tensor the token exchange sends (forward and backward)."""
    from autoep.runtime import dispatch

    seen, exchange = set(), dispatch._all_to_all

    def recorded(x, *args):
        seen.add(x.dtype)
        return exchange(x, *args)

    dispatch._all_to_all = recorded
    return seen


def run_recording(seen: set, *overrides: str) -> dict:
    seen.clear()
    out = run(*overrides)
    out["exchanged"] = set(seen)
    return out


def two_rank_worker(rank: int, world_size: int, tmp: str) -> dict:
    torch.optim.AdamW = sgd  # this spawned process only
    seen, rows = recording_exchange(), f"data.batch_size={ROWS // world_size}"
    out = {"bf16-mixed": run_recording(seen, "parallel.ep_size=2", rows, "trainer.precision=bf16-mixed",
                                       f"run_dir={tmp}/mixed")}
    out["bf16"] = run_recording(seen, "parallel.ep_size=2", rows, "trainer.precision=bf16", "trainer.ckpt_every=2",
                                f"run_dir={tmp}/bf16")
    out["bf16_resumed"] = run("parallel.ep_size=2", rows, "trainer.precision=bf16", f"run_dir={tmp}/bf16",
                              f"trainer.resume={tmp}/bf16/checkpoints/step_00000002")
    out["module_list"] = run("parallel.ep_size=2", rows, "trainer.precision=bf16", f"run_dir={tmp}/module_list",
                             model=model_config())
    return out


def four_rank_worker(rank: int, world_size: int, tmp: str) -> dict:
    torch.optim.AdamW = sgd
    seen, rows = recording_exchange(), f"data.batch_size={ROWS // world_size}"
    out = {"bf16": run_recording(seen, "parallel.ep_size=4", rows, "trainer.precision=bf16", f"run_dir={tmp}/ep4")}
    fsdp2 = (rows, "trainer.dense_sharding=fsdp2", "trainer.precision=bf16-mixed")
    out["fsdp2"] = run_recording(seen, "parallel.ep_size=2", *fsdp2, "trainer.ckpt_every=2", f"run_dir={tmp}/fsdp2")
    out["fsdp2_resumed"] = run("parallel.ep_size=2", *fsdp2, f"run_dir={tmp}/fsdp2",
                               f"trainer.resume={tmp}/fsdp2/checkpoints/step_00000002")
    out["fsdp2_without_ep"] = run("parallel.ep_size=1", *fsdp2, f"run_dir={tmp}/fsdp2_ep1")
    return out


# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def with_sgd():
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.optim, "AdamW", sgd)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def single(with_sgd, tmp_path_factory):
    """One process on the whole global batch, per precision, and the weights before training."""
    from autoep.train.trainer import build_model

    tmp = tmp_path_factory.mktemp("single")
    out = {p: run(f"data.batch_size={ROWS}", f"trainer.precision={p}", f"run_dir={tmp}/{p}")
           for p in ("fp32", "bf16-mixed", "bf16")}
    model, _ = build_model(compose_cfg(), None, torch.device("cpu"))  # the seeded weights every run starts from
    out["init"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn(2, "test_precision:two_rank_worker", str(tmp_path_factory.mktemp("two")))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return spawn(4, "test_precision:four_rank_worker", str(tmp_path_factory.mktemp("four")))


def weight_errors(run_: dict, ref: dict, init: dict) -> dict[str, float]:
    """Per tensor: how far ``run_`` ended from ``ref``, as a fraction of how far ``ref`` moved from ``init``."""
    assert run_["weights"].keys() == ref["weights"].keys()
    return {n: ((run_["weights"][n] - w).norm() / (w - init[n]).norm()).item() for n, w in ref["weights"].items()}


def assert_same_run(run_: dict, ref: dict, init: dict) -> None:
    first = torch.tensor([run_["losses"][0], ref["losses"][0]], dtype=torch.float32)
    torch.testing.assert_close(first[0], first[1])  # the first forward is exact: fp32 defaults (docstring)
    torch.testing.assert_close(torch.tensor(run_["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)
    worst = max(weight_errors(run_, ref, init).items(), key=lambda kv: kv[1])
    assert worst[1] <= WEIGHT_TOL, f"{worst[0]} ended {worst[1]:.1%} of its update away from the reference"


def assert_resumed_exactly(resumed: dict, full: dict) -> None:
    assert resumed["losses"] == full["losses"][2:]
    for name, w in full["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], w, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------------------------------------------------


def test_bf16_really_runs_in_bf16_and_keeps_fp32_masters(single):
    fp32 = single["fp32"]
    for precision in ("bf16-mixed", "bf16"):
        assert single[precision]["losses"][0] != fp32["losses"][0], precision
        assert single[precision]["dtypes"] == {torch.float32}, precision  # the parameters the optimiser steps


def test_the_tolerance_catches_a_wrong_expert_grad_scale(single, tmp_path, monkeypatch):
    """One process whose expert gradients are 2x (what EP on 2 ranks gives when they are summed where they should
    not be) fails the parity comparison: the comparison can fail."""
    from autoep.train import trainer

    clip = trainer.grads.clip_grad_norm

    def doubled(dense, expert, *args, **kwargs):
        for p in expert:
            if p.grad is not None:
                p.grad.mul_(2)
        return clip(dense, expert, *args, **kwargs)

    monkeypatch.setattr(trainer.grads, "clip_grad_norm", doubled)
    wrong = run(f"data.batch_size={ROWS}", "trainer.precision=bf16", f"run_dir={tmp_path}")
    errors = weight_errors(wrong, single["bf16"], single["init"])
    assert max(errors.values()) > 3 * WEIGHT_TOL
    with pytest.raises(AssertionError, match="experts"):
        assert_same_run(wrong, single["bf16"], single["init"])


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_ep2_equals_one_process(two_ranks, single, precision):
    for rank in two_ranks:
        assert_same_run(rank[precision], single[precision], single["init"])


def test_ep2_bf16_module_list_experts_equal_one_process(two_ranks, with_sgd, tmp_path):
    """v4-style ModuleList experts (each rank's own experts' forward; the other ranks' are meta stand-ins, never
    cast) under bf16."""
    from autoep.train.trainer import build_model

    one = run(f"data.batch_size={ROWS}", "trainer.precision=bf16", f"run_dir={tmp_path}", model=model_config())
    cfg = compose_cfg()
    cfg.model = OmegaConf.create(model_config())
    init = {n: p.detach().clone() for n, p in build_model(cfg, None, torch.device("cpu"))[0].named_parameters()}
    for rank in two_ranks:
        assert_same_run(rank["module_list"], one, init)


def test_ep4_bf16_equals_one_process(four_ranks, single):
    for rank in four_ranks:
        assert_same_run(rank["bf16"], single["bf16"], single["init"])


def test_bf16_exchanges_bf16(two_ranks, four_ranks):
    """bf16: the activations are bf16, and so is everything the exchange sends (half the fp32 bytes). bf16-mixed
    on CPU exchanges fp32 rows (the residual stream between autocast's ops), except under FSDP2, whose bf16
    embedding makes the activations bf16."""
    assert two_ranks[0]["bf16"]["exchanged"] == four_ranks[0]["bf16"]["exchanged"] == {torch.bfloat16}
    assert two_ranks[0]["bf16-mixed"]["exchanged"] == {torch.float32}
    assert four_ranks[0]["fsdp2"]["exchanged"] == {torch.bfloat16}


def test_fsdp2_bf16_mixed_on_2x2_equals_the_same_ranks_without_ep(four_ranks, single):
    for rank in four_ranks:
        assert_same_run(rank["fsdp2"], rank["fsdp2_without_ep"], single["init"])
    # FSDP2's bf16 gathers are not autocast's fp32 weights: its reference cannot be one process under bf16-mixed
    assert four_ranks[0]["fsdp2"]["losses"][0] != single["bf16-mixed"]["losses"][0]


def test_resume_continues_exactly(two_ranks, four_ranks):
    """bf16 (2 ranks, ep 2) and FSDP2 + bf16-mixed (4 ranks, (2, 2)) resumed at step 2 end where the uninterrupted
    runs ended, bit for bit: parameters, optimiser state and checkpoints are fp32 in every precision."""
    for rank in two_ranks:
        assert_resumed_exactly(rank["bf16_resumed"], rank["bf16"])
    for rank in four_ranks:
        assert_resumed_exactly(rank["fsdp2_resumed"], rank["fsdp2"])


def test_bf16_keeps_what_transformers_keeps_in_fp32():
    """DeepSeek-V3's routers (``_keep_in_fp32_modules_strict = [..., "gate.weight"]``) are not cast; the rest is."""
    from autoep.train.precision import bf16_copies
    from autoep.train.trainer import build_model

    model, _ = build_model(compose_cfg("model=deepseek_v3"), None, torch.device("cpu"))
    kept = {n for n, _ in model.named_parameters()} - bf16_copies(model).keys()
    assert kept and all(n.endswith("mlp.gate.weight") for n in kept), kept
    assert {c.dtype for c in bf16_copies(model).values()} == {torch.bfloat16}


def test_unknown_precision_is_refused_before_any_work(tmp_path):
    from autoep.train.trainer import train

    with pytest.raises(ConfigError, match=r"trainer.precision=fp16: must be one of fp32, bf16-mixed, bf16"):
        train(compose_cfg("trainer.precision=fp16", f"run_dir={tmp_path}"))
    assert not any(tmp_path.iterdir())


def test_a_model_built_in_bf16_is_refused_below_fp32(tmp_path):
    """Its bf16 parameters cannot be the fp32 masters: refused before a step, naming the fix."""
    from autoep.train.trainer import train

    with pytest.raises(ConfigError, match=r"trainer.precision=bf16-mixed keeps fp32 master weights, but \d+ of the "
                                          r"model's parameters are bfloat16 .*trainer.precision=fp32"):
        train(compose_cfg("+model.dtype=bfloat16", "trainer.precision=bf16-mixed", f"run_dir={tmp_path}"))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_cuda_device_without_bf16_is_refused(monkeypatch):
    from autoep.train import precision

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    with pytest.raises(ConfigError, match=r"trainer.precision=bf16: Tesla T4 has no bf16 .* trainer.precision=fp32"):
        precision.check_supported("bf16", torch.device("cuda"))
    precision.check_supported("fp32", torch.device("cuda"))  # fp32 asks nothing of the device
