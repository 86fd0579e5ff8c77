"""Every expert on every row, masked by the row's id, summed (transformers 4.57 ``VitPoseBackboneMoeMLP``;
written out as ``blocks.MaskedSumMoE`` so this file runs under transformers 5 too): no loop proof reads it, so
record/exchange/replay runs it (``autoep.runtime.recipes.replay``), each expert called on the whole
``(batch, seq, ffn)`` tensor and moved as its rows (the experts are plain ``nn.Linear``s, proven to treat leading
dims alike). The block's own masks and sum run as written, so it is exact whatever the experts' outputs are
(an overflowing expert gives NaN on both sides); the cost is every row sent to every expert.

Parity (DESIGN.md) on 2 and 4 gloo ranks through the real detector, table and ``apply_plan``: several sequences
per rank (one rank with none at W=4), each with its own id, some naming no expert.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import inspect
import sys
import textwrap

import blocks
import pytest
import test_row_local_parity as rl
import torch
from distributed import guarded, run_cases
from test_row_local_parity import _check_block

from autoep.detect.structure import detect_moe_structure
from autoep.runtime.recipes.replay import ReplayError, ep_replay_block

BLOCKS = {
    "masked_sum": lambda: blocks.MaskedSumMoE(hidden=rl.D, ffn=24, part=4, num_experts=4),
    "masked_sum_eight_experts": lambda: blocks.MaskedSumMoE(hidden=rl.D, ffn=24, part=6, num_experts=8),
}


def masked_sum_cases(rank: int, world_size: int) -> dict:
    rl.BLOCKS.update(BLOCKS)
    results = {}
    for name in BLOCKS:
        guarded(results, name, _check_block, name, rank, world_size)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_on_ranks(world_size):
    results = run_cases(world_size, "test_masked_sum:masked_sum_cases")
    assert results.keys() == BLOCKS.keys()
    failed = {n: e for n, e in results.items() if e}
    assert not failed, "\n".join(f"{n}:\n{e[0]}" for n, e in failed.items())


def _block(**kw):
    torch.manual_seed(0)
    return blocks.MaskedSumMoE(hidden=16, ffn=24, part=4, num_experts=4, **kw).train()


def test_detected_and_equal_in_one_process():
    block = _block()
    s = detect_moe_structure(block)
    assert (s.expert_storage, s.expert_kind, s.execution) == ("module_list", "row_local", "replay")
    ep = copy.deepcopy(block)
    ep_replay_block(ep, ep_mesh=None, structure=s)
    x = torch.randn(6, 3, 16)
    ids = torch.tensor([0, 3, 1, 9, 2, 2])  # 9 names no expert: the row keeps zeros
    torch.testing.assert_close(ep(x, ids), block(x, ids))
    torch.testing.assert_close(ep(x, ids.float()), block(x, ids.float()))  # 2.0 == 2 in the model's mask
    half = torch.tensor([0.5, 1.0, 2.0, 3.0, 0.0, 1.5])  # 0.5 and 1.5 match no expert
    torch.testing.assert_close(ep(x, half), block(x, half))


class _UpcastExpert(torch.nn.Module):
    """A row-local expert whose output is float64: the loop's term keeps that dtype, and ``acc + term`` promotes."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(24, 4)

    def forward(self, x):
        return self.proj(x).double()


def test_the_experts_own_output_dtype_is_kept():
    block = _block()
    block.experts = torch.nn.ModuleList([_UpcastExpert() for _ in range(4)])
    ep = copy.deepcopy(block)
    ep_replay_block(ep, ep_mesh=None, structure=detect_moe_structure(block))
    x = torch.randn(5, 2, 16)
    out, want = ep(x), block(x)
    assert out.dtype == want.dtype == torch.float64
    torch.testing.assert_close(out, want)


def _variant(old: str, new: str, tmp_path) -> type:
    src = textwrap.dedent(inspect.getsource(blocks.MaskedSumMoE))
    assert old in src, old
    src = src.replace(old, new, 1).replace("class MaskedSumMoE(", "class MaskedSumMoEVariant(", 1)
    path = tmp_path / f"masked_sum_variant_{abs(hash((old, new)))}.py"
    path.write_text("import torch\nimport torch.nn as nn\n\n" + src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module.MaskedSumMoEVariant


# One-edit variants: the splice's proof refused them; replay runs the block's own forward once, so each is exact
# (what the model computes, whatever that is) or raises.
VARIANTS = [
    # The expert's output added without its mask: every expert's output reaches every row.
    ("current_hidden_state = self.experts[i](hidden_state) * selected_index",
     "current_hidden_state = self.experts[i](hidden_state) * 1.0", None),
    # The mask of the next expert: rows get another expert's output.
    ("selected_index = indices == i", "selected_index = indices == i + 1", None),
    # The accumulator read inside the loop besides the one addition.
    ("expert_hidden_state = expert_hidden_state + current_hidden_state",
     "expert_hidden_state = expert_hidden_state + current_hidden_state * expert_hidden_state", None),
    # One expert fewer than the experts: the last one is never called (its gradients stay None).
    ("for i in range(self.num_experts):", "for i in range(self.num_experts - 1):", None),
    # The experts fed the running sum: an expert's input computed from earlier experts' outputs (chained calls:
    # one exchange per link, exact).
    ("current_hidden_state = self.experts[i](hidden_state) * selected_index",
     "current_hidden_state = self.experts[i](expert_hidden_state[..., :1].expand_as(hidden_state)) * selected_index",
     None),
    # The rows rebound inside the loop: the next expert reads other rows.
    ("selected_index = indices == i", "selected_index = indices == i\n            hidden_state = hidden_state * 2", None),
]


@pytest.mark.parametrize("old,new,raises", VARIANTS, ids=[r[1][:50] for r in VARIANTS])
def test_variants_are_exact_or_raise_under_replay(old, new, raises, tmp_path):
    torch.manual_seed(0)
    block = _variant(old, new, tmp_path)(hidden=16, ffn=24, part=4, num_experts=4).train()
    s = detect_moe_structure(block)
    assert s.execution == "replay"
    ep = copy.deepcopy(block)
    ep_replay_block(ep, ep_mesh=None, structure=s)
    x = torch.randn(6, 3, 16, requires_grad=True)
    ids = torch.tensor([0, 3, 1, 9, 2, 2])
    if raises:
        with pytest.raises(ReplayError, match=re.escape(raises)):
            ep(x, ids)
        return
    out, want = ep(x, ids), block(x, ids)
    torch.testing.assert_close(out, want)
    grad_out = torch.randn_like(out)
    got_grad, = torch.autograd.grad(out, x, grad_out)
    want_grad, = torch.autograd.grad(want, x, grad_out)
    torch.testing.assert_close(got_grad, want_grad)


class _TokenDropoutMoE(blocks.MaskedSumMoE):
    """NLLB-MoE's spelling inside the loop: the block's own dropout on each expert's output."""

    def __init__(self, p: float):
        super().__init__(hidden=16, ffn=24, part=4, num_experts=4)
        self.token_dropout = torch.nn.Dropout(p)

    def forward(self, hidden_state, indices=None):
        indices = torch.arange(hidden_state.shape[0]) % (self.num_experts + 1) if indices is None else indices
        expert_hidden_state = torch.zeros_like(hidden_state[:, :, -self.part_features:])
        hidden_state = self.act(self.fc1(hidden_state))
        shared_hidden_state = self.fc2(hidden_state)
        indices = indices.view(-1, 1, 1)
        for i in range(self.num_experts):
            selected_index = indices == i
            current_hidden_state = self.token_dropout(self.experts[i](hidden_state)) * selected_index
            expert_hidden_state = expert_hidden_state + current_hidden_state
        return torch.cat([shared_hidden_state, expert_hidden_state], dim=-1)


def test_a_dropout_of_the_block_inside_the_loop_draws_the_models_masks():
    """The block's own dropout runs where the token is, in pass 2 with the RNG pass 1 started from: the same
    masks as the block's own call."""
    block = _TokenDropoutMoE(0.2).train()
    ep = copy.deepcopy(block)
    ep_replay_block(ep, ep_mesh=None, structure=detect_moe_structure(block))
    x = torch.randn(5, 3, 16)
    torch.manual_seed(3)
    want = block(x)
    torch.manual_seed(3)
    torch.testing.assert_close(ep(x), want)
