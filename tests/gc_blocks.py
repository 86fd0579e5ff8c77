"""Hand-written decoder-layer blocks in transformers 5.x's layer idioms (Gemma-4's), for detection tests and the
soundness fuzzer: a ``GradientCheckpointingLayer`` subclass (its forward wrapped by transformers'
``forward_with_checkpointing``), the forward decorated with ``@deprecate_kwarg``, a dense MLP beside the MoE
branch, the router reading the residual, transformers' own ``Gemma4TextRouter`` and ``Gemma4TextExperts``
(batched experts whose loop skips the padding class ``num_experts``), and the experts call under
``if self.enable_moe_block:``. No attention, so the block runs on hidden states alone."""
from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm, Gemma4TextExperts, Gemma4TextRouter
from transformers.utils.deprecation import deprecate_kwarg


def tiny_config(hidden: int = 16, ffn: int = 24, num_experts: int = 4, top_k: int = 2) -> Gemma4TextConfig:
    return Gemma4TextConfig(hidden_size=hidden, intermediate_size=ffn, moe_intermediate_size=ffn, num_experts=num_experts,
                            top_k_experts=top_k, enable_moe_block=True, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=8, vocab_size=32, layer_types=["full_attention"] * 2)


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.gelu(self.up_proj(x)))


class GemmaStyleMoeLayer(GradientCheckpointingLayer):
    def __init__(self, hidden: int = 16, ffn: int = 24, num_experts: int = 4, top_k: int = 2, enable_moe_block=True):
        super().__init__()
        config = tiny_config(hidden, ffn, num_experts, top_k)
        self.enable_moe_block = enable_moe_block
        self.mlp = DenseMLP(hidden, ffn)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden)
        self.layer_scalar = nn.Buffer(torch.ones(1))
        self.router = Gemma4TextRouter(config)
        self.experts = Gemma4TextExperts(config)
        self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden)
        self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden)
        self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden)
        with torch.no_grad():
            for p in self.experts.parameters():
                p.normal_(0, 0.2)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(self, hidden_states, cache=None, **kwargs):
        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        if self.enable_moe_block:
            hidden_states_1 = self.post_feedforward_layernorm_1(hidden_states)
            hidden_states_flat = residual.reshape(-1, residual.shape[-1])
            _, top_k_weights, top_k_index = self.router(hidden_states_flat)
            hidden_states_2 = self.pre_feedforward_layernorm_2(hidden_states_flat)
            hidden_states_2 = self.experts(hidden_states_2, top_k_index, top_k_weights)
            hidden_states_2 = hidden_states_2.reshape(residual.shape)
            hidden_states_2 = self.post_feedforward_layernorm_2(hidden_states_2)
            hidden_states = hidden_states_1 + hidden_states_2
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        hidden_states *= self.layer_scalar
        return hidden_states


def passthrough(fn):
    """A decorator autoep does not know (it returns the function itself: no wrapper to see at run time)."""
    return fn


class UnknownDecoratorLayer(GemmaStyleMoeLayer):
    @passthrough
    def forward(self, hidden_states, cache=None, **kwargs):
        residual = hidden_states
        hidden_states = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        flat = residual.reshape(-1, residual.shape[-1])
        _, top_k_weights, top_k_index = self.router(flat)
        out = self.experts(self.pre_feedforward_layernorm_2(flat), top_k_index, top_k_weights)
        return residual + hidden_states + out.reshape(residual.shape)


class ElseBranchLayer(GemmaStyleMoeLayer):
    """The experts call in the ``else`` of a flag: taken only where the flag is off, not folded."""

    def forward(self, hidden_states, cache=None, **kwargs):
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        if self.enable_moe_block:
            out = flat
        else:
            _, top_k_weights, top_k_index = self.router(flat)
            out = self.experts(flat, top_k_index, top_k_weights)
        return out.reshape(hidden_states.shape)
