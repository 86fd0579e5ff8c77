"""``autoep-train``: train an MoE model with expert parallelism from the Hydra config tree.

Compose -> check every config value and the run directory -> build the model on meta -> ``resolve_plan``
-> ranks join (``autoep.train.launch``) and check they hold the same plan -> mesh ``(edp, ep)`` -> seeded or
pretrained weights -> ``apply_plan`` -> dense params replicated or FSDP2-sharded (``trainer.dense_sharding``)
-> checkpoint loaded (resume) -> the run is accepted: ``resolved.yaml`` and ``.hydra/`` written -> train.
Commands (any Hydra override works)::

    autoep-train                                    # tiny Qwen3-MoE, CPU, one process, about a minute
    python -m autoep.train trainer.steps=50 data.batch_size=4 run_dir=runs/try
    torchrun --nproc-per-node 2 -m autoep.train parallel.ep_size=2            # CPU: gloo, (edp, ep) = (1, 2)
    torchrun --nproc-per-node 4 -m autoep.train parallel.ep_size=2            # (edp, ep) = (2, 2)
    torchrun --nproc-per-node 2 -m autoep.train parallel.ep_size=2 trainer.dense_sharding=fsdp2   # dense: FSDP2
    torchrun --nproc-per-node 2 -m autoep.train parallel.ep_size=2 trainer.precision=bf16-mixed  # or bf16
    torchrun --nproc-per-node 4 -m autoep.train parallel.ep_size=2 trainer.expert_sharding=fsdp2  # experts: FSDP2 on edp
    autoep-train run_dir=runs/a trainer.ckpt_every=50                       # a run, checkpointed ...
    autoep-train run_dir=runs/a trainer.ckpt_every=50 trainer.resume=latest # ... continued where it stopped
    autoep-train data.source=tokens data.path=data/train.bin data.val_fraction=0.01 trainer.val_every=50  # real data

The run directory gets ``resolved.yaml``, ``.hydra/``, ``train.log``, ``metrics.jsonl`` (one line per step:
loss, grad norm, lr, tokens/s, tokens per expert, imbalance; per block at logged steps; ``val_loss`` every
``trainer.val_every`` steps), ``load.png`` (the expert load heatmap, ``autoep.train.plot``),
``checkpoints/step_*`` and, with ``trainer.export_hf=true``, ``hf/`` (``from_pretrained`` loads it).
Run-directory rules: ``autoep.train.rundir``; exit codes: ``autoep.train.command`` (both in the README).
"""
from __future__ import annotations

import copy
import json
import logging
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import autoep.train.config  # noqa: F401  (registers train_schema / resolved_schema before Hydra composes)
from autoep.errors import ConfigError, NonFiniteLoss, PeerFailure
from autoep.plan.artifact import check_complete, check_plan_consistent, write_resolved
from autoep.plan.ep_size import is_auto
from autoep.plan.resolve import resolve_plan
from autoep.plan.table import format_table, plan_rows
from autoep.runtime import grads
from autoep.runtime.apply import apply_plan
from autoep.runtime.compile import compile_dense
from autoep.runtime.dense import set_grad_sync, shard_dense
from autoep.runtime.expert_fsdp import shard_experts_over_edp
from autoep.runtime.export import export_hf
from autoep.runtime.mesh import check_world, make_mesh
from autoep.train import balance, checkpoint, launch, loop, plot, precision, rundir
from autoep.train import command as cli
from autoep.train.config import CONF_DIR, check_config
from autoep.train.data import Loader, Validation, make_splits
from autoep.train.export import check_exportable
from autoep.train.load import ExpertLoad
from autoep.train.models import MODEL_CONFIG_ERRORS, check_model_config, check_top_k, instantiate_model
from autoep.train.pretrained import PretrainedError, load_pretrained, local_checkpoint_dir, parameters_on_meta

PROG = "autoep-train"
log = logging.getLogger("autoep.train.trainer")  # not __name__: under `python -m` that is __main__


def build_model(cfg: DictConfig, mesh, device: torch.device):
    """Resolve the plan on a meta model, then build seeded weights and apply the frozen plan.

    With ``model.pretrained_path`` the meta model itself is planned, sharded and then filled from the
    checkpoint, each rank reading only its own experts (``autoep.train.pretrained``).
    """
    pretrained_path = pretrained_path_of(cfg.model)
    if pretrained_path:
        with parameters_on_meta():  # NOTE: buffers (rotary inv_freq) are computed for real, weights are not
            model = instantiate_model(cfg.model)
        parallel = resolve_plan(cfg.parallel, model)
        check_top_k(model, parallel.plan)
        apply_plan(model, parallel, mesh)
        load_pretrained(model, pretrained_path, device)
        return model, parallel
    with torch.device("meta"):  # NOTE: detection reads shapes and source only; nothing is allocated
        meta_model = instantiate_model(cfg.model)
    parallel = resolve_plan(cfg.parallel, meta_model)
    check_top_k(meta_model, parallel.plan)
    torch.manual_seed(cfg.trainer.seed)  # same full weights on every rank; apply_plan slices the experts
    with torch.device(device):
        model = instantiate_model(cfg.model)
    apply_plan(model, parallel, mesh)
    return model, parallel


def resolve_on_meta(cfg: DictConfig, world: int) -> DictConfig:
    """``cfg.parallel`` resolved on a meta model for ``world`` ranks (``parallel.ep_size: auto`` becomes a number)."""
    with torch.device("meta"):
        return resolve_plan(cfg.parallel, instantiate_model(cfg.model), world_size=world)


def planned_and_skipped(parallel: DictConfig) -> tuple[list[str], list[str]]:
    """(the planned EP blocks, the dense modules ``moe_only`` skipped), over every plan entry."""
    return ([m for e in parallel.plan for m in e.decision.modules],
            [m for e in parallel.plan for m in e.decision.get("skipped") or []])


def pretrained_path_of(model_cfg: DictConfig) -> str | None:
    """``model.pretrained_path`` (a local HF checkpoint directory), or None for seeded init."""
    if "pretrained_path" in model_cfg.keys() and OmegaConf.is_missing(model_cfg, "pretrained_path"):
        raise PretrainedError("model.pretrained_path is required by this model config; pass "
                              "model.pretrained_path=<a directory written by save_pretrained>")
    return model_cfg.get("pretrained_path")


@dataclass
class Run:
    """Where a run lives and what it starts from (every rank holds its own)."""

    out: Path  # the run directory
    rank: int
    world: int
    device: torch.device
    resume_from: Path | None  # the checkpoint to continue from, or None for a fresh run
    composed: DictConfig  # the config as composed, for .hydra/config.yaml
    state: dict | None = None  # the trainer state loaded from resume_from


def train(cfg: DictConfig, run_dir: str | None = None) -> dict:
    """Run the whole training described by ``cfg``.

    Every value is checked and the run directory's rules applied before any work; nothing in the run
    directory changes until the run is accepted (``autoep.train.rundir``). Returns, on every rank,
    ``{"losses": global mean loss per step run, "run_dir", "step", "rank", "model"}``. Joins an
    initialised process group (tests) or the launcher's; destroys only a group it created.
    """
    composed = copy.deepcopy(cfg)
    check_complete(cfg, "the composed config")
    cfg = check_config(cfg)
    out = rundir.prepare(run_dir or cfg.run_dir or "runs/autoep-train")
    resume_from = rundir.checkpoint_to_resume(cfg.trainer.resume, out)
    check_model_config(cfg)
    if resume_from is not None:
        check_resumable(checkpoint.read_state(resume_from), resume_from, cfg)
    if cfg.model.get("pretrained_path"):  # made absolute, so resolved.yaml and every rank read the same one
        cfg.model.pretrained_path = str(local_checkpoint_dir(cfg.model.pretrained_path))
    t = cfg.trainer
    rank, world, device, created = launch.init_distributed(t.device, t.timeout_s, t.join_timeout_s)
    try:
        if is_auto(cfg.parallel.ep_size):  # NOTE: the mesh needs the number: decided on meta, replayed below
            cfg.parallel = resolve_on_meta(cfg, world)
        check_world(cfg.parallel.ep_size, world)
        precision.check_supported(t.precision, device)
        out = launch.agree_run_dir(out)
        mesh = make_mesh(world, cfg.parallel.ep_size, device)
        model, cfg.parallel = build_model(cfg, mesh, device)
        precision.check_fp32_masters(model, t.precision)
        if not cfg.parallel.plan and rank == 0:
            log.warning("parallel.plan is empty: no module gets expert parallelism (every expert on every rank)")
        if t.export_hf:
            check_exportable(model)
        if t.compile:  # before FSDP2, as torchtitan orders them
            compiled = compile_dense(model, *planned_and_skipped(cfg.parallel), backend=t.compile_backend)
            log.info("trainer.compile: %d dense modules compiled (%s); the EP blocks run eager", len(compiled),
                     t.compile_backend)
        blocks = [m for e in cfg.parallel.plan for m in e.decision.modules]
        if t.expert_sharding == "fsdp2":  # before the dense layers: FSDP2 goes bottom-up
            shard_experts_over_edp(model, blocks, mesh)
        if t.dense_sharding == "fsdp2" and world > 1:  # one process: nothing to shard or reduce
            shard_dense(model, blocks, world, device, mp_policy=precision.fsdp_policy(t.precision))
        check_plan_consistent(cfg.parallel)
        return run_loop(cfg, model, mesh, Run(out, rank, world, device, resume_from, composed))
    finally:
        if created:
            dist.destroy_process_group()


def check_resumable(state: dict, path: Path, cfg: DictConfig) -> None:
    """Before any work: the checkpoint has steps left to train and was saved from this model config."""
    step, steps = int(state["step"]), cfg.trainer.steps
    if step >= steps:
        raise ConfigError(f"trainer.resume={cfg.trainer.resume}: {path.name} is at step {step} and trainer.steps="
                          f"{steps}, so nothing is left to train; raise trainer.steps (e.g. trainer.steps="
                          f"{step + max(steps, 1)}) to continue the run")
    saved = (state.get("run") or {}).get("model")
    if saved is None:
        return  # a checkpoint written before autoep recorded its model config: the parameter shapes decide
    mine = _model_identity(cfg.model)
    diff = [f"model.{k}: {saved.get(k)} -> {mine.get(k)}" for k in sorted(set(saved) | set(mine))
            if saved.get(k) != mine.get(k)]
    if diff:
        raise checkpoint.CheckpointError(f"trainer.resume={cfg.trainer.resume}: {path} was saved from a different "
                                         f"model ({'; '.join(diff[:3])}); resume with the model config it was trained "
                                         f"with, or start fresh in a new run_dir")


def _model_identity(model_cfg) -> dict:
    """The model config as a resume compares it (where the pretrained weights came from does not matter)."""
    plain = OmegaConf.to_container(model_cfg, resolve=True)
    plain.pop("pretrained_path", None)
    return plain


def report_resume(state: dict, cfg: DictConfig, world: int) -> None:
    """Say what changed since the checkpoint was saved: steps, world size, global batch, precision (rank 0 logs)."""
    saved = state.get("run") or {}
    now = {"trainer.steps": cfg.trainer.steps, "world size": world, "global batch": global_batch(cfg, world),
           "data": data_identity(cfg), "trainer.precision": cfg.trainer.precision}
    for key, value in now.items():
        before = saved.get(key)
        if before is not None and before != value and key in ("global batch", "data"):
            log.warning("resuming with global batch %s -> %s; the data stream differs from the uninterrupted "
                        "run's from here on", before, value)
        elif before is not None and before != value:
            log.info("resuming with %s %s -> %s", key, before, value)


def data_identity(cfg: DictConfig) -> dict:
    """What decides the token stream besides the seed and the global batch (a resume compares it)."""
    return {k: cfg.data[k] for k in ("source", "path", "tokenizer_path", "val_path", "val_fraction", "seq_len")}


def global_batch(cfg: DictConfig, world: int) -> int:
    """Sequences per optimiser step over all ranks."""
    return cfg.data.batch_size * world * cfg.trainer.grad_accum


@dataclass
class Parts:
    """What one optimiser step touches."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    loader: Loader
    params: tuple  # (dense, expert) parameter lists
    groups: tuple  # (world, edp, ep) process groups, None where there is one rank
    balance: balance.Balance  # router losses and bias update (autoep.train.balance)
    val: Validation | None = None  # the held-out rows, read every trainer.val_every steps


def train_step(parts: Parts, *, run: Run, step: int, cfg: DictConfig, first: bool = False
               ) -> tuple[float, float, float, bool]:
    """One optimiser step over ``trainer.grad_accum`` micro-batches; returns (global mean loss, grad norm, lr,
    applied). A step whose loss or grad norm is not finite is not applied (every rank agrees: both are
    reduced over the world); the schedule advances either way.

    Each rank back-propagates ``loss / (world * grad_accum)``, so summing gradients over ranks gives the
    gradient of the global mean loss: dense gradients are summed over the world, expert gradients over
    ``edp`` (their ``ep`` peers already contributed through the token exchange).
    """
    t, o = cfg.trainer, cfg.optim
    (dense, expert), (world_group, edp_group, ep_group) = parts.params, parts.groups
    loss_sum = torch.zeros((), dtype=torch.float64)
    for micro in range(t.grad_accum):
        set_grad_sync(parts.model, micro == t.grad_accum - 1)  # FSDP2: reduce-scatter once, after the last
        batch = parts.loader.next().to(run.device)
        with precision.forward(parts.model, t.precision, run.device):  # fp32 | autocast | bf16 weight copies
            if first and micro == 0:
                loss = first_forward(parts.model, batch, parts.balance, t.precision)
            else:
                loss = loop.causal_lm_loss(parts.model, batch, parts.balance.local_aux_coef, parts.balance.router_losses)
        die_if_fault_injected(run.rank, step + 1)
        (loss / (run.world * t.grad_accum)).backward()
        loss_sum += loss.detach().double().cpu()
    grads.reduce_grads(dense, expert, world_group, edp_group)
    grad_norm = grads.clip_grad_norm(dense, expert, o.grad_clip, ep_group)
    if world_group is not None:
        dist.all_reduce(loss_sum, group=world_group)  # NOTE: collective; the global mean loss
    step_loss = loss_sum.item() / (run.world * t.grad_accum)
    lr = parts.optimizer.param_groups[0]["lr"]
    applied = math.isfinite(step_loss) and math.isfinite(grad_norm)
    if applied:
        parts.optimizer.step()
    parts.schedule.step()
    parts.optimizer.zero_grad(set_to_none=True)
    return step_loss, grad_norm, lr, applied


def first_forward(model, batch, balancing: balance.Balance, precision_name: str = "fp32"):
    """The run's first forward: where model config values that do not fit together (a hidden size the
    heads do not divide, ...) show up. Such an error is a ``ConfigError`` naming the model; a failed
    collective is not (a peer failed)."""
    try:
        return loop.causal_lm_loss(model, batch, balancing.local_aux_coef, balancing.router_losses)
    except (*MODEL_CONFIG_ERRORS, RuntimeError) as e:
        if isinstance(e, (dist.DistError, ConfigError)):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"model: the first forward of {type(model).__name__} failed ({type(e).__name__}: {first}); "
                          f"its config values probably do not fit together: check the model.* values (traceback in "
                          f"train.log)" + (f"; or it does not compute in trainer.precision={precision_name}: try "
                                           f"trainer.precision=fp32" if precision_name != "fp32" else "")) from e


def run_loop(cfg: DictConfig, model, mesh, run: Run) -> dict:
    t, o, d = cfg.trainer, cfg.optim, cfg.data
    world_group = dist.group.WORLD if run.world > 1 else None
    groups = (world_group, *(mesh[n].get_group() if mesh is not None else None for n in ("edp", "ep")))
    dense, expert = grads.split_params(model)
    # foreach=False: dense tensors and expert DTensors share one optimiser; the per-tensor path handles both.
    optimizer = torch.optim.AdamW(dense + expert, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                  weight_decay=o.weight_decay, foreach=False)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: loop.warmup_cosine(
        s, warmup_steps=o.warmup_steps, total_steps=t.steps, min_lr_ratio=o.min_lr_ratio))
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or cfg.model.get("vocab_size"))
    source, held_out = make_splits(d.source, vocab_size=vocab, seq_len=d.seq_len, seed=t.seed, path=d.path,
                                   tokenizer_path=d.tokenizer_path, val_path=d.val_path, val_fraction=d.val_fraction)
    loader = Loader(source, batch_size=d.batch_size, rank=run.rank, world_size=run.world)
    val = Validation(held_out, batch_size=d.batch_size, rank=run.rank, world_size=run.world,
                     batches=t.val_batches) if held_out is not None and t.val_every else None
    decisions = [e.decision for e in cfg.parallel.plan]
    blocks = [m for dec in decisions for m in dec.modules]
    load = ExpertLoad(model, blocks, int(decisions[0].num_experts or 0) if decisions else 0) if decisions else None
    balancing = balance.build(model, blocks, load.counted if load else [], aux_loss_coef=o.aux_loss_coef,
                              aux_loss_scope=o.aux_loss_scope, z_loss_coef=o.z_loss_coef,
                              bias_update_rate=o.bias_update_rate, world_group=world_group)
    parts = Parts(model, optimizer, schedule, loader, (dense, expert), groups, balancing, val)
    start = restore(run, parts)  # a damaged or mismatched checkpoint fails here, before anything is written
    with accepted(cfg, model, run, start) as metrics:
        losses = run_steps(cfg, parts, run, start, metrics, load)
        if metrics and load:
            plot.draw_at_end(run.out)
        if t.export_hf:
            export_hf(model, run.out / "hf")
    return {"losses": losses, "run_dir": str(run.out), "step": t.steps, "rank": run.rank, "model": model}


def restore(run: Run, parts: Parts) -> int:
    """Load the checkpoint the run continues from into model, optimiser, schedule and data position;
    return the step to start from (0 for a fresh run)."""
    if run.resume_from is None:
        return 0
    state = checkpoint.load(run.resume_from, parts.model, parts.optimizer)
    parts.schedule.load_state_dict(state["schedule"])
    parts.loader.load_state_dict(state["data"])
    if "rng" in state:
        torch.set_rng_state(state["rng"])
    run.state = state
    return int(state["step"])


@contextmanager
def accepted(cfg: DictConfig, model, run: Run, start: int):
    """The run is accepted: rank 0 writes ``resolved.yaml`` and ``.hydra/``, cuts ``metrics.jsonl`` back to
    the start step, logs to ``train.log``, prints the plan, and yields the open metrics file (None elsewhere)."""
    if run.rank != 0:
        yield None
        return
    write_resolved(cfg, run.out)
    rundir.write_hydra_record(run.out, run.composed)
    dropped = rundir.cut_metrics(run.out, start)
    with rundir.log_to_file(run.out), open(run.out / rundir.METRICS, "a") as metrics:
        log.info("%s", format_table(plan_rows(model, cfg.parallel)))
        if run.resume_from is not None:
            log.info("resumed from %s at step %d%s", run.resume_from, start,
                     f" ({dropped} metrics rows past it dropped)" if dropped else "")
            report_resume(run.state, cfg, run.world)
        yield metrics


def run_steps(cfg: DictConfig, parts: Parts, run: Run, start: int, metrics, load) -> list[float]:
    """Steps ``start + 1 .. trainer.steps``: metrics rows, progress lines, checkpoints; the losses."""
    t, d = cfg.trainer, cfg.data
    ckpt_root = run.out / rundir.CHECKPOINTS
    losses, tokens_per_step = [], global_batch(cfg, run.world) * d.seq_len
    step = start
    parts.model.train()
    try:
        for step in range(start, t.steps):
            t0 = time.perf_counter()
            step_loss, grad_norm, lr, applied = train_step(parts, run=run, step=step, cfg=cfg, first=step == start)
            if not applied:
                skip_or_stop(cfg, step + 1, step_loss, grad_norm, ckpt_root)
            losses.append(step_loss)
            logged = (step + 1) % t.log_every == 0 or step + 1 == t.steps or step == start
            row = {"step": step + 1, "loss": step_loss if applied else None, "grad_norm": grad_norm if applied else None,
                   "lr": lr, "tokens_per_s": tokens_per_step / (time.perf_counter() - t0),
                   **({"skipped": True} if not applied else {}),
                   **(load.collect(parts.groups[0]) if load else {}), **(load.log_fields() if load and logged else {})}
            if applied and parts.balance.bias is not None:
                parts.balance.bias.step(load.step_LE)  # the step's global counts: the same bias on every rank
            if parts.val is not None and ((step + 1) % t.val_every == 0 or step + 1 == t.steps):
                with precision.forward(parts.model, t.precision, run.device):  # validated as it trains
                    row["val_loss"] = loop.validation_loss(parts.model, parts.val.batches(), parts.groups[0], run.device)
                if load:
                    load.discard()  # the validation tokens are no step's load
            if metrics:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                if logged or "val_loss" in row:
                    val = f" | val loss {row['val_loss']:.4f}" if "val_loss" in row else ""
                    log.info("step %5d/%d | loss %.4f | lr %.2e | grad norm %.3f | %s tok/s | imbalance %.2f%s%s",
                             step + 1, t.steps, step_loss, lr, grad_norm, f"{row['tokens_per_s']:,.0f}",
                             row.get("load_imbalance", 0), load.worst(row) if load else "", val)
            if t.ckpt_every and ((step + 1) % t.ckpt_every == 0 or step + 1 == t.steps):
                checkpoint.save(ckpt_root, step + 1, parts.model, parts.optimizer, {
                    "step": step + 1, "schedule": parts.schedule.state_dict(), "data": parts.loader.state_dict(),
                    "run": {"model": _model_identity(cfg.model), "trainer.steps": t.steps, "world size": run.world,
                            "global batch": global_batch(cfg, run.world), "data": data_identity(cfg),
                            "trainer.precision": t.precision}})
    except RuntimeError as exc:
        if run.world == 1 or isinstance(exc, (NonFiniteLoss, checkpoint.CheckpointError)):
            raise
        # A collective failed: on gloo/NCCL this is how a dead or hung peer shows up on the survivors.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PeerFailure(
            f"rank {run.rank} failed in step {step + 1}: {first}. Another rank probably died or hung (check its "
            f"log). Every completed step up to the last checkpoint is kept under {ckpt_root}; resume with "
            f"trainer.resume=latest run_dir={run.out}") from exc
    return losses


def skip_or_stop(cfg: DictConfig, step: int, loss: float, grad_norm: float, ckpt_root: Path) -> None:
    """A step whose loss or grad norm is not finite: stop the run (``trainer.on_nonfinite=error``) or log it
    and go on (``skip``). Either way the step was not applied."""
    what = f"step {step}: loss {loss} and gradient norm {grad_norm}, not finite; the step was not applied"
    if cfg.trainer.on_nonfinite == "skip":
        log.warning("%s (trainer.on_nonfinite=skip)", what)
        return
    last = checkpoint.latest(ckpt_root)
    kept = f"the last good checkpoint, {last}, is kept" if last else "no checkpoint was saved (trainer.ckpt_every=0)"
    raise NonFiniteLoss(f"{what} and nothing of it saved; {kept}. Lower optim.lr (now {cfg.optim.lr}) or raise "
                        f"optim.warmup_steps and resume with trainer.resume=latest, or set trainer.on_nonfinite=skip "
                        f"to skip such steps")


FAULT_ENV = "AUTOEP_FAULT_STEP"


def die_if_fault_injected(rank: int, step: int) -> None:
    """TEST-ONLY fault hook: ``AUTOEP_FAULT_STEP=<rank>:<step>`` makes that rank ``os._exit(1)`` mid-step
    (after its forward, before the backward's exchanges), as a crashed or killed worker would;
    ``<rank>:<step>:hang`` makes it sleep there instead, as a stuck worker would. Never set it
    in a real run; tests use it to prove the other ranks fail within ``trainer.timeout_s`` instead of hanging."""
    spec = os.environ.get(FAULT_ENV, "")
    if spec == f"{rank}:{step}":
        os._exit(1)
    if spec == f"{rank}:{step}:hang":  # alive but silent: the others must give up after trainer.timeout_s
        time.sleep(10 * 24 * 3600)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    cli.task(PROG, lambda: _train_cli(cfg))


def _train_cli(cfg: DictConfig) -> None:
    result = train(cfg, cfg.run_dir or HydraConfig.get().runtime.output_dir)
    if result["rank"] == 0:
        log.info("run dir: %s", result["run_dir"])


def main() -> None:
    """``autoep-train [overrides]``: one-line errors and exit codes as ``autoep.train.command`` documents."""
    cli.main(PROG, _hydra_main)


if __name__ == "__main__":
    main()
