"""Compute-fn factories named by the archetype table (``autoep.archetypes.TABLE``).

Every factory follows one contract (see ``autoep.archetypes``)::

    factory(module: nn.Module, *, ep_mesh: DeviceMesh | None, **kwargs) -> None

It is called once per matched block by ``autoep.apply.apply_plan`` after the block's expert
parameters have become ``Shard(0)`` DTensors over ``ep_mesh`` (the 1-D ``ep`` mesh; ``None`` runs
without exchange). It makes the block EP-ready in place and returns nothing. ``kwargs`` are the keys
written next to ``_target_`` in the resolved config (for auto decisions ``structure``, the
``MoeStructure`` as a dict).

- ``batched.ep_batched_experts``: v5-style blocks; keeps the block forward, replaces the experts'.
- ``module_list.ep_module_list_block``: v4-style blocks; runs the block's own forward with only its
  proven expert loop spliced out and replaced by the exchange.
- ``grouped.ep_grouped_experts``: blocks calling ``experts(x_sorted, num_tokens_per_expert)``; keeps the
  block forward, replaces the experts' (each group's rows go to the rank owning that expert).
"""

from __future__ import annotations

from torch import Tensor


def local_tensor(t: Tensor) -> Tensor:
    """This rank's shard of an expert parameter (a ``Shard(0)`` DTensor), differentiably; plain tensors pass."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def ep_group_of(ep_mesh):
    """The process group of the 1-D ``ep`` mesh, or ``None`` (no exchange) for no mesh."""
    return None if ep_mesh is None else ep_mesh.get_group()
