"""HF ``transformers.Trainer`` with expert parallelism: ``ExpertParallelTrainer``, a thin layer on
``autoep.ExpertParallel``. Run it as any HF training script, e.g. ``torchrun --nproc-per-node 2 train.py``::

    from autoep.integrations.hf import ExpertParallelTrainer

    args = TrainingArguments(output_dir="out", optim="sgd", max_steps=100, save_strategy="steps", save_steps=50)
    trainer = ExpertParallelTrainer(model=model, args=args, train_dataset=data, parallel=cfg.parallel)
    trainer.train()                                   # also trainer.train(resume_from_checkpoint=True)

``parallel`` is the ``parallel`` config section (``pkg://autoep.plan.conf``'s group, a dict, or a path to a
resolved.yaml); the frozen plan goes to ``<output_dir>/resolved.yaml``.

Why a ``Trainer`` subclass, not a callback or an accelerate plugin: what EP changes are steps the
Trainer's own methods take, between events a callback sees. Expert gradients must be finished (summed
over ``edp``, scaled to DDP's mean) after the last backward and *before* clipping, and callbacks fire
after clipping (``on_pre_optimizer_step``); the clip norm must count every expert once; saving must
gather every expert on every rank before rank 0 writes (``save_model`` runs ``_save`` on rank 0 only, so
a gather there would hang); loading must slice each expert back to its rank. Each override below is one
of those steps, delegating to the handle; nothing else of the Trainer changes.

The gradient convention is DDP's (``grad_convention="mean"``): the Trainer's per-rank loss is averaged
over ranks by DDP for the dense parameters (also with ``average_tokens_across_devices``, where each rank's
loss is already scaled by the world size), and ``finish_gradients`` gives the experts the same scale.
"""
from __future__ import annotations

import os

import torch
from transformers import Trainer, TrainingArguments

from autoep.errors import PlanError
from autoep.integrations.handle import ExpertParallel

# The Trainer methods this adapter replaces. They are not public API: on a transformers that lacks one,
# the adapter refuses to run rather than let the Trainer's own (EP-unaware) step run silently.
OVERRIDDEN = ("_clip_grad_norm", "_get_grad_norm", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler",
              "_load_from_checkpoint", "training_step", "create_optimizer", "save_model")
OPTIMIZER_NAME, SCHEDULER_NAME, WEIGHTS_NAME = "optimizer.pt", "scheduler.pt", "model.safetensors"


class ExpertParallelTrainer(Trainer):
    """``transformers.Trainer`` whose model is made expert-parallel by ``autoep.ExpertParallel``.

    Every ``Trainer`` argument works as usual; ``parallel`` (required) is the ``parallel`` section, and
    ``run_dir`` (default ``args.output_dir``) where rank 0 writes ``resolved.yaml``. ``self.ep`` is the handle.
    """

    def __init__(self, model=None, args: TrainingArguments | None = None, *trainer_args, parallel=None, run_dir=None,
                 **trainer_kwargs):
        if parallel is None:
            raise PlanError("ExpertParallelTrainer(parallel=...) is required: the `parallel` config section "
                            "(e.g. cfg.parallel, or {'ep_size': 2, 'plan': [{'match': 'model.layers.*.mlp', "
                            "'local_compute_fn': 'auto'}]}), or the path of a resolved.yaml to replay")
        if model is None:
            raise PlanError("ExpertParallelTrainer needs model=...: the plan is applied to the model before training "
                            "(model_init, which builds a new model per trial, is not supported)")
        args = args if args is not None else TrainingArguments(output_dir="trainer_output")
        check_args(args)
        model.to(args.device)  # NOTE: args.device sets up torch.distributed (accelerate) under torchrun
        self.ep = ExpertParallel(model, parallel, run_dir=args.output_dir if run_dir is None else run_dir)
        super().__init__(model, args, *trainer_args, **trainer_kwargs)

    # -- gradients: finished after the step's last backward, clipped with the EP-correct norm ---------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:  # the last micro-batch of this optimizer step
            self.ep.finish_gradients()  # NOTE: collective over edp (and the world when ep < world)
        return loss

    def _clip_grad_norm(self, model):
        return self.ep.clip_grad_norm_(self.args.max_grad_norm)  # NOTE: collective over ep

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:  # max_grad_norm=0: the norm is only logged
            grad_norm = self.ep.clip_grad_norm_(float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def create_optimizer(self, model=None):
        """The Trainer's optimizer with each parameter group split into its dense and expert parameters (an
        optimizer's fused/foreach kernels cannot mix plain tensors and DTensors), and a step on unfinished
        gradients made an error (``ExpertParallel.attach``)."""
        optimizer = super().create_optimizer(model)
        raw = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it later; the hooks go on torch's
        if not getattr(raw, "_autoep_attached", False):
            experts = {id(p) for p in self.ep.expert_parameters()}
            groups = []
            for group in raw.param_groups:
                for mine in (False, True):
                    params = [p for p in group["params"] if (id(p) in experts) == mine]
                    if params:
                        groups.append({**group, "params": params})
            raw.param_groups = groups
            self.ep.attach(raw)
            raw._autoep_attached = True
        return optimizer

    # -- state: every expert saved by rank 0 after a gather on every rank, sliced back on load ----------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        full = self.ep.state_dict()  # NOTE: collective: every rank gathers every expert
        self._save(output_dir, state_dict=full)  # rank 0 writes (args.should_save); the others return at once
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        full = self.ep.optimizer_state_dict(_raw(self.optimizer))  # NOTE: collective: expert moments gathered
        if self.args.should_save:
            torch.save(full, os.path.join(output_dir, OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, OPTIMIZER_NAME)
        if not os.path.isfile(path):
            raise PlanError(f"resume_from_checkpoint={checkpoint}: no {OPTIMIZER_NAME}, so the optimizer state "
                            f"(every expert's) cannot be restored; resume from a checkpoint ExpertParallelTrainer "
                            f"saved with save_only_model=False")
        self.ep.load_optimizer_state_dict(_raw(self.optimizer), torch.load(path, map_location="cpu", weights_only=True))
        self.lr_scheduler.load_state_dict(
            torch.load(os.path.join(checkpoint, SCHEDULER_NAME), map_location="cpu", weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Each rank reads the whole checkpoint and keeps its own experts. A ``PreTrainedModel``'s checkpoint is
        read by ``from_pretrained`` (``save_pretrained`` writes transformers' original layout, e.g. one tensor
        per expert, which only its loader maps back onto the model's parameters)."""
        from transformers import PreTrainedModel

        if not os.path.isfile(os.path.join(resume_from_checkpoint, WEIGHTS_NAME)):
            raise PlanError(f"resume_from_checkpoint={resume_from_checkpoint}: no {WEIGHTS_NAME}; resume from a "
                            f"checkpoint-N directory that ExpertParallelTrainer saved")
        if isinstance(self.model, PreTrainedModel):
            dtype = next(self.model.parameters()).dtype
            full = type(self.model).from_pretrained(resume_from_checkpoint, dtype=dtype).state_dict()
        else:  # Trainer saved the plain state dict under the model's own names
            import safetensors.torch

            full = safetensors.torch.load_file(os.path.join(resume_from_checkpoint, WEIGHTS_NAME), device="cpu")
        self.ep.load_state_dict(full)  # NOTE: collective; each rank keeps its own slice of every expert


def _raw(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps torch's


def check_args(args: TrainingArguments) -> None:
    """Refuse what this adapter does not run exactly, naming the argument and the fix."""
    missing = [name for name in OVERRIDDEN if not hasattr(Trainer, name)]
    if missing:
        import transformers

        raise PlanError(f"transformers {transformers.__version__}: Trainer has no {missing}, which "
                        f"ExpertParallelTrainer replaces to finish, clip, save and load expert gradients and state; "
                        f"use transformers 5.x as autoep's [test] extra pins it")
    refused = {
        "fp16": (args.fp16, "fp16=True (a GradScaler over expert DTensor gradients is not tested); use bf16=True"),
        "deepspeed": (args.deepspeed, "deepspeed shards what autoep shards; drop deepspeed"),
        "fsdp": (args.fsdp, "fsdp through the Trainer is not supported with EP; drop fsdp"),
        "load_best_model_at_end": (args.load_best_model_at_end, "load_best_model_at_end=True (not supported yet); "
                                   "load the best checkpoint with trainer.train(resume_from_checkpoint=...) or "
                                   "from_pretrained"),
        "torch_compile": (args.torch_compile, "torch_compile=True: accelerate compiles the whole model, the EP "
                          "blocks' token exchange included (a host sync for the split sizes, all-to-all on expert "
                          "shards), which no test runs; drop it (autoep-train's trainer.compile=true compiles the dense "
                          "layers only, autoep.runtime.compile; this adapter does not pass that through yet)"),
    }
    for key, (value, why) in refused.items():
        if value:
            raise PlanError(f"TrainingArguments.{key}={value!r}: ExpertParallelTrainer refuses {why}")
