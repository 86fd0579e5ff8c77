"""Experts slicing their own weights (issue 31, ``tests/wrapper_blocks.py``) under the execution ``auto`` picks for
them, the spliced loop (their block's loop is proven; ``tests/detect/test_wrapper_blocks.py`` checks the choice), on
1, 2 and 4 gloo ranks: outputs, input grads, router grads summed over ranks, every expert grad from its owner, a rank
without tokens at W=4 (``tests/ep_parity.py``). ``auto`` picks the one pass for every other block there; the one pass
forced on every block, with two SGD steps and Python state, is ``tests/runtime/test_one_pass.py``.

    pytest tests/runtime/test_wrapper_parity.py
"""
from __future__ import annotations

import ep_parity
import pytest
import torch
import wrapper_blocks as wb
from distributed import guarded, run_cases

SPLICED = ("sliced_weights", "chunked_weights")  # the blocks ``auto`` runs by another path than the one pass


def _make(name: str):
    torch.manual_seed(sum(map(ord, name)))
    return wb.BLOCKS[name]().train()


def wrapper_cases(rank: int, world_size: int) -> dict:
    results = {}
    for name in SPLICED:
        guarded(results, name, ep_parity.check_parity, lambda n=name: _make(n), rank, world_size, wb.D)
    return results


@pytest.mark.parametrize("name", SPLICED)
def test_single_process_parity(name):
    ep_parity.check_parity(lambda: _make(name), 0, 1, wb.D)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_multi_rank_parity(world_size):
    results = run_cases(world_size, "test_wrapper_parity:wrapper_cases")
    failed = {case: errs for case, errs in results.items() if errs}
    assert len(results) == len(SPLICED) and not failed, "\n".join(f"{c}: {e[0][-800:]}" for c, e in failed.items())
