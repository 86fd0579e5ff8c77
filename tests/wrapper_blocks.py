"""MoE blocks whose experts sit elsewhere relative to the block (issue 31), written in the idioms of real code
(DeepSeek remote code, research repos), each with one-edit harmful twins that must be refused or raise:

- ``TwoWrappersMoE``: the matched block holds a wrapper that holds an MoE that holds the experts
  (``self.ffn.moe.experts``), each level's forward a plain call of the next on (a row-local transform of) its rows.
  ``ThreeWrappersMoE``: one level more (``self.mlp.ffn.moe.experts``). Twins: a wrapper calling the inner MoE
  twice, on rows mixed across the batch (``h - h.mean(0)``), or reading the experts' parameters.
- ``AuxTupleMoE``: the MoE two wrappers down returns its load-balancing loss (``out, aux_loss = self.moe(h)``),
  the wrapper hands the tuple up and the block adds the loss to its output (router grads flow through it);
  ``AuxStateMoE``: the wrapper counts its calls and keeps the aux loss on ``self`` (``return out``; the block reads
  ``self.ffn.aux_loss``); ``SharedBelowWrapperMoE``: the MoE below the wrapper holds routed ``experts`` beside
  ``shared_experts`` run on every row. Twins: the tuple's MoE on rows mixed across the batch, the wrapper reading
  back the count it keeps (a branch mixing rows from the second call on: at detection the count is 0), the aux loss
  kept on the wrapped MoE (``self.moe.aux_loss = ...``), the "shared" experts called on the rows expert 0 picks,
  the routed loop left to the parent's forward (``super().forward(x)``; below a wrapper and as the block itself:
  the shared list was taken for the experts before).
- ``PerRowExtrasMoE``: an experts container with a forward of its own (the loop inside it) that receives extra
  per-row tensors besides the hidden states, ``self.experts(x, topk_idx, topk_w, pos_emb)``: a rotary table indexed
  per row, each row's routing probability, a per-row mask, passed to each expert with the rows
  (``expert(x[tok], pos[tok], w[tok, slot, None], keep[tok])``). Twin: the expert reads the table whole
  (``pos.mean(0)``). ``KeywordExtrasMoE``: the same extras passed by keyword in the block's own loop
  (``expert(x[tok], pos=pos_emb[tok], prob=..., keep=keep[tok])``, the expert's parameters without a default). Twins:
  ``pos=pos_emb`` unindexed into an expert reading its mean (refused), a keyword for a parameter with a default
  (``scale=keep[tok]``: raises at the first call).
- ``GroupedRoutingMoE``: two-level routing, a router over groups, then a router per group over that group's
  experts (a ModuleList of ModuleLists, ``self.experts[g][j]``); ``FlatGroupedRoutingMoE``: the same experts in one
  flat list indexed ``g * per_group + j``; ``FlatGroupedLoraMoE``: two aligned flat lists (each expert's adapter
  ``self.lora[g * per_group + j]`` placed with it). Twins: the group's router called again on its experts' rows
  inside the inner loop (selected by the group id alone), the next expert's adapter (``[(g * P + j + 1) % E]``).
- ``SlicedWeightsMoE``: experts that slice their own fused weight (``w1, w3 = self.w13.weight.split(F, dim=0)``,
  as fused gate/up checkpoints are kept); ``ChunkedSwiGLU``: ``chunk`` and a slice ``weight[:, :F]``. Twin: the
  rows split (``x.split(x.shape[0] // 2, dim=0)``) and their halves swapped.

Every block takes ``(batch, seq, hidden)`` and returns the same shape. ``BLOCKS`` and ``TWINS`` map a name to a
builder; ``TWINS`` values are ``(builder, what the refusal names)``; ``RAISES`` (accepted spellings of per-row extras
the exchange cannot move: a bool mask, an optional parameter given a value) ``(builder, what the ReplayError at the
first call names)``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from replay_blocks import FF, D, E, FeedForward, K, _top_k

GROUPS, PER_GROUP = 2, 2  # two-level routing: E = GROUPS * PER_GROUP experts
SEQ_MAX = 16  # rows of the position table (>= the tests' sequence length)


# ---------------------------------------------------------------------------------------------
# Experts two (and three) wrappers down
# ---------------------------------------------------------------------------------------------


class DeepseekStyleMoE(nn.Module):
    """The MoE itself: a softmax top-k gate and a loop over ModuleList experts (DeepSeek remote code's train
    path: ``y[flat == i] = expert(x[flat == i])``, then the weighted sum over the top-k)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([FeedForward() for _ in range(E)])

    def forward(self, x):
        weights, selected = _top_k(self.gate, x, K)
        flat = selected.view(-1)
        rows = x.repeat_interleave(K, dim=0)
        y = torch.empty_like(rows)
        for i, expert in enumerate(self.experts):
            y[flat == i] = expert(rows[flat == i])
        return (y.view(-1, K, D) * weights.unsqueeze(-1)).sum(dim=1)


class MoeFeedForward(nn.Module):
    """A wrapper holding the MoE: a pre-norm, then the MoE on the normed rows (a research repo's ``ffn``)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.moe = DeepseekStyleMoE()

    def forward(self, x):
        h = self.norm(x)
        return self.moe(h)


class TwoWrappersMoE(nn.Module):
    """The matched block: ``self.ffn`` (a wrapper) holds ``moe`` that holds the experts."""

    def __init__(self):
        super().__init__()
        self.ffn = MoeFeedForward()
        self.calls, self.rows = 0, []  # Python state the block keeps (compared after every step)

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        self.calls += 1
        self.rows.append(x.shape[0])
        return (x + self.ffn(x)).reshape(hidden_states.shape)

    def visible_state(self) -> dict:
        return {"calls": self.calls, "rows": list(self.rows)}


class SublayerWrapper(nn.Module):
    """One more level: a residual sub-layer holding the feed-forward wrapper."""

    def __init__(self):
        super().__init__()
        self.ffn = MoeFeedForward()

    def forward(self, x):
        return x + self.ffn(x)


class ThreeWrappersMoE(nn.Module):
    """``self.mlp.ffn.moe.experts``: three wrappers down."""

    def __init__(self):
        super().__init__()
        self.mlp = SublayerWrapper()

    def forward(self, hidden_states):
        return self.mlp(hidden_states.reshape(-1, D)).reshape(hidden_states.shape)


class CallsTwiceFeedForward(MoeFeedForward):
    """Edit: the MoE is called twice."""

    def forward(self, x):
        h = self.norm(x)
        return self.moe(h) + self.moe(h)


class MixedRowsFeedForward(MoeFeedForward):
    """Edit: the MoE sees rows centred over the batch (``h - h.mean(0)``): not row-local."""

    def forward(self, x):
        h = self.norm(x)
        return self.moe(h - h.mean(0))


class ReadsExpertsFeedForward(MoeFeedForward):
    """Edit: the wrapper scales by the first expert's weight norm (another rank's expert is a stand-in there)."""

    def forward(self, x):
        h = self.norm(x)
        return self.moe(h) * self.moe.experts[0].fc1.weight.norm()


def _two_wrappers_twin(ffn: type) -> type:
    class Twin(TwoWrappersMoE):
        def __init__(self):
            super().__init__()
            self.ffn = ffn()

    Twin.__name__ = Twin.__qualname__ = f"TwoWrappers{ffn.__name__}"
    return Twin


CallsTwiceTwin = _two_wrappers_twin(CallsTwiceFeedForward)
MixedRowsTwin = _two_wrappers_twin(MixedRowsFeedForward)
ReadsExpertsTwin = _two_wrappers_twin(ReadsExpertsFeedForward)


# ---------------------------------------------------------------------------------------------
# Wrapper levels whose MoE returns its load-balancing loss, that keep Python state, over shared experts
# ---------------------------------------------------------------------------------------------

AUX_COEF = 0.01  # the blocks add their aux loss to the output: the router's grads flow through it too


class AuxLossMoE(DeepseekStyleMoE):
    """The MoE returns ``(out, aux_loss)``: a Switch-style load-balancing loss (each expert's picks times its summed
    probability; a sum, so a rank without tokens has 0, not nan)."""

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, selected = torch.topk(probs, K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = selected.view(-1)
        rows = x.repeat_interleave(K, dim=0)
        y = torch.empty_like(rows)
        for i, expert in enumerate(self.experts):
            y[flat == i] = expert(rows[flat == i])
        aux_loss = (F.one_hot(selected, E).sum(dim=(0, 1)).to(probs.dtype) * probs.sum(dim=0)).sum() / (K * E)
        return (y.view(-1, K, D) * weights.unsqueeze(-1)).sum(dim=1), aux_loss


class AuxTupleFeedForward(nn.Module):
    """A wrapper returning what its MoE returns, a tuple: ``out, aux_loss = self.moe(h); return out, aux_loss``."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.moe = AuxLossMoE()

    def forward(self, x):
        h = self.norm(x)
        out, aux_loss = self.moe(h)
        return out, aux_loss


class AuxTupleMoE(nn.Module):
    """``self.ffn.moe.experts``, the aux loss handed up as a tuple and added by the block."""

    def __init__(self):
        super().__init__()
        self.ffn = AuxTupleFeedForward()

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        y, aux_loss = self.ffn(x)
        return (x + y + AUX_COEF * aux_loss).reshape(hidden_states.shape)


class AuxStateFeedForward(AuxTupleFeedForward):
    """A wrapper keeping Python state: it counts its calls and keeps the aux loss on ``self`` (read by the block)."""

    def __init__(self):
        super().__init__()
        self.calls, self.aux_loss = 0, None

    def forward(self, x):
        self.calls += 1
        h = self.norm(x)
        out, aux_loss = self.moe(h)
        self.aux_loss = aux_loss
        return out


class AuxStateMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.ffn = AuxStateFeedForward()

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        y = self.ffn(x)
        return (x + y + AUX_COEF * self.ffn.aux_loss).reshape(hidden_states.shape)

    def visible_state(self) -> dict:
        return {"calls": self.ffn.calls, "aux_loss": round(float(self.ffn.aux_loss.detach()), 5)}


class SharedRoutedMoE(DeepseekStyleMoE):
    """Routed ``experts`` beside ``shared_experts`` run on every row (DeepSeek-V2/Qwen2-MoE style, as a list)."""

    def __init__(self):
        super().__init__()
        self.shared_experts = nn.ModuleList([FeedForward() for _ in range(2)])

    def forward(self, x):
        weights, selected = _top_k(self.gate, x, K)
        flat = selected.view(-1)
        rows = x.repeat_interleave(K, dim=0)
        y = torch.empty_like(rows)
        for i, expert in enumerate(self.experts):
            y[flat == i] = expert(rows[flat == i])
        return (y.view(-1, K, D) * weights.unsqueeze(-1)).sum(dim=1) + sum(shared(x) for shared in self.shared_experts)


class SharedFeedForward(MoeFeedForward):
    def __init__(self):
        super().__init__()
        self.moe = SharedRoutedMoE()


class SharedBelowWrapperMoE(TwoWrappersMoE):
    """``self.ffn.moe.experts`` routed, ``self.ffn.moe.shared_experts`` on every row (stays where the token is)."""

    def __init__(self):
        super().__init__()
        self.ffn = SharedFeedForward()


class AuxMixedRowsFeedForward(AuxTupleFeedForward):
    """Edit: the tuple-returning MoE sees rows centred over the batch (``h - h.mean(0)``)."""

    def forward(self, x):
        h = self.norm(x)
        out, aux_loss = self.moe(h - h.mean(0))
        return out, aux_loss


class AuxMixedRowsTwin(AuxTupleMoE):
    def __init__(self):
        super().__init__()
        self.ffn = AuxMixedRowsFeedForward()


class StateReadBackFeedForward(AuxStateFeedForward):
    """Edit: the wrapper reads back the count it keeps, mixing rows from its second call on (at detection the
    count is 0: a proof reading it would follow only the first call's branch)."""

    def forward(self, x):
        self.calls += 1
        h = self.norm(x)
        if self.calls > 1:
            h = h - h.mean(0)
        out, aux_loss = self.moe(h)
        self.aux_loss = aux_loss
        return out


class StateOnInnerFeedForward(AuxStateFeedForward):
    """Edit: the aux loss is kept on the wrapped MoE (``self.moe.aux_loss = ...``), not on the wrapper."""

    def forward(self, x):
        self.calls += 1
        h = self.norm(x)
        out, aux_loss = self.moe(h)
        self.moe.aux_loss = self.aux_loss = aux_loss
        return out


def _aux_state_twin(ffn: type) -> type:
    class Twin(AuxStateMoE):
        def __init__(self):
            super().__init__()
            self.ffn = ffn()

    Twin.__name__ = Twin.__qualname__ = f"AuxState{ffn.__name__}"
    return Twin


StateReadBackTwin = _aux_state_twin(StateReadBackFeedForward)
StateOnInnerTwin = _aux_state_twin(StateOnInnerFeedForward)


class SharedRoutedOnSomeRowsMoE(SharedRoutedMoE):
    """Edit: the "shared" experts run on the rows expert 0 picks only (in the routed loop): no longer every row."""

    def forward(self, x):
        weights, selected = _top_k(self.gate, x, K)
        flat = selected.view(-1)
        rows = x.repeat_interleave(K, dim=0)
        y = torch.empty_like(rows)
        for i, expert in enumerate(self.experts):
            y[flat == i] = expert(rows[flat == i]) + self.shared_experts[0](rows[flat == i])
        return (y.view(-1, K, D) * weights.unsqueeze(-1)).sum(dim=1)


class SharedOnSomeRowsFeedForward(MoeFeedForward):
    def __init__(self):
        super().__init__()
        self.moe = SharedRoutedOnSomeRowsMoE()


SharedOnSomeRowsTwin = _two_wrappers_twin(SharedOnSomeRowsFeedForward)


class SharedViaSuperMoE(DeepseekStyleMoE):
    """Edit: the routed loop is the parent's (``super().forward(x)``), the shared list alone read here: taken for
    the experts before (sharded, the routed ones left replicated); now refused naming the parent's read."""

    def __init__(self):
        super().__init__()
        self.shared_experts = nn.ModuleList([FeedForward() for _ in range(2)])

    def forward(self, x):
        return super().forward(x) + sum(shared(x) for shared in self.shared_experts)


class SharedViaSuperFeedForward(MoeFeedForward):
    def __init__(self):
        super().__init__()
        self.moe = SharedViaSuperMoE()


SharedViaSuperTwin = _two_wrappers_twin(SharedViaSuperFeedForward)


# ---------------------------------------------------------------------------------------------
# An experts container with a forward of its own, receiving extra per-row tensors
# ---------------------------------------------------------------------------------------------


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryExpert(nn.Module):
    """An expert that rotates its rows by their position's angles before its MLP, scales its output by the row's
    routing probability and zeroes masked rows: ``(x, pos, prob, keep)`` all per row."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, FF)
        self.fc2 = nn.Linear(FF, D)

    def forward(self, x, pos, prob, keep):
        x = x * pos.cos() + rotate_half(x) * pos.sin()
        return self.fc2(F.gelu(self.fc1(x))) * prob * keep


class PerRowExperts(nn.ModuleList):
    """The experts container whose forward is the loop (``self.experts(x, topk_idx, topk_w, pos_emb, keep)``)."""

    def forward(self, x, topk_idx, topk_w, pos_emb, keep):
        y = torch.zeros_like(x)
        for i, expert in enumerate(self):
            tok, slot = torch.where(topk_idx == i)
            y.index_add_(0, tok, expert(x[tok], pos_emb[tok], topk_w[tok, slot, None], keep[tok]))
        return y


class PerRowExtrasMoE(nn.Module):
    """Positions per row from a rotary table (a buffer), a per-row mask from the input (rows of zeros are
    padding), the loop in the experts' own forward."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = PerRowExperts([RotaryExpert() for _ in range(E)])
        inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
        angles = torch.outer(torch.arange(SEQ_MAX).float(), inv_freq)
        self.register_buffer("rotary", torch.cat((angles, angles), dim=-1), persistent=False)

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        pos_emb = self.rotary[:s].repeat(b, 1)  # row r's position is r % s
        keep = (x.abs().sum(-1, keepdim=True) > 0).to(x.dtype)
        topk_w, topk_idx = _top_k(self.gate, x, K)
        return self.experts(x, topk_idx, topk_w, pos_emb, keep).reshape(b, s, h)


class WholeTableExpert(RotaryExpert):
    """Edit: the position table's mean over its rows (``pos.mean(0)``) instead of each row's own."""

    def forward(self, x, pos, prob, keep):
        pos = pos.mean(0)
        x = x * pos.cos() + rotate_half(x) * pos.sin()
        return self.fc2(F.gelu(self.fc1(x))) * prob * keep


class WholeTableTwin(PerRowExtrasMoE):
    def __init__(self):
        super().__init__()
        self.experts = PerRowExperts([WholeTableExpert() for _ in range(E)])


class BoolMaskExperts(PerRowExperts):
    """Edit: the mask passed as booleans (``keep[tok] > 0``): the model multiplies by it; autoep moves per-row
    extras in the rows' dtype only, so the call raises naming the cast."""

    def forward(self, x, topk_idx, topk_w, pos_emb, keep):
        y = torch.zeros_like(x)
        for i, expert in enumerate(self):
            tok, slot = torch.where(topk_idx == i)
            y.index_add_(0, tok, expert(x[tok], pos_emb[tok], topk_w[tok, slot, None], keep[tok] > 0))
        return y


class BoolMaskTwin(PerRowExtrasMoE):
    def __init__(self):
        super().__init__()
        self.experts = BoolMaskExperts([RotaryExpert() for _ in range(E)])


class ScaledRotaryExpert(RotaryExpert):
    """An optional ``scale`` (default 1.0): the proof takes the default where a call does not pass it."""

    def forward(self, x, pos, prob, keep, scale=1.0):
        x = x * pos.cos() + rotate_half(x) * pos.sin()
        return self.fc2(F.gelu(self.fc1(x))) * prob * keep * scale


class GivesOptionalExperts(PerRowExperts):
    """Edit: the container passes the optional ``scale`` too (each row's norm): a value the proof took at its
    default; the call raises (the count of per-row tensors is the forward's parameters without a default)."""

    def forward(self, x, topk_idx, topk_w, pos_emb, keep):
        y = torch.zeros_like(x)
        for i, expert in enumerate(self):
            tok, slot = torch.where(topk_idx == i)
            rows = x[tok]
            y.index_add_(0, tok, expert(rows, pos_emb[tok], topk_w[tok, slot, None], keep[tok], rows.norm(dim=-1,
                                                                                                  keepdim=True)))
        return y


class GivesOptionalTwin(PerRowExtrasMoE):
    def __init__(self):
        super().__init__()
        self.experts = GivesOptionalExperts([ScaledRotaryExpert() for _ in range(E)])


class KeywordExtrasMoE(PerRowExtrasMoE):
    """The per-row extras passed by keyword in the block's own loop, ``expert(x[tok], pos=pos_emb[tok],
    prob=topk_w[tok, slot, None], keep=keep[tok])``: the expert's parameters without a default, named (moved with the
    rows as if passed by position)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([RotaryExpert() for _ in range(E)])

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        pos_emb = self.rotary[:s].repeat(b, 1)
        keep = (x.abs().sum(-1, keepdim=True) > 0).to(x.dtype)
        topk_w, topk_idx = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            tok, slot = torch.where(topk_idx == i)
            y.index_add_(0, tok, expert(x[tok], pos=pos_emb[tok], prob=topk_w[tok, slot, None], keep=keep[tok]))
        return y.reshape(b, s, h)


class DefaultedRotaryExpert(RotaryExpert):
    """The extras as optional parameters (``pos=None, prob=None, keep=None``), as real code declares them."""

    def forward(self, x, pos=None, prob=None, keep=None):
        x = x * pos.cos() + rotate_half(x) * pos.sin()
        return self.fc2(F.gelu(self.fc1(x))) * prob * keep


class KeywordDefaultedMoE(KeywordExtrasMoE):
    """``KeywordExtrasMoE`` whose expert declares its extras with a default None: refused naming the default (the
    proof takes it), not yet accepted (``tests/detect/test_wrapper_blocks.py``, xfail)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([DefaultedRotaryExpert() for _ in range(E)])


class KeywordOptionalTwin(KeywordExtrasMoE):
    """Edit: the expert's ``scale`` has a default (1.0) and the call names it, ``scale=keep[tok]``: a value the proof
    took at its default; the first call raises."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([ScaledRotaryExpert() for _ in range(E)])

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        pos_emb = self.rotary[:s].repeat(b, 1)
        keep = (x.abs().sum(-1, keepdim=True) > 0).to(x.dtype)
        topk_w, topk_idx = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            tok, slot = torch.where(topk_idx == i)
            y.index_add_(0, tok, expert(x[tok], pos=pos_emb[tok], prob=topk_w[tok, slot, None], keep=keep[tok],
                                        scale=keep[tok]))
        return y.reshape(b, s, h)


class KeywordWholeTableTwin(KeywordExtrasMoE):
    """Edit: ``pos=pos_emb`` unindexed, into an expert reading its mean (every row's position, not its rows')."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([WholeTableExpert() for _ in range(E)])

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        pos_emb = self.rotary[:s].repeat(b, 1)
        keep = (x.abs().sum(-1, keepdim=True) > 0).to(x.dtype)
        topk_w, topk_idx = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            tok, slot = torch.where(topk_idx == i)
            y.index_add_(0, tok, expert(x[tok], pos=pos_emb, prob=topk_w[tok, slot, None], keep=keep[tok]))
        return y.reshape(b, s, h)


# ---------------------------------------------------------------------------------------------
# Two-level routing
# ---------------------------------------------------------------------------------------------


class GroupedRoutingMoE(nn.Module):
    """A router over groups (top-1), then each group's own router over its experts (top-1): the rows of group g
    go to ``self.experts[g][j]``; the output is weighted by both probabilities (hierarchical MoE)."""

    def __init__(self):
        super().__init__()
        self.group_gate = nn.Linear(D, GROUPS, bias=False)
        self.expert_gates = nn.ModuleList([nn.Linear(D, PER_GROUP, bias=False) for _ in range(GROUPS)])
        self.experts = nn.ModuleList([nn.ModuleList([FeedForward() for _ in range(PER_GROUP)])
                                      for _ in range(GROUPS)])
        self.group_rows: list[list[int]] = []  # rows per group, per call (a load statistic the block keeps)

    def visible_state(self) -> dict:
        return {"group_rows": [list(r) for r in self.group_rows]}

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        group_w, group_idx = _top_k(self.group_gate, x, 1)
        self.group_rows.append(torch.bincount(group_idx[:, 0], minlength=GROUPS).tolist())
        y = torch.zeros_like(x)
        for g in range(len(self.experts)):
            rows = torch.where(group_idx[:, 0] == g)[0]
            xg = x[rows]
            w, idx = torch.softmax(self.expert_gates[g](xg), dim=-1).max(dim=-1)
            for j in range(len(self.experts[g])):
                tok = torch.where(idx == j)[0]
                out = self.experts[g][j](xg[tok]) * (w[tok] * group_w[rows[tok], 0])[:, None]
                y.index_add_(0, rows[tok], out)
        return y.reshape(hidden_states.shape)


class FlatGroupedRoutingMoE(GroupedRoutingMoE):
    """The same routing over one flat list: expert ``g * per_group + j``."""

    def __init__(self):
        super().__init__()
        self.per_group = PER_GROUP
        self.experts = nn.ModuleList([FeedForward() for _ in range(GROUPS * PER_GROUP)])

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        group_w, group_idx = _top_k(self.group_gate, x, 1)
        y = torch.zeros_like(x)
        for g in range(GROUPS):
            rows = torch.where(group_idx[:, 0] == g)[0]
            xg = x[rows]
            w, idx = torch.softmax(self.expert_gates[g](xg), dim=-1).max(dim=-1)
            for j in range(self.per_group):
                tok = torch.where(idx == j)[0]
                out = self.experts[g * self.per_group + j](xg[tok]) * (w[tok] * group_w[rows[tok], 0])[:, None]
                y.index_add_(0, rows[tok], out)
        return y.reshape(hidden_states.shape)


class FlatGroupedLoraMoE(FlatGroupedRoutingMoE):
    """Two-level routing over two aligned flat lists: each expert's output through its own low-rank adapter
    (``self.lora[g * per_group + j]``), placed with it on its owner."""

    def __init__(self):
        super().__init__()
        self.num_experts = GROUPS * PER_GROUP
        self.lora = nn.ModuleList([nn.Sequential(nn.Linear(D, 2, bias=False), nn.Linear(2, D, bias=False))
                                   for _ in range(self.num_experts)])

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        group_w, group_idx = _top_k(self.group_gate, x, 1)
        y = torch.zeros_like(x)
        for g in range(GROUPS):
            rows = torch.where(group_idx[:, 0] == g)[0]
            xg = x[rows]
            w, idx = torch.softmax(self.expert_gates[g](xg), dim=-1).max(dim=-1)
            for j in range(self.per_group):
                tok = torch.where(idx == j)[0]
                h = self.experts[g * self.per_group + j](xg[tok])
                out = h + self.lora[g * self.per_group + j](h)
                y.index_add_(0, rows[tok], out * (w[tok] * group_w[rows[tok], 0])[:, None])
        return y.reshape(hidden_states.shape)


class FlatLoraMisalignedTwin(FlatGroupedLoraMoE):
    """Edit: the adapter of the next expert (``(g * per_group + j + 1) % num_experts``)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        group_w, group_idx = _top_k(self.group_gate, x, 1)
        y = torch.zeros_like(x)
        for g in range(GROUPS):
            rows = torch.where(group_idx[:, 0] == g)[0]
            xg = x[rows]
            w, idx = torch.softmax(self.expert_gates[g](xg), dim=-1).max(dim=-1)
            for j in range(self.per_group):
                tok = torch.where(idx == j)[0]
                h = self.experts[g * self.per_group + j](xg[tok])
                out = h + self.lora[(g * self.per_group + j + 1) % self.num_experts](h)
                y.index_add_(0, rows[tok], out * (w[tok] * group_w[rows[tok], 0])[:, None])
        return y.reshape(hidden_states.shape)


class GroupRouterOnExpertRowsTwin(GroupedRoutingMoE):
    """Edit: the group's router is called again on the rows its experts got, and scales their output."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        group_w, group_idx = _top_k(self.group_gate, x, 1)
        y = torch.zeros_like(x)
        for g in range(len(self.experts)):
            rows = torch.where(group_idx[:, 0] == g)[0]
            xg = x[rows]
            w, idx = torch.softmax(self.expert_gates[g](xg), dim=-1).max(dim=-1)
            for j in range(len(self.experts[g])):
                tok = torch.where(idx == j)[0]
                out = self.experts[g][j](xg[tok]) * self.expert_gates[g](xg[tok])[:, j:j + 1]
                y.index_add_(0, rows[tok], out)
        return y.reshape(hidden_states.shape)


# ---------------------------------------------------------------------------------------------
# Experts that slice their own weights
# ---------------------------------------------------------------------------------------------


class FusedSwiGLU(nn.Module):
    """A SwiGLU expert with gate and up fused in one Linear (as fused checkpoints keep them), split in its
    forward: ``w1, w3 = self.w13.weight.split(F, dim=0)``."""

    def __init__(self):
        super().__init__()
        self.hidden = FF
        self.w13 = nn.Linear(D, 2 * FF, bias=False)
        self.w2 = nn.Linear(FF, D, bias=False)

    def forward(self, x):
        w1, w3 = self.w13.weight.split(self.hidden, dim=0)
        return self.w2(F.silu(F.linear(x, w1)) * F.linear(x, w3))


class ChunkedSwiGLU(FusedSwiGLU):
    """The same with ``chunk`` and a slice of the down weight (``self.w2.weight[:, : self.hidden]``)."""

    def forward(self, x):
        gate_w, up_w = self.w13.weight.chunk(2, dim=0)
        h = F.silu(x @ gate_w.t()) * (x @ up_w.t())
        return F.linear(h, self.w2.weight[:, : self.hidden])


class SlicedWeightsMoE(nn.Module):
    def __init__(self, expert: type = FusedSwiGLU):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([expert() for _ in range(E)])

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class SplitRowsSwiGLU(FusedSwiGLU):
    """Edit: the rows are split (``x.split(n, dim=0)``) and the halves' roles swapped: row i reads row i + n."""

    def forward(self, x):
        w1, w3 = self.w13.weight.split(self.hidden, dim=0)
        a, b = x.split(x.shape[0] // 2, dim=0)
        return self.w2(F.silu(F.linear(torch.cat([b, a]), w1)) * F.linear(x, w3))


BLOCKS = {
    "two_wrappers": TwoWrappersMoE,
    "three_wrappers": ThreeWrappersMoE,
    "wrapper_aux_tuple": AuxTupleMoE,
    "wrapper_aux_state": AuxStateMoE,
    "wrapper_shared_experts": SharedBelowWrapperMoE,
    "per_row_extras": PerRowExtrasMoE,
    "keyword_extras": KeywordExtrasMoE,
    "grouped_routing": GroupedRoutingMoE,
    "flat_grouped_routing": FlatGroupedRoutingMoE,
    "flat_grouped_lora": FlatGroupedLoraMoE,
    "sliced_weights": SlicedWeightsMoE,
    "chunked_weights": lambda: SlicedWeightsMoE(ChunkedSwiGLU),
}

# The soundness fuzzer's targets among BLOCKS (``mutation.replay_targets``): one per mechanism. wrapper_aux_state (a
# tuple returned, state kept) and wrapper_shared_experts (roles below a wrapper) fuzzed once, every mutant
# (``bench/soundness.py --replay --ranks 2 --target replay/<name>`` with them added here): 147, 0 accepted-wrong,
# 0 crashes, 63 exact on 2 ranks; not kept: adding them shifts the sample of tests/detect/test_replay_soundness.py
# onto replay/forward_concat's private_attr mutants, which raise a PlanError (ep_size does not divide num_experts
# 1 or 3) on main too.
FUZZED = ("two_wrappers", "per_row_extras", "grouped_routing", "flat_grouped_lora", "sliced_weights")

# name -> (builder, what the ReplayError raised at the first call names): accepted spellings EP cannot move
RAISES = {
    "bool_mask_extra": (BoolMaskTwin, "of the rows' count and dtype"),
    "optional_param_given": (GivesOptionalTwin, "its forward's parameters without a default"),
    "keyword_optional_given": (KeywordOptionalTwin, "its forward's parameters without a default"),
}

# name -> (builder, what the refusal names)
TWINS = {
    "wrapper_calls_twice": (CallsTwiceTwin, "calls self.moe 2 times"),
    "wrapper_mixes_rows": (MixedRowsTwin, "mixes rows"),
    "wrapper_reads_experts": (ReadsExpertsTwin, "reads self.moe"),
    "wrapper_aux_mixes_rows": (AuxMixedRowsTwin, "mixes rows"),
    "wrapper_reads_back_state": (StateReadBackTwin, "reads self.calls .*which it also writes"),
    "wrapper_state_on_inner": (StateOnInnerTwin, "assigns an attribute"),
    "wrapper_shared_on_some_rows": (SharedOnSomeRowsTwin, "not selected by that id"),
    "wrapper_shared_via_super": (SharedViaSuperTwin, r"super\(\)\.forward\(\.\.\.\) .* reads self\.experts"),
    "whole_table": (WholeTableTwin, "mixes rows"),
    "keyword_whole_table": (KeywordWholeTableTwin, "mixes rows"),
    "group_router_on_expert_rows": (GroupRouterOnExpertRowsTwin, "not selected by that id"),
    "flat_lora_misaligned": (FlatLoraMisalignedTwin, "indexed by the routing loops' ids differently"),
    "split_rows": (lambda: SlicedWeightsMoE(SplitRowsSwiGLU), "reads the number of rows"),
}


class BlockLoopExtrasMoE(nn.Module):
    """The per-row extras passed in the block's own loop (no container forward): ``expert(x[tok], pos[tok], ...)``."""

    def __init__(self):
        super().__init__()
        self.inner = PerRowExtrasMoE()

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        pos_emb = self.inner.rotary[:s].repeat(b, 1)
        keep = (x.abs().sum(-1, keepdim=True) > 0).to(x.dtype)
        topk_w, topk_idx = _top_k(self.inner.gate, x, K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.inner.experts):
            tok, slot = torch.where(topk_idx == i)
            y.index_add_(0, tok, expert(x[tok], pos_emb[tok], topk_w[tok, slot, None], keep[tok]))
        return y.reshape(b, s, h)
