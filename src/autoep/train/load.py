"""Expert load: tokens per routed expert of each planned block, summed over ranks; the fields ``metrics.jsonl``
and the progress line show (``autoep.train.plot`` draws them).

Every step's row carries the load summed over blocks (``expert_load``, ``load_imbalance``); a logged step's row
(every ``trainer.log_every`` steps, the first and the last) adds each block's tokens per expert since the last
logged row (``layer_load``, over ``layer_load_steps`` steps) and each block's max/mean (``layer_imbalance``).

Legend: L planned blocks (in plan order), E routed experts.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autoep.runtime.recipes.local_experts import register_counts_hook, spec_of


class ExpertLoad:
    """Counts tokens per routed expert of each planned block; ``collect`` sums them over ranks.

    Blocks that keep their own forward call ``experts(hidden, top_k_index, ...)``: this rank's routed
    (token, expert) pairs are counted there. Blocks whose expert loop the module_list recipe replaced, or
    that the one-pass execution runs, report the rows the exchange brought to this rank's own experts
    (``register_counts_hook``): those counts land at the rank's expert offset. Blocks calling grouped experts
    ``experts(x_sorted, num_tokens_per_expert)`` pass this rank's counts per expert: added as they are.
    Experts called on E equal groups of rows (Llama-4's ``experts(rows)``, each token once per expert,
    pre-scaled by its score): the rows of group e that are not all zero are the tokens routed to e.
    Summed over the world, all give the same global tokens per expert (``edp`` replicas hold disjoint tokens).
    """

    def __init__(self, model: nn.Module, block_names: list[str], num_experts: int):
        self.names = list(block_names)
        self.num_experts = num_experts
        self.counts_LE = torch.zeros(len(block_names), num_experts, dtype=torch.long)
        self.counted = [False] * len(block_names)  # whether a hook hears block i
        self.window_LE = torch.zeros_like(self.counts_LE)  # global counts since the last logged row
        self.window_steps = 0
        for i, name in enumerate(block_names):
            block = model.get_submodule(name)
            experts = getattr(block, "experts", None)
            if spec_of(block) is not None:  # ModuleList/ModuleDict experts are placed on the block
                register_counts_hook(block, partial(self._local_hook, i))
                self.counted[i] = True
            elif isinstance(experts, nn.Module):
                experts.register_forward_pre_hook(partial(self._hook, i), with_kwargs=True)
                self.counted[i] = True

    @property
    def layers(self) -> int:
        """How many planned blocks are counted."""
        return sum(self.counted)

    @property
    def counts_E(self) -> Tensor:
        """This rank's counts since the last ``collect``, summed over blocks."""
        return self.counts_LE.sum(dim=0)

    def _local_hook(self, i: int, first_expert: int, tokens_per_local_expert: Tensor):
        span = slice(first_expert, first_expert + len(tokens_per_local_expert))
        self.counts_LE[i, span] += tokens_per_local_expert.detach().cpu()

    def _hook(self, i: int, module, args, kwargs):
        counts_E = self.counts_LE[i]
        spec = getattr(module, "_autoep_ep", None)  # the batched recipe binds the ids by the experts' signature
        roles, signature = getattr(spec, "roles", None), getattr(spec, "signature", None)
        proof = getattr(spec, "proof", None)
        equal = getattr(spec, "equal", None)
        if equal is not None and signature is not None:  # experts(rows) on E equal groups of rows
            rows = signature.bind(module, *args, **kwargs).arguments.get(equal.grouped.x)
            E = equal.grouped.num_experts
            if isinstance(rows, Tensor) and rows.dim() >= 2 and rows.numel() and (rows.numel() // rows.shape[-1]) % E == 0:
                routed_E = (rows.detach().reshape(E, -1, rows.shape[-1]) != 0).any(dim=-1).sum(dim=1)
                counts_E[:E] += routed_E.cpu()  # NOTE: device-to-host copy of E counts per layer
            return
        if proof is not None and signature is not None:  # grouped experts(x_sorted, num_tokens_per_expert)
            counts = signature.bind(module, *args, **kwargs).arguments.get(proof.counts)
            if isinstance(counts, Tensor):
                counts = counts.detach().reshape(-1).cpu()[: self.num_experts]
                counts_E[: len(counts)] += counts.long()
            return
        if roles is not None and signature is not None:  # e.g. 4.x DBRX: experts(x, weights, top_weights, top_experts)
            top_k_index = signature.bind(module, *args, **kwargs).arguments.get(roles.index)
        else:
            top_k_index = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
        if isinstance(top_k_index, Tensor):
            ids = top_k_index.detach().reshape(-1).cpu()
            ids = ids[(ids >= 0) & (ids < self.num_experts)]  # padding ids (e.g. E) route nowhere
            counts_E += torch.bincount(ids, minlength=self.num_experts)

    def discard(self) -> None:
        """Forget the tokens counted since the last ``collect`` (a validation pass routes tokens too)."""
        self.counts_LE.zero_()

    def collect(self, world_group) -> dict:
        """The step's fields: tokens per expert summed over blocks and ranks since the last call, and their
        max/mean. The step's global counts per block stay in ``step_LE`` (the router bias update reads them)."""
        counts_LE = self.counts_LE.clone()
        self.counts_LE.zero_()
        if world_group is not None and dist.get_world_size(world_group) > 1:
            dist.all_reduce(counts_LE, group=world_group)  # NOTE: collective; L x E ints per step
        self.step_LE = counts_LE
        self.window_LE += counts_LE
        self.window_steps += 1
        counts_E = counts_LE.sum(dim=0)
        return {"expert_load": counts_E.tolist(), "load_imbalance": imbalance(counts_E)}

    def log_fields(self) -> dict:
        """A logged row's fields: each block's tokens per expert since the last logged row, and its max/mean."""
        fields = {"layer_load": self.window_LE.tolist(), "layer_load_steps": self.window_steps,
                  "layer_imbalance": [imbalance(c) for c in self.window_LE]}
        self.window_LE.zero_()
        self.window_steps = 0
        return fields

    def worst(self, fields: dict) -> str:
        """The progress line's view of ``log_fields``: the block with the highest max/mean, and that value."""
        ratios = fields.get("layer_imbalance") or []
        if not ratios:
            return ""
        i = max(range(len(ratios)), key=ratios.__getitem__)
        return f" (worst {self.names[i]} {ratios[i]:.2f})"


def imbalance(counts_E: Tensor) -> float:
    """max/mean of tokens per expert (1.0: perfectly even; 0.0 where no token was counted)."""
    mean = counts_E.float().mean().item()
    return counts_E.max().item() / mean if mean else 0.0
