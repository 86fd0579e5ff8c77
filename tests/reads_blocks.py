"""Blocks for "reads, not reachability" (issue 31 item 5), in the idioms that were refused for what their helpers
could reach rather than what they read: a tensor library on the routing path (``einops.reduce``, whose backend
lookup reads ``sys.modules``), a logging helper that sums a module's parameters when given one, and a framework
layer (Megatron's ``ColumnParallelLinear`` idiom) whose ``raise`` guards a configuration the model never takes;
and their one-edit harmful twins (the helper given ``self``; the layer built without its weight).

``einops`` is optional (``reduce`` is None without it; tests using it skip).
"""
from __future__ import annotations

import blocks
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from einops import reduce
except ImportError:  # the tests that use it importorskip einops
    reduce = None

D, FF = 16, 32


def total(value) -> torch.Tensor:
    """A logging helper: a tensor's sum, or the sum of every parameter of a module it is given."""
    if isinstance(value, nn.Module):
        return sum(p.sum() for p in value.parameters())
    return value.sum()




class EinopsRoutingMoE(blocks.MoE):
    """torchtitan-style routing whose top-k weights are renormalised with ``einops.reduce``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        top_scores, selected_experts = torch.topk(scores, self.config.top_k, dim=-1)
        top_scores = (top_scores / reduce(top_scores, "t k -> t 1", "sum")).to(x.dtype)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token_idx, slot = torch.where(selected_experts == i)
            out.index_add_(0, token_idx, expert(x[token_idx]) * top_scores[token_idx, slot, None])
        return out.view(bs, slen, dim)


class LoggedScoresMoE(blocks.MoE):
    """Adds ``0 * total(scores)`` (a value logged through a generic helper): the helper gets the routing's tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        top_scores, selected_experts = torch.topk(scores, self.config.top_k, dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token_idx, slot = torch.where(selected_experts == i)
            out.index_add_(0, token_idx, expert(x[token_idx]) * top_scores[token_idx, slot, None].to(x.dtype))
        return out.view(bs, slen, dim) + 0 * total(scores)


class LoggedSelfMoE(blocks.MoE):
    """The harmful twin: ``total(self)`` sums every parameter, the experts' (stand-ins on other ranks) among them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        top_scores, selected_experts = torch.topk(scores, self.config.top_k, dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token_idx, slot = torch.where(selected_experts == i)
            out.index_add_(0, token_idx, expert(x[token_idx]) * top_scores[token_idx, slot, None].to(x.dtype))
        return out.view(bs, slen, dim) + 0 * total(self)


class FrameworkLinear(nn.Module):
    """A framework's linear layer (Megatron's ``ColumnParallelLinear`` idiom): the weight may be supplied per call;
    one built without its weight (``skip_weight_param_allocation``) raises where none is supplied."""

    def __init__(self, input_size: int, output_size: int, skip_weight_param_allocation: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = nn.Parameter(torch.randn(output_size, input_size) / input_size ** 0.5)
        self.bias = nn.Parameter(torch.randn(output_size) * 0.1)

    def forward(self, input_, weight=None):
        if weight is None:
            if self.weight is None:
                raise RuntimeError("weight was not supplied to FrameworkLinear forward pass and "
                                   "skip_weight_param_allocation is True.")
            weight = self.weight
        else:
            expected_shape = (self.output_size, self.input_size)
            if weight.shape != expected_shape:
                raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, not {expected_shape} as "
                                   "expected")
        return F.linear(input_, weight, self.bias)


class FrameworkExpert(nn.Module):
    def __init__(self, skip_weight_param_allocation: bool = False):
        super().__init__()
        self.fc1 = FrameworkLinear(D, FF, skip_weight_param_allocation)
        self.fc2 = FrameworkLinear(FF, D)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def framework_moe(skip_weight_param_allocation: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return blocks.ExpertListMoE([FrameworkExpert(skip_weight_param_allocation) for _ in range(4)], hidden=D)


def moe(cls) -> nn.Module:
    torch.manual_seed(0)
    return cls(hidden=D, ffn=FF, num_experts=4, top_k=2)
