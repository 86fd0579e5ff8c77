"""A tiny causal LM whose MoE blocks call grouped experts ``experts(x_sorted, num_tokens_per_expert)``
(``tests/blocks.py``: torchtitan's padded spelling or the Aria-style layer with nested grouped-GEMM modules;
``tests/function_blocks.py``: experts applying their weights through their own autograd Function, or holding a
LayerScale of their own),
built by the trainer from a ``_target_`` model config (``model_config(kind)``). Module names follow
transformers: ``model.layers.{i}.mlp``."""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from blocks import AriaStyleMoELayer, TitanPaddedMoE
from function_blocks import FunctionMoE, LayerScaleExperts
from torch import nn

BLOCKS = {"titan_padded": TitanPaddedMoE, "aria_style": AriaStyleMoELayer, "own_function": FunctionMoE,
          "layer_scale": functools.partial(FunctionMoE, LayerScaleExperts)}


class Layer(nn.Module):
    def __init__(self, kind: str, hidden: int, ffn: int, num_experts: int, top_k: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = BLOCKS[kind](hidden=hidden, ffn=ffn, num_experts=num_experts, top_k=top_k)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class GroupedLM(nn.Module):
    """Embedding, a causal running mean (the only token mixing), MoE layers, LM head; returns logits."""

    def __init__(self, kind="aria_style", vocab_size=64, hidden=16, ffn=32, num_experts=4, top_k=2, num_layers=2):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab_size)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab_size, hidden)
        self.model.layers = nn.ModuleList(Layer(kind, hidden, ffn, num_experts, top_k) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, input_ids, use_cache=False):
        x = self.model.embed_tokens(input_ids)
        x = x + x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device).view(1, -1, 1)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(x)


def model_config(kind: str) -> dict:
    return {"_target_": "grouped_lm.GroupedLM", "kind": kind, "vocab_size": 64, "hidden": 16, "ffn": 32,
            "num_experts": 4, "top_k": 2, "num_layers": 2}
