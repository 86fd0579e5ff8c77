"""MoE blocks whose experts are 3-D weights on the block itself (issue 31 item 3, ``autoep.detect.block_weights``),
applied inside the block's own routing loop, each with one-edit harmful twins that must be refused:

- ``BlockWeightsMoE``: ``w1 (E, D, F)``, ``w2 (E, F, D)``; ``F.silu(x[tok] @ self.w1[i]) @ self.w2[i]`` into
  ``index_add_`` with the routing weight (research code's spelling); it counts its calls and keeps the last expert's
  output in an attribute (``visible_state()``).
- ``SwiGLUWeightsMoE``: three weights, ``torch.matmul``, ``F.linear(x[idx], self.w1[i])`` and ``F.linear(x[idx],
  self.w3[i].t())``, the rows read twice
  (``x[idx]`` in the gate and in the up), the loop over the hit experts (``selected.unique().tolist()``), ``out[idx]
  +=``; a per-expert bias ``b2 (E, D)`` (2-D: not an expert weight; dense, added where the token is).
- ``EinsumWeightsMoE``: both projections by ``torch.einsum``.
- ``MethodWeightsMoE``: the block calls ``self._expert(i, x[tok])``, a method taking the expert id, in a loop over
  ``range(self.w1.shape[0])`` (the weight's metadata), skipping experts no token picked.
- ``ChildWeightsMoE``: the weights in an ``experts`` child that also holds a dense per-feature scale of its own
  (``gamma``, used by the block after the loop), a constant and an activation module; the block never calls it.

- ``IdleExpertMoE``: no token picks the last expert; its owner (at 4 ranks) gets no rows, and its slices still get
  the zero gradient the model's one tensor gives them.

Twins (``TWINS``): ``self.w1[i + 1]`` (another expert's weight), ``self.w2[i].sum(1)`` (a weight reduced, not applied
to rows), ``x @ self.w1[i]`` on every row (rows the routing did not pick), ``self.w1.mean(0)`` read outside the loop
(an auxiliary penalty), ``.softmax(0)`` between the two projections (mixes the expert's rows), and the method called
with the rows of every token, every
parameter of the weights' child read whole (``self.experts.parameters()``), and one expression slicing its two
weights by two loops' ids, a weight read by name
(``getattr(self, "w1")[i]``), an einsum summing the routed rows (``"td,df->f"``).

Every block takes ``(batch, seq, hidden)`` and returns the same shape.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from replay_blocks import FF, D, E, K, _top_k


def _weight(*shape) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) / shape[-2] ** 0.5)


class BlockWeightsMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = _weight(E, D, FF)
        self.w2 = _weight(E, FF, D)
        self.calls, self.last_expert_out = 0, None

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        out = torch.zeros_like(x)
        self.calls += 1
        for i in range(E):
            tok, slot = torch.where(selected == i)
            h = F.silu(x[tok] @ self.w1[i]) @ self.w2[i]
            self.last_expert_out = h  # kept by the block: a pending value during the forward, real after
            out.index_add_(0, tok, h * weights[tok, slot, None])
        return out.reshape(hidden_states.shape)

    def visible_state(self) -> dict:
        return {"calls": self.calls, "last_expert_out": self.last_expert_out}


class SwiGLUWeightsMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.w1 = _weight(E, FF, D)  # (out, in), as F.linear takes it transposed below
        self.w3 = _weight(E, D, FF)  # (in, out): applied as F.linear(x, w3[i].t())
        self.w2 = _weight(E, FF, D)
        self.b2 = nn.Parameter(torch.randn(E, D) * 0.1)

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        out = x.new_zeros(x.shape)
        for i in selected.unique().tolist():
            idx, k = torch.where(selected == i)
            y = torch.matmul(F.silu(F.linear(x[idx], self.w1[i])) * F.linear(x[idx], self.w3[i].t()), self.w2[i]) \
                + self.b2[i]
            out[idx] += y * weights[idx, k].unsqueeze(-1)
        return out.reshape(hidden_states.shape)


class MethodWeightsMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = _weight(E, D, FF)
        self.w2 = _weight(E, FF, D)

    def _expert(self, i, h):
        h = F.gelu(h @ self.w1[i])
        return h @ self.w2[i]

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        out = torch.zeros_like(x)
        for i in range(self.w1.shape[0]):
            tok, slot = torch.where(selected == i)
            if tok.numel() == 0:
                continue
            out.index_add_(0, tok, self._expert(i, x[tok]) * weights[tok, slot, None])
        return out.reshape(hidden_states.shape)


class EinsumWeightsMoE(BlockWeightsMoE):
    """The same weights applied by ``torch.einsum``, the loop variable ``e``, ``F.gelu`` with a constant argument."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        out = torch.zeros_like(x)
        for e in range(E):
            rows, k = torch.where(selected == e)
            h = torch.einsum("tf,fd->td", F.gelu(torch.einsum("td,df->tf", x[rows], self.w1[e]), approximate="tanh"),
                             self.w2[e])
            out.index_add_(0, rows, h * weights[rows, k, None])
        return out.reshape(hidden_states.shape)


class _ExpertWeights(nn.Module):
    """The weights, a dense scale of its own, a constant and an activation; never called."""

    def __init__(self):
        super().__init__()
        self.w1 = _weight(E, D, FF)
        self.w2 = _weight(E, FF, D)
        self.gamma = nn.Parameter(torch.rand(D) + 0.5)
        self.num_experts = E
        self.act = nn.SiLU()


class ChildWeightsMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = _ExpertWeights()

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        out = torch.zeros_like(x)
        for i in range(self.experts.num_experts):
            tok, slot = torch.where(selected == i)
            h = self.experts.act(x[tok] @ self.experts.w1[i])
            out.index_add_(0, tok, (h @ self.experts.w2[i]) * weights[tok, slot, None])
        return (out * self.experts.gamma).reshape(hidden_states.shape)


class IdleExpertMoE(BlockWeightsMoE):
    """No token ever picks the last expert (``selected % (E - 1)``) and the loop visits the experts hit only: the
    last one's slice of each weight gets a zero gradient in the model (one tensor), which its owner must give it too
    (at 4 ranks, an owner no rank calls)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        selected = selected % (E - 1)
        out = torch.zeros_like(x)
        for i in selected.unique().tolist():  # the experts hit: the last one is never called
            tok, slot = torch.where(selected == i)
            h = F.silu(x[tok] @ self.w1[i]) @ self.w2[i]
            out.index_add_(0, tok, h * weights[tok, slot, None])
        return out.reshape(hidden_states.shape)


# ---------------------------------------------------------------------------------------------------------------
# Harmful twins: one edit each
# ---------------------------------------------------------------------------------------------------------------


class NextExpertTwin(BlockWeightsMoE):
    """Edit: ``self.w2[i + 1]`` (another expert's weight; wraps with ``% E``)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        out = torch.zeros_like(x)
        for i in range(E):
            tok, slot = torch.where(selected == i)
            h = F.silu(x[tok] @ self.w1[i]) @ self.w2[(i + 1) % E]
            out.index_add_(0, tok, h * weights[tok, slot, None])
        return out.reshape(hidden_states.shape)


class SummedWeightTwin(BlockWeightsMoE):
    """Edit: ``self.w2[i].sum(1)``: the weight reduced, added to every routed row (not applied to the rows)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        out = torch.zeros_like(x)
        for i in range(E):
            tok, slot = torch.where(selected == i)
            h = F.silu(x[tok] @ self.w1[i]) + self.w2[i].sum(1)
            out.index_add_(0, tok, h[:, :D] * weights[tok, slot, None])
        return out.reshape(hidden_states.shape)


class AllRowsTwin(BlockWeightsMoE):
    """Edit: ``x @ self.w1[i]`` on every row, the routed rows picked after."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        out = torch.zeros_like(x)
        for i in range(E):
            tok, slot = torch.where(selected == i)
            h = (F.silu(x @ self.w1[i]) @ self.w2[i])[tok]
            out.index_add_(0, tok, h * weights[tok, slot, None])
        return out.reshape(hidden_states.shape)


class MeanPenaltyTwin(BlockWeightsMoE):
    """Edit: an auxiliary term ``self.w1.mean(0)`` read outside the loop (every expert's weight)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        out = torch.zeros_like(x)
        for i in range(E):
            tok, slot = torch.where(selected == i)
            h = F.silu(x[tok] @ self.w1[i]) @ self.w2[i]
            out.index_add_(0, tok, h * weights[tok, slot, None])
        out = out + (x @ self.w1.mean(0)).sum(-1, keepdim=True) * 0.01
        return out.reshape(hidden_states.shape)


class SoftmaxRowsTwin(BlockWeightsMoE):
    """Edit: ``.softmax(0)`` between the projections: each routed row's hidden mixes every other routed row's."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        out = torch.zeros_like(x)
        for i in range(E):
            tok, slot = torch.where(selected == i)
            h = (x[tok] @ self.w1[i]).softmax(0) @ self.w2[i]
            out.index_add_(0, tok, h * weights[tok, slot, None])
        return out.reshape(hidden_states.shape)


class EinsumSumTwin(EinsumWeightsMoE):
    """Edit: the einsum drops the rows' label (``"td,df->f"``): every routed row summed."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        out = torch.zeros_like(x)
        for e in range(E):
            rows, k = torch.where(selected == e)
            h = F.gelu(torch.einsum("td,df->f", x[rows], self.w1[e]), approximate="tanh") @ self.w2[e]
            out.index_add_(0, rows, h * weights[rows, k, None])
        return out.reshape(hidden_states.shape)


class MethodAllRowsTwin(MethodWeightsMoE):
    """Edit: the expert method called on every row."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        out = torch.zeros_like(x)
        for i in range(E):
            tok, slot = torch.where(selected == i)
            out.index_add_(0, tok, self._expert(i, x)[tok] * weights[tok, slot, None])
        return out.reshape(hidden_states.shape)


class ChildParametersTwin(ChildWeightsMoE):
    """Edit: an auxiliary term over ``self.experts.parameters()`` (every expert's weight, read whole)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        out = torch.zeros_like(x)
        for i in range(self.experts.num_experts):
            tok, slot = torch.where(selected == i)
            h = self.experts.act(x[tok] @ self.experts.w1[i])
            out.index_add_(0, tok, (h @ self.experts.w2[i]) * weights[tok, slot, None])
        penalty = sum(p.pow(2).sum() for p in self.experts.parameters())
        return (out * self.experts.gamma).reshape(hidden_states.shape) + penalty * 1e-3


class TwoIdsTwin(BlockWeightsMoE):
    """Edit: the down projection sliced by another loop's id (an inner loop over every expert)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        out = torch.zeros_like(x)
        for i in range(E):
            tok, slot = torch.where(selected == i)
            for j in range(E):
                h = F.silu(x[tok] @ self.w1[i]) @ self.w2[j]
                out.index_add_(0, tok, h * weights[tok, slot, None] / E)
        return out.reshape(hidden_states.shape)


class ByNameTwin(BlockWeightsMoE):
    """Edit: the up projection read by name, ``getattr(self, "w1")[i]`` (the whole parameter, sliced at the caller)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        out = torch.zeros_like(x)
        for i in range(E):
            tok, slot = torch.where(selected == i)
            h = F.silu(x[tok] @ getattr(self, "w1")[i]) @ self.w2[i]  # noqa: B009 - the twin's edit
            out.index_add_(0, tok, h * weights[tok, slot, None])
        return out.reshape(hidden_states.shape)


BLOCKS = {
    "block_weights": BlockWeightsMoE,
    "swiglu_weights": SwiGLUWeightsMoE,
    "method_weights": MethodWeightsMoE,
    "einsum_weights": EinsumWeightsMoE,
    "child_weights": ChildWeightsMoE,
    "idle_expert": IdleExpertMoE,
}
TWINS = {
    "next_expert": NextExpertTwin,
    "summed_weight": SummedWeightTwin,
    "all_rows": AllRowsTwin,
    "mean_penalty": MeanPenaltyTwin,
    "softmax_rows": SoftmaxRowsTwin,
    "method_all_rows": MethodAllRowsTwin,
    "child_parameters": ChildParametersTwin,
    "two_ids": TwoIdsTwin,
    "by_name": ByNameTwin,
    "einsum_sum": EinsumSumTwin,
}
