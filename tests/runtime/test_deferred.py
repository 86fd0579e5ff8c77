"""One pass, deferred expert outputs (``autoep.runtime.recipes.deferred``): the block's forward runs once, so
whatever it writes besides its output (attributes, containers, globals, buffers, random draws, caches, its input)
is written once, as in its own call; what needs an expert's output on the host raises, naming the line.

Each state block writes Python-side state in its forward and scales its output by it; under the one-pass
execution (one process, ep_size=1: the forward, the exchange and the deferred calls all run) its output and the
state after one call equal the block's own. The reference is the block's own forward.
"""

from __future__ import annotations

import collections
import copy
import random
import types

import numpy as np
import pytest
import replay_blocks as rb
import torch
from torch import nn

from autoep.plan.resolve import resolve_plan
from autoep.runtime.apply import apply_plan
from autoep.runtime.recipes.replay import ReplayError

_CALLS = [0]  # a module global the forward counts in


def _ep(block: nn.Module) -> nn.Module:
    """``block`` under record/exchange/replay, by the real plan (ep_size=1: no process group)."""
    model = nn.ModuleDict({"mlp": block})
    resolved = resolve_plan({"ep_size": 1, "plan": [{"match": "mlp", "record_replay": True}]}, model)
    assert resolved.plan[0].decision.structure.execution == "replay"
    apply_plan(model, resolved, None)
    return model["mlp"]


def _x() -> torch.Tensor:
    return torch.randn(2, 3, rb.D, generator=torch.Generator().manual_seed(7))


class _Moe(rb.ComprehensionMoE):
    """The comprehension block's work as a method the subclasses' forwards call (a super().forward() call is not
    followed by the search for the experts container)."""

    def run_experts(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, selected = rb._top_k(self.gate, x, rb.K)
        hits = [torch.where(selected == i) for i in range(len(self.experts))]
        outs = [self.experts[i](x[tok]) for i, (tok, _) in enumerate(hits)]
        y = torch.zeros_like(x)
        for (tok, slot), out in zip(hits, outs):
            y.index_add_(0, tok, out * weights[tok, slot, None])
        return y.reshape(shape)


class StateBlock(_Moe):
    """The comprehension block, its output scaled by ``1 + 0.1 * step()``: a count or a draw kept in ``kind``."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.counts = collections.OrderedDict() if kind == "ordered_dict" else collections.defaultdict(int)
        self.nested = {"calls": []}
        self.state = types.SimpleNamespace(calls=0)
        self.gen = torch.Generator().manual_seed(0)
        self.py_random = random.Random(0)
        self.np_random = np.random.default_rng(0)

    def forward(self, hidden_states):
        return self.run_experts(hidden_states) * (1.0 + 0.1 * self.step())

    def step(self) -> float:
        kind = self.kind
        if kind == "ordered_dict":
            self.counts["calls"] = self.counts.get("calls", 0) + 1
            return self.counts["calls"]
        if kind == "defaultdict":
            self.counts["calls"] += 1
            return self.counts["calls"]
        if kind == "nested_list":
            self.nested["calls"].append(1)
            return len(self.nested["calls"])
        if kind == "namespace":
            self.state.calls += 1
            return self.state.calls
        if kind == "module_global":
            _CALLS[0] += 1
            return _CALLS[0]
        if kind == "torch_generator":
            return torch.rand((), generator=self.gen).item()
        if kind == "python_random":
            return self.py_random.random()
        if kind == "numpy_generator":
            return float(self.np_random.random())
        return float(np.random.rand())  # numpy's global generator


KINDS = ["ordered_dict", "defaultdict", "nested_list", "namespace", "module_global", "torch_generator",
         "python_random", "numpy_generator", "numpy_global"]


def _one_call(block: nn.Module) -> tuple[torch.Tensor, float]:
    """The block's output on one call from a fixed state, and the value its next ``step`` gives (equal state)."""
    _CALLS[0] = 0
    np.random.seed(0)
    out = block(_x())
    return out, block.step()


@pytest.mark.parametrize("kind", KINDS)
def test_state_written_in_forward_is_written_once(kind):
    torch.manual_seed(0)
    own = StateBlock(kind)
    ep = _ep(copy.deepcopy(own))
    want_out, want_next = _one_call(own)
    got_out, got_next = _one_call(ep)
    torch.testing.assert_close(got_out, want_out)
    assert got_next == want_next, f"{kind}: the state after one call differs from the block's own"


class ChainBlock(rb.ComprehensionMoE):
    """experts[2] reads experts[1]'s output."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, rb.D)
        h0 = self.experts[0](x)
        h1 = self.experts[1](x)
        h2 = self.experts[2](x + h1)
        return (h0 + h1 + h2).reshape(hidden_states.shape)


class CounterBlock(_Moe):
    """Counts its calls in a buffer, in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("counter", torch.zeros((), dtype=torch.long))

    def forward(self, hidden_states):
        self.counter += 1
        return self.run_experts(hidden_states)


class StatsBlock(_Moe):
    """Accumulates into a plain tensor attribute (not a buffer) of a submodule, in place."""

    def __init__(self):
        super().__init__()
        self.gate.stats = torch.zeros(())

    def forward(self, hidden_states):
        out = self.run_experts(hidden_states)
        self.gate.stats.add_(out.detach().abs().sum())
        return out


class BranchBlock(rb.ComprehensionMoE):
    """Calls experts[3] only where experts[0]'s output sums positive."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, rb.D)
        h = self.experts[0](x)
        if h.sum() > 0:
            h = h + self.experts[3](x)
        h = h + self.experts[1](x)
        return h.reshape(hidden_states.shape)


@pytest.mark.parametrize("make", [ChainBlock, CounterBlock, StatsBlock])
def test_chains_and_in_place_state_are_exact(make):
    """An expert fed another's output (a chained call: a second exchange), a buffer counted in place, a tensor
    attribute accumulated from the output: output, gradients and the state after the call are the block's own."""
    torch.manual_seed(0)
    own = make()
    block = _ep(copy.deepcopy(own))
    x_own, x_ep = _x().requires_grad_(), _x().requires_grad_()
    want, got = own(x_own * 1), block(x_ep * 1)
    torch.testing.assert_close(got, want)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(x_ep.grad, x_own.grad)
    for (n, p), (_, q) in zip(own.named_parameters(), block.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"{n}: {m}")
    for (n, b), (_, c) in zip(own.named_buffers(), block.named_buffers()):
        torch.testing.assert_close(c, b, msg=lambda m: f"{n}: {m}")
    if make is StatsBlock:
        torch.testing.assert_close(block.gate.stats, own.gate.stats)


def test_a_branch_on_an_expert_output_names_the_line():
    torch.manual_seed(0)
    block = _ep(BranchBlock())
    with pytest.raises(ReplayError) as info:
        block(_x())
    assert str(info.value).startswith("BranchBlock: __bool__ reads a pending expert output on the host before the "
                                      "exchange"), str(info.value)
    assert "line" in str(info.value) and "`if h.sum() > 0:`" in str(info.value), str(info.value)


class ClosureOrderBlock(_Moe):
    """The call order cached by a closure of a module-level function the forward calls: put back (its cell
    followed), so the block is exact."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, rb.D)
        weights, selected = rb._top_k(self.gate, x, rb.K)
        y = torch.zeros_like(x)
        for i in _ORDER(len(self.experts)):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, self.experts[i](x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


def _order_cache():
    """A call order cached in a closure: reversed on the first call only."""
    seen = []

    def order(n: int):
        seen.append(n)
        return range(n) if len(seen) > 1 else range(n - 1, -1, -1)

    return order


_ORDER = _order_cache()


class DeepOrderBlock(ClosureOrderBlock):
    """The same cache deeper in plain objects than replay follows (``replay_state.DEPTH``)."""

    def __init__(self):
        super().__init__()
        self.ns = types.SimpleNamespace(a=types.SimpleNamespace(b=types.SimpleNamespace(seen=[])))

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, rb.D)
        weights, selected = rb._top_k(self.gate, x, rb.K)
        seen = self.ns.a.b.seen
        seen.append(1)
        y = torch.zeros_like(x)
        for i in (range(len(self.experts)) if len(seen) > 1 else range(len(self.experts) - 1, -1, -1)):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, self.experts[i](x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


def test_a_closure_cache_is_put_back():
    global _ORDER
    torch.manual_seed(0)
    own = ClosureOrderBlock()
    block = _ep(copy.deepcopy(own))
    _ORDER = _order_cache()
    want = own(_x())
    _ORDER = _order_cache()
    torch.testing.assert_close(block(_x()), want)


def test_state_in_nested_plain_objects_is_written_once():
    """A call-order cache deep in plain objects (which the two passes could not put back): exact, appended once."""
    torch.manual_seed(0)
    own = DeepOrderBlock()
    block = _ep(copy.deepcopy(own))
    torch.testing.assert_close(block(_x()), own(_x()))
    assert block.ns.a.b.seen == own.ns.a.b.seen == [1]


# ---------------------------------------------------------------------------------------------
# The block's input edited in place
# ---------------------------------------------------------------------------------------------


class AliasedInputsBlock(_Moe):
    """Scales ``hidden_states`` in place, then routes it plus ``residual`` (the caller may pass one tensor as
    both, or a view of it): the experts' rows see the edit as the aliasing gives it."""

    def forward(self, hidden_states, residual):
        hidden_states.mul_(2.0)
        return self.run_experts(hidden_states + residual)


def test_an_input_given_twice_is_edited_once_as_in_the_block():
    torch.manual_seed(0)
    own = AliasedInputsBlock()
    block = _ep(copy.deepcopy(own))
    x0 = torch.randn(2, 3, rb.D, requires_grad=True)
    x1 = x0.detach().clone().requires_grad_()
    a, b = x0 * 1, x1 * 1
    want = own(a, a)
    got = block(b, b)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(b, a)  # the input edited once
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(x1.grad, x0.grad)


def test_an_input_and_its_view_are_edited_as_in_the_block():
    """One input a view of another (the two passes refused it): the edit reaches both, as in the block's own call.
    A leaf input that requires grad refuses the edit in the block's own forward, and in the EP one alike."""
    torch.manual_seed(0)
    own = AliasedInputsBlock()
    block = _ep(copy.deepcopy(own))
    a, b = _x() * 1, _x() * 1
    torch.testing.assert_close(block(b, b[:1]), own(a, a[:1]))
    torch.testing.assert_close(b, a)
    leaf = _x().requires_grad_()
    for blk in (own, block):
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
            blk(leaf, leaf)


# ---------------------------------------------------------------------------------------------
# What cannot wait for the exchange raises; what the block keeps of an expert output becomes real
# ---------------------------------------------------------------------------------------------


class _EachExpert(rb.ComprehensionMoE):
    """The comprehension block with ``after(out, rows)`` called on each expert's output and rows."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, rb.D)
        weights, selected = rb._top_k(self.gate, x, rb.K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == i)
            rows = x[tok]
            out = self.after(expert(rows), rows)
            y.index_add_(0, tok, out * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class EditsRowsAfterCall(_EachExpert):
    def after(self, out, rows):
        rows.mul_(2.0)  # the expert already read them in the model; its owner reads them after the forward
        return out


class SwallowsHostRead(_EachExpert):
    def after(self, out, rows):
        try:
            scale = 1.0 + 0.0 * out.sum().item()
        except Exception:  # noqa: BLE001 - the block's own fallback: a different value than the model's
            scale = 2.0
        return out * scale


class FormatsOutput(_EachExpert):
    def after(self, out, rows):
        self.log = getattr(self, "log", []) + [f"{out.mean():.3f}"]
        return out


class ScalesByBufferWrittenThroughData(_EachExpert):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def after(self, out, rows):
        out = out * self.scale
        self.scale.data.add_(0.1)  # no version counter sees it; autograd saved this very buffer for the backward
        return out


class ScalesByNumpyWrittenTensor(_EachExpert):
    def __init__(self):
        super().__init__()
        self.host = torch.ones(1)

    def after(self, out, rows):
        out = out * self.host
        self.host.numpy()[0] += 0.1
        return out


class DrawsAfterDroppingOutputs(_EachExpert):
    def after(self, out, rows):
        return torch.nn.functional.dropout(out, 0.5) * (1 + 0.01 * torch.rand(()))


@pytest.mark.parametrize("make, message", [
    (EditsRowsAfterCall, "EditsRowsAfterCall: mul_ writes (or exposes, to numpy or .data) a tensor of shape"),
    (ScalesByBufferWrittenThroughData, "ScalesByBufferWrittenThroughData: data:get writes (or exposes"),
    (ScalesByNumpyWrittenTensor, "ScalesByNumpyWrittenTensor: numpy writes (or exposes"),
    (DrawsAfterDroppingOutputs, "DrawsAfterDroppingOutputs: rand draws from a random generator after a draw on an "
                                "expert's output"),
    (SwallowsHostRead, "SwallowsHostRead: item reads a pending expert output on the host"),
    (FormatsOutput, "FormatsOutput: __format__ reads a pending expert output on the host"),
])
def test_what_needs_an_expert_output_now_raises(make, message):
    """An expert's rows written after the call, a tensor a deferred product reads written through ``.data`` or a
    numpy view, a random draw after a draw on an expert output (the deferred draw would come second), a host read
    the block catches itself, a log line formatting an output: each raises (a caught one too: the tape keeps it),
    never computes otherwise than the model."""
    torch.manual_seed(0)
    block = _ep(make())
    with pytest.raises(ReplayError) as info:
        block(_x() * 1)
    assert str(info.value).startswith(message), str(info.value)


class KeepsOutputs(_EachExpert):
    """Keeps each expert's output in an attribute and a list, and a gradient hook's view of it."""

    def __init__(self):
        super().__init__()
        self.kept, self.grads = [], []

    def after(self, out, rows):
        self.last = out
        self.kept.append(out.detach())
        if out.requires_grad:
            out.register_hook(lambda g: self.grads.append(g.clone()))
        return out


def test_expert_outputs_the_block_keeps_are_real_and_their_hooks_run_once():
    torch.manual_seed(0)
    own = KeepsOutputs()
    block = _ep(copy.deepcopy(own))
    want, got = own(_x().requires_grad_()), block(_x().requires_grad_())
    assert type(block.last) is torch.Tensor and all(type(t) is torch.Tensor for t in block.kept)
    torch.testing.assert_close(block.last, own.last)
    torch.testing.assert_close(block.kept, own.kept)
    want.square().sum().backward()
    got.square().sum().backward()
    assert len(block.grads) == len(own.grads) == len(own.experts)
    # The hooks run once each; the order autograd's engine reaches them in is its own (the exchange changes the
    # graph's shape), so they are matched by value.
    def by_value(grads):
        return sorted(grads, key=lambda g: (g.shape[0], g.sum().item()))
    torch.testing.assert_close(by_value(block.grads), by_value(own.grads))


class CheckpointsExperts(rb.ComprehensionMoE):
    """Each expert call through ``torch.utils.checkpoint`` inside the block's forward."""

    reentrant = False

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, rb.D)
        weights, selected = rb._top_k(self.gate, x, rb.K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == i)
            out = torch.utils.checkpoint.checkpoint(expert, x[tok], use_reentrant=self.reentrant)
            y.index_add_(0, tok, out * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class CheckpointsExpertsReentrant(CheckpointsExperts):
    reentrant = True


def test_checkpointing_inside_the_block():
    """Non-reentrant: the expert's call is answered inside the checkpoint, which saves nothing of it: exact. Reentrant
    (an autograd.Function whose backward recomputes the expert where it does not run): raises, naming the call."""
    torch.manual_seed(0)
    own = CheckpointsExperts()
    block = _ep(copy.deepcopy(own))
    x_own, x_ep = _x().requires_grad_(), _x().requires_grad_()
    want, got = own(x_own * 1), block(x_ep * 1)
    torch.testing.assert_close(got, want)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(x_ep.grad, x_own.grad)
    for (n, p), (_, q) in zip(own.named_parameters(), block.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"{n}: {m}")
    with pytest.raises(ReplayError, match=r"experts\[0\] \(expert call 0\) is called inside CheckpointFunction's "
                                          r"forward"):
        _ep(CheckpointsExpertsReentrant())(_x().requires_grad_() * 1)


class _StraightThroughClamp(torch.autograd.Function):
    """Clamps in forward, passes the gradient unchanged (its backward is not the clamp's)."""

    @staticmethod
    def forward(ctx, x):
        return x.clamp(-0.05, 0.05)

    @staticmethod
    def backward(ctx, grad):
        return grad


class FunctionOnOutputs(_EachExpert):
    def after(self, out, rows):
        return _StraightThroughClamp.apply(out)


def test_a_custom_autograd_function_on_an_expert_output_keeps_its_backward():
    """``Function.apply`` is no torch call a mode sees: applied to a pending output it is taped as one call (its
    forward's ops taped one by one would lose its own backward: the clamp's zero gradients instead of the
    straight-through ones)."""
    torch.manual_seed(0)
    own = FunctionOnOutputs()
    block = _ep(copy.deepcopy(own))
    x_own, x_ep = _x().requires_grad_(), _x().requires_grad_()
    want, got = own(x_own * 1), block(x_ep * 1)
    torch.testing.assert_close(got, want)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(x_ep.grad, x_own.grad)
    for (n, p), (_, q) in zip(own.named_parameters(), block.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"{n}: {m}")


class DropsOutputs(_EachExpert):
    def after(self, out, rows):
        return torch.nn.functional.dropout(out, 0.5)


def test_draws_on_expert_outputs_in_the_models_order_are_exact():
    """Dropout on each expert's output, no other draw after the first: the deferred draws come in the model's order,
    so the masks are the model's."""
    torch.manual_seed(0)
    own = DropsOutputs()
    block = _ep(copy.deepcopy(own))
    torch.manual_seed(5)
    want = own(_x() * 1)
    want_next = torch.rand(3)  # the generator after the block: as many draws made
    torch.manual_seed(5)
    got = block(_x() * 1)
    got_next = torch.rand(3)
    torch.testing.assert_close(got, want)
    assert torch.equal(got_next, want_next)
