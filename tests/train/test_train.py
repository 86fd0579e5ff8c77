"""The trainer end to end: EP=2 on 2 gloo ranks equals one process on the concatenated batch (loss
curve and final weights), with dense params replicated and with FSDP2 (``trainer.dense_sharding=fsdp2``),
resume continues the same curve (same ep_size, resharded 2 -> 1, FSDP2 <-> replicated),
and the failure modes (world not divisible by ep_size, missing/corrupt checkpoint, another model).

One spawned 2-rank group runs every distributed case; the single-process cases compare against it.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import free_port, spawn
from hydra import compose, initialize_config_dir
from torch.distributed.tensor import DTensor

from autoep.errors import ConfigError, PlanError
from autoep.train.checkpoint import CheckpointError
from autoep.train.config import CONF_DIR

STEPS = 5
# 2 rows per rank on 2 ranks == 4 rows in one process: the same global batches (autoep.train.data).
SMALL = ["trainer.steps=5", "optim.warmup_steps=2", "trainer.log_every=100", "data.seq_len=16", "trainer.device=cpu"]


def compose_cfg(*overrides: str):
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return compose("train", overrides=[*SMALL, *overrides])


def full_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter as one full tensor (expert DTensors gathered over ep: a collective)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


# A fixed batch whose logits an exported run must reproduce through from_pretrained.
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))


def run(*overrides: str) -> dict:
    from autoep.runtime.dense import is_expert
    from autoep.train.trainer import train

    result = train(compose_cfg(*overrides))
    model = result.pop("model")
    if "trainer.export_hf=true" in overrides:
        model.eval()
        with torch.no_grad():  # NOTE: an EP forward is a collective: every rank runs the same batch
            result["logits"] = model(input_ids=IDS).logits
    result["dense_meshes"] = {p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else None
                              for p in model.parameters() if not is_expert(p)}
    result["weights"] = full_weights(model)
    metrics = Path(result["run_dir"]) / "metrics.jsonl"  # rank 0 writes it; Adam hides a grad scale error, the norm does not
    rows = metrics.read_text().splitlines()[-len(result["losses"]):] if metrics.is_file() else []
    result["grad_norms"] = [json.loads(line)["grad_norm"] for line in rows]
    return result


def ep2_worker(rank: int, world_size: int, tmp: str) -> dict:
    torch.set_num_threads(1)
    out = {"full": run("parallel.ep_size=2", "data.batch_size=2", "trainer.ckpt_every=2", f"run_dir={tmp}/ep2",
                       "trainer.export_hf=true")}
    out["resumed"] = run("parallel.ep_size=2", "data.batch_size=2", f"run_dir={tmp}/ep2",
                         f"trainer.resume={tmp}/ep2/checkpoints/step_00000002")
    out["accum"] = run("parallel.ep_size=2", "data.batch_size=2", "trainer.grad_accum=2", "trainer.steps=3",
                       f"run_dir={tmp}/accum2")
    fsdp2 = ("parallel.ep_size=2", "data.batch_size=2", "trainer.dense_sharding=fsdp2")
    out["fsdp2"] = run(*fsdp2, "trainer.ckpt_every=2", f"run_dir={tmp}/fsdp2")
    out["fsdp2_resumed"] = run(*fsdp2, f"run_dir={tmp}/fsdp2", f"trainer.resume={tmp}/fsdp2/checkpoints/step_00000002")
    out["fsdp2_from_replicate"] = run(*fsdp2, f"run_dir={tmp}/fsdp2_from_rep",
                                      f"trainer.resume={tmp}/ep2/checkpoints/step_00000002")
    try:
        run("parallel.ep_size=4", f"run_dir={tmp}/bad")
    except PlanError as e:
        out["not_divisible"] = str(e)
    return out


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    results = spawn(2, "test_train:ep2_worker", str(tmp))
    return tmp, results[0]


@pytest.fixture(scope="module")
def single(ep2):
    tmp, _ = ep2
    return run("data.batch_size=4", "trainer.ckpt_every=2", f"run_dir={tmp}/ep1", "trainer.export_hf=true")


def assert_weights_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=lambda m, n=name: f"{n}: {m}")


def test_loss_falls_and_artifacts_written(single):
    run_dir = Path(single["run_dir"])
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == STEPS
    assert (run_dir / "resolved.yaml").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002", "step_00000004", "step_00000005"]
    assert single["losses"][-1] < single["losses"][0]


def test_ep2_equals_single_process(ep2, single):
    _, r = ep2
    torch.testing.assert_close(torch.tensor(r["full"]["losses"]), torch.tensor(single["losses"]))
    torch.testing.assert_close(torch.tensor(r["full"]["grad_norms"]), torch.tensor(single["grad_norms"]))
    assert_weights_equal(r["full"]["weights"], single["weights"])


def test_grad_accumulation_under_ep_equals_single_process(ep2):
    tmp, r = ep2
    single = run("data.batch_size=4", "trainer.grad_accum=2", "trainer.steps=3", f"run_dir={tmp}/accum1")
    torch.testing.assert_close(torch.tensor(r["accum"]["losses"]), torch.tensor(single["losses"]))
    assert_weights_equal(r["accum"]["weights"], single["weights"])


def test_resume_continues_same_curve(ep2):
    _, r = ep2
    torch.testing.assert_close(torch.tensor(r["resumed"]["losses"]), torch.tensor(r["full"]["losses"][2:]))
    assert_weights_equal(r["resumed"]["weights"], r["full"]["weights"])


def test_resume_reshards_ep2_to_ep1(ep2):
    tmp, r = ep2
    resumed = run("data.batch_size=4", f"run_dir={tmp}/reshard", f"trainer.resume={tmp}/ep2/checkpoints/step_00000002")
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(r["full"]["losses"][2:]))
    assert_weights_equal(resumed["weights"], r["full"]["weights"])


def test_fsdp2_dense_sharding_ep2_equals_single_process(ep2, single):
    _, r = ep2
    assert r["fsdp2"]["dense_meshes"] == {("dp",)} and r["full"]["dense_meshes"] == {None}
    torch.testing.assert_close(torch.tensor(r["fsdp2"]["losses"]), torch.tensor(single["losses"]))
    torch.testing.assert_close(torch.tensor(r["fsdp2"]["grad_norms"]), torch.tensor(single["grad_norms"]))
    assert_weights_equal(r["fsdp2"]["weights"], single["weights"])


def test_fsdp2_checkpoints_resume_and_reshard(ep2, single):
    """An FSDP2 checkpoint resumes under FSDP2, loads into one replicated process (dense and experts
    resharded), and a replicated ep=2 checkpoint resumes under FSDP2: all continue the same curve."""
    tmp, r = ep2
    for resumed in (r["fsdp2_resumed"], r["fsdp2_from_replicate"],
                    run("data.batch_size=4", f"run_dir={tmp}/fsdp2_to_ep1",
                        f"trainer.resume={tmp}/fsdp2/checkpoints/step_00000002")):
        torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(single["losses"][2:]))
        assert_weights_equal(resumed["weights"], single["weights"])


def test_export_hf_loads_with_from_pretrained_to_the_same_logits(ep2, single):
    """trainer.export_hf=true, after EP over 2 ranks and in one process: from_pretrained gives the trained
    weights and the trained model's logits."""
    from transformers import AutoModelForCausalLM

    _, r = ep2
    for result in (r["full"], single):
        hf_dir = Path(result["run_dir"]) / "hf"
        assert sorted(p.name for p in hf_dir.iterdir()) == ["config.json", "model.safetensors"]
        loaded = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        assert_weights_equal({n: p.detach() for n, p in loaded.named_parameters()}, result["weights"])
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=IDS).logits, result["logits"])


def test_unknown_dense_sharding_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.dense_sharding=ddp: must be one of replicate, fsdp2"):
        run("trainer.dense_sharding=ddp", f"run_dir={tmp_path}")


def test_world_not_divisible_by_ep_size(ep2):
    _, r = ep2
    msg = r["not_divisible"]
    assert "parallel.ep_size=4" in msg and "world size 2" in msg and "[1, 2]" in msg


def test_missing_and_corrupt_checkpoints(ep2, tmp_path):
    tmp, _ = ep2
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        run(f"run_dir={tmp_path}/a", f"trainer.resume={tmp_path}/nope")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        run(f"run_dir={tmp_path}/b", "trainer.resume=latest")
    broken = tmp_path / "broken"
    shutil.copytree(tmp / "ep1" / "checkpoints" / "step_00000002", broken)
    (broken / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        run("data.batch_size=4", f"run_dir={tmp_path}/c", f"trainer.resume={broken}")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tmp / "ep1" / "checkpoints" / "step_00000002", corrupt)
    for f in corrupt.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="DCP load failed"):
        run("data.batch_size=4", f"run_dir={tmp_path}/d", f"trainer.resume={corrupt}")


def test_resume_with_another_model_is_refused(ep2, tmp_path):
    tmp, _ = ep2
    with pytest.raises(CheckpointError, match="different model"):
        run("model.moe_intermediate_size=8", f"run_dir={tmp_path}/m",
            f"trainer.resume={tmp}/ep1/checkpoints/step_00000002")


def test_cli_default_command(tmp_path):
    """README command 1's ``autoep-train`` (3 steps) from a fresh directory: the run lands in Hydra's default run
    dir, ``outputs/<date>/<time>``, and leaves there its log, metrics and, matplotlib being importable (the ``hf``
    extra installs it), the expert load heatmap ``load.png``."""
    from test_load import assert_heatmap

    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, "-m", "autoep.train", "trainer.steps=3", "trainer.ckpt_every=2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no warnings in a normal run (DCP's single-process one included)
    assert "step     1/3 | loss" in proc.stdout and "tok/s" in proc.stdout
    (run_dir,) = tmp_path.glob("outputs/*/*")
    assert proc.stdout.splitlines()[-1] == f"run dir: {run_dir}"
    assert "step     3/3 | loss" in (run_dir / "train.log").read_text()  # the run's log, through logging
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3
    assert f"expert load heatmap: {run_dir / 'load.png'}" in proc.stdout
    assert_heatmap(run_dir / "load.png")
    bad = subprocess.run([sys.executable, "-m", "autoep.train", "parallel.ep_size=2", f"run_dir={tmp_path}/bad"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "parallel.ep_size=2 does not divide the world size 1" in bad.stderr


def test_torchrun_two_ranks_ep2(tmp_path):
    """The README's torchrun form, literally (torch.distributed.run is torchrun's module), on CPU gloo."""
    port = free_port()
    steps = 3
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(port), "-m", "autoep.train", "parallel.ep_size=2",
                           f"trainer.steps={steps}", f"run_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "model.layers.0.mlp" in proc.stdout and "autoep.runtime.recipes.batched.ep_batched_experts  4" in proc.stdout


def test_torchrun_config_error_is_printed_once_and_named_in_torchrun_summary(tmp_path):
    """A config error under torchrun: autoep's line once (rank 0), torchrun exits 1 and its failure summary shows
    the same line and exit code 2 (the README's exit codes) instead of an empty traceback."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "-m", "autoep.train", "parallel.ep_size=2", "trainer.steps=0",
                           f"run_dir={tmp_path}"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = "autoep-train: error: trainer.steps=0: must be an integer >= 1"
    assert proc.returncode == 1
    printed = [ln for ln in proc.stderr.splitlines() if ln.startswith("autoep-train: error:")]
    assert len(printed) == 1 and printed[0].startswith(line), proc.stderr[-3000:]
    assert f"traceback : {line}" in proc.stderr and "exitcode  : 2" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_non_finite_loss_stops_the_run_keeping_the_last_good_checkpoint(tmp_path, monkeypatch):
    """Step 3's loss is not finite (made nan here): step 3 is not applied, nothing of it is saved, step 2 stays
    the newest checkpoint and the last metrics row, and resume=latest continues from it. With
    trainer.on_nonfinite=skip the run goes on: step 3 is logged as skipped and no weight turns nan."""
    from autoep.errors import NonFiniteLoss
    from autoep.train import loop

    real, calls = loop.causal_lm_loss, []

    def nan_at_step_3(*args, **kwargs):
        calls.append(1)
        loss = real(*args, **kwargs)
        return loss * float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(loop, "causal_lm_loss", nan_at_step_3)
    with pytest.raises(NonFiniteLoss, match=r"step 3: loss nan and gradient norm nan, not finite; the step was not "
                                            r"applied and nothing of it saved; the last good checkpoint, .*step_00000002, "
                                            r"is kept\. Lower optim.lr"):
        run("trainer.steps=4", "trainer.ckpt_every=1", f"run_dir={tmp_path}/a")
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    assert [json.loads(r)["step"] for r in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    calls.clear()
    calls.extend([1] * 10)  # no more nan
    resumed = run("trainer.steps=4", "trainer.resume=latest", f"run_dir={tmp_path}/a")
    assert len(resumed["losses"]) == 2 and all(math.isfinite(x) for x in resumed["losses"])

    calls.clear()
    skipped = run("trainer.steps=3", "trainer.on_nonfinite=skip", f"run_dir={tmp_path}/b")
    rows = [json.loads(r) for r in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and [r.get("skipped", False) for r in rows] == [False, False, True]
    assert rows[2]["loss"] is None and math.isnan(skipped["losses"][2])
    assert all(torch.isfinite(w).all() for w in skipped["weights"].values())  # the nan step touched no weight
