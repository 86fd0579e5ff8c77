"""Expert calls on N-D tensors under record/exchange/replay (``autoep.runtime.recipes.replay``, "N-D calls"):
an expert proven to treat its leading dims alike travels as its flattened rows and comes back in the shape it
would have returned (parity on 1, 2 and 4 ranks: ``replay_blocks.WholeTensorMoE`` / ``FourDimCallsMoE`` in
``test_replay.py``); any other expert called so raises, naming the block, the expert, the shape and the construct;
an expert that is not row-local even on rows is refused at detection.
"""

from __future__ import annotations

import copy

import pytest
import replay_blocks as rb
import torch
import torch.nn.functional as F
from test_replay import _ep_block
from torch import nn

from autoep.detect.structure import detect_moe_structure
from autoep.errors import FactChanged, UnsupportedModuleStructure
from autoep.plan.resolve import resolve_plan
from autoep.runtime.apply import apply_plan
from autoep.runtime.recipes.replay import ReplayError

PINNED = [rb.SumSeqExpert, rb.SoftmaxDimOneExpert, rb.ColonSliceExpert, rb.RankBranchExpert]


@pytest.mark.parametrize("expert", PINNED, ids=lambda c: c.__name__)
def test_flattening_a_pinned_experts_call_would_be_wrong(expert):
    """Why the twins must raise: on (batch, seq, hidden) each computes otherwise than on its flattened rows."""
    torch.manual_seed(0)
    e, x = expert(), torch.randn(2, 3, rb.D)
    flat = e(x.reshape(-1, rb.D)).reshape(x.shape)
    assert not torch.allclose(e(x), flat)


def test_the_error_names_the_block_the_expert_the_shape_and_the_construct():
    torch.manual_seed(0)
    block = _ep_block("sum_over_seq", 1, rb.TWINS)
    with pytest.raises(ReplayError) as info:
        block(torch.randn(2, 3, rb.D))
    assert str(info.value).startswith("WholeTensorMoE: experts[0] (expert call 0) is called on a tensor of shape "
                                      "(2, 3, 8); autoep moves such a call as its (prod(leading dims), features) rows "
                                      "only for an expert that treats every dim before the last alike"), info.value
    assert str(info.value).endswith("SumSeqExpert.forward line 4: `h.sum(1, keepdim=True)` reads dim 1 by a positive "
                                    "index"), info.value


def test_a_pinned_expert_called_on_2d_rows_still_runs():
    """The fact matters for N-D calls only: the same expert called on (tokens, hidden) rows is exact."""

    class Flat(rb.WholeTensorMoE):
        def forward(self, x):
            rows = x.reshape(-1, x.shape[-1])
            probs = torch.softmax(self.gate(rows), dim=-1)
            return sum(probs[:, e:e + 1] * expert(rows) for e, expert in enumerate(self.experts)).reshape(x.shape)

    torch.manual_seed(0)
    ref = Flat(rb.SumSeqExpert)
    ep = nn.ModuleDict({"mlp": Flat(rb.SumSeqExpert)})
    ep.load_state_dict(nn.ModuleDict({"mlp": ref}).state_dict())
    apply_plan(ep, resolve_plan({"ep_size": 1, "plan": [{"match": "mlp", "record_replay": True}]}, ep), None)
    x = torch.randn(2, 3, rb.D)
    torch.testing.assert_close(ep["mlp"](x), ref(x))


class _TransposeExpert(rb.LastDimExpert):
    """Edit: ``x.transpose(0, 1)``: swaps batch and sequence of a 3-D call (rows and features of a 2-D one)."""

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x.transpose(0, 1))))


class _ViewRowsExpert(rb.LastDimExpert):
    """Edit: ``x.view(x.shape[0], -1)``: folds the sequence into the features of a 3-D call."""

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x.view(x.shape[0], -1))))



@pytest.mark.parametrize("expert, why", [(_TransposeExpert, r"`x.transpose\(0, 1\)` changes the rows' layout"),
                                         (_ViewRowsExpert, r"`x.shape\[0\]` reads the number of rows")])
def test_experts_that_are_not_row_local_on_rows_are_refused_at_detection(expert, why):
    torch.manual_seed(0)
    with pytest.raises(UnsupportedModuleStructure, match=why):
        detect_moe_structure(rb.WholeTensorMoE(expert), replay=True)


def test_an_expert_swapped_after_apply_is_not_flattened_on_a_stale_proof():
    """The fact was proven for the experts at apply: an expert (or a module of one) replaced afterwards by another
    class raises before the call (``recipes.watching_experts``), naming it, instead of being flattened unproven.
    Same-class experts and deep copies run. (2-D calls: ``test_replay.py``.)"""
    block = _ep_block("whole_tensor", 1)
    x = torch.randn(2, 3, rb.D)
    torch.testing.assert_close(copy.deepcopy(block)(x), block(x))
    block.experts[2] = rb.SumSeqExpert()
    with pytest.raises(FactChanged, match=r"WholeTensorMoE: experts\[2\] was replaced by a SumSeqExpert "
                                          r"\(proven: a LastDimExpert\) after apply_plan"):
        block(x)
    block.experts[2] = rb.LastDimExpert()
    block(x)
    block.experts[1].norm = nn.BatchNorm1d(rb.FF)
    with pytest.raises(FactChanged, match=r"experts\[1\].norm was replaced by a BatchNorm1d \(proven: a "
                                          r"LayerNorm\)"):
        block(x)
