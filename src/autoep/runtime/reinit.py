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

Init code that does not recurse through ``apply`` (a loop over ``model.parameters()`` calling ``nn.init`` on each,
``p.uniform_()`` on named parameters, transformers' ``model.init_weights()``, whose ``smart_apply`` calls ``fn``
directly) is exact per draw instead:
  - on a remote expert's stand-in, a random op draws on a temporary of the model tensor's shape, dtype and device
    (``autoep.runtime.stand_in``);
  - on a sharded expert parameter (a DTensor on a mesh with an ``ep`` dim), DTensor's random ops (``normal_``,
    ``uniform_``, ``bernoulli_``, ``*_like``, dropout: what every ``nn.init`` draw reaches) are drawn on the full
    tensor (``_full_with_shard``, for the time of the op) and this rank's slot kept (``install_exact_draws``), where
    DTensor alone draws the shard's size (CPU) or from an RNG tracker of its own (CUDA). What follows a draw on the
    parameter (``trunc_normal_``'s ``erfinv_``, ``mul_``, ``clamp_``) is elementwise, exact on the shard.
Both draw the model's stream, so the tensors drawn after the experts are the model's too. Not exact, and refused by
torch itself on a sharded parameter: inits that compute on the whole tensor (``orthogonal_``'s QR); spell those
``model.apply(fn)`` or init before ``apply_plan``.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autoep.errors import AfterApplyError


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


# ---------------------------------------------------------------------------------------------
# Random ops on sharded expert parameters, outside ``model.apply``
# ---------------------------------------------------------------------------------------------


def install_exact_draws(is_expert: Callable[[torch.Tensor], bool]) -> None:
    """Process-wide, once: a random op on an expert parameter (a DTensor ``is_expert`` holds for: on a mesh with an
    ``ep`` dim) draws as on the model's full tensor (module docstring). Other DTensors draw as DTensor draws them."""
    # NOTE: torch-private names (as in torch 2.13). DTensor's own random ops (``_random_ops``) come back to Python
    # for their local computation (``_dispatch_get_local_results_slow_path``); the draws it takes for pointwise ops
    # (``exponential_``, ...) are given a handler in ``_custom_op_handlers``, as torch's loss_parallel does. Where a
    # torch lacks them nothing is wrapped, and tests/runtime/test_init_precision.py's init-loop cases on batched
    # experts fail, so an upgrade cannot drop this silently.
    dispatcher = getattr(DTensor, "_op_dispatcher", None)
    local_results = getattr(dispatcher, "_dispatch_get_local_results_slow_path", None)
    random_ops = getattr(dispatcher, "_random_ops", None)
    handlers = getattr(dispatcher, "_custom_op_handlers", None)
    if local_results is None or random_ops is None or not isinstance(handlers, dict):
        return
    if not isinstance(local_results, _ExactDraws):
        dispatcher._dispatch_get_local_results_slow_path = _ExactDraws(local_results, random_ops, is_expert)
    for name in _POINTWISE_DRAWS:
        op = getattr(getattr(torch.ops.aten, name, None), "default", None)
        if op is not None and op not in random_ops:
            handlers.setdefault(op, functools.partial(_pointwise_draw, is_expert))


# In-place draws DTensor shards as pointwise ops (each rank draws its shard's size from the default generator).
_POINTWISE_DRAWS = ("exponential_", "cauchy_", "log_normal_", "geometric_")


class _ExactDraws:
    """``OpDispatcher._dispatch_get_local_results_slow_path`` drawing random ops on expert shards whole."""

    def __init__(self, original, random_ops, is_expert: Callable[[torch.Tensor], bool]):
        self.original, self.random_ops, self.is_expert = original, random_ops, is_expert

    def __call__(self, op_call, args, op_info):
        first = args[0] if args else None
        if op_call in self.random_ops and self.is_expert(first) and not op_info.local_args[0].is_meta:
            return _drawn_whole(op_call, first, op_info.local_args[0], op_info.local_args[1:], op_info.local_kwargs)
        return self.original(op_call, args, op_info)


def _pointwise_draw(is_expert: Callable[[torch.Tensor], bool], op_call, args, kwargs):
    """A ``_custom_op_handlers`` entry for an in-place draw DTensor takes for pointwise: an expert shard drawn whole,
    any other DTensor's local tensor drawn as DTensor draws it."""
    first = args[0]
    local = first._local_tensor
    rest = tuple(a._local_tensor if isinstance(a, DTensor) else a for a in args[1:])
    if is_expert(first) and not local.is_meta:
        _drawn_whole(op_call, first, local, rest, kwargs)
    else:
        op_call(local, *rest, **kwargs)
    return first


def _drawn_whole(op_call, shard: DTensor, local: torch.Tensor, rest: tuple, kwargs: dict):
    """The local results of the random op ``op_call`` on ``shard`` (``local`` its local tensor): the op run on the
    full tensor (this rank's shard in its slot, zeros elsewhere; real memory for the time of the op, as
    ``model.apply`` allocates it), this rank's slot of what it gives."""
    if any(arg.is_out for arg in op_call._schema.arguments):
        raise AfterApplyError(f"{op_call} writes its draw into an expert parameter shard through out=; under expert "
                              f"parallelism autoep draws a sharded expert parameter whole (as the model draws it) "
                              f"only in place or *_like: initialise it in place (nn.init.*) or before apply_plan")
    slot = _slot(shard)
    full = torch.zeros(shard.shape, dtype=local.dtype, device=local.device)
    full[slot].copy_(local)
    out = op_call(full, *rest, **kwargs)
    if op_call._schema.name.endswith("_"):  # in place (normal_, uniform_, ...): this rank's slot, into its shard
        local.copy_(full[slot])
        return local
    if isinstance(out, (tuple, list)):
        return type(out)(o[slot].clone() for o in out)
    return out[slot].clone()


def _slot(shard: DTensor) -> tuple[slice, ...]:
    """Where this rank's shard sits in the full tensor: contiguous along each dim ``Shard``/``Replicate`` place it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(type(p) not in (Shard, Replicate) for p in shard.placements):
        raise AfterApplyError(f"a random draw on an expert parameter placed {shard.placements}: autoep draws a "
                              f"sharded expert parameter whole (as the model draws it) only for Shard/Replicate "
                              f"placements; initialise the model before apply_plan, or through model.apply(fn)")
    shape, offset = compute_local_shape_and_global_offset(shard.shape, shard.device_mesh, shard.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))
