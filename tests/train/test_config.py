"""The real conf/ tree: every file composes, every _target_ binds to its callable without being called."""
import inspect
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from autoep.plan.resolve import check_compute_fn
from autoep.plan.schema import ParallelConfig, PlanEntry
from autoep.targets import import_object
from autoep.train.config import CONF_DIR, PLAN_CONF_DIR
from autoep.train.models import check_config_kwargs

GROUPS = ("model", "parallel", "data", "optim", "trainer")


def options(group):
    return sorted({p.stem for root in (CONF_DIR, PLAN_CONF_DIR) for p in (Path(root) / group).glob("*.yaml")})


def compose_train(overrides=()):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("train", overrides=list(overrides))


def targets(node, key=""):
    """(key, mapping) for every mapping with a _target_ in a plain config tree."""
    if isinstance(node, dict):
        if "_target_" in node:
            yield key, node
        for k, v in node.items():
            yield from targets(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from targets(v, f"{key}.{i}")


def test_every_group_has_its_default_and_the_primary_places_self_last():
    text = (Path(CONF_DIR) / "train.yaml").read_text()
    assert text.index("- _self_") > max(text.index(f"- {g}:") for g in GROUPS)
    for group in GROUPS:
        assert options(group), group
    assert len(options("model")) >= 4


@pytest.mark.parametrize("group", GROUPS)
def test_every_config_file_composes_and_its_targets_bind(group):
    for option in options(group):
        cfg = compose_train([f"{group}={option}"])
        assert OmegaConf.get_type(cfg.parallel) is ParallelConfig
        for entry in cfg.parallel.plan:
            assert OmegaConf.get_type(entry) is PlanEntry
        found = list(targets(OmegaConf.to_container(cfg, resolve=True)))
        assert any(k == "model" for k, _ in found)
        for key, node in found:
            kwargs = {k: v for k, v in node.items() if k != "_target_"}
            fn = import_object(node["_target_"])
            inspect.signature(fn).bind(**kwargs)  # raises TypeError if the keys do not bind
            if key == "model" and "config_class" in node:  # hf_pretrained reads its config.json
                config_kwargs = {k: v for k, v in kwargs.items() if k not in ("config_class", "dtype")}
                check_config_kwargs(kwargs["config_class"], config_kwargs)


def test_default_model_is_a_shipped_family_and_default_plan_is_auto():
    cfg = compose_train()
    assert cfg.model.config_class == "transformers.Qwen3MoeConfig"
    assert cfg.parallel.ep_size == 1 and cfg.parallel.on_drift == "error" and cfg.parallel.allowed_targets == []
    assert OmegaConf.to_container(cfg.parallel.plan) == [
        {"match": "model.layers.*.mlp", "local_compute_fn": "auto", "moe_only": True, "record_replay": True,
         "execution": "auto", "expert_draws": "exact", "decision": None}]


def test_model_kwarg_typo_is_caught_without_building():
    with pytest.raises(TypeError, match=r"no field\(s\) \['num_expertz'\]"):
        check_config_kwargs("transformers.Qwen3MoeConfig", {"num_expertz": 4})


DOC_OVERRIDES = [
    "parallel.plan.0.local_compute_fn={_target_:autoep.runtime.recipes.batched.ep_batched_experts,structure:{router:"
    "topk_router_module,shared_experts:none,expert_storage:batched_parameters,jitter:false}}",
    "parallel.plan.0.local_compute_fn=auto",
    "parallel.detect=false",
    "parallel.plan=[]",
    "parallel.on_drift=redetect",
    "parallel.plan.0.decision=null",
]


def test_documented_overrides_are_in_the_doc_and_compose():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "overrides.md")
    if doc.exists():  # the docs ship with the repo, not the wheel
        for override in DOC_OVERRIDES:
            assert override in doc.read_text(), override
    cfg = compose_train(DOC_OVERRIDES[:1])
    fn = OmegaConf.to_container(cfg.parallel.plan[0].local_compute_fn)
    check_compute_fn("parallel.plan.0", fn, [])
    assert compose_train(DOC_OVERRIDES[1:5]).parallel.plan == []
    assert compose_train(DOC_OVERRIDES[5:]).parallel.plan[0].decision is None


@pytest.mark.parametrize("override, message", [
    ("parallel.foo=1", "foo"),
    ("parallel.detect=maybe", "detect"),  # ep_size takes auto too: check_config refuses 'two' (test_ep_size)
    ("parallel.plan.0.mtch=x", "mtch"),
])
def test_composition_rejects_unknown_keys_and_wrong_types(override, message):
    with pytest.raises(Exception, match=message):
        compose_train([override])
