"""equal_groups_proof + recipes.equal_groups: experts called as ``experts(rows)`` on E equal groups of rows
(Llama-4) are proven from source, one-line edits the recipe would get wrong are refused, and under EP the
block computes exactly what its own forward computes (outputs, input grads, router and shared grads summed
over ranks, expert grads gathered) while sending only the rows that are not all zero (T * top_k of E * T).
"""

from __future__ import annotations

import ast
import textwrap

import pytest
import torch
from blocks import EqualGroupExperts, EqualGroupsMoE
from distributed import guarded, run_cases
from mutation_source import with_method
from test_grouped_recipe import _gathered, _plan
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autoep.runtime.dispatch
from autoep.detect.equal_groups_proof import equal_groups_proof
from autoep.detect.source import Refusal
from autoep.detect.structure import detect_moe_structure
from autoep.runtime.apply import apply_plan
from autoep.runtime.recipes.equal_groups import ep_equal_group_experts

D, FFN, E, TOP_K, SEQ = 16, 24, 4, 2, 3
BATCH_PER_RANK = {1: [4], 2: [3, 1], 4: [2, 1, 3, 1]}  # its own view(E, -1, D) cannot take an empty batch


class SigmoidGateExperts(EqualGroupExperts):
    """act(0) = 1/2: a zero row's Jacobian is not zero, so every row must be sent."""

    def forward(self, x):
        x = x.view(self.num_experts, -1, x.shape[-1])
        gate, up = torch.matmul(x, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.matmul(torch.sigmoid(gate) * up, self.down_proj)
        return out.reshape(-1, self.down_proj.shape[-1])


def _make(name: str) -> nn.Module:
    torch.manual_seed(sum(map(ord, name)))
    block = EqualGroupsMoE(hidden=D, ffn=FFN, num_experts=E, top_k=TOP_K)
    if name == "sigmoid_gate":
        block.experts.__class__ = SigmoidGateExperts
    return block.train()


def _run(block, x, grad_out):
    x = x.clone().requires_grad_()
    out, logits = block(x)
    (out * grad_out).sum().backward()
    return out.detach(), x.grad


def _data(world_size: int):
    g = torch.Generator().manual_seed(7)
    batches = BATCH_PER_RANK[world_size]
    x = torch.randn(sum(batches), SEQ, D, generator=g)
    x[0, 1] = 0  # a zero token: even its picked experts' rows are zero (not sent, exact zeros back)
    grad_out = torch.randn(x.shape, generator=g)
    bounds = [sum(batches[:r]) for r in range(world_size + 1)]
    return [(x[lo:hi], grad_out[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]


def _check(name, rank, world_size):
    slices = _data(world_size)
    ref = _make(name)
    ref_out, ref_x_grad = [_run(ref, *s) for s in slices][rank]
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)) if world_size > 1 else None
    model = nn.ModuleDict({"mlp": _make(name)})
    apply_plan(model, _plan(model), mesh)
    sent = []
    exchange = autoep.runtime.dispatch.all_to_all
    autoep.runtime.dispatch.all_to_all = lambda x, *a: sent.append(x.shape[0]) or exchange(x, *a)
    try:
        out, x_grad = _run(model["mlp"], *slices[rank])
    finally:
        autoep.runtime.dispatch.all_to_all = exchange
    grads, weights = _gathered(model["mlp"], mesh)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(x_grad, ref_x_grad)
    ref_params = dict(ref.named_parameters())
    assert grads.keys() == ref_params.keys() and (mesh is None or weights)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_params[n].grad, msg=lambda m: f"grad of {n}: {m}")
    if world_size > 1:
        # Rows this rank sends to the experts' owners: its (token, expert) pairs, less the zero token's.
        tokens = slices[rank][0].shape[0] * SEQ
        zero = TOP_K if rank == 0 else 0
        assert sent[0] == (tokens * TOP_K - zero if name == "silu" else tokens * E), sent


def equal_groups_cases(rank, world_size):
    results = {}
    for name in ("silu", "sigmoid_gate"):
        guarded(results, name, _check, name, rank, world_size)
    return results


@pytest.mark.parametrize("name", ["silu", "sigmoid_gate"])
def test_single_process_parity(name):
    _check(name, 0, 1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_multi_rank_parity_and_rows_sent(world_size):
    results = run_cases(world_size, "test_equal_groups:equal_groups_cases")
    assert sorted(results) == ["sigmoid_gate", "silu"]
    failed = {n: e for n, e in results.items() if e}
    assert not failed, "\n".join(f"{n}:\n{e[0]}" for n, e in failed.items())


def test_proof_records_spellings_and_zero_at_zero():
    p = equal_groups_proof(_make("silu").experts)
    assert (p.groups, p.widths, p.zero_at_zero) == (("attr", "num_experts"), (("weight", "down_proj", 2),), True)
    assert p.grouped.facts == dict(expert_transposed=True, gate_up_layout="concatenated", activation="glu",
                                   expert_projs=("gate_up_proj", "down_proj"), expert_act="silu")
    assert equal_groups_proof(_make("sigmoid_gate").experts).zero_at_zero is False
    assert detect_moe_structure(_make("silu")).expert_storage == "equal_groups"


def test_transformers_llama4_is_proven():
    modeling = pytest.importorskip("transformers.models.llama4.modeling_llama4")
    config = modeling.Llama4TextConfig(hidden_size=32, intermediate_size=16, num_local_experts=4)
    with torch.device("meta"):
        block = modeling.Llama4TextMoe(config)
    s = detect_moe_structure(block)
    assert (s.expert_storage, s.expert_projs, s.expert_act) == ("equal_groups", ("gate_up_proj", "down_proj"), "act_fn")
    p = equal_groups_proof(block.experts)
    assert (p.groups, p.widths, p.zero_at_zero) == (("weight", "gate_up_proj", 0), (("attr", "hidden_size"),), True)


# EqualGroupExperts.forward as written in tests/blocks.py (a literal: its file may change while tests run)
OWN_FORWARD = textwrap.dedent("""
    def forward(self, x):
        x = x.view(self.num_experts, -1, x.shape[-1])
        gate, up = torch.matmul(x, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.matmul(F.silu(gate) * up, self.down_proj)
        return out.reshape(-1, self.down_proj.shape[-1])
""")
MUTANTS = {  # one edit of EqualGroupExperts.forward each; the recipe would compute something else
    "groups_last": ("x.view(self.num_experts, -1, x.shape[-1])", "x.view(-1, self.num_experts, x.shape[-1])"),
    "width_middle": ("x.view(self.num_experts, -1, x.shape[-1])", "x.view(self.num_experts, x.shape[-1], -1)"),
    "half_groups": ("x.view(self.num_experts, -1, x.shape[-1])", "x.view(self.num_experts // 2, -1, x.shape[-1])"),
    "two_groups": ("x.view(self.num_experts, -1, x.shape[-1])", "x.view(2, -1, x.shape[-1])"),
    "row_shift": ("x.view(self.num_experts, -1, x.shape[-1])", "x.roll(1, 0).view(self.num_experts, -1, x.shape[-1])"),
    "scale": ("F.silu(gate) * up", "F.silu(gate) * up * 2"),
    "swap_halves": ("F.silu(gate) * up", "F.silu(up) * up"),
    "out_view": ("out.reshape(-1, self.down_proj.shape[-1])", "out.reshape(self.down_proj.shape[-1], -1)"),
    "out_width": ("out.reshape(-1, self.down_proj.shape[-1])", "out.reshape(-1, self.down_proj.shape[1])"),
    "no_view_back": ("out.reshape(-1, self.down_proj.shape[-1])", "out"),
    "transposed_weight": ("torch.matmul(F.silu(gate) * up, self.down_proj)",
                          "torch.matmul(F.silu(gate) * up, self.down_proj.transpose(1, 2))"),
    "mixing_groups": ("x.view(self.num_experts, -1, x.shape[-1])", "x.view(self.num_experts, -1, x.shape[-1]).flip(0)"),
}


def test_the_unedited_forward_is_proven():
    experts = EqualGroupExperts(D, FFN, E)
    experts.__class__ = with_method(EqualGroupExperts, "forward", ast.parse(OWN_FORWARD).body[0])
    assert equal_groups_proof(experts).zero_at_zero


@pytest.mark.parametrize("name", list(MUTANTS))
def test_edits_the_recipe_would_get_wrong_are_refused(name):
    old, new = MUTANTS[name]
    src = OWN_FORWARD
    assert old in src
    mutant = with_method(EqualGroupExperts, "forward", ast.parse(src.replace(old, new)).body[0])
    experts = EqualGroupExperts(D, FFN, E)
    experts.__class__ = mutant
    with pytest.raises(Refusal):
        equal_groups_proof(experts)


def test_a_group_count_changed_after_apply_raises_as_the_own_forward_does():
    block = _make("silu")
    ep_equal_group_experts(block, structure=detect_moe_structure(block).as_dict())
    block.experts.num_experts = 2
    with pytest.raises(ValueError, match="groups"):
        block(torch.randn(2, 3, D))
    with pytest.raises(RuntimeError):
        _make("silu").experts.__class__.forward(_with_groups(2), torch.randn(24, D))


def _with_groups(n):
    experts = EqualGroupExperts(D, FFN, E)
    experts.num_experts = n
    return experts


def test_rows_of_another_width_are_refused_at_run_time():
    block = _make("silu")
    ep_equal_group_experts(block, structure=detect_moe_structure(block).as_dict())
    with pytest.raises(ValueError, match="rows"):
        block.experts(torch.randn(8, 2 * D))  # its own view would reinterpret them as (E, 4, D): rows mixed


def test_expert_load_counts_the_tokens_routed_to_each_group():
    from autoep.train.load import ExpertLoad

    model = nn.ModuleDict({"mlp": _make("silu")})
    apply_plan(model, _plan(model), None)
    load = ExpertLoad(model, ["mlp"], E)
    x = torch.randn(2, SEQ, D)
    model["mlp"](x)
    top_k_index = torch.topk(model["mlp"].router(x.reshape(-1, D)), TOP_K, dim=1).indices
    assert load.counts_E.tolist() == torch.bincount(top_k_index.reshape(-1), minlength=E).tolist()
