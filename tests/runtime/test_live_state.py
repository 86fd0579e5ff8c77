"""Run-time state on everything autoep touches is kept or refused naming it, never dropped (issue 17).

At apply (``autoep.runtime.live_state``, called by ``apply_plan``): state on expert parameters autoep
replaces (gradient hooks, post-accumulate hooks, tensor-subclass weights), expert tensors shared by two
names in the model, hooks on the block that read the experts, process-wide patches. At forward time (the
fast path in the exchange): patches, torch-function and dispatch modes, global module hooks. Each refused
case is one that ``main`` before issue 17 ran silently wrong or crashed in; the rank cases run on 2 and 4
gloo ranks (every rank must refuse alike: none may wait in an exchange).
"""
from __future__ import annotations

import copy

import live_state_blocks as L
import pytest
import torch
import torch.nn.functional as F
from distributed import guarded, run_cases
from test_parity_hf import _block_parity, ep_plan
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.overrides import TorchFunctionMode

from autoep.errors import LiveStateError, UnsupportedModuleStructure
from autoep.runtime.apply import apply_plan


def _holder(block: nn.Module) -> nn.Module:
    holder = nn.Module()
    holder.mlp = block
    return holder


def _plan(holder: nn.Module, world_size: int) -> dict:
    import torch.distributed as dist

    plan = ep_plan(holder, ["mlp"]) if dist.is_initialized() else _single_plan(holder)
    return plan | {"ep_size": world_size}


def _single_plan(holder: nn.Module) -> dict:
    from autoep.detect.structure import detect_moe_structure
    from autoep.plan.archetypes import compute_fn_config

    structure = detect_moe_structure(holder.mlp)
    return {"plan": [{"match": "mlp", "local_compute_fn": compute_fn_config(structure),
                      "decision": {"modules": ["mlp"]}}]}


def _mesh(world_size: int):
    return None if world_size == 1 else init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))


def _apply_refuses(holder, plan, world_size, *needles):
    with pytest.raises(UnsupportedModuleStructure) as info:
        apply_plan(holder, plan, _mesh(world_size))
    for needle in needles:
        assert needle in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------
# State on the expert parameters, sharing, hooks on the block: refused at apply
# ---------------------------------------------------------------------------------------------


def _grad_hook(world_size):
    """ModuleList experts stay the model's own parameter objects on the rank owning them (issue 16): a gradient
    hook on one is kept there, not refused (tests/runtime/test_module_list_recipe.py checks that it runs)."""
    from autoep.runtime.recipes.local_experts import expert_owners

    holder = _holder(L.moe())
    plan = _plan(holder, world_size)
    name = L.with_grad_hook(holder.mlp)
    hooked = holder.mlp.get_parameter(name)
    apply_plan(holder, plan, _mesh(world_size))
    place = expert_owners(holder)[f"mlp.{name}"]
    assert (holder.mlp.get_parameter(name) is hooked) == place.local


def _post_accumulate_hook(world_size):
    holder = _holder(L.qwen3())
    plan = _plan(holder, world_size)
    name = L.with_post_accumulate_hook(holder.mlp, [])
    _apply_refuses(holder, plan, world_size, f"mlp.{name} carries 1 post-accumulate-grad hook(s)")


def _fake_quant(world_size):
    holder = _holder(L.moe())
    plan = _plan(holder, world_size)
    name = L.with_fake_quant(holder.mlp)
    _apply_refuses(holder, plan, world_size, f"mlp.{name} is a FakeQuantWeight (a tensor subclass weight")


def _tied_to_shared_expert(world_size):
    holder = _holder(L.qwen2_shared())
    plan = _plan(holder, world_size)
    holder.mlp.shared_expert.down_proj.weight = holder.mlp.experts[2].down_proj.weight
    _apply_refuses(holder, plan, world_size, "mlp.experts.2.down_proj.weight is also mlp.shared_expert.down_proj.weight")


def _renorm_pre_hook(world_size):
    holder = _holder(L.qwen3())
    plan = _plan(holder, world_size)
    holder.mlp.register_forward_pre_hook(L.renorm_experts)
    _apply_refuses(holder, plan, world_size, "the forward pre hook renorm_experts line", "reads `experts`")


def _patched_linear_forward_at_apply(world_size):
    holder = _holder(L.mixtral())
    plan = _plan(holder, world_size)
    real = nn.Linear.forward
    nn.Linear.forward = lambda self, x: real(self, x) * 1.0
    try:
        _apply_refuses(holder, plan, world_size, "torch.nn.Linear.forward is not torch's own")
    finally:
        nn.Linear.forward = real


APPLY_CASES = {
    "gradient hook on a ModuleList expert weight: kept": _grad_hook,
    "post-accumulate hook (optimizer in backward)": _post_accumulate_hook,
    "fake-quant tensor-subclass weights": _fake_quant,
    "routed expert tied to the shared expert": _tied_to_shared_expert,
    "block pre-hook renorming every expert weight": _renorm_pre_hook,
    "nn.Linear.forward patched before apply": _patched_linear_forward_at_apply,
}

# ---------------------------------------------------------------------------------------------
# At forward time: the fast path raises naming the patch, mode or hook (on every rank)
# ---------------------------------------------------------------------------------------------


class _ScaleLinear(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is F.linear else out


def _applied(make, world_size):
    holder = _holder(make())
    apply_plan(holder, _plan(holder, world_size), _mesh(world_size))
    return holder.mlp, torch.randn(1, 3, L.D if make is not L.qwen3 else holder.mlp.gate.weight.shape[-1])


def _forward_raises(block, x, *needles):
    with pytest.raises(LiveStateError) as info:
        block(x)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def _mode_at_forward(world_size):
    block, x = _applied(L.mixtral, world_size)
    with _ScaleLinear():
        _forward_raises(block, x, "a TorchFunctionMode _ScaleLinear is active")


def _global_hook_at_forward(world_size):
    block, x = _applied(L.moe, world_size)
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, out: out)
    try:
        _forward_raises(block, x, "global module forward hooks are registered")
    finally:
        handle.remove()


def _patched_f_linear_at_forward(world_size):
    block, x = _applied(L.qwen3, world_size)
    real = F.linear
    F.linear = lambda inp, w, b=None: real(inp, w, b) * 2
    try:
        _forward_raises(block, x, "torch.nn.functional.linear is patched")
    finally:
        F.linear = real


def _benign_modes_still_exact(world_size):
    """A value-preserving torch mode (``with torch.device(...)``, a TorchFunctionMode) does not stop the fast
    path. (torch's FLOP counter registers global module hooks, which are refused.)"""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    with torch.device("cpu"):
        _block_parity(rank, world_size, L.moe(), L.D)


FORWARD_CASES = {
    "TorchFunctionMode at forward": _mode_at_forward,
    "global forward hook at forward": _global_hook_at_forward,
    "F.linear patched after apply": _patched_f_linear_at_forward,
}


def live_state_cases(rank: int, world_size: int) -> dict:
    results = {}
    for name, case in {**APPLY_CASES, **FORWARD_CASES}.items():
        guarded(results, name, case, world_size)
    guarded(results, "benign modes keep the fast path, exact", _benign_modes_still_exact, world_size)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return request.param, run_cases(request.param, "test_live_state:live_state_cases")


def test_every_rank_refuses_or_raises_alike(ranks):
    world_size, results = ranks
    assert len(results) == len(APPLY_CASES) + len(FORWARD_CASES) + 1, sorted(results)
    failed = {name: errs for name, errs in results.items() if errs}
    assert not failed, f"world_size={world_size}: " + "\n".join(f"{n}:\n{e[0]}" for n, e in failed.items())


# Without a mesh the batched experts keep their parameters, so their state is kept (the test below), not refused.
KEPT_IN_ONE_PROCESS = {"post-accumulate hook (optimizer in backward)"}


@pytest.mark.parametrize("case", [c for c in APPLY_CASES if c not in KEPT_IN_ONE_PROCESS])
def test_refused_at_apply_in_one_process(case):
    APPLY_CASES[case](1)


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_fast_path_raises_in_one_process(case):
    FORWARD_CASES[case](1)


# ---------------------------------------------------------------------------------------------
# What is present and kept is preserved
# ---------------------------------------------------------------------------------------------


def test_state_on_a_parameter_autoep_keeps_still_runs():
    """Without a mesh, batched experts keep their parameters: a gradient hook and a post-accumulate hook on
    one still run, and the gradient equals the block's own (hook included)."""
    ref = L.qwen3()
    seen_ref, seen_ep = [], []
    ep = _holder(copy.deepcopy(ref))
    ref.experts.down_proj.register_hook(lambda g: g * 3)
    L.with_post_accumulate_hook(ref, seen_ref)
    ep.mlp.experts.down_proj.register_hook(lambda g: g * 3)
    L.with_post_accumulate_hook(ep.mlp, seen_ep)
    apply_plan(ep, _single_plan(ep), None)
    x = torch.randn(2, 3, ref.gate.weight.shape[-1])
    ref(x)[0].sum().backward() if isinstance(ref(x), tuple) else ref(x).sum().backward()
    out = ep.mlp(x)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    assert seen_ep and seen_ep[0] is ep.mlp.experts.gate_up_proj
    torch.testing.assert_close(ep.mlp.experts.down_proj.grad, ref.experts.down_proj.grad)


def test_frozen_experts_stay_frozen():
    holder = _holder(L.moe())
    holder.mlp.experts.requires_grad_(False)
    apply_plan(holder, _single_plan(holder), None)
    assert not any(p.requires_grad for p in holder.mlp.experts.parameters())
    assert holder.mlp.gate.weight.requires_grad


def test_resolve_refuses_experts_shared_between_blocks_and_elsewhere():
    from autoep.plan.resolve import resolve_plan

    def model():
        m = nn.Module()
        m.layers = nn.ModuleList([nn.Module(), nn.Module()])
        for layer in m.layers:
            layer.mlp = L.moe()
        return m

    cfg = {"ep_size": 2, "plan": [{"match": "layers.*.mlp"}]}
    resolve_plan(cfg, model())  # untied: accepted
    shared_pool = model()
    shared_pool.layers[1].mlp.experts = shared_pool.layers[0].mlp.experts
    with pytest.raises(UnsupportedModuleStructure, match=r"layers.0.mlp.experts.0.w1.weight is also "
                                                         r"layers.1.mlp.experts.0.w1.weight"):
        resolve_plan(cfg, shared_pool)
    reused = model()
    reused.layers[1].mlp = reused.layers[0].mlp  # one block registered twice
    with pytest.raises(UnsupportedModuleStructure, match="is also layers.1.mlp.experts"):
        resolve_plan(cfg, reused)
    elsewhere = model()
    elsewhere.probe = elsewhere.layers[0].mlp.experts[3]
    with pytest.raises(UnsupportedModuleStructure, match="layers.0.mlp.experts.3.w1.weight is also probe.w1.weight"):
        resolve_plan(cfg, elsewhere)
