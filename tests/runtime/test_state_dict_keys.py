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
    target = fn.get("_target_") or fn.get("_factory_")  # plan entries name the factory as _factory_
    assert f".recipes.{BLOCKS[kind][1]}." in target, target
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


def _full_state_round_trip(rank: int, world_size: int):
    """``runtime.state``'s full model and optimizer state (what the handle's full-state checkpoints hold) of a
    ModuleList model under EP: every expert from its owner, the same on every rank, equal to the model's own
    weights; loading it back into a fresh EP model and optimizer restores this rank's experts and moments."""
    import torch.distributed as dist

    from autoep.runtime import state
    from autoep.runtime.grads import split_params

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)) if world_size > 1 else None
    torch.manual_seed(0)
    own = nn.ModuleDict({"mlp": BLOCKS["module_list"][0]()}).state_dict()
    model, _, _ = _apply("module_list", mesh)
    full = state.full_model_state(model)  # NOTE: collective
    assert list(full) == list(own)
    for k, v in own.items():
        torch.testing.assert_close(full[k], v, msg=lambda m: f"{k}: {m}")

    def trained(model):
        opt = torch.optim.SGD([p for group in split_params(model) for p in group], lr=0.1, momentum=0.9)
        x = torch.randn(3, 2, D, generator=torch.Generator().manual_seed(rank))
        model["mlp"](x)[0].square().sum().backward()
        opt.step()
        return opt

    opt = trained(model)
    full, optim = state.full_model_state(model), state.full_optim_state(model, opt)  # NOTE: collectives
    experts = [k for k in own if k.startswith("mlp.experts.")]
    assert set(experts) <= set(optim["state"]) and {f for g in optim["param_groups"] for f in g["params"]} == set(
        optim["state"])
    gathered = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(gathered, (full, optim))  # NOTE: collective; every rank holds the same experts
        for other_full, other_optim in gathered:  # (dense grads were not summed here: dense weights differ)
            for k in experts:
                torch.testing.assert_close(other_full[k], full[k])
            for k in experts:
                torch.testing.assert_close(other_optim["state"][k]["momentum_buffer"], optim["state"][k]["momentum_buffer"])
    fresh, _, _ = _apply("module_list", mesh)
    fresh_opt = trained(fresh)  # different moments: the load must overwrite them
    state.load_full_model_state(fresh, full)
    state.load_full_optim_state(fresh, fresh_opt, optim)
    names = dict(model.named_parameters())
    for n, p in fresh.named_parameters():
        if not p.is_meta:
            torch.testing.assert_close(p, names[n], msg=lambda m: f"{n}: {m}")
            torch.testing.assert_close(fresh_opt.state[p]["momentum_buffer"], opt.state[names[n]]["momentum_buffer"])


def test_full_state_round_trip_single_process():
    _full_state_round_trip(0, 1)


def full_state_cases(rank, world_size):
    results = {}
    guarded(results, "full_state", _full_state_round_trip, rank, world_size)
    return results


def test_full_state_round_trip_on_2_ranks():
    results = run_cases(2, "test_state_dict_keys:full_state_cases")
    assert list(results) == ["full_state"] and not results["full_state"], "\n".join(results["full_state"])
