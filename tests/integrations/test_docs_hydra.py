"""docs/integrations.md, "Hydra in your repo": every snippet runs. The YAML composes as an app's config with
only autoep's `parallel` group, resolves against a model, and survives the app's recursive instantiate; the
bash pair is run as written (torchrun, 2 ranks, examples/research_moe), and the second line is exactly what
the first run's resolved.yaml prints to replay it."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch
from distributed import free_port
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from autoep.plan.resolve import resolve_plan

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "integrations.md"
CALLS = []


def blocks(heading: str, lang: str) -> list[str]:
    """The ```lang blocks of the ``## heading`` section."""
    section = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", DOC.read_text(), flags=re.M | re.S)
    assert section, f"docs/integrations.md has no section '## {heading}'"
    return re.findall(rf"^```{lang}\n(.*?)^```", section.group(1), flags=re.M | re.S)


def my_factory(module, *, ep_mesh, scale: float = 1.0):
    """Stands in for the doc's my_pkg.ep.my_factory: records any call."""
    CALLS.append(module)


def tiny_qwen3():
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2)
    with torch.device("meta"):
        return transformers.Qwen3MoeForCausalLM(cfg)


def test_the_yaml_snippets_compose_resolve_and_are_never_instantiated(tmp_path, monkeypatch):
    app_config, explicit = blocks("Hydra in your repo", "yaml")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(app_config)
    with initialize_config_dir(str(tmp_path / "conf"), version_base="1.3"):
        cfg = compose("config")
    assert list(cfg) == ["parallel"]  # autoep's section only: no key of autoep's beyond it
    model = tiny_qwen3()
    resolved = resolve_plan(cfg.parallel, model)
    assert resolved.ep_size == 2 and resolved.plan[0].decision.source == "auto"
    # the explicit entry, with the doc's factory path pointing at a recording stand-in
    pkg = tmp_path / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ep.py").write_text("from test_docs_hydra import my_factory  # noqa: F401\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = OmegaConf.merge(cfg, OmegaConf.create(explicit))
    CALLS.clear()
    instantiate(cfg)  # the app's recursive instantiate
    explicit_resolved = resolve_plan(cfg.parallel, model)
    cfg.parallel = explicit_resolved
    instantiate(cfg)
    assert CALLS == []
    entry = explicit_resolved.plan[0]
    assert entry.decision.source == "explicit" and entry.local_compute_fn._factory_ == "my_pkg.ep.my_factory"
    assert entry.local_compute_fn.scale == 2.0


def torchrun(line: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(line.replace("$PWD", str(cwd)))
    assert argv[0] == "torchrun"
    argv = [sys.executable, "-m", "torch.distributed.run", "--master-port", str(free_port()), *argv[1:]]
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_the_replay_lines_run_as_written(tmp_path):
    (script,) = blocks("Hydra in your repo", "bash")
    first, replay = [ln for ln in script.splitlines() if ln.startswith("torchrun")]
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # "run from the repository root", in a scratch copy
    ran = torchrun(first, tmp_path)
    header = (tmp_path / "outputs" / "a" / "resolved.yaml").read_text().splitlines()
    printed = [ln[len("#   "):] for ln in header if ln.startswith("#   torchrun")]
    assert printed == [replay.replace("$PWD", str(tmp_path))]
    again = torchrun(replay, tmp_path)
    assert "replaying its frozen plan" in again.stdout + again.stderr
    losses = [re.findall(r"step \d+ loss ([0-9.]+)", p.stdout) for p in (ran, again)]
    assert losses[0] == losses[1] and len(losses[0]) == 8
