"""Rows assigned expert by expert from a boolean (..., E) mask (transformers 4.57 ``SwitchTransformersSparseMLP``,
written out as ``blocks.SelectedRowsMoE`` so this file runs under transformers 5 too): no fast path reads the loop
(``for idx in <ids the block computed>: y[mask[:, :, idx]] = getattr(self.experts, f"expert_{idx}")(...)``), so
record/exchange/replay runs it as written (``execution="replay"``): the ids the loop visits, a row selected by
several of them (the last one's output stays), by none (left as it was), are the block's own business.

Parity (DESIGN.md) on 2 and 4 gloo ranks through the real detector, table and ``apply_plan`` (tokens past an
expert's capacity dropped, so some rows are selected by no expert). Expert dropout p>0 while training is refused,
naming it; in eval it is accepted (the training flag is then folded and watched). Edits of the loop the splice
refused run as written (exact, or failing as the model fails); one feeding the experts the rows earlier experts
wrote raises.
"""

from __future__ import annotations

import copy
import importlib
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
from autoep.plan.archetypes import compute_fn_config
from autoep.runtime.recipes.replay import ReplayError

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
    """``block`` made EP-ready in one process (no exchange) by the detector's decision through the table."""
    structure = detect_moe_structure(block)
    assert structure.execution == "replay", structure
    cfg = dict(compute_fn_config(structure))
    module, _, attr = cfg.pop("_factory_").rpartition(".")
    ep = copy.deepcopy(block)
    getattr(importlib.import_module(module), attr)(ep, ep_mesh=None, **cfg)
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
# One-edit twins of the loop. The splice refused them all; replay runs each as written, so each must be exact
# ("exact"), fail as the model fails ("fails": the model's own exception type), or raise (``ReplayError``).
VARIANTS = [
    # Reads other rows than it writes.
    (LOOP, 'next_states[router_mask[:, :, idx]] = getattr(self.experts, f"expert_{idx}")(hidden_states[router_mask[:, :, 0]])',
     "exact"),
    # The key of another expert: expert_{idx + 1} (the last id names no expert: the model raises).
    (LOOP, 'next_states[router_mask[:, :, idx]] = getattr(self.experts, f"expert_{(idx + 1) % 4}")(hidden_states[router_mask[:, :, idx]])',
     "exact"),
    (LOOP, 'next_states[router_mask[:, :, idx]] = getattr(self.experts, f"expert_{idx + 1}")(hidden_states[router_mask[:, :, idx]])',
     "fails"),
    # Adds into the rows instead of assigning them.
    (LOOP, 'next_states[router_mask[:, :, idx]] += getattr(self.experts, f"expert_{idx}")(hidden_states[router_mask[:, :, idx]])',
     "exact"),
    # The id on another axis: a (batch, experts) mask of the sequence axis, which the model cannot index by.
    (LOOP, 'next_states[router_mask[:, idx]] = getattr(self.experts, f"expert_{idx}")(hidden_states[router_mask[:, idx]])',
     "fails"),
    # The experts fed the output tensor's neighbouring rows, which earlier experts wrote: chained calls, exact.
    (LOOP, 'next_states[router_mask[:, :, idx]] = getattr(self.experts, f"expert_{idx}")((next_states.roll(1, 1) + hidden_states)[router_mask[:, :, idx]])',
     "exact"),
]


@pytest.mark.parametrize("old,new,outcome", VARIANTS, ids=[r[1][15:70] for r in VARIANTS])
def test_loop_variants_run_as_written_or_raise(old, new, outcome, tmp_path):
    torch.manual_seed(0)
    block = _variant(old, new, tmp_path)(hidden=16, ffn=24, num_experts=4, capacity=3).train()
    ep = _ep(block)
    x = torch.randn(2, 5, 16)
    if outcome == "raises":
        with pytest.raises(ReplayError, match="expert"):
            ep(x)
    elif outcome == "fails":
        with pytest.raises(Exception) as model_error:
            block(x)
        with pytest.raises(type(model_error.value)):
            ep(x)
    else:
        x_ref, x_ep = x.clone().requires_grad_(), x.clone().requires_grad_()
        want, got = block(x_ref), ep(x_ep)
        torch.testing.assert_close(got, want)
        want.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(x_ep.grad, x_ref.grad)
        for (n, p), (_, q) in zip(block.named_parameters(), ep.named_parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=lambda m, n=n: f"{n}: {m}")
