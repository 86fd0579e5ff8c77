"""Hand-written v4-style and research-style MoE blocks, written the way their model files are.

They copy the *semantics* of code nobody here owns: transformers 4.x ``MixtralSparseMoeBlock``
and ``Qwen2MoeSparseMoeBlock`` (bare ``nn.Linear`` gate, routing inside the block forward, a
``ModuleList`` of SwiGLU experts, the per-expert ``index_add_`` loop), DeepSeek-V3's remote-code /
transformers 4.x ``DeepseekV3MoE`` (sigmoid scores, group-limited top-k on bias-corrected scores,
``routed_scaling_factor``, additive ``shared_experts``), and a research block with
torchtitan/Mixtral ``w1``/``w2``/``w3`` experts.

Used by the detector tests (``tests/detect/test_structure.py``) and the recipe parity tests
(``tests/runtime/test_module_list_recipe.py``); keep class and attribute spellings realistic. Every block
takes simple keyword arguments and keeps a tiny config object as ``self.config``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# Mixtral, transformers 4.x style
# ---------------------------------------------------------------------------------------------


@dataclass
class MixtralStyleConfig:
    hidden_size: int = 16
    intermediate_size: int = 32
    num_local_experts: int = 4
    num_experts_per_tok: int = 2
    router_jitter_noise: float = 0.0


class MixtralStyleMLP(nn.Module):
    def __init__(self, config: MixtralStyleConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


class MixtralStyleSparseMoeBlock(nn.Module):
    """Softmax top-k, weights always renormalised; returns ``(final_hidden_states, router_logits)``."""

    def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=2, jitter_noise=0.0):
        super().__init__()
        self.config = MixtralStyleConfig(hidden, ffn, num_experts, top_k, jitter_noise)
        self.hidden_dim = hidden
        self.ffn_dim = ffn
        self.num_experts = num_experts
        self.top_k = top_k
        self.gate = nn.Linear(self.hidden_dim, self.num_experts, bias=False)
        self.experts = nn.ModuleList([MixtralStyleMLP(self.config) for _ in range(self.num_experts)])
        self.jitter_noise = jitter_noise

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            # transformers 4.x multiplies in place (``*=``); out of place here so a leaf input works.
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise
            )
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)

        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)

        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


# ---------------------------------------------------------------------------------------------
# Qwen2-MoE, transformers 4.x style
# ---------------------------------------------------------------------------------------------


@dataclass
class Qwen2MoeStyleConfig:
    hidden_size: int = 16
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 48
    num_experts: int = 4
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = False


class Qwen2MoeStyleMLP(nn.Module):
    def __init__(self, config: Qwen2MoeStyleConfig, intermediate_size: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Qwen2MoeStyleSparseMoeBlock(nn.Module):
    """Softmax top-k, renormalised only when ``norm_topk_prob``; sigmoid-gated shared expert."""

    def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=2, norm_topk_prob=False, shared_ffn=48):
        super().__init__()
        self.config = Qwen2MoeStyleConfig(hidden, ffn, shared_ffn, num_experts, top_k, norm_topk_prob)
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(
            [Qwen2MoeStyleMLP(self.config, intermediate_size=ffn) for _ in range(self.num_experts)]
        )
        self.shared_expert = Qwen2MoeStyleMLP(self.config, intermediate_size=shared_ffn)
        self.shared_expert_gate = torch.nn.Linear(hidden, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)

        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)

        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))

        shared_expert_output = self.shared_expert(hidden_states)
        shared_expert_output = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared_expert_output
        final_hidden_states = final_hidden_states + shared_expert_output

        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3, remote-code / transformers 4.x style, with a bare nn.Linear gate
# ---------------------------------------------------------------------------------------------


@dataclass
class DeepseekV3StyleConfig:
    hidden_size: int = 16
    moe_intermediate_size: int = 32
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_group: int = 4
    topk_group: int = 2
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True


class DeepseekV3StyleMLP(nn.Module):
    def __init__(self, config: DeepseekV3StyleConfig, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DeepseekV3StyleMoE(nn.Module):
    """Sigmoid scores; top-k restricted to the best ``topk_group`` of ``n_group`` groups, chosen on
    ``scores + e_score_correction_bias``; weights gathered from the un-biased scores, optionally
    renormalised, times ``routed_scaling_factor``; plus additive ``shared_experts``. Returns a tensor."""

    def __init__(
        self,
        *,
        hidden=16,
        ffn=32,
        num_experts=8,
        top_k=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        n_shared_experts=1,
    ):
        super().__init__()
        self.config = DeepseekV3StyleConfig(
            hidden, ffn, num_experts, top_k, n_group, topk_group, n_shared_experts, routed_scaling_factor, norm_topk_prob
        )
        self.n_routed_experts = num_experts
        self.num_experts_per_tok = top_k
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.experts = nn.ModuleList(
            [DeepseekV3StyleMLP(self.config, intermediate_size=ffn) for _ in range(self.n_routed_experts)]
        )
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        # Trained outside backprop (aux-loss-free balancing), so a buffer, not a parameter.
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.shared_experts = DeepseekV3StyleMLP(self.config, intermediate_size=ffn * n_shared_experts)

    def route_tokens_to_experts(self, router_logits):
        router_logits = router_logits.sigmoid()
        router_logits_for_choice = router_logits + self.e_score_correction_bias
        group_scores = (
            router_logits_for_choice.view(-1, self.n_group, self.n_routed_experts // self.n_group)
            .topk(2, dim=-1)[0]
            .sum(dim=-1)
        )
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(-1, self.n_group, self.n_routed_experts // self.n_group)
            .reshape(-1, self.n_routed_experts)
        )
        scores_for_choice = router_logits_for_choice.masked_fill(~score_mask.bool(), 0.0)
        topk_indices = torch.topk(scores_for_choice, k=self.num_experts_per_tok, dim=-1, sorted=False)[1]
        topk_weights = router_logits.gather(1, topk_indices)
        if self.norm_topk_prob:
            denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
            topk_weights /= denominator
        topk_weights = topk_weights * self.routed_scaling_factor
        return topk_indices, topk_weights

    def moe(self, hidden_states: torch.Tensor, topk_indices: torch.Tensor, topk_weights: torch.Tensor):
        final_hidden_states = torch.zeros_like(hidden_states, dtype=topk_weights.dtype)
        expert_mask = F.one_hot(topk_indices, num_classes=len(self.experts)).permute(2, 0, 1)
        for expert_idx in range(len(self.experts)):
            expert = self.experts[expert_idx]
            mask = expert_mask[expert_idx]
            token_indices, weight_indices = torch.where(mask)
            if token_indices.numel() > 0:
                expert_weights = topk_weights[token_indices, weight_indices]
                expert_input = hidden_states[token_indices]
                expert_output = expert(expert_input)
                weighted_output = expert_output * expert_weights.unsqueeze(-1)
                final_hidden_states.index_add_(0, token_indices, weighted_output)
        return final_hidden_states.type(hidden_states.dtype)

    def forward(self, hidden_states):
        residuals = hidden_states
        orig_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        router_logits = self.gate(hidden_states)
        topk_indices, topk_weights = self.route_tokens_to_experts(router_logits)
        hidden_states = self.moe(hidden_states, topk_indices, topk_weights).view(*orig_shape)
        hidden_states = hidden_states + self.shared_experts(residuals)
        return hidden_states


# ---------------------------------------------------------------------------------------------
# Research style: torchtitan / original-Mixtral ``w1``/``w2``/``w3`` experts in a ModuleList
# ---------------------------------------------------------------------------------------------


@dataclass
class MoEArgs:
    dim: int = 16
    hidden_dim: int = 32
    num_experts: int = 4
    top_k: int = 2


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Softmax top-k without renormalisation; ``top_k`` lives only on ``self.config``. Returns a tensor."""

    def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=2):
        super().__init__()
        self.config = MoEArgs(hidden, ffn, num_experts, top_k)
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList([FeedForward(hidden, ffn) for _ in range(num_experts)])

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
        return out.view(bs, slen, dim)


class DropoutFeedForward(FeedForward):
    """fairseq/minimind-era experts: dropout on the expert's output (exact under EP only at p=0)."""

    def __init__(self, dim: int, hidden_dim: int, dropout: float = 0.0):
        super().__init__(dim, hidden_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class DropoutExpertsMoE(MoE):
    def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=2, dropout=0.0):
        super().__init__(hidden=hidden, ffn=ffn, num_experts=num_experts, top_k=top_k)
        self.experts = nn.ModuleList([DropoutFeedForward(hidden, ffn, dropout) for _ in range(num_experts)])


# ---------------------------------------------------------------------------------------------
# Idioms the block's own code may use around its expert loop (they run as written under EP)
# ---------------------------------------------------------------------------------------------


class CappedRouterMoE(MoE):
    """A soft-capped, temperature-scaled router that drops low-confidence picks to the padding id
    ``num_experts`` (the loop ``where(selected == i)`` never visits it), then a routed scale."""

    def __init__(self, *, temperature=0.7, cap=5.0, drop_below=0.2, **kw):
        super().__init__(**kw)
        self.temperature, self.cap, self.drop_below = temperature, cap, drop_below

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        logits = self.cap * torch.tanh(self.gate(x) / self.temperature / self.cap)
        scores = F.softmax(logits, dim=-1, dtype=torch.float)
        top_scores, selected = torch.topk(scores, self.config.top_k, dim=-1)
        selected = torch.where(top_scores < self.drop_below, torch.full_like(selected, len(self.experts)), selected)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token_idx, slot = torch.where(selected == i)
            out.index_add_(0, token_idx, expert(x[token_idx]) * top_scores[token_idx, slot, None])
        return (out * 1.5).view(bs, slen, dim)


class _FlatteningBase(nn.Module):
    def _flatten(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1])


def make_closure_moe_class(bias_scale: float):
    """A block class built in a function: its forward reads a closure variable and zero-arg super()."""

    class ClosureMoE(_FlatteningBase):
        def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=2):
            super().__init__()
            self.top_k = top_k
            self.gate = nn.Linear(hidden, num_experts, bias=False)
            self.experts = nn.ModuleList([FeedForward(hidden, ffn) for _ in range(num_experts)])

        def forward(self, hidden_states):
            shape = hidden_states.shape
            x = super()._flatten(hidden_states)
            probs = self.gate(x).softmax(dim=-1) + bias_scale
            weights, chosen = probs.topk(self.top_k, dim=-1)
            acc = x.new_zeros(x.shape)
            mask = F.one_hot(chosen, num_classes=len(self.experts)).permute(2, 0, 1)
            for e in range(len(self.experts)):
                tok, slot = torch.where(mask[e])
                acc.index_add_(0, tok, self.experts[e](x[tok]) * weights[tok, slot].unsqueeze(-1))
            return acc.view(shape)

    return ClosureMoE


# ---------------------------------------------------------------------------------------------
# mistral-inference style: k in a nested args object, softmax over the top-k logits, and the
# accumulation written as ``results[batch_idx] += w * expert(x)``
# ---------------------------------------------------------------------------------------------


@dataclass
class MoeArgs:
    num_experts: int = 4
    num_experts_per_tok: int = 2


class MistralInferenceMoeLayer(nn.Module):
    def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=2):
        super().__init__()
        self.experts = nn.ModuleList([FeedForward(hidden, ffn) for _ in range(num_experts)])
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.args = MoeArgs(num_experts, top_k)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        shape = inputs.shape  # mistral-inference feeds (tokens, dim); flattened here for (batch, seq, dim)
        inputs = inputs.reshape(-1, shape[-1])
        gate_logits = self.gate(inputs)
        weights, selected_experts = torch.topk(gate_logits, self.args.num_experts_per_tok)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(inputs.dtype)
        results = torch.zeros_like(inputs)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs[batch_idx])
        return results.view(shape)


# ---------------------------------------------------------------------------------------------
# DeepSeek's argsort/split loop (remote-code ``moe_infer``, transformers 4.x ``DeepseekV2MoE.moe``): the
# block counts and sorts its (token, slot) rows by expert, runs each expert on its contiguous slice and
# unsorts; and LongCat-Flash's zero-compute experts (trailing ``nn.Identity`` in the ModuleList)
# ---------------------------------------------------------------------------------------------


class SortedSplitMoE(nn.Module):
    """transformers 4.x ``DeepseekV2MoE`` spelling: a softmax top-k gate, the loop in a helper ``moe``
    with an ``ep_rank`` offset into the experts, products formed in the weights' dtype."""

    def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=2):
        super().__init__()
        self.num_experts_per_tok = top_k
        self.experts = nn.ModuleList([FeedForward(hidden, ffn) for _ in range(num_experts)])
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.ep_rank, self.experts_per_rank = 0, num_experts

    def moe(self, hidden_states, topk_ids, topk_weight):
        cnts = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        cnts.scatter_(1, topk_ids, 1)
        tokens_per_expert = cnts.sum(dim=0)
        indices = topk_ids.view(-1).argsort()
        sorted_tokens = hidden_states[indices // topk_ids.shape[1]]

        outputs = []
        start_idx = 0
        for i, num_tokens in enumerate(tokens_per_expert):
            if num_tokens == 0:
                continue
            end_idx = start_idx + num_tokens
            expert = self.experts[i + self.ep_rank * self.experts_per_rank]
            tokens_for_this_expert = sorted_tokens[start_idx:end_idx]
            expert_out = expert(tokens_for_this_expert)
            outputs.append(expert_out)
            start_idx = end_idx

        outs = torch.cat(outputs, dim=0) if outputs else sorted_tokens.new_empty(0)
        new_x = torch.empty_like(outs)
        new_x[indices] = outs
        # (T, K, D) spelled with D, not -1, so a rank with no tokens runs too (DeepSeek's own -1 cannot).
        return (new_x.view(*topk_ids.shape, hidden_states.shape[-1]).type(topk_weight.dtype)
                .mul_(topk_weight.unsqueeze(dim=-1)).sum(dim=1).type(new_x.dtype))

    def forward(self, hidden_states):
        orig_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        scores = self.gate(hidden_states).softmax(dim=-1, dtype=torch.float32)
        topk_weight, topk_ids = torch.topk(scores, k=self.num_experts_per_tok, dim=-1, sorted=False)
        return self.moe(hidden_states, topk_ids, topk_weight).view(*orig_shape)


class SortedSplitHostCountsMoE(SortedSplitMoE):
    """Remote-code ``moe_infer`` spelling in the forward itself: counts moved to the host, the end offset
    taken before the skip, a tuple init, ``len(outputs)`` as the test, a scale after the combine."""

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        topk_weight, topk_ids = torch.topk(F.softmax(self.gate(x), dim=-1), self.num_experts_per_tok)
        cnts = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        cnts.scatter_(1, topk_ids, 1)
        tokens_per_expert = cnts.sum(dim=0)
        idxs = torch.argsort(topk_ids.view(-1), stable=True)
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        tokens_per_expert = tokens_per_expert.cpu().numpy()
        outputs, start_idx = [], 0
        for i, num_tokens in enumerate(tokens_per_expert):
            end_idx = start_idx + num_tokens
            if num_tokens == 0:
                continue
            outputs.append(self.experts[i](sorted_tokens[start_idx:end_idx]))
            start_idx = end_idx
        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        y = (new_x.view(*topk_ids.shape, shape[-1]) * topk_weight.unsqueeze(-1)).sum(dim=1)
        return (y * 0.5).view(shape)


class ZeroExpertMoE(nn.Module):
    """LongCat-Flash (transformers 4.x): ``num_experts`` SwiGLU experts then ``zero_experts`` identity
    experts in one ModuleList; the loop over all of them accumulates in the weights' dtype (fp32)."""

    def __init__(self, *, hidden=16, ffn=32, num_experts=4, zero_experts=2, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.experts = nn.ModuleList([FeedForward(hidden, ffn) for _ in range(num_experts)]
                                     + [nn.Identity() for _ in range(zero_experts)])
        self.router = nn.Linear(hidden, num_experts + zero_experts, bias=False)

    def moe(self, hidden_states, topk_indices, topk_weights):
        final_hidden_states = torch.zeros_like(hidden_states, dtype=topk_weights.dtype)
        expert_mask = F.one_hot(topk_indices, num_classes=len(self.experts)).permute(2, 0, 1)
        for expert_idx in range(len(self.experts)):
            expert = self.experts[expert_idx]
            mask = expert_mask[expert_idx]
            token_indices, weight_indices = torch.where(mask)
            if token_indices.numel() > 0:
                expert_weights = topk_weights[token_indices, weight_indices]
                expert_input = hidden_states[token_indices]
                expert_output = expert(expert_input)
                weighted_output = expert_output * expert_weights.unsqueeze(-1)
                final_hidden_states.index_add_(0, token_indices, weighted_output)
        return final_hidden_states.type(hidden_states.dtype)

    def forward(self, hidden_states):
        orig_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        scores = self.router(hidden_states).softmax(dim=-1)
        topk_weights, topk_indices = torch.topk(scores, self.top_k, dim=-1)
        return self.moe(hidden_states, topk_indices, topk_weights).view(*orig_shape)


@dataclass
class MiniMoEConfig:
    num_experts: int = 4
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01


class MiniMindStyleMoE(nn.Module):
    """minimind's ``MOEFeedForward``: ``mask = idx == i``, ``if mask.any()`` with the tokens taken from
    ``mask.any(dim=-1)`` and the weights from ``w[mask]``; an expert without tokens touches its parameters
    with ``0 * sum(...)`` while training (so data-parallel wrappers see a gradient); an aux loss kept on
    the module."""

    def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=2):
        super().__init__()
        self.config = MiniMoEConfig(num_experts, top_k)
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList([FeedForward(hidden, ffn) for _ in range(num_experts)])

    def forward(self, x):
        batch_size, seq_len, hidden_dim = x.shape
        x_flat = x.view(-1, hidden_dim)
        scores = F.softmax(self.gate(x_flat), dim=-1)
        topk_weight, topk_idx = torch.topk(scores, k=self.config.num_experts_per_tok, dim=-1, sorted=False)
        if self.config.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        y = torch.zeros_like(x_flat)
        for i, expert in enumerate(self.experts):
            mask = (topk_idx == i)
            if mask.any():
                token_idx = mask.any(dim=-1).nonzero().flatten()
                weight = topk_weight[mask].view(-1, 1)
                y.index_add_(0, token_idx, (expert(x_flat[token_idx]) * weight).to(y.dtype))
            elif self.training:
                y[0, 0] += 0 * sum(p.sum() for p in expert.parameters())
        if self.training and self.config.router_aux_loss_coef > 0:
            load = F.one_hot(topk_idx, self.config.num_experts).float().mean(0)
            self.aux_loss = (load * scores.mean(0)).sum() * self.config.num_experts * self.config.router_aux_loss_coef
        else:
            self.aux_loss = scores.new_zeros(1).squeeze()
        return y.view(batch_size, seq_len, hidden_dim)


# ---------------------------------------------------------------------------------------------
# DeepSeek-V2/V3 remote code (modeling_deepseek.py): two expert regions, one per mode
# ---------------------------------------------------------------------------------------------


class AddAuxiliaryLoss(torch.autograd.Function):
    """DeepSeek remote code: attach an aux loss to the output's graph (its grad is 1 in backward)."""

    @staticmethod
    def forward(ctx, x, loss):
        ctx.dtype = loss.dtype
        ctx.required_aux_loss = loss.requires_grad
        return x

    @staticmethod
    def backward(ctx, grad_output):
        grad_loss = None
        if ctx.required_aux_loss:
            grad_loss = torch.ones(1, dtype=ctx.dtype, device=grad_output.device)
        return grad_output, grad_loss


class MoEGate(nn.Module):
    """DeepSeek-V2 remote-code gate: returns (topk_idx, topk_weight, aux_loss)."""

    def __init__(self, hidden=16, num_experts=4, top_k=2, alpha=0.01):
        super().__init__()
        self.top_k, self.n_routed_experts, self.alpha = top_k, num_experts, alpha
        self.weight = nn.Parameter(torch.randn(num_experts, hidden) / hidden**0.5)

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        scores = F.linear(hidden_states, self.weight).softmax(dim=-1)
        topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        aux_loss = None
        if self.training and self.alpha > 0.0:
            mask_ce = F.one_hot(topk_idx.view(-1), num_classes=self.n_routed_experts)
            ce = mask_ce.float().mean(0)
            aux_loss = (ce * scores.mean(0) * self.n_routed_experts).sum() * self.alpha
        return topk_idx, topk_weight, aux_loss


class DeepseekRemoteMoE(nn.Module):
    """modeling_deepseek.py's DeepseekV2MoE: per-pair outputs by masked assignment while training, an
    argsort/split loop in a ``@torch.no_grad()`` helper otherwise."""

    def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=2):
        super().__init__()
        self.num_experts_per_tok = top_k
        self.experts = nn.ModuleList([FeedForward(hidden, ffn) for _ in range(num_experts)])
        self.gate = MoEGate(hidden, num_experts, top_k)

    def forward(self, hidden_states):
        orig_shape = hidden_states.shape
        topk_idx, topk_weight, aux_loss = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        flat_topk_idx = topk_idx.view(-1)
        if self.training:
            hidden_states = hidden_states.repeat_interleave(self.num_experts_per_tok, dim=0)
            y = torch.empty_like(hidden_states)
            for i, expert in enumerate(self.experts):
                y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])
            # (T, K, D) spelled with D, not -1, so a rank with no tokens runs too (DeepSeek's own -1 cannot).
            y = (y.view(*topk_weight.shape, orig_shape[-1]) * topk_weight.unsqueeze(-1)).sum(dim=1)
            y = y.view(*orig_shape)
            y = AddAuxiliaryLoss.apply(y, aux_loss)
        else:
            y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
        return y

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        cnts = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        cnts.scatter_(1, topk_ids, 1)
        tokens_per_expert = cnts.sum(dim=0)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        outputs, start_idx = [], 0
        for i, num_tokens in enumerate(tokens_per_expert.tolist()):
            end_idx = start_idx + num_tokens
            if num_tokens == 0:
                continue
            outputs.append(self.experts[i](sorted_tokens[start_idx:end_idx]))
            start_idx = end_idx
        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        return (new_x.view(*topk_ids.shape, x.shape[-1]).type(topk_weight.dtype)
                .mul_(topk_weight.unsqueeze(dim=-1)).sum(dim=1))


# ---------------------------------------------------------------------------------------------
# Idioms autoep does not take yet (tests/detect/test_structure.py holds them as strict xfails)
# ---------------------------------------------------------------------------------------------


class DenseScaledMoE(nn.Module):
    """Llama-4's way: every expert runs on every token, its input pre-scaled by the token's router score
    (zero for the experts it did not pick); the exchange has no rows to send for it yet."""

    def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=1):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList([FeedForward(hidden, ffn) for _ in range(num_experts)])

    def forward(self, x):
        shape = x.shape
        x = x.view(-1, shape[-1])
        logits = self.router(x)
        top_v, top_i = torch.topk(logits, self.top_k, dim=-1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, top_i, top_v).sigmoid()
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + expert(x * scores[:, e:e + 1])
        return out.view(shape)


class GroupedExperts(nn.Module):
    """torchtitan's experts: ``(x sorted by expert, tokens per expert) -> y``, weights (E, ...)."""

    def __init__(self, dim=16, hidden_dim=32, num_experts=4):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden_dim) / hidden_dim**0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        out = []
        for expert_idx, x_expert in enumerate(torch.split(x, num_tokens_per_expert.tolist(), dim=0)):
            h = F.silu(torch.matmul(x_expert, self.w1[expert_idx].transpose(-2, -1)))
            h = h * torch.matmul(x_expert, self.w3[expert_idx].transpose(-2, -1))
            out.append(torch.matmul(h, self.w2[expert_idx].transpose(-2, -1)))
        return torch.cat(out, dim=0)


class TitanMoE(nn.Module):
    """torchtitan's MoE block: the block sorts tokens by expert and calls the grouped experts."""

    def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=2):
        super().__init__()
        self.top_k, self.num_experts = top_k, num_experts
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = GroupedExperts(hidden, ffn, num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = torch.sigmoid(self.router(x).float())
        top_scores, selected = torch.topk(scores, k=self.top_k, dim=1)
        num_tokens_per_expert = torch.histc(selected.view(-1).float(), bins=self.num_experts, min=0,
                                            max=self.num_experts)
        token_indices_sorted = torch.argsort(selected.view(-1), stable=True)
        top_scores_sorted = top_scores.view(-1)[token_indices_sorted]
        token_indices_sorted = token_indices_sorted // self.top_k
        routed_input = x[token_indices_sorted]
        routed_output = self.experts(routed_input, num_tokens_per_expert.long())
        routed_output = (routed_output.float() * top_scores_sorted.reshape(-1, 1)).to(x.dtype)
        out = torch.zeros_like(x)
        out = out.scatter_add(0, token_indices_sorted.reshape(-1, 1).expand(-1, dim), routed_output)
        return out.view(bs, slen, dim)


# ---------------------------------------------------------------------------------------------
# Grouped experts: ``experts(x sorted by expert, tokens per expert)`` (torchtune, transformers 4.x Aria)
# ---------------------------------------------------------------------------------------------


class TuneGroupedExperts(nn.Module):
    """torchtune's experts: weights stored (E, in, out) and applied as ``x @ w[e]``, the activation a plain
    function held on the module."""

    def __init__(self, *, dim=16, hidden_dim=32, num_experts=4, activation=F.silu):
        super().__init__()
        self.dim, self.num_experts = dim, num_experts
        self.gate_proj = nn.Parameter(torch.randn(num_experts, dim, hidden_dim) / dim**0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) / hidden_dim**0.5)
        self.up_proj = nn.Parameter(torch.randn(num_experts, dim, hidden_dim) / dim**0.5)
        self.act_fn = activation

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        num_tokens_per_expert = num_tokens_per_expert.tolist()
        x = torch.split(x, split_size_or_sections=num_tokens_per_expert, dim=0)
        out_experts_splits = []
        for expert_idx, x_expert in enumerate(x):
            w1, w2, w3 = self.gate_proj[expert_idx], self.down_proj[expert_idx], self.up_proj[expert_idx]
            h = self.act_fn(torch.matmul(x_expert, w1))
            h = h * torch.matmul(x_expert, w3)
            h = torch.matmul(h, w2)
            out_experts_splits.append(h)
        out = torch.cat(out_experts_splits, dim=0)
        return out


class TuneTokenChoiceRouter(nn.Module):
    """torchtune's router: sigmoid scores, top-k, tokens sorted by expert, counts by histc."""

    def __init__(self, *, gate: nn.Module, dim: int, num_experts: int, experts_per_token: int):
        super().__init__()
        self.gate, self.dim, self.num_experts, self.experts_per_token = gate, dim, num_experts, experts_per_token

    def forward(self, x: torch.Tensor):
        n_tokens = x.shape[0]
        scores = torch.sigmoid(self.gate(x).to(torch.float32))
        top_scores, selected_experts_indices = torch.topk(scores, k=self.experts_per_token, dim=1)
        selected_experts_indices, token_indices = selected_experts_indices.view(-1).sort(stable=True)
        top_scores = top_scores.view(-1)[token_indices]
        token_indices = token_indices // self.experts_per_token
        num_tokens_per_expert = torch.histc(selected_experts_indices.float(), bins=self.num_experts, min=0,
                                            max=self.num_experts - 1).long()
        return top_scores, token_indices, num_tokens_per_expert, n_tokens


class TuneMoE(nn.Module):
    """torchtune's MoE layer: scores applied before the experts, a shared expert, scatter_add back."""

    def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=2):
        super().__init__()
        self.experts = TuneGroupedExperts(dim=hidden, hidden_dim=ffn, num_experts=num_experts)
        self.router = TuneTokenChoiceRouter(gate=nn.Linear(hidden, num_experts, bias=False), dim=hidden,
                                            num_experts=num_experts, experts_per_token=top_k)
        self.shared_expert = FeedForward(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        top_scores, token_indices, num_tokens_per_expert, _ = self.router(x.reshape(b * s, dim))
        token_indices = token_indices.reshape(-1, 1).expand(-1, dim)
        routed_input = torch.gather(x.view(-1, dim), dim=0, index=token_indices)
        routed_input = routed_input * top_scores.reshape(-1, 1).to(x.dtype)
        routed_output = self.experts(routed_input, num_tokens_per_expert)
        out = self.shared_expert(x).reshape(b * s, dim)
        out = out.scatter_add(dim=0, index=token_indices, src=routed_output)
        return out.reshape(b, s, dim)


def grouped_gemm_loop(token_states, expert_weights, tokens_per_expert):
    """Aria-style fallback GEMM: rows of expert e are ``offsets[e]:offsets[e + 1]``; rows no expert
    reaches stay zero."""
    num_tokens = token_states.shape[0]
    out_features = expert_weights.shape[-1]
    output = torch.zeros(num_tokens, out_features, dtype=token_states.dtype, device=token_states.device)
    cumsum_num_tokens = torch.cumsum(tokens_per_expert, dim=0)
    zero_tensor = torch.zeros(1, dtype=torch.long, device=cumsum_num_tokens.device)
    cumsum_num_tokens = torch.cat((zero_tensor, cumsum_num_tokens))
    for expert_num in range(expert_weights.shape[0]):
        start = cumsum_num_tokens[expert_num]
        end = cumsum_num_tokens[expert_num + 1]
        tokens = token_states[start:end]
        out = torch.matmul(tokens, expert_weights[expert_num])
        output[start:end] = out
    return output


class AriaStyleGroupedGemm(nn.Module):
    def __init__(self, in_features, out_features, groups):
        super().__init__()
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        self.weight = nn.Parameter(torch.randn(groups, in_features, out_features) / in_features**0.5)

    def forward(self, input, tokens_per_expert):
        return grouped_gemm_loop(input, self.weight, tokens_per_expert.cpu())


class AriaStyleGroupedMLP(nn.Module):
    """fc1 (E, D, 2F) chunked ``projection, gate``; ``silu(projection) * gate``; fc2 (E, F, D)."""

    def __init__(self, hidden=16, ffn=32, num_experts=4):
        super().__init__()
        self.fc1 = AriaStyleGroupedGemm(hidden, ffn * 2, num_experts)
        self.fc2 = AriaStyleGroupedGemm(ffn, hidden, num_experts)

    def forward(self, permuted_tokens, tokens_per_expert):
        fc1_output = self.fc1(permuted_tokens, tokens_per_expert)
        projection, gate = torch.chunk(fc1_output, 2, dim=-1)
        fc1_output = nn.functional.silu(projection) * gate
        fc2_output = self.fc2(fc1_output, tokens_per_expert)
        return fc2_output


class AriaStyleMoELayer(nn.Module):
    """transformers 4.x Aria's text MoE: softmax over the top-k logits, argsort permutation, histc counts,
    index_copy back, weighted sum over k, plus shared experts."""

    def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=2):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = AriaStyleGroupedMLP(hidden, ffn, num_experts)
        self.shared_experts = Qwen2MoeStyleMLP(Qwen2MoeStyleConfig(hidden_size=hidden), ffn)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        original_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_states.size(-1))
        logits = self.router(hidden_states)
        top_logits, top_indices = torch.topk(logits, k=self.top_k, dim=1)
        scores = nn.functional.softmax(top_logits, dim=-1)
        tokens_per_expert = torch.histc(top_indices.flatten().to(torch.float32), bins=self.num_experts, min=0,
                                        max=self.num_experts - 1).to(top_indices.dtype)
        sorted_indices = torch.argsort(top_indices.view(-1))
        permuted_tokens = hidden_states.index_select(0, sorted_indices // self.top_k)
        expert_output = self.experts(permuted_tokens, tokens_per_expert)
        unpermuted = torch.zeros((scores.shape[0] * self.top_k, expert_output.size(1)), dtype=expert_output.dtype,
                                 device=expert_output.device)
        unpermuted.index_copy_(0, sorted_indices, expert_output)
        unpermuted = unpermuted.view(-1, self.top_k, expert_output.size(1))
        output = (unpermuted * scores.unsqueeze(-1)).sum(dim=1).view(original_shape)
        return output + self.shared_experts(hidden_states.view(original_shape))


def run_experts_for_loop(w1, w2, w3, x, num_tokens_per_expert):
    """torchtitan's padded for-loop experts: rows past sum(counts) (alignment padding) come back as zeros."""
    num_tokens_per_expert = num_tokens_per_expert.tolist()
    num_padding = x.shape[0] - sum(num_tokens_per_expert)
    x = torch.split(x[: sum(num_tokens_per_expert)], split_size_or_sections=num_tokens_per_expert, dim=0)
    out_experts_splits = []
    for expert_idx, x_expert in enumerate(x):
        h = F.silu(torch.matmul(x_expert, w1[expert_idx].transpose(-2, -1)))
        h = h * torch.matmul(x_expert, w3[expert_idx].transpose(-2, -1))
        h = torch.matmul(h, w2[expert_idx].transpose(-2, -1))
        out_experts_splits.append(h)
    out = torch.cat(out_experts_splits, dim=0)
    out = torch.vstack((out, out.new_zeros((num_padding, out.shape[-1]))))
    return out


class PaddedGroupedExperts(GroupedExperts):
    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return run_experts_for_loop(self.w1, self.w2, self.w3, x, num_tokens_per_expert)


class TitanPaddedMoE(TitanMoE):
    """torchtitan's block with its routed rows padded to a multiple of 8 (grouped-GEMM alignment)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.experts = PaddedGroupedExperts(self.router.in_features, kw.get("ffn", 32), self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = torch.sigmoid(self.router(x).float())
        top_scores, selected = torch.topk(scores, k=self.top_k, dim=1)
        num_tokens_per_expert = torch.bincount(selected.view(-1), minlength=self.num_experts)
        token_indices_sorted = torch.argsort(selected.view(-1), stable=True)
        top_scores_sorted = top_scores.view(-1)[token_indices_sorted]
        token_indices_sorted = token_indices_sorted // self.top_k
        routed_input = x[token_indices_sorted]
        n = routed_input.shape[0]
        routed_input = torch.cat([routed_input, routed_input.new_zeros((-n % 8, dim))])
        routed_output = self.experts(routed_input, num_tokens_per_expert)[:n]
        routed_output = (routed_output.float() * top_scores_sorted.reshape(-1, 1)).to(x.dtype)
        out = torch.zeros_like(x)
        out = out.scatter_add(0, token_indices_sorted.reshape(-1, 1).expand(-1, dim), routed_output)
        return out.view(bs, slen, dim)


class EqualGroupExperts(nn.Module):
    """Llama-4's experts, spelled differently: ``experts(rows)`` on ``num_experts`` equal groups of rows
    (group e for expert e), fused [gate | up] weights (E, D, 2F), down (E, F, D), a batched matmul each."""

    def __init__(self, dim=16, hidden_dim=32, num_experts=4):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, dim, 2 * hidden_dim) / dim**0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) / hidden_dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(self.num_experts, -1, x.shape[-1])
        gate, up = torch.matmul(x, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.matmul(F.silu(gate) * up, self.down_proj)
        return out.reshape(-1, self.down_proj.shape[-1])


class EqualGroupsMoE(nn.Module):
    """Llama-4's block: every token repeated once per expert, row block e pre-scaled by the token's
    sigmoid score for expert e (zero for experts outside its top-k), the experts' rows summed over
    experts, plus a shared expert."""

    def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=2):
        super().__init__()
        self.top_k, self.num_experts = top_k, num_experts
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = EqualGroupExperts(hidden, ffn, num_experts)
        self.shared_expert = FeedForward(hidden, ffn)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        top_v, top_i = torch.topk(logits, self.top_k, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, top_i, top_v).sigmoid()
        routed_in = x.repeat(self.num_experts, 1) * scores.t().reshape(-1, 1)
        routed_out = self.experts(routed_in)
        out = self.shared_expert(x) + routed_out.view(self.num_experts, -1, shape[-1]).sum(dim=0)
        return out.view(shape), logits


# ---------------------------------------------------------------------------------------------
# Splice fidelity: the spliced method is the live one (issue 17). Each reads something a copy of the
# method would get wrong: a private name, a default argument, a closure variable rebound later.
# ---------------------------------------------------------------------------------------------

ROUTED_SCALE = 1.5  # read by DefaultScaleMoE's default arguments, once, when the class is defined


class _RoutedLoopMoE(MoE):
    """``MoE``'s routing and loop, returning the routed sum as (tokens, hidden) for subclasses to finish."""

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        scores = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        top_scores, selected_experts = torch.topk(scores, self.config.top_k, dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token_idx, slot = torch.where(selected_experts == i)
            out.index_add_(0, token_idx, expert(x[token_idx]) * top_scores[token_idx, slot, None])
        return out


class PrivateNameMoE(MoE):
    """A block keeping its routed scale and temperature in private attributes (``self.__scale`` is
    ``_PrivateNameMoE__scale`` on the instance), one read before the expert loop, one after."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.__temperature = 0.7
        self.__scale = 1.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = F.softmax(self.gate(x) / self.__temperature, dim=1, dtype=torch.float)
        top_scores, selected_experts = torch.topk(scores, self.config.top_k, dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token_idx, slot = torch.where(selected_experts == i)
            out.index_add_(0, token_idx, expert(x[token_idx]) * top_scores[token_idx, slot, None])
        return (out * self.__scale).view(bs, slen, dim)


class DefaultScaleMoE(MoE):
    """A routed scale and shift given as default arguments, positional and keyword-only, evaluated once
    when the class is defined (rebinding ``ROUTED_SCALE`` later changes neither)."""

    def forward(self, x: torch.Tensor, scale=ROUTED_SCALE, *, shift=ROUTED_SCALE / 10) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        top_scores, selected_experts = torch.topk(scores, self.config.top_k, dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token_idx, slot = torch.where(selected_experts == i)
            out.index_add_(0, token_idx, expert(x[token_idx]) * top_scores[token_idx, slot, None])
        return (out * scale + shift).view(bs, slen, dim)


def make_rebindable_moe_class(scale: float):
    """A block class whose forward reads the closure variable ``scale``, and the function that rebinds it
    (both the model's forward and its spliced twin must see the new value: they share the cell)."""

    def set_scale(value: float) -> None:
        nonlocal scale
        scale = value

    class RebindableMoE(MoE):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            bs, slen, dim = x.shape
            x = x.view(-1, dim)
            scores = F.softmax(self.gate(x), dim=1, dtype=torch.float)
            top_scores, selected_experts = torch.topk(scores, self.config.top_k, dim=-1)
            out = torch.zeros_like(x)
            for i, expert in enumerate(self.experts):
                token_idx, slot = torch.where(selected_experts == i)
                out.index_add_(0, token_idx, expert(x[token_idx]) * top_scores[token_idx, slot, None])
            return (out * scale).view(bs, slen, dim)

    return RebindableMoE, set_scale


class HalfScaledMoE(MoE):
    """``MoE`` with its routed output halved: a forward whose code another class's forward may be given."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        top_scores, selected_experts = torch.topk(scores, self.config.top_k, dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token_idx, slot = torch.where(selected_experts == i)
            out.index_add_(0, token_idx, expert(x[token_idx]) * top_scores[token_idx, slot, None])
        return (out * 0.5).view(bs, slen, dim)


# ---------------------------------------------------------------------------------------------
# Autograd around the exchange (issue 17): what the model's own backward survives, EP's must too
# ---------------------------------------------------------------------------------------------


class InplaceAfterLoopMoE(MixtralStyleSparseMoeBlock):
    """Mixtral's block that, after its expert loop, edits its routing weights in place (e.g. to reuse the
    buffer for a statistic): its own loop saved indexed copies of them, so its own backward works."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)

        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)

        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        routing_weights.mul_(0.5)
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class TuneDropEmptyMoE(TuneMoE):
    """torchtune's shipped ``MoE.forward``: the routed output is added back only when it is non-empty
    (``if routed_output.numel() > 0``), so a rank without tokens drops it from its graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        top_scores, token_indices, num_tokens_per_expert, _ = self.router(x.reshape(b * s, dim))
        token_indices = token_indices.reshape(-1, 1).expand(-1, dim)
        routed_input = torch.gather(x.view(-1, dim), dim=0, index=token_indices)
        routed_input = routed_input * top_scores.reshape(-1, 1).to(x.dtype)
        routed_output = self.experts(routed_input, num_tokens_per_expert)
        out = self.shared_expert(x).reshape(b * s, dim)
        if routed_output.numel() > 0:
            out.scatter_add_(dim=0, index=token_indices, src=routed_output)
        return out.reshape(b, s, dim)


# Row-local experts in third-party idioms (issue 16): experts that are not the SwiGLU the grouped fast
# path computes, stored under other names. Each is written the way its kind of code base writes it:
# fairseq/fairscale feed-forward experts (biased fc1/fc2, an activation *function* kept on the instance, a
# module-level ``_ffn`` helper that flattens and restores the shape), ``nn.Sequential`` experts, experts with
# optional arguments the block never passes, config branches folded at detection, ``ModuleDict`` experts
# keyed ``expert_{i}``, and torchtune-style LoRA-wrapped expert Linears.
# ---------------------------------------------------------------------------------------------


def _linear(x, weight, bias=None):
    return F.linear(x, weight, bias)


def _ffn(x, fc1, activation_fn, activation_dropout_module, fc2, dropout_module):
    """fairseq's feed-forward helper: flatten to rows, fc1 -> activation -> dropout -> fc2, restore the shape."""
    x_shape = x.shape
    x = x.reshape(-1, x.size(-1))
    x = _linear(x, fc1.weight, fc1.bias)
    x = activation_fn(x)
    x = activation_dropout_module(x)
    x = _linear(x, fc2.weight, fc2.bias)
    x = x.view(x_shape)
    x = dropout_module(x)
    return x


def get_activation_fn(activation: str):
    """fairseq's ``utils.get_activation_fn``: the activation *function* by name."""
    return {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh}[activation]


class FairseqStyleFFN(nn.Module):
    """A fairseq transformer feed-forward network used as an expert: biased ``fc1``/``fc2``, GELU/ReLU."""

    def __init__(self, embed_dim: int, ffn_dim: int, activation_fn: str = "gelu", dropout: float = 0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.activation_fn = get_activation_fn(activation_fn)
        self.activation_dropout_module = nn.Dropout(dropout)
        self.dropout_module = nn.Dropout(dropout)
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)

    def forward(self, x):
        return _ffn(x, self.fc1, self.activation_fn, self.activation_dropout_module, self.fc2, self.dropout_module)


class FairseqStyleMoE(nn.Module):
    """Top-k token routing over ``self.local_experts`` (fairscale's MOELayer name), the loop written the
    mistral-inference way (``results[batch_idx] += w * expert(x[batch_idx])``)."""

    def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=2, activation_fn="gelu"):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.local_experts = nn.ModuleList(
            [FairseqStyleFFN(hidden, ffn, activation_fn) for _ in range(num_experts)])

    def forward(self, input):
        shape = input.shape
        inputs = input.reshape(-1, shape[-1])
        gate_logits = self.gate(inputs)
        weights, selected_experts = torch.topk(gate_logits, self.top_k)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(inputs.dtype)
        results = torch.zeros_like(inputs)
        for i, expert in enumerate(self.local_experts):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs[batch_idx])
        return results.view(shape)


class SequentialExpertsMoE(nn.Module):
    """``nn.Sequential(Linear, ReLU, Linear)`` experts with biases under ``self.ffn_experts`` (research code),
    softmax top-k and the transformers-4 ``index_add_`` loop."""

    def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.ffn_experts = nn.ModuleList(
            [nn.Sequential(nn.Linear(hidden, ffn), nn.ReLU(), nn.Dropout(0.0), nn.Linear(ffn, hidden))
             for _ in range(num_experts)])

    def forward(self, hidden_states):
        b, s, d = hidden_states.shape
        x = hidden_states.view(-1, d)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(len(self.ffn_experts)):
            tok, k = torch.where(top_i == e)
            out.index_add_(0, tok, self.ffn_experts[e](x[tok]) * top_w[tok, k, None])
        return out.view(b, s, d)


class OptionalArgsExpert(nn.Module):
    """An expert whose forward takes optional arguments the MoE block never passes (OLMo/fairseq style)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.ff_proj = nn.Linear(hidden, ffn)
        self.ff_out = nn.Linear(ffn, hidden)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x, residual=None, scale: float = 1.0, *, return_hidden: bool = False):
        h = self.act(self.ff_proj(x))
        if return_hidden:
            return h
        out = self.ff_out(h) * scale
        if residual is not None:
            out = out + residual
        return out


@dataclass
class BranchExpertConfig:
    hidden_size: int = 16
    intermediate_size: int = 32
    mlp_type: str = "gelu"  # "gelu" | "swiglu"
    glu_multiplier: int = 1


class ConfigBranchExpert(nn.Module):
    """An expert that picks its computation from constant config attributes (``if self.cfg > 1:``): the
    branch not taken may do anything; detection folds the constants and records them."""

    def __init__(self, config: BranchExpertConfig):
        super().__init__()
        self.config = config
        self.glu = config.glu_multiplier
        self.w_in = nn.Linear(config.hidden_size, config.intermediate_size * max(config.glu_multiplier, 1))
        self.w_out = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        h = self.w_in(x)
        if self.glu > 1:
            a, b = h.chunk(2, dim=-1)
            h = F.silu(a) * b
        elif self.config.mlp_type == "gelu":
            h = F.gelu(h)
        else:
            h = h - h.mean(dim=0)  # never taken for this instance: it would mix rows
        return self.w_out(h)


class ExpertListMoE(nn.Module):
    """Mistral-inference-style routing over ``self.experts_list`` holding any expert modules (optional-argument
    or config-branch experts)."""

    def __init__(self, experts, *, hidden=16, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, len(experts), bias=False)
        self.experts_list = nn.ModuleList(experts)

    def forward(self, inputs):
        x = inputs.reshape(-1, inputs.shape[-1])
        gate_logits = self.gate(x)
        weights, selected_experts = torch.topk(gate_logits, self.top_k)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(x.dtype)
        results = torch.zeros_like(x)
        for i, expert in enumerate(self.experts_list):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(x[batch_idx])
        return results.view(inputs.shape)


class ModuleDictExpertsMoE(nn.Module):
    """Experts in an ``nn.ModuleDict`` keyed ``expert_{i}`` (NLLB/Switch naming), looked up by an f-string of
    the expert id inside the block's ``index_add_`` loop."""

    def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=2):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleDict({f"expert_{i}": FairseqStyleFFN(hidden, ffn, "relu") for i in range(num_experts)})

    def forward(self, hidden_states):
        b, s, d = hidden_states.shape
        x = hidden_states.view(-1, d)
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w = top_w.to(x.dtype)
        out = torch.zeros_like(x)
        for i in range(self.num_experts):
            expert = self.experts[f"expert_{i}"]
            tok, k = torch.where(top_i == i)
            out.index_add_(0, tok, expert(x[tok]) * top_w[tok, k, None])
        return out.view(b, s, d)


class LoRALinear(nn.Module):
    """torchtune's LoRALinear idiom: a frozen base weight plus ``lora_b(lora_a(dropout(x)))`` scaled by
    ``alpha / rank``, switchable with ``disabled``."""

    def __init__(self, in_dim: int, out_dim: int, rank: int = 2, alpha: float = 4.0, dropout: float = 0.0,
                 use_bias: bool = False):
        super().__init__()
        self.in_dim, self.out_dim, self.rank, self.alpha = in_dim, out_dim, rank, alpha
        self.use_bias = use_bias
        self.weight = nn.Parameter(torch.randn(out_dim, in_dim) / in_dim ** 0.5, requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_dim), requires_grad=False) if use_bias else None
        self.disabled = False
        self.dropout = nn.Dropout(p=dropout) if dropout > 0.0 else nn.Identity()
        self.lora_a = nn.Linear(in_dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, out_dim, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.1)  # torchtune zero-inits it; nonzero so its path is tested

    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)
        if self.disabled:
            return out
        lora_out = self.lora_a(self.dropout(x))
        lora_out = (self.alpha / self.rank) * self.lora_b(lora_out)
        return out + lora_out


class LoRAFeedForward(nn.Module):
    """A torchtitan/torchtune ``w1``/``w2``/``w3`` SwiGLU expert whose Linears are LoRA-wrapped."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = LoRALinear(dim, hidden_dim)
        self.w2 = LoRALinear(hidden_dim, dim)
        self.w3 = LoRALinear(dim, hidden_dim)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoRAExpertsMoE(MoE):
    """The research ``MoE`` block (``self.experts``, ``w1/w2/w3``) after LoRA-wrapping every expert Linear."""

    def __init__(self, *, hidden=16, ffn=32, num_experts=4, top_k=2):
        super().__init__(hidden=hidden, ffn=ffn, num_experts=num_experts, top_k=top_k)
        self.experts = nn.ModuleList([LoRAFeedForward(hidden, ffn) for _ in range(num_experts)])




# ---------------------------------------------------------------------------------------------
# Facts that can change (issue 17): what the detector folds from the block's attributes
# ---------------------------------------------------------------------------------------------


class CountedExpertsMoE(MoE):
    """``MoE`` whose loop runs over ``range(self.num_experts)``: the count is a plain attribute."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.num_experts = self.config.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        top_scores, selected_experts = torch.topk(scores, self.config.top_k, dim=-1)
        out = torch.zeros_like(x)
        for i in range(self.num_experts):
            token_idx, slot = torch.where(selected_experts == i)
            out.index_add_(0, token_idx, self.experts[i](x[token_idx]) * top_scores[token_idx, slot, None])
        return out.view(bs, slen, dim)


class PropertyCountMoE(CountedExpertsMoE):
    """The count a property: in eval the last expert is left out (a value read at detection, in train
    mode, that differs later)."""

    def __init__(self, **kw):
        MoE.__init__(self, **kw)

    @property
    def num_experts(self) -> int:
        return len(self.experts) if self.training else len(self.experts) - 1


# ---------------------------------------------------------------------------------------------
# transformers 4.57 batched experts with a training test (Qwen3-VL-MoE, GPT-OSS): a per-expert loop
# over dense (T, E) routing weights while training, every expert on every token otherwise
# ---------------------------------------------------------------------------------------------


class DenseWeightsExperts(nn.Module):
    """transformers 4.57 ``Qwen3VLMoeTextExperts``, as written: ``gate_up_proj`` (E, D, 2F) indexed by a (1,)
    row of ``nonzero()`` (a leading 1-dim, taken off by ``out[0]``), ``up * act_fn(gate)``, routing weights
    ``W[tok, e, None]`` of a dense (T, E) tensor, and a bmm branch over all experts when not training."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = ffn
        self.hidden_size = hidden
        self.expert_dim = ffn
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, hidden, 2 * ffn) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(num_experts, ffn, hidden) * 0.3)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states: torch.Tensor, routing_weights: torch.Tensor, router_indices: torch.Tensor):
        batch_size = hidden_states.shape[0]
        hidden_states = hidden_states.reshape(-1, self.hidden_size)  # (num_tokens, hidden_size)
        if self.training:
            next_states = torch.zeros_like(hidden_states, dtype=hidden_states.dtype, device=hidden_states.device)
            with torch.no_grad():
                expert_mask = torch.nn.functional.one_hot(router_indices, num_classes=self.num_experts)
                expert_mask = expert_mask.permute(2, 1, 0)
                expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
            for expert_idx in expert_hit[:]:
                with torch.no_grad():
                    _, token_idx = torch.where(expert_mask[expert_idx[0]])
                current_state = hidden_states[token_idx]
                gate_up = current_state @ self.gate_up_proj[expert_idx]
                gate, up = gate_up.chunk(2, dim=-1)
                gated_output = up * self.act_fn(gate)
                out = gated_output @ self.down_proj[expert_idx]
                weighted_output = out[0] * routing_weights[token_idx, expert_idx, None]
                next_states.index_add_(0, token_idx, weighted_output.to(hidden_states.dtype))
            next_states = next_states.view(batch_size, -1, self.hidden_size)
        else:
            hidden_states = hidden_states.repeat(self.num_experts, 1)
            hidden_states = hidden_states.view(self.num_experts, -1, self.hidden_size)
            gate_up = torch.bmm(hidden_states, self.gate_up_proj)
            gate, up = gate_up.chunk(2, dim=-1)
            next_states = torch.bmm((up * self.act_fn(gate)), self.down_proj)
            next_states = next_states.reshape(self.num_experts, batch_size, -1, self.hidden_size)
            next_states = (
                next_states * routing_weights.transpose(0, 1).view(self.num_experts, batch_size, -1)[..., None]
            )
            next_states = next_states.sum(dim=0)
        return next_states


class DenseWeightsMoE(nn.Module):
    """transformers 4.57 ``Qwen3VLMoeTextSparseMoeBlock``: softmax top-k, renormalised, scattered into a dense
    (T, E) weight tensor the experts read per expert."""

    def __init__(self, *, hidden=16, ffn=24, num_experts=4, top_k=2, experts_cls=DenseWeightsExperts):
        super().__init__()
        self.hidden_size = hidden
        self.num_experts = num_experts
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = experts_cls(num_experts, hidden, ffn)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size = hidden_states.shape[0]
        hidden_states = hidden_states.reshape(-1, self.hidden_size)
        router_logits = self.gate(hidden_states)
        routing_weights = torch.nn.functional.softmax(router_logits, dim=-1, dtype=torch.float)
        routing_weights, router_indices = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        router_weights = torch.zeros_like(router_logits).scatter_(1, router_indices, routing_weights)
        hidden_states = hidden_states.reshape(batch_size, -1, self.hidden_size)
        routed_out = self.experts(hidden_states, router_weights, router_indices)
        return routed_out, router_logits


class InlineGateExperts(nn.Module):
    """transformers 4.57 ``GptOssExperts``, as written: biased projections, a clamped GLU written inline on
    the interleaved halves (``[..., ::2]``, ``[..., 1::2]``), E read from the routing weights' shape, a padding
    class ``E`` skipped, and a bmm branch over all experts when neither on CPU nor training."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.intermediate_size = ffn
        self.num_experts = num_experts
        self.hidden_size = hidden
        self.expert_dim = ffn
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, hidden, 2 * ffn) * 0.5)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(num_experts, 2 * ffn) * 0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, ffn, hidden) * 0.3)
        self.down_proj_bias = nn.Parameter(torch.randn(num_experts, hidden) * 0.3)
        self.alpha = 1.702
        self.limit = 1.5  # small: the clamps bite on these weights

    def forward(self, hidden_states: torch.Tensor, router_indices=None, routing_weights=None) -> torch.Tensor:
        batch_size = hidden_states.shape[0]
        hidden_states = hidden_states.reshape(-1, self.hidden_size)  # (num_tokens, hidden_size)
        num_experts = routing_weights.shape[1]
        if hidden_states.device.type == "cpu" or self.training:
            next_states = torch.zeros_like(hidden_states, dtype=hidden_states.dtype, device=hidden_states.device)
            with torch.no_grad():
                expert_mask = torch.nn.functional.one_hot(router_indices, num_classes=num_experts + 1)
                expert_mask = expert_mask.permute(2, 1, 0)
                expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
            for expert_idx in expert_hit[:]:
                expert_idx = expert_idx[0]
                if expert_idx == num_experts:
                    continue
                with torch.no_grad():
                    _, token_idx = torch.where(expert_mask[expert_idx])
                current_state = hidden_states[token_idx]
                gate_up = current_state @ self.gate_up_proj[expert_idx] + self.gate_up_proj_bias[expert_idx]
                gate, up = gate_up[..., ::2], gate_up[..., 1::2]
                gate = gate.clamp(min=None, max=self.limit)
                up = up.clamp(min=-self.limit, max=self.limit)
                glu = gate * torch.sigmoid(gate * self.alpha)
                gated_output = (up + 1) * glu
                out = gated_output @ self.down_proj[expert_idx] + self.down_proj_bias[expert_idx]
                weighted_output = out * routing_weights[token_idx, expert_idx, None]
                next_states.index_add_(0, token_idx, weighted_output.to(hidden_states.dtype))
            next_states = next_states.view(batch_size, -1, self.hidden_size)
        else:
            hidden_states = hidden_states.repeat(num_experts, 1)
            hidden_states = hidden_states.view(num_experts, -1, self.hidden_size)
            gate_up = torch.bmm(hidden_states, self.gate_up_proj) + self.gate_up_proj_bias[..., None, :]
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            gate = gate.clamp(min=None, max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            glu = gate * torch.sigmoid(gate * self.alpha)
            next_states = torch.bmm(((up + 1) * glu), self.down_proj)
            next_states = next_states + self.down_proj_bias[..., None, :]
            next_states = next_states.view(num_experts, batch_size, -1, self.hidden_size)
            next_states = next_states * routing_weights.transpose(0, 1).view(num_experts, batch_size, -1)[..., None]
            next_states = next_states.sum(dim=0)
        return next_states


class InlineGateTopKRouter(nn.Module):
    """transformers 4.57 ``GptOssTopKRouter``: biased logits, top-k, softmax over the k, scattered to (T, E)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.num_experts = num_experts
        self.hidden_dim = hidden
        self.weight = nn.Parameter(torch.randn(num_experts, hidden) * 0.5)
        self.bias = nn.Parameter(torch.randn(num_experts) * 0.1)

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight, self.bias)
        router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=-1)
        router_top_value = torch.nn.functional.softmax(router_top_value, dim=1, dtype=router_top_value.dtype)
        router_scores = torch.zeros_like(router_logits).scatter_(1, router_indices, router_top_value)
        return router_scores, router_indices


class InlineGateMoE(nn.Module):
    """transformers 4.57 ``GptOssMLP``: the router module, then the experts by keyword."""

    def __init__(self, *, hidden=16, ffn=24, num_experts=4, top_k=2, experts_cls=InlineGateExperts):
        super().__init__()
        self.router = InlineGateTopKRouter(hidden, num_experts, top_k)
        self.experts = experts_cls(num_experts, hidden, ffn)

    def forward(self, hidden_states):
        router_scores, router_indices = self.router(hidden_states)
        routed_out = self.experts(hidden_states, router_indices=router_indices, routing_weights=router_scores)
        return routed_out, router_scores


# ---------------------------------------------------------------------------------------------
# transformers 4.57 VitPose: every expert on every row, masked by the sequence's id, summed
# ---------------------------------------------------------------------------------------------


class MaskedSumMoE(nn.Module):
    """transformers 4.57 ``VitPoseBackboneMoeMLP``, as written: a shared fc1 -> act -> fc2 and biased
    ``nn.Linear`` experts (to ``part`` features) each run on every row, times the mask of the sequences whose
    id (``indices``, one per sequence) is that expert, summed in expert order and concatenated after the shared
    part. ``indices`` default: sequence b gets id ``(2b + 1) % (num_experts + 1)`` (``num_experts``: no expert)."""

    def __init__(self, *, hidden=16, ffn=32, part=4, num_experts=4):
        super().__init__()
        self.part_features = part
        self.fc1 = nn.Linear(hidden, ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn, hidden - part)
        self.num_experts = num_experts
        self.experts = nn.ModuleList([nn.Linear(ffn, part) for _ in range(num_experts)])

    def forward(self, hidden_state: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        if indices is None:
            indices = (torch.arange(hidden_state.shape[0], device=hidden_state.device) * 2 + 1) % (self.num_experts + 1)
        expert_hidden_state = torch.zeros_like(hidden_state[:, :, -self.part_features :])

        hidden_state = self.fc1(hidden_state)
        hidden_state = self.act(hidden_state)
        shared_hidden_state = self.fc2(hidden_state)
        indices = indices.view(-1, 1, 1)

        # to support ddp training
        for i in range(self.num_experts):
            selected_index = indices == i
            current_hidden_state = self.experts[i](hidden_state) * selected_index
            expert_hidden_state = expert_hidden_state + current_hidden_state

        hidden_state = torch.cat([shared_hidden_state, expert_hidden_state], dim=-1)

        return hidden_state


# ---------------------------------------------------------------------------------------------
# Experts containers whose own forward loops over their entries (transformers 5.x Switch/NLLB idiom)
# ---------------------------------------------------------------------------------------------


class BiasedGeluFFN(nn.Module):
    """A biased ``fc1 -> GELU -> fc2`` expert (any row-local expert would do)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        self.act = nn.GELU()

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class ExpertBank(nn.ModuleDict):
    """Experts under ``ffn{e}`` in a ModuleDict that routes by itself: given a (tokens, slots, experts)
    dispatch mask, it walks the hit experts token-major (``permute(2, 0, 1)``) and adds each routed row's
    weighted output. ``output_scale`` is a constant branch, folded at detection."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, output_scale: float = 1.0):
        super().__init__({f"ffn{e}": BiasedGeluFFN(hidden, ffn) for e in range(num_experts)})
        self.output_scale = output_scale

    def forward(self, tokens, dispatch, gates):
        out = torch.zeros_like(tokens)
        by_expert = dispatch.permute(2, 0, 1)
        busy = torch.greater(by_expert.sum(dim=(1, 2)), 0).nonzero()
        for e in busy.squeeze(-1):
            tok, slot = torch.where(by_expert[e])
            rows = self[f"ffn{e}"](tokens[tok]) * gates[tok, slot, None]
            if self.output_scale != 1.0:
                rows = rows * self.output_scale
            out.index_add_(0, tok, rows)
        return out


class DispatchMaskMoE(nn.Module):
    """GShard-style top-2 routing with a per-batch capacity: slot k of token t is a one-hot row over the
    experts, zeroed when its expert already took ``capacity`` (token, slot) pairs (counted slot 0 first);
    the experts container gets the (T, 2, E) mask and the (T, 2) gate weights."""

    def __init__(self, *, hidden=16, ffn=24, num_experts=4, capacity=3, output_scale=1.0):
        super().__init__()
        self.num_experts, self.capacity = num_experts, capacity
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = ExpertBank(hidden, ffn, num_experts, output_scale)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        probs = self.gate(x).softmax(dim=-1)
        gates, chosen = probs.topk(2, dim=-1)
        onehot = F.one_hot(chosen, self.num_experts)  # (T, 2, E)
        order = onehot.transpose(0, 1).reshape(-1, self.num_experts).cumsum(dim=0)  # slot 0 of every token first
        within = order.reshape(2, -1, self.num_experts).transpose(0, 1) <= self.capacity
        dispatch = onehot * within
        return self.experts(x, dispatch, gates).reshape(shape)


class ExpertStack(nn.ModuleList):
    """Experts in a ModuleList that runs its own Mixtral-style loop over the hit expert ids."""

    def forward(self, x, top_k_index, top_k_weights):
        acc = torch.zeros_like(x)
        hot = F.one_hot(top_k_index, num_classes=len(self)).permute(2, 1, 0)
        for e in torch.greater(hot.sum(dim=(-1, -2)), 0).nonzero():
            slot, tok = torch.where(hot[e].squeeze(0))
            acc.index_add_(0, tok, self[e[0]](x[tok]) * top_k_weights[tok, slot, None])
        return acc


class ExpertStackMoE(nn.Module):
    def __init__(self, *, hidden=16, ffn=24, num_experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.ffns = ExpertStack(BiasedGeluFFN(hidden, ffn) for _ in range(num_experts))

    def forward(self, hidden_states):
        b, s, d = hidden_states.shape
        x = hidden_states.view(-1, d)
        w, idx = torch.topk(self.router(x).softmax(-1), self.top_k, dim=-1)
        return self.ffns(x, idx, w / w.sum(-1, keepdim=True)).view(b, s, d)
# transformers 4.57 Switch Transformers: a one-hot mask with capacity, ModuleDict experts by getattr, rows
# overwritten expert by expert
# ---------------------------------------------------------------------------------------------


class SelectedRowsExpert(nn.Module):
    """``SwitchTransformersDenseActDense``: wi -> act -> dropout -> wo, bias-free."""

    def __init__(self, hidden: int, ffn: int, dropout: float = 0.0):
        super().__init__()
        self.wi = nn.Linear(hidden, ffn, bias=False)
        self.wo = nn.Linear(ffn, hidden, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.act = nn.ReLU()

    def forward(self, hidden_states):
        hidden_states = self.wi(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.wo(hidden_states)
        return hidden_states


class SelectedRowsMoE(nn.Module):
    """transformers 4.57 ``SwitchTransformersSparseMLP`` with its top-1 router inlined: argmax one-hot, tokens past
    an expert's capacity (per sequence, in order) dropped (an all-zero mask row: the output row stays zero), the
    experts hit taken as ``nonzero(...).tolist()``, and each expert's rows assigned by ``y[mask[:, :, e]] = ...``
    with the expert read as ``getattr(self.experts, f"expert_{e}")``; the top probability scales the rows after."""

    def __init__(self, *, hidden=16, ffn=24, num_experts=4, capacity=2, dropout=0.0):
        super().__init__()
        self.num_experts = num_experts
        self.expert_capacity = capacity
        self.classifier = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleDict()
        for idx in range(num_experts):
            self.experts[f"expert_{idx}"] = SelectedRowsExpert(hidden, ffn, dropout)

    def forward(self, hidden_states):
        router_probs = nn.functional.softmax(self.classifier(hidden_states), dim=-1)
        expert_index = torch.nn.functional.one_hot(torch.argmax(router_probs, dim=-1), num_classes=self.num_experts)
        token_priority = torch.cumsum(expert_index, dim=-2)
        expert_index = expert_index * (token_priority <= self.expert_capacity)
        router_probs = torch.max(router_probs, dim=-1).values.unsqueeze(-1)

        next_states = torch.zeros(hidden_states.shape, device=hidden_states.device, dtype=hidden_states.dtype)
        router_mask = expert_index.bool()
        batch_size, seq_len, num_experts = router_mask.shape
        idx_mask = router_mask.reshape(batch_size * seq_len, num_experts).sum(dim=0)
        idx_mask = torch.nonzero(idx_mask, as_tuple=True)[0].tolist()
        for idx in idx_mask:
            next_states[router_mask[:, :, idx]] = getattr(self.experts, f"expert_{idx}")(
                hidden_states[router_mask[:, :, idx]]
            )

        hidden_states = router_probs * next_states
        return hidden_states
