"""After apply it is still the user's model: torch's own entry points over the applied model either behave as on
the model or raise ``AfterApplyError`` before they change anything (issue 20).

``apply_plan`` calls ``track(model, replaced)`` after the recipes ran; the first call installs, once per process:

- an optimizer step pre-hook (torch's global ``register_optimizer_step_pre_hook``): an optimizer built BEFORE apply
  holds the parameter objects apply replaced (batched experts became new ``nn.Parameter(DTensor)`` shards, other
  ranks' module experts ``meta`` stand-ins); they get no gradient any more, so its step would silently leave
  the experts untrained. Those objects are remembered weakly (id -> name, dropped when they die), so a step
  costs one emptiness test once nothing holds them, and one dict lookup per parameter while something does;
- torch's clipping: ``clip_grad_norm_`` (every spelling: the norm goes through ``clip_grad._get_total_norm``)
  over expert gradients is refused: each rank holds only its own experts, so the norm needs a collective over
  ``ep`` that torch's function does not make (and a rank may call it alone, e.g. to log a norm, where a
  collective would hang); ``ep.clip_grad_norm_`` / ``autoep.runtime.grads.clip_grad_norm`` make it.
  ``clip_grad_value_`` is elementwise, so exact on each rank's shards: it only must not hand DTensor and plain
  gradients to one ``torch._foreach_*`` call (which fails), so such lists take torch's own per-tensor loop;
- random draws on sharded expert parameters (``reinit.install_exact_draws``): an init outside ``model.apply``
  (``nn.init.normal_`` over ``model.parameters()``, transformers' ``init_weights()``) draws each expert parameter
  whole, as the model does, and keeps this rank's slot (DTensor alone draws the shard's size).

``keep_hooks_through_moves(block)``: torch's ``Module._apply`` (``.to``, ``.cuda``, ``.half``, ...) swaps a
tensor-subclass parameter's payload (``torch.utils.swap_tensors``; every DTensor expert shard), and the hooks
registered on the parameter (``register_hook``, ``register_post_accumulate_grad_hook``) stay with the old
payload: they, and every hook registered later, never fire again. The module holding such parameters gets an
instance ``_apply`` that re-attaches them to the new payload, as they stay attached on a plain parameter.
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grad
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autoep.errors import AfterApplyError
from autoep.runtime.dense import is_expert
from autoep.runtime.reinit import install_exact_draws

_REPLACED: dict[int, str] = {}  # id -> name of each live parameter object apply_plan replaced
_APPLIED: weakref.WeakSet = weakref.WeakSet()  # every live model apply_plan made EP-ready (names for messages)
_INSTALLED: list = []  # the global hook's handle, once installed


def track(model: nn.Module, replaced: dict[int, tuple[str, Tensor]]) -> None:
    """Remember ``model`` and the parameter objects apply replaced in it (``{id: (name, old parameter)}``)."""
    _install()
    _APPLIED.add(model)
    for key, (name, param) in replaced.items():
        _REPLACED[key] = name
        weakref.finalize(param, _REPLACED.pop, key, None)


def replaced_parameters() -> dict[int, str]:
    """The live replaced parameter objects (id -> name); empty once nothing holds them."""
    return dict(_REPLACED)


def _install() -> None:
    if _INSTALLED:
        return
    _INSTALLED.append(register_optimizer_step_pre_hook(_refuse_replaced))
    install_exact_draws(is_expert)  # random init of a sharded expert parameter draws as on the model
    # NOTE: torch-private names (as in torch 2.13); where a torch lacks them nothing is wrapped, and
    # tests/integrations/test_after_apply.py's clipping cases fail, so an upgrade cannot drop the guard silently.
    original_norm = getattr(clip_grad, "_get_total_norm", None)
    original_foreach = getattr(clip_grad, "_has_foreach_support", None)
    if original_norm is None or original_foreach is None:
        return

    @functools.wraps(original_norm)
    def _get_total_norm(tensors, *args, **kwargs):
        tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
        _refuse_expert_norm(tensors)
        return original_norm(tensors, *args, **kwargs)

    @functools.wraps(original_foreach)
    def _has_foreach_support(tensors, device):
        # NOTE: a list mixing DTensors (of one mesh or several) with other tensors takes the per-tensor loop:
        # the same elementwise result, and ``torch._foreach_*`` refuses the mix.
        kinds = {t.device_mesh if isinstance(t, DTensor) else None for t in tensors if t is not None}
        return len(kinds) <= 1 and original_foreach(tensors, device)

    # NOTE: process-wide, once: clip_grad_norm_ looks both names up in its module at each call, so the wrappers
    # see every spelling (``from torch.nn.utils import clip_grad_norm_`` bound before apply included).
    clip_grad._get_total_norm = _get_total_norm
    clip_grad._has_foreach_support = _has_foreach_support
    torch.nn.utils.get_total_norm = _get_total_norm


def _refuse_replaced(optimizer, args, kwargs) -> None:
    if not _REPLACED:
        return  # the common case: nothing apply replaced is alive
    stale = [_REPLACED[id(p)] for group in optimizer.param_groups for p in group["params"] if id(p) in _REPLACED]
    if stale:
        raise AfterApplyError(
            f"{type(optimizer).__name__}.step() over {len(stale)} parameter(s) that apply_plan replaced "
            f"({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}): this optimizer was built before "
            f"apply_plan / ExpertParallel and holds the model's old expert tensors, which get no gradient any more "
            f"(the experts would never train). Build the optimizer after apply: torch.optim."
            f"{type(optimizer).__name__}(ep.param_groups(...)) with the handle, or over model.parameters()")


def _refuse_expert_norm(grads: list[Tensor]) -> None:
    experts = [g for g in grads if is_expert(g)]
    if not experts and _APPLIED:
        local = _local_expert_grads()
        experts = [g for g in grads if id(g) in local]
    if experts:
        names = _grad_names()
        shown = ", ".join(names.get(id(g), "an expert shard") for g in experts[:3])
        raise AfterApplyError(
            f"torch.nn.utils.clip_grad_norm_ over {len(experts)} expert-parallel gradient(s) ({shown}"
            f"{', ...' if len(experts) > 3 else ''}): each rank holds only its own experts, so torch's norm would "
            f"be this rank's local norm (or fail on DTensor and plain gradients mixed); the global norm needs a "
            f"collective over the ep ranks that torch's function does not make. Clip with ep.clip_grad_norm_"
            f"(max_norm) (autoep.ExpertParallel; the Lightning and HF adapters do it for gradient_clip_val / "
            f"max_grad_norm), or autoep.runtime.grads.clip_grad_norm(dense, expert, max_norm, ep_group) after "
            f"apply_plan. clip_grad_value_ is exact as it is")


def _local_expert_grads() -> set[int]:
    """ids of the gradients of module experts (plain tensors) whose block is split over more than one ep rank."""
    from autoep.runtime.recipes.local_experts import placed_experts, spec_of

    found = set()
    for model in list(_APPLIED):
        for block in model.modules():
            spec = spec_of(block)
            if spec is not None and spec.ep_size > 1:
                for expert in placed_experts(block, spec)[spec.first: spec.first + spec.num_local]:
                    found |= {id(p.grad) for p in expert.parameters() if p.grad is not None}
    return found


def _grad_names() -> dict[int, str]:
    return {id(p.grad): name for model in list(_APPLIED) for name, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------------------------
# Hooks through module conversions
# ---------------------------------------------------------------------------------------------


def keep_hooks_through_moves(block: nn.Module) -> None:
    """Every module under ``block`` holding a DTensor parameter directly keeps its parameters' hooks through
    ``_apply`` (module docstring). Idempotent."""
    for m in block.modules():
        if isinstance(m.__dict__.get("_apply"), _HooksKeptApply):
            continue
        if any(isinstance(p, DTensor) for p in m._parameters.values()):
            m._apply = _HooksKeptApply(m)


class _HooksKeptApply:
    """``module._apply`` that re-attaches each parameter's hook dicts to its payload after torch's own ``_apply``
    (setting the attribute registers the dict with the tensor's current payload; idempotent where nothing was
    swapped). A plain object, so ``deepcopy`` and ``pickle`` of the module take it along, bound to the copy."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, fn, recurse: bool = True):
        m = self.module
        type(m)._apply(m, fn, recurse)
        for p in m._parameters.values():
            if p is None:
                continue
            if p._backward_hooks:
                p._backward_hooks = p._backward_hooks
            if p._post_accumulate_grad_hooks:
                p._post_accumulate_grad_hooks = p._post_accumulate_grad_hooks
        return m
