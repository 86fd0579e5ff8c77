"""Every expert on every row, masked by the row's id, summed (transformers 4.57 ``VitPoseBackboneMoeMLP``;
written out as ``blocks.MaskedSumMoE`` so this file runs under transformers 5 too): the loop is proven
(``autoep.detect.split_loop.masked_sum_loop``) and runs as the exchange, each row through its own expert only.

Exact where every expert's output is finite: a row's other terms are ``expert(x) * 0`` = zeros there, and adding a
zero changes nothing; where an expert the row is not routed to overflows, the model's own sum is NaN and EP's is
not (EP never computes that expert on that row).

Parity (DESIGN.md) on 2 and 4 gloo ranks through the real detector, table and ``apply_plan``: several sequences
per rank (one rank with none at W=4), each with its own id, some naming no expert.
"""

from __future__ import annotations

import copy
import importlib.util
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
from autoep.errors import UnsupportedModuleStructure
from autoep.runtime.recipes.module_list import ep_masked_sum_loop, ep_module_list_block

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
    assert (s.expert_storage, s.expert_kind) == ("module_list", "row_local")
    ep = copy.deepcopy(block)
    ep_module_list_block(ep, ep_mesh=None, structure=s)
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
    ep_module_list_block(ep, ep_mesh=None, structure=detect_moe_structure(block))
    x = torch.randn(5, 2, 16)
    out, want = ep(x), block(x)
    assert out.dtype == want.dtype == torch.float64
    torch.testing.assert_close(out, want)


def test_ids_that_are_not_one_per_row_fail_loudly():
    """The spliced call itself: ids varying along the features (a mask per feature in the model's loop) have no
    exchange form; one id per row (any leading shape that broadcasts) does."""
    block = _block()
    ep = copy.deepcopy(block)
    ep_module_list_block(ep, ep_mesh=None, structure=detect_moe_structure(block))
    acc, x = torch.zeros(2, 3, 4), torch.randn(2, 3, 24)
    with pytest.raises(RuntimeError, match="vary along the feature dim"):
        ep_masked_sum_loop(ep, acc, x, torch.tensor([[[0, 1, 2, 3]]]), ep_group=None)
    per_row = torch.tensor([[0, 1, 2], [3, 4, 1]]).unsqueeze(-1)  # (2, 3, 1): an id per row, 4 names no expert
    want = acc + sum(e(x) * (per_row == i) for i, e in enumerate(block.experts))
    torch.testing.assert_close(ep_masked_sum_loop(ep, acc, x, per_row, ep_group=None), want)


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


REFUSED = [
    # The expert's output added without its mask: every expert's output reaches every row.
    ("current_hidden_state = self.experts[i](hidden_state) * selected_index",
     "current_hidden_state = self.experts[i](hidden_state) * 1.0", "is not the expert.s output times its mask"),
    # The mask of the next expert: rows would get another expert's output.
    ("selected_index = indices == i", "selected_index = indices == i + 1", "is not understood"),
    # The accumulator read inside the loop besides the one addition: not a plain sum of the terms.
    ("expert_hidden_state = expert_hidden_state + current_hidden_state",
     "expert_hidden_state = expert_hidden_state + current_hidden_state * expert_hidden_state",
     "is not the expert's output times its mask"),
    # One expert fewer than the experts: the last expert's rows would get no output in the model.
    ("for i in range(self.num_experts):", "for i in range(self.num_experts - 1):", "is not understood"),
    # The experts fed the running sum: not the rows every expert reads.
    ("current_hidden_state = self.experts[i](hidden_state) * selected_index",
     "current_hidden_state = self.experts[i](expert_hidden_state) * selected_index",
     r"rebinds \['expert_hidden_state'\] inside the loop"),
    # The rows rebound inside the loop: the next expert reads other rows.
    ("selected_index = indices == i", "selected_index = indices == i\n            hidden_state = hidden_state * 2",
     r"`hidden_state \* 2` is not the expert.s output times its mask"),
]


@pytest.mark.parametrize("old,new,why", REFUSED, ids=[r[1][:50] for r in REFUSED])
def test_unsound_variants_are_refused(old, new, why, tmp_path):
    torch.manual_seed(0)
    block = _variant(old, new, tmp_path)(hidden=16, ffn=24, part=4, num_experts=4).train()
    with pytest.raises(UnsupportedModuleStructure, match=why):
        # the masked-sum splice's own proof (replay=False): with the default fallback such a block goes to
        # record/exchange/replay, whose checks run at the forward (tests/runtime/test_replay.py)
        detect_moe_structure(block, replay=False)


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


def test_a_dropout_of_the_block_inside_the_loop_is_refused_naming_it():
    block = _TokenDropoutMoE(0.2).train()
    with pytest.raises(UnsupportedModuleStructure, match=r"line \d+: `self.token_dropout\(self.experts\[i\]\(hidden_state\)\)` "
                                                         r"is Dropout with p=0.2 while training inside the expert loop"):
        detect_moe_structure(block, replay=False)  # the splice's proof, as above
