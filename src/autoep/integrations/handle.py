"""``autoep.ExpertParallel``: expert parallelism inside any training loop (a plain torchrun loop, DDP, and the
Lightning and HF ``Trainer`` adapters built on it). The API is agreed in docs/integrations.md.

A plain loop (``torchrun --nproc-per-node 2 train.py``; one process works too with ``ep_size: 1``)::

    dist.init_process_group("gloo")                        # or "nccl"
    ep = ExpertParallel(model, cfg.parallel, run_dir=out)  # mesh, plan resolved once, applied, logged, recorded
    ddp = DistributedDataParallel(model)                   # dense params only: the handle set DDP's ignore list
    opt = torch.optim.SGD(ep.param_groups(lr=0.1))
    ep.attach(opt)                                         # a step on unfinished gradients raises
    for batch in data:
        loss_fn(ddp(batch)).backward()
        ep.finish_gradients()                              # experts: summed over edp, / world ("mean")
        ep.clip_grad_norm_(1.0)
        opt.step(); opt.zero_grad()
    ep.save(out / "ckpt", opt)                             # every expert, DCP sharded; ep.load(out / "ckpt", opt)

Gradient convention (``grad_convention``): ``"mean"`` when the host's global loss is the mean over ranks of each
rank's loss, as DDP assumes when it averages dense gradients; ``"sum"`` when the ranks' back-propagated losses
add up to the global loss (a loop that scaled each rank's loss by 1/W itself and sums gradients). Expert
gradients arrive through ordinary autograd (hooks on expert parameters fire, ``.grad`` is written by autograd),
but as sums over the ranks that routed tokens to them, so ``finish_gradients`` must run before every step:
a step of any optimizer over the model's parameters without it is an error (a global optimizer step pre-hook;
``attach`` adds one to a given optimizer too), never a silently wrong update.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import weakref
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autoep.errors import GradientsNotFinished, PlanError
from autoep.plan.artifact import load_plan, plan_hash, write_plan
from autoep.plan.ep_size import is_auto
from autoep.plan.resolve import resolve_plan, typed_parallel
from autoep.plan.table import format_table, plan_rows
from autoep.runtime import grads, state
from autoep.runtime.apply import apply_plan, ep_mesh_of
from autoep.runtime.export import export_hf
from autoep.runtime.mesh import check_distributed, check_mesh, check_world, make_mesh, world_of
from autoep.runtime.recipes.local_experts import expert_owners

__all__ = ["ExpertParallel", "load_plan"]

log = logging.getLogger("autoep")
DDP_IGNORE = "_ddp_params_and_buffers_to_ignore"  # torch's own name; read by DistributedDataParallel.__init__


class ExpertParallel:
    """Make ``model`` expert-parallel in place and give the host trainer what EP needs (module docstring).

    ``parallel``: the host's ``parallel`` config section (DictConfig, dict or ``ParallelConfig``), an already
    resolved one (replay: fingerprints re-checked, drift is an error), or a path to a resolved.yaml.
    ``mesh``: an ``(edp, ep)`` or 1-D ``ep`` DeviceMesh over the world; built when None.
    ``run_dir``: rank 0 writes ``<run_dir>/resolved.yaml`` (write-then-rename); ``load_plan`` reads it back.
    ``grad_convention``: ``"mean"`` (DDP's) or ``"sum"``. ``allowed_targets``: extra ``_target_`` prefixes.
    """

    def __init__(self, model: nn.Module, parallel, *, mesh=None, run_dir=None, grad_convention: str = "mean",
                 allowed_targets=()):
        if grad_convention not in grads.CONVENTIONS:
            raise PlanError(f"grad_convention={grad_convention!r} is not one of {list(grads.CONVENTIONS)}: 'mean' "
                            f"when the global loss is the mean of the ranks' losses (DDP), 'sum' when they add up to it")
        if isinstance(parallel, Mapping) and "expert_sharding" in parallel:
            raise PlanError(f"parallel.expert_sharding={parallel['expert_sharding']}: expert FSDP2 is autoep-train's "
                            f"trainer.expert_sharding; ExpertParallel (and the Lightning and HF adapters on it) keeps "
                            f"the experts whole on each edp replica, with a DDP-wrapped dense part (no FSDP2 path "
                            f"here yet); drop parallel.expert_sharding, or train with autoep-train "
                            f"trainer.expert_sharding=fsdp2")
        if isinstance(parallel, (str, os.PathLike)):
            parallel = load_plan(parallel)
        elif dataclasses.is_dataclass(parallel):
            parallel = OmegaConf.structured(parallel)
        with _info_on_rank_zero():  # NOTE: every rank reads a replayed file; rank 0 alone says so
            parallel = typed_parallel(parallel)
        self.rank, self.world = world_of()
        if not is_auto(parallel.ep_size):  # before any detection; auto is checked once it is a number
            _check_ep_size(parallel, self.world)
        self.model = model
        self.grad_convention = grad_convention
        self.resolved = resolve_once(parallel, model, self.rank, self.world)
        _check_ep_size(self.resolved, self.world)
        ep_size = self.resolved.ep_size
        if mesh is None:
            mesh = make_mesh(self.world, ep_size, torch.device(_device_type()))
        else:
            check_mesh(mesh, ep_size, self.world)
        self.mesh = mesh
        if self.rank == 0:
            log.info("autoep plan (parallel.ep_size=%d, world size %d):\n%s", ep_size, self.world,
                     format_table(plan_rows(model, self.resolved)))
        apply_plan(model, self.resolved, mesh, allowed_targets=allowed_targets)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        if self.run_dir is not None:
            write_plan(self.resolved, self.run_dir)  # rank 0 only; every rank gets the path
        self.prepare_ddp(model)
        self._unfinished = False  # a backward wrote gradients that finish_gradients has not finished yet
        # "A backward happened": a backward through any planned block's output (whichever parameter objects the
        # model holds by then: an adapter added after apply, load_state_dict(assign=True)), or a gradient
        # accumulated into any trainable parameter the handle watches (``_watch``; a backward missing the blocks).
        self._param_ids: set[int] = set()
        self._watch()
        for entry in self.resolved.plan:
            for name in entry.decision.modules:
                model.get_submodule(name).register_forward_hook(_BackwardSignal(self))
        # Every optimizer holding this model's parameters is guarded, attached or not: a step on unfinished
        # gradients is an error, never a silently wrong update (torch's global optimizer step pre-hook; a step
        # given a closure runs its backward after the hook and is not judged here).
        guard = register_optimizer_step_pre_hook(_step_guard(weakref.ref(self)))
        weakref.finalize(self, guard.remove)

    # -- parameters ------------------------------------------------------------------------------------------
    def expert_parameters(self) -> list[nn.Parameter]:
        """Trainable expert parameters (``Shard(0)`` DTensors over ``ep``): each rank holds its own experts."""
        return grads.split_params(self.model)[1]

    def dense_parameters(self) -> list[nn.Parameter]:
        """Every other trainable parameter (replicated over the world)."""
        return grads.split_params(self.model)[0]

    def param_groups(self, **optim_kwargs) -> list[dict]:
        """``[dense group, expert group]`` for any ``torch.optim`` optimizer, each with ``optim_kwargs``."""
        dense, expert = grads.split_params(self.model)
        return [{"params": dense, **optim_kwargs}, {"params": expert, **optim_kwargs}]

    def prepare_ddp(self, module: nn.Module | None = None) -> None:
        """Make ``DistributedDataParallel(module)`` wrap the dense parameters only (``module``: the model, done at
        construction, or a module holding it, e.g. a LightningModule). The one place autoep sets torch's
        DDP ignore list: expert parameters are reduced by ``finish_gradients`` over ``edp``, never by DDP."""
        module = self.model if module is None else module
        experts = {id(p) for p in self.expert_parameters()}
        # ModuleList experts: this rank's own and the other ranks' meta stand-ins (DDP would broadcast them).
        tensors = dict(self.model.named_parameters(remove_duplicate=False)) | dict(self.model.named_buffers())
        experts |= {id(tensors[n]) for n in expert_owners(self.model) if n in tensors}
        named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        names = [n for n, p in named if id(p) in experts]
        setattr(module, DDP_IGNORE, sorted(set(getattr(module, DDP_IGNORE, ())) | set(names)))

    # -- gradients -------------------------------------------------------------------------------------------
    def _on_grad(self, param) -> None:
        self._unfinished = True

    def _watch(self, params: list[nn.Parameter] | None = None) -> None:
        """Hook every trainable parameter the model holds now (``params``: ``split_params``'s two lists joined, when
        the caller has them; new objects included) and note which they are."""
        if params is None:
            params = [p for group in grads.split_params(self.model) for p in group]
        for p in params:
            hooks = p._post_accumulate_grad_hooks or {}
            if not any(getattr(h, "__func__", None) is ExpertParallel._on_grad and h.__self__ is self
                       for h in hooks.values()):
                p.register_post_accumulate_grad_hook(self._on_grad)
        self._param_ids = {id(p) for p in params}

    def finish_gradients(self, *, dense_synced: bool = True) -> None:
        """After backward (all micro-batches), before clipping and the optimizer step; a collective.

        Expert grads are summed over ``edp`` and, for ``grad_convention="mean"``, divided by the world size; dense
        grads are left as DDP/FSDP made them (``dense_synced=True``) or summed over the world (and divided for
        ``"mean"``) when nothing synced them (``dense_synced=False``, a loop without DDP). With ``dense_synced=True``
        a checksum checks that the ranks' dense gradients agree (one two-scalar all-reduce): a model nobody
        wrapped in DDP is an error, not a silent divergence of the replicas."""
        if not self._unfinished:
            raise GradientsNotFinished("finish_gradients() called with no backward since the last call: expert "
                                       "gradients would be reduced and scaled twice; call it once per optimizer step, "
                                       "after the last backward")
        dense, expert = grads.split_params(self.model)
        edp = self.mesh["edp"].get_group() if self.mesh is not None and self.mesh.ndim > 1 else None
        world = dist.group.WORLD if self.world > 1 else None
        if dense_synced and not grads.dense_grads_agree(dense, world):
            raise GradientsNotFinished(
                "finish_gradients(dense_synced=True) but the dense gradients differ across ranks, so nothing synced "
                "them (no DistributedDataParallel around the model, or its sync was skipped); wrap the model in DDP, "
                "or call ep.finish_gradients(dense_synced=False) to have autoep average them")
        grads.finish_grads(dense, expert, world_group=world, edp_group=edp, world_size=self.world,
                           convention=self.grad_convention, dense_synced=dense_synced)
        self._unfinished = False
        self._watch(dense + expert)  # parameters added since the last step (an adapter, assign=True) watched from now

    def attach(self, optimizer) -> None:
        """Make ``optimizer.step()`` raise ``GradientsNotFinished`` when a backward since the last
        ``finish_gradients`` left gradients unfinished (a step pre-hook). Every optimizer over the model's
        parameters is guarded already (a global step pre-hook installed at construction); ``attach`` says so
        explicitly and also covers an optimizer whose parameters the handle has not seen."""
        optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: None if _has_closure(args, kwargs) else self._check_finished("optimizer.step()"))

    def _check_finished(self, what: str) -> None:
        if self._unfinished:
            raise GradientsNotFinished(
                f"{what} after a backward whose gradients autoep.ExpertParallel.finish_gradients() did not finish: "
                f"expert gradients are not yet reduced over edp nor scaled to grad_convention="
                f"{self.grad_convention!r}, so the update would be wrong; call ep.finish_gradients() after the last "
                f"backward of the step (the Lightning and HF adapters do it for you)")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient to the global norm over dense and expert parameters (experts counted once each,
        summed over ``ep``); returns the norm before clipping, the same on every rank. A collective; call it
        after ``finish_gradients``."""
        self._check_finished("clip_grad_norm_()")
        dense, expert = grads.split_params(self.model)
        ep = ep_mesh_of(self.mesh).get_group() if self.mesh is not None else None
        return torch.tensor(grads.clip_grad_norm(dense, expert, max_norm, ep, norm_type))

    # -- state -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The model's state with every expert gathered to full shape, under the model's own names, on every
        rank (what a trainer saving one file from rank 0 needs). As with ``nn.Module.state_dict()``, tensors that
        are not experts alias the live parameters. A collective."""
        return state.full_model_state(self.model)

    def load_state_dict(self, state_dict: dict) -> None:
        """The inverse of ``state_dict``: each rank keeps its own slice of every expert. A collective."""
        state.load_full_model_state(self.model, state_dict)

    def optimizer_state_dict(self, optimizer) -> dict:
        """``optimizer``'s state keyed by parameter name, expert moments gathered to full shape. A collective."""
        return state.full_optim_state(self.model, optimizer)

    def load_optimizer_state_dict(self, optimizer, state_dict: dict) -> None:
        state.load_full_optim_state(self.model, optimizer, state_dict)

    def save(self, path, optimizer=None) -> Path:
        """A DCP directory at ``path`` with the model (and ``optimizer``): each rank writes its own experts,
        written under a temporary name and renamed once complete. A collective."""
        return state.save_sharded(path, self.model, optimizer)

    def load(self, path, optimizer=None) -> None:
        """Load a ``save`` directory (another ``ep_size`` reshards). A collective."""
        state.load_sharded(path, self.model, optimizer, key="path",
                           fix="pass a directory written by ExpertParallel.save")

    def export_hf(self, path) -> Path:
        """``path`` gets config.json + model.safetensors with every expert (rank 0 writes; a collective)."""
        return export_hf(self.model, path)


def _has_closure(args, kwargs) -> bool:
    """``step(closure)`` runs the backward itself, after the pre-hooks (Lightning's automatic optimization, LBFGS):
    gradients from an earlier micro-batch are legitimately unfinished there, so the check is left to the trainer
    that calls ``finish_gradients`` inside the closure (the Lightning adapter does)."""
    # NOTE: torch passes the step's own args, the optimizer first (``step(self, closure=None)``).
    positional = [a for a in args if not isinstance(a, torch.optim.Optimizer)]
    return (kwargs.get("closure") if "closure" in kwargs else (positional[0] if positional else None)) is not None


def _step_guard(handle_ref):
    """A global optimizer step pre-hook: an optimizer holding the handle's parameters may not step on unfinished
    gradients. Holds the handle weakly; a set lookup per parameter and step."""
    def guard(optimizer, args, kwargs):
        ep = handle_ref()
        if ep is None or not ep._unfinished or _has_closure(args, kwargs):
            return
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if ids.isdisjoint(ep._param_ids):
            ep._watch()  # parameters the model gained since the last step (an adapter, assign=True)?
            if ids.isdisjoint(ep._param_ids):
                return
        ep._check_finished("optimizer.step()")
    return guard


class _BackwardSignal:
    """A forward hook on each planned block: a backward reaching the block's output marks the handle's gradients
    unfinished. Holds the handle weakly; a copy of the block (``deepcopy``, ``pickle``: an EMA model) gets a
    disarmed one, so only the handle's own model reports to it."""

    def __init__(self, handle: ExpertParallel | None = None):
        self.handle = None if handle is None else weakref.ref(handle)

    def __call__(self, module, args, output) -> None:
        if self.handle is None or not torch.is_grad_enabled():
            return
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._mark)

    def _mark(self, grad) -> None:
        ep = self.handle()
        if ep is not None:
            ep._unfinished = True

    def __deepcopy__(self, memo) -> _BackwardSignal:
        return _BackwardSignal()

    def __reduce__(self):
        return (_BackwardSignal, ())


def _check_ep_size(parallel: DictConfig, world: int) -> None:
    """``parallel.ep_size`` (a number) fits the process group and shards something."""
    ep_size = parallel.ep_size
    check_distributed(ep_size)
    check_world(ep_size, world)
    if ep_size > 1 and not parallel.plan:
        raise PlanError(f"parallel.ep_size={ep_size} but parallel.plan is empty, so no module would be sharded "
                        f"and every rank would hold every expert; add an entry (e.g. parallel.plan=[{{match: "
                        f"'model.layers.*.mlp', local_compute_fn: auto}}]) or set parallel.ep_size=1")


def resolve_once(parallel: DictConfig, model: nn.Module, rank: int, world: int) -> DictConfig:
    """Rank 0 resolves (detection runs once per run), the decision is broadcast, and every other rank replays it
    on its own model (fingerprints re-checked, nothing detected). Every rank learns whether every rank succeeded
    before anyone raises, so a refusal on one rank is an error on all of them instead of a hang."""
    if world == 1:
        return resolve_plan(parallel, model, world_size=1)
    resolved, error = None, None
    if rank == 0:
        try:
            resolved = resolve_plan(parallel, model, world_size=world)  # ep_size auto: decided here, once
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others heard of it
            error = e
    decided = [OmegaConf.to_container(resolved) if resolved is not None else None]
    dist.broadcast_object_list(decided, src=0)  # NOTE: collective; one small pickle from rank 0
    if rank != 0 and decided[0] is not None:
        try:
            resolved = resolve_plan(decided[0], model)
        except Exception as e:  # noqa: BLE001 - re-raised below
            error = e
    mine = (f"{type(error).__name__}: {error}" if error is not None else None,
            None if resolved is None else plan_hash(resolved))
    outcomes: list = [None] * world
    dist.all_gather_object(outcomes, mine)  # NOTE: collective; every rank's outcome and plan hash
    if error is not None:
        raise error
    failed = {r: msg for r, (msg, _) in enumerate(outcomes) if msg is not None}
    if failed:
        r, msg = next(iter(failed.items()))
        what = "resolve the plan" if r == 0 else "replay rank 0's plan"
        raise PlanError(f"rank {r} could not {what}: {msg}")
    if len({h for _, h in outcomes}) > 1:
        raise PlanError("ranks hold different resolved plans; every rank must build the same model from the same "
                        "config: resolve once and give every rank the same resolved.yaml")
    return resolved


@contextlib.contextmanager
def _info_on_rank_zero():
    """autoep's info lines inside are logged by rank 0 only (every rank does the same work, so they would print
    once per rank in a host whose logging shows every rank); warnings and errors still show on every rank."""
    logger = logging.getLogger("autoep")
    quiet = dist.is_available() and dist.is_initialized() and dist.get_rank() != 0
    level = logger.level
    if quiet and logger.getEffectiveLevel() < logging.WARNING:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _device_type() -> str:
    return "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
