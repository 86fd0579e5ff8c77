"""The Lightning adapter (``autoep.integrations.lightning.ExpertParallelStrategy``) against Lightning's own
``strategy="ddp"`` without EP: a tiny transformers Qwen3-MoE, 2 gloo ranks, SGD with momentum (a wrong expert
gradient scale shows in the weights; Adam would hide it).

- parity: the losses and every weight (experts gathered) after 6 steps equal the run without EP at fp32
  (the Qwen3-MoE's batched experts, and v4-style ModuleList experts)
  tolerance, also with ``gradient_clip_val`` (by norm and by value), gradient accumulation and manual
  optimization (``manual_backward``, ``clip_gradients``, ``opt.step()``), and AdamW with its foreach kernels
  (which cannot take expert DTensors and dense tensors in one list; or with the handle's param groups,
  which keep them); a run with the
  issue's bug (expert gradients W x too large) is not equal, so the comparison can fail.
- ``precision="bf16-mixed"``: equal within BF16_TOL (stated below), the same bug again not equal; fp16 with its
  GradScaler and the half-precision weights are refused at ``Trainer(...)``.
- ``ModelCheckpoint``: the file holds every expert (full shape) and the optimizer's state;
  ``trainer.test(ckpt_path="best")`` (same trainer, and a fresh module and trainer) leaves every rank's experts
  equal to what was saved; ``trainer.fit(ckpt_path=<epoch 0>)`` ends where the uninterrupted run ended.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="the Lightning adapter's tests need lightning (pip install '.[test]')")

from distributed import spawn  # noqa: E402

# bf16-mixed: the matmuls run in bf16 under autocast on both sides, the master weights and the optimizer stay
# fp32. EP reorders no reduction inside a row's computation, so the runs agree far more closely than bf16's
# resolution (measured: max weight diff 1.5e-8 after 6 steps); the stated tolerance leaves rounding-order room
# and is still far below the drift of a W x expert gradient (1.1e-3 max weight diff after 6 steps, the
# summed-experts control, which must fail it).
BF16_TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    return spawn(2, "lightning_moe:parity_worker", str(tmp_path_factory.mktemp("parity")))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return spawn(2, "lightning_moe:checkpoint_worker", str(tmp_path_factory.mktemp("ckpt")))


def assert_same_run(a: dict, b: dict, **tol) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), **tol)
    assert a["weights"].keys() == b["weights"].keys()
    for name in a["weights"]:
        torch.testing.assert_close(a["weights"][name], b["weights"][name], msg=lambda m: f"{name}: {m}", **tol)


def max_weight_diff(a: dict, b: dict) -> float:
    return max((a["weights"][n] - b["weights"][n]).abs().max().item() for n in a["weights"])


def test_the_baseline_is_ddp_of_the_global_batch(parity):
    """Lightning's ``ddp`` without EP (every comparison's reference) trains as one process on the global batch."""
    from lightning_moe import reference_fit

    reference = reference_fit(world_size=2)
    for rank in parity:
        for name, w in reference["weights"].items():
            torch.testing.assert_close(rank["plain"]["ref"]["weights"][name], w, msg=name)


@pytest.mark.parametrize("setting", ["plain", "clip_norm", "clip_value", "accumulate", "manual", "adamw_foreach",
                                     "adamw_groups"])
def test_ddp_with_the_adapter_equals_ddp_without_ep(parity, setting):
    for rank in parity:
        assert_same_run(rank[setting]["ep"], rank[setting]["ref"])


def test_info_lines_are_logged_once_per_run(parity):
    """Rank 0 alone logs autoep's info lines (the plan table, the param group stepping per parameter): in a host
    whose logging shows every rank they printed once per rank (issue 20)."""
    lines = [rank["info_lines"] for rank in parity]
    assert lines[1] == [], lines[1]
    assert any("autoep plan" in line for line in lines[0]), lines[0]
    assert any("param group 0 mixes expert and dense parameters" in line for line in lines[0]), lines[0]


def test_module_list_experts_train_the_same_losses(parity):
    for rank in parity:
        torch.testing.assert_close(torch.tensor(rank["module_list"]["ep"]["losses"]),
                                   torch.tensor(rank["module_list"]["ref"]["losses"]))


def test_module_list_experts_keep_the_models_own_weights(parity):
    """ModuleList experts stay the model's own modules and names (issue 16): every weight lines up with the run
    without EP."""
    for rank in parity:
        assert_same_run(rank["module_list"]["ep"], rank["module_list"]["ref"])


def test_the_settings_change_the_run(parity):
    """Clipping and accumulation were active: each reference differs from the plain run."""
    plain = parity[0]["plain"]["ref"]
    for setting in ("clip_norm", "clip_value", "accumulate", "manual"):
        assert max_weight_diff(parity[0][setting]["ref"], plain) > 1e-4, setting


def test_clipping_part_of_the_model_by_norm_is_refused(parity):
    for rank in parity:
        assert rank["partial_clip"] is not None and rank["partial_clip"].startswith("PlanError: gradient_clip_val by "
                                                                                     "norm"), rank["partial_clip"]
        assert re.search(r"this SGD holds \d+ of them", rank["partial_clip"]), rank["partial_clip"]


def test_summed_expert_gradients_are_caught(parity):
    """The issue's bug (experts get W x their gradient) fails the parity comparison, in fp32 and bf16."""
    for setting, tol in (("plain", {}), ("bf16", BF16_TOL)):
        with pytest.raises(AssertionError):
            assert_same_run(parity[0][setting]["summed"], parity[0][setting]["ref"], **tol)


def test_bf16_mixed_equals_the_run_without_ep(parity):
    for rank in parity:
        assert_same_run(rank["bf16"]["ep"], rank["bf16"]["ref"], **BF16_TOL)
    # bf16 really ran: its reference is not the fp32 run
    assert max_weight_diff(parity[0]["bf16"]["ref"], parity[0]["plain"]["ref"]) > 0


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-true", "16-true", "64-true"])
def test_untested_precisions_are_refused(precision):
    """Refused when the strategy gets the plugin (on CPU, Lightning turns ``precision="16-mixed"`` into
    bf16-mixed before that, so fp16's plugin is handed over directly here, as a GPU Trainer would)."""
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision

    from autoep.errors import PlanError
    from autoep.integrations.lightning import ExpertParallelStrategy

    plugin = {"16-mixed": lambda: MixedPrecision("16-mixed", "cpu"), "64-true": DoublePrecision}.get(
        precision, lambda: HalfPrecision(precision))()
    with pytest.raises(PlanError, match=rf"precision='{precision}'.*use precision='bf16-mixed' or '32-true'"):
        ExpertParallelStrategy({"ep_size": 1}, precision_plugin=plugin)


def test_a_refused_precision_stops_the_trainer_before_it_runs():
    import lightning as L

    from autoep.errors import PlanError
    from autoep.integrations.lightning import ExpertParallelStrategy

    with pytest.raises(PlanError, match="precision='bf16-true'"):
        L.Trainer(accelerator="cpu", devices=1, precision="bf16-true", strategy=ExpertParallelStrategy({"ep_size": 1}))


def test_a_compiled_module_is_refused_before_a_step(tmp_path):
    """The real Lightning Trainer, one process: ``fit(torch.compile(module))`` stops in the strategy's setup."""
    import lightning as L
    from lightning_moe import MoeLM, Tokens

    from autoep.errors import PlanError
    from autoep.integrations.lightning import ExpertParallelStrategy

    environ = dict(os.environ)
    module = MoeLM()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        default_root_dir=str(tmp_path), strategy=ExpertParallelStrategy(
                            {"ep_size": 1, "plan": [{"match": "model.model.layers.*.mlp"}]}))
    try:
        with pytest.raises(PlanError, match=r"torch.compile\(module\).*whole training_step.*pass the module uncompiled"):
            trainer.fit(torch.compile(module, backend="aot_eager"), torch.utils.data.DataLoader(Tokens(2), batch_size=1))
    finally:  # the strategy's setup created a one-process group: later tests in this process expect none
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        # and Lightning's launch wrote MASTER_ADDR/MASTER_PORT/NODE_RANK/LOCAL_RANK into os.environ: left there, a
        # later ``python train.py`` subprocess believes an outside launcher started it and waits for rank 1 forever
        os.environ.clear()
        os.environ.update(environ)
    assert module.losses == []  # no step ran


def test_spawn_is_refused():
    from autoep.errors import PlanError
    from autoep.integrations.lightning import ExpertParallelStrategy

    with pytest.raises(PlanError, match="start_method='spawn'.*only rank 0's experts"):
        ExpertParallelStrategy({"ep_size": 2}, start_method="spawn")


KINDS = ["full", "sharded"]  # ExpertParallelStrategy(state_dict_type=...): one .ckpt file, or a DCP directory


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_keeps_every_expert_and_the_optimizer(checkpoints, kind):
    run = checkpoints[0][kind]
    assert {"epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"} <= set(run["files"])
    model_state, optimizer_state = run["last_saved"]
    for name, full in run["final"].items():  # every expert at full shape, equal to the trained weights
        torch.testing.assert_close(model_state[name], full, rtol=0, atol=0, msg=name)
    experts = [n for n in run["final"] if ".experts." in n]
    assert experts and all(optimizer_state[n]["momentum_buffer"].shape == run["final"][n].shape for n in experts)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", ["test_same", "test_fresh"])
def test_test_from_best_restores_every_expert_on_every_rank(checkpoints, case, kind):
    for rank in checkpoints:
        shards, expected = rank[kind][case]
        assert shards.keys() == expected.keys() and shards
        for name in shards:
            torch.testing.assert_close(shards[name], expected[name], rtol=0, atol=0, msg=name)
    # the fresh module's dense weights came from the checkpoint too (its own init differs)
    run = checkpoints[0][kind]
    for name, w in run["test_fresh_weights"].items():
        torch.testing.assert_close(w, run["best_saved"][name], rtol=0, atol=0, msg=name)


def test_the_checkpoint_loads_without_ep(checkpoints):
    """The full ``.ckpt`` is an ordinary Lightning checkpoint: one process, no EP, ``load_from_checkpoint``."""
    from lightning_moe import MoeLM

    run = checkpoints[0]["full"]
    loaded = MoeLM.load_from_checkpoint(run["best"], map_location="cpu", weights_only=False)
    state = loaded.state_dict()
    assert state.keys() == run["best_saved"].keys()
    for name, w in run["best_saved"].items():
        torch.testing.assert_close(state[name], w, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_resume_continues_the_same_run(checkpoints, kind):
    """Resumed from the epoch-0 checkpoint (weights and SGD momentum), the run ends where the uninterrupted
    one ended."""
    for rank in checkpoints:
        for name, w in rank[kind]["final"].items():
            torch.testing.assert_close(rank[kind]["resumed"][name], w, msg=name)

@pytest.mark.parametrize("kind", KINDS)
def test_a_host_apps_checkpoints_load_as_without_ep(checkpoints, kind):
    """Issue 20: a module that saves a Hydra partial with its hyperparameters (lightning-hydra-template's), loaded
    with ``weights_only=False`` as the host passes it: ``trainer.test(ckpt_path="best")``, an eval script's fresh
    module and trainer, and ``trainer.fit(ckpt_path=<epoch 0>)`` give the test losses and weights of the same runs
    without EP (they crashed with a weights-only unpickling error: the caller's ``weights_only`` was dropped)."""
    for rank in checkpoints:
        ref, ep = rank["host"]["ddp"], rank["host"][kind]
        assert "error" not in ref, ref["error"]
        assert "error" not in ep, ep["error"]
        torch.testing.assert_close(torch.tensor([ep["test"], ep["eval"]]), torch.tensor([ref["test"], ref["eval"]]))
        for what in ("final", "tested", "resumed"):
            assert ep[what].keys() == ref[what].keys()
            for name in ref[what]:
                torch.testing.assert_close(ep[what][name], ref[what][name], msg=lambda m: f"{what} {name}: {m}")
    ref = checkpoints[0]["host"]["ddp"]
    for name in ref["final"]:  # the resumed run is the uninterrupted one, and "best" is not the last epoch's
        torch.testing.assert_close(ref["resumed"][name], ref["final"][name], msg=name)
    assert any(not torch.equal(ref["tested"][n], ref["final"][n]) for n in ref["final"]), "best is the last epoch"


def test_the_host_apps_checkpoints_need_weights_only_false():
    """The control: the hyperparameters of ``HostMoeLM`` are refused by ``torch.load(weights_only=True)``, so the
    comparison above loads what a ``weights_only=True`` read could not (this is what the adapter dropped)."""
    import io
    import pickle

    from lightning_moe import HostMoeLM

    buffer = io.BytesIO()
    torch.save({"hyper_parameters": HostMoeLM().hparams}, buffer)  # what save_hyperparameters puts in a checkpoint
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(buffer, weights_only=True)


def test_a_strategy_override_is_refused_before_a_step(checkpoints):
    """Issue 20: ``trainer.strategy`` overridden away from ExpertParallelStrategy (here by Lightning's plain
    ``ddp``) silently trained without EP; with ``RequireExpertParallel`` in the callbacks it stops in setup, no
    step taken, no weight moved, naming the strategy and the fix."""
    for rank in checkpoints:
        run = rank["require_ep"]
        assert run["error"] is not None and run["error"].startswith(
            "PlanError: trainer.strategy is Lightning's DDPStrategy"), run["error"]
        assert "without expert parallelism" in run["error"] and "remove RequireExpertParallel" in run["error"]
        assert run["steps"] == 0 and run["moved"] == []


DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def lightning_section_files() -> dict[str, str]:
    """The files docs/integrations.md's Lightning section shows: each fenced block under the backticked path
    that introduces it (```` `conf/config.yaml` ````, ```` `train.py` ````)."""
    section = DOCS.read_text().split("\n## PyTorch Lightning\n", 1)[1].split("\n## ", 1)[0]
    files = dict(re.findall(r"`([\w/]+\.(?:yaml|py))`[^`\n]*\n*```(?:yaml|python)\n(.*?)```", section, re.S))
    assert set(files) == {"conf/config.yaml", "train.py"}, sorted(files)
    return files


def docs_app(tmp_path: Path):
    """docs/integrations.md's Lightning app written into ``tmp_path``; returns ``run(command, ok=True)``, which
    runs a command there as its users would and returns its output."""
    import autoep

    for name, text in lightning_section_files().items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    project = tmp_path / "my_project"  # "your" LightningModule and data: the tests' tiny Qwen3-MoE ones
    project.mkdir()
    (project / "__init__.py").write_text("")
    (project / "models.py").write_text("from lightning_moe import MoeLM  # noqa: F401\n")
    (project / "data.py").write_text("from lightning_moe import TokenData  # noqa: F401\n")
    tests = Path(__file__).resolve().parents[1]
    path = [str(Path(autoep.__file__).parents[1]), str(tests), str(tests / "integrations"), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}

    def run(command: list[str], ok: bool = True) -> str:
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert (done.returncode == 0) == ok, done.stdout[-3000:] + done.stderr[-5000:]
        return done.stdout + done.stderr
    return run


def test_the_docs_lightning_app_runs_and_replays(tmp_path):
    """docs/integrations.md's Lightning app, as its users run it: ``python train.py``; Lightning starts the
    second rank itself (re-running the script with Hydra's run dir), fits, and tests the best checkpoint. Then
    the replay line its ``resolved.yaml`` prints, run as printed: the same frozen plan, replayed."""
    run = docs_app(tmp_path)
    log = run([sys.executable, "train.py", f"hydra.run.dir={tmp_path / 'run'}"])
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in log  # Lightning launched the second rank
    resolved = (tmp_path / "run" / "resolved.yaml").read_text()
    assert "model.model.layers.0.mlp" in resolved and "decision" in resolved
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert ckpts, log[-3000:]
    state = torch.load(ckpts[-1], map_location="cpu", weights_only=False)["state_dict"]
    assert state["model.model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8  # every expert, not rank 0's 4

    replay = next(line for line in resolved.splitlines() if "++parallel.replay=" in line).lstrip("# ").strip()
    log = run(["bash", "-c", replay])
    assert "replaying its frozen plan" in log and "GLOBAL_RANK: 1, MEMBER: 2/2" in log
    (again,) = (tmp_path / "outputs").rglob("resolved.yaml")
    body = lambda text: text[text.index("\nparallel:"):]  # noqa: E731 - the header names each file's own path
    assert body(again.read_text()) == body(resolved)


def test_the_docs_lightning_app_refuses_a_strategy_override(tmp_path):
    """Issue 20: ``trainer.strategy=ddp_spawn`` on the docs app's command line trained without EP, silently. Its
    ``RequireExpertParallel`` callback stops each spawned rank in setup, naming the override and the fix."""
    run = docs_app(tmp_path)
    log = run([sys.executable, "train.py", f"hydra.run.dir={tmp_path / 'run'}", "trainer.strategy=ddp_spawn"], ok=False)
    assert ("PlanError: trainer.strategy is Lightning's DDPStrategy(start_method='spawn'), set by "
            "trainer.strategy=ddp_spawn, not autoep.integrations.lightning.ExpertParallelStrategy, so the model "
            "would train without expert parallelism") in log, log[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()  # no step, no checkpoint
