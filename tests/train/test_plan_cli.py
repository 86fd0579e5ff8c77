"""The real autoep-plan entry point in subprocesses: table, resolved.yaml, replay, opt-out/opt-in, refusals.

Each process imports torch and transformers (seconds), so independent runs go concurrently in two waves.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_config import DOC_OVERRIDES

from autoep.plan.artifact import plan_hash

EXPLICIT, AUTO, NO_DETECT = DOC_OVERRIDES[0], DOC_OVERRIDES[1], DOC_OVERRIDES[2]
DRAWS = "parallel.plan.0.expert_draws=on_owner"  # docs/overrides.md, README "Randomness in experts"
SCRIPT = Path(sys.executable).parent / "autoep-plan"


def command(*args):
    entry = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "autoep.train.dry_run"]
    return entry + list(args)


def run_all(tmp_path, runs: dict) -> dict:
    """Start every run at once; ``{name: CompletedProcess-like (returncode, stdout, stderr)}``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    procs = {name: subprocess.Popen(command(*args, f"hydra.run.dir={tmp_path / name}"), cwd=tmp_path, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, args in runs.items()}
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        out[name] = (p.returncode, stdout, stderr)
    return out


def resolved(tmp_path, name):
    return yaml.safe_load((tmp_path / name / "resolved.yaml").read_text())


def ok(result):
    rc, stdout, stderr = result
    assert rc == 0, stderr[-3000:]
    return stdout


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    first = run_all(tmp, {"auto": ["parallel.ep_size=2"], "explicit": [EXPLICIT], "nodetect": [NO_DETECT],
                          "draws": [DRAWS]})
    ok(first["auto"]), ok(first["explicit"])
    text = (tmp / "auto" / "resolved.yaml").read_text()
    edited_text = text.replace("num_experts: 8", "num_experts: 16")
    (tmp / "edited").mkdir()
    (tmp / "edited" / "resolved.yaml").write_text(edited_text)
    # Edited and re-hashed (artifact.plan_hash made to match): the decision's own fingerprint still refuses it.
    old_hash = yaml.safe_load(text)["artifact"]["plan_hash"]
    (tmp / "rehashed").mkdir()
    (tmp / "rehashed" / "resolved.yaml").write_text(
        edited_text.replace(old_hash, plan_hash(yaml.safe_load(edited_text)["parallel"])))
    replay = ["--config-name", "resolved"]
    second = run_all(tmp, {
        "replay": ["--config-dir", str(tmp / "auto"), *replay],
        "back_to_auto": ["--config-dir", str(tmp / "explicit"), *replay, AUTO, "parallel.plan.0.decision=null"],
        "hand_edited": ["--config-dir", str(tmp / "edited"), *replay],
        "rehashed": ["--config-dir", str(tmp / "rehashed"), *replay],
    })
    return tmp, {**first, **second}


def test_plan_prints_one_row_per_module_and_writes_resolved(cli):
    tmp, results = cli
    stdout = ok(results["auto"])
    rows = [line.split() for line in stdout.splitlines() if line.startswith("model.layers.")]
    # Qwen3-MoE tiny: 8 experts x (gate_up 2*16*32 + down 32*16) fp32 = 49152 bytes per layer, ep_size 2.
    assert rows == [[f"model.layers.{i}.mlp", "topk_router_module/none/batched_parameters", "grouped",
                     "autoep.runtime.recipes.batched.ep_batched_experts", "4", "24576"] for i in (0, 1)]
    cfg = resolved(tmp, "auto")
    assert cfg["parallel"]["plan"][0]["decision"]["source"] == "auto"
    assert f"wrote {tmp / 'auto' / 'resolved.yaml'}" in stdout


def test_replay_reproduces_the_plan_without_change(cli):
    tmp, results = cli
    ok(results["replay"])
    assert resolved(tmp, "replay") == resolved(tmp, "auto")


def test_opt_out_then_back_in(cli):
    tmp, results = cli
    assert "explicit" in ok(results["explicit"])
    out = resolved(tmp, "explicit")["parallel"]["plan"][0]
    assert out["decision"]["source"] == "explicit" and out["decision"]["structure"] is None
    assert out["local_compute_fn"]["structure"]["router"] == "topk_router_module"
    ok(results["back_to_auto"])
    back = resolved(tmp, "back_to_auto")["parallel"]["plan"][0]
    assert back["decision"]["source"] == "auto"
    assert back["decision"]["structure"]["router"] == "topk_router_module"


def test_detect_false_refuses_auto_entries(cli):
    tmp, results = cli
    rc, _, stderr = results["nodetect"]
    assert rc == 2
    assert "autoep-plan: error: parallel.plan.0.local_compute_fn=auto but parallel.detect=false" in stderr
    assert not (tmp / "nodetect" / "resolved.yaml").exists()


def test_hand_edited_resolved_yaml_is_refused(cli):
    tmp, results = cli
    rc, _, stderr = results["hand_edited"]
    assert rc == 2 and "does not match its parallel section" in stderr and "artifact.plan_hash" in stderr, stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert not (tmp / "hand_edited").exists()  # refused before Hydra made a run dir
    rc, _, stderr = results["rehashed"]
    assert rc == 2 and "parallel.plan.0: match/local_compute_fn/decision were changed" in stderr, stderr


def test_the_draws_opt_in_is_recorded_and_changes_nothing_where_nothing_draws(cli):
    """Qwen3-MoE's experts draw nothing: the same structure as without the key, the key kept in resolved.yaml."""
    tmp, results = cli
    ok(results["draws"])
    assert DRAWS in (Path(__file__).resolve().parents[2] / "docs" / "overrides.md").read_text()
    draws, auto = resolved(tmp, "draws")["parallel"]["plan"][0], resolved(tmp, "auto")["parallel"]["plan"][0]
    assert draws["expert_draws"] == "on_owner" and draws["decision"]["structure"]["expert_draws"] == []
    assert draws["decision"]["structure"] == auto["decision"]["structure"]
