"""HF ``transformers.Trainer`` with expert parallelism (``autoep.integrations.hf.ExpertParallelTrainer``), run as
HF users run it: ``torchrun --nproc-per-node 2`` (and 4: edp 2 x ep 2) over gloo, SGD with momentum, the default ``max_grad_norm=1.0``
(which bites: every step's norm is above 1), checkpoints every 3 of 6 steps.

The reference is the same script with ``transformers.Trainer`` and no autoep (DDP over both ranks). EP must end
with the same losses and every weight (every expert gathered) equal at fp32 tolerance; its checkpoint must load
with ``from_pretrained`` to the EP model's logits and put every expert back on its rank; a run resumed from step
3 must end where the uninterrupted one ends (so the optimizer's momentum of every expert came back too).
bf16: EP against the same bf16 run without it (tolerance in ``test_bf16_equals_the_run_without_ep``).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

WORKER = Path(__file__).with_name("hf_worker.py")


def torchrun(out: Path, *args: str, nproc: int = 2) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(nproc), str(WORKER), str(out), *args], env=env, capture_output=True, text=True,
                              timeout=900)
    except subprocess.TimeoutExpired as exc:  # say where each rank was (slow machine or a hang)
        said = [s.decode(errors="replace") if isinstance(s, bytes) else (s or "") for s in (exc.stdout, exc.stderr)]
        raise AssertionError(f"{nproc}-rank HF Trainer run timed out after {exc.timeout} s:\n{''.join(said)[-6000:]}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return torch.load(out / "result.pt", weights_only=False)


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "edp2xep2"])
def fp32(request, tmp_path_factory):
    """2 ranks: (edp, ep) = (1, 2); 4 ranks: (2, 2), expert gradients also summed over edp."""
    out = tmp_path_factory.mktemp("hf")
    result = torchrun(out, nproc=request.param)
    assert result["world"] == request.param
    return {**result, "dir": out}


def assert_weights_close(got: dict, want: dict, **tol) -> None:
    assert sorted(got) == sorted(want)  # every parameter, every expert (gathered to full shape)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, msg=lambda m: f"{name}: {m}", **tol)


def test_ep_trains_like_the_trainer_without_it(fp32):
    plain, ep = fp32["plain"], fp32["ep"]
    assert len(plain["loss"]) == 6
    assert min(plain["grad_norm"]) > 1.0  # the default max_grad_norm=1.0 clips every step
    torch.testing.assert_close(torch.tensor(ep["loss"]), torch.tensor(plain["loss"]))
    torch.testing.assert_close(torch.tensor(ep["grad_norm"]), torch.tensor(plain["grad_norm"]))
    assert_weights_close(ep["weights"], plain["weights"])
    torch.testing.assert_close(ep["eval_loss"], plain["eval_loss"])  # trainer.evaluate() runs under EP too


def test_gradient_accumulation_finishes_once_per_step(fp32):
    """2 micro-batches per step: DDP skips the first sync, experts accumulate both, finished once."""
    plain, ep = fp32["plain_ga"], fp32["ep_ga"]
    assert len(plain["loss"]) == 3
    torch.testing.assert_close(torch.tensor(ep["loss"]), torch.tensor(plain["loss"]))
    assert_weights_close(ep["weights"], plain["weights"])


def test_detection_runs_on_rank_zero_only(fp32):
    """Every EP trainer of the run (4, plus the checkpoint loader) detected on rank 0; the others only replayed."""
    rank0, *others = fp32["detections"]
    assert rank0 > 0 and others == [0] * (fp32["world"] - 1)


def test_checkpoints_are_saved_and_load_with_from_pretrained(fp32):
    assert fp32["checkpoints"] == ["checkpoint-3", "checkpoint-6", "resolved.yaml"]
    assert {"config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= set(
        fp32["files"])
    ep_logits, loaded_logits = fp32["logits"]
    torch.testing.assert_close(loaded_logits, ep_logits)
    assert fp32["shard_diff"] == 0.0  # each rank's expert rows after loading the checkpoint are the file's rows


def test_resume_ends_where_the_uninterrupted_run_ends(fp32):
    resumed, ep = fp32["resumed"], fp32["ep"]
    torch.testing.assert_close(torch.tensor(resumed["loss"][3:]), torch.tensor(ep["loss"][3:]))
    assert_weights_close(resumed["weights"], ep["weights"])


def test_one_process_resumes_the_multi_rank_checkpoint(fp32):
    """``python train.py`` with parallel.ep_size=1 resumes the 2- (4-) rank run's checkpoint-3, the global batch as
    one per-device batch, and ends where that run ends: every expert and its momentum came back in one process
    (the optimizer and lr scheduler hold the param groups the multi-rank run saved)."""
    from hf_worker import PARALLEL, SAVE_EVERY, TRAINING, arguments, dataset, history, tiny_moe

    from autoep.integrations.hf import ExpertParallelTrainer

    out, per_device = fp32["dir"], TRAINING["per_device_train_batch_size"] * fp32["world"]
    trainer = ExpertParallelTrainer(model=tiny_moe(), args=arguments(str(out / "one"), per_device_train_batch_size=
                                                                     per_device), train_dataset=dataset(),
                                    parallel={**PARALLEL, "ep_size": 1})
    trainer.train(resume_from_checkpoint=str(out / "ep" / f"checkpoint-{SAVE_EVERY}"))
    torch.testing.assert_close(torch.tensor(history(trainer)["loss"]), torch.tensor(fp32["ep"]["loss"]))
    assert_weights_close(dict(trainer.model.state_dict()), fp32["ep"]["weights"])


def test_bf16_equals_the_run_without_ep(tmp_path):
    """bf16=True (autocast; weights and the optimizer stay fp32). Stated tolerance: losses within torch's bf16
    tolerance (rtol 1.6e-2, atol 1e-5), and every weight within 1% of how far the run without EP moved it
    from its initial value (a wrong expert gradient scale moves experts by about their whole update)."""
    from hf_worker import tiny_moe

    bf16 = torchrun(tmp_path, "bf16")
    plain, ep = bf16["plain"], bf16["ep"]
    torch.testing.assert_close(torch.tensor(ep["loss"]), torch.tensor(plain["loss"]), rtol=1.6e-2, atol=1e-5)
    init = tiny_moe().state_dict()
    for name, w in plain["weights"].items():
        moved = (w - init[name]).abs().max().item()
        assert moved > 0, name
        assert (ep["weights"][name] - w).abs().max().item() <= 0.01 * moved, name


@pytest.mark.parametrize("key, value, message", [
    ("fp16", True, "fp16=True"), ("deepspeed", "ds.json", "deepspeed"), ("fsdp", "full_shard", "fsdp"),
    ("load_best_model_at_end", True, "load_best_model_at_end=True"), ("torch_compile", True, "torch_compile=True"),
])
def test_what_the_adapter_does_not_run_exactly_is_refused(key, value, message):
    from autoep.errors import PlanError
    from autoep.integrations.hf import check_args

    args = dict(fp16=False, deepspeed=None, fsdp="", load_best_model_at_end=False, torch_compile=False)
    check_args(SimpleNamespace(**args))
    with pytest.raises(PlanError, match=rf"TrainingArguments.{key}=.*ExpertParallelTrainer refuses {message}"):
        check_args(SimpleNamespace(**{**args, key: value}))


def test_one_process_with_ep_size_one_trains_like_the_trainer(tmp_path):
    """`python train.py` (no torchrun): the adapter runs with parallel.ep_size=1 (the recipes bound, nothing
    sharded) and ends where plain Trainer ends; parallel.ep_size=2 there is refused, naming the fix."""
    from hf_worker import PARALLEL, TRAINING, dataset, run_plain, tiny_moe
    from transformers import TrainingArguments

    from autoep.errors import PlanError
    from autoep.integrations.hf import ExpertParallelTrainer

    short = dict(max_steps=2, save_strategy="no")
    plain = run_plain(str(tmp_path / "plain"), **short)
    args = TrainingArguments(output_dir=str(tmp_path / "ep"), **{**TRAINING, **short})
    trainer = ExpertParallelTrainer(model=tiny_moe(), args=args, train_dataset=dataset(),
                                    parallel={**PARALLEL, "ep_size": 1})
    trainer.train()
    assert (tmp_path / "ep" / "resolved.yaml").is_file()
    assert_weights_close(dict(trainer.model.state_dict()), plain["weights"])
    with pytest.raises(PlanError, match=r"parallel.ep_size=2"):
        ExpertParallelTrainer(model=tiny_moe(), args=args, train_dataset=dataset(), parallel=PARALLEL)
