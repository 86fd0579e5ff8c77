"""MoE blocks whose dispatch loop no fast-path spec reads, written in the idioms of real code (list
comprehensions over experts, ``zip(chunks, experts)``, DeepSeek's sorted-token ``vstack`` loop, Switch-style
masked assignment through a cast, an outer loop over batch rows, a config-flag branch, an experts container
with its own forward and an optional argument, experts nested under another module, a plain dict of expert
modules and a plain list of them, expert-choice routing, capacity dropping, every expert on the whole N-D tensor),
blocks that edit their input in place (``INPUT_EDITS``: Switch's router jitter, a residual scaled in place), and
their harmful one-edit twins.

Every block takes ``(batch, seq, hidden)`` and returns the same shape; experts are biased GELU MLPs (row-local,
not the SwiGLU fast path). ``BLOCKS`` and ``TWINS`` map a case name to a builder.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

D, FF, E, K = 8, 16, 4, 2


class FeedForward(nn.Module):
    """A fairseq-style expert: fc2(gelu(fc1(x)))."""

    def __init__(self, dim: int = D, hidden: int = FF):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _top_k(gate: nn.Module, x: torch.Tensor, k: int):
    probs = F.softmax(gate(x), dim=-1, dtype=torch.float32)
    weights, selected = torch.topk(probs, k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), selected


class ComprehensionMoE(nn.Module):
    """Experts indexed in a list comprehension, then combined per token (mistral-inference-like)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([FeedForward() for _ in range(E)])

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, selected = _top_k(self.gate, x, K)
        hits = [torch.where(selected == i) for i in range(len(self.experts))]
        outs = [self.experts[i](x[tok]) for i, (tok, _) in enumerate(hits)]
        y = torch.zeros_like(x)
        for (tok, slot), out in zip(hits, outs):
            y.index_add_(0, tok, out * weights[tok, slot, None].to(out.dtype))
        return y.reshape(shape)


class ZipChunksMoE(nn.Module):
    """Tokens sorted by expert, split into per-expert chunks, ``zip(chunks, self.experts)`` (torchtune-like)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([FeedForward() for _ in range(E)])

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        weights, selected = _top_k(self.router, x, K)
        flat = selected.view(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        chunks = x[order // K].split(counts)
        out = torch.cat([expert(chunk) for chunk, expert in zip(chunks, self.experts)])
        combined = torch.zeros(b * s * K, h, dtype=out.dtype, device=x.device)
        combined[order] = out
        combined = (combined.view(-1, K, h) * weights.unsqueeze(-1)).sum(dim=1)
        return combined.view(b, s, h).to(hidden_states.dtype)


class VstackMoE(nn.Module):
    """DeepSeek's sorted-token loop: counts on the host, empty experts skipped, ``torch.vstack`` of outputs."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([FeedForward() for _ in range(E)])

    def forward(self, hidden_states):
        orig = hidden_states.shape
        x = hidden_states.view(-1, orig[-1])
        topk_weight, topk_idx = _top_k(self.gate, x, K)
        cnts = topk_idx.new_zeros((topk_idx.shape[0], len(self.experts)))
        cnts.scatter_(1, topk_idx, 1)
        tokens_per_expert = cnts.sum(dim=0).tolist()
        idxs = topk_idx.view(-1).argsort()
        sorted_tokens = x[idxs // topk_idx.shape[1]]
        outputs, start = [], 0
        for i, num_tokens in enumerate(tokens_per_expert):
            end = start + num_tokens
            if num_tokens == 0:
                continue
            outputs.append(self.experts[i](sorted_tokens[start:end]))
            start = end
        outs = torch.vstack(outputs) if outputs else sorted_tokens.new_empty(0, orig[-1])
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        y = (new_x.view(*topk_idx.shape, orig[-1]) * topk_weight.unsqueeze(-1)).sum(dim=1)
        return y.view(*orig)


class CastMaskedMoE(nn.Module):
    """Top-1 (Switch-like): ``y[idx == i] = expert(x[idx == i]).to(dtype)``, then scaled by the router prob."""

    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleDict({f"expert_{i}": FeedForward() for i in range(E)})

    def forward(self, hidden_states):
        probs = F.softmax(self.classifier(hidden_states), dim=-1)
        prob, idx = probs.max(dim=-1)
        y = hidden_states.clone()
        for i, expert in enumerate(self.experts.values()):
            mask = idx == i
            y[mask] = expert(hidden_states[mask]).to(y.dtype)
        return y * prob.unsqueeze(-1)


class BatchRowsMoE(nn.Module):
    """An outer loop over the batch rows around the expert loop."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([FeedForward() for _ in range(E)])

    def forward(self, x):
        weights, selected = _top_k(self.gate, x, K)
        out = torch.zeros_like(x)
        for b in range(x.shape[0]):
            for e, expert in enumerate(self.experts):
                tok, slot = torch.where(selected[b] == e)
                out[b, tok] += weights[b, tok, slot, None] * expert(x[b, tok])
        return out


@dataclass
class MoeConfig:
    normalize_weights: bool = True
    residual_scale: float = 0.5


class ConfigFlagMoE(nn.Module):
    """A framework's sequential experts: branches on ``self.config.<flag>`` around the routing and the loop."""

    def __init__(self, config: MoeConfig | None = None):
        super().__init__()
        self.config = config or MoeConfig()
        self.gate = nn.Linear(D, E, bias=False)
        self.local_experts = nn.ModuleList([FeedForward() for _ in range(E)])

    def forward(self, hidden_states):
        x = hidden_states.flatten(0, 1)
        logits = self.gate(x)
        weights, selected = torch.topk(logits.softmax(-1), K)
        if self.config.normalize_weights:
            weights = weights / weights.sum(-1, keepdim=True)
        out = x * self.config.residual_scale
        for e in range(len(self.local_experts)):
            rows = (selected == e).nonzero()
            if rows.numel() == 0:
                continue
            out = out.index_add(0, rows[:, 0], self.local_experts[e](x[rows[:, 0]]) * weights[rows[:, 0], rows[:, 1], None])
        return out.view_as(hidden_states)


class OptionalArgExperts(nn.ModuleList):
    """An experts container with its own forward and an optional argument the block never passes."""

    def forward(self, x, selected, weights, is_distributed=None):
        out = torch.zeros_like(x)
        for e, expert in enumerate(self):
            tok, slot = torch.where(selected == e)
            if is_distributed is not None:
                tok = tok[is_distributed[tok]]
            out.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return out


class OptionalArgContainerMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = OptionalArgExperts([FeedForward() for _ in range(E)])

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, selected = _top_k(self.gate, x, K)
        return self.experts(x, selected, weights).reshape(hidden_states.shape)


class ExpertBank(nn.Module):
    """Experts nested under another module, whose forward runs the loop with a list comprehension."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([FeedForward() for _ in range(E)])

    def forward(self, x, weights, selected):
        parts = [(torch.where(selected == e), expert) for e, expert in enumerate(self.experts)]
        return sum(torch.zeros_like(x).index_add(0, tok, expert(x[tok]) * weights[tok, slot, None])
                   for (tok, slot), expert in parts)


class NestedExpertsMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.moe = ExpertBank()
        self.shared = FeedForward()

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, selected = _top_k(self.router, x, K)
        return (self.moe(x, weights, selected) + self.shared(x)).reshape(hidden_states.shape)


class NormedExperts(nn.ModuleDict):
    """NLLB-MoE's container shape: experts under ``expert_{e}`` and, after them, a module of the container's own
    that its forward reads by name (a LayerNorm on each expert's output: dense, with parameters); the experts
    are called in a comprehension (no fast path reads it)."""

    def __init__(self, num_experts: int = E):
        super().__init__({f"expert_{e}": FeedForward() for e in range(num_experts)})
        self.num_experts = num_experts
        self.norm = nn.LayerNorm(D)

    def forward(self, x, selected, weights):
        hits = [torch.where(selected == e) for e in range(self.num_experts)]
        outs = [self.norm(self[f"expert_{e}"](x[tok])) for e, (tok, _) in enumerate(hits)]
        y = torch.zeros_like(x)
        for (tok, slot), out in zip(hits, outs):
            y.index_add_(0, tok, out * weights[tok, slot, None])
        return y


class NamedEntryMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = NormedExperts()

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, selected = _top_k(self.gate, x, K)
        return self.experts(x, selected, weights).reshape(hidden_states.shape)


class PlainDictMoE(nn.Module):
    """Experts registered one by one, and held in a plain dict attribute the forward indexes."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        for i in range(E):
            self.add_module(f"expert_{i}", FeedForward())
        self.expert_by_id = {i: getattr(self, f"expert_{i}") for i in range(E)}

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, selected = _top_k(self.gate, x, K)
        out = torch.zeros_like(x)
        for i, expert in self.expert_by_id.items():
            tok, slot = torch.where(selected == i)
            out.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return out.reshape(hidden_states.shape)


class PlainListMoE(nn.Module):
    """Experts registered one by one, and held in a plain list attribute the forward zips with its chunks."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        for i in range(E):
            setattr(self, f"ffn_{i}", FeedForward())
        self.expert_list = [self.ffn_0, self.ffn_1, self.ffn_2, self.ffn_3]

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, selected = _top_k(self.router, x, K)
        order = selected.flatten().argsort(stable=True)
        counts = torch.bincount(selected.flatten(), minlength=len(self.expert_list)).tolist()
        rows = x.repeat_interleave(K, dim=0)[order]
        outs = [expert(chunk) for chunk, expert in zip(rows.split(counts), self.expert_list)]
        y = torch.empty_like(rows)
        y[order] = torch.cat(outs)
        return (y.view(-1, K, x.shape[-1]) * weights[..., None]).sum(1).reshape(hidden_states.shape)


class ExpertChoiceMoE(nn.Module):
    """Expert choice: each expert takes its top-c tokens of this batch (capacity factor 1)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([FeedForward() for _ in range(E)])

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        scores = self.gate(x).softmax(dim=-1).t()  # (E, T)
        capacity = min(x.shape[0], max(1, x.shape[0] * K // len(self.experts)))
        gates, tokens = scores.topk(capacity, dim=-1) if x.shape[0] else (scores, scores.long())
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out.index_add(0, tokens[e], gates[e, :, None] * expert(x[tokens[e]]))
        return out.reshape(hidden_states.shape)


class CapacityDropMoE(nn.Module):
    """Top-1 with an expert capacity: tokens past it (in token order) are dropped (output zero for them)."""

    def __init__(self, capacity_factor: float = 1.0):
        super().__init__()
        self.capacity_factor = capacity_factor
        self.wg = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([FeedForward() for _ in range(E)])

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        probs = self.wg(x).softmax(-1)
        gate, idx = probs.max(-1)
        one_hot = F.one_hot(idx, len(self.experts))
        position = (one_hot.cumsum(0) - 1) * one_hot
        capacity = int(self.capacity_factor * x.shape[0] / len(self.experts)) + 1
        kept = one_hot * (position < capacity)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = torch.nonzero(kept[:, e]).squeeze(-1)
            out[sel] = gate[sel, None] * expert(x[sel])
        return out.reshape(hidden_states.shape)


class DropoutBetweenCallsMoE(BatchRowsMoE):
    """Random numbers drawn between expert calls (dropout on each expert's output while training): exact
    under replay, which restores the RNG before pass 2 (the same draws as the block's own run)."""

    def forward(self, x):
        weights, selected = _top_k(self.gate, x, K)
        out = torch.zeros_like(x)
        for b in range(x.shape[0]):
            for e, expert in enumerate(self.experts):
                tok, slot = torch.where(selected[b] == e)
                h = F.dropout(expert(x[b, tok]), p=0.25, training=self.training)
                out[b, tok] += weights[b, tok, slot, None] * h
        return out


class LastDimExpert(nn.Module):
    """An expert that reads its input's last dim alone (``dim=-1``, ``[..., a:b]``, ``view(x.shape)``, a
    last-dim norm): the same on a ``(..., D)`` tensor as on its flattened rows (``leading_dims_free``)."""

    def __init__(self, dim: int = D, hidden: int = FF):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        h = self.norm(h) + F.softmax(h, dim=-1)
        h = h - h.sum(-1, keepdim=True) / h.shape[-1]
        h = torch.cat([h[..., FF // 2:], h[..., :FF // 2]], dim=-1) * torch.sigmoid(h[..., :1])
        return self.fc2(h.view(h.shape))


class WholeTensorMoE(nn.Module):
    """Every expert on the whole ``(batch, seq, hidden)`` tensor, weighted per token by a dense softmax gate
    (soft routing; VitPose's masked sum is its 0/1 case): expert calls on N-D tensors, moved as their rows."""

    def __init__(self, expert: type = LastDimExpert):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([expert() for _ in range(E)])

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + probs[..., e:e + 1] * expert(x)
        return out


class FourDimCallsMoE(WholeTensorMoE):
    """Each expert called on a 4-D ``(batch, seq, 1, hidden)`` view; the top expert's output kept per token."""

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        top = probs.argmax(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + (top == e) * probs[..., e:e + 1] * expert(x.unsqueeze(2))[:, :, 0]
        return out


class InPlaceScaledMoE(ComprehensionMoE):
    """The comprehension block scaling each expert's output in place by its weights (``out.mul_(w)``) before
    adding it: the expert's output is the block's own tensor to edit, under replay as in the model."""

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, selected = _top_k(self.gate, x, K)
        hits = [torch.where(selected == i) for i in range(len(self.experts))]
        outs = [self.experts[i](x[tok]) for i, (tok, _) in enumerate(hits)]
        y = torch.zeros_like(x)
        for (tok, slot), out in zip(hits, outs):
            out.mul_(weights[tok, slot, None].to(out.dtype))
            y.index_add_(0, tok, out)
        return y.reshape(shape)


BLOCKS = {
    "comprehension": ComprehensionMoE,
    "in_place_scaled": InPlaceScaledMoE,
    "zip_chunks": ZipChunksMoE,
    "vstack": VstackMoE,
    "cast_masked": CastMaskedMoE,
    "batch_rows": BatchRowsMoE,
    "config_flag": ConfigFlagMoE,
    "optional_arg_container": OptionalArgContainerMoE,
    "nested_experts": NestedExpertsMoE,
    "expert_choice": ExpertChoiceMoE,
    "capacity_drop": CapacityDropMoE,
    "dropout_between_calls": DropoutBetweenCallsMoE,
    "named_entry": NamedEntryMoE,
    "whole_tensor": WholeTensorMoE,
    "four_dim_calls": FourDimCallsMoE,
    "plain_dict": PlainDictMoE,
    "plain_list": PlainListMoE,
}


# ---------------------------------------------------------------------------------------------
# Harmful twins: one edit each
# ---------------------------------------------------------------------------------------------


class ChainedTwin(CastMaskedMoE):
    """Edit: each expert reads ``y`` (holding earlier experts' outputs) instead of the block's input."""

    def forward(self, hidden_states):
        probs = F.softmax(self.classifier(hidden_states), dim=-1)
        prob, idx = probs.max(dim=-1)
        y = hidden_states.clone()
        for i, expert in enumerate(self.experts.values()):
            mask = idx >= i
            y[mask] = expert(y[mask]).to(y.dtype)
        return y * prob.unsqueeze(-1)


class BranchOnOutputTwin(BatchRowsMoE):
    """Edit: the loop stops once an expert's output is nonzero."""

    def forward(self, x):
        weights, selected = _top_k(self.gate, x, K)
        out = torch.zeros_like(x)
        for b in range(x.shape[0]):
            for e, expert in enumerate(self.experts):
                tok, slot = torch.where(selected[b] == e)
                h = expert(x[b, tok])
                out[b, tok] += weights[b, tok, slot, None] * h
                if h.abs().sum() > 0:
                    break
        return out


class CounterMoE(ComprehensionMoE):
    """The forward counts its calls on the instance: pass 1's write is undone, pass 2 counts once."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, hidden_states):
        self.calls += 1
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, selected = _top_k(self.gate, x, K)
        hits = [torch.where(selected == i) for i in range(len(self.experts))]
        outs = [self.experts[i](x[tok]) for i, (tok, _) in enumerate(hits)]
        y = torch.zeros_like(x)
        for (tok, slot), out in zip(hits, outs):
            y.index_add_(0, tok, out * weights[tok, slot, None].to(out.dtype))
        return y.reshape(shape)


class BufferTwin(ComprehensionMoE):
    """Edit: tokens per expert accumulated into a buffer in the forward (torchtitan's load balancing)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("tokens_per_expert", torch.zeros(E), persistent=False)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, selected = _top_k(self.gate, x, K)
        self.tokens_per_expert.add_(torch.bincount(selected.view(-1), minlength=E))
        hits = [torch.where(selected == i) for i in range(len(self.experts))]
        outs = [self.experts[i](x[tok]) for i, (tok, _) in enumerate(hits)]
        y = torch.zeros_like(x)
        for (tok, slot), out in zip(hits, outs):
            y.index_add_(0, tok, out * weights[tok, slot, None].to(out.dtype))
        return y.reshape(shape)


class RngFromOutputTwin(BatchRowsMoE):
    """Edit: a random draw decides whether the next expert runs, with a probability from the last output."""

    def forward(self, x):
        weights, selected = _top_k(self.gate, x, K)
        out = torch.zeros_like(x)
        for b in range(x.shape[0]):
            keep = torch.ones(())
            for e, expert in enumerate(self.experts):
                if torch.bernoulli(keep) == 0:
                    continue
                tok, slot = torch.where(selected[b] == e)
                h = expert(x[b, tok])
                out[b, tok] += weights[b, tok, slot, None] * h
                keep = torch.sigmoid(-100 * h.abs().sum()).detach() * 2 if h.numel() else keep
                keep = keep.clamp(max=1)
        return out


class InputJitterMoE(ComprehensionMoE):
    """Switch's router jitter: while training, the block multiplies its input by uniform noise in place before
    routing. Pass 1 runs on a copy of the input; pass 2 makes the edit, once, on the input itself."""

    def forward(self, hidden_states):
        if self.training:
            hidden_states *= torch.empty_like(hidden_states).uniform_(0.9, 1.1)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, selected = _top_k(self.gate, x, K)
        hits = [torch.where(selected == i) for i in range(len(self.experts))]
        outs = [self.experts[i](x[tok]) for i, (tok, _) in enumerate(hits)]
        y = torch.zeros_like(x)
        for (tok, slot), out in zip(hits, outs):
            y.index_add_(0, tok, out * weights[tok, slot, None].to(out.dtype))
        return y.reshape(shape)


class InputEditedAfterCallsMoE(ComprehensionMoE):
    """The block halves its input in place after the expert calls and adds it back (a residual scaled in place);
    the router reads a product of the input, so the model's own backward needs no value the edit overwrote."""

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, selected = _top_k(self.gate, x * 1.0, K)
        hits = [torch.where(selected == i) for i in range(len(self.experts))]
        outs = [self.experts[i](x[tok]) for i, (tok, _) in enumerate(hits)]
        y = torch.zeros_like(x)
        for (tok, slot), out in zip(hits, outs):
            y.index_add_(0, tok, out * weights[tok, slot, None].to(out.dtype))
        hidden_states.mul_(0.5)
        return y.reshape(shape) + hidden_states


# Blocks that edit their input in place: exact when called on a non-leaf input (a leaf that requires grad refuses
# the edit in the model's own forward, as the fuzzer's harness feeds it: so they are no fuzzer targets).
INPUT_EDITS = {"input_jitter": InputJitterMoE, "input_edited_after_calls": InputEditedAfterCallsMoE}


class CacheOrderMoE(ComprehensionMoE):
    """The order the experts run in is cached per batch size in a Python dict: pass 1's entry is undone, pass
    2 computes the same order and caches it once."""

    def __init__(self):
        super().__init__()
        self._order_cache = {}

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, selected = _top_k(self.gate, x, K)
        order = self._order_cache.get(x.shape[0])
        if order is None:
            order = list(range(len(self.experts)))[::-1]
            self._order_cache[x.shape[0]] = order
        y = torch.zeros_like(x)
        for i in order:
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, self.experts[i](x[tok]) * weights[tok, slot, None])
        return y.reshape(shape)


class AutocastTwin(ComprehensionMoE):
    """Edit: the expert calls run under ``torch.autocast`` opened inside the forward."""

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, selected = _top_k(self.gate, x, K)
        hits = [torch.where(selected == i) for i in range(len(self.experts))]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = [self.experts[i](x[tok]) for i, (tok, _) in enumerate(hits)]
        y = torch.zeros_like(x)
        for (tok, slot), out in zip(hits, outs):
            y.index_add_(0, tok, (out * weights[tok, slot, None].to(out.dtype)).to(y.dtype))
        return y.reshape(shape)


class NoGradTwin(ComprehensionMoE):
    """Edit: the expert calls run under ``torch.no_grad()`` (frozen experts, as the block writes it)."""

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, selected = _top_k(self.gate, x, K)
        hits = [torch.where(selected == i) for i in range(len(self.experts))]
        with torch.no_grad():
            outs = [self.experts[i](x[tok]) for i, (tok, _) in enumerate(hits)]
        y = torch.zeros_like(x)
        for (tok, slot), out in zip(hits, outs):
            y.index_add_(0, tok, out * weights[tok, slot, None].to(out.dtype))
        return y.reshape(shape)


BLOCKS.update(counter_attribute=CounterMoE, cached_order=CacheOrderMoE)  # state written in forward, undone after pass 1

class SumSeqExpert(LastDimExpert):
    """Edit: ``sum(1)``, the features of 2-D rows but the sequence of a (batch, seq, hidden) call."""

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        h = self.norm(h) + F.softmax(h, dim=-1)
        h = h - h.sum(1, keepdim=True) / h.shape[-1]
        h = torch.cat([h[..., FF // 2:], h[..., :FF // 2]], dim=-1) * torch.sigmoid(h[..., :1])
        return self.fc2(h.view(h.shape))


class SoftmaxDimOneExpert(LastDimExpert):
    """Edit: ``softmax(h, dim=1)``: over the sequence of a (batch, seq, hidden) call."""

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        h = self.norm(h) + F.softmax(h, dim=1)
        h = h - h.sum(-1, keepdim=True) / h.shape[-1]
        h = torch.cat([h[..., FF // 2:], h[..., :FF // 2]], dim=-1) * torch.sigmoid(h[..., :1])
        return self.fc2(h.view(h.shape))


class ColonSliceExpert(LastDimExpert):
    """Edit: ``h[:, :1]`` for ``h[..., :1]``: the first token of a (batch, seq, hidden) call, broadcast."""

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        h = self.norm(h) + F.softmax(h, dim=-1)
        h = h - h.sum(-1, keepdim=True) / h.shape[-1]
        h = torch.cat([h[..., FF // 2:], h[..., :FF // 2]], dim=-1) * torch.sigmoid(h[:, :1])
        return self.fc2(h.view(h.shape))


class RankBranchExpert(LastDimExpert):
    """Edit: a branch on the input's rank (the flattened rows would take the other path)."""

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        h = self.norm(h) + F.softmax(h, dim=-1)
        h = h - h.sum(-1, keepdim=True) / h.shape[-1] if x.dim() == 2 else h
        h = torch.cat([h[..., FF // 2:], h[..., :FF // 2]], dim=-1) * torch.sigmoid(h[..., :1])
        return self.fc2(h.view(h.shape))


class ReplacesEntryInForwardTwin(PlainDictMoE):
    """Edit: the forward swaps the dict's entry 2 for a fresh module after its loop (a module autoep never placed)."""

    def forward(self, hidden_states):
        out = super().forward(hidden_states)
        self.expert_by_id[2] = FeedForward()
        return out


class AppendsInForwardTwin(PlainListMoE):
    """Edit: the forward appends to the list of experts after using it."""

    def forward(self, hidden_states):
        out = super().forward(hidden_states)
        self.expert_list.append(self.expert_list[0])
        return out


# name -> (builder, the ReplayError text it must raise)
TWINS = {
    "branch_on_output": (BranchOnOutputTwin, "BranchOnOutputTwin: __bool__ reads a pending expert output on the host "
                         "before the exchange"),
    "rng_from_output": (RngFromOutputTwin, "RngFromOutputTwin: __bool__ reads a pending expert output on the host"),
    # N-D expert calls of an expert that reads a leading dim or the rank (row-local on 2-D rows alone)
    "sum_over_seq": (lambda: WholeTensorMoE(SumSeqExpert), "only for an expert that treats every dim before the "
                     "last alike, and this one does not: SumSeqExpert.forward line 4: `h.sum(1, keepdim=True)` reads "
                     "dim 1 by a positive index"),
    "softmax_over_seq": (lambda: WholeTensorMoE(SoftmaxDimOneExpert), "`F.softmax(h, dim=1)` reads dim 1"),
    "colon_slice": (lambda: WholeTensorMoE(ColonSliceExpert), "`h[:, :1]` reads dim 1 by position"),
    "rank_branch": (lambda: FourDimCallsMoE(RankBranchExpert), "`x.dim()` reads the rows' rank"),
    # experts in a plain dict/list attribute, changed by the block's own forward
    "plain_dict_entry_replaced": (ReplacesEntryInForwardTwin, "ReplacesEntryInForwardTwin.expert_by_id was changed "
                                  "by the block's forward: expert_by_id[2] is no longer the module registered as "
                                  "ReplacesEntryInForwardTwin.expert_2"),
    "plain_list_appended": (AppendsInForwardTwin, "AppendsInForwardTwin.expert_list was changed by the block's "
                            "forward: expert_list now holds the entries [0, 1, 2, 3, 4], not the 4 it held at apply"),
}

# Exact since the block's forward runs once (issue 30): the two-pass execution refused each of them.
ONE_PASS = {"chained": ChainedTwin, "autocast_around_experts": AutocastTwin, "no_grad_around_experts": NoGradTwin,
            "buffer": BufferTwin}
BLOCKS.update(ONE_PASS)
