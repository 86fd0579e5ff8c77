"""apply_plan: which params become Shard(0) DTensors, names kept, targets gated, the meta -> materialise flow,
(edp, ep) meshes, and the errors a user sees."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from distributed import guarded, run_cases
from test_parity_hf import BLOCK_TOKENS, build_tiny_lm, ep_plan
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoep.errors import PlanError
from autoep.runtime.apply import apply_plan, import_target, shard_expert_tensor


def _plan(modules, target="autoep.runtime.recipes.batched.ep_batched_experts", **kwargs):
    return {"plan": [{"match": "*", "local_compute_fn": {"_target_": target, **kwargs}, "decision": {"modules": modules}}]}


def _qwen3_block():
    return build_tiny_lm("qwen3_moe").model.layers[0].mlp


def test_target_outside_allowed_prefixes_is_refused():
    with pytest.raises(PlanError, match="not under an allowed prefix"):
        import_target("os.system", ("autoep.runtime.recipes.",), key="parallel.plan.0.local_compute_fn._target_")


def test_allowed_targets_extend_the_prefixes():
    assert import_target("test_apply._plan", ("test_apply.",)) is _plan
    holder = nn.Module()
    holder.mlp = nn.Linear(2, 2)
    seen = []
    apply_plan(holder, {"plan": [{"match": "*", "local_compute_fn": {"_target_": "test_apply.record_factory", "seen": seen},
                                  "decision": {"modules": ["mlp"]}}]}, None, allowed_targets=["test_apply."])
    assert seen == [(holder.mlp, None)]


def record_factory(module, *, ep_mesh, seen):
    seen.append((module, ep_mesh))


def test_unimportable_target_names_the_key():
    with pytest.raises(PlanError, match=r"parallel.plan.0.local_compute_fn._target_='autoep.runtime.recipes.nope.fn'"):
        apply_plan(nn.Module(), _plan(["mlp"], "autoep.runtime.recipes.nope.fn"), None)


def test_entry_without_decision_is_refused():
    cfg = {"plan": [{"match": "*", "local_compute_fn": {"_target_": "autoep.runtime.recipes.batched.ep_batched_experts"}}]}
    with pytest.raises(PlanError, match="run resolve_plan"):
        apply_plan(nn.Module(), cfg, None)


def test_unknown_module_is_named():
    with pytest.raises(PlanError, match="'model.layers.9.mlp'"):
        apply_plan(nn.Module(), _plan(["model.layers.9.mlp"]), None)


def test_dictconfig_plan_and_no_mesh_run_unsharded():
    from omegaconf import OmegaConf

    from autoep.detect.structure import detect_moe_structure
    from autoep.plan.archetypes import compute_fn_config

    block = _qwen3_block()
    holder = nn.Module()
    holder.mlp = copy.deepcopy(block)
    cfg = OmegaConf.create({"plan": [{"match": "mlp", "local_compute_fn": compute_fn_config(detect_moe_structure(block)),
                                      "decision": {"modules": ["mlp"]}}]})
    apply_plan(holder, cfg, None)
    assert not any(isinstance(p, DTensor) for p in holder.parameters())
    x = torch.randn(1, 5, 32)
    torch.testing.assert_close(holder.mlp(x), block(x))


# ---------------------------------------------------------------- multi-rank cases (one spawn per world size)


def sharding_case(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    lm = build_tiny_lm("qwen3_moe")
    full = {n: p.detach().clone() for n, p in lm.named_parameters()}
    apply_plan(lm, ep_plan(lm, ["model.layers.0.mlp", "model.layers.1.mlp"]), mesh)
    params = dict(lm.named_parameters())
    assert params.keys() == full.keys(), "parameter names changed"
    for name, p in params.items():
        if ".mlp.experts." in name:
            assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
            assert p.to_local().shape[0] == full[name].shape[0] // world_size
            torch.testing.assert_close(p.to_local(), full[name].chunk(world_size)[rank])
            torch.testing.assert_close(p.full_tensor(), full[name])
        else:
            assert not isinstance(p, DTensor), f"dense param {name} was sharded"


def ep_size_not_dividing_case(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    with pytest.raises(PlanError, match=r"parallel.ep_size=4 does not divide num_experts=6 .*pick one of \[1, 2, 3, 6\]"):
        shard_expert_tensor(torch.zeros(6, 2), mesh, name="x")


def meta_then_materialise_case(rank, world_size):
    """The trainer's flow: build on meta, apply_plan, to_empty, fill each expert shard from the full weights."""
    ref = build_tiny_lm("qwen3_moe")
    with torch.device("meta"):
        lm = copy.deepcopy(ref).to("meta")
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    apply_plan(lm, ep_plan(lm, ["model.layers.0.mlp", "model.layers.1.mlp"]), mesh)
    lm.to_empty(device="cpu")
    full = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if isinstance(p, DTensor):
                p.to_local().copy_(full[name].chunk(world_size)[rank])
            else:
                p.copy_(full[name])
        for name, b in ref.named_buffers():
            lm.get_buffer(name).copy_(b)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(rank))
    torch.testing.assert_close(lm(input_ids=ids).logits, ref(input_ids=ids).logits)


def two_dim_mesh_case(rank, world_size):
    """(edp=2, ep=2): experts Shard(0) on ep, Replicate on edp; per-rank outputs and edp-reduced expert grads exact."""
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("edp", "ep"))
    ref = _qwen3_block()
    holder = nn.Module()
    holder.mlp = copy.deepcopy(ref)
    apply_plan(holder, ep_plan(holder, ["mlp"]), mesh)
    p = holder.mlp.experts.gate_up_proj
    assert p.placements == (Replicate(), Shard(0)) and p.to_local().shape[0] == 8 // (world_size // 2)
    counts = BLOCK_TOKENS[world_size]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, sum(counts), 32, generator=g)
    lo, hi = sum(counts[:rank]), sum(counts[: rank + 1])
    out = holder.mlp(x[:, lo:hi])
    out.sum().backward()
    ref_out = ref(x)
    ref_out.sum().backward()
    torch.testing.assert_close(out, ref_out[:, lo:hi])
    # The trainer all-reduces expert grads over edp (each edp replica saw different tokens).
    local = p.grad.to_local().clone()
    dist.all_reduce(local, group=mesh.get_group("edp"))  # NOTE: collective (edp grad reduction)
    L = local.shape[0]
    ep_rank = mesh.get_local_rank("ep")
    torch.testing.assert_close(local, ref.experts.gate_up_proj.grad[ep_rank * L : (ep_rank + 1) * L])


def apply_cases(rank, world_size):
    results = {}
    guarded(results, "sharding", sharding_case, rank, world_size)
    guarded(results, "meta_then_materialise", meta_then_materialise_case, rank, world_size)
    if world_size == 4:
        guarded(results, "ep_size_not_dividing", ep_size_not_dividing_case, rank, world_size)
        guarded(results, "two_dim_mesh", two_dim_mesh_case, rank, world_size)
    return results


_RESULTS: dict = {}


@pytest.mark.parametrize(
    "world_size,case",
    [(2, "sharding"), (4, "sharding"), (2, "meta_then_materialise"), (4, "ep_size_not_dividing"), (4, "two_dim_mesh")],
)
def test_multi_rank(world_size, case):
    if world_size not in _RESULTS:
        _RESULTS[world_size] = run_cases(world_size, "test_apply:apply_cases")
    errors = _RESULTS[world_size][case]
    assert not errors, "\n".join(errors)
