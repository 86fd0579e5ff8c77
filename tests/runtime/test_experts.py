"""experts.grouped_swiglu: grouped and loop paths equal a per-expert reference, every layout fact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autoep.runtime.experts import can_use_grouped_mm, glu_gate, grouped_linear, grouped_swiglu

GATE = glu_gate(F.silu)


def _interleaved_gate(h):
    return F.silu(h[..., ::2]) * h[..., 1::2]


def _reference(x, counts, gate_up, down, gate_up_bias, down_bias, transposed, gate):
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start : start + n]
        start += n
        h = xe @ gate_up[e] if transposed else xe @ gate_up[e].T
        if gate_up_bias is not None:
            h = h + gate_up_bias[e]
        h = gate(h)
        y = h @ down[e] if transposed else h @ down[e].T
        if down_bias is not None:
            y = y + down_bias[e]
        outs.append(y)
    return torch.cat(outs)


@pytest.mark.parametrize("D,Fi", [(16, 8), (6, 5), (16, 0)])  # aligned (grouped_mm) / unaligned / zero width (loop)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("gate", [GATE, _interleaved_gate], ids=["glu", "interleaved"])
def test_grouped_swiglu_matches_per_expert_loop(D, Fi, transposed, bias, gate):
    g = torch.Generator().manual_seed(0)
    L = 4
    counts = torch.tensor([3, 0, 5, 2])  # an expert with no rows still gets a (zero) gradient
    x = torch.randn(int(counts.sum()), D, generator=g)
    gu_shape, dn_shape = ((L, D, 2 * Fi), (L, Fi, D)) if transposed else ((L, 2 * Fi, D), (L, D, Fi))
    params = [torch.randn(gu_shape, generator=g), torch.randn(dn_shape, generator=g)]
    params += [torch.randn(L, 2 * Fi, generator=g), torch.randn(L, D, generator=g)] if bias else [None, None]
    grad = torch.randn(x.shape, generator=g)

    results = []
    for fn in ("grouped", "reference"):
        xs = x.clone().requires_grad_()
        ps = [p.clone().requires_grad_() if p is not None else None for p in params]
        if fn == "grouped":
            y = grouped_swiglu(xs, counts, ps[0], ps[1], gate_up_bias=ps[2], down_bias=ps[3], transposed=transposed, apply_gate=gate)
        else:
            y = _reference(xs, counts, *ps, transposed, gate)
        y.backward(grad)
        results.append([y, xs.grad] + [p.grad for p in ps if p is not None])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)
    assert results[0][2][1].abs().sum() == 0  # expert 1 had no rows


def test_grouped_mm_path_is_taken_when_aligned():
    x = torch.randn(10, 16)
    assert can_use_grouped_mm(x, torch.randn(3, 16, 8))
    assert not can_use_grouped_mm(x[:, :6], torch.randn(3, 6, 8))  # 24-byte rows
    assert not can_use_grouped_mm(x, torch.randn(3, 16, 6))  # 24-byte output rows
    assert not can_use_grouped_mm(x.double(), torch.randn(3, 16, 8).double())  # no CPU fp64 kernel


def test_zero_width_experts_take_the_loop():
    """The kernels refuse the strides of an empty operand ("strides should be multiple of 16 bytes")."""
    x = torch.randn(10, 16)
    assert not can_use_grouped_mm(x, torch.randn(3, 16, 0))
    assert not can_use_grouped_mm(x[:, :0], torch.randn(3, 0, 16))


def test_zero_width_transformers_block_equals_its_own_forward():
    """Ernie-4.5-VL's sparse block with expert width 0 (what a tiny config can give) under the batched recipe:
    no crash, output and input grad equal its own forward."""
    import copy

    from torch import nn
    from transformers.models.ernie4_5_vl_moe import modeling_ernie4_5_vl_moe as modeling
    from transformers.models.ernie4_5_vl_moe.configuration_ernie4_5_vl_moe import Ernie4_5_VLMoeTextConfig

    from autoep.detect.structure import detect_moe_structure
    from autoep.plan.archetypes import compute_fn_config
    from autoep.runtime.apply import apply_plan

    config = Ernie4_5_VLMoeTextConfig(hidden_size=32, moe_intermediate_size=[0, 0], moe_num_experts=4, moe_k=2)
    torch.manual_seed(0)
    ref = modeling.Ernie4_5_VLMoeSparseMoeBlock(config, intermediate_size=0)
    assert ref.experts.down_proj.shape[-1] == 0
    model = nn.ModuleDict({"mlp": copy.deepcopy(ref)})
    structure = detect_moe_structure(model["mlp"])
    decision = {"source": "auto", "structure": structure.as_dict(), "modules": ["mlp"]}
    apply_plan(model, {"plan": [{"match": "mlp", "local_compute_fn": compute_fn_config(structure),
                                 "decision": decision}]}, None)
    outs = []
    for block in (model["mlp"], ref):
        x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()
        outs.append((out, x.grad))
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want)


def test_grouped_linear_accepts_expanded_grad():
    # y.sum() hands backward a stride-0 gradient, which the grouped-mm kernel rejects unless made contiguous.
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(2, 16, 8, requires_grad=True)
    grouped_linear(x, torch.tensor([5, 3]), w).sum().backward()
    torch.testing.assert_close(w.grad[0], x[:5].detach().sum(0, keepdim=True).T.expand(16, 8))


def test_zero_rows():
    w = torch.randn(2, 16, 8, requires_grad=True)
    y = grouped_linear(torch.zeros(0, 16), torch.tensor([0, 0]), w)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert w.grad is not None and w.grad.abs().sum() == 0


# Hidden and intermediate sizes around the 16-byte alignment the grouped-mm kernels need (fp32: 4
# elements): odd, even-unaligned and aligned, so both paths and every mix of them run.
SWEEP_D = (1, 3, 4, 5, 6, 7, 8, 12, 13, 20)
SWEEP_F = (1, 2, 3, 4, 5, 6, 8, 10)
# Rows per expert: none at all, a single row (a size-1 dim, whose stride the kernels read), empty experts
# at either end and in the middle, and an uneven spread.
SWEEP_COUNTS = ([0, 0, 0], [1, 0, 0], [0, 0, 1], [0, 2, 0], [1, 1, 1], [3, 0, 5])


def _odd_strided(t):
    """``t`` (one row or one expert) with an odd stride on its size-1 leading dim: ``contiguous()``
    keeps such a tensor as it is, the grouped-mm kernels refuse it."""
    if t.shape[0] != 1:
        return t
    base = torch.empty(t.numel() + 8, dtype=t.dtype)[4:]  # 16-byte aligned offset, odd stride below
    out = base.as_strided(t.shape, (t[0].numel() + 1, *t.stride()[1:]))
    out.copy_(t)
    return out


@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_swiglu_any_size_and_token_count(transposed):
    """Every (D, F) of the sweep and every row pattern, forward and backward, equal the per-expert loop,
    also when a single row or a single expert arrives with an odd stride on its size-1 dim."""
    g = torch.Generator().manual_seed(1)
    for D in SWEEP_D:
        for Fi in SWEEP_F:
            for counts_list in SWEEP_COUNTS:
                counts = torch.tensor(counts_list)
                L, S = len(counts_list), int(counts.sum())
                gu_shape, dn_shape = ((L, D, 2 * Fi), (L, Fi, D)) if transposed else ((L, 2 * Fi, D), (L, D, Fi))
                params = [torch.randn(gu_shape, generator=g), torch.randn(dn_shape, generator=g)]
                x, grad = torch.randn(S, D, generator=g), torch.randn(S, D, generator=g)
                results = []
                for fn in ("grouped", "reference"):
                    xs = _odd_strided(x.clone()).requires_grad_()
                    ps = [p.clone().requires_grad_() for p in params]
                    if fn == "grouped":
                        y = grouped_swiglu(xs, counts, ps[0], ps[1], transposed=transposed, apply_gate=GATE)
                    else:
                        y = _reference(xs, counts, ps[0], ps[1], None, None, transposed, GATE)
                    y.backward(_odd_strided(grad.clone()))
                    results.append([y, xs.grad, ps[0].grad, ps[1].grad])
                for got, want in zip(*results):
                    torch.testing.assert_close(got, want, msg=lambda m: f"D={D} F={Fi} counts={counts_list}: {m}")


def test_grouped_linear_single_expert_with_odd_stride():
    """One local expert (ep_size == num_experts): its weight's size-1 expert dim may carry any stride."""
    x = torch.randn(5, 8, requires_grad=True)
    w = _odd_strided(torch.randn(1, 8, 4)).requires_grad_()
    y = grouped_linear(x, torch.tensor([5]), w)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(y, x.detach() @ w.detach()[0])
    torch.testing.assert_close(w.grad[0], x.detach().T @ torch.ones(5, 4))
