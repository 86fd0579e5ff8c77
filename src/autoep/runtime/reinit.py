"""``model.apply(fn)`` after ``apply_plan``: every expert initialised once, as the model would be for the same seed.

``nn.Module.apply`` visits the modules children first, in registration order, and an init ``fn`` draws from the
RNG stream as it goes: on the model, once per expert tensor, expert by expert, then for the dense modules after
them. After ``apply_plan`` a rank holds only its own experts: ModuleList/ModuleDict experts another rank owns are
``meta`` stand-ins (a draw on ``meta`` consumes nothing) and batched experts are ``Shard(0)`` DTensors (DTensor's
random ops draw from a stream of their own), so the stream, and every dense weight drawn after the experts, would
differ from the model's and from rank to rank.

The modules holding such experts therefore get an instance-level ``apply`` (``nn.Module.apply`` recurses through
``child.apply(fn)``, which finds it), a ``functools.partial`` so that a deep copy or a pickle keeps it:
  - ModuleList experts (``autoep.runtime.recipes.local_experts``, on the container): a remote expert's tensors are
    allocated in full on the local experts' device for the time of its own ``apply`` (one expert at a time), then
    it becomes a stand-in again; its modules' ``reset_parameters`` likewise, where called directly;
  - sharded experts (``sharded_apply``, on the experts module): each DTensor parameter is swapped for a full plain
    parameter holding this rank's shard in its slot (zeros elsewhere) for the time of the call; afterwards the slot
    is copied back into the shard and the rest freed.
Both run ``nn.Module.apply`` itself, so ``fn`` sees the modules, classes and full shapes the model has and draws
exactly what it draws there (fan-in/fan-out included); an ``fn`` that edits values in place (``p.mul_(0.5)``) edits
this rank's part as on the model.

Not covered, and not exact: init code that does not recurse through ``apply`` (a loop over ``model.parameters()``
calling ``nn.init`` on each, transformers' ``model.init_weights()``, whose ``smart_apply`` calls ``fn`` directly).
Spell those ``model.apply(fn)`` (transformers: ``model.apply(model._init_weights)``).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def install_sharded_apply(experts: nn.Module) -> None:
    """Give ``experts`` (a module holding ``Shard(0)`` DTensor expert parameters, nested ones included) the exact
    ``apply`` of this module's docstring; nothing to do where it holds none (no mesh)."""
    if any(isinstance(p, DTensor) for p in experts.parameters()):
        experts.apply = functools.partial(sharded_apply, experts)


def sharded_apply(self: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
    """``nn.Module.apply(self, fn)`` with every DTensor parameter of ``self`` full for the time of the call."""
    swapped = []
    for m in self.modules():
        for name, p in list(m._parameters.items()):
            if isinstance(p, DTensor):
                m._parameters[name] = nn.Parameter(_full_with_shard(p), requires_grad=p.requires_grad)
                swapped.append((m, name, p))
    try:
        nn.Module.apply(self, fn)
        for m, name, shard in swapped:
            _keep_shard(m._parameters.get(name), shard, f"{type(m).__name__}.{name}")
    finally:
        for m, name, shard in swapped:
            m._parameters[name] = shard
    return self


def _place(shard: DTensor) -> tuple[int, int]:
    """(number of shards, this rank's index) along dim 0: the ``ep`` mesh dim that ``Shard(0)`` is placed on."""
    dims = [i for i, placement in enumerate(shard.placements) if placement.is_shard(0)]
    if len(dims) != 1:
        raise ValueError(f"expert parameter placed {shard.placements}; autoep shards experts Shard(0) over one "
                         f"mesh dim")
    return shard.device_mesh.size(dims[0]), shard.device_mesh.get_local_rank(dims[0])


def _full_with_shard(shard: DTensor) -> torch.Tensor:
    """A full tensor (real memory, the shard's device and dtype) holding this rank's shard in its slot, zeros
    elsewhere (a slot as ``autoep.runtime.apply.shard_expert_tensor`` cuts it: ``chunk`` along dim 0)."""
    local = shard.to_local().detach()
    full = torch.zeros(shard.shape, dtype=shard.dtype, device=local.device)
    size, index = _place(shard)
    full.chunk(size, dim=0)[index].copy_(local)
    return full


def _keep_shard(full, shard: DTensor, name: str) -> None:
    if not isinstance(full, torch.Tensor) or tuple(full.shape) != tuple(shard.shape):
        got = tuple(full.shape) if isinstance(full, torch.Tensor) else full
        raise ValueError(f"model.apply(fn) replaced the expert parameter {name} of shape {tuple(shard.shape)} by "
                         f"{got!r}; under expert parallelism each rank keeps its shard of it. Initialise it in "
                         f"place (nn.init.*, p.copy_(...)) or re-apply the plan to a model built with the new shape")
    size, index = _place(shard)
    with torch.no_grad():
        shard.to_local().copy_(full.detach().chunk(size, dim=0)[index])


@contextmanager
def allocated(module: nn.Module, device: torch.device) -> Iterator[nn.Module]:
    """Within: every ``meta`` parameter and buffer of ``module`` is a real zero tensor of its shape and dtype on
    ``device`` (trainable parameters where floating). The caller makes them stand-ins again afterwards."""
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None and p.is_meta:
                m._parameters[name] = nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=device),
                                                   requires_grad=p.is_floating_point() or p.is_complex())
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)
    yield module
