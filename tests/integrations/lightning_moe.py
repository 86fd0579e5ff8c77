"""A user's Lightning project in miniature: a tiny transformers Qwen3-MoE in a ``LightningModule``, a token
dataset, and a real ``lightning.Trainer`` run on the gloo ranks ``tests/distributed.py`` spawns.

The ranks are launched the way torchrun launches them (the process group exists, ``LOCAL_RANK`` is set), so
``strategy="ddp"`` runs in place instead of re-running the script; that is Lightning's own path for an
externally launched job (``LightningEnvironment.creates_processes_externally``).

``fit(...)`` returns what a parity test compares: the logged per-step losses and every weight, experts
gathered over ``ep`` (a collective: every rank calls it).
"""
from __future__ import annotations

import functools
import logging
import os
import traceback

import lightning as L
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

# The tiny Qwen3-MoE of src/autoep/conf/model/qwen3_moe.yaml (router module + batched experts, v5 layout).
TINY_QWEN3_MOE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                      num_experts_per_tok=2, head_dim=8)
SEQ_LEN = 16
ROWS_PER_RANK = 2  # per step; the global batch is ROWS_PER_RANK * world_size


def tiny_qwen3_moe(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_QWEN3_MOE))


class Tokens(Dataset):
    """``n`` fixed rows of random token ids (the same on every rank; Lightning's sampler splits them)."""

    def __init__(self, n: int, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, TINY_QWEN3_MOE["vocab_size"], (n, SEQ_LEN), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i]


class MoeLM(L.LightningModule):
    """Next-token cross entropy of a causal LM, mean over this rank's tokens (what DDP's averaging assumes);
    SGD with momentum, so the optimizer has state a checkpoint must keep."""

    def __init__(self, lr: float = 0.5, momentum: float = 0.9, seed: int = 0):
        super().__init__()
        self.model = tiny_qwen3_moe(seed)
        self.lr, self.momentum = lr, momentum
        self.losses: list[float] = []

    def loss(self, ids):
        out = self.model(input_ids=ids, use_cache=False)
        logits = getattr(out, "logits", out)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    def training_step(self, ids, batch_idx):
        loss = self.loss(ids)
        self.losses.append(loss.detach().item())
        return loss

    def validation_step(self, ids, batch_idx):
        self.log("val_loss", self.loss(ids), sync_dist=True)

    def test_step(self, ids, batch_idx):
        self.log("test_loss", self.loss(ids), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class ModuleListMoeLM(MoeLM):
    """The same module around v4-style MoE blocks (``tests/module_list_lm.py``: ModuleList experts, routing in
    the block's forward), the other expert storage autoep executes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        from module_list_lm import ModuleListLM

        torch.manual_seed(0)
        self.model = ModuleListLM(vocab_size=TINY_QWEN3_MOE["vocab_size"])


class ManualMoeLM(MoeLM):
    """The same training with manual optimization: ``manual_backward``, ``clip_gradients``, ``opt.step()``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, ids, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = self.loss(ids)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.3, gradient_clip_algorithm="norm")
        opt.step()
        self.losses.append(loss.detach().item())


class AdamWMoeLM(MoeLM):
    """AdamW with its multi-tensor (foreach) kernels, torch's default on CUDA, asked for here on CPU."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, foreach=True)


class AdamWGroupsMoeLM(MoeLM):
    """The same AdamW with the experts in their own group (the handle's), keeping the foreach kernels."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.trainer.strategy.expert_parallel.param_groups(lr=1e-2), foreach=True)


class TwoOptimizersMoeLM(ManualMoeLM):
    """Manual optimization with the embeddings in an optimizer of their own: clipping one optimizer by the norm
    cannot be the model's global norm."""

    def configure_optimizers(self):
        embed = list(self.model.model.embed_tokens.parameters())
        rest = [p for p in self.parameters() if all(p is not e for e in embed)]
        return torch.optim.SGD(rest, lr=self.lr), torch.optim.SGD(embed, lr=self.lr)

    def training_step(self, ids, batch_idx):
        opt, _ = self.optimizers()
        self.manual_backward(self.loss(ids))
        self.clip_gradients(opt, gradient_clip_val=0.3, gradient_clip_algorithm="norm")


class HostMoeLM(MoeLM):
    """The module as lightning-hydra-template writes it: the optimizer arrives as a Hydra partial and is saved
    with the hyperparameters (``save_hyperparameters``), so every checkpoint holds a ``functools.partial``,
    which ``torch.load(weights_only=True)`` refuses; the template's scripts load with ``weights_only=False``."""

    def __init__(self, optimizer=functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9), seed: int = 0):
        super().__init__(seed=seed)
        self.save_hyperparameters(logger=False)

    def configure_optimizers(self):
        return self.hparams.optimizer(params=self.parameters())


def loader(n: int, seed: int = 1) -> DataLoader:
    return DataLoader(Tokens(n, seed), batch_size=ROWS_PER_RANK, shuffle=False)


class TokenData(L.LightningDataModule):
    """The same rows as a datamodule (what a Hydra template instantiates from ``data:``)."""

    def __init__(self, train_rows: int = 12, eval_rows: int = 4):
        super().__init__()
        self.train_rows, self.eval_rows = train_rows, eval_rows

    def train_dataloader(self):
        return loader(self.train_rows)

    def val_dataloader(self):
        return loader(self.eval_rows, seed=2)

    def test_dataloader(self):
        return loader(self.eval_rows, seed=3)


def trainer(world_size: int, strategy="ddp", **kwargs) -> L.Trainer:
    """A ``lightning.Trainer`` on this spawned rank's CPU process group (see the module docstring)."""
    os.environ["LOCAL_RANK"] = str(torch.distributed.get_rank())  # one node: local rank = global rank
    defaults = dict(accelerator="cpu", devices=world_size, num_nodes=1, strategy=strategy, logger=False,
                    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                    num_sanity_val_steps=0)
    return L.Trainer(**{**defaults, **kwargs})


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, expert shards gathered to full tensors and ModuleList experts from their owner ranks
    (NOTE: collective; every rank calls it)."""
    from autoep.runtime.recipes.local_experts import full_state_dict_of_experts

    names = {n for n, _ in module.named_parameters()}
    state = full_state_dict_of_experts(module) if torch.distributed.is_initialized() else module.state_dict()
    state = {n: v for n, v in state.items() if n in names}
    assert set(state) == names, f"parameters missing from the gathered state: {sorted(names - set(state))[:4]}"
    return {n: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for n, v in state.items()}


def fit(world_size: int, strategy="ddp", steps: int = 6, module_cls=MoeLM, **kwargs) -> dict:
    """Train ``module_cls`` for ``steps`` optimizer steps; the per-step losses of this rank and every weight."""
    module = module_cls()
    t = trainer(world_size, strategy, max_steps=steps, **kwargs)
    t.fit(module, train_dataloaders=loader(steps * ROWS_PER_RANK * world_size))
    return {"losses": module.losses, "weights": weights(module.model)}


# ---- the cases tests/integrations/test_lightning.py spawns (each rank returns plain tensors and floats) ----------

# The plan, as a host's YAML would give it; globs are relative to the LightningModule (MoeLM keeps the
# causal LM as ``self.model``, whose decoder is ``model.model``).
PARALLEL = {"ep_size": 2, "plan": [{"match": "model.model.layers.*.mlp", "local_compute_fn": "auto"}]}


def ep_strategy(tmp: str, **kwargs):
    from autoep.integrations.lightning import ExpertParallelStrategy

    return ExpertParallelStrategy(PARALLEL, run_dir=os.path.join(tmp, "run"), **kwargs)


def summed_experts_strategy(tmp: str):
    """The issue's bug, on purpose: expert gradients summed over the ranks but not divided by the world size as
    DDP divides the dense ones (W x too large). A negative control: the parity assertions must catch it."""
    from autoep.integrations.lightning import ExpertParallelStrategy

    class SummedExperts(ExpertParallelStrategy):
        def setup(self, trainer):
            super().setup(trainer)
            self.expert_parallel.grad_convention = "sum"

    return SummedExperts(PARALLEL, run_dir=os.path.join(tmp, "run"))


def parity_worker(rank: int, world_size: int, tmp: str) -> dict:
    """Each setting trained without EP (Lightning's ``ddp``) and with the adapter; the summed-experts control."""
    settings = {"plain": {}, "clip_norm": {"gradient_clip_val": 0.3},
                "clip_value": {"gradient_clip_val": 0.02, "gradient_clip_algorithm": "value"},
                "accumulate": {"accumulate_grad_batches": 2}, "bf16": {"precision": "bf16-mixed"}}
    settings["manual"] = {"module_cls": ManualMoeLM}
    settings["module_list"] = {"module_cls": ModuleListMoeLM}
    settings["adamw_foreach"] = {"module_cls": AdamWMoeLM}
    out = {}
    records = []  # autoep's info lines during the adapter's runs (rank 0 alone logs them)
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("autoep")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    for name, kwargs in settings.items():
        out[name] = {"ref": fit(world_size, "ddp", **kwargs), "ep": fit(world_size, ep_strategy(tmp), **kwargs)}
    logger.removeHandler(handler)
    out["info_lines"] = records
    try:
        fit(world_size, ep_strategy(tmp), steps=1, module_cls=TwoOptimizersMoeLM)
        out["partial_clip"] = None
    except Exception as e:  # noqa: BLE001 - the test reads what was raised
        out["partial_clip"] = f"{type(e).__name__}: {e}"
    out["adamw_groups"] = {"ref": out["adamw_foreach"]["ref"],
                           "ep": fit(world_size, ep_strategy(tmp), module_cls=AdamWGroupsMoeLM)}
    out["plain"]["summed"] = fit(world_size, summed_experts_strategy(tmp))
    out["bf16"]["summed"] = fit(world_size, summed_experts_strategy(tmp), precision="bf16-mixed")
    return out


def expert_shards(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's own slice of every expert parameter."""
    return {n: p.to_local().detach().clone() for n, p in module.named_parameters() if isinstance(p, DTensor)}


def saved_checkpoint(path: str) -> tuple[dict, dict]:
    """(model state, optimizer state per parameter name) a checkpoint holds, every tensor at full shape: a
    ``.ckpt`` file (``state_dict_type="full"``) or a DCP directory (``"sharded"``, converted in this process)."""
    if not os.path.isdir(path):
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        return ckpt["state_dict"], ckpt["optimizer_states"][0]["state"] if ckpt.get("optimizer_states") else {}
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.r{torch.distributed.get_rank()}.pt")
    dcp_to_torch_save(path, out)
    ckpt = torch.load(out, map_location="cpu", weights_only=False)
    return ckpt["model"], ckpt.get("optim", {}).get("state", {})


def saved_slices(path: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What this rank's experts must hold after loading ``path``: its slice of each full expert tensor saved."""
    saved = saved_checkpoint(path)[0]
    out = {}
    for n, p in module.named_parameters():
        if isinstance(p, DTensor):
            ep = p.device_mesh.mesh_dim_names.index("ep")
            out[n] = saved[n].chunk(p.device_mesh.size(ep), 0)[p.device_mesh.get_local_rank(ep)]
    return out


def checkpoint_worker(rank: int, world_size: int, tmp: str) -> dict:
    out = {kind: checkpoint_case(world_size, os.path.join(tmp, kind), kind) for kind in ("full", "sharded")}
    strategies = {"ddp": lambda sub: "ddp",
                  **{kind: functools.partial(ep_strategy, state_dict_type=kind) for kind in ("full", "sharded")}}
    out["host"] = {name: host_checkpoint_case(world_size, os.path.join(tmp, f"host_{name}"), strategy)
                   for name, strategy in strategies.items()}
    out["require_ep"] = require_ep_case(world_size)
    return out


def host_checkpoint_case(world_size: int, tmp: str, strategy) -> dict:
    """lightning-hydra-template's flow, loading with ``weights_only=False`` as its scripts do: fit with
    ``ModelCheckpoint``, ``trainer.test(ckpt_path="best")`` (its train.py), a fresh module and trainer testing
    the best checkpoint (its eval.py), and a fit resumed from the epoch-0 checkpoint. ``strategy(tmp)``:
    Lightning's ``"ddp"`` or the adapter; an error is returned as its traceback (every rank raises alike)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from autoep.integrations.lightning import ExpertParallelStrategy, RequireExpertParallel

    train, val, test = loader(12), loader(4, seed=2), loader(4, seed=3)
    ckpt_dir = os.path.join(tmp, "ckpt")

    def callbacks(s):  # the guard against a strategy override rides along wherever EP is the strategy
        return [RequireExpertParallel()] if isinstance(s, ExpertParallelStrategy) else []

    out = {}
    try:
        checkpoint = ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=-1)
        module, s = HostMoeLM(), strategy(tmp)
        t = trainer(world_size, s, max_epochs=2, callbacks=[checkpoint, *callbacks(s)], enable_checkpointing=True)
        t.fit(module, train_dataloaders=train, val_dataloaders=val)
        out["final"], out["best"] = weights(module), checkpoint.best_model_path
        out["test"] = t.test(module, dataloaders=test, ckpt_path="best", weights_only=False)[0]["test_loss"]
        out["tested"] = weights(module)
        fresh, s = HostMoeLM(seed=5), strategy(tmp)
        out["eval"] = trainer(world_size, s, callbacks=callbacks(s)).test(
            fresh, dataloaders=test, ckpt_path=out["best"], weights_only=False)[0]["test_loss"]
        epoch0 = os.path.join(ckpt_dir, next(f for f in sorted(os.listdir(ckpt_dir)) if f.startswith("epoch=0")))
        resumed, s = HostMoeLM(seed=5), strategy(tmp)
        trainer(world_size, s, max_epochs=2, callbacks=callbacks(s)).fit(
            resumed, train_dataloaders=train, val_dataloaders=val, ckpt_path=epoch0, weights_only=False)
        out["resumed"] = weights(resumed)
    except Exception:  # noqa: BLE001 - the test reads it
        out["error"] = traceback.format_exc()
    return out


def require_ep_case(world_size: int) -> dict:
    """``RequireExpertParallel`` in a run whose strategy was replaced by Lightning's plain ``"ddp"``: what it
    raised, how many steps ran, and whether any weight moved."""
    from autoep.integrations.lightning import RequireExpertParallel

    module = MoeLM()
    before = weights(module)
    try:
        trainer(world_size, "ddp", max_steps=2, callbacks=[RequireExpertParallel()]).fit(
            module, train_dataloaders=loader(4 * world_size))
        error = None
    except Exception as e:  # noqa: BLE001 - the test reads it
        error = f"{type(e).__name__}: {e}"
    moved = [n for n, w in weights(module).items() if not torch.equal(w, before[n])]
    return {"error": error, "steps": len(module.losses), "moved": moved}


def checkpoint_case(world_size: int, tmp: str, state_dict_type: str) -> dict:
    """``ModelCheckpoint`` under the adapter: 2 epochs of 3 steps, a checkpoint after each validation (and
    ``last.ckpt``); ``trainer.test(ckpt_path="best")`` on the same trainer and on a fresh module and trainer;
    ``trainer.fit(ckpt_path=<epoch 0>)`` resumed to the end."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def strategy():
        return ep_strategy(tmp, state_dict_type=state_dict_type)

    ckpt_dir = os.path.join(tmp, "ckpt")
    train, val, test = loader(12), loader(4, seed=2), loader(4, seed=3)
    callback = ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=-1, save_last=True)
    module = MoeLM()
    t = trainer(world_size, strategy(), max_epochs=2, callbacks=[callback], enable_checkpointing=True)
    t.fit(module, train_dataloaders=train, val_dataloaders=val)
    out = {"final": weights(module), "files": sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".ckpt")),
           "best": callback.best_model_path}
    out["last_saved"] = saved_checkpoint(os.path.join(ckpt_dir, "last.ckpt"))
    out["best_saved"] = saved_checkpoint(out["best"])[0]

    t.test(module, dataloaders=test, ckpt_path="best")
    out["test_same"] = (expert_shards(module), saved_slices(out["best"], module))

    fresh = MoeLM(seed=5)  # another init: only the checkpoint can make its experts equal the saved ones
    trainer(world_size, strategy()).test(fresh, dataloaders=test, ckpt_path=out["best"])
    out["test_fresh"] = (expert_shards(fresh), saved_slices(out["best"], fresh))
    out["test_fresh_weights"] = weights(fresh)

    epoch0 = os.path.join(ckpt_dir, next(f for f in out["files"] if f.startswith("epoch=0")))
    resumed = MoeLM(seed=5)
    trainer(world_size, strategy(), max_epochs=2).fit(resumed, train_dataloaders=train, val_dataloaders=val,
                                                      ckpt_path=epoch0)
    out["resumed"] = weights(resumed)
    return out


def reference_fit(world_size: int, steps: int = 6) -> dict:
    """What Lightning's ``ddp`` run computes, in one process without Lightning: each rank's batches come from
    the ``DistributedSampler`` Lightning puts on a training loader (always shuffled, seed 0, epoch 0; see
    ``lightning.pytorch.trainer.connectors.data_connector._process_dataloader``), and DDP's mean of the ranks'
    mean losses is the mean over the global batch (equal token counts)."""
    from torch.utils.data.distributed import DistributedSampler

    module = MoeLM()
    optimizer = module.configure_optimizers()
    data = Tokens(steps * ROWS_PER_RANK * world_size)
    order = [list(DistributedSampler(data, num_replicas=world_size, rank=r, shuffle=True, seed=0))
             for r in range(world_size)]
    for s in range(steps):
        rows = [i for r in range(world_size) for i in order[r][s * ROWS_PER_RANK:(s + 1) * ROWS_PER_RANK]]
        optimizer.zero_grad()
        module.loss(data.ids[rows]).backward()
        optimizer.step()
    return {"weights": weights(module.model)}
