"""Grouped experts that apply their 3-D weights through a custom ``torch.autograd.Function`` with a hand-written
backward (the ScatterMoE / JetMoE-era ``ParallelLinear.apply(x, counts, W)`` idiom), and one-edit twins of them.

``ParallelLinear`` is written as such research code writes it: a per-group loop over ``x.split(counts)`` with
``F.linear(x_e, W[e])`` in the forward, the matching loop in the backward (rows' gradient ``g_e @ W[e]``, weight
gradient ``g_e.t() @ x_e`` stacked). The twins each change one expression: a backward scaling the rows'
gradient, a forward or backward reading the next expert's weight, a backward averaging the weight gradient over
the experts it holds (a number that differs on a rank's slice), a backward with the gradient of a weight it never
reads. Every block routes as torchtitan's does (``TitanMoE``): sorted rows and counts to ``experts(x, counts)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from blocks import TitanMoE
from torch import nn
from torch.autograd.function import once_differentiable


class ParallelLinear(torch.autograd.Function):
    """``y_e = x_e @ W[e].T`` for each group e of rows (``counts[e]`` rows, in order), its own backward."""

    @staticmethod
    def forward(ctx, x, counts, weight):
        sizes = counts.tolist()
        ctx.save_for_backward(x, weight)
        ctx.sizes = sizes
        out = []
        for e, x_e in enumerate(torch.split(x, sizes, dim=0)):
            out.append(F.linear(x_e, weight[e]))
        return torch.cat(out, dim=0)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = [], []
        for e, (x_e, g_e) in enumerate(zip(torch.split(x, ctx.sizes, dim=0), torch.split(grad_out, ctx.sizes, dim=0))):
            grad_x.append(g_e @ weight[e])
            grad_w.append(g_e.t() @ x_e)
        return torch.cat(grad_x, dim=0), None, torch.stack(grad_w, dim=0)


class FunctionExperts(nn.Module):
    """SwiGLU experts, weights (E, out, in), every projection through ``ParallelLinear``."""

    def __init__(self, dim=16, hidden_dim=32, num_experts=4):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden_dim) / hidden_dim**0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) / dim**0.5)

    def forward(self, x, num_tokens_per_expert):
        h = F.silu(ParallelLinear.apply(x, num_tokens_per_expert, self.w1))
        h = h * ParallelLinear.apply(x, num_tokens_per_expert, self.w3)
        return ParallelLinear.apply(h, num_tokens_per_expert, self.w2)


class FusedFunctionExperts(nn.Module):
    """One fused (E, 2F, D) [gate | up] weight through the Function, chunked; the down projection (E, D, F) applied
    by the experts' own split loop: both spellings in one module."""

    def __init__(self, dim=16, hidden_dim=32, num_experts=4):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(num_experts, 2 * hidden_dim, dim) / dim**0.5)
        self.down = nn.Parameter(torch.randn(num_experts, dim, hidden_dim) / hidden_dim**0.5)

    def forward(self, x, counts):
        gate, up = ParallelLinear.apply(x, counts, self.gate_up).chunk(2, dim=-1)
        h = F.silu(gate) * up
        out = []
        for e, h_e in enumerate(torch.split(h, counts.tolist(), dim=0)):
            out.append(torch.matmul(h_e, self.down[e].transpose(-2, -1)))
        return torch.cat(out, dim=0)


class FunctionMoE(TitanMoE):
    """torchtitan's routing around experts of ``experts_cls``."""

    def __init__(self, experts_cls=FunctionExperts, *, hidden=16, ffn=32, num_experts=4, top_k=2):
        super().__init__(hidden=hidden, ffn=ffn, num_experts=num_experts, top_k=top_k)
        self.experts = experts_cls(hidden, ffn, num_experts)


# ---------------------------------------------------------------------------------------------
# One-edit twins: each must be refused (a proof that accepted one could compute something else on a slice)
# ---------------------------------------------------------------------------------------------


class ScaledBackward(ParallelLinear):
    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = [], []
        for e, (x_e, g_e) in enumerate(zip(torch.split(x, ctx.sizes, dim=0), torch.split(grad_out, ctx.sizes, dim=0))):
            grad_x.append(2.0 * (g_e @ weight[e]))  # the edit: the rows' gradient scaled
            grad_w.append(g_e.t() @ x_e)
        return torch.cat(grad_x, dim=0), None, torch.stack(grad_w, dim=0)


class NextExpertForward(ParallelLinear):
    @staticmethod
    def forward(ctx, x, counts, weight):
        sizes = counts.tolist()
        ctx.save_for_backward(x, weight)
        ctx.sizes = sizes
        out = []
        for e, x_e in enumerate(torch.split(x, sizes, dim=0)):
            out.append(F.linear(x_e, weight[e + 1]))  # the edit: the next expert's weight
        return torch.cat(out, dim=0)


class NextExpertBackward(ParallelLinear):
    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = [], []
        for e, (x_e, g_e) in enumerate(zip(torch.split(x, ctx.sizes, dim=0), torch.split(grad_out, ctx.sizes, dim=0))):
            grad_x.append(g_e @ weight[e + 1])  # the edit
            grad_w.append(g_e.t() @ x_e)
        return torch.cat(grad_x, dim=0), None, torch.stack(grad_w, dim=0)


class AveragedWeightGrad(ParallelLinear):
    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = [], []
        for e, (x_e, g_e) in enumerate(zip(torch.split(x, ctx.sizes, dim=0), torch.split(grad_out, ctx.sizes, dim=0))):
            grad_x.append(g_e @ weight[e])
            grad_w.append(g_e.t() @ x_e)
        return torch.cat(grad_x, dim=0), None, torch.stack(grad_w, dim=0) / weight.shape[0]  # the edit


class NoWeightGradOrder(ParallelLinear):
    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = [], []
        for e, (x_e, g_e) in enumerate(zip(torch.split(x, ctx.sizes, dim=0), torch.split(grad_out, ctx.sizes, dim=0))):
            grad_x.append(g_e @ weight[e])
            grad_w.append(g_e.t() @ x_e)
        return torch.stack(grad_w, dim=0), None, torch.cat(grad_x, dim=0)  # the edit: gradients swapped


class WithSetupContext(ParallelLinear):
    @staticmethod
    def setup_context(ctx, inputs, output):  # the edit: torch would call this, the proof reads forward alone
        pass


class OnceDifferentiable(ParallelLinear):
    @staticmethod
    @once_differentiable  # the edit: a decorator the proof does not read
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = [], []
        for e, (x_e, g_e) in enumerate(zip(torch.split(x, ctx.sizes, dim=0), torch.split(grad_out, ctx.sizes, dim=0))):
            grad_x.append(g_e @ weight[e])
            grad_w.append(g_e.t() @ x_e)
        return torch.cat(grad_x, dim=0), None, torch.stack(grad_w, dim=0)


TWIN_FUNCTIONS = {
    "scaled_backward": ScaledBackward,
    "next_expert_forward": NextExpertForward,
    "next_expert_backward": NextExpertBackward,
    "averaged_weight_grad": AveragedWeightGrad,
    "swapped_grads": NoWeightGradOrder,
    "setup_context": WithSetupContext,
    "once_differentiable": OnceDifferentiable,
}


class MixedExperts(FunctionExperts):
    """The gate weight applied through the Function and by the experts' own matmul: one weight, two ways."""

    def forward(self, x, num_tokens_per_expert):
        h = F.silu(ParallelLinear.apply(x, num_tokens_per_expert, self.w1))
        h = h * ParallelLinear.apply(x, num_tokens_per_expert, self.w3)
        out = []
        for e, h_e in enumerate(torch.split(h, num_tokens_per_expert.tolist(), dim=0)):
            out.append(h_e @ self.w1[e])
        return torch.cat(out, dim=0)


def twin_experts(fn: type) -> type:
    """``FunctionExperts`` applying ``fn`` (a twin) to its gate weight, ``ParallelLinear`` elsewhere."""

    class TwinExperts(FunctionExperts):
        def forward(self, x, num_tokens_per_expert):
            h = F.silu(fn.apply(x, num_tokens_per_expert, self.w1))
            h = h * ParallelLinear.apply(x, num_tokens_per_expert, self.w3)
            return ParallelLinear.apply(h, num_tokens_per_expert, self.w2)

    TwinExperts.__qualname__ = f"TwinExperts[{fn.__name__}]"
    return TwinExperts


# ---------------------------------------------------------------------------------------------
# An experts container holding one parameter of its own beside its 3-D expert weights
# ---------------------------------------------------------------------------------------------


class LayerScaleExperts(nn.Module):
    """torchtitan's grouped experts with a learned per-feature output scale of the container's own (LayerScale,
    the CaiT / DINOv2 idiom): the one parameter that is not an expert's, dense under EP."""

    def __init__(self, dim=16, hidden_dim=32, num_experts=4):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden_dim) / hidden_dim**0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) / dim**0.5)
        self.gamma = nn.Parameter(1.0 + 0.5 * torch.randn(dim))

    def forward(self, x, num_tokens_per_expert):
        out = []
        for expert_idx, x_expert in enumerate(torch.split(x, num_tokens_per_expert.tolist(), dim=0)):
            h = F.silu(torch.matmul(x_expert, self.w1[expert_idx].transpose(-2, -1)))
            h = h * torch.matmul(x_expert, self.w3[expert_idx].transpose(-2, -1))
            out.append(torch.matmul(h, self.w2[expert_idx].transpose(-2, -1)))
        return torch.cat(out, dim=0) * self.gamma


class FirstFeatureScaleExperts(LayerScaleExperts):
    """One-edit twin: every row scaled by the scale's first entry (a number the proof does not read)."""

    def forward(self, x, num_tokens_per_expert):
        out = []
        for expert_idx, x_expert in enumerate(torch.split(x, num_tokens_per_expert.tolist(), dim=0)):
            h = F.silu(torch.matmul(x_expert, self.w1[expert_idx].transpose(-2, -1)))
            h = h * torch.matmul(x_expert, self.w3[expert_idx].transpose(-2, -1))
            out.append(torch.matmul(h, self.w2[expert_idx].transpose(-2, -1)))
        return torch.cat(out, dim=0) * self.gamma[0]


class ExpertWeightScaleExperts(LayerScaleExperts):
    """One-edit twin: the output times an expert weight (3-D, per expert), not a scale of the container's own."""

    def forward(self, x, num_tokens_per_expert):
        out = []
        for expert_idx, x_expert in enumerate(torch.split(x, num_tokens_per_expert.tolist(), dim=0)):
            h = F.silu(torch.matmul(x_expert, self.w1[expert_idx].transpose(-2, -1)))
            h = h * torch.matmul(x_expert, self.w3[expert_idx].transpose(-2, -1))
            out.append(torch.matmul(h, self.w2[expert_idx].transpose(-2, -1)))
        return torch.cat(out, dim=0) * self.w2


class UnusedScaleExperts(LayerScaleExperts):
    """One-edit twin: the scale held but never applied (who updates it is not the experts' business: refused)."""

    def forward(self, x, num_tokens_per_expert):
        out = []
        for expert_idx, x_expert in enumerate(torch.split(x, num_tokens_per_expert.tolist(), dim=0)):
            h = F.silu(torch.matmul(x_expert, self.w1[expert_idx].transpose(-2, -1)))
            h = h * torch.matmul(x_expert, self.w3[expert_idx].transpose(-2, -1))
            out.append(torch.matmul(h, self.w2[expert_idx].transpose(-2, -1)))
        return torch.cat(out, dim=0)


# ---------------------------------------------------------------------------------------------
# The Function one module down: JetMoE / ScatterMoE's ``ParallelExperts`` submodules of the experts
# ---------------------------------------------------------------------------------------------


class ParallelExperts(nn.Module):
    """One grouped linear map, weight (E, out, in), applied through ``ParallelLinear``."""

    def __init__(self, num_experts, input_size, output_size):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_experts, output_size, input_size) / input_size**0.5)

    def forward(self, inputs, expert_size):
        return ParallelLinear.apply(inputs, expert_size, self.weight)


class ParallelExpertsMLP(nn.Module):
    """JetMoE's MoE MLP shape: a fused [gate | up] ``input_linear``, GLU, ``output_linear``."""

    def __init__(self, dim=16, hidden_dim=32, num_experts=4):
        super().__init__()
        self.input_linear = ParallelExperts(num_experts, dim, 2 * hidden_dim)
        self.output_linear = ParallelExperts(num_experts, hidden_dim, dim)

    def forward(self, x, expert_size):
        gate, up = self.input_linear(x, expert_size).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up, expert_size)
