"""``autoep-train``: train an MoE model with expert parallelism from the Hydra config tree.

Compose -> build the model on meta -> ``resolve_plan`` -> rank 0 writes ``<run_dir>/resolved.yaml``,
every rank checks the plan hash -> mesh ``(edp, ep)`` -> seeded weights -> ``apply_plan`` -> dense
params replicated or FSDP2-sharded (``trainer.dense_sharding``, ``autoep.dense``) -> train.
Commands (any Hydra override works)::

    autoep-train                                    # tiny Qwen3-MoE, CPU, one process, about a minute
    python -m autoep.train trainer.steps=50 data.batch_size=4 run_dir=runs/try
    torchrun --nproc-per-node 2 -m autoep.train parallel.ep_size=2            # CPU: gloo, (edp, ep) = (1, 2)
    torchrun --nproc-per-node 4 -m autoep.train parallel.ep_size=2            # (edp, ep) = (2, 2)
    torchrun --nproc-per-node 2 -m autoep.train parallel.ep_size=2 trainer.dense_sharding=fsdp2   # dense: FSDP2
    autoep-train trainer.ckpt_every=50 run_dir=runs/a && autoep-train run_dir=runs/a trainer.resume=latest

The run directory gets ``resolved.yaml``, ``metrics.jsonl`` (one line per step: loss, grad norm, lr,
tokens/s, tokens per expert, imbalance) and ``checkpoints/step_*``. Rank 0 chooses it and every rank
uses rank 0's choice. Exit status 2 with ``autoep-train: error: ...`` on a config/plan/checkpoint error.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed.device_mesh import init_device_mesh

import autoep.config  # noqa: F401  (registers train_schema / resolved_schema before Hydra composes)
from autoep import checkpoint, loop
from autoep.apply import apply_plan
from autoep.artifact import check_complete, check_plan_consistent, write_resolved
from autoep.data import Loader, make_source
from autoep.dense import check_dense_sharding, set_grad_sync, shard_dense
from autoep.errors import PlanError
from autoep.plan import CONF_DIR, format_table, plan_rows
from autoep.pretrained import PretrainedError, load_pretrained, parameters_on_meta
from autoep.resolve import resolve_plan


def init_distributed(device: str, timeout_s: int) -> tuple[int, int, torch.device, bool]:
    """(rank, world size, device, whether this call created the process group).

    Joins torchrun's group (``WORLD_SIZE`` set) or one a caller already initialised; else single process.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    created = False
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        created = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))))
        return rank, world, torch.device("cuda", torch.cuda.current_device()), created
    return rank, world, torch.device(device), created


def check_world(ep_size: int, world: int) -> None:
    if ep_size < 1 or world % ep_size:
        fits = [d for d in range(1, world + 1) if world % d == 0]
        raise PlanError(f"parallel.ep_size={ep_size} does not divide the world size {world} (processes launched); "
                        f"pick parallel.ep_size from {fits} or launch a multiple of {ep_size} processes "
                        f"(torchrun --nproc-per-node)")


def agree_run_dir(run_dir: str | None) -> Path:
    """Rank 0's run directory, on every rank (Hydra's per-process timestamps may differ)."""
    chosen = [str(Path(run_dir or "runs/autoep-train").resolve())]
    if dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0)  # NOTE: collective; one small pickle from rank 0
    return Path(chosen[0])


def build_model(cfg: DictConfig, mesh, device: torch.device):
    """Resolve the plan on a meta model, then build seeded weights and apply the frozen plan.

    With ``model.pretrained_path`` the meta model itself is planned, sharded and then filled from the
    checkpoint, each rank reading only its own experts (``autoep.pretrained``).
    """
    pretrained_path = pretrained_path_of(cfg.model)
    if pretrained_path:
        with parameters_on_meta():  # NOTE: buffers (rotary inv_freq) are computed for real, weights are not
            model = instantiate(cfg.model)
        parallel = resolve_plan(cfg.parallel, model)
        apply_plan(model, parallel, mesh)
        load_pretrained(model, pretrained_path, device)
        return model, parallel
    with torch.device("meta"):  # NOTE: detection reads shapes and source only; nothing is allocated
        meta_model = instantiate(cfg.model)
    parallel = resolve_plan(cfg.parallel, meta_model)
    torch.manual_seed(cfg.trainer.seed)  # same full weights on every rank; apply_plan slices the experts
    with torch.device(device):
        model = instantiate(cfg.model)
    apply_plan(model, parallel, mesh)
    return model, parallel


def pretrained_path_of(model_cfg: DictConfig) -> str | None:
    """``model.pretrained_path`` (a local HF checkpoint directory), or None for seeded init."""
    if "pretrained_path" in model_cfg.keys() and OmegaConf.is_missing(model_cfg, "pretrained_path"):
        raise PretrainedError("model.pretrained_path is required by this model config; pass "
                              "model.pretrained_path=<a directory written by save_pretrained>")
    return model_cfg.get("pretrained_path")


def make_mesh(world: int, ep_size: int, device: torch.device):
    if world == 1:
        return None  # single process: recipes run without exchange, params stay plain tensors
    return init_device_mesh(device.type, (world // ep_size, ep_size), mesh_dim_names=("edp", "ep"))


def train(cfg: DictConfig, run_dir: str | None = None) -> dict:
    """Run the whole training described by ``cfg``.

    Returns, on every rank, ``{"losses": global mean loss per step run, "run_dir", "step", "rank", "model"}``.
    Joins an initialised process group (tests) or torchrun's; destroys only a group it created.
    """
    check_complete(cfg, "the composed config")
    check_dense_sharding(cfg.trainer.dense_sharding)
    rank, world, device, created = init_distributed(cfg.trainer.device, cfg.trainer.timeout_s)
    try:
        check_world(cfg.parallel.ep_size, world)
        out = Path(agree_run_dir(run_dir or cfg.run_dir))
        mesh = make_mesh(world, cfg.parallel.ep_size, device)
        model, cfg.parallel = build_model(cfg, mesh, device)
        if cfg.trainer.dense_sharding == "fsdp2" and world > 1:  # one process: nothing to shard or reduce
            shard_dense(model, [m for e in cfg.parallel.plan for m in e.decision.modules], world, device)
        write_resolved(cfg, out)
        check_plan_consistent(cfg.parallel)
        if rank == 0:
            print(format_table(plan_rows(model, cfg.parallel)), flush=True)
        return run_loop(cfg, model, mesh, out, rank, world, device)
    finally:
        if created:
            dist.destroy_process_group()


def train_step(model, loader, optimizer, schedule, *, params, groups, rank: int, world: int, step: int, device,
               cfg: DictConfig) -> tuple[float, float, float]:
    """One optimiser step over ``trainer.grad_accum`` micro-batches; returns (global mean loss, grad norm, lr).

    Each rank back-propagates ``loss / (world * grad_accum)``, so summing gradients over ranks gives the
    gradient of the global mean loss: dense gradients are summed over the world, expert gradients over
    ``edp`` (their ``ep`` peers already contributed through the token exchange).
    """
    t, o = cfg.trainer, cfg.optim
    (dense, expert), (world_group, edp_group, ep_group) = params, groups
    loss_sum = torch.zeros((), dtype=torch.float64)
    for micro in range(t.grad_accum):
        set_grad_sync(model, micro == t.grad_accum - 1)  # FSDP2: reduce-scatter once, after the last
        loss = loop.causal_lm_loss(model, loader.next().to(device), o.aux_loss_coef)
        die_if_fault_injected(rank, step + 1)
        (loss / (world * t.grad_accum)).backward()
        loss_sum += loss.detach().double().cpu()
    loop.reduce_grads(dense, expert, world_group, edp_group)
    grad_norm = loop.clip_grad_norm(dense, expert, o.grad_clip, ep_group)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)
    if world_group is not None:
        dist.all_reduce(loss_sum, group=world_group)  # NOTE: collective; the global mean loss for logging
    return loss_sum.item() / (world * t.grad_accum), grad_norm, lr


def run_loop(cfg: DictConfig, model, mesh, out: Path, rank: int, world: int, device) -> dict:
    t, o, d = cfg.trainer, cfg.optim, cfg.data
    world_group = dist.group.WORLD if world > 1 else None
    edp_group = mesh["edp"].get_group() if mesh is not None else None
    ep_group = mesh["ep"].get_group() if mesh is not None else None
    dense, expert = loop.split_params(model)
    # foreach=False: dense tensors and expert DTensors share one optimiser; the per-tensor path handles both.
    optimizer = torch.optim.AdamW(dense + expert, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                  weight_decay=o.weight_decay, foreach=False)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: loop.warmup_cosine(
        s, warmup_steps=o.warmup_steps, total_steps=t.steps, min_lr_ratio=o.min_lr_ratio))
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or cfg.model.get("vocab_size"))
    loader = Loader(make_source(d.source, vocab_size=vocab, seq_len=d.seq_len, seed=t.seed, path=d.path),
                    batch_size=d.batch_size, rank=rank, world_size=world)
    decisions = [e.decision for e in cfg.parallel.plan]
    load = loop.ExpertLoad(model, [m for dec in decisions for m in dec.modules],
                           int(decisions[0].num_experts or 0) if decisions else 0) if decisions else None
    start = resume(t.resume, out, model, optimizer, schedule, loader)
    ckpt_root = out / "checkpoints"
    metrics = open(out / "metrics.jsonl", "a") if rank == 0 else None
    losses, tokens_per_step = [], d.batch_size * d.seq_len * world * t.grad_accum
    model.train()
    step = start
    try:
        for step in range(start, t.steps):
            t0 = time.perf_counter()
            step_loss, grad_norm, lr = train_step(model, loader, optimizer, schedule, params=(dense, expert),
                                                  groups=(world_group, edp_group, ep_group), rank=rank, world=world,
                                                  step=step, device=device, cfg=cfg)
            losses.append(step_loss)
            row = {"step": step + 1, "loss": step_loss, "grad_norm": grad_norm, "lr": lr,
                   "tokens_per_s": tokens_per_step / (time.perf_counter() - t0), **(load.collect(world_group) if load else {})}
            if metrics:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                if (step + 1) % t.log_every == 0 or step + 1 == t.steps or step == start:
                    print(f"step {step + 1:>5}/{t.steps} | loss {step_loss:.4f} | lr {lr:.2e} | grad norm {grad_norm:.3f} "
                          f"| {row['tokens_per_s']:,.0f} tok/s | imbalance {row.get('load_imbalance', 0):.2f}", flush=True)
            if t.ckpt_every and ((step + 1) % t.ckpt_every == 0 or step + 1 == t.steps):
                checkpoint.save(ckpt_root, step + 1, model, optimizer,
                                {"step": step + 1, "schedule": schedule.state_dict(), "data": loader.state_dict()})
    except RuntimeError as exc:
        if world == 1:
            raise
        # A collective failed: on gloo/NCCL this is how a dead or hung peer shows up on the survivors.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PeerFailure(
            f"rank {rank} failed in step {step + 1}: {first}\nAnother rank probably died or hung (check its log). "
            f"Every completed step up to the last checkpoint is kept under {ckpt_root}; resume with "
            f"trainer.resume=latest run_dir={out}") from exc
    if metrics:
        metrics.close()
    return {"losses": losses, "run_dir": str(out), "step": t.steps, "rank": rank, "model": model}


FAULT_ENV = "AUTOEP_FAULT_STEP"


class PeerFailure(RuntimeError):
    """A multi-rank step failed in a collective; the message says how to resume."""


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


def resume(spec: str | None, out: Path, model, optimizer, schedule, loader) -> int:
    """Load the checkpoint ``spec`` names (a path, ``latest``, or None) and return the step to start from."""
    if not spec:
        return 0
    path = checkpoint.latest(out / "checkpoints") if spec == "latest" else Path(spec)
    if path is None:
        raise checkpoint.CheckpointError(f"trainer.resume=latest: no complete checkpoint under {out / 'checkpoints'}; "
                                         f"train with trainer.ckpt_every=N first, or set trainer.resume=null")
    state = checkpoint.load(path, model, optimizer)
    schedule.load_state_dict(state["schedule"])
    loader.load_state_dict(state["data"])
    if "rng" in state:
        torch.set_rng_state(state["rng"])
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"resumed from {path} at step {state['step']}", flush=True)
    return int(state["step"])


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        result = train(cfg, cfg.run_dir or HydraConfig.get().runtime.output_dir)
    except (PlanError, checkpoint.CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"autoep-train: error: {e}", file=sys.stderr)
        sys.exit(2)
    except PeerFailure as e:
        print(f"autoep-train: error: {e}", file=sys.stderr)
        sys.exit(3)
    if result["rank"] == 0:
        print(f"run dir: {result['run_dir']}", flush=True)


if __name__ == "__main__":
    main()
