"""Blocks accepted by reading what their helpers read (issue 31 item 5: ``tests/reads_blocks.py``) run under EP
exactly as their own forward on 1, 2 and 4 gloo ranks (``tests/ep_parity.py``): routing renormalised by
``einops.reduce``, a logging helper given the routing's scores, experts built of a framework's linear layer whose
unsupplied-weight ``raise`` the configuration never reaches."""
from __future__ import annotations

import ep_parity
import pytest
import reads_blocks as R
from distributed import guarded, run_cases

BLOCKS = {
    "einops_routing": lambda: R.moe(R.EinopsRoutingMoE).train(),
    "logged_scores": lambda: R.moe(R.LoggedScoresMoE).train(),
    "framework_layer": lambda: R.framework_moe().train(),
}


def _names():
    return [n for n in BLOCKS if n != "einops_routing" or R.reduce is not None]


def reads_cases(rank: int, world_size: int) -> dict:
    results = {}
    for name in _names():
        guarded(results, name, ep_parity.check_parity, BLOCKS[name], rank, world_size, R.D)
    return results


@pytest.mark.parametrize("name", list(BLOCKS))
def test_single_process_parity(name):
    if name == "einops_routing":
        pytest.importorskip("einops")
    ep_parity.check_parity(BLOCKS[name], 0, 1, R.D)


@pytest.mark.parametrize("world_size", [2, 4])
def test_multi_rank_parity(world_size):
    results = run_cases(world_size, "test_reads_parity:reads_cases")
    failed = {case: errs for case, errs in results.items() if errs}
    assert results.keys() == set(_names()) and not failed, \
        "\n".join(f"{case}: {errs[0]}" for case, errs in failed.items())
