"""autoep's own training step pieces: the loss, the learning-rate schedule, the router load.

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
from autoep.runtime.recipes.local_experts import register_counts_hook, spec_of


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


class ExpertLoad:
    """Counts tokens per routed expert, summed over layers and ranks.

    Blocks that keep their own forward call ``experts(hidden, top_k_index, ...)``: this rank's routed
    (token, expert) pairs are counted there. Blocks whose expert loop the module_list recipe replaced report
    the rows the exchange brought to this rank's own experts (``register_counts_hook``): those counts land at
    the rank's expert offset. Blocks calling grouped experts
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
            block = model.get_submodule(name)
            experts = getattr(block, "experts", None)
            # ModuleList/ModuleDict experts are placed on the block, or on their container where its own
            # forward is the loop (Switch, NLLB): it reports the rows its local experts got
            placed = block if spec_of(block) is not None else experts if spec_of(experts) is not None else None
            if placed is not None:
                register_counts_hook(placed, self._local_hook)
                self.layers += 1
            elif isinstance(experts, nn.Module):
                experts.register_forward_pre_hook(self._hook, with_kwargs=True)
                self.layers += 1

    def _local_hook(self, first_expert: int, tokens_per_local_expert: Tensor):
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

    def discard(self) -> None:
        """Forget the tokens counted since the last ``collect`` (a validation pass routes tokens too)."""
        self.counts_E.zero_()

    def collect(self, world_group) -> dict:
        """Tokens per expert summed over layers and ranks since the last call, and max/mean imbalance."""
        counts = self.counts_E.clone()
        self.counts_E.zero_()
        if world_group is not None and dist.get_world_size(world_group) > 1:
            dist.all_reduce(counts, group=world_group)  # NOTE: collective; a few ints per step
        mean = counts.float().mean().item()
        return {"expert_load": counts.tolist(), "load_imbalance": counts.max().item() / mean if mean else 0.0}
