"""``autoep.detect.row_norm``: a module the batched experts apply to their output rows is accepted only where its
forward is proven row-local (MuseSpark's post-expert norm), and the batched recipe computes what the
experts' own forward computes with it. Multi-rank parity: ``test_parity_hf`` (MuseSparkMoE is picked up
from coverage); mutants: ``bench/soundness.py --target hf/muse_spark``."""
from __future__ import annotations

import copy
import importlib
import textwrap

import pytest
import torch
import torch.nn as nn
from mutation_source import exec_subclass

from autoep.detect.row_norm import prove_row_local
from autoep.detect.source import Refusal
from autoep.detect.structure import detect_moe_structure
from autoep.errors import UnsupportedModuleStructure
from autoep.plan.archetypes import compute_fn_config
from autoep.runtime.apply import import_target

D = 8

muse = pytest.importorskip("transformers.models.muse_spark.modeling_muse_spark")


def muse_block() -> nn.Module:
    from test_parity_hf import eager_experts_, randomize_

    from autoep.tools.tiny import build_block, family_configs

    family = importlib.import_module("transformers.models.muse_spark")
    block, _ = build_block(muse.MuseSparkMoE, list(family_configs(family)), tiny=True)
    randomize_(block, 0)
    eager_experts_(block)
    return block.float().train()


# ---------------------------------------------------------------- the norm's forward, on its own


class ScaledRMSNorm(nn.Module):
    """MuseSpark's norm, written again (scale, then normalise)."""

    def __init__(self, dim: int = D, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = x.float() * (1.0 + self.weight).float()
        output = self._norm(output.type_as(x).float())
        return output.type_as(x)


def _variant(body: str) -> nn.Module:
    """``ScaledRMSNorm`` with its forward replaced by ``def forward(self, x): <body>`` (source readable)."""
    src = textwrap.indent(f"def forward(self, x):\n    {body}\n", "    ")
    return exec_subclass(ScaledRMSNorm, src, check="forward")()


def test_the_norm_and_its_method_are_row_local():
    prove_row_local(ScaledRMSNorm(), D, "norm")
    prove_row_local(muse.MuseSparkTextInputScaledRMSNorm(D), D, "norm")
    prove_row_local(_variant("return x / x.float().sum(dim=-1, keepdim=True).sqrt() * -self.weight"), D, "norm")
    prove_row_local(_variant("return x.to(torch.bfloat16) * self.weight.to(torch.float64).type_as(x)"), D, "norm")


@pytest.mark.parametrize("body, why", [
    ("return x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + self.eps)", "reduction over dim -1"),
    ("return x * torch.rsqrt(x.pow(2).mean(-1) + self.eps)", "reduction over dim -1"),
    ("return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).mean(0, keepdim=True))", "reduction over dim -1"),
    ("return x * torch.rsqrt(x.pow(2).mean() + self.eps)", "reduction over dim -1"),
    ("return x[..., :4]", "not understood"),
    ("return x.mean(-1, keepdim=True)", "does not return"),
    ("return self.weight * 2.0", "does not return"),
    ("return x * self.weight.sum(-1, keepdim=True)", "tensor method"),
    ("return x.cumsum(-1)", "tensor method"),
    ("return x.roll(1, 0)", "tensor method"),
    ("return x * torch.ones_like(x)", "calls"),
    ("return x * self.training", "bool"),
    ("return x * (1.0 + self.weight).to(torch.bfloat16).float()", "narrower dtype"),
    ("return x * self.weight.half()", "narrower dtype"),
    ("x = x * 2.0\n    return x * (x > 0)", "not understood"),
    ("if self.eps > 0:\n        x = x * 2.0\n    return x", "not an assignment"),
    ("x.mul_(2.0)\n    return x", "not an assignment"),
])
def test_what_is_not_row_local_is_refused(body, why):
    with pytest.raises(Refusal, match=why):
        prove_row_local(_variant(body), D, "norm")


def test_state_the_norm_forward_does_not_show_is_refused():
    with_buffer = ScaledRMSNorm()
    with_buffer.register_buffer("scale", torch.ones(D))
    wide = ScaledRMSNorm(dim=D + 1)
    hooked = ScaledRMSNorm()
    hooked.register_forward_hook(lambda *_: None)
    instance = ScaledRMSNorm()
    instance.forward = lambda x: x.flip(0)
    own_norm = ScaledRMSNorm()
    own_norm._norm = lambda x: x.flip(0)
    shadowed = ScaledRMSNorm()
    shadowed.__dict__["weight"] = torch.ones(D)  # plain lookup finds it before nn.Module's parameters
    tensor_eps = ScaledRMSNorm(eps=torch.tensor(1e-6))
    nested = ScaledRMSNorm()
    nested.inner = nn.Linear(D, D)
    for module, why in [(with_buffer, "buffers"), (wide, r"not \(8,\)"), (hooked, "forward_hooks"),
                        (instance, "instance-level forward"), (own_norm, "reads function"),
                        (shadowed, "shadowed"), (tensor_eps, "Tensor"), (nested, "submodules")]:
        with pytest.raises(Refusal, match=why):
            prove_row_local(module, D, "norm")


# ---------------------------------------------------------------- inside the experts


def test_muse_spark_is_accepted_with_its_post_expert_norm():
    s = detect_moe_structure(muse_block())
    assert (s.expert_storage, s.post_expert_norm, s.gate_up_layout, s.activation) == (
        "batched_parameters", "post_expert_norm", "concatenated", "glu")


WEIGHTED = "current_hidden_states * top_k_weights[token_idx, top_k_pos, None]"


def _experts_with(line: str, weighted: str = WEIGHTED) -> type:
    """MuseSparkExperts whose loop computes its expert output as ``line`` (from ``h``, the gate's output)
    and weights it as ``weighted``."""
    src = f'''
def forward(self, hidden_states, top_k_index, top_k_weights):
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        current_hidden_states = {line}
        current_hidden_states = {weighted}
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    return final_hidden_states
'''
    return exec_subclass(muse.MuseSparkExperts, textwrap.indent(src, "    "), check="forward")


def _reclassed(line: str, weighted: str = WEIGHTED) -> nn.Module:
    block = muse_block()
    block.experts.__class__ = _experts_with(line, weighted)
    return block


def test_the_norm_where_muse_spark_applies_it_is_accepted():
    block = _reclassed("self.post_expert_norm(nn.functional.linear(h, self.down_proj[expert_idx]))")
    assert detect_moe_structure(block).post_expert_norm == "post_expert_norm"
    _assert_recipe_exact(block)


def test_the_norm_applied_elsewhere_is_refused():
    for line, why in [
        ("self.post_expert_norm(self.post_expert_norm(nn.functional.linear(h, self.down_proj[expert_idx])))",
         "more than once"),
        ("nn.functional.linear(self.post_expert_norm(h), self.down_proj[expert_idx])", "down_proj"),
        ("nn.functional.linear(h, self.down_proj[expert_idx]) + self.post_expert_norm(current_state)", "not understood"),
        ("self.post_expert_norm(current_state)", "down_proj"),
        ("self.post_expert_norm(nn.functional.linear(h, self.down_proj[expert_idx]), 1e-6)", "rows alone"),
    ]:
        with pytest.raises(UnsupportedModuleStructure, match=why):
            detect_moe_structure(_reclassed(line))


def test_a_norm_after_the_routing_weight_is_refused():
    line = "nn.functional.linear(h, self.down_proj[expert_idx])"
    weighted = "self.post_expert_norm(current_hidden_states * top_k_weights[token_idx, top_k_pos, None])"
    with pytest.raises(UnsupportedModuleStructure, match="routing weight"):
        detect_moe_structure(_reclassed(line, weighted))


def test_hooks_on_the_norm_are_refused():
    block = muse_block()
    block.experts.post_expert_norm.register_forward_pre_hook(lambda *_: None)
    with pytest.raises(UnsupportedModuleStructure, match="forward_pre_hooks"):
        detect_moe_structure(block)
    handle = nn.modules.module.register_module_forward_hook(lambda *_: None)
    try:
        with pytest.raises(Refusal, match="global module hooks"):
            prove_row_local(ScaledRMSNorm(), D, "norm")
    finally:
        handle.remove()
    prove_row_local(ScaledRMSNorm(), D, "norm")


def test_a_frozen_norm_weight_is_still_dense_and_exact():
    block = muse_block()
    block.experts.post_expert_norm.weight.requires_grad_(False)
    _assert_recipe_exact(block)


def test_recipe_applies_the_blocks_own_norm_exactly():
    _assert_recipe_exact(muse_block())


@pytest.mark.parametrize("tokens", [1, 3, 7, 8])
def test_recipe_is_bit_identical_to_the_blocks_own_forward_in_one_process(tokens):
    """Issue 21 reported MuseSparkMoE at 1e-4 on 2 ranks (5.24). On 5.25 the 2-rank differences are rounding
    (out 3e-7, weight grads 4e-6, within fp32 ``assert_close``): the owner computes an expert over rows from both
    ranks, and CPU GEMMs round differently for other row counts (measured on the CI CPU: the block's own forward on
    rows 0:7 of 8 differs from its rows 0:7 of a call on all 8 by 3e-7, the 2-rank output difference). With the
    same rows, the batched recipe (grouped compute, post-expert norm) is the block's own computation bit for bit.
    On one thread: with two, a GEMM splits its rows between the threads by the row count, so the recipe's
    grouped GEMMs and the block's own round differently (this test failed alone at 2 threads and passed in the
    suite only because an earlier test had set one thread for the process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _assert_bit_identical(tokens)
    finally:
        torch.set_num_threads(threads)


def _assert_bit_identical(tokens: int) -> None:
    block = muse_block()
    fn = compute_fn_config(detect_moe_structure(block))
    ep = copy.deepcopy(block)
    import_target(fn.pop("_factory_"), ["autoep.runtime.recipes."])(ep, ep_mesh=None, **fn)
    x = torch.randn(1, 8, block.pre_expert_proj.in_features, generator=torch.Generator().manual_seed(7))
    assert torch.equal(ep(x[:, :tokens]), block(x[:, :tokens]))


def _assert_recipe_exact(block: nn.Module) -> None:
    structure = detect_moe_structure(block)
    fn = compute_fn_config(structure)
    ep = copy.deepcopy(block)
    import_target(fn.pop("_factory_"), ["autoep.runtime.recipes."])(ep, ep_mesh=None, **fn)
    x = torch.randn(2, 5, block.pre_expert_proj.in_features, generator=torch.Generator().manual_seed(0))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = block(xa), ep(xb)
    torch.testing.assert_close(yb, ya)
    ya.square().sum().backward()
    yb.square().sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad)
    for (name, p), (_, q) in zip(block.named_parameters(), ep.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, msg=name)
    assert ep.experts.post_expert_norm.weight is not block.experts.post_expert_norm.weight


# ---------------------------------------------------------------- on ranks: the norm's weight is dense


def dense_norm_case(rank: int, world_size: int) -> None:
    """After ``apply_plan`` the norm's weight is a plain (dense) parameter, the experts' weights DTensors on
    ``ep``; the trainer's ``reduce_grads`` sums the norm's grad over the world to the model's own grad."""
    import torch.distributed as dist
    from test_parity_hf import ep_plan
    from torch.distributed.device_mesh import init_device_mesh

    from autoep.runtime.apply import apply_plan
    from autoep.runtime.dense import is_expert
    from autoep.runtime.grads import reduce_grads, split_params

    ref = muse_block()
    holder = nn.Module()
    holder.mlp = copy.deepcopy(ref)
    apply_plan(holder, ep_plan(holder, ["mlp"]), init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)))
    experts = holder.mlp.experts
    dense, expert = split_params(holder)
    assert any(p is experts.post_expert_norm.weight for p in dense)
    assert not is_expert(experts.post_expert_norm.weight)
    assert {id(p) for p in expert} == {id(experts.gate_up_proj), id(experts.down_proj)}

    counts = [5, 2, 4, 1][:world_size]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, sum(counts), ref.pre_expert_proj.in_features, generator=g)
    grad_out = torch.randn(x.shape, generator=g)
    for r in range(world_size):  # the reference: each rank's slice on its own, grads summed
        a, b = sum(counts[:r]), sum(counts[:r + 1])
        (ref(x[:, a:b]) * grad_out[:, a:b]).sum().backward()
    lo, hi = sum(counts[:rank]), sum(counts[:rank + 1])
    (holder.mlp(x[:, lo:hi]) * grad_out[:, lo:hi]).sum().backward()
    reduce_grads(dense, expert, dist.group.WORLD, None)  # NOTE: collective (dense grads over the world)
    torch.testing.assert_close(experts.post_expert_norm.weight.grad, ref.experts.post_expert_norm.weight.grad)
    torch.testing.assert_close(holder.mlp.pre_expert_proj.weight.grad, ref.pre_expert_proj.weight.grad)


def norm_cases(rank: int, world_size: int) -> dict:
    from distributed import guarded

    results: dict = {}
    guarded(results, "dense_norm", dense_norm_case, rank, world_size)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_norm_weight_stays_dense_and_its_grads_sum_over_the_world(world_size):
    from distributed import run_cases

    errors = run_cases(world_size, "test_row_norm:norm_cases")["dense_norm"]
    assert not errors, "\n".join(errors)
