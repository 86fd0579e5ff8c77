"""resolve_plan on real transformers MoE models built on meta from the shipped model configs."""
import copy
import functools
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

import autoep
from autoep.detect import structure
from autoep.errors import DriftError, PlanError
from autoep.plan.resolve import resolve_plan
from autoep.train.config import CONF_DIR

MLP = "model.layers.*.mlp"
SHIPPED_PARALLEL = Path(autoep.__file__).parent / "plan" / "conf" / "parallel" / "default.yaml"
EXPECTED = {  # model config -> (shared_experts, num_experts), proven by the detector
    "qwen3_moe": ("none", 8), "mixtral": ("none", 4), "qwen2_moe": ("gated", 8),
    "deepseek_v3": ("additive", 8), "olmoe": ("none", 8), "gpt_oss": ("none", 4),
}


@functools.lru_cache(maxsize=None)
def model_cfg(name, **overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"model={name}"] + [f"model.{k}={v}" for k, v in overrides.items()])
    return cfg.model


def meta_model(name="qwen3_moe", **overrides):
    with torch.device("meta"):
        return instantiate(model_cfg(name, **overrides))


def plan(ep_size=1, match=MLP, fn="auto", moe_only=None, **parallel):
    entry = {"match": match, "local_compute_fn": fn} | ({} if moe_only is None else {"moe_only": moe_only})
    return {"ep_size": ep_size, "plan": [entry], **parallel}


def plain(resolved):
    return OmegaConf.to_container(resolved)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_auto_freezes_a_decision_for_every_shipped_model(name):
    model = meta_model(name)
    resolved = autoep.resolve_plan(plan(ep_size=2), model)
    entry = plain(resolved)["plan"][0]
    decision = entry["decision"]
    shared, n = EXPECTED[name]
    assert decision["source"] == "auto"
    assert decision["modules"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert decision["num_experts"] == n
    assert decision["structure"]["shared_experts"] == shared
    assert decision["structure"] == structure.detect_moe_structure(model.model.layers[0].mlp).as_dict()
    assert entry["local_compute_fn"]["_factory_"] == "autoep.runtime.recipes.batched.ep_batched_experts"
    assert decision["fingerprint"].startswith("sha256:")
    block = model.model.layers[0].mlp
    router = getattr(block, "gate", None) or block.router
    assert type(router).__qualname__ in " ".join(decision["classes"])
    assert next(model.parameters()).device.type == "meta"


def test_plain_dict_takes_schema_defaults_and_replay_is_identity():
    model = meta_model()
    resolved = resolve_plan({"plan": [{"match": MLP}]}, model)
    assert resolved.ep_size == 1 and resolved.on_drift == "error" and resolved.detect is True
    assert plain(resolve_plan(resolved, model)) == plain(resolved)
    assert plain(resolve_plan(plain(resolved), model)) == plain(resolved)


def test_fingerprint_differs_between_families():
    a = plain(resolve_plan(plan(), meta_model("qwen3_moe")))["plan"][0]["decision"]["fingerprint"]
    b = plain(resolve_plan(plan(), meta_model("olmoe")))["plan"][0]["decision"]["fingerprint"]
    assert a != b


def test_explicit_target_is_kept_not_detected_and_still_recorded(monkeypatch):
    def no_detection(module, **_):
        raise AssertionError("explicit entries must not be detected")

    monkeypatch.setattr(structure, "detect_moe_structure", no_detection)
    fn = {"_target_": "plan_factories.scaled_experts", "scale": 2.0}
    resolved = plain(resolve_plan(plan(ep_size=4, fn=fn, allowed_targets=["plan_factories"]), meta_model()))
    entry = resolved["plan"][0]
    # recorded under _factory_ (a host's recursive instantiate never calls it), kwargs kept
    assert entry["local_compute_fn"] == {"_factory_": fn["_target_"], "scale": 2.0}
    assert entry["decision"]["source"] == "explicit" and entry["decision"]["structure"] is None
    assert entry["decision"]["num_experts"] == 8 and len(entry["decision"]["modules"]) == 2
    assert entry["decision"]["fingerprint"].startswith("sha256:")


def test_detect_false_refuses_auto_but_takes_explicit():
    model = meta_model()
    with pytest.raises(PlanError, match=r"parallel.plan.0.local_compute_fn=auto but parallel.detect=false"):
        resolve_plan(plan(detect=False), model)
    fn = {"_target_": "plan_factories.scaled_experts"}
    resolved = resolve_plan(plan(fn=fn, detect=False, allowed_targets=["plan_factories"]), model)
    assert resolved.plan[0].decision.source == "explicit"


def swap_in_qwen2_block(model):
    other = meta_model("qwen2_moe")
    model.model.layers[1].mlp = other.model.layers[1].mlp
    return model


@pytest.mark.parametrize("bad, message", [
    ({"ep_size": 0}, r"parallel.ep_size=0 must be a positive integer"),
    ({"ep_size": -2}, r"parallel.ep_size=-2 must be a positive integer"),
    (plan(ep_size=3), r"parallel.ep_size=3 does not divide num_experts=8 of model.layers.0.mlp; "
                      r"pick one of \[1, 2, 4, 8\]"),
    ({"ep_sise": 2}, r"parallel.ep_sise: Key 'ep_sise' not in 'ParallelConfig'; valid keys of parallel: ep_size"),
    ({"ep_size": "two"}, r"parallel.ep_size='two' must be a positive integer or auto; use 1"),
    ({"detect": "maybe"}, r"parallel.detect: Value 'maybe'"),
    ({"plan": [{"match": MLP, "local_fn": "auto"}]}, r"parallel.plan.0.local_fn: Key 'local_fn' not in"),
    ({"plan": "model.layers.*.mlp"}, r"parallel.plan='model.layers.\*.mlp' must be a list"),
    ({"plan": [{"local_compute_fn": "auto"}]}, r"parallel.plan.0.match is required"),
    ({"on_drift": "ignore"}, r"parallel.on_drift='ignore' is not one of \['error', 'redetect'\]"),
    (plan(match="model.layer.*.mlp"), r"parallel.plan.0.match='model.layer.\*.mlp' matches no module.*"
                                      r"globs that match its MoE blocks: \['model.layers.\*.mlp'\]"),
    (plan(match="model.layers.0.moe"), r"matches no module.*e.g. match: 'model.layers.\*.mlp'"),
    (plan(match="model.layers.*.self_attn", moe_only=False),
     r"matched model.layers.0.self_attn \(Qwen3MoeAttention\), which auto cannot take: .*"
     r"Declare an explicit local_compute_fn to opt out of structure detection: \{_factory_: "),
    (plan(match="model.layers.*.self_attn"), r"moe_only=true matches 2 modules and none has an `experts` submodule; "
                                             r"globs that match its MoE blocks: \['model.layers.\*.mlp'\]"),
    (plan(fn="autoep.runtime.recipes.batched.ep_batched_experts"), r"local_compute_fn='autoep.runtime.recipes.batched.ep_batched"
                                                           r"_experts' must be 'auto' or a mapping naming its factory: "
                                                           r".*\{_factory_: my_pkg.ep.my_factory"),
    (plan(fn={"target": "x.y"}), r"must be 'auto' or a mapping naming its factory"),
    (plan(fn={"_target_": "os..system"}), r"_target_='os..system' is not a dotted import path"),
    (plan(fn={"_target_": 42}), r"_target_=42 is not a dotted import path"),
    (plan(fn={"_target_": "evil_pkg_never_imported.run"}), r"'evil_pkg_never_imported.run' is not under an "
                                                           r"allowed prefix \['autoep.runtime.recipes'\].*allowed_targets"),
    (plan(fn={"_target_": "plan_factories2.scaled_experts"}, allowed_targets=["plan_factories"]),
     r"not under an allowed prefix"),
    (plan(fn={"_target_": "plan_factories.scaled_experts", "scael": 2}, allowed_targets=["plan_factories"]),
     r"keys \['scael'\] do not bind to plan_factories.scaled_experts\(module, \*, ep_mesh, scale"),
    (plan(fn={"_target_": "plan_factories.no_such_fn"}, allowed_targets=["plan_factories"]),
     r"'plan_factories.no_such_fn' cannot be imported"),
    (plan(fn={"_target_": "autoep.runtime.recipes.batched.ep_batched_experts"}),
     r"do not bind to autoep.runtime.recipes.batched.ep_batched_experts.*missing a required argument: 'structure'"),
])
def test_bad_input_names_key_value_and_fix(bad, message):
    with pytest.raises(PlanError, match=message):
        resolve_plan(bad, meta_model())


def test_ambiguous_glob_names_both_groups():
    model = swap_in_qwen2_block(meta_model())
    with pytest.raises(PlanError, match=r"matches modules that resolve differently: \['model.layers.0.mlp'\] -> "
                                        r".*'shared_experts': 'none'.*; \['model.layers.1.mlp'\] -> .*'shared_"
                                        r"experts': 'gated'.*Split the glob"):
        resolve_plan(plan(), model)
    split = {"plan": [{"match": "model.layers.0.mlp"}, {"match": "model.layers.1.mlp"}]}
    resolved = plain(resolve_plan(split, model))
    assert [e["decision"]["structure"]["shared_experts"] for e in resolved["plan"]] == ["none", "gated"]


def test_a_module_claimed_by_two_entries_is_refused():
    with pytest.raises(PlanError, match=r"model.layers.0.mlp is matched by parallel.plan.0 and parallel.plan.1"):
        resolve_plan({"plan": [{"match": MLP}, {"match": "model.layers.0.mlp"}]}, meta_model())


def test_unmatched_names_fall_back_to_all_modules_when_nothing_looks_like_moe():
    with pytest.raises(PlanError, match=r"no module of the model holds experts; closest module names: \['0'\]"):
        resolve_plan(plan(match="lin"), torch.nn.Sequential(torch.nn.Linear(2, 2)))


# --- replay: seal and drift -------------------------------------------------------------------------


@pytest.fixture
def resolved_qwen3():
    return plain(resolve_plan(plan(ep_size=2), meta_model()))


@pytest.mark.parametrize("edit", [
    lambda e: e["decision"]["structure"].update(jitter=True),
    lambda e: e["decision"].update(num_experts=16),
    lambda e: e["decision"]["modules"].pop(),
    lambda e: e["decision"].update(source="explicit"),
    lambda e: e["local_compute_fn"].update(_factory_="autoep.runtime.recipes.module_list.ep_module_list_block"),
    lambda e: e.update(match="model.layers.0.mlp"),
])
def test_hand_edited_decision_is_refused(resolved_qwen3, edit):
    edited = copy.deepcopy(resolved_qwen3)
    edit(edited["plan"][0])
    for on_drift in ("error", "redetect"):
        edited["on_drift"] = on_drift
        with pytest.raises(PlanError, match=r"parallel.plan.0: match/local_compute_fn/decision were changed after "
                                            r"the plan was resolved.*parallel.plan.0.decision=null") as info:
            resolve_plan(edited, meta_model())
        assert not isinstance(info.value, DriftError)


def test_replay_does_not_detect(resolved_qwen3, monkeypatch):
    monkeypatch.setattr(structure, "detect_moe_structure", lambda m, **_: pytest.fail("replay must not detect"))
    assert plain(resolve_plan(resolved_qwen3, meta_model())) == resolved_qwen3


def test_replay_rechecks_ep_size(resolved_qwen3):
    resolved_qwen3["ep_size"] = 3
    with pytest.raises(PlanError, match=r"parallel.ep_size=3 does not divide num_experts=8"):
        resolve_plan(resolved_qwen3, meta_model())


def test_changed_source_is_drift_naming_the_class(resolved_qwen3, monkeypatch):
    model = meta_model()
    router_cls = type(model.model.layers[0].mlp.gate)
    original = router_cls.forward

    def patched_forward(self, hidden_states):  # same behaviour, different source
        return original(self, hidden_states)

    monkeypatch.setattr(router_cls, "forward", patched_forward)
    with pytest.raises(DriftError, match=rf"parallel.plan.0 \(model.layers.0.mlp ...\): the model's code changed.*"
                                         rf"source of .*\.{router_cls.__qualname__} changed.*on_drift=redetect"):
        resolve_plan(resolved_qwen3, model)


def test_detector_version_change_is_drift(resolved_qwen3, monkeypatch):
    old = structure.DETECTOR_VERSION
    monkeypatch.setattr(structure, "DETECTOR_VERSION", "999")
    with pytest.raises(DriftError, match=rf"detector version {old} -> 999"):
        resolve_plan(resolved_qwen3, meta_model())


def test_drift_redetects_when_asked(resolved_qwen3, caplog):
    deeper = meta_model(num_hidden_layers=3)
    with pytest.raises(DriftError, match=r"matched modules changed \(added \['model.layers.2.mlp'\], removed \[\]\)"):
        resolve_plan(resolved_qwen3, deeper)
    resolved_qwen3["on_drift"] = "redetect"
    with caplog.at_level("WARNING", logger="autoep.plan.resolve"):
        fresh = plain(resolve_plan(resolved_qwen3, deeper))
    assert fresh["plan"][0]["decision"]["modules"][-1] == "model.layers.2.mlp"
    assert fresh["plan"][0]["decision"]["source"] == "auto"
    assert "deciding afresh" in caplog.text


def test_auto_on_a_non_moe_module_is_also_an_unsupported_structure():
    from autoep import UnsupportedModuleStructure

    with pytest.raises(UnsupportedModuleStructure) as info:
        resolve_plan(plan(match="model.layers.*.self_attn", moe_only=False), meta_model())
    assert info.value.cls_name == "Qwen3MoeAttention" and "no `experts` submodule" in info.value.reason


def _structure_of(name):
    model = meta_model(name)
    return structure.detect_moe_structure(model.get_submodule("model.layers.0.mlp")).as_dict()


@pytest.mark.parametrize("name, target, edit, message", [
    # the module_list recipe on batched experts: caught here, not as a traceback at run time
    ("qwen3_moe", "autoep.runtime.recipes.module_list.ep_module_list_block", {}, "needs a ModuleList/ModuleDict of experts"),
    # layout facts that differ from what the experts compute
    ("gpt_oss", "autoep.runtime.recipes.batched.ep_batched_experts", {"expert_transposed": False}, "structure says"),
    ("qwen3_moe", "autoep.runtime.recipes.batched.ep_batched_experts", {"activation": "clamped_glu"}, "structure says"),
])
def test_an_explicit_recipe_that_does_not_fit_is_refused_at_resolve_time(name, target, edit, message):
    fn = {"_target_": target, "structure": {**_structure_of(name), **edit}}
    with pytest.raises(PlanError, match=rf"parallel.plan.0.local_compute_fn._target_='{target}' does not fit "
                                        rf"model.layers.0.mlp \(.*\): .*{message}"):
        resolve_plan(plan(fn=fn), meta_model(name))


def test_an_explicit_recipe_that_fits_resolves():
    fn = {"_target_": "autoep.runtime.recipes.batched.ep_batched_experts", "structure": _structure_of("gpt_oss")}
    assert plain(resolve_plan(plan(fn=fn), meta_model("gpt_oss")))["plan"][0]["decision"]["source"] == "explicit"


def test_moe_only_takes_the_moe_blocks_of_a_model_that_mixes_dense_layers():
    """DeepSeek-V3's first layers are dense: moe_only (the default of an entry a user writes and of the shipped
    one alike) takes the MoE blocks and lists the dense ones; with moe_only=false the same glob stops on the
    dense module, naming it."""
    model = meta_model("deepseek_v3", first_k_dense_replace=1)
    resolved = plain(resolve_plan(plan(ep_size=2), model))  # the entry as a user writes it: no moe_only key
    decision = resolved["plan"][0]["decision"]
    assert decision["modules"] == ["model.layers.1.mlp"] and decision["skipped"] == ["model.layers.0.mlp"]
    assert plain(resolve_plan(resolved, model)) == resolved  # replay keeps it
    shipped = {"plan": [OmegaConf.to_container(OmegaConf.load(SHIPPED_PARALLEL).plan[0])], "ep_size": 2}
    assert plain(resolve_plan(shipped, model)) == resolved
    from autoep import UnsupportedModuleStructure

    with pytest.raises(UnsupportedModuleStructure, match="model.layers.0.mlp"):
        resolve_plan(plan(ep_size=2, moe_only=False), model)
    with pytest.raises(PlanError, match=r"moe_only=true matches .* none has an `experts` submodule"):
        resolve_plan({"plan": [{"match": "model.layers.*.self_attn", "moe_only": True}]}, model)


def test_moe_only_has_one_default_the_shipped_entry_and_the_schema():
    """The entry autoep ships (plan/conf/parallel/default.yaml) and an entry a user writes without the key get
    the same moe_only (issue 20: they differed)."""
    from autoep.plan.schema import PlanEntry

    assert OmegaConf.load(SHIPPED_PARALLEL).plan[0].moe_only is PlanEntry().moe_only is True


def test_moe_only_finds_experts_by_data_flow_not_by_name():
    import blocks

    from autoep.plan.resolve import split_moe

    modules = {"layers.0.mlp": blocks.FairseqStyleMoE(), "layers.1.mlp": blocks.FeedForward(16, 32),
               "layers.2.mlp": blocks.SequentialExpertsMoE()}
    assert split_moe("parallel.plan.0", "layers.*.mlp", list(modules), modules) == (
        ["layers.0.mlp", "layers.2.mlp"], ["layers.1.mlp"])


def test_a_glob_that_matches_nothing_suggests_globs_that_match_the_moe_blocks():
    """Issue 20: a host keeps the causal LM under ``net`` (a LightningModule's attribute), so the usual glob
    matches nothing; the error suggested that same glob back. Now it suggests globs over the blocks that hold
    experts, and the one it proposes resolves to every MoE block."""
    host = torch.nn.Module()
    host.net = meta_model()
    with pytest.raises(PlanError) as info:
        resolve_plan(plan(), host)
    message = str(info.value)
    assert "e.g. match: 'net.model.layers.*.mlp'" in message, message
    suggested = re.search(r"e.g. match: '([^']+)'", message).group(1)
    assert suggested != MLP
    decision = plain(resolve_plan(plan(match=suggested), host))["plan"][0]["decision"]
    assert decision["modules"] == ["net.model.layers.0.mlp", "net.model.layers.1.mlp"]
    # a dense-first model: the glob is over the blocks with experts; the dense ones are not suggested
    host.net = meta_model("deepseek_v3", first_k_dense_replace=1)
    with pytest.raises(PlanError, match=r"globs that match its MoE blocks: \['net.model.layers.\*.mlp'\]"):
        resolve_plan(plan(match="model.layers.*.mlp"), host)
