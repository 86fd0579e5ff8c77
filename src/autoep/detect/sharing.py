"""Sharing: an expert tensor autoep shards must be reachable by exactly one name in the whole model.

autoep replaces the experts' parameters of each matched block (stacked, sharded into new DTensor
parameters). A tensor the model reaches by a second name (tied to the shared expert's or another expert's,
the experts container of two blocks, one block registered twice, an expert registered elsewhere) would then
be two tensors: gradients split between them or land on an orphan. Such a model is refused, on the whole
model, naming both places.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch.nn as nn

from autoep.detect import plain_experts


def tensor_paths(model: nn.Module) -> dict[int, list[str]]:
    """``{id(tensor): every name the model reaches it by}`` for every parameter and buffer (one pass)."""
    paths: dict[int, list[str]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        paths.setdefault(id(t), []).append(name)
    for name, t in model.named_buffers(remove_duplicate=False):
        if t is not None:
            paths.setdefault(id(t), []).append(name)
    return paths


def shared_expert_tensors(model: nn.Module, blocks: Mapping[str, nn.Module], experts_path: str = "experts",
                          paths: dict[int, list[str]] | None = None) -> list[str]:
    """One line per expert parameter or buffer of the matched ``blocks`` (``{name: block}``) that the model
    reaches by more than one name, naming every name; ``[]`` when each has exactly one."""
    paths = tensor_paths(model) if paths is None else paths
    found, seen = [], set()
    for name, block in blocks.items():
        resolved = plain_experts.resolve(block, experts_path)
        if resolved is None:
            continue
        experts, prefix = resolved
        own = dict(experts.named_parameters(remove_duplicate=False))
        own |= {n: b for n, b in experts.named_buffers(remove_duplicate=False) if b is not None}
        for local, t in own.items():
            names = paths.get(id(t), [".".join(p for p in (name, prefix, local) if p)])
            if len(names) > 1 and id(t) not in seen:
                seen.add(id(t))
                found.append(f"{names[0]} is also {', '.join(names[1:4])}{' ...' if len(names) > 4 else ''}")
    return found


SHARING_FIX = ("autoep shards each block's expert tensors into new parameters, so a tensor reached by two names "
               "would become two: give each place its own nn.Parameter (untie them), or leave the block out of "
               "the plan")
