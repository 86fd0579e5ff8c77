"""autoep's own training step pieces: the loss and the learning-rate schedule (the router load:
``autoep.train.load``; global load balancing: ``autoep.train.balance``).

Gradient reduction and clipping (and why dense grads are summed over the world and expert grads over ``edp``)
live in ``autoep.runtime.grads``, shared with ``autoep.integrations``. Helpers take models, meshes, groups and
plain values; only ``autoep.train.trainer`` reads the config.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from autoep.errors import ConfigError


def causal_lm_loss(model: nn.Module, input_ids_BL: Tensor, aux_loss_coef: float = 0.0, router_losses=None) -> Tensor:
    """Mean next-token cross entropy over this rank's tokens, plus ``aux_loss_coef`` times the model's own
    load-balancing loss (asked for with ``output_router_logits=True``; computed on this rank's tokens), plus
    ``router_losses(out)`` (``autoep.train.balance.RouterLosses``: global aux loss, z-loss) where given."""
    kwargs = {"output_router_logits": True} if aux_loss_coef or router_losses is not None else {}
    out = model(input_ids=input_ids_BL, use_cache=False, **kwargs)
    logits_BLV = out.logits if hasattr(out, "logits") else out
    loss = F.cross_entropy(logits_BLV[:, :-1].flatten(0, 1).float(), input_ids_BL[:, 1:].flatten())
    if aux_loss_coef:
        aux = getattr(out, "aux_loss", None)
        if aux is None:
            raise ConfigError(f"optim.aux_loss_coef={aux_loss_coef} but {type(model).__name__} returns no aux_loss "
                              f"with output_router_logits=True; set optim.aux_loss_coef=0")
        loss = loss + aux_loss_coef * aux
    if router_losses is not None:
        loss = loss + router_losses(out)
    return loss


def validation_loss(model: nn.Module, batches, world_group, device) -> float:
    """Mean next-token loss over this rank's rows of each validation batch, averaged over the world: every
    rank holds as many rows of each as the others, so the mean of the means is the mean over all tokens.
    Eval mode, no autograd, the RNG left as it was (a resumed run draws what the uninterrupted one did)."""
    was_training = model.training
    model.eval()
    loss_sum, count = torch.zeros((), dtype=torch.float64), 0
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []):
            for batch_BL in batches:
                loss_sum += causal_lm_loss(model, batch_BL.to(device)).double().cpu()
                count += 1
    finally:
        model.train(was_training)
    if world_group is not None:
        dist.all_reduce(loss_sum, group=world_group)  # NOTE: collective; the global mean
        count *= dist.get_world_size(world_group)
    return loss_sum.item() / count


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup from ~0 to 1, then cosine down to ``min_lr_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
