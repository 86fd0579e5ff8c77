"""Blocks and run-time state for the live-state tests (issue 17): what a user's model carries besides its
classes' source. Each builder returns a fresh seeded block; each ``with_*`` changes one thing about it.
Kept in a module of its own so gloo workers import them by name (tests/runtime/test_live_state.py)."""
from __future__ import annotations

import blocks
import torch
import torch.nn.functional as F
from torch import nn

D = 16

# ---------------------------------------------------------------------------------------------
# Blocks whose code reads the experts outside the loop autoep proves (accepted by the region proofs alone)
# ---------------------------------------------------------------------------------------------


def l2_penalty(module: nn.Module) -> torch.Tensor:
    """A module-level function given ``self``: an L2 penalty over every parameter (the experts' among them)."""
    return sum((p * p).sum() for p in module.parameters())


class PenaltyMoE(blocks.MoE):
    """torchtitan-style MoE whose forward adds ``0 * l2_penalty(self)`` (a regulariser wired in for logging)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        top_scores, selected_experts = torch.topk(scores, self.config.top_k, dim=-1)
        top_scores = top_scores.to(x.dtype)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token_idx, slot = torch.where(selected_experts == i)
            if token_idx.numel() == 0:
                continue
            out.index_add_(0, token_idx, expert(x[token_idx]) * top_scores[token_idx, slot, None])
        return out.view(bs, slen, dim) + 0.0 * l2_penalty(self)


class HelperChainMoE(blocks.MoE):
    """forward -> ``self._aux()`` -> ``self._expert_norm()``, which indexes ``self.experts`` (two calls deep)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        top_scores, selected_experts = torch.topk(scores, self.config.top_k, dim=-1)
        top_scores = top_scores.to(x.dtype)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token_idx, slot = torch.where(selected_experts == i)
            if token_idx.numel() == 0:
                continue
            out.index_add_(0, token_idx, expert(x[token_idx]) * top_scores[token_idx, slot, None])
        return out.view(bs, slen, dim) * self._aux()

    def _aux(self) -> torch.Tensor:
        return 1.0 + 0.0 * self._expert_norm()

    def _expert_norm(self) -> torch.Tensor:
        return self.experts[0].w1.weight.norm()


class StateDictMoE(blocks.MoE):
    """forward reads ``self.state_dict()`` through a property (a size log)."""

    @property
    def num_weights(self) -> int:
        return len(self.state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = F.softmax(self.gate(x), dim=1, dtype=torch.float) * (self.num_weights > 0)
        top_scores, selected_experts = torch.topk(scores, self.config.top_k, dim=-1)
        top_scores = top_scores.to(x.dtype)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token_idx, slot = torch.where(selected_experts == i)
            if token_idx.numel() == 0:
                continue
            out.index_add_(0, token_idx, expert(x[token_idx]) * top_scores[token_idx, slot, None])
        return out.view(bs, slen, dim)


def moe(cls=blocks.MoE) -> nn.Module:
    torch.manual_seed(0)
    return cls(hidden=D, num_experts=4, top_k=2)


def mixtral() -> nn.Module:
    torch.manual_seed(0)
    return blocks.MixtralStyleSparseMoeBlock(hidden=D, num_experts=4, top_k=2)


def qwen2_shared() -> nn.Module:
    """Qwen2-MoE-style block whose shared expert has the routed experts' intermediate size (so weights can tie)."""
    torch.manual_seed(0)
    return blocks.Qwen2MoeStyleSparseMoeBlock(hidden=D, num_experts=4, top_k=2, shared_ffn=32)


def qwen3() -> nn.Module:
    """transformers' Qwen3-MoE block (batched 3-D expert parameters, experts call ``F.linear``)."""
    from test_parity_hf import build_tiny_lm

    return build_tiny_lm("qwen3_moe").model.layers[0].mlp


# ---------------------------------------------------------------------------------------------
# Run-time state on the expert parameters
# ---------------------------------------------------------------------------------------------


class FakeQuantWeight(torch.Tensor):
    """torchao-style QAT weight: ``F.linear`` sees it rounded to a 1/8 grid (straight-through gradient)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w, *rest = args
            w = w.as_subclass(torch.Tensor)
            w = w + (torch.round(w * 8) / 8 - w).detach()
            x = x.as_subclass(torch.Tensor) if isinstance(x, cls) else x
            return F.linear(x, w, *rest, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)


def with_fake_quant(block: nn.Module) -> str:
    """Every expert's first projection a fake-quant weight; returns one's name."""
    for expert in block.experts:
        lin = expert.w1 if hasattr(expert, "w1") else expert.gate_proj
        lin.weight = nn.Parameter(lin.weight.detach().clone().as_subclass(FakeQuantWeight))
    return "experts.0.w1.weight" if hasattr(block.experts[0], "w1") else "experts.0.gate_proj.weight"


def with_grad_hook(block: nn.Module) -> str:
    """A gradient hook doubling one expert weight's gradient (``p.register_hook``)."""
    block.experts[1].w3.weight.register_hook(lambda g: g * 2)
    return "experts.1.w3.weight"


def with_post_accumulate_hook(block: nn.Module, seen: list) -> str:
    """torchtune's optimizer-in-backward: a post-accumulate hook steps (here: records) the parameter."""
    p = block.experts.gate_up_proj
    p.register_post_accumulate_grad_hook(lambda param: seen.append(param))
    return "experts.gate_up_proj"


def renorm_experts(module: nn.Module, args) -> None:
    """A forward pre-hook on the block: renorm every expert weight (max-norm constraint)."""
    with torch.no_grad():
        for p in module.experts.parameters():
            p.copy_(torch.renorm(p, 2, 0, 1.0))
