"""Execute a frozen plan: shard each decided block's experts over the ``ep`` mesh dim and bind its recipe.

``apply_plan(model, resolved_parallel_cfg, mesh)`` never re-decides anything: it reads the
``decision`` that ``resolve_plan`` wrote (modules, compute fn) and executes it.

Parameters after ``apply_plan``:
  - expert parameters (every parameter registered directly on ``block.experts``, dim 0 = expert) are
    ``nn.Parameter(DTensor)`` placed ``Shard(0)`` on ``ep`` (``Replicate()`` on ``edp``); each rank
    holds ``num_experts // ep_size`` whole experts; names are unchanged; ``.full_tensor()`` gathers.
    ModuleList/ModuleDict experts hold no direct parameters: their recipe keeps them as the model's own
    modules, this rank's experts as they are and the others' as ``meta`` stand-ins
    (``autoep.runtime.recipes.local_experts``; ``expert_owners(model)`` says which rank owns which key).
  - every other parameter stays a plain tensor (replicated; the trainer's FSDP/DDP owns it), and so do the
    parameters of the experts' own that their proof names dense (``MoeStructure.dense_params``).

Materialising after ``apply_plan`` (the trainer's job): a model built on ``meta`` gets meta DTensor
shards of the local shape. Allocate with ``model.to_empty(device=...)``, then fill each expert
DTensor's local shard from the full checkpoint tensor with
``p.to_local().copy_(full.chunk(ep_size, 0)[ep_rank])`` (or DCP, which understands DTensors, or
``model.load_state_dict(full_state)``, which cuts each expert tensor: ``slice_full_on_load``), and
re-run ``model.init_weights``-style init on plain params only. A model whose weights are already
materialised (tests) is sliced locally here: no communication.

Gradients: expert grads are DTensors over ``ep`` and must be all-reduced over ``edp`` only; dense
grads over the whole world.

After apply it is still the user's model (``autoep.runtime.after_apply``): an optimizer holding a parameter
object apply replaced is refused at its step, torch's ``clip_grad_norm_`` over expert gradients is refused
(``clip_grad_value_`` is exact), and hooks on expert parameters survive ``model.to(...)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autoep.detect import adapters
from autoep.errors import PlanError
from autoep.runtime import adapters as ep_adapters
from autoep.runtime import after_apply, live_state
from autoep.targets import RECIPES, check_not_moved, factory_spec

ALLOWED_PREFIXES = (RECIPES + ".",)
UNSHARDED = "_autoep_unsharded_experts"  # a module's expert parameters left whole (``mark_unsharded``)


def apply_plan(model: nn.Module, resolved_parallel_cfg, mesh, *, allowed_targets: Iterable[str] = ()) -> nn.Module:
    """Make ``model`` EP-ready in place per the frozen plan and return it.

    ``mesh``: a ``DeviceMesh`` with dims ``("edp", "ep")`` or a 1-D mesh named ``"ep"``; ``None`` binds the
    recipes without sharding or exchange (single process). ``allowed_targets``: extra ``_target_``
    prefixes that may be imported besides ``autoep.runtime.recipes.`` (also read from the config's
    ``allowed_targets``). PEFT's LoRA wrappers around batched experts stay where they are; the experts under them
    are sharded and bound (``autoep.detect.adapters``, ``autoep.runtime.adapters``).
    """
    with adapters.peeled(model):
        _apply_plan(model, resolved_parallel_cfg, mesh, allowed_targets)
    ep_adapters.adopt_all(model)  # the chains back in place: their merge too runs on the shards
    return model


def _apply_plan(model: nn.Module, resolved_parallel_cfg, mesh, allowed_targets: Iterable[str]) -> None:
    cfg = _plain(resolved_parallel_cfg)
    allowed = ALLOWED_PREFIXES + tuple(allowed_targets) + tuple(cfg.get("allowed_targets") or ())
    ep_mesh = ep_mesh_of(mesh)
    named = dict(model.named_modules())
    _check_live_state(model, cfg, named)
    before = {id(p): (n, p) for n, p in model.named_parameters(remove_duplicate=False)}
    for i, entry in enumerate(cfg.get("plan") or []):
        decision = entry.get("decision")
        if not decision:
            raise PlanError(f"parallel.plan.{i} has no decision; run resolve_plan on the config before apply_plan")
        name, target, fn_cfg = factory_spec(entry["local_compute_fn"], f"parallel.plan.{i}.local_compute_fn")  # _factory_, or _target_ as older plans wrote
        factory = import_target(target, allowed, key=f"parallel.plan.{i}.local_compute_fn.{name}")
        for name in decision["modules"]:
            if name not in named:
                raise PlanError(f"parallel.plan.{i}.decision.modules names {name!r}, which the model does not have")
            block = named[name]
            paths = live_state.expert_paths_of(fn_cfg)  # one, or each child holding experts' modules
            held = [live_state.before_block(block, name, path) for path in paths]
            shard_experts(block, mesh, name=name, dense=live_state.dense_params_of(fn_cfg))
            factory(block, ep_mesh=ep_mesh, **fn_cfg)
            for path, kept in zip(paths, held):
                live_state.after_block(block, name, kept, path)
            after_apply.keep_hooks_through_moves(block)
    # The parameter objects the recipes replaced (sharded, released): an optimizer still holding one is refused.
    kept = {id(p) for _, p in model.named_parameters(remove_duplicate=False)}
    after_apply.track(model, {k: v for k, v in before.items() if k not in kept})


def _check_live_state(model: nn.Module, cfg: dict, named: dict) -> None:
    """Run-time state of the whole model before anything is replaced (``autoep.runtime.live_state``)."""
    paths = {n: live_state.expert_paths_of(entry.get("local_compute_fn") or {}) for entry in cfg.get("plan") or []
             for n in (entry.get("decision") or {}).get("modules") or [] if n in named}
    live_state.check_model(model, {n: named[n] for n in paths}, paths)


def ep_mesh_of(mesh):
    """The 1-D ``ep`` sub-mesh of ``mesh`` (or ``mesh`` itself when 1-D), ``None`` for no mesh."""
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or ()
    if "ep" not in names:
        raise PlanError(f"mesh dims {names} have no 'ep'; build it with dims ('edp', 'ep') or ('ep',)")
    return mesh if mesh.ndim == 1 else mesh["ep"]


def import_target(target: str, allowed: Iterable[str], *, key: str = "_target_"):
    """Import the callable ``target`` if it starts with an allowed prefix (configs are code to import)."""
    allowed = tuple(allowed)
    check_not_moved(target, key)
    if not any(target.startswith(p) for p in allowed):
        raise PlanError(f"{key}={target!r} is not under an allowed prefix {allowed}; add its prefix to allowed_targets")
    module_name, _, attr = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PlanError(f"{key}={target!r} cannot be imported: {exc}") from exc


def shard_experts(block: nn.Module, mesh, *, name: str = "block", dense: tuple[str, ...] = ()) -> None:
    """Turn every parameter registered directly on ``block.experts`` into a ``Shard(0)`` DTensor over ``ep``,
    except the ``dense`` ones the proof found are the experts' own, not experts' (``MoeStructure.dense_params``)."""
    experts = getattr(block, "experts", None)
    if experts is None:
        return
    if mesh is None:
        mark_unsharded(experts, [pname for pname, _ in experts.named_parameters(recurse=False) if pname not in dense])
        return
    for pname, param in list(experts.named_parameters(recurse=False)):
        if isinstance(param, DTensor) or pname in dense:
            continue  # already sharded (apply_plan run twice on shared modules), or the experts' own dense one
        setattr(experts, pname, shard_expert_tensor(param, mesh, name=f"{name}.experts.{pname}"))
        slice_full_on_load(experts)


def shard_expert_tensor(full: torch.Tensor, mesh, *, name: str = "expert param") -> nn.Parameter:
    """``nn.Parameter(DTensor)`` holding this rank's contiguous slice of ``full`` along dim 0 (experts).

    Slices locally (no communication; every rank must hold the same ``full``). A meta ``full`` gives a
    meta local shard of the right shape, to be filled after ``to_empty`` (see module docstring).
    """
    ep_mesh = ep_mesh_of(mesh)
    ep_size, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    num_experts = full.shape[0]
    if num_experts % ep_size:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise PlanError(f"parallel.ep_size={ep_size} does not divide num_experts={num_experts} of {name}; pick one of {divisors}")
    local = full.detach().chunk(ep_size, dim=0)[ep_rank].clone()
    placements = [Shard(0) if d == "ep" else Replicate() for d in mesh.mesh_dim_names]
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
    return nn.Parameter(dt, requires_grad=full.requires_grad)


def mark_unsharded(module: nn.Module, names) -> None:
    """Record that ``module``'s parameters ``names`` are expert parameters left whole (no mesh: one process).
    ``unsharded_expert_names`` reads them, so optimizer param groups have one layout at every ep size and a
    checkpoint of any ``(edp, ep)`` loads into one process."""
    setattr(module, UNSHARDED, tuple(dict.fromkeys((*getattr(module, UNSHARDED, ()), *names))))


def unsharded_expert_names(model: nn.Module) -> set[str]:
    """Names (as ``model.named_parameters`` gives them) of the expert parameters ``apply_plan`` left whole."""
    return {f"{mname}.{p}" if mname else p for mname, m in model.named_modules()
            for p in getattr(m, UNSHARDED, ()) if m._parameters.get(p) is not None}


def slice_full_on_load(module: nn.Module) -> None:
    """``load_state_dict`` into ``module`` (or a model holding it) takes the model's own single-process
    checkpoint: a plain tensor of an expert DTensor parameter's global shape is cut to this rank's shard
    (locally: every rank holds the full tensor); a DTensor (the EP model's own ``state_dict()``) is loaded as
    it is. With ``assign=True`` the parameter becomes a DTensor of the shard (a copy, not a view of the full
    tensor). Any other shape is left to torch's size check, which names the key and both shapes."""
    if not getattr(module, "_autoep_slices_full", False):
        module._autoep_slices_full = True
        module.register_load_state_dict_pre_hook(_full_to_shard)


def _full_to_shard(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *_) -> None:
    for name, param in module._parameters.items():
        value = state_dict.get(prefix + name)
        if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            continue
        if tuple(value.shape) != tuple(param.shape):
            continue
        local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        local = value.detach()[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))]
        if local_metadata.get("assign_to_params_buffers", False):
            local = local.to(value.device if param.is_meta else param.to_local().device, copy=True)
        else:
            local = local.to(param.to_local().device)
        state_dict[prefix + name] = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                                       shape=param.shape, stride=param.stride())


def _plain(cfg):
    """A mapping (an OmegaConf ``DictConfig`` too: it is one) as plain dicts and lists, read through the
    mapping and sequence protocols: the runtime never imports Hydra or OmegaConf. Plain dicts and lists are
    taken as they are (a factory's kwargs may hold objects the caller keeps)."""
    if isinstance(cfg, (dict, list)):
        return cfg
    if isinstance(cfg, Mapping):
        return {k: _plain(v) for k, v in cfg.items()}
    if isinstance(cfg, Sequence) and not isinstance(cfg, (str, bytes)):
        return [_plain(v) for v in cfg]
    return cfg
