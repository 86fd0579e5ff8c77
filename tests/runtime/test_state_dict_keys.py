"""After ``apply_plan`` a model's parameter names and ``state_dict()`` keys are the model's own, on every recipe
(one block per storage kind), on 2 gloo ranks; ModuleList experts keep their own parameter objects on the rank
that owns them, are ``meta`` stand-ins elsewhere, and every expert key is owned by exactly one ep rank.
"""

from __future__ import annotations

import pytest
import torch
from blocks import EqualGroupsMoE, MixtralStyleSparseMoeBlock, TitanMoE
from distributed import guarded, run_cases
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autoep.detect.structure import detect_moe_structure
from autoep.plan.archetypes import compute_fn_config
from autoep.runtime.apply import apply_plan
from autoep.runtime.recipes.local_experts import expert_owners, owned_state_dict

D = 16


def _batched():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    return Qwen3MoeSparseMoeBlock(cfg)


BLOCKS = {  # storage kind -> (block, the recipe the table must pick)
    "module_list": (lambda: MixtralStyleSparseMoeBlock(hidden=D, num_experts=4, top_k=2), "module_list"),
    "batched_parameters": (_batched, "batched"),
    "grouped": (lambda: TitanMoE(hidden=D, num_experts=4, top_k=2), "grouped"),
    "equal_groups": (lambda: EqualGroupsMoE(hidden=D, ffn=32, num_experts=4, top_k=1), "equal_groups"),
}


def _apply(kind: str, mesh) -> tuple[nn.Module, dict, dict]:
    """(EP model, the model's own state_dict keys -> tensor objects, its own named_parameters) before apply."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"mlp": BLOCKS[kind][0]()})
    own_keys = list(model.state_dict(keep_vars=True))
    own_params = dict(model.named_parameters())
    structure = detect_moe_structure(model["mlp"])
    fn = compute_fn_config(structure)
    assert f".recipes.{BLOCKS[kind][1]}." in fn["_target_"], fn["_target_"]
    decision = {"source": "auto", "structure": structure.as_dict(), "modules": ["mlp"]}
    apply_plan(model, {"plan": [{"match": "mlp", "local_compute_fn": fn, "decision": decision}]}, mesh)
    return model, own_keys, own_params


def _check(kind: str, rank: int, world_size: int):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)) if world_size > 1 else None
    model, own_keys, own_params = _apply(kind, mesh)
    assert list(model.state_dict(keep_vars=True)) == own_keys
    assert list(dict(model.named_parameters())) == list(own_params)
    owners = expert_owners(model)
    if kind != "module_list":
        assert not owners
        return None
    experts = [k for k in own_keys if k.startswith("mlp.experts.")]
    assert sorted(owners) == sorted(experts)
    for name, p in model.named_parameters():
        place = owners.get(name)
        if place is None:
            assert p is own_params[name]  # dense: untouched
        elif place.local:
            assert p is own_params[name] and not p.is_meta and p.requires_grad  # the model's own object
        else:
            assert p.is_meta and not p.requires_grad  # another rank's expert: never allocated here
    model.to("cpu").double()  # module conversions keep the stand-ins on meta, in the converted dtype
    for name, p in model.named_parameters():
        assert p.dtype == torch.float64 and p.is_meta == (name in owners and not owners[name].local)
    local = {k for k, place in owners.items() if place.local}
    per_rank = 4 // world_size
    assert {place.expert for place in owners.values() if place.local} == set(range(rank * per_rank, (rank + 1) * per_rank))
    assert set(owned_state_dict(model)) == (set(own_keys) - set(experts)) | local
    return sorted(local)


def state_dict_cases(rank, world_size):
    results = {}
    for kind in BLOCKS:
        guarded(results, kind, _check, kind, rank, world_size)
    return results


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_keys_are_the_models_own_single_process(kind):
    _check(kind, 0, 1)


def test_keys_are_the_models_own_on_2_ranks():
    results = run_cases(2, "test_state_dict_keys:state_dict_cases")
    assert sorted(results) == sorted(BLOCKS)
    failed = {n: e for n, e in results.items() if e}
    assert not failed, "\n".join(f"{n}:\n{e[0]}" for n, e in failed.items())
