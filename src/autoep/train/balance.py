"""Global load balancing of the routers: the model's aux loss on global counts, router z-loss, and DeepSeek-V3's
aux-loss-free bias update. Every statistic is summed over the data ranks (the whole world: ``edp`` replicas and
``ep`` peers hold disjoint tokens), so a run on W ranks balances exactly what one process on the whole global
batch would.

Legend: N router rows (tokens x router layers, this rank), E routed experts, L planned blocks.

Gradient convention (``autoep.train.trainer.train_step``): each rank back-propagates its loss divided by the
world size and gradients are summed over ranks. A global statistic's value is the same on every rank; its
gradient flows only through this rank's own rows, scaled by the world size, so the summed gradient is the
gradient of the global statistic.

    autoep-train optim.aux_loss_coef=0.01 optim.z_loss_coef=1e-3                 # global aux loss + z-loss
    torchrun --nproc-per-node 2 -m autoep.train parallel.ep_size=2 model=deepseek_v3 optim.bias_update_rate=1e-3
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from autoep.errors import ConfigError
from autoep.train.models import TOP_K_KEYS

BIAS = "e_score_correction_bias"  # DeepSeek-V3's router buffer (and its descendants': GLM-4.5, dots.llm1, ...)
# The model's own aux loss and ours, computed from the same logits in fp32, differ by summation order only
# (torch's blocked sums: |rel| ~ log2(N) * 2**-24, ~1e-6 for a million rows); a different formula (no top-k
# factor, per-layer sums, a mask) differs by a factor, far more. 1e-3 leaves room for bf16 logits.
FORMULA_RTOL = 1e-3


@dataclass
class Balance:
    """What the trainer's step does for load balancing; ``build`` makes it from the ``optim`` values."""

    local_aux_coef: float  # the model's own aux loss on this rank's tokens (``optim.aux_loss_scope=local``)
    router_losses: RouterLosses | None  # global aux loss and z-loss, added to each micro-batch's loss
    bias: BiasUpdate | None  # applied after each optimiser step


def build(model: nn.Module, block_names: list[str], counted: list[bool], *, aux_loss_coef: float,
          aux_loss_scope: str, z_loss_coef: float, bias_update_rate: float, world_group) -> Balance:
    """Check the model can do what the ``optim`` values ask (before any step) and return the step's pieces.
    ``counted[i]``: whether the expert load counter hears block ``block_names[i]`` (the bias update reads it)."""
    global_aux = aux_loss_coef if aux_loss_scope == "global" else 0.0
    losses = None
    if global_aux or z_loss_coef:
        losses = RouterLosses(aux_loss_coef=global_aux, z_loss_coef=z_loss_coef, top_k=model_top_k(model, global_aux),
                              group=world_group)
    bias = None
    if bias_update_rate:
        bias = BiasUpdate(router_biases(model, block_names, counted, bias_update_rate), bias_update_rate)
    return Balance(aux_loss_coef if aux_loss_scope == "local" else 0.0, losses, bias)


def model_top_k(model: nn.Module, aux_loss_coef: float) -> int:
    """Experts per token as the model's config spells it (its aux loss counts that many per row)."""
    config = getattr(model, "config", None)
    for key in TOP_K_KEYS:
        k = getattr(config, key, None)
        if isinstance(k, int) and not isinstance(k, bool):
            return k
    if aux_loss_coef:
        raise ConfigError(f"optim.aux_loss_coef={aux_loss_coef} with optim.aux_loss_scope=global: "
                          f"{type(model).__name__} has no config.{TOP_K_KEYS[0]} (experts per token) to count the "
                          f"global load with; set optim.aux_loss_scope=local (the model's own aux loss per rank)")
    return 0


class RouterLosses:
    """``aux_loss_coef * aux + z_loss_coef * z`` of one micro-batch, from the router logits the model returns
    with ``output_router_logits=True`` (all router layers' rows together, as transformers' aux loss takes them):

    - aux: Switch/Mixtral's ``E * sum_e f_e * P_e``, ``f_e`` the share of top-k slots routed to expert e,
      ``P_e`` the mean router probability of e, both over every rank's rows. Computed as the model's own
      ``load_balancing_loss_func`` does (softmax, the model's top-k): the first micro-batch checks the formula
      against the model's own ``aux_loss`` on this rank's rows and refuses a model whose aux loss differs.
    - z: ST-MoE's router z-loss, the mean over every rank's rows of ``logsumexp(logits)**2``.
    """

    def __init__(self, *, aux_loss_coef: float, z_loss_coef: float, top_k: int, group):
        self.aux_loss_coef, self.z_loss_coef, self.top_k, self.group = aux_loss_coef, z_loss_coef, top_k, group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.checked = False

    def __call__(self, out) -> Tensor:
        logits_NE = self._logits(out)
        E = logits_NE.shape[-1]
        probs_NE = F.softmax(logits_NE, dim=-1)
        prob_sum_E = probs_NE.sum(dim=0)
        z_sum = torch.logsumexp(logits_NE, dim=-1).square().sum()
        counts_E = torch.zeros(E, dtype=torch.float64, device=logits_NE.device)
        if self.aux_loss_coef:
            top_k_index = torch.topk(probs_NE, self.top_k, dim=-1).indices
            counts_E = torch.bincount(top_k_index.reshape(-1), minlength=E).double()
        mismatch = self._formula_differs(out, counts_E, prob_sum_E, len(logits_NE)) if self.aux_loss_coef else 0.0
        stats = torch.cat([counts_E, prob_sum_E.detach().double(), z_sum.detach().double().reshape(1),
                           torch.tensor([len(logits_NE), mismatch], dtype=torch.float64, device=logits_NE.device)])
        if self.group is not None:
            # NOTE: one collective per micro-batch, 2E + 3 float64s (fp64: counts past 2**24 stay exact)
            dist.all_reduce(stats, group=self.group)
        counts_g, prob_sum_g, (z_g, rows_g, mismatches) = stats[:E], stats[E:2 * E], stats[2 * E:].tolist()
        if mismatches:  # every rank learns it from the same sum, so every rank raises (none waits in a collective)
            raise ConfigError(self._mismatch_message(out))
        loss = logits_NE.new_zeros(())
        if self.aux_loss_coef:
            f_E = (counts_g / rows_g).float()
            aux = _global(E * (f_E * prob_sum_g.float() / rows_g).sum(), E * (f_E * prob_sum_E / rows_g).sum(),
                          self.world)
            loss = loss + self.aux_loss_coef * aux
        if self.z_loss_coef:
            loss = loss + self.z_loss_coef * _global(logits_NE.new_tensor(z_g / rows_g), z_sum / rows_g, self.world)
        return loss

    def _logits(self, out) -> Tensor:
        logits = getattr(out, "router_logits", None)
        if isinstance(logits, Tensor):
            logits = (logits,)
        if not isinstance(logits, (tuple, list)) or not logits or not all(isinstance(t, Tensor) for t in logits):
            raise ConfigError(f"{self._keys()} need the router logits, but the model returns none with "
                              f"output_router_logits=True; set {self._off()}")
        widths = {t.shape[-1] for t in logits}
        if len(widths) != 1:
            raise ConfigError(f"{self._keys()}: the model's router layers score different expert counts "
                              f"{sorted(widths)}; one global statistic needs one; set {self._off()}")
        return torch.cat([t.reshape(-1, t.shape[-1]).float() for t in logits])

    def _formula_differs(self, out, counts_E: Tensor, prob_sum_E: Tensor, rows: int) -> float:
        """1.0 where the model's own aux loss on this rank's rows is not ours (checked on the first call only)."""
        if self.checked:
            return 0.0
        self.checked = True
        own = getattr(out, "aux_loss", None)
        if not isinstance(own, Tensor):
            return 1.0
        ours = len(counts_E) * (counts_E.float() / rows * prob_sum_E.detach() / rows).sum()
        return 0.0 if torch.allclose(own.detach().float(), ours, rtol=FORMULA_RTOL, atol=0.0) else 1.0

    def _mismatch_message(self, out) -> str:
        own = getattr(out, "aux_loss", None)
        why = ("returns no aux_loss" if not isinstance(own, Tensor) else
               "returns an aux_loss that is not the Switch/Mixtral loss E * sum(f * P) over its router logits with "
               f"top_k={self.top_k}")
        return (f"optim.aux_loss_coef={self.aux_loss_coef} with optim.aux_loss_scope=global: the model {why}, so "
                f"there is no aux loss of its own to compute on global counts; set optim.aux_loss_scope=local "
                f"(its own loss per rank) or optim.aux_loss_coef=0")

    def _keys(self) -> str:
        keys = [f"optim.aux_loss_coef={self.aux_loss_coef} (optim.aux_loss_scope=global)"] if self.aux_loss_coef else []
        return " and ".join(keys + ([f"optim.z_loss_coef={self.z_loss_coef}"] if self.z_loss_coef else []))

    def _off(self) -> str:
        return " and ".join((["optim.aux_loss_coef=0"] if self.aux_loss_coef else [])
                            + (["optim.z_loss_coef=0"] if self.z_loss_coef else []))


def _global(value: Tensor, local: Tensor, world: int) -> Tensor:
    """``value`` (the global statistic, the same on every rank) carrying the gradient of ``world * local``
    (this rank's share): summed over ranks after the trainer's division by the world size, that is the
    gradient of the global statistic."""
    local = world * local
    return value.to(local.dtype) + (local - local.detach())


def router_biases(model: nn.Module, block_names: list[str], counted: list[bool], rate: float) -> list[Tensor]:
    """Each planned block's ``e_score_correction_bias`` buffer (one per block), or a ``ConfigError``."""
    if not block_names:
        raise ConfigError(f"optim.bias_update_rate={rate}: parallel.plan holds no MoE block whose router bias it could "
                          f"move; set optim.bias_update_rate=0")
    biases = []
    for name, heard in zip(block_names, counted):
        found = [(n, b) for n, b in model.get_submodule(name).named_buffers() if n.rsplit(".", 1)[-1] == BIAS]
        if len(found) != 1 or found[0][1].dim() != 1:
            what = (f"no {BIAS} buffer" if not found else f"{len(found)} {BIAS} buffers, not one"
                    if len(found) != 1 else f"a {BIAS} buffer that is not one number per expert")
            raise ConfigError(f"optim.bias_update_rate={rate}: {name} has {what} (the aux-loss-free router bias of "
                              f"DeepSeek-V3-style routers); set optim.bias_update_rate=0, or pick a model whose "
                              f"router has one (e.g. model=deepseek_v3)")
        if not heard:
            raise ConfigError(f"optim.bias_update_rate={rate}: autoep cannot count the tokens routed to each expert of "
                              f"{name} (its experts call is none the load counter knows), so it cannot move its "
                              f"{BIAS}; set optim.bias_update_rate=0")
        biases.append(found[0][1])
    return biases


class BiasUpdate:
    """DeepSeek-V3's aux-loss-free balancing: after each optimiser step, each block's router bias moves by
    ``rate * sign(mean load - load)`` per expert, from the step's global token counts of that block (the same
    on every rank, so the biases stay equal everywhere). The biases are buffers: checkpoints keep them."""

    def __init__(self, biases: list[Tensor], rate: float):
        self.biases, self.rate = biases, rate

    @torch.no_grad()
    def step(self, counts_LE: Tensor) -> None:
        for bias, counts_E in zip(self.biases, counts_LE):
            load_E = counts_E[: bias.numel()].double()
            bias.add_((self.rate * torch.sign(load_E.mean() - load_E)).to(device=bias.device, dtype=bias.dtype))
