"""MoE blocks for the doors a block's forward opens when it runs more than once (issue 30), each as a benign twin
(exact under EP) and a harmful one (exact, or ``ReplayError``/``UnsupportedModuleStructure`` on every rank):
side effects outside the block's locals, hooks on the experts and the gate, chained experts, attributes and
globals the experts read, DeepSeek's ``@torch.no_grad()`` eval path, context opened around the expert calls,
host reads of expert outputs, and ranks with no tokens.

Every block takes ``(batch, seq, hidden)``; ``visible_state()`` returns what its forward leaves behind that
Python can see (counters, lists, hook stores, buffers, globals), as plain values and tensors. ``shared_state()``
/ ``load_shared_state()`` copy and restore what lives outside the instances (module globals here and in
``one_pass_stats``, class attributes, default arguments, the log), so a test starts the model's run and the EP
run from the same. ``CASES`` maps a case name to its builder and what EP must do with it.
"""

from __future__ import annotations

import collections
import copy
import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import blocks
import numpy as np
import one_pass_stats
import role_blocks
import role_blocks_attrs
import torch
import torch.nn.functional as F
import wrapper_blocks
from replay_blocks import FF, D, E, FeedForward, K, _top_k
from torch import nn

_EXPERT_TEMPERATURE = 1.0  # read by TemperedExpert.forward, set by GlobalTemperatureMoE.forward
_LAST_TOKENS = 0  # set by GlobalNoteMoE.forward, read by nobody


class _LoopMoE(nn.Module):
    """Softmax top-k and a Mixtral-style loop over module experts; each door block adds one thing to it."""

    def __init__(self, expert: type = FeedForward):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([expert() for _ in range(E)])

    def combine(self, x, weights, selected):
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == e)
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return y

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        return self.combine(x, weights, selected).reshape(hidden_states.shape)

    def visible_state(self) -> dict:
        return {}


# ---------------------------------------------------------------------------------------------
# Side effects outside the block's locals: each must happen once per call, as in the model
# ---------------------------------------------------------------------------------------------


class LoadByDataMoE(_LoopMoE):
    """torchtitan's tokens-per-expert buffer, accumulated through ``.data`` (no autograd record of it)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("tokens_per_expert", torch.zeros(E), persistent=False)

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        self.tokens_per_expert.data += torch.bincount(selected.flatten(), minlength=E).float()
        return self.combine(x, weights, selected).reshape(hidden_states.shape)

    def visible_state(self):
        return {"tokens_per_expert": self.tokens_per_expert.clone()}


class BiasByDataMoE(_LoopMoE):
    """Harmful: DeepSeek-V3's aux-loss-free balancing updated in the forward through ``.data``; the bias picks the
    experts of the next call."""

    def __init__(self):
        super().__init__()
        self.register_buffer("e_score_correction_bias", torch.zeros(E), persistent=False)

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        scores = self.gate(x).sigmoid()
        _, selected = torch.topk(scores + self.e_score_correction_bias, K, dim=-1)
        weights = scores.gather(-1, selected)
        weights = weights / weights.sum(-1, keepdim=True)
        load = torch.bincount(selected.flatten(), minlength=E).float()
        self.e_score_correction_bias.data += 0.05 * torch.sign(load.mean() - load)
        return self.combine(x, weights, selected).reshape(hidden_states.shape)

    def visible_state(self):
        return {"e_score_correction_bias": self.e_score_correction_bias.clone()}


class NumpyStatsMoE(_LoopMoE):
    """Hits per expert counted in numpy, through a view of a CPU tensor (torch sees no write)."""

    def __init__(self):
        super().__init__()
        self.hits = torch.zeros(E, dtype=torch.int64)
        self.hits_np = self.hits.numpy()

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        np.add.at(self.hits_np, selected.flatten().numpy(), 1)
        return self.combine(x, weights, selected).reshape(hidden_states.shape)

    def visible_state(self):
        return {"hits": self.hits.clone()}


class NumpyStatsScaledMoE(NumpyStatsMoE):
    """Harmful: the numpy counts scale the output."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        np.add.at(self.hits_np, selected.flatten().numpy(), 1)
        scale = 1.0 / (1.0 + 0.01 * float(self.hits_np.sum()))
        return (self.combine(x, weights, selected) * scale).reshape(hidden_states.shape)


class OtherModuleListMoE(_LoopMoE):
    """Tokens per expert appended to a list in another module of the project."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        one_pass_stats.ROUTED.append(torch.bincount(selected.flatten(), minlength=E).tolist())
        return self.combine(x, weights, selected).reshape(hidden_states.shape)

    def visible_state(self):
        return {"routed": copy.deepcopy(one_pass_stats.ROUTED)}


class OtherModuleTensorMoE(_LoopMoE):
    """Harmful: another module's load tensor, added to in place by its own function, scales the output."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        mean_load = one_pass_stats.add_load(selected)
        return (self.combine(x, weights, selected) / (1.0 + 0.01 * mean_load)).reshape(hidden_states.shape)

    def visible_state(self):
        return {"load": one_pass_stats.LOAD.clone()}


class MutableDefaultMoE(_LoopMoE):
    """The batch sizes seen, appended to a mutable default argument of forward (one list for the class)."""

    def forward(self, hidden_states, history=[]):  # noqa: B006 - the door under test
        history.append(hidden_states.shape[0])
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        return self.combine(x, weights, selected).reshape(hidden_states.shape)

    def visible_state(self):
        return {"history": list(type(self).forward.__defaults__[0])}


class MutableDefaultScaledMoE(MutableDefaultMoE):
    """Harmful: the default list's length scales the output."""

    def forward(self, hidden_states, history=[]):  # noqa: B006 - the door under test
        history.append(hidden_states.shape[0])
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        return (self.combine(x, weights, selected) * (1.0 + 0.1 * len(history))).reshape(hidden_states.shape)


class RoutingTracker:
    """A helper object whose class holds the history (one list for every instance)."""

    history: list = []  # noqa: RUF012 - the door under test

    def log(self, counts: list[int]) -> int:
        self.history.append(counts)
        return len(self.history)


class ClassListMoE(_LoopMoE):
    def __init__(self):
        super().__init__()
        self.tracker = RoutingTracker()

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        self.tracker.log(torch.bincount(selected.flatten(), minlength=E).tolist())
        return self.combine(x, weights, selected).reshape(hidden_states.shape)

    def visible_state(self):
        return {"history": copy.deepcopy(RoutingTracker.history)}


class ClassListScaledMoE(ClassListMoE):
    """Harmful: the class-level history's length scales the output."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        seen = self.tracker.log(torch.bincount(selected.flatten(), minlength=E).tolist())
        return (self.combine(x, weights, selected) * (1.0 + 0.1 * seen)).reshape(hidden_states.shape)


class NestedStatsMoE(_LoopMoE):
    """Router statistics in nested dicts (calls, tokens per expert)."""

    def __init__(self):
        super().__init__()
        self.stats = {"router": {"calls": 0, "tokens": {e: 0 for e in range(E)}}}

    def count(self, selected) -> int:
        router = self.stats["router"]
        router["calls"] += 1
        for e, n in enumerate(torch.bincount(selected.flatten(), minlength=E).tolist()):
            router["tokens"][e] += n
        return router["calls"]

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        self.count(selected)
        return self.combine(x, weights, selected).reshape(hidden_states.shape)

    def visible_state(self):
        return copy.deepcopy(self.stats)


class NestedStatsScaledMoE(NestedStatsMoE):
    """Harmful: the nested call count scales the output."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        calls = self.count(selected)
        return (self.combine(x, weights, selected) * (1.0 + 0.1 * calls)).reshape(hidden_states.shape)


@dataclass(slots=True)
class StepCounter:
    calls: int = 0
    tokens: int = 0


class SlotsCounterMoE(_LoopMoE):
    """Calls and tokens counted in a ``__slots__`` dataclass (no ``__dict__`` to snapshot)."""

    def __init__(self):
        super().__init__()
        self.counter = StepCounter()

    def forward(self, hidden_states):
        self.counter.calls += 1
        self.counter.tokens += hidden_states.shape[0] * hidden_states.shape[1]
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        return self.combine(x, weights, selected).reshape(hidden_states.shape)

    def visible_state(self):
        return {"calls": self.counter.calls, "tokens": self.counter.tokens}


class SlotsCounterScaledMoE(SlotsCounterMoE):
    """Harmful: the slotted call count scales the output."""

    def forward(self, hidden_states):
        self.counter.calls += 1
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        return (self.combine(x, weights, selected) * (1.0 + 0.1 * self.counter.calls)).reshape(hidden_states.shape)


class CallIdsMoE(_LoopMoE):
    """Each call numbered by an ``itertools.count`` (no state to read back but by advancing it)."""

    def __init__(self):
        super().__init__()
        self.call_ids = itertools.count()
        self.last_call_id = None

    def forward(self, hidden_states):
        self.last_call_id = next(self.call_ids)
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        return self.combine(x, weights, selected).reshape(hidden_states.shape)

    def visible_state(self):
        return {"last_call_id": self.last_call_id, "call_ids": repr(self.call_ids)}


class CallIdsScaledMoE(CallIdsMoE):
    """Harmful: the call number scales the output."""

    def forward(self, hidden_states):
        self.last_call_id = next(self.call_ids)
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        return (self.combine(x, weights, selected) * (1.0 + 0.1 * self.last_call_id)).reshape(hidden_states.shape)


class _Records(logging.Handler):
    """Keeps every record's message."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


ROUTER_LOG = logging.getLogger("one_pass_blocks.router")
ROUTER_LOG.setLevel(logging.DEBUG)
ROUTER_LOG.propagate = False
ROUTER_RECORDS = _Records()
ROUTER_LOG.addHandler(ROUTER_RECORDS)


class LoggedLoadMoE(_LoopMoE):
    """Tokens per expert logged at debug level (a handler collects the records)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        ROUTER_LOG.debug("tokens per expert: %s", torch.bincount(selected.flatten(), minlength=E).tolist())
        return self.combine(x, weights, selected).reshape(hidden_states.shape)

    def visible_state(self):
        return {"records": list(ROUTER_RECORDS.messages)}


class LoggedLoadScaledMoE(LoggedLoadMoE):
    """Harmful: the number of records logged so far scales the output."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        ROUTER_LOG.debug("tokens per expert: %s", torch.bincount(selected.flatten(), minlength=E).tolist())
        scale = 1.0 + 0.1 * len(ROUTER_RECORDS.messages)
        return (self.combine(x, weights, selected) * scale).reshape(hidden_states.shape)


class JitterMoE(_LoopMoE):
    """Switch's router jitter while training, drawn from a generator the block holds."""

    def __init__(self):
        super().__init__()
        self.jitter = torch.Generator().manual_seed(0)

    def noise(self, x):
        return torch.empty_like(x).uniform_(0.9, 1.1, generator=self.jitter)

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x * self.noise(x) if self.training else x, K)
        return self.combine(x, weights, selected).reshape(hidden_states.shape)

    def visible_state(self):
        return {"jitter": self.jitter.get_state()}


class JitterElsewhereMoE(JitterMoE):
    """Harmful: the jitter's generator is another module's (``one_pass_stats.NOISE``)."""

    def noise(self, x):
        return torch.empty_like(x).uniform_(0.9, 1.1, generator=one_pass_stats.NOISE)

    def visible_state(self):
        return {"noise": one_pass_stats.NOISE.get_state()}


class ExpertDropoutMoE(_LoopMoE):
    """Expert dropout while training: which experts run this call is drawn on the host by a numpy generator the
    block holds (a dropped expert's tokens get nothing from it)."""

    def __init__(self):
        super().__init__()
        self.rng = np.random.default_rng(0)

    def draw(self):
        return self.rng.random(E)

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        keep = self.draw() >= 0.25 if self.training else np.ones(E, dtype=bool)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            if not keep[e]:
                continue
            tok, slot = torch.where(selected == e)
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)

    def visible_state(self):
        return {"rng": self.rng.bit_generator.state}


class ExpertDropoutElsewhereMoE(ExpertDropoutMoE):
    """Harmful: the numpy generator is another module's (``one_pass_stats.NP_RNG``)."""

    def draw(self):
        return one_pass_stats.NP_RNG.random(E)

    def visible_state(self):
        return {"np_rng": one_pass_stats.NP_RNG.bit_generator.state}


class HitCounterMoE(_LoopMoE):
    """A ``collections.Counter`` of expert hits on the block."""

    def __init__(self):
        super().__init__()
        self.expert_hits = collections.Counter()

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        self.expert_hits.update(selected.flatten().tolist())
        return self.combine(x, weights, selected).reshape(hidden_states.shape)

    def visible_state(self):
        return {"expert_hits": dict(self.expert_hits)}


class HitCounterScaledMoE(HitCounterMoE):
    """Harmful: each expert's output damped by its hits so far (load-aware scaling)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        self.expert_hits.update(selected.flatten().tolist())
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == e)
            damp = 1.0 / (1.0 + 0.01 * self.expert_hits[e])
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None] * damp)
        return y.reshape(hidden_states.shape)


# ---------------------------------------------------------------------------------------------
# Hooks on the experts and the gate: once per call, on the caller's rows, as in the model
# ---------------------------------------------------------------------------------------------


def _count_rows(store: list, e: int, module, args):
    store[e] += args[0].shape[0]


def _halve_rows(store: list, e: int, module, args):
    store[e] += args[0].shape[0]
    return (args[0] * 0.5,)


def _keep_output_sum(store: list, e: int, module, args, output):
    store.append((e, output.detach().sum(0)))


def _scale_output(store: list, e: int, module, args, output):
    store[e] += output.shape[0]
    return output * (1.0 + 0.25 * e)


def _keep_logits(store: list, module, args, output):
    store.append(output.detach().clone())


def _temper_logits(store: list, module, args, output):
    store.append(output.shape[0])
    return output / (1.0 + 0.5 * len(store))


class HookedMoE(_LoopMoE):
    """Hooks writing into a store on the block: on the gate at construction, on the experts by ``attach_hooks``
    (a profiler attaching to the built model: the harness calls it after ``apply_plan``)."""

    PRE_HOOK = OUTPUT_HOOK = GATE_HOOK = None
    APPENDS = False  # the store is a list the hooks append to, else a row count per expert

    def __init__(self):
        super().__init__()
        cls = type(self)
        self.store = [] if cls.APPENDS else [0] * E
        if cls.GATE_HOOK:
            self.gate.register_forward_hook(functools.partial(cls.GATE_HOOK, self.store))

    def attach_hooks(self):
        cls = type(self)
        for e, expert in enumerate(self.experts):
            if cls.PRE_HOOK:
                expert.register_forward_pre_hook(functools.partial(cls.PRE_HOOK, self.store, e))
            if cls.OUTPUT_HOOK:
                expert.register_forward_hook(functools.partial(cls.OUTPUT_HOOK, self.store, e))

    def visible_state(self):
        return {"store": [tuple(entry) if isinstance(entry, tuple) else entry for entry in self.store]}


class PreHookRowsMoE(HookedMoE):
    """Forward pre-hooks counting the rows each expert gets."""

    PRE_HOOK = _count_rows


class PreHookRowsAtInitMoE(PreHookRowsMoE):
    """The same pre-hooks, registered by the block's own constructor (before the plan is resolved)."""

    def __init__(self):
        super().__init__()
        self.attach_hooks()


class OutputHookStoreMoE(HookedMoE):
    """Forward hooks keeping each call's detached output sum (a profiler's activation stats)."""

    OUTPUT_HOOK = _keep_output_sum
    APPENDS = True


class PreHookHalvesMoE(HookedMoE):
    """Harmful: pre-hooks halving each expert's input (and counting its rows)."""

    PRE_HOOK = _halve_rows


class OutputHookScalesMoE(HookedMoE):
    """Harmful: forward hooks scaling each expert's output by a per-expert factor (and counting its rows)."""

    OUTPUT_HOOK = _scale_output


class GateHookLogitsMoE(HookedMoE):
    """A forward hook on the gate collecting the router logits."""

    GATE_HOOK = _keep_logits
    APPENDS = True


class GateHookTemperMoE(HookedMoE):
    """Harmful: a forward hook on the gate tempering its logits by the number of calls it has seen."""

    GATE_HOOK = _temper_logits
    APPENDS = True


# ---------------------------------------------------------------------------------------------
# Chained experts: data flows through an expert's output into another expert's input
# ---------------------------------------------------------------------------------------------


class ReZeroMoE(_LoopMoE):
    """A learned scale initialised at 0 (ReZero) on each expert's output; not fed to another expert."""

    def __init__(self):
        super().__init__()
        self.rezero = nn.Parameter(torch.zeros(()))

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        y = x.clone()
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == e)
            y.index_add_(0, tok, self.rezero * expert(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class ReZeroChainMoE(ReZeroMoE):
    """Harmful: the next expert reads ``x + rezero * h``: at rezero = 0 its input equals ``x`` bit for bit, but
    the scale's gradient comes through the next expert."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == e)
            h = expert(x[tok])
            h = h + self.experts[(e + 1) % E](x[tok] + self.rezero * h)
            y.index_add_(0, tok, h * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class StraightThroughRouterMoE(_LoopMoE):
    """Top-1 with a straight-through estimator: hard one-hot weights forward, the softmax's gradient backward."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        probs = F.softmax(self.gate(x), dim=-1)
        idx = probs.argmax(dim=-1)
        hard = F.one_hot(idx, E).to(probs.dtype)
        weights = hard - probs.detach() + probs
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = idx == e
            y[mask] = expert(x[mask]) * weights[mask, e, None]
        return y.reshape(hidden_states.shape)


class StraightThroughChainMoE(_LoopMoE):
    """Harmful: the next expert reads ``x + (h - h.detach())``: the rows as they are, forward; the first expert's
    output's gradient, backward."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == e)
            h = expert(x[tok])
            h = h + self.experts[(e + 1) % E](x[tok] + (h - h.detach()))
            y.index_add_(0, tok, h * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class LoraMixtureMoE(nn.Module):
    """A mixture of LoRA experts on a frozen-style base layer (MoLoRA/MixLoRA): ``B[i](A[i](dropout(x)))``,
    ``B`` initialised at 0 as PEFT does."""

    def __init__(self, rank: int = 4):
        super().__init__()
        self.base_layer = nn.Linear(D, D)
        self.router = nn.Linear(D, E, bias=False)
        self.lora_dropout = nn.Dropout(0.1)
        self.lora_A = nn.ModuleList([nn.Linear(D, rank, bias=False) for _ in range(E)])
        self.lora_B = nn.ModuleList([nn.Linear(rank, D, bias=False) for _ in range(E)])
        for b in self.lora_B:
            nn.init.zeros_(b.weight)
        self.scaling = 2.0

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        result = self.base_layer(x)
        weights, selected = _top_k(self.router, x, K)
        for i in range(E):
            tok, slot = torch.where(selected == i)
            delta = self.lora_B[i](self.lora_A[i](self.lora_dropout(x[tok]))) * self.scaling
            result = result.index_add(0, tok, delta * weights[tok, slot, None])
        return result.reshape(hidden_states.shape)


# ---------------------------------------------------------------------------------------------
# State the block sets for its experts before calling them
# ---------------------------------------------------------------------------------------------


class ScaledExpert(FeedForward):
    """An expert whose output is scaled by an attribute its block sets."""

    output_scale = 1.0

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x))) * self.output_scale


class TemperedExpert(FeedForward):
    """An expert that divides its output by a module global its block sets."""

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x))) / _EXPERT_TEMPERATURE


class NotesOnExpertsMoE(_LoopMoE):
    """Each expert gets its call's row count as an attribute (read by nobody but a profiler)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == e)
            expert.last_rows = len(tok)
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)

    def visible_state(self):
        return {"last_rows": [getattr(expert, "last_rows", None) for expert in self.experts]}


class SetsExpertScaleMoE(_LoopMoE):
    """Harmful: each expert's ``output_scale`` set from its call's row count just before the call."""

    def __init__(self):
        super().__init__(ScaledExpert)

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == e)
            expert.output_scale = 1.0 / (1.0 + len(tok))
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)

    def visible_state(self):
        return {"output_scale": [expert.output_scale for expert in self.experts]}


class GlobalNoteMoE(_LoopMoE):
    """The call's token count kept in a module global (read by nobody but the tests)."""

    def forward(self, hidden_states):
        global _LAST_TOKENS
        x = hidden_states.reshape(-1, D)
        _LAST_TOKENS = x.shape[0]
        weights, selected = _top_k(self.gate, x, K)
        return self.combine(x, weights, selected).reshape(hidden_states.shape)

    def visible_state(self):
        return {"_LAST_TOKENS": _LAST_TOKENS}


class GlobalTemperatureMoE(_LoopMoE):
    """Harmful: the experts' temperature, a module global they read, set from the call's token count."""

    def __init__(self):
        super().__init__(TemperedExpert)

    def forward(self, hidden_states):
        global _EXPERT_TEMPERATURE
        x = hidden_states.reshape(-1, D)
        _EXPERT_TEMPERATURE = 1.0 + x.shape[0] / 8
        weights, selected = _top_k(self.gate, x, K)
        return self.combine(x, weights, selected).reshape(hidden_states.shape)

    def visible_state(self):
        return {"_EXPERT_TEMPERATURE": _EXPERT_TEMPERATURE}


# ---------------------------------------------------------------------------------------------
# DeepSeek's remote code: a train path, and ``moe_infer`` under ``@torch.no_grad()`` in eval
# ---------------------------------------------------------------------------------------------


class DeepseekStyleMoE(_LoopMoE):
    """DeepSeek's remote-code shape: a train path in the forward, ``moe_infer`` under ``@torch.no_grad()`` in
    eval (its sorted-token loop: host counts, empty experts skipped, outputs put back by the sort)."""

    def forward(self, hidden_states):
        orig_shape = hidden_states.shape
        x = hidden_states.view(-1, D)
        topk_weight, topk_idx = _top_k(self.gate, x, K)
        if not self.training:
            return self.moe_infer(x, topk_idx, topk_weight).view(*orig_shape)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            tok, slot = torch.where(topk_idx == i)
            y.index_add_(0, tok, expert(x[tok]) * topk_weight[tok, slot, None])
        return y.view(*orig_shape)

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        tokens_per_expert = torch.bincount(topk_ids.flatten(), minlength=E)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        outputs, start_idx = [], 0
        for i, num_tokens in enumerate(tokens_per_expert.tolist()):
            end_idx = start_idx + num_tokens
            if num_tokens == 0:
                continue
            outputs.append(self.experts[i](sorted_tokens[start_idx:end_idx]))
            start_idx = end_idx
        outs = torch.cat(outputs, dim=0) if outputs else sorted_tokens.new_empty(0, D)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        return (new_x.view(*topk_ids.shape, D) * topk_weight.unsqueeze(-1)).sum(dim=1)


class DeepseekEvalCountsMoE(DeepseekStyleMoE):
    """Harmful: its ``moe_infer`` also counts tokens per expert into a buffer, in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("eval_tokens", torch.zeros(E), persistent=False)

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        self.eval_tokens += torch.bincount(topk_ids.flatten(), minlength=E).float()
        return super().moe_infer(x, topk_ids, topk_weight)

    def visible_state(self):
        return {"eval_tokens": self.eval_tokens.clone()}


def deepseek_remote():
    """tests/blocks.py's copy of modeling_deepseek.py's DeepseekV2MoE (masked assignment while training)."""
    return blocks.DeepseekRemoteMoE(hidden=D, ffn=FF, num_experts=E, top_k=K)


# ---------------------------------------------------------------------------------------------
# Context opened around the expert calls inside the forward
# ---------------------------------------------------------------------------------------------


class AutocastExpertsMoE(_LoopMoE):
    """The expert calls under ``torch.autocast('cpu', dtype=torch.bfloat16)``, summed in float32."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == e)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = expert(x[tok])
            y.index_add_(0, tok, h.float() * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class AutocastEvenExpertsMoE(_LoopMoE):
    """Harmful: autocast for the even experts only (the context differs call to call)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == e)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=e % 2 == 0):
                h = expert(x[tok])
            y.index_add_(0, tok, h.float() * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class NoGradExpertsMoE(_LoopMoE):
    """The expert calls under ``torch.no_grad()`` (frozen experts; the router still learns)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == e)
            with torch.no_grad():
                h = expert(x[tok])
            y.index_add_(0, tok, h * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class Bf16AccumulatorMoE(_LoopMoE):
    """Expert outputs accumulated in a bfloat16 buffer, cast back at the end."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        acc = torch.zeros(x.shape, dtype=torch.bfloat16)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == e)
            acc.index_add_(0, tok, (expert(x[tok]) * weights[tok, slot, None]).to(torch.bfloat16))
        return acc.to(x.dtype).reshape(hidden_states.shape)


# ---------------------------------------------------------------------------------------------
# Host reads: of expert outputs (harmful: the value is not there yet) and of everything else (benign)
# ---------------------------------------------------------------------------------------------


class RescaleLoopMoE(_LoopMoE):
    """Harmful: small expert outputs doubled until they are not, on the host."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == e)
            if len(tok) == 0:
                continue
            out = expert(x[tok])
            while out.abs().max() < 0.1:
                out = out * 2
            y.index_add_(0, tok, out * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class RescaleWhereMoE(_LoopMoE):
    """The same rescale as tensor ops: no host read."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == e)
            out = expert(x[tok])
            out = torch.where(out.abs().amax(-1, keepdim=True) < 0.1, out * 2, out)
            y.index_add_(0, tok, out * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class NanGuardMoE(_LoopMoE):
    """Harmful: a NaN guard on each expert's output, on the host."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == e)
            out = expert(x[tok])
            if torch.isnan(out).any():
                raise FloatingPointError(f"expert {e} returned NaN")
            y.index_add_(0, tok, out * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class NanGuardLogitsMoE(_LoopMoE):
    """A NaN guard on the router logits (no expert output read)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        logits = self.gate(x)
        if torch.isnan(logits).any():
            raise FloatingPointError("router logits are NaN")
        weights, selected = torch.topk(logits.softmax(-1), K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return self.combine(x, weights, selected).reshape(hidden_states.shape)


class MaxNormMoE(_LoopMoE):
    """Harmful: the outputs divided by the largest expert output norm, found by Python's ``max``."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        hits = [torch.where(selected == e) for e in range(E)]
        outs = [expert(x[tok]) for expert, (tok, _) in zip(self.experts, hits)]
        peak = max(out.norm() for out in outs)
        y = torch.zeros_like(x)
        for (tok, slot), out in zip(hits, outs):
            y.index_add_(0, tok, out / peak * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class StackedNormMoE(MaxNormMoE):
    """The same largest norm as a tensor: ``torch.stack(norms).max()``."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        hits = [torch.where(selected == e) for e in range(E)]
        outs = [expert(x[tok]) for expert, (tok, _) in zip(self.experts, hits)]
        peak = torch.stack([out.norm() for out in outs]).max()
        y = torch.zeros_like(x)
        for (tok, slot), out in zip(hits, outs):
            y.index_add_(0, tok, out / peak * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


# ---------------------------------------------------------------------------------------------
# A rank with no tokens
# ---------------------------------------------------------------------------------------------


class UniqueLoopMoE(_LoopMoE):
    """The loop over the experts hit, ``selected.unique().tolist()`` (none on a rank with no tokens)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for e in selected.unique().tolist():
            tok, slot = torch.where(selected == e)
            y[tok] += self.experts[e](x[tok]) * weights[tok, slot, None]
        return y.reshape(hidden_states.shape)


def mixtral_v4():
    return blocks.MixtralStyleSparseMoeBlock(hidden=D, ffn=FF, num_experts=E, top_k=K)


def module_list_subclass():
    return blocks.ExpertStackMoE(hidden=D, ffn=FF, num_experts=E, top_k=K)


class TwoLayerNet(nn.Module):
    """Two MoE blocks with residuals; a v4 block's ``router_logits`` dropped (no aux loss)."""

    def __init__(self, block: Callable[[], nn.Module] = mixtral_v4):
        super().__init__()
        self.layers = nn.ModuleList([block() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            out = layer(x)
            x = x + (out[0] if isinstance(out, tuple) else out)
        return x


# ---------------------------------------------------------------------------------------------
# State outside the instances, and the cases
# ---------------------------------------------------------------------------------------------


def _defaults() -> list[list]:
    return [MutableDefaultMoE.forward.__defaults__[0], MutableDefaultScaledMoE.forward.__defaults__[0]]


def shared_state() -> dict:
    """A copy of every piece of state the blocks keep outside their instances."""
    return copy.deepcopy({
        "routed": one_pass_stats.ROUTED, "load": one_pass_stats.LOAD, "noise": one_pass_stats.NOISE.get_state(),
        "np_rng": one_pass_stats.NP_RNG.bit_generator.state, "defaults": _defaults(),
        "tracker": RoutingTracker.history, "records": ROUTER_RECORDS.messages,
        "globals": {"_EXPERT_TEMPERATURE": _EXPERT_TEMPERATURE, "_LAST_TOKENS": _LAST_TOKENS},
    })


def load_shared_state(state: dict) -> None:
    """Puts ``state`` (from ``shared_state``) back, in place: the blocks hold the same objects after."""
    state = copy.deepcopy(state)
    one_pass_stats.ROUTED[:] = state["routed"]
    one_pass_stats.LOAD.copy_(state["load"])
    one_pass_stats.NOISE.set_state(state["noise"])
    one_pass_stats.NP_RNG.bit_generator.state = state["np_rng"]
    for held, saved in zip(_defaults(), state["defaults"]):
        held[:] = saved
    RoutingTracker.history[:] = state["tracker"]
    ROUTER_RECORDS.messages[:] = state["records"]
    globals().update(state["globals"])


EMPTY_RANK = {1: [4], 2: [0, 3], 4: [2, 0, 3, 1]}  # batch rows per rank: one rank with no tokens


@dataclass(frozen=True)
class Case:
    """A block and what EP must do with it: ``exact``; ``exact_or_raise`` (``ReplayError`` or
    ``UnsupportedModuleStructure`` on every rank); ``raise`` (on every rank, some rank's message containing
    ``names``). ``modes``: one per step, train, eval or inference (eval under ``torch.inference_mode()``).
    ``bf16_grads``: the expert grads are bfloat16 sums over rows, rounded once per call: the owner's one call on
    every rank's rows rounds them otherwise than the model's call per rank (compared up to that rounding; the
    next step starts from the model's parameters)."""

    block: Callable[[], nn.Module]
    expect: str = "exact"
    names: str = ""
    modes: tuple[str, ...] = ("train", "train")
    splits: dict | None = None
    match: str = "mlp"
    bf16_grads: bool = False


def _harmful(block, **kw):
    return Case(block, expect="exact_or_raise", **kw)


CASES: dict[str, Case] = {
    # side effects
    "buffer_data": Case(LoadByDataMoE),
    "buffer_data_routes": _harmful(BiasByDataMoE),
    "numpy_view": Case(NumpyStatsMoE),
    "numpy_view_scales": _harmful(NumpyStatsScaledMoE),
    "other_module_list": Case(OtherModuleListMoE),
    "other_module_tensor_scales": _harmful(OtherModuleTensorMoE),
    "mutable_default": Case(MutableDefaultMoE),
    "mutable_default_scales": _harmful(MutableDefaultScaledMoE),
    "class_list": Case(ClassListMoE),
    "class_list_scales": _harmful(ClassListScaledMoE),
    "nested_dicts": Case(NestedStatsMoE),
    "nested_dicts_scale": _harmful(NestedStatsScaledMoE),
    "slots_counter": Case(SlotsCounterMoE),
    "slots_counter_scales": _harmful(SlotsCounterScaledMoE),
    "itertools_count": Case(CallIdsMoE),
    "itertools_count_scales": _harmful(CallIdsScaledMoE),
    "logging_handler": Case(LoggedLoadMoE),
    "logging_handler_scales": _harmful(LoggedLoadScaledMoE),
    "torch_generator": Case(JitterMoE),
    "torch_generator_elsewhere": _harmful(JitterElsewhereMoE),
    "numpy_generator": Case(ExpertDropoutMoE),
    "numpy_generator_elsewhere": _harmful(ExpertDropoutElsewhereMoE),
    "counter_hits": Case(HitCounterMoE),
    "counter_hits_scale": _harmful(HitCounterScaledMoE),
    # hooks
    "expert_pre_hooks_count": Case(PreHookRowsMoE),
    "expert_pre_hooks_at_init": Case(PreHookRowsAtInitMoE),
    "expert_hooks_store": Case(OutputHookStoreMoE),
    "expert_pre_hooks_scale": _harmful(PreHookHalvesMoE),
    "expert_hooks_scale": _harmful(OutputHookScalesMoE),
    "gate_hook_logits": Case(GateHookLogitsMoE),
    "gate_hook_tempers": _harmful(GateHookTemperMoE),
    # chained experts (the design answers chains in rounds: exact)
    "rezero_scale": Case(ReZeroMoE),
    "rezero_chain": Case(ReZeroChainMoE),
    "straight_through_router": Case(StraightThroughRouterMoE),
    "straight_through_chain": Case(StraightThroughChainMoE),
    "lora_mixture": Case(LoraMixtureMoE),
    # state set for the experts
    "expert_attribute_note": Case(NotesOnExpertsMoE),
    "expert_attribute_read": _harmful(SetsExpertScaleMoE),
    "global_note": Case(GlobalNoteMoE),
    "global_read_by_experts": _harmful(GlobalTemperatureMoE),
    # DeepSeek remote code, train then eval
    "deepseek_train_eval": Case(DeepseekStyleMoE, modes=("train", "eval")),
    "deepseek_remote_code": Case(deepseek_remote, modes=("train", "eval")),
    "deepseek_eval_counts": _harmful(DeepseekEvalCountsMoE, modes=("train", "eval")),
    # context inside the block
    "autocast_experts": Case(AutocastExpertsMoE, bf16_grads=True),
    "autocast_even_experts": _harmful(AutocastEvenExpertsMoE, bf16_grads=True),
    "no_grad_experts": Case(NoGradExpertsMoE),
    "bf16_accumulator": Case(Bf16AccumulatorMoE),
    # host reads
    "rescale_where": Case(RescaleWhereMoE),
    "rescale_loop": Case(RescaleLoopMoE, expect="raise", names="while out.abs().max() < 0.1"),
    "nan_guard_logits": Case(NanGuardLogitsMoE),
    "nan_guard_outputs": Case(NanGuardMoE, expect="raise", names="if torch.isnan(out).any()"),
    "stacked_norms": Case(StackedNormMoE),
    "max_over_norms": Case(MaxNormMoE, expect="raise", names="peak = max(out.norm() for out in outs)"),
    "inference_mode_eval": Case(_LoopMoE, modes=("train", "inference")),
    # a rank with no tokens (last: a rank aborted by a collective mismatch takes the cases after it along)
    "unique_loop": Case(UniqueLoopMoE, splits=EMPTY_RANK),
    "module_list_subclass": Case(module_list_subclass, splits=EMPTY_RANK),
    "mixtral_v4": Case(mixtral_v4, splits=EMPTY_RANK),
    "two_layer_net": Case(TwoLayerNet, splits=EMPTY_RANK, match="layers.?"),
    "two_layer_unique_net": Case(lambda: TwoLayerNet(UniqueLoopMoE), splits=EMPTY_RANK, match="layers.?"),
    # experts by role (issue 31): one expert across aligned containers, a shared list beside the experts, a list the
    # forward builds beside per-adapter routers; their one-edit twins are refused (tests/detect/test_expert_roles.py)
    "lora_mixture_3": Case(role_blocks.LoraMixture3MoE, splits=EMPTY_RANK),
    "lora_dict": Case(role_blocks.LoraDictMoE, splits=EMPTY_RANK),
    "shared_list": Case(role_blocks.SharedListMoE, splits=EMPTY_RANK),
    "dropout_list": Case(role_blocks.DropoutListMoE, splits=EMPTY_RANK),
    "forward_built": Case(role_blocks.ForwardBuiltMoE, splits=EMPTY_RANK),
    "lora_misaligned": _harmful(role_blocks.LoraMisalignedTwin, splits=EMPTY_RANK),
    "shared_on_routed_rows": _harmful(role_blocks.SharedOnRoutedRowsTwin, splits=EMPTY_RANK),
    "forward_built_by_method": _harmful(role_blocks.ForwardBuiltByMethodTwin, splits=EMPTY_RANK),
    # experts not in one registered container (issue 31): numbered attributes, lists built with extend, slices and
    # concatenation, multi-task lists; their one-edit twins are refused (tests/detect/test_expert_roles_attrs.py)
    **{name: Case(make, splits=EMPTY_RANK) for name, make in role_blocks_attrs.BLOCKS.items()},
    **{name: _harmful(make, splits=EMPTY_RANK) for name, (make, _) in role_blocks_attrs.TWINS.items()},
    "append_skipping": _harmful(role_blocks_attrs.AppendSkippingTwin, splits=EMPTY_RANK),  # an unread list, one container
    # experts by where they sit (issue 31): two and three wrappers down, a container with its own forward passing
    # per-row extras to each expert, two-level routing, experts slicing their own weights; twins refused or raise
    # (tests/detect/test_wrapper_blocks.py)
    **{name: Case(make, splits=EMPTY_RANK) for name, make in wrapper_blocks.BLOCKS.items()},
    **{name: _harmful(make, splits=EMPTY_RANK) for name, (make, _) in wrapper_blocks.TWINS.items()},
    **{name: Case(make, expect="raise", names=text, splits=EMPTY_RANK)
       for name, (make, text) in wrapper_blocks.RAISES.items()},
}
