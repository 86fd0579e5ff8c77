"""MoE blocks whose experts are found by role (issue 31, ``autoep.detect.expert_roles``), each with a one-edit
harmful twin that must be refused:

- ``LoraMixture3MoE``: a mixture of LoRA experts on a base layer (MoLoRA/MixLoRA, PEFT's names), one expert across
  three containers aligned by index and called in a chain, ``lora_B[i](lora_A[i](lora_dropout[i](x[tok])))``;
  the dropout container holds no tensor and stays where the token is (its draws as in the model), ``lora_A[i]`` and
  ``lora_B[i]`` lie together on expert i's owner. Twin: ``lora_B[(i + 1) % E]`` (misaligned). ``LoraDictMoE``: the
  same in ModuleDicts keyed by expert name, the loop over their keys.
- ``SharedListMoE``: routed ``experts`` beside a ``shared_experts`` ModuleList run on every token, with capacity
  dropping and in-place router jitter; the shared list stays where the token is. Twin: a shared expert called on
  the routed rows inside the expert loop (a "shared" list routed on some rows). ``DropoutListMoE``: the same with a
  per-expert dropout list indexed by the expert id (no tensor: it stays where the token is, its draws the model's).
- Chains run whole on the owner (``autoep.runtime.recipes.chains``, ``tests/runtime/test_chained_experts.py``):
  ``LoraChain3MoE`` (three modules per expert), ``AdapterMixtureMoE`` (``up[i](F.gelu(down[i](x)))``, an activation
  between the links); chains that must stay one exchange per link, each exact: ``LoraHookedMoE`` (a hook on
  ``lora_A[i]``), ``LoraReadsIntermediateMoE`` and ``AdapterKeepsMoE`` (an intermediate read or kept by the block),
  ``LoraNoGradLinkMoE`` (``no_grad`` around one link), ``AdapterDropoutMoE`` (dropout between the links).
- ``ForwardBuiltMoE``: experts in a list the forward builds (``[self.base_layer] + list(self.adapters)``), a router
  per adapter called on every row (``self.routers``: never sharded). Twin: the list built by a method, which the
  detector does not read (the routers and the adapters are then two containers of unknown role).

Every block takes ``(batch, seq, hidden)`` and returns the same shape. ``BLOCKS`` and ``TWINS`` map a name to a
builder; ``ADAPTERS`` is ``ForwardBuiltMoE``'s default adapter count (E = 1 + ADAPTERS).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from replay_blocks import FF, D, E, FeedForward, K, _top_k

ADAPTERS = E - 1  # ForwardBuiltMoE: the base layer and E - 1 adapters are its E experts
RANK = 4  # LoRA rank


class LoraMixture3MoE(nn.Module):
    """``result = base(x) + sum_i w_i * B[i](A[i](dropout[i](x))) * scaling`` over the top-k LoRA experts."""

    def __init__(self, dropout: float = 0.1):
        super().__init__()
        self.base_layer = nn.Linear(D, D)
        self.router = nn.Linear(D, E, bias=False)
        self.lora_dropout = nn.ModuleList([nn.Dropout(dropout) for _ in range(E)])
        self.lora_A = nn.ModuleList([nn.Linear(D, RANK, bias=False) for _ in range(E)])
        self.lora_B = nn.ModuleList([nn.Linear(RANK, D, bias=False) for _ in range(E)])
        self.scaling = 2.0

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        result = self.base_layer(x)
        weights, selected = _top_k(self.router, x, K)
        for i in range(len(self.lora_A)):
            tok, slot = torch.where(selected == i)
            delta = self.lora_B[i](self.lora_A[i](self.lora_dropout[i](x[tok]))) * self.scaling
            result = result.index_add(0, tok, delta * weights[tok, slot, None])
        return result.reshape(hidden_states.shape)


class LoraMisalignedTwin(LoraMixture3MoE):
    """Edit: ``lora_B[(i + 1) % E]``: the up projection of another expert."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        result = self.base_layer(x)
        weights, selected = _top_k(self.router, x, K)
        for i in range(len(self.lora_A)):
            tok, slot = torch.where(selected == i)
            delta = self.lora_B[(i + 1) % E](self.lora_A[i](self.lora_dropout[i](x[tok]))) * self.scaling
            result = result.index_add(0, tok, delta * weights[tok, slot, None])
        return result.reshape(hidden_states.shape)


class LoraDictMoE(nn.Module):
    """LoRA experts in ModuleDicts keyed by expert name (``lora_A["e2"]``), the loop over the keys."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.lora_A = nn.ModuleDict({f"e{i}": nn.Linear(D, RANK, bias=False) for i in range(E)})
        self.lora_B = nn.ModuleDict({f"e{i}": nn.Linear(RANK, D, bias=False) for i in range(E)})

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        result = x.clone()
        for i, key in enumerate(self.lora_A):
            tok, slot = torch.where(selected == i)
            result[tok] += self.lora_B[key](self.lora_A[key](x[tok])) * weights[tok, slot, None]
        return result.reshape(hidden_states.shape)


class LoraChain3MoE(nn.Module):
    """Three modules per expert in one chain: ``lora_B[i](lora_M[i](lora_A[i](x)))`` (a rank-to-rank mixing
    matrix between the LoRA factors)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.lora_A = nn.ModuleList([nn.Linear(D, RANK, bias=False) for _ in range(E)])
        self.lora_M = nn.ModuleList([nn.Linear(RANK, RANK) for _ in range(E)])
        self.lora_B = nn.ModuleList([nn.Linear(RANK, D, bias=False) for _ in range(E)])

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        y = x.clone()
        for i in range(E):
            tok, slot = torch.where(selected == i)
            y = y.index_add(0, tok, self.lora_B[i](self.lora_M[i](self.lora_A[i](x[tok]))) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class LoraHookedMoE(LoraMixture3MoE):
    """A forward hook on each ``lora_A[i]`` (``attach_hooks``, after apply) noting every call, at the caller."""

    def attach_hooks(self):
        self.notes = []
        for i, module in enumerate(self.lora_A):
            module.register_forward_hook(lambda m, args, out, i=i: self.notes.append((i, tuple(out.shape))))

    def visible_state(self):
        return {"notes": list(self.notes)}


class LoraReadsIntermediateMoE(LoraMixture3MoE):
    """The block reads expert 0's intermediate (``h + h.mean(-1)``, a taped call on it) and keeps expert 1's
    (``self.kept``): those two chains stay staged, the others fuse (outputs of two widths in one exchange)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        result = self.base_layer(x)
        weights, selected = _top_k(self.router, x, K)
        self.kept = []
        for i in range(len(self.lora_A)):
            tok, slot = torch.where(selected == i)
            h = self.lora_A[i](self.lora_dropout[i](x[tok]))
            if i == 1:
                self.kept.append(h)
            delta = self.lora_B[i](h) * self.scaling
            if i == 0:
                delta = delta + h.mean(-1, keepdim=True)
            result = result.index_add(0, tok, delta * weights[tok, slot, None])
        return result.reshape(hidden_states.shape)

    def visible_state(self):
        return {"kept": list(self.kept)}


class LoraNoGradLinkMoE(LoraMixture3MoE):
    """``lora_A`` frozen by ``torch.no_grad()`` around its call, ``lora_B`` trained: a context change inside the
    chain (each link keeps its own)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        result = self.base_layer(x)
        weights, selected = _top_k(self.router, x, K)
        for i in range(len(self.lora_A)):
            tok, slot = torch.where(selected == i)
            with torch.no_grad():
                h = self.lora_A[i](self.lora_dropout[i](x[tok]))
            delta = self.lora_B[i](h) * self.scaling
            result = result.index_add(0, tok, delta * weights[tok, slot, None])
        return result.reshape(hidden_states.shape)


class AdapterMixtureMoE(nn.Module):
    """A mixture of bottleneck adapters (AdaMix/MoA style): ``up[i](F.gelu(down[i](x[tok])))``, an activation
    between the two modules of each expert."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.down = nn.ModuleList([nn.Linear(D, RANK) for _ in range(E)])
        self.up = nn.ModuleList([nn.Linear(RANK, D) for _ in range(E)])

    def activation(self, h):
        return F.gelu(h)

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        y = x.clone()
        for i in range(E):
            tok, slot = torch.where(selected == i)
            y = y.index_add(0, tok, self.up[i](self.activation(self.down[i](x[tok]))) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class AdapterDropoutMoE(AdapterMixtureMoE):
    """Dropout between the adapter's modules: its draws stay where the token is, in the forward's order."""

    def activation(self, h):
        return F.dropout(h, 0.2, self.training)


class AdapterKeepsMoE(AdapterMixtureMoE):
    """The block keeps expert 0's activation output and expert 1's first output (``self.kept``): those two chains
    stay staged (each value the block holds, with the tape's other references to its chain put back)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.router, x, K)
        y = x.clone()
        self.kept = []
        for i in range(E):
            tok, slot = torch.where(selected == i)
            h = self.down[i](x[tok])
            a = F.gelu(h)
            if i < 2:
                self.kept.append(a if i == 0 else h)
            y = y.index_add(0, tok, self.up[i](a) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)

    def visible_state(self):
        return {"kept": list(self.kept)}


class SharedListMoE(nn.Module):
    """Routed experts with capacity dropping (each keeps its first ``capacity`` tokens) and router jitter applied
    in place while training, plus a list of shared experts every token goes through."""

    def __init__(self, shared: int = 2, capacity: int = 5):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([FeedForward() for _ in range(E)])
        self.shared_experts = nn.ModuleList([FeedForward(D, FF // 2) for _ in range(shared)])
        self.capacity = capacity
        self.jitter_eps = 0.1

    def route(self, x):
        logits_in = x.clone()
        if self.training:
            logits_in.mul_(torch.empty_like(x).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps))
        return _top_k(self.gate, logits_in, K)

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = self.route(x)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == i)
            tok, slot = tok[: self.capacity], slot[: self.capacity]
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        for shared in self.shared_experts:
            y = y + shared(x)
        return y.reshape(hidden_states.shape)


class DropoutListMoE(SharedListMoE):
    """Routed experts with a per-expert dropout list beside them (``expert_dropout[i](x[tok])``)."""

    def __init__(self):
        super().__init__()
        self.expert_dropout = nn.ModuleList([nn.Dropout(0.1) for _ in range(E)])

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = self.route(x)
        y = torch.zeros_like(x)
        for i in range(len(self.experts)):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, self.experts[i](self.expert_dropout[i](x[tok])) * weights[tok, slot, None])
        for shared in self.shared_experts:
            y = y + shared(x)
        return y.reshape(hidden_states.shape)


class SharedOnRoutedRowsTwin(SharedListMoE):
    """Edit: the first shared expert is called on each expert's routed rows, inside the expert loop."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = self.route(x)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == i)
            tok, slot = tok[: self.capacity], slot[: self.capacity]
            y.index_add_(0, tok, (expert(x[tok]) + self.shared_experts[0](x[tok])) * weights[tok, slot, None])
        for shared in self.shared_experts:
            y = y + shared(x)
        return y.reshape(hidden_states.shape)


class ForwardBuiltMoE(nn.Module):
    """A base layer and adapters as experts, listed in the forward; the base layer's score from a gate of its own,
    each adapter's from its router (one ``Linear(D, 1)`` per adapter, called on every row)."""

    def __init__(self, adapters: int = ADAPTERS):
        super().__init__()
        self.base_layer = FeedForward()
        self.base_gate = nn.Linear(D, 1, bias=False)
        self.adapters = nn.ModuleList([FeedForward(D, FF // 2) for _ in range(adapters)])
        self.routers = nn.ModuleList([nn.Linear(D, 1, bias=False) for _ in range(adapters)])

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        experts = [self.base_layer] + list(self.adapters)
        logits = torch.cat([self.base_gate(x)] + [router(x) for router in self.routers], dim=-1)
        weights, selected = torch.topk(logits.softmax(dim=-1), min(K, len(experts)), dim=-1)
        y = torch.zeros_like(x)
        for i, expert in enumerate(experts):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class ForwardBuiltByMethodTwin(ForwardBuiltMoE):
    """Edit: the list comes from a method (``self.active()``), which the detector does not read."""

    def active(self):
        return [self.base_layer] + list(self.adapters)

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        experts = self.active()
        logits = torch.cat([self.base_gate(x)] + [router(x) for router in self.routers], dim=-1)
        weights, selected = torch.topk(logits.softmax(dim=-1), min(K, len(experts)), dim=-1)
        y = torch.zeros_like(x)
        for i, expert in enumerate(experts):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


BLOCKS = {
    "lora_mixture_3": LoraMixture3MoE,
    "lora_dict": LoraDictMoE,
    "shared_list": SharedListMoE,
    "dropout_list": DropoutListMoE,
    "forward_built": ForwardBuiltMoE,
    "adapter_mixture": AdapterMixtureMoE,
}

# name -> (builder, what the refusal names)
TWINS = {
    "lora_misaligned": (LoraMisalignedTwin, "not selected by that id"),
    "shared_on_routed_rows": (SharedOnRoutedRowsTwin, "not selected by that id"),
    "forward_built_by_method": (ForwardBuiltByMethodTwin, "ambiguous"),
}
