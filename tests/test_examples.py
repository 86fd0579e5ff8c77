"""examples/research_moe: someone else's Hydra app using resolve_plan/apply_plan on its own model."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
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


@pytest.mark.slow
def test_auto_explicit_and_two_rank_ep_train_the_same(tmp_path):
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
    assert a == pytest.approx(e, abs=1e-4) and p == pytest.approx(e, abs=1e-4)
    assert (tmp_path / "auto" / "resolved.yaml").exists()


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
