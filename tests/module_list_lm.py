"""A tiny causal LM whose MoE blocks are v4-style (``tests/blocks.py`` ``MixtralStyleSparseMoeBlock``: bare
linear gate, routing in the block forward, ModuleList experts), built by the trainer from a ``_target_``
model config (``model_config()``). Module names follow transformers: ``model.layers.{i}.mlp``."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from blocks import MixtralStyleSparseMoeBlock
from torch import nn


class Layer(nn.Module):
    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = MixtralStyleSparseMoeBlock(hidden=hidden, ffn=ffn, num_experts=num_experts, top_k=top_k)

    def forward(self, x):
        return x + self.mlp(self.norm(x))[0]


class ModuleListLM(nn.Module):
    """Embedding, a causal running mean (the only token mixing), MoE layers, LM head; returns logits."""

    def __init__(self, vocab_size=64, hidden=16, ffn=32, num_experts=4, top_k=2, num_layers=2):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab_size)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab_size, hidden)
        self.model.layers = nn.ModuleList(Layer(hidden, ffn, num_experts, top_k) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, input_ids, use_cache=False):
        x = self.model.embed_tokens(input_ids)
        x = x + x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device).view(1, -1, 1)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(x)


class PlainDictLayer(nn.Module):
    """A layer whose MoE block holds its experts in a plain dict attribute (``replay_blocks.PlainDictMoE``)."""

    def __init__(self):
        super().__init__()
        from replay_blocks import D, PlainDictMoE

        self.norm = nn.LayerNorm(D)
        self.mlp = PlainDictMoE()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def plain_dict_lm() -> ModuleListLM:
    """``ModuleListLM`` at ``replay_blocks.D`` wide whose layers are ``PlainDictLayer``s (run by replay)."""
    from replay_blocks import D

    model = ModuleListLM(hidden=D)
    model.model.layers = nn.ModuleList(PlainDictLayer() for _ in range(2))
    return model


def model_config() -> dict:
    return {"_target_": "module_list_lm.ModuleListLM", "vocab_size": 64, "hidden": 16, "ffn": 32, "num_experts": 4,
            "top_k": 2, "num_layers": 2}
