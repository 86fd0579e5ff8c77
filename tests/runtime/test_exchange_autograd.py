"""Autograd around the exchange (issue 17): whatever the block's own backward survives, EP's does too.

- The exchange saves only tensors of its own: a block that edits its routing weights in place after its
  expert loop (its own loop saved indexed copies) still backpropagates under EP.
- Every rank joins the backward exchange: torchtune's ``MoE.forward`` adds the routed output back only
  ``if routed_output.numel() > 0``, so a rank without tokens drops the exchange's output from its graph
  and would skip the backward all-to-all its peers wait in. The ep group times out after a few seconds:
  a rank left waiting fails the case, never hangs the run.

Parity on 1, 2 and 4 gloo ranks (one rank without tokens), against the blocks' own forward/backward.
"""

from __future__ import annotations

import pytest
import torch
from blocks import InplaceAfterLoopMoE, TitanMoE, TuneDropEmptyMoE
from distributed import guarded, run_cases
from rank_parity import SPLITS, ep_mesh, parity

from autoep.runtime import dispatch
from autoep.runtime.dispatch import _Join, join_exchanges, open_exchanges

BLOCKS = {
    "inplace_weights_after_loop": lambda: InplaceAfterLoopMoE(hidden=16, num_experts=4, top_k=2),
    "tune_drops_empty_output": lambda: TuneDropEmptyMoE(hidden=16, num_experts=4, top_k=2),
    "titan_control": lambda: TitanMoE(hidden=16, num_experts=4, top_k=2),
}


def _build(name: str):
    torch.manual_seed(sum(map(ord, name)))
    return BLOCKS[name]().train()


def autograd_cases(rank: int, world_size: int) -> dict:
    mesh = ep_mesh(world_size)
    results = {}
    for name in BLOCKS:
        for split in SPLITS[world_size]:
            guarded(results, f"{name} split={split}", parity, _build(name), rank, world_size, mesh, split)
    return results


def test_single_process_parity():
    failed = {n: e for n, e in autograd_cases(0, 1).items() if e}
    assert not failed, "\n".join(f"{n}:\n{e}" for n, e in failed.items())


@pytest.mark.parametrize("world_size", [2, 4])
def test_multi_rank_parity(world_size):
    results = run_cases(world_size, "test_exchange_autograd:autograd_cases")
    assert len(results) == len(BLOCKS) * len(SPLITS[world_size]), sorted(results)
    failed = {name: errs for name, errs in results.items() if errs}
    assert not failed, f"world_size={world_size}: " + "\n".join(f"{n}:\n{e[0]}" for n, e in failed.items())


def test_a_dropped_exchange_output_is_joined_without_changing_values():
    """The join keeps the block's output values (a copy, not a view) and gives the dropped output a zero
    gradient; an output the block used is not joined (the graph reaches it)."""
    x = torch.randn(3, 4, requires_grad=True)
    used, dropped = x * 2, x * 3
    open_exchanges()
    dispatch._exchanged(used)
    dispatch._exchanged(dropped)
    out = join_exchanges((used + 1, "aux"))
    assert isinstance(out, tuple) and out[1] == "aux"
    assert out[0].grad_fn._forward_cls is _Join
    torch.testing.assert_close(out[0], used + 1, rtol=0, atol=0)
    seen = []
    dropped.register_hook(lambda g: seen.append(g))
    out[0].sum().backward()
    assert len(seen) == 1 and not seen[0].any()  # the dropped output's backward ran, with zeros
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    open_exchanges()
    dispatch._exchanged(used)
    kept = used * 1
    assert join_exchanges(kept) is kept
