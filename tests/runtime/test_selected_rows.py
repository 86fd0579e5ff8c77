"""Rows assigned expert by expert from a boolean (..., E) mask (transformers 4.57 ``SwitchTransformersSparseMLP``,
written out as ``blocks.SelectedRowsMoE`` so this file runs under transformers 5 too): the loop is proven
(``autoep.detect.split_loop.selected_loop``) and runs as the exchange. The ids the loop visits are the block's
own (read at run time); a row selected by several of them keeps the last one's output, by none stays as it was.

Parity (DESIGN.md) on 2 and 4 gloo ranks through the real detector, table and ``apply_plan`` (tokens past an
expert's capacity dropped, so some rows are selected by no expert). Expert dropout p>0 while training is refused,
naming it; in eval it is accepted (the training flag is then folded and watched).
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
from autoep.runtime.recipes.module_list import ep_module_list_block, ep_selected_loop

BLOCKS = {
    "selected_rows": lambda: blocks.SelectedRowsMoE(hidden=rl.D, ffn=24, num_experts=4, capacity=2),
    "selected_rows_eight": lambda: blocks.SelectedRowsMoE(hidden=rl.D, ffn=24, num_experts=8, capacity=1),
}


def selected_cases(rank: int, world_size: int) -> dict:
    rl.BLOCKS.update(BLOCKS)
    results = {}
    for name in BLOCKS:
        guarded(results, name, _check_block, name, rank, world_size)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_on_ranks(world_size):
    results = run_cases(world_size, "test_selected_rows:selected_cases")
    assert results.keys() == BLOCKS.keys()
    failed = {n: e for n, e in results.items() if e}
    assert not failed, "\n".join(f"{n}:\n{e[0]}" for n, e in failed.items())


def _ep(block):
    ep = copy.deepcopy(block)
    ep_module_list_block(ep, ep_mesh=None, structure=detect_moe_structure(block))
    return ep


def test_one_process_with_dropped_tokens():
    torch.manual_seed(0)
    block = blocks.SelectedRowsMoE(hidden=16, ffn=24, num_experts=4, capacity=1).train()
    ep = _ep(block)
    x = torch.randn(2, 6, 16)
    want = block(x)
    assert (want == 0).all(-1).any(), "no token was dropped: the capacity case is not exercised"
    torch.testing.assert_close(ep(x), want)


def test_expert_dropout_while_training_is_refused_and_eval_accepted():
    torch.manual_seed(0)
    block = blocks.SelectedRowsMoE(hidden=16, ffn=24, num_experts=4, dropout=0.1).train()
    with pytest.raises(UnsupportedModuleStructure, match=r"dropout with p=0.1 while training"):
        detect_moe_structure(block)
    block.eval()
    ep = _ep(block)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(ep(x), block(x))
    ep.train()
    with pytest.raises(RuntimeError, match="training"):  # the folded training=False is watched
        ep(x)


def test_the_last_selecting_id_wins_and_bad_ids_fail():
    """The spliced call itself, on a mask with rows selected twice and ids in a loop order of the caller's."""
    torch.manual_seed(0)
    block = blocks.SelectedRowsMoE(hidden=16, ffn=24, num_experts=4).train()
    ep = _ep(block)
    x = torch.randn(2, 3, 16)
    mask = torch.rand(2, 3, 4) > 0.4
    for order in ([0, 1, 2, 3], [3, 1, 0], [2, 2, 0], []):
        want = torch.zeros(2, 3, 16)
        for e in order:
            want[mask[:, :, e]] = getattr(block.experts, f"expert_{e}")(x[mask[:, :, e]])
        got = torch.zeros(2, 3, 16)
        ep_selected_loop(ep, got, x, mask, order, ep_group=None, dims=2)
        torch.testing.assert_close(got, want)
    for bad in ([4], [-1], [True], torch.tensor([0, 1])):
        with pytest.raises(RuntimeError, match="needs Python ints naming experts"):
            ep_selected_loop(ep, torch.zeros(2, 3, 16), x, mask, bad, ep_group=None, dims=2)
    with pytest.raises(RuntimeError, match="bool mask"):
        ep_selected_loop(ep, torch.zeros(2, 3, 16), x, mask.long(), [0], ep_group=None, dims=2)


def _variant(old: str, new: str, tmp_path) -> type:
    src = textwrap.dedent(inspect.getsource(blocks.SelectedRowsMoE))
    assert old in src, old
    src = src.replace(old, new, 1).replace("class SelectedRowsMoE(", "class SelectedRowsMoEVariant(", 1)
    path = tmp_path / f"selected_variant_{abs(hash((old, new)))}.py"
    path.write_text("import torch\nimport torch.nn as nn\nfrom blocks import SelectedRowsExpert\n\n" + src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module.SelectedRowsMoEVariant


LOOP = "next_states[router_mask[:, :, idx]] = getattr(self.experts, f\"expert_{idx}\")(\n                hidden_states[router_mask[:, :, idx]]\n            )"
REFUSED = [
    # Reads other rows than it writes: a row would get another row's output.
    (LOOP, 'next_states[router_mask[:, :, idx]] = getattr(self.experts, f"expert_{idx}")(hidden_states[router_mask[:, :, 0]])',
     "reads other rows than it writes|is not mask"),
    # The key of another expert: rows of expert e would get expert e+1's output... named by a key not the id.
    (LOOP, 'next_states[router_mask[:, :, idx]] = getattr(self.experts, f"expert_{idx + 1}")(hidden_states[router_mask[:, :, idx]])',
     "key made from the loop's id alone"),
    # Adds into the rows instead of assigning them: not the selected-rows loop.
    (LOOP, 'next_states[router_mask[:, :, idx]] += getattr(self.experts, f"expert_{idx}")(hidden_states[router_mask[:, :, idx]])',
     "is not understood|does not|not one"),
    # The id on another axis than the last taken: rows by the sequence axis.
    (LOOP, 'next_states[router_mask[:, idx]] = getattr(self.experts, f"expert_{idx}")(hidden_states[router_mask[:, idx]])',
     None),  # accepted: the run time checks the id's axis is the mask's last (see below)
    # The experts fed the output tensor: a later expert would read an earlier one's output.
    (LOOP, 'next_states[router_mask[:, :, idx]] = getattr(self.experts, f"expert_{idx}")(next_states[router_mask[:, :, idx]])',
     "reads and writes the same tensor"),
]


@pytest.mark.parametrize("old,new,why", REFUSED, ids=[r[1][15:70] for r in REFUSED])
def test_unsound_variants_are_refused(old, new, why, tmp_path):
    torch.manual_seed(0)
    block = _variant(old, new, tmp_path)(hidden=16, ffn=24, num_experts=4).train()
    if why is None:
        ep = _ep(block)  # mask[:, id] of a 3-D mask: the id indexes the sequence axis, not the experts'
        with pytest.raises(RuntimeError, match="whose last axis is the expert id"):
            ep(torch.randn(2, 5, 16))
        return
    with pytest.raises(UnsupportedModuleStructure, match=why):
        detect_moe_structure(block, replay=False)  # the splice proof; the fallback is replay
