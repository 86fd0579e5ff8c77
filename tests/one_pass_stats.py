"""Routing statistics and random generators kept in a module of their own, as a project keeps them in a ``utils``
module: state outside the block, its class and its module (``one_pass_blocks`` writes it; issue 30's "another
module of the user's project" door)."""

from __future__ import annotations

import numpy as np
import torch

E = 4

ROUTED: list[list[int]] = []  # tokens per expert, one entry per block call
LOAD = torch.zeros(E)  # tokens per expert, summed over calls
NOISE = torch.Generator().manual_seed(1234)  # router jitter drawn by every block that imports it
NP_RNG = np.random.default_rng(1234)  # expert dropout drawn on the host


def add_load(selected: torch.Tensor) -> torch.Tensor:
    """Counts ``selected``'s experts into ``LOAD`` in place; returns the mean load so far."""
    LOAD.add_(torch.bincount(selected.flatten(), minlength=E).to(LOAD.dtype))
    return LOAD.mean()
