"""What pass 1 of record/exchange/replay may write, and its undo (``autoep.runtime.recipes.replay_state``), and
replay's refusals in the model's terms (issue 21 item 4): the block class, the call position, the expert and
the attribute, as the model names them.

Each state block writes Python-side state in its forward and scales its output by it; under replay (one
process, ep_size=1: record, exchange and replay all run) its output and the state after one call equal the
block's own (pass 1's write undone, pass 2's made once). The reference is the block's own forward.
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


@pytest.mark.parametrize("make, message", [
    (ChainBlock, "ChainBlock.forward: experts[2] (expert call 2) got its input from experts[1]'s output "
                 "(expert call 1)"),
    (CounterBlock, "CounterBlock.forward wrote self.counter in place during the record pass"),
    (StatsBlock, "StatsBlock.forward wrote self.gate.stats in place during the record pass"),
])
def test_refusals_name_the_block_the_call_and_the_state(make, message):
    torch.manual_seed(0)
    block = _ep(make())
    with pytest.raises(ReplayError) as info:
        block(_x() * 1)
    assert str(info.value).startswith(message), str(info.value)


def test_a_branch_on_an_expert_output_names_the_call():
    torch.manual_seed(0)
    own = BranchBlock()
    with torch.no_grad():
        own.experts[0].fc2.bias.fill_(1.0)  # experts[0]'s output sums positive: experts[3] runs in the own forward
    block = _ep(copy.deepcopy(own))
    with pytest.raises(ReplayError) as info:
        block(_x())
    assert str(info.value).startswith(
        "BranchBlock.forward: expert call 1 went to experts[1] when the experts answered placeholders and to "
        "experts[3] with their true outputs: which expert the block calls depends on an earlier expert's output "
        "(the expert called before it: experts[0])"), str(info.value)


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


def test_state_replay_cannot_put_back_is_named_as_such():
    """A write out of replay's reach changes the first expert call: no expert output can explain that, and the
    message says so rather than blaming an expert."""
    torch.manual_seed(0)
    block = _ep(DeepOrderBlock())
    with pytest.raises(ReplayError) as info:
        block(_x())
    assert str(info.value).startswith(
        "DeepOrderBlock.forward: its first expert call went to experts[3] in the record pass and to experts[0] in "
        "the replay: no expert output can explain it"), str(info.value)


# ---------------------------------------------------------------------------------------------
# Pass 1 on copies of the block's inputs (``replay_state.record_inputs``)
# ---------------------------------------------------------------------------------------------


class AliasedInputsBlock(_Moe):
    """Scales ``hidden_states`` in place, then routes it plus ``residual`` (the caller passes one tensor as
    both): the experts' rows see the edit twice only where the copies alias as the inputs do."""

    def forward(self, hidden_states, residual):
        hidden_states.mul_(2.0)
        return self.run_experts(hidden_states + residual)


def test_pass_one_copies_the_inputs_alike():
    """Each plain tensor among the block's arguments (positional, keyword, in plain tuples, lists and dicts, an
    integer mask too) is copied, with its strides, once (one tensor given twice: one copy), differentiably to the
    original; views of one another, expanded tensors and parameters are left as they are."""
    from autoep.runtime.recipes.replay_state import record_inputs

    x = torch.randn(4, 6, requires_grad=True) * 1
    mask = torch.tensor([1, 0, 2])
    base = torch.randn(3, 4)
    param = nn.Parameter(torch.randn(2))
    sliced = torch.randn(4, 6)[:, ::2]
    args, kwargs = record_inputs((x, [x, mask], {"m": mask}, sliced), {"views": (base, base[0]), "w": param,
                                                                       "wide": torch.randn(1, 4).expand(3, 4)})
    copy_x, (again, copy_mask), held, copy_sliced = args
    assert copy_x is not x and again is copy_x and held["m"] is copy_mask and copy_mask is not mask
    assert torch.equal(copy_x, x) and torch.equal(copy_mask, mask) and copy_sliced.stride() == sliced.stride()
    assert kwargs["views"][0] is base and kwargs["views"][1]._base is base and kwargs["w"] is param
    assert kwargs["wide"].stride() == (0, 1)
    (copy_x * torch.arange(6.0)).sum().backward()
    torch.testing.assert_close(x.grad if x.is_leaf else torch.autograd.grad(copy_x.sum(), x)[0], torch.ones(4, 6))


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


def test_input_edits_replay_cannot_copy_raise_as_before():
    """An input that is a view of another input is not copied (separate copies would not see each other's
    edits): its edit raises, naming it. A leaf input that requires grad refuses the edit in the block's own
    forward, and in the replayed one alike."""
    torch.manual_seed(0)
    own = AliasedInputsBlock()
    block = _ep(copy.deepcopy(own))
    x = _x() * 1
    with pytest.raises(ReplayError, match="AliasedInputsBlock.forward wrote its input hidden_states in place"):
        block(x, x[:1])
    leaf = _x().requires_grad_()
    for b in (own, block):
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
            b(leaf, leaf)
