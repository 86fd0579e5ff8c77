"""PyTorch Lightning adapter: ``strategy: ddp`` with expert parallelism, as one Strategy.

Use (Lightning's own ``strategy="ddp"``, plus the ``parallel`` section; the plan's globs are relative to the
LightningModule, e.g. ``model.model.layers.*.mlp`` when it keeps a transformers causal LM as ``self.model``)::

    from autoep.integrations.lightning import ExpertParallelStrategy
    trainer = L.Trainer(strategy=ExpertParallelStrategy(parallel=cfg.parallel), devices=2, ...)

or in a Hydra host's trainer config (``hydra.utils.instantiate(cfg.trainer)`` builds it; autoep writes plan
entries as ``_factory_``, which a recursive instantiate never calls)::

    strategy:
      _target_: autoep.integrations.lightning.ExpertParallelStrategy
      parallel: ${parallel}

Run it as any Lightning DDP job: ``python train.py`` (Lightning launches the ranks) or ``torchrun
--nproc-per-node 2 train.py``; CPU ranks use gloo, GPU ranks NCCL.

Why a Strategy and not a Callback: every place EP must hook is the strategy's (or its precision plugin's)
job in Lightning -- what DDP wraps (``configure_ddp``), when a checkpoint is read and when it is loaded
(``restore_checkpoint_after_setup``, ``setup``), how a checkpoint is written and read (``save_checkpoint``,
``load_checkpoint``), and how gradients are clipped (the precision plugin the strategy holds). A Callback sees
none of these and would have to patch them. Each override below is a few lines on the public handle
``autoep.ExpertParallel`` (``autoep.integrations.handle``), which owns the gradient, clipping and checkpoint
logic:

- ``setup``: applies the plan to the LightningModule (the handle resolves or replays it, once per run) and
  installs DDP's ignore list (``prepare_ddp``), so ``DistributedDataParallel`` wraps the dense parameters and
  Lightning's state sync skips the expert shards.
- gradients: after the last backward of an optimizer step (accumulation included), before
  ``on_before_optimizer_step`` hooks, clipping and the step, the expert gradients are finished
  (``finish_gradients``: summed over ``edp``, divided by the world size as DDP divides the dense ones).
- ``gradient_clip_val``: the handle's EP-correct global norm (by value: elementwise on the local shards).
- checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``): Lightning's own ``.ckpt`` file, written by
  rank 0 as usual, with every expert gathered to full shape in ``state_dict`` and the optimizer's state keyed
  by parameter name (expert moments gathered too). ``trainer.test(ckpt_path="best")`` and
  ``trainer.fit(ckpt_path=...)`` slice each rank's experts back out of it (the file is read before ``setup``
  with the caller's ``weights_only``, as ``strategy="ddp"`` reads it, and loaded once the experts are sharded);
  the file loads into the model without EP as well (``LightningModule.load_from_checkpoint`` in one process).
- ``RequireExpertParallel``: a callback for a Hydra host's ``trainer.callbacks`` that stops a run whose
  ``trainer.strategy`` was overridden away from this strategy (which would train without EP, silently).
- precision: ``32-true`` and ``bf16-mixed``; the others are refused (why, in ``_ep_precision``).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.tensor import DTensor

from autoep.errors import PlanError
from autoep.runtime.recipes import local_tensor

log = logging.getLogger("autoep")
META = "meta.pt"  # Lightning's own state in a sharded checkpoint directory (FSDPStrategy's name for it)
SHARDED = "autoep_sharded"  # the key in it saying the handle wrote the model (and whether the optimizer)


class ExpertParallelStrategy(DDPStrategy):
    """Lightning's DDP with the experts of ``parallel``'s plan sharded over ``ep`` ranks.

    ``parallel``: the host's ``parallel`` config section (DictConfig or dict), an already resolved one, or the
    path of a ``resolved.yaml`` to replay. ``run_dir``: where rank 0 writes ``resolved.yaml`` (default: the
    trainer's ``default_root_dir``). ``allowed_targets``: extra ``_target_`` prefixes the plan may import.
    Every other keyword is ``DDPStrategy``'s (``timeout``, ``process_group_backend``, DDP's own kwargs).
    """

    def __init__(self, parallel, *, run_dir: str | os.PathLike | None = None, allowed_targets=(),
                 state_dict_type: str = "full", **ddp_kwargs):
        if state_dict_type not in ("full", "sharded"):
            raise PlanError(f"ExpertParallelStrategy(state_dict_type={state_dict_type!r}): pick 'full' (one .ckpt file, "
                            f"every expert gathered) or 'sharded' (a directory, each rank writes its own experts)")
        start_method = ddp_kwargs.get("start_method", "popen")
        if start_method != "popen":
            raise PlanError(f"ExpertParallelStrategy(start_method={start_method!r}) is not supported: the main process "
                            f"of a spawned run gets back rank 0's module, which holds only rank 0's experts. Drop "
                            f"start_method and launch as strategy='ddp' does: `python train.py` (Lightning starts "
                            f"one process per device) or `torchrun --nproc-per-node N train.py`")
        super().__init__(**ddp_kwargs)
        self._parallel, self._run_dir, self._allowed_targets = parallel, run_dir, tuple(allowed_targets)
        self._state_dict_type = state_dict_type
        self.expert_parallel = None  # the handle, built in ``setup`` on the LightningModule
        self._grads_finished = True
        self._set_up = False  # between ``setup`` and ``teardown``: the experts are sharded, the optimizers built
        self._pending = None  # a checkpoint read before ``setup``, loaded into the model at its end

    # ---- precision: the strategy holds the plugin Lightning built from ``precision=`` -----------------------

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else _ExpertParallelPrecision(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else _ep_precision(plugin, self)

    # ---- the plan, applied before DDP wraps the module and before a checkpoint is restored -------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # NOTE: False although the experts must be sharded (and the optimizer built) before the handle loads
        # into them: after setup, Lightning 2.6 reads the file without the caller's ``weights_only``
        # (``_restore_modules_and_callbacks(ckpt_path)``), so torch's default ``weights_only=True`` refuses a
        # checkpoint whose hyperparameters hold a Hydra partial or a DictConfig, where ``strategy="ddp"``
        # loads it. So Lightning reads the checkpoint before ``setup``, as for ``ddp``, with the caller's
        # ``weights_only``; the model's state waits in ``_pending`` and ``setup`` loads it (``_load_pending``).
        return False

    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        if getattr(module, "_compiler_ctx", None) is not None:  # Lightning's mark of trainer.fit(torch.compile(m))
            raise PlanError("trainer.fit(torch.compile(module)) with ExpertParallelStrategy: Lightning compiles the "
                            "whole training_step, the EP blocks' token exchange included (a host sync for the split "
                            "sizes, all-to-all on expert shards), which no test runs; pass the module uncompiled "
                            "(autoep-train's trainer.compile=true compiles the dense layers only, "
                            "autoep.runtime.compile; this adapter does not pass that through yet)")
        if self.expert_parallel is None or self.expert_parallel.model is not module:
            from autoep.integrations.handle import ExpertParallel

            run_dir = self._run_dir if self._run_dir is not None else trainer.default_root_dir
            self.expert_parallel = ExpertParallel(module, self._parallel, run_dir=run_dir,
                                                  allowed_targets=self._allowed_targets)
        self.expert_parallel.prepare_ddp(module)  # DDP (fit) and Lightning's state sync (test) skip the experts
        super().setup(trainer)
        for optimizer in self.optimizers:
            _no_mixed_multi_tensor_kernels(optimizer, log_it=self.global_rank == 0)
        self._set_up = True
        self._load_pending()
        # NOTE: the handle's step guard cannot check Lightning's steps: Lightning passes ``optimizer.step`` a
        # closure that runs the last backward inside the step, after any step pre-hook. The finishing is ensured
        # by construction instead: every Lightning step runs the precision plugin's ``_after_closure`` (the
        # plugins here are ours, see ``_ep_precision``), which finishes the gradients before clipping and update.

    # ---- gradients ---------------------------------------------------------------------------------------

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        self._grads_finished = False

    def finish_gradients(self) -> None:
        """Finish the expert gradients of the backward passes since the last step, once (idempotent)."""
        if not self._grads_finished:
            self.expert_parallel.finish_gradients(dense_synced=True)  # DDP averaged the dense ones
            self._grads_finished = True

    # ---- checkpoints -------------------------------------------------------------------------------------
    # "full": Lightning's own file, rank 0 writes it (CheckpointIO); every expert gathered into ``state_dict``.
    # "sharded": a directory: the handle's DCP shards (each rank writes its own experts) plus Lightning's state
    # (loops, callbacks, schedulers, hparams) in ``meta.pt``, as FSDPStrategy's sharded checkpoints are laid out.
    # Either kind loads under either setting (a directory is sharded, a file is full).

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._state_dict_type == "sharded":
            return {}  # the handle writes the model in ``save_checkpoint``
        return self.expert_parallel.state_dict()  # every expert at full shape (a collective: every rank saves)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if self._state_dict_type == "sharded":
            return {}
        return self.expert_parallel.optimizer_state_dict(_unwrap(optimizer))  # keyed by name, experts gathered

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if self._state_dict_type == "full":
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # rank 0 writes the file
        if storage_options is not None:
            raise TypeError("ExpertParallelStrategy(state_dict_type='sharded').save_checkpoint(storage_options=...) is "
                            "not supported: autoep's handle writes the shards, not a CheckpointIO")
        path = Path(self.broadcast(str(filepath)))  # rank 0's path on every rank
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        meta[SHARDED] = {"optimizer": "optimizer_states" in checkpoint}
        self.expert_parallel.save(path, self._one_optimizer() if meta[SHARDED]["optimizer"] else None)
        if self.global_rank == 0:  # after the handle's rename: a directory without meta.pt is refused on load
            self.checkpoint_io.save_checkpoint(meta, path / META)
        self.barrier("ExpertParallelStrategy.save_checkpoint")

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if not path.is_dir():
            return super().load_checkpoint(path, weights_only)  # a full file; ``load_*_state_dict`` slice it
        if not (path / META).is_file():
            raise FileNotFoundError(f"ckpt_path={str(path)!r} is a directory without {META}: not a complete "
                                    f"checkpoint of ExpertParallelStrategy(state_dict_type='sharded')")
        meta = self.checkpoint_io.load_checkpoint(path / META, weights_only=weights_only)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if fitting and not meta[SHARDED]["optimizer"]:
            raise KeyError(f"Trying to restore optimizer state but {path} holds only the model (saved with "
                           f"ModelCheckpoint(save_weights_only=True)); resume from a full checkpoint")
        self._load_or_defer(("sharded", path, fitting))
        if meta[SHARDED]["optimizer"]:
            meta["optimizer_states"] = []  # loaded with the model; the key tells Lightning the checkpoint has them
        return meta

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if SHARDED in checkpoint:
            return  # ``load_checkpoint`` loads the model (and the optimizer) through the handle
        if not strict:
            raise PlanError("LightningModule.strict_loading=False is not supported with ExpertParallelStrategy: the "
                            "experts are loaded strictly (a missing expert would stay as initialised without a word); "
                            "set strict_loading=True")
        self._load_or_defer(("full", checkpoint["state_dict"], False))

    def _load_or_defer(self, pending: tuple) -> None:
        """Load a checkpoint's model state now when ``setup`` has sharded the experts (a restore mid-run, e.g.
        Lightning's tuner), else keep it for the end of ``setup``."""
        self._pending = pending
        if self._set_up:
            self._load_pending()

    def _load_pending(self) -> None:
        if self._pending is None:
            return
        kind, what, fitting = self._pending
        self._pending = None
        if kind == "full":
            self.expert_parallel.load_state_dict(what)  # each rank keeps its experts' slices
        else:
            self.expert_parallel.load(what, self._one_optimizer() if fitting else None)

    def teardown(self) -> None:
        self._set_up, self._pending = False, None  # a run that failed before loading leaves nothing for the next
        super().teardown()

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if SHARDED in checkpoint:
            return  # ... and the optimizer
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise KeyError(f"the checkpoint holds {len(states)} optimizer states but configure_optimizers returned "
                           f"{len(self.optimizers)} optimizers; resume with the same optimizers")
        for optimizer, state in zip(self.optimizers, states):
            self.expert_parallel.load_optimizer_state_dict(_unwrap(optimizer), state)

    def _one_optimizer(self):
        if len(self.optimizers) != 1:
            raise PlanError(f"ExpertParallelStrategy(state_dict_type='sharded') checkpoints one optimizer; "
                            f"configure_optimizers returned {len(self.optimizers)}. Use state_dict_type='full' or "
                            f"one optimizer (param groups may differ)")
        return self.optimizers[0]


class RequireExpertParallel(pl.Callback):
    """Stop a run whose strategy is not ``ExpertParallelStrategy``, naming what replaced it.

    In a Hydra host, ``trainer.strategy`` names the strategy and hands it ``parallel``; an override of that
    node (``trainer.strategy=ddp_spawn`` on the command line) replaces it, and then nothing of autoep runs:
    the model would train without expert parallelism and say nothing. Listed in ``trainer.callbacks``,
    which such an override leaves alone, this callback raises in ``setup``, before any step::

        callbacks:
          - _target_: autoep.integrations.lightning.RequireExpertParallel
    """

    def __init__(self):
        # NOTE: read here, in the process that composed the config: Hydra's state does not reach the ranks a
        # spawning strategy starts.
        self.overrides = _strategy_overrides()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, ExpertParallelStrategy):
            return
        spawn = getattr(strategy, "_start_method", None)
        name = type(strategy).__name__ + (f"(start_method={spawn!r})" if spawn not in (None, "popen") else "")
        cause = (f", set by {' '.join(self.overrides)}" if self.overrides
                 else " (the config's trainer.strategy was replaced, e.g. on the command line)")
        raise PlanError(f"trainer.strategy is Lightning's {name}{cause}, not autoep.integrations.lightning."
                        f"ExpertParallelStrategy, so the model would train without expert parallelism. Drop the "
                        f"override (ExpertParallelStrategy is Lightning's ddp with EP; spawn is not supported with "
                        f"it: launch with `python train.py` or torchrun), or remove RequireExpertParallel from "
                        f"trainer.callbacks to train without EP on purpose")


def _strategy_overrides() -> list[str]:
    """The Hydra command-line overrides of this run that name a strategy (``trainer.strategy=ddp_spawn``)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return [o for o in HydraConfig.get().overrides.task if "strategy" in o.split("=", 1)[0]]
    except Exception:  # noqa: BLE001 - Hydra absent or not running this app: nothing to name
        pass
    return []


def _no_mixed_multi_tensor_kernels(optimizer, log_it: bool = True) -> None:
    """Step param groups that mix expert (DTensor) and dense (plain) parameters param by param.

    An optimizer's foreach and fused kernels (torch's default on CUDA) cannot take both kinds in one list
    (``aten._foreach_mul_.Scalar got mixed torch.Tensor and DTensor``). Splitting such a group in two would
    desynchronise the LR schedulers ``configure_optimizers`` already built on its groups, so the group keeps
    its parameters and its kernels change (the same update, computed per parameter). To keep the multi-tensor
    kernels, give the experts their own group in ``configure_optimizers``:
    ``AdamW(self.trainer.strategy.expert_parallel.param_groups(lr=...))``.
    """
    for i, group in enumerate(optimizer.param_groups):
        kinds = {isinstance(p, DTensor) for p in group["params"]}
        if len(kinds) > 1 and (group.get("foreach") is not False or group.get("fused")):
            group["foreach"] = False
            if group.get("fused"):
                group["fused"] = False
            if log_it:  # once per run, not once per rank
                log.info("autoep: %s param group %d mixes expert and dense parameters; foreach/fused kernels cannot "
                         "take both, so it steps per parameter (give experts their own group to keep them: "
                         "self.trainer.strategy.expert_parallel.param_groups(...))", type(optimizer).__name__, i)


def _unwrap(optimizer):
    return getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the torch optimizer


class _EPGradients:
    """Mixed into the precision plugin: finish expert gradients before the hooks that read them, clip by the
    EP-correct norm."""

    strategy: ExpertParallelStrategy

    def _after_closure(self, model, optimizer) -> None:
        self.strategy.finish_gradients()
        super()._after_closure(model, optimizer)

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        ep = self.strategy.expert_parallel
        mine = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        if mine != {id(p) for p in ep.dense_parameters() + ep.expert_parameters()}:
            raise PlanError(f"gradient_clip_val by norm with ExpertParallelStrategy clips the global norm over every "
                            f"trainable parameter of the LightningModule, but this {type(_unwrap(optimizer)).__name__} holds "
                            f"{len(mine)} of them; clip with one optimizer over all parameters, or by value "
                            f"(gradient_clip_algorithm='value')")
        self.strategy.finish_gradients()
        ep.clip_grad_norm_(float(clip_val))

    @torch.no_grad()
    def clip_grad_by_value(self, optimizer, clip_val) -> None:
        self.strategy.finish_gradients()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:  # elementwise: each rank clips the shards it holds
                    local_tensor(p.grad).clamp_(-clip_val, clip_val)


class _ExpertParallelPrecision(_EPGradients, Precision):
    def __init__(self, strategy: ExpertParallelStrategy):
        super().__init__()
        self.strategy = strategy


class _ExpertParallelMixedPrecision(_EPGradients, MixedPrecision):
    def __init__(self, strategy: ExpertParallelStrategy, device: str):
        super().__init__("bf16-mixed", device)
        self.strategy = strategy


def _ep_precision(plugin: Precision, strategy: ExpertParallelStrategy) -> Precision:
    """The EP version of the plugin Lightning built from ``precision=``, or a refusal naming why.

    Supported: ``32-true`` and ``bf16-mixed`` (autocast, no scaler), tested against the run without EP.
    ``16-mixed`` is refused: its GradScaler decides per rank whether gradients are finite and skips the step
    there, but expert gradients differ per rank, so ranks could step differently. Half-precision weights
    (``bf16-true``, ``16-true``), ``64-true`` and other plugins are not tested with EP.
    """
    if isinstance(plugin, _EPGradients):
        return plugin
    if type(plugin) is Precision:
        return _ExpertParallelPrecision(strategy)
    if type(plugin) is MixedPrecision and plugin.precision == "bf16-mixed" and plugin.scaler is None:
        return _ExpertParallelMixedPrecision(strategy, plugin.device)
    name = getattr(plugin, "precision", type(plugin).__name__)
    raise PlanError(f"Trainer(precision={name!r}) is not supported with ExpertParallelStrategy: "
                    + ("fp16's GradScaler decides per rank whether to skip a step, and expert gradients differ per "
                       "rank, so ranks could diverge" if name == "16-mixed" else "not tested with expert parallelism")
                    + "; use precision='bf16-mixed' or '32-true'")
