"""Run-time state on everything autoep touches: kept, or refused naming it, never dropped (issue 17).

The model is a live object. Besides its classes' source (which the detector proves), it carries state that
autoep's replacement of the experts could silently drop or bypass:

- on the expert tensors autoep replaces (stacked, sharded into new DTensor parameters): gradient hooks
  (``p.register_hook``), post-accumulate-grad hooks (``register_post_accumulate_grad_hook``: torchtune's
  optimizer-in-backward), tensor-subclass weights (fake-quant for QAT), ``requires_grad``;
- sharing: an expert tensor reachable by two names (tied to the shared expert's, the experts of two blocks,
  one block registered twice, ``autoep.detect.sharing``);
- code of the block that reads the experts outside the proven region, hooks on the block included (a
  pre-hook renorming every expert weight), and cached references to them (``autoep.detect.expert_reads``);
- process-wide patches: ``F.linear``, ``nn.Linear.forward``, activations that are not torch's own
  (``autoep.detect.genuine``), and, at forward time, an active ``TorchFunctionMode`` / dispatch mode or
  global module hooks, which the model's experts honour and autoep's grouped GEMM does not.

``apply_plan`` calls ``check_model`` once, ``before_block``/``after_block`` around each block's recipe; the
exchange calls ``check_fast_path`` each time it runs the local experts' fast path. A recipe that runs the
experts' own modules may instead call ``fast_path_blockers`` and step aside.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from autoep.detect import elementwise, expert_reads, genuine, plain_experts, sharing
from autoep.detect.source import Refusal
from autoep.errors import LiveStateError, UnsupportedModuleStructure

EXPERTS = "experts"  # where the experts are when a plan entry gives no structure (an explicit _target_)


def experts_path_of(fn_cfg: Mapping) -> str:
    """The proven experts path of a plan entry's compute fn kwargs (``structure.experts_path``)."""
    structure = fn_cfg.get("structure") or {}
    return getattr(structure, "experts_path", None) or (structure.get("experts_path") if isinstance(
        structure, Mapping) else None) or EXPERTS


def dense_params_of(fn_cfg: Mapping) -> tuple[str, ...]:
    """The proven dense parameters of the experts of a plan entry (``structure.dense_params``), () for none."""
    structure = fn_cfg.get("structure") or {}
    names = getattr(structure, "dense_params", None) if not isinstance(structure, Mapping) else \
        structure.get("dense_params")
    return tuple(names or ())


# ---------------------------------------------------------------------------------------------
# At apply: the whole model, then each block around its recipe
# ---------------------------------------------------------------------------------------------


def expert_paths_of(fn_cfg: Mapping) -> list[str]:
    """Where a plan entry's experts are: its experts path, or the block's children holding each expert's modules
    where one expert is several (``structure.expert_members``: ``lora_A``, ``lora_B``)."""
    structure = fn_cfg.get("structure") or {}
    members = getattr(structure, "expert_members", None) if not isinstance(structure, Mapping) else \
        structure.get("expert_members")
    if members:
        return list(dict.fromkeys(path.split(".")[0] for expert in members for path in expert))
    return [experts_path_of(fn_cfg)]


def check_model(model: nn.Module, blocks: Mapping[str, nn.Module],
                experts_paths: Mapping[str, str | list[str]] | None = None) -> None:
    """Before anything is replaced: process-wide patches, and expert tensors shared by two names
    (``experts_paths``: each block's experts path, or the paths holding its experts, default ``experts``)."""
    patched = genuine.patched_torch_objects(elementwise.activation_classes())
    if patched:
        first = next(iter(blocks.values()), model)
        raise UnsupportedModuleStructure(type(first).__name__, f"{', '.join(patched)} is not torch's own (patched "
                                         f"process-wide); the model's experts would run the patch and autoep's "
                                         f"grouped GEMM would not. Remove the patch before apply_plan")
    paths, experts_paths = sharing.tensor_paths(model), experts_paths or {}
    held_at = {name: experts_paths.get(name, EXPERTS) for name in blocks}
    shared = [line for name, block in blocks.items()
              for path in ([held_at[name]] if isinstance(held_at[name], str) else held_at[name])
              for line in sharing.shared_expert_tensors(model, {name: block}, path, paths)]
    if shared:
        first = next(iter(blocks.values()))
        raise UnsupportedModuleStructure(type(first).__name__, f"{shared[0]}: {sharing.SHARING_FIX}")


@dataclass
class _Held:
    """An expert tensor of a block before its recipe ran, and what state it carries."""

    name: str
    tensor: torch.Tensor
    state: list[str]


def before_block(block: nn.Module, name: str, experts_path: str = EXPERTS) -> list[_Held]:
    """Refuse what no recipe keeps (subclass weights, reads of the experts by the block's hooks and cached
    references) and remember each expert tensor's state, for ``after_block``."""
    cls = type(block).__name__
    try:
        expert_reads.hook_reads(block, experts_path)
        expert_reads.cached_experts(block, experts_path)
    except Refusal as exc:
        raise UnsupportedModuleStructure(cls, f"{name}: {exc}") from None
    found = plain_experts.resolve(block, experts_path)
    if found is None:
        return []
    experts, prefix = found
    held = []
    for pname, p in experts.named_parameters(remove_duplicate=False):
        where = ".".join(part for part in (name, prefix, pname) if part)
        if type(p) is not nn.Parameter and not _is_dtensor(p):
            raise UnsupportedModuleStructure(cls, f"{where} is a {type(p).__name__} (a tensor subclass weight, e.g. "
                                             f"fake-quant); autoep's grouped GEMM and sharding would not apply it. "
                                             f"Convert the weights to plain tensors, or leave the block out of the plan")
        held.append(_Held(where, p, param_state(p)))
    return held


def after_block(block: nn.Module, name: str, held: list[_Held], experts_path: str = EXPERTS) -> None:
    """Refuse a block whose recipe replaced an expert tensor that carried state (the new parameter would not
    run it): the state is named, never dropped. ``requires_grad`` must come through unchanged."""
    cls = type(block).__name__
    now = {id(p) for p in block.parameters()}
    # ModuleList experts another ep rank owns are meta stand-ins here: their tensors, and hooks on them, live
    # (and run) on the owner, which keeps them as they are.
    from autoep.runtime.recipes.local_experts import remote_names  # recipes import apply, which imports this

    remote = {f"{name}.{n}" for n in remote_names(block)}
    held = [h for h in held if h.name not in remote]
    for h in held:
        if h.state and id(h.tensor) not in now:
            raise UnsupportedModuleStructure(cls, f"{h.name} carries {' and '.join(h.state)}; autoep replaces it by "
                                             f"a new (stacked or sharded) parameter, which would not run them. "
                                             f"Register them after apply_plan, on the parameters it leaves")
    found = plain_experts.resolve(block, experts_path)
    before = {h.tensor.requires_grad for h in held}
    after = {p.requires_grad for n, p in found[0].named_parameters()
             if ".".join(part for part in (name, found[1], n) if part) not in remote} if found is not None else before
    if held and after != before:
        raise UnsupportedModuleStructure(cls, f"{name}.{experts_path}: requires_grad was {sorted(before)} before autoep "
                                         f"replaced the expert parameters and is {sorted(after)} after")


def param_state(p: torch.Tensor) -> list[str]:
    """What run-time state ``p`` carries that a new parameter would not."""
    state = []
    if getattr(p, "_backward_hooks", None):
        state.append(f"{len(p._backward_hooks)} gradient hook(s) (register_hook)")
    if getattr(p, "_post_accumulate_grad_hooks", None):
        state.append(f"{len(p._post_accumulate_grad_hooks)} post-accumulate-grad hook(s) "
                     f"(register_post_accumulate_grad_hook, e.g. an optimizer in backward)")
    return state


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


# ---------------------------------------------------------------------------------------------
# At forward time: the fast path (grouped GEMM on the local experts)
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _benign_modes() -> tuple[type, ...]:
    """torch's modes that change no value: ``with torch.device(...)``, selective activation checkpointing's
    caching modes, the FLOP counter."""
    from torch.utils import _device, checkpoint, flop_counter

    names = ((_device, "DeviceContext"), (checkpoint, "_CachingTorchDispatchMode"),
             (checkpoint, "_CachedTorchDispatchMode"), (flop_counter, "_FlopCounterMode"))
    return tuple(getattr(m, n) for m, n in names if isinstance(getattr(m, n, None), type))


def _activation_classes() -> tuple[type, ...]:
    """The known activation classes, without importing transformers at forward time for a model that has not."""
    return elementwise.activation_classes() if "transformers" in sys.modules else elementwise.TORCH_ACTIVATIONS


def fast_path_blockers() -> list[str]:
    """What would make autoep's fast path compute something else than the model's experts now: patched
    torch objects, active torch-function or dispatch modes (other than torch's value-preserving ones), global
    module hooks. ``[]`` when nothing does."""
    from torch.nn.modules import module as m

    found = [f"{name} is patched" for name in genuine.patched_torch_objects(_activation_classes())]
    if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        benign = _benign_modes()
        for kind, stack in (("TorchFunctionMode", _get_current_function_mode_stack()),
                            ("TorchDispatchMode", _get_current_dispatch_mode_stack())):
            found += [f"a {kind} {type(mode).__qualname__} is active" for mode in stack if type(mode) not in benign]
    hooks = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
             "_global_backward_pre_hooks")
    registered = [h[len('_global_'):].replace('_', ' ') for h in hooks if getattr(m, h, None)]
    if registered:
        # A mode the user entered may have registered them (FlopCounterMode's module tracker): say which.
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        modes = [f"{type(mode).__module__}.{type(mode).__qualname__}"
                 for mode in (*_get_current_function_mode_stack(), *_get_current_dispatch_mode_stack())]
        found.append(f"global module {', '.join(registered)} are registered"
                     + (f" (the active mode {', '.join(modes)} registered them)" if modes else ""))
    return found


def check_fast_path() -> None:
    """Raise ``LiveStateError`` naming what ``fast_path_blockers`` finds."""
    found = fast_path_blockers()
    if found:
        raise LiveStateError(f"autoep's expert fast path cannot run: {'; '.join(found)}. The model's own experts "
                             f"would honour it and the grouped GEMM would not. Remove it around the forward (or "
                             f"leave these blocks out of parallel.plan)")
