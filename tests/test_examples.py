"""examples/research_moe: someone else's Hydra app with a plain torchrun loop on autoep's public handle."""
import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import free_port

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "research_moe" / "train.py"
EXPLICIT = "parallel.plan.0.local_compute_fn={_target_:my_ep.replicated_experts,count_tokens:true}"


def run(tmp_path, *overrides, nproc=1) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        cmd = [sys.executable, str(EXAMPLE)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), str(EXAMPLE)]
    out = subprocess.run(cmd + [f"run_dir={tmp_path}", *overrides], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", stdout)]


def example_model():
    """The example's model, seeded as its train.py seeds it, made EP-ready at ep_size 1 by the handle."""
    from omegaconf import OmegaConf

    from autoep import ExpertParallel

    spec = importlib.util.spec_from_file_location("research_moe_model", EXAMPLE.parent / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    conf = OmegaConf.load(EXAMPLE.parent / "conf" / "config.yaml")
    torch.manual_seed(conf.seed)
    model = module.TinyMoELM(**{k: v for k, v in conf.model.items() if k != "_target_"})
    return model, ExpertParallel(model, {"ep_size": 1, "plan": OmegaConf.to_container(conf.parallel.plan)})


def trained_weights(run_dir: Path | None) -> dict:
    """Every weight of ``run_dir/checkpoint`` at full shape, read back in this process at ep_size 1 (DCP reshards
    whatever ep_size wrote it); the initial weights for None."""
    model, ep = example_model()
    if run_dir is not None:
        ep.load(run_dir / "checkpoint")
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_auto_explicit_and_two_rank_ep_train_the_same(tmp_path):
    """SGD, 8 steps: one process (auto recipe), one process with the model's own loop (explicit), and EP over
    2 gloo ranks give the same losses; the EP run ends with every weight equal to the one-process run's."""
    auto = run(tmp_path / "auto")
    assert "decision: auto {'router': 'softmax_topk'" in auto and "'expert_projs': ['w1', 'w3', 'w2']" in auto
    explicit = run(tmp_path / "explicit", EXPLICIT)
    assert "decision: explicit" in explicit
    assert "tokens seen by the user's compute fn: [1024, 1024]" in explicit  # the user's fn really ran
    ep2 = run(tmp_path / "ep2", "parallel.ep_size=2", nproc=2)
    a, e, p = losses(auto), losses(explicit), losses(ep2)
    assert len(a) == len(e) == len(p) == 8
    assert a[-1] < a[0]  # it learns
    # The auto recipe (single process, and EP over 2 ranks) trains exactly like the model's own forward.
    assert a == pytest.approx(e, abs=1e-5) and p == pytest.approx(e, abs=1e-5)
    assert (tmp_path / "auto" / "resolved.yaml").exists()
    one, two = trained_weights(tmp_path / "auto"), trained_weights(tmp_path / "ep2")
    assert sorted(one) == sorted(two) and any("moe" in name for name in one)
    start = trained_weights(None)
    for name in one:
        torch.testing.assert_close(two[name], one[name], msg=lambda m: f"{name}: {m}")
        assert not torch.equal(one[name], start[name]), f"{name} did not train"
    # A round trip on 2 ranks: load the EP run's checkpoint, train 0 steps, save: every expert of every rank
    # comes back as it was saved.
    again = run(tmp_path / "again", "parallel.ep_size=2", f"resume={tmp_path / 'ep2' / 'checkpoint'}", "steps=0",
                nproc=2)
    assert "step 0" not in again
    for name, value in trained_weights(tmp_path / "again").items():
        assert torch.equal(value, two[name]), name


def test_the_loop_uses_only_public_names_and_little_glue():
    """The app imports nothing from autoep but its public names, and its autoep lines stay few."""
    tree = ast.parse(EXAMPLE.read_text())
    from_autoep = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                   and ("autoep" in (getattr(n, "module", None) or "") or any("autoep" in a.name for a in n.names))]
    import autoep

    for node in from_autoep:
        assert isinstance(node, ast.ImportFrom) and node.module == "autoep", ast.unparse(node)
        assert {a.name for a in node.names} <= set(autoep.__all__), ast.unparse(node)
    glue = [line for line in EXAMPLE.read_text().splitlines() if "# autoep" in line or "init_process_group" in line
            or line.strip().startswith(("ep.", "ep = "))]
    assert len(glue) <= 15, glue


def test_disallowed_user_target_is_refused(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(EXAMPLE), f"run_dir={tmp_path}", EXPLICIT, "parallel.allowed_targets=[]"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0 and "my_ep.replicated_experts" in out.stderr and "allowed_targets" in out.stderr


def test_readme_shows_the_commands_the_entry_point_documents():
    """examples/research_moe/README.md and train.py's docstring show the same commands (the slow test above
    runs them: auto, explicit, torchrun on 2 ranks)."""
    readme = (EXAMPLE.parent / "README.md").read_text()
    doc = EXAMPLE.read_text().split('"""')[1]
    def commands(text):
        return [" ".join(line.replace("\\", " ").split()) for line in re.findall(
            r"^\s*((?:python|torchrun) .*?(?:\\\n.*?)?)\s*(?:#.*)?$", text, flags=re.M)]
    assert commands(readme) and sorted(commands(readme)) == sorted(commands(doc))
