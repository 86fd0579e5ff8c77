"""Paths from before the package tree (issue 14): a config or a resolved artifact naming an old autoep path is
refused by name, with the new path to write, never with an import traceback.

``data/resolved_before_move.yaml`` is the artifact ``autoep-plan`` wrote at commit 4de2a1a (the last flat
layout), unedited: its model builder is ``autoep.models.build_hf_causal_lm``, its recipe
``autoep.recipes.batched.ep_batched_experts``, its detector version 2.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from autoep import resolve_plan
from autoep.errors import PlanError
from autoep.plan.artifact import load_resolved
from autoep.runtime.apply import apply_plan
from autoep.targets import import_object, moved_to
from autoep.train.config import ResolvedConfig
from autoep.train.models import instantiate_model

OLD = Path(__file__).parent / "data" / "resolved_before_move.yaml"
PLAN = Path(sys.executable).parent / "autoep-plan"


def test_every_moved_prefix_names_a_path_that_imports():
    assert moved_to("autoep.recipes.batched.ep_batched_experts") == "autoep.runtime.recipes.batched.ep_batched_experts"
    assert moved_to("autoep.models.build_hf_causal_lm") == "autoep.train.models.build_hf_causal_lm"
    assert moved_to("autoep.runtime.recipes.batched.ep_batched_experts") is None
    for old in ("autoep.recipes.batched.ep_batched_experts", "autoep.recipes.module_list.ep_module_list_block",
                "autoep.models.build_hf_causal_lm", "autoep.tiny.build_tiny_model",
                "autoep.experts.grouped_swiglu", "autoep.dispatch.ep_experts_forward"):
        assert callable(import_object(moved_to(old))), old
        with pytest.raises(PlanError, match=moved_to(old).replace(".", r"\.")):
            import_object(old)


def test_the_replay_line_of_an_old_artifact_names_the_new_builder(tmp_path):
    """The artifact's own replay command: exit 2, one line naming the key, the old value and the new path."""
    shutil.copy(OLD, tmp_path / "resolved.yaml")
    cmd = [str(PLAN)] if PLAN.exists() else [sys.executable, "-c", "from autoep.cli import plan_main; plan_main()"]
    proc = subprocess.run([*cmd, "--config-dir", str(tmp_path), "--config-name", "resolved", f"run_dir={tmp_path}/r"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "model._target_=autoep.models.build_hf_causal_lm" in proc.stderr
    assert "model._target_=autoep.train.models.build_hf_causal_lm" in proc.stderr


def test_an_old_recipe_path_in_a_replayed_plan_is_refused_naming_the_new_one():
    """Through the Python API (a host app replaying its record): the old recipe path, not a fingerprint or
    import error."""
    cfg = load_resolved(OLD, ResolvedConfig)
    model_cfg = OmegaConf.to_container(cfg.model)
    model_cfg["_target_"] = moved_to(model_cfg["_target_"])
    with torch.device("meta"):
        model = instantiate_model(OmegaConf.create(model_cfg))
    with pytest.raises(PlanError) as err:
        resolve_plan(cfg.parallel, model)
    assert "parallel.plan.0.local_compute_fn._target_='autoep.recipes.batched.ep_batched_experts'" in str(err.value)
    assert "'autoep.runtime.recipes.batched.ep_batched_experts'" in str(err.value)
    with pytest.raises(PlanError, match=r"autoep\.runtime\.recipes\.batched\.ep_batched_experts"):
        apply_plan(model, cfg.parallel, None)


def test_an_old_structure_record_says_regenerate():
    """Detector version 2 wrote expert_projs as one comma-joined string; read back now it is refused by name."""
    from autoep.detect.structure import MoeStructure

    structure = yaml.safe_load(OLD.read_text())["parallel"]["plan"][0]["local_compute_fn"]["structure"]
    assert structure["expert_projs"] == ""  # version 2 wrote a string even where there are no names
    for old in ("", "gate_proj,up_proj,down_proj"):
        with pytest.raises(ValueError, match="regenerate the resolved config with autoep-plan"):
            MoeStructure(**{**structure, "expert_projs": old})
    assert MoeStructure(**{**structure, "expert_projs": ["w1", "w3", "w2"]}).expert_projs == ("w1", "w3", "w2")
