"""``trainer.precision``: what one micro-batch's forward and backward compute in (``fp32 | bf16-mixed | bf16``).

In every precision the parameters the optimiser steps, their gradients, the optimiser state, the gradient sums
and norm (``autoep.runtime.grads``) and the DCP checkpoints are fp32: only the forward (and the backward it
records) changes, so a resume continues exactly, under the same precision or another.

- ``fp32``: nothing changes (the default).
- ``bf16-mixed``: the forward runs under ``torch.autocast(<device>, torch.bfloat16)``: matmuls in bf16, what
  autocast keeps in fp32 (softmax, norms, the loss) in fp32; the backward follows the forward's dtypes. Dense
  parameters FSDP2 shards (``trainer.dense_sharding=fsdp2``) are gathered in bf16 and their gradients
  reduce-scattered in fp32 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, torchtitan's mixed
  precision). There the bf16 embedding makes every activation bf16, so the experts (which FSDP leaves out) get
  bf16 copies as under ``bf16``: every weight the forward reads is bf16, autocast on top.
- ``bf16``: every parameter enters the forward as its bf16 copy, without autocast, so every op computes in bf16
  except where the model upcasts itself (HF's RMSNorm, the loss), and the activations the token exchange
  carries are bf16. What a transformers model keeps in fp32 in bf16 too (``_keep_in_fp32_modules_strict``:
  DeepSeek-V3's router) stays fp32, except in dense shards FSDP2 gathers (its ``param_dtype`` is one per
  layer). The fp32 master of each parameter is the parameter itself; the bf16 copy is a differentiable cast
  made at each forward (FSDP2's ``param_dtype=bf16`` makes the same copy of the dense shards it gathers). The gradient reaches the fp32 parameter through the cast: computed in bf16, accumulated
  in fp32 over micro-batches. Chosen over a second fp32 parameter set the optimiser steps and copies back
  (Megatron's): the optimiser, clipping, gradient sums, checkpoints and the HF export see exactly what they
  see in fp32 (no optimiser state to re-key by name, no copy to keep in step), and the bf16 copy lives only
  from the forward to the end of the backward; it costs one cast of the local parameters per micro-batch.

Helpers take models, devices and plain strings; the trainer reads the config.
"""
from __future__ import annotations

import re
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.nn.utils.stateless import _reparametrize_module

from autoep.errors import ConfigError
from autoep.runtime.dense import is_expert
from autoep.runtime.recipes.local_experts import expert_owners
from autoep.train.config import PRECISIONS


def check_supported(precision: str, device: torch.device) -> None:
    """Before any work: ``precision`` is one of ``PRECISIONS`` and ``device`` computes in it."""
    if precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision={precision}: must be one of {', '.join(PRECISIONS)}")
    if precision != "fp32" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"trainer.precision={precision}: {torch.cuda.get_device_name(device)} has no bf16 "
                          f"support (torch.cuda.is_bf16_supported() is False); use trainer.precision=fp32")


def check_fp32_masters(model: nn.Module, precision: str) -> None:
    """Before any step: below fp32 the trainable parameters are the fp32 masters, so they must be fp32 (a model
    built in bf16 would silently step bf16 weights with bf16 optimizer state)."""
    if precision == "fp32":
        return
    other = {name: p.dtype for name, p in model.named_parameters()
             if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32}
    if other:
        name, dtype = next(iter(other.items()))
        raise ConfigError(f"trainer.precision={precision} keeps fp32 master weights, but {len(other)} of the model's "
                          f"parameters are {str(dtype).removeprefix('torch.')} (e.g. {name}); build the model in fp32 "
                          f"(model.dtype=float32 where its config has a dtype), or train these weights as they are "
                          f"with trainer.precision=fp32")


def fsdp_policy(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for the dense shards: bf16 gathers and fp32 reduce-scatters below fp32, else None (fp32).

    FSDP casts no layer inputs (``cast_forward_inputs=False``): the activations' dtype is the precision's (fp32
    between autocast's ops, bf16 from the bf16 weights), not FSDP's. Casting them would make a bf16-mixed layer's
    residual stream bf16, and hand bf16 rows to the experts, which FSDP leaves out and so does not cast."""
    if precision == "fp32":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


@contextmanager
def forward(model: nn.Module, precision: str, device: torch.device):
    """Run the model's forward inside this context: under autocast (``bf16-mixed``) or with every parameter
    replaced by its bf16 copy (``bf16``); the backward runs after the context, on the graph it recorded."""
    # Under FSDP2 (bf16-mixed too) the dense weights are gathered in bf16 (``fsdp_policy``), so the activations are
    # bf16 from the embedding on; the experts, which FSDP leaves out, get the same bf16 copy: every weight the
    # forward reads is bf16, as FSDP2's param_dtype says (and as FSDP2 would gather experts it sharded). Left fp32,
    # they would meet bf16 rows in the batched recipe's grouped GEMM on CPU, which raises on the mixed dtypes
    # (transformers' own grouped_mm casts the rows to the weights' dtype instead).
    copies = precision == "bf16" or (precision == "bf16-mixed" and isinstance(model, FSDPModule))
    # NOTE: functional_call's own context (torch.func.functional_call is this context around one call), as the
    # trainer's loss calls the model itself. Tied parameters stay tied (one copy).
    with _reparametrize_module(model, bf16_copies(model), tie_weights=True) if copies else nullcontext(), \
            torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        yield


def bf16_copies(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each floating parameter this rank computes with, cast to bf16 (differentiable), by name. Left out: what a
    transformers model keeps in fp32 in bf16 too (``_keep_in_fp32_modules_strict``, matched as transformers matches
    it: DeepSeek-V3's router ``gate.weight``), the dense shards FSDP2 manages (it gathers them in bf16 itself,
    ``fsdp_policy``) and the meta stand-ins of ModuleList experts other ranks own (they never compute)."""
    remote = {name for name, place in expert_owners(model).items() if not place.local}
    fp32 = [re.compile(glob.replace("*", ".*")) for glob in getattr(model, "_keep_in_fp32_modules_strict", None) or ()]
    return {name: p.to(torch.bfloat16) for name, p in model.named_parameters()
            if p.is_floating_point() and name not in remote and not (isinstance(p, DTensor) and not is_expert(p))
            and not any(pattern.search(name) for pattern in fp32)}
