"""One optimiser step of EP training: loss, gradient reduction, clipping, schedule, router load.

Gradient scaling (what makes EP training equal single-process training on the concatenated batch):
the global loss is the mean of the ranks' losses, ``(1/W) sum_r loss_r`` (every rank has the same
token count). Each rank backpropagates ``loss_r / (W * accum)``. A dense parameter's grad on rank r is
then its share of the global grad, so dense grads are *summed* over the world. An expert shard's grad
already holds the contributions of every rank of its ``ep`` group (the all-to-all backward brought
them home), so expert grads are *summed* over ``edp`` only. Averaging over ``edp`` instead would be
``ep`` times too large.

Helpers take models, meshes, groups and plain values; only ``autoep.train.trainer`` reads the config.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from autoep.errors import ConfigError
from autoep.runtime.dense import is_expert
from autoep.runtime.recipes import local_tensor
from autoep.runtime.recipes.module_list import StackedSwiGLUExperts
from autoep.train.pretrained import expert_rows


def causal_lm_loss(model: nn.Module, input_ids_BL: Tensor, aux_loss_coef: float = 0.0) -> Tensor:
    """Mean next-token cross entropy over this rank's tokens, plus ``aux_loss_coef`` times the model's own
    load-balancing loss (asked for with ``output_router_logits=True``; computed on this rank's tokens)."""
    kwargs = {"output_router_logits": True} if aux_loss_coef else {}
    out = model(input_ids=input_ids_BL, use_cache=False, **kwargs)
    logits_BLV = out.logits if hasattr(out, "logits") else out
    loss = F.cross_entropy(logits_BLV[:, :-1].flatten(0, 1).float(), input_ids_BL[:, 1:].flatten())
    if aux_loss_coef:
        aux = getattr(out, "aux_loss", None)
        if aux is None:
            raise ConfigError(f"optim.aux_loss_coef={aux_loss_coef} but {type(model).__name__} returns no aux_loss "
                              f"with output_router_logits=True; set optim.aux_loss_coef=0")
        loss = loss + aux_loss_coef * aux
    return loss


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense, expert) trainable parameters; experts are the DTensors ``apply_plan`` sharded on ``ep``
    (dense ones are plain tensors, or DTensors on FSDP2's ``dp`` mesh under ``trainer.dense_sharding=fsdp2``)."""
    dense, expert = [], []
    for p in model.parameters():
        if p.requires_grad:
            (expert if is_expert(p) else dense).append(p)
    return dense, expert


def reduce_grads(dense: list[nn.Parameter], expert: list[nn.Parameter], world_group, edp_group) -> None:
    """Sum dense grads over the world and expert grads over ``edp`` (one flat bucket each).

    Dense parameters FSDP2 sharded (``trainer.dense_sharding=fsdp2``, ``autoep.runtime.dense``) are skipped: FSDP
    already reduce-scattered their grads over the world in backward. Replicated dense params (the
    default, and the only choice for one process) take the plain all-reduce here.
    """
    dense = [p for p in dense if not isinstance(p, DTensor)]
    for params, group in ((dense, world_group), (expert, edp_group)):
        if not params or group is None or dist.get_world_size(group) == 1:
            continue
        grads = []
        for p in params:
            if p.grad is None:  # a parameter no token reached still joins the collective, with zeros
                p.grad = torch.zeros_like(p)
            grads.append(local_tensor(p.grad))
        flat = _flatten_dense_tensors(grads)
        # NOTE: collective. One all-reduce per parameter kind and step; every rank calls both in order.
        dist.all_reduce(flat, group=group)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)


@torch.no_grad()
def clip_grad_norm(dense: list[nn.Parameter], expert: list[nn.Parameter], max_norm: float, ep_group) -> float:
    """Clip to a global L2 norm (replicated dense counted once, FSDP2 dense shards summed over their ``dp``
    mesh, expert shards summed over ``ep``); returns the norm, the same on every rank."""
    sq = torch.zeros((), dtype=torch.float64)
    sharded_sq, sharded_group = torch.zeros((), dtype=torch.float64), None
    for p in dense:
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):  # an FSDP2 shard (Shard(0) on the 1-D dp mesh; padding excluded)
            sharded_sq += p.grad.to_local().double().pow(2).sum()
            sharded_group = p.grad.device_mesh.get_group()
        else:
            sq += p.grad.double().pow(2).sum()
    if sharded_group is not None:
        dist.all_reduce(sharded_sq, group=sharded_group)  # NOTE: collective; each rank holds 1/W of every dense grad
    expert_sq = torch.zeros((), dtype=torch.float64)
    for p in expert:
        if p.grad is not None:
            expert_sq += local_tensor(p.grad).double().pow(2).sum()
    if ep_group is not None and dist.get_world_size(ep_group) > 1:
        dist.all_reduce(expert_sq, group=ep_group)  # NOTE: collective; each ep rank holds other experts
    norm = float((sq + sharded_sq + expert_sq).sqrt())
    if max_norm and max_norm > 0:
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for p in dense + expert:
                if p.grad is not None:
                    local_tensor(p.grad).mul_(coef)
    return norm


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup from ~0 to 1, then cosine down to ``min_lr_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class ExpertLoad:
    """Counts tokens per routed expert, summed over layers and ranks.

    Blocks that keep their own forward call ``experts(hidden, top_k_index, ...)``: this rank's routed
    (token, expert) pairs are counted there. Blocks whose whole forward the module_list recipe replaced
    call ``experts(x_SD, tokens_per_local_expert)`` on the rows the exchange brought to this rank's own
    experts: those counts land at the rank's expert offset. Blocks calling grouped experts
    ``experts(x_sorted, num_tokens_per_expert)`` pass this rank's counts per expert: added as they are.
    Experts called on E equal groups of rows (Llama-4's ``experts(rows)``, each token once per expert,
    pre-scaled by its score): the rows of group e that are not all zero are the tokens routed to e.
    Summed over the world, all give the same global tokens per expert (``edp`` replicas hold disjoint tokens).
    """

    def __init__(self, model: nn.Module, block_names: list[str], num_experts: int):
        self.num_experts = num_experts
        self.counts_E = torch.zeros(num_experts, dtype=torch.long)
        self.layers = 0
        for name in block_names:
            experts = getattr(model.get_submodule(name), "experts", None)
            if isinstance(experts, StackedSwiGLUExperts):
                rows = expert_rows(experts.gate_up_proj)
                experts.register_forward_pre_hook(functools.partial(self._local_hook, rows.start if rows else 0))
                self.layers += 1
            elif isinstance(experts, nn.Module):
                experts.register_forward_pre_hook(self._hook, with_kwargs=True)
                self.layers += 1

    def _local_hook(self, first_expert: int, module, args):
        tokens_per_local_expert = args[1]
        self.counts_E[first_expert:first_expert + len(tokens_per_local_expert)] += tokens_per_local_expert.detach().cpu()

    def _hook(self, module, args, kwargs):
        spec = getattr(module, "_autoep_ep", None)  # the batched recipe binds the ids by the experts' signature
        roles, signature = getattr(spec, "roles", None), getattr(spec, "signature", None)
        proof = getattr(spec, "proof", None)
        equal = getattr(spec, "equal", None)
        if equal is not None and signature is not None:  # experts(rows) on E equal groups of rows
            rows = signature.bind(module, *args, **kwargs).arguments.get(equal.grouped.x)
            E = equal.grouped.num_experts
            if isinstance(rows, Tensor) and rows.dim() >= 2 and rows.numel() and (rows.numel() // rows.shape[-1]) % E == 0:
                routed_E = (rows.detach().reshape(E, -1, rows.shape[-1]) != 0).any(dim=-1).sum(dim=1)
                self.counts_E[:E] += routed_E.cpu()  # NOTE: device-to-host copy of E counts per layer
            return
        if proof is not None and signature is not None:  # grouped experts(x_sorted, num_tokens_per_expert)
            counts = signature.bind(module, *args, **kwargs).arguments.get(proof.counts)
            if isinstance(counts, Tensor):
                counts = counts.detach().reshape(-1).cpu()[: self.num_experts]
                self.counts_E[: len(counts)] += counts.long()
            return
        if roles is not None and signature is not None:  # e.g. 4.x DBRX: experts(x, weights, top_weights, top_experts)
            top_k_index = signature.bind(module, *args, **kwargs).arguments.get(roles.index)
        else:
            top_k_index = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
        if isinstance(top_k_index, Tensor):
            ids = top_k_index.detach().reshape(-1).cpu()
            ids = ids[(ids >= 0) & (ids < self.num_experts)]  # padding ids (e.g. E) route nowhere
            self.counts_E += torch.bincount(ids, minlength=self.num_experts)

    def collect(self, world_group) -> dict:
        """Tokens per expert summed over layers and ranks since the last call, and max/mean imbalance."""
        counts = self.counts_E.clone()
        self.counts_E.zero_()
        if world_group is not None and dist.get_world_size(world_group) > 1:
            dist.all_reduce(counts, group=world_group)  # NOTE: collective; a few ints per step
        mean = counts.float().mean().item()
        return {"expert_load": counts.tolist(), "load_imbalance": counts.max().item() / mean if mean else 0.0}
