"""A research-style MoE language model of the user's own (not from transformers).

torchtitan-like spelling: ``w1``/``w2``/``w3`` SwiGLU experts in a ModuleList, a bare ``nn.Linear``
gate, ``top_k`` on the block, softmax -> top-k -> renormalise. autoep has never seen this class:
``local_compute_fn: auto`` proves its structure from the source below.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList([FeedForward(dim, hidden_dim) for _ in range(num_experts)])

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None].to(x.dtype))
        return out.reshape(shape)


class Layer(nn.Module):
    def __init__(self, dim, hidden_dim, num_experts, top_k):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim)
        self.mix = nn.Linear(dim, dim, bias=False)  # a stand-in for attention: the example is about the MoE
        self.norm2 = nn.RMSNorm(dim)
        self.moe = SparseMoE(dim, hidden_dim, num_experts, top_k)

    def forward(self, h):
        h = h + self.mix(self.norm1(h))
        return h + self.moe(self.norm2(h))


class TinyMoELM(nn.Module):
    def __init__(self, vocab_size=64, dim=32, hidden_dim=64, num_layers=2, num_experts=4, top_k=2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList([Layer(dim, hidden_dim, num_experts, top_k) for _ in range(num_layers)])
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))
