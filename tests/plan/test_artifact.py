"""resolved.yaml: atomic rank-0 write, round trip, truncated / non-YAML files refused, cross-rank plan check."""
import os

import pytest
import yaml
from distributed import spawn
from omegaconf import OmegaConf

from autoep.errors import PlanError
from autoep.plan import artifact
from autoep.plan.artifact import check_plan_consistent, load_resolved, plan_hash, write_resolved
from autoep.train.config import ResolvedConfig, TrainConfig

PARALLEL = {"ep_size": 2, "plan": [{"match": "model.layers.*.mlp", "local_compute_fn": {"_target_": "a.b"},
                                    "decision": {"source": "explicit", "modules": ["model.layers.0.mlp"],
                                                 "num_experts": 8, "classes": {"x.Block": "sha256:00"},
                                                 "detector_version": "1", "fingerprint": "sha256:11"}}]}


def train_cfg(**parallel):
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig),
                          {"model": {"_target_": "m.build", "width": "${data.seq_len}"}, "parallel": PARALLEL})
    return OmegaConf.merge(cfg, {"parallel": parallel})


def test_write_then_load_round_trips_resolved_and_location_free(tmp_path):
    path = write_resolved(OmegaConf.merge(train_cfg(), {"run_dir": str(tmp_path)}), tmp_path)
    assert path == tmp_path / "resolved.yaml"
    text = path.read_text()
    assert "${" not in text and "width: 32" in text  # interpolations resolved
    raw = yaml.safe_load(text)
    assert raw["defaults"] == ["resolved_schema", "_self_"] and list(raw)[-1] == "artifact"
    assert "hydra" not in raw and raw["run_dir"] is None
    cfg = load_resolved(path, ResolvedConfig)
    assert OmegaConf.to_container(cfg.parallel) == OmegaConf.to_container(train_cfg().parallel)
    assert cfg.artifact.plan_hash == plan_hash(train_cfg().parallel)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resolved.yaml"]  # no temp file left


def test_interrupted_write_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    path = write_resolved(train_cfg(), tmp_path)
    before = path.read_text()

    def crash(fd):
        raise KeyboardInterrupt  # e.g. the job is killed between write and rename

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(KeyboardInterrupt):
        write_resolved(train_cfg(ep_size=4), tmp_path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resolved.yaml"]
    with pytest.raises(KeyboardInterrupt):
        write_resolved(train_cfg(), tmp_path / "fresh")
    assert list((tmp_path / "fresh").iterdir()) == []  # never a partial resolved.yaml


def test_only_rank_zero_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(artifact, "_rank", lambda: 1)
    assert write_resolved(train_cfg(), tmp_path) == tmp_path / "resolved.yaml"
    assert not (tmp_path / "resolved.yaml").exists()


@pytest.mark.parametrize("cut", [0.2, 0.5, 0.8, 0.97, 0.999])
def test_truncated_file_is_refused_naming_it(tmp_path, cut):
    path = write_resolved(train_cfg(), tmp_path)
    text = path.read_text()
    path.write_text(text[: int(len(text) * cut)])
    with pytest.raises(PlanError, match=rf"{path}: .*(truncated|regenerate it)"):
        load_resolved(path, ResolvedConfig)


@pytest.mark.parametrize("content", ["model: [\n  {{{", "\x00\x01binary", "just a string", "- a\n- list\n", ""])
def test_non_yaml_or_non_mapping_is_refused_naming_it(tmp_path, content):
    path = tmp_path / "resolved.yaml"
    path.write_text(content)
    with pytest.raises(PlanError, match=rf"{path}: .*autoep-plan"):
        load_resolved(path, ResolvedConfig)


def test_edited_parallel_section_or_hash_is_refused(tmp_path):
    path = write_resolved(train_cfg(), tmp_path)
    text = path.read_text()
    path.write_text(text.replace("ep_size: 2", "ep_size: 4"))
    with pytest.raises(PlanError, match=r"artifact.plan_hash=sha256:\w+\.\.\. does not match its parallel section"):
        load_resolved(path, ResolvedConfig)
    written = yaml.safe_load(text)["artifact"]["plan_hash"]
    path.write_text(text.replace(written, "sha256:" + "0" * 64))  # the hash itself edited
    with pytest.raises(PlanError, match=r"edited or damaged after autoep wrote it"):
        load_resolved(path, ResolvedConfig)


def test_resolved_yaml_is_readable_by_others_as_open_would_make_it(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_resolved(train_cfg(), tmp_path)
    finally:
        os.umask(old)
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)


def test_consistency_check_without_process_group_returns_the_hash():
    assert check_plan_consistent(train_cfg().parallel) == plan_hash(train_cfg().parallel)


def _consistency_worker(rank, world_size):
    same = check_plan_consistent(train_cfg().parallel)
    try:
        check_plan_consistent(train_cfg(ep_size=2 if rank == 0 else 1).parallel)
        differing = None
    except PlanError as e:
        differing = str(e)
    return same, differing


def test_ranks_holding_different_plans_fail_loudly():
    results = spawn(2, "test_artifact:_consistency_worker")
    assert results[0][0] == results[1][0] == plan_hash(train_cfg().parallel)
    for _, message in results:
        assert message is not None and "ranks hold different parallel plans (ranks [0]" in message
        assert "ranks [1]" in message
