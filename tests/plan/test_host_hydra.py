"""autoep inside someone else's Hydra app: only the `parallel` group on its search path, plan entries its
recursive ``hydra.utils.instantiate`` never calls, no keys added to its config, and the frozen plan replayed
by that app itself with the line the artifact's header prints.

The host app is written here (conf/config.yaml + train.py, research_moe's model, which autoep never saw)
and run as its users run it; nothing of autoep's own trainer is involved.
"""
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from autoep.detect import structure
from autoep.errors import DriftError, PlanError
from autoep.plan import replay
from autoep.plan.artifact import plan_hash
from autoep.plan.resolve import resolve_plan

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "research_moe"
CALLS = []  # what a factory below was called with, when something called it

HOST_CONFIG = """\
defaults:
  - parallel: default
  - _self_
hydra:
  searchpath:
    - {searchpath}
steps: 2
model:
  _target_: model.TinyMoELM
  vocab_size: 64
  dim: 32
  hidden_dim: 64
  num_layers: 2
  num_experts: 4
  top_k: 2
optimizer:
  _target_: torch.optim.SGD
  _partial_: true
  lr: 0.1
parallel:
  allowed_targets: [test_host_hydra.]
  plan:
    - match: "layers.*.moe"
      local_compute_fn: auto
"""

HOST_TRAIN = '''\
"""A host app: instantiates its whole config recursively, as many Hydra apps do."""
import json
import os

import hydra
from hydra.utils import instantiate

from autoep import ExpertParallel


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg):
    if os.environ.get("HOST_NO_DETECT"):  # the replay must not detect: make detection fail loudly
        from autoep.detect import structure

        def boom(module, **_):
            raise AssertionError("detection ran during a replay")
        structure.detect_moe_structure = boom
    built = instantiate(cfg)  # every _target_ in the config is called here, the plan's included
    ep = ExpertParallel(built.model, cfg.parallel, run_dir=os.environ["HOST_RUN_DIR"])  # writes resolved.yaml
    cfg.parallel = ep.resolved
    instantiate(cfg)  # and again with the resolved section in the config: nothing in it may be called
    print("HOST", json.dumps({"steps": cfg.steps, "on_drift": cfg.parallel.on_drift, "keys": sorted(cfg),
                              "fingerprint": cfg.parallel.plan[0].decision.fingerprint,
                              "source": cfg.parallel.plan[0].decision.source}), flush=True)


if __name__ == "__main__":
    main()
'''


def record(module, *, ep_mesh, **kwargs):
    """A compute-fn factory (contract: factory(module, *, ep_mesh, **kwargs)) that records every call."""
    CALLS.append((module, ep_mesh, kwargs))


def host_app(tmp_path: Path, searchpath: str = "pkg://autoep.plan.conf") -> Path:
    app = tmp_path / "host"
    (app / "conf").mkdir(parents=True)
    (app / "conf" / "config.yaml").write_text(HOST_CONFIG.format(searchpath=searchpath))
    (app / "train.py").write_text(HOST_TRAIN)
    shutil.copy(EXAMPLE / "model.py", app / "model.py")
    return app


def compose_host(app: Path, overrides=()):
    with initialize_config_dir(str(app / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.fixture
def host(tmp_path, monkeypatch):
    app = host_app(tmp_path)
    monkeypatch.syspath_prepend(str(app))  # the app imports its own model.py
    CALLS.clear()
    return app


def test_search_path_brings_only_the_parallel_group(host, tmp_path):
    cfg = compose_host(host)
    assert sorted(cfg) == ["model", "optimizer", "parallel", "steps"]  # the host's keys and autoep's section
    assert cfg.parallel.ep_size == 1 and cfg.parallel.plan[0].match == "layers.*.moe"
    for group in ("data", "optim", "trainer"):  # autoep's trainer groups are not on the path: Hydra finds no
        assert compose_host(host, [f"+{group}=default"])[group] == "default"  # group file, so adds a plain value
    # the control: with autoep's trainer tree on the path they are there, so the check above can fail
    both = host_app(tmp_path / "both", searchpath="pkg://autoep.plan.conf\n    - pkg://autoep.conf")
    assert compose_host(both, ["+optim=default"]).optim.lr > 0
    old = host_app(tmp_path / "old", searchpath="pkg://autoep.conf")
    with pytest.raises(MissingConfigException, match="parallel/default"):  # it no longer carries parallel/
        compose_host(old)


def test_recursive_instantiate_never_calls_a_plan_entry(host):
    cfg = compose_host(host, ["parallel.plan.0.local_compute_fn={_factory_:test_host_hydra.record,tag:host}"])
    built = instantiate(cfg)  # the host's own recursive instantiate: model, optimizer partial, ...
    assert CALLS == []
    assert OmegaConf.to_container(built.parallel.plan[0].local_compute_fn) == {
        "_factory_": "test_host_hydra.record", "tag": "host"}
    resolved = resolve_plan(cfg.parallel, built.model)
    entry = resolved.plan[0]
    assert entry.decision.source == "explicit" and entry.local_compute_fn._factory_ == "test_host_hydra.record"
    auto = resolve_plan(compose_host(host).parallel, built.model)
    assert auto.plan[0].decision.source == "auto" and "_target_" not in auto.plan[0].local_compute_fn
    for section in (resolved, auto):  # the resolved section put back into the host's config
        cfg.parallel = section
        instantiate(cfg)
    assert CALLS == []


def test_an_explicit_target_would_be_called_by_the_host_so_factory_is_the_spelling(host):
    """The control: Hydra calls a `_target_` wherever it sits (why autoep writes `_factory_`); `_target_`
    still resolves to the same decision as `_factory_` (the command line form the docs show)."""
    cfg = compose_host(host, ["parallel.plan.0.local_compute_fn={_target_:test_host_hydra.record,tag:host}"])
    with pytest.raises(Exception, match="ep_mesh|module"):
        instantiate(cfg)  # TypeError wrapped by Hydra: record() called without its module
    model = instantiate(cfg.model)
    by_target = resolve_plan(cfg.parallel, model)
    by_factory = resolve_plan(compose_host(
        host, ["parallel.plan.0.local_compute_fn={_factory_:test_host_hydra.record,tag:host}"]).parallel, model)
    assert plan_hash(by_target) == plan_hash(by_factory)


def test_an_artifact_written_with_target_replays_as_it_was_written(host):
    """resolved.yaml files from before `_factory_` hold `_target_`, sealed over it: they replay unchanged."""
    from autoep.plan.resolve import seal_entry

    cfg = compose_host(host)
    model = instantiate(cfg.model)
    new = OmegaConf.to_container(resolve_plan(cfg.parallel, model))
    old = json.loads(json.dumps(new))
    entry = old["plan"][0]
    entry["local_compute_fn"] = {"_target_": entry["local_compute_fn"].pop("_factory_"), **entry["local_compute_fn"]}
    entry["decision"]["fingerprint"] = seal_entry(entry["match"], entry["local_compute_fn"], entry["decision"])
    replayed = OmegaConf.to_container(resolve_plan(old, model))
    assert replayed["plan"][0]["local_compute_fn"]["_target_"] == new["plan"][0]["local_compute_fn"]["_factory_"]
    both = json.loads(json.dumps(old))
    both["plan"][0]["local_compute_fn"]["_factory_"] = "test_host_hydra.record"
    with pytest.raises(PlanError, match=r"parallel.plan.0.local_compute_fn names its factory twice"):
        resolve_plan(both, model)


def frozen_file(tmp_path: Path, section: dict) -> Path:
    path = tmp_path / "run" / "resolved.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"parallel": section, "artifact": {"format": 1, "plan_hash": plan_hash(section)}}
    path.write_text(replay.host_header(path) + yaml.safe_dump(body, sort_keys=False))
    return path


def test_replay_key_replays_the_file_without_detecting(host, tmp_path, monkeypatch):
    cfg = compose_host(host, ["parallel.ep_size=2"])
    model = instantiate(cfg.model)
    section = OmegaConf.to_container(resolve_plan(cfg.parallel, model))
    path = frozen_file(tmp_path, section)

    def boom(module, **_):
        raise AssertionError("a replay must not detect")
    monkeypatch.setattr(structure, "detect_moe_structure", boom)
    again = compose_host(host, [f"++parallel.replay={path}"])  # ep_size 1 composed; the file says 2
    out = OmegaConf.to_container(resolve_plan(again.parallel, model))
    assert out == section and out["replay"] is None and out["ep_size"] == 2
    # the edits a replay refuses: a missing file, a hand-edited section, drifted model code
    with pytest.raises(PlanError, match=r"parallel.replay=.*nope.yaml: no such file"):
        resolve_plan({**section, "replay": str(tmp_path / "nope.yaml")}, model)
    edited = path.read_text().replace("ep_size: 2", "ep_size: 4")
    (tmp_path / "edited.yaml").write_text(edited)
    with pytest.raises(PlanError, match=r"edited.yaml.*plan_hash"):
        resolve_plan({"replay": str(tmp_path / "edited.yaml")}, model)
    deeper = instantiate(cfg.model, num_layers=3)  # the model changed since the plan was resolved
    with pytest.raises(DriftError, match=r"parallel.plan.0 \(layers.0.moe.*added \['layers.2.moe'\]"):
        resolve_plan({"replay": str(path)}, deeper)


def run_host(app: Path, argv: list[str], run_dir: str, **env) -> dict:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "HOST_RUN_DIR": run_dir, **env}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), environ.get("PYTHONPATH")]))
    proc = subprocess.run(argv, cwd=app, env=environ, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("HOST ")][-1]
    return {**json.loads(line[5:]), "stderr": proc.stderr, "stdout": proc.stdout}


def test_the_header_replay_line_runs_in_the_host_app(host):
    """The file's own replay line, run as printed, replays the plan in the app that wrote it: the same
    decision, its own overrides kept, no detection; no key of autoep's appears in the host's config."""
    first = run_host(host, [sys.executable, "train.py", "steps=3", "parallel.on_drift=redetect"], "runs/a")
    assert first["source"] == "auto" and first["steps"] == 3 and first["on_drift"] == "redetect"
    assert first["keys"] == ["model", "optimizer", "parallel", "steps"]
    path = host / "runs" / "a" / "resolved.yaml"
    lines = path.read_text().splitlines()
    command = [ln[len("#   "):] for ln in lines if ln.startswith("#   ") and "from Python" not in ln]
    assert len(command) == 1, lines[:6]
    argv = shlex.split(command[0])
    assert argv[:2] == ["python", "train.py"] and "steps=3" in argv and not any("on_drift" in a for a in argv)
    assert argv[-1] == f"++parallel.replay={path}"
    again = run_host(host, [sys.executable, *argv[1:]], "runs/b", HOST_NO_DETECT="1")
    assert (again["fingerprint"], again["on_drift"], again["steps"]) == (first["fingerprint"], "redetect", 3)
    assert again["keys"] == first["keys"]
    assert "replaying its frozen plan" in again["stdout"] + again["stderr"]
    b = yaml.safe_load((host / "runs" / "b" / "resolved.yaml").read_text())
    assert b["parallel"] == yaml.safe_load(path.read_text())["parallel"]  # the replay records the same plan
    assert f'autoep.load_plan({str(path)!r})' in path.read_text()


def test_launcher_in_the_replay_line(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert replay._launcher() == ["python"]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert replay._launcher() == ["torchrun", "--nproc-per-node", "2"]
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert replay._launcher() == ["torchrun", "--nnodes", "4", "--nproc-per-node", "2"]
    assert replay._sets_parallel("parallel.ep_size=2") and replay._sets_parallel("++parallel.replay=x")
    assert replay._sets_parallel("parallel=default") and not replay._sets_parallel("parallelism=3")


def test_host_header_outside_hydra_prints_the_python_form_only(tmp_path):
    text = replay.host_header(tmp_path / "resolved.yaml")
    assert "++parallel.replay" not in text and "autoep.load_plan(" in text


def test_empty_or_foreign_resolved_yaml_replayed_by_autoep_plan_is_a_clear_error(tmp_path):
    """autoep-plan --config-dir D --config-name resolved: an empty file, or a plan a host app wrote, is
    named with what to run instead (was: ConfigAttributeError: run_dir / Key 'task_name')."""
    from autoep.train.command import check_primary

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "resolved.yaml").write_text("")
    script = Path(sys.executable).parent / "autoep-plan"
    entry = [str(script)] if script.exists() else [sys.executable, "-m", "autoep.train.dry_run"]
    proc = subprocess.run([*entry, "--config-dir", str(tmp_path / "empty"), "--config-name", "resolved"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"autoep-plan: error: {tmp_path / 'empty' / 'resolved.yaml'} is empty, so there is nothing to replay (a "
        f"resolved.yaml cut to nothing?); restore it, regenerate it with autoep-plan, or name another config"]
    host_plan = {"parallel": {"ep_size": 1, "plan": []}, "artifact": {"format": 1, "plan_hash": "sha256:0"}}
    with pytest.raises(PlanError, match=r"holds only a frozen parallel section.*autoep-plan \+\+parallel.replay=x"):
        check_primary(Path("x"), host_plan, "autoep-plan")
    check_primary(Path("x"), {"defaults": ["resolved_schema", "_self_"], **host_plan, "model": {}}, "autoep-plan")



def test_the_factory_override_in_docs_overrides_resolves_like_the_target_one():
    """docs/overrides.md's `_factory_` and `_target_` + `_partial_` lines, composed by autoep's own tree, are the
    same plan as its bare `_target_` line."""
    from test_config import DOC_OVERRIDES, compose_train

    doc = (Path(__file__).resolve().parents[2] / "docs" / "overrides.md").read_text()
    by_factory = DOC_OVERRIDES[0].replace("{_target_:", "{_factory_:")
    by_partial = DOC_OVERRIDES[0].replace(",structure:", ",_partial_:true,structure:", 1)
    for line in (by_factory, by_partial):
        assert f"autoep-plan '{line}'" in doc
    import torch

    resolved = []
    for override in (DOC_OVERRIDES[0], by_factory, by_partial):
        cfg = compose_train([override])
        with torch.device("meta"):
            model = instantiate(cfg.model)
        resolved.append(resolve_plan(cfg.parallel, model))
    assert plan_hash(resolved[0]) == plan_hash(resolved[1]) == plan_hash(resolved[2])
    assert resolved[0].plan[0].decision.source == "explicit"


class Holder:
    """What a host's config node such as Lightning's ``strategy: {_target_: ..., parallel: ${parallel}}`` builds:
    its ``parallel`` is the section as the host's recursive ``instantiate`` made it."""

    def __init__(self, parallel):
        self.parallel = parallel


def spellings() -> dict[str, str]:
    """The opt-out spellings autoep's own messages recommend (``errors.OPT_OUT_SPELLING``, ending every
    ``UnsupportedModuleStructure``), as Hydra overrides naming ``record`` with one keyword."""
    from autoep.errors import OPT_OUT_HINT, OPT_OUT_SPELLING

    assert OPT_OUT_SPELLING in OPT_OUT_HINT
    forms = re.findall(r"\{[^{}]*\}", OPT_OUT_SPELLING)
    assert len(forms) == 2, OPT_OUT_SPELLING
    out = {}
    for form in forms:
        form = form.replace("my_pkg.ep.my_factory", "test_host_hydra.record").replace(", ...kwargs", ", tag: host")
        out[form.split(":")[0].strip("{")] = form.replace(", ...", ", tag: host")
    assert set(out) == {"_factory_", "_target_"}, out
    return out


@pytest.mark.parametrize("spelling", ["_factory_", "_target_"])
def test_the_recommended_opt_out_survives_the_hosts_recursive_instantiate(host, spelling):
    """Issue 20: the opt-out as autoep's messages spell it is never called by a host that instantiates its whole
    config (also where a node interpolates the section, as a Lightning strategy does), and resolves, from the
    composed section or from what ``instantiate`` made of it, to the plan of the `_factory_` spelling."""
    override = spellings()[spelling]
    assert ("_partial_: true" in override) == (spelling == "_target_")
    cfg = compose_host(host, [f"parallel.plan.0.local_compute_fn={override}"])
    OmegaConf.set_struct(cfg, False)
    cfg.strategy = {"_target_": "test_host_hydra.Holder", "parallel": "${parallel}"}
    built = instantiate(cfg)  # the host's own recursive instantiate: model, optimizer partial, strategy, ...
    assert CALLS == []
    made = built.strategy.parallel.plan[0].local_compute_fn  # Hydra made a partial of the _target_ spelling
    assert isinstance(made, functools.partial) == (spelling == "_target_"), made
    reference = resolve_plan(compose_host(
        host, ["parallel.plan.0.local_compute_fn={_factory_:test_host_hydra.record,tag:host}"]).parallel, built.model)
    for section in (cfg.parallel, built.parallel, built.strategy.parallel):
        resolved = resolve_plan(section, built.model)
        assert plan_hash(resolved) == plan_hash(reference)
        assert OmegaConf.to_container(resolved.plan[0].local_compute_fn) == {
            "_factory_": "test_host_hydra.record", "tag": "host"}
    cfg.parallel = resolved
    instantiate(cfg)  # the resolved section back in the host's config: still nothing called
    assert CALLS == []
    from autoep import ExpertParallel

    ExpertParallel(built.model, built.strategy.parallel)  # one process: the plan applied, the factory called
    assert [(module, kwargs) for module, _, kwargs in CALLS] == [
        (built.model.layers[0].moe, {"tag": "host"}), (built.model.layers[1].moe, {"tag": "host"})]


def test_a_partial_without_an_import_path_is_refused_naming_the_spelling(host):
    model = instantiate(compose_host(host).model)

    def local(module, *, ep_mesh):
        return None
    for fn, why in ((functools.partial(local), "no import path that leads back"),
                    (functools.partial(record, 1), "positional arguments")):
        with pytest.raises(PlanError, match=rf"parallel.plan.0.local_compute_fn is a functools.partial with {why}.*"
                                            r"\{_factory_: my_pkg.ep.my_factory"):
            resolve_plan({"plan": [{"match": "layers.*.moe", "local_compute_fn": fn}]}, model)
