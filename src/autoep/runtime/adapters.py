"""PEFT's LoRA on the experts' parameters under expert parallelism (``LoraConfig(target_parameters=[...])``):
each expert's delta is applied on the rank that owns the expert, with that expert's rows of the adapter.

What the wrappers compute is in ``autoep.detect.adapters`` (read from PEFT's code): the experts' forward with each
targeted parameter ``W`` replaced by PEFT's parametrization of it, ``W + delta``, per expert along dim 0. Under
EP each rank holds ``W`` as a ``Shard(0)`` DTensor (whole experts ``first .. first + L``), while the adapter's
``lora_A``/``lora_B`` are plain tensors sized from ``W``'s global shape (PEFT reads ``param.shape``, the global
one). ``local_weight`` gives the experts' forward this rank's rows of ``W + delta``: PEFT's own proxy, built on
the rows ``first .. first + L`` of its operands, applied to the local shard. Each rank's adapter gradient is then
the contribution of the rows its experts computed (zeros on the other experts' rows); summed over the ranks it
is the model's. The adapter's parameters are dense (replicated) parameters, reduced as dense gradients are
(``finish_gradients``, DDP): exact, in either order of ``get_peft_model`` and ``apply_plan``/``ExpertParallel``
(``apply_plan`` and ``resolve_plan`` read the experts under a chain: ``autoep.detect.adapters.peeled``).

torch's ``register_parametrization`` (in the wrapper's forward) evaluates the parametrization once, on the
DTensor, to check its shape and dtype; a plain operand would make DTensor raise there, so the outermost wrapper
of a chain around EP experts runs under DTensor's implicit replication (``_adapted_forward``). That value is never
used: ``local_weight`` never reads the parametrized attribute. PEFT's ``merge`` and ``unmerge``
(``merge_and_unload``) add the whole delta to the parameter's data: under implicit replication each rank adds its
experts' rows, which is exact. The chain is adapted where the EP experts sit as soon as PEFT sets it there (a
module-registration hook: ``merge_and_unload()`` right after ``get_peft_model`` on an applied model merges on the
shards), at ``apply_plan`` where it was there before, and at the block's call otherwise (``follow``, ``adopt``);
each adapted method checks the chain's code first, again whenever a wrapper's class changed.

Refused (``LiveStateError`` at the block's call, before any exchange): any other parametrization of a sharded
expert parameter (``weight_norm``, one of the user's), a PEFT version whose code changed, and a PEFT wrapper
that the replaced experts forward would not call: ``target_parameters`` on a submodule of the experts (DBRX's
``experts.mlp.w1``, whose own forward cannot run under it either: PEFT's wrapper does not pass ``mlp.v1`` on).
Its ``merge_and_unload()`` is exact (each rank adds its rows of the 2-D delta). A PEFT ``merge`` whose code is not
the code read raises ``LiveStateError`` instead of merging.
"""
from __future__ import annotations

import contextlib

from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.modules.module import register_module_module_registration_hook

from autoep.detect import adapters
from autoep.detect.source import Refusal
from autoep.errors import LiveStateError
from autoep.runtime.shared import InstanceMethod

_PATH = "_autoep_adapter_path"  # on a block: where its EP experts are (``follow``)
_SLOT = "_autoep_adapter_slot"  # on the EP experts' parent: the name they are set under (``follow``)
_CHECKED = "_autoep_checked_chain"  # on a wrapper: the classes of its chain when it was last checked
_WHERE = "_autoep_adapter_where"  # on a wrapper: how errors name it
_REGISTRATIONS = []  # the one process-wide module-registration hook (``_watch_registrations``)


def follow(block: nn.Module, path: str) -> None:
    """Before each call of ``block``, and as soon as a PEFT chain is set around its EP experts at ``path`` or
    around a submodule of them (``_registered``): the chain's code checked, its forward, ``merge`` and ``unmerge``
    run with the shape check of its parametrizations allowed on the shards (module docstring). Idempotent."""
    if getattr(block, _PATH, None) is None:
        setattr(block, _PATH, path)
        block.register_forward_pre_hook(_follow_hook, prepend=True)
        parent_path, _, name = path.rpartition(".")
        setattr(block.get_submodule(parent_path) if parent_path else block, _SLOT, name)
        _watch_registrations()


def _watch_registrations() -> None:
    if not _REGISTRATIONS:
        # NOTE: process-wide (torch has no per-module registration hook): ``_registered`` looks at two instance
        # attributes of the parent and returns; PEFT sets its wrappers with setattr, which runs it.
        _REGISTRATIONS.append(register_module_module_registration_hook(_registered))


def _registered(parent: nn.Module, name: str, module) -> None:
    """``parent.name = module`` where ``follow`` marked the EP experts' slot, or on the EP experts themselves
    (DBRX's ``experts.mlp``): a PEFT chain set there is adapted at once, so ``merge_and_unload()`` before any
    forward merges on the shards (its code is checked when a method of it first runs)."""
    vars_ = parent.__dict__
    if (vars_.get(_SLOT) != name and vars_.get("_autoep_ep") is None) or not adapters.is_param_wrapper(module):
        return None
    where = f"{type(parent).__name__}.{name}"
    chain, _ = adapters.wrapper_chain(module)
    _install(chain, where, forward=vars_.get(_SLOT) == name)
    return None


def _follow_hook(block: nn.Module, args) -> None:
    adopt(block)


def adopt_all(model: nn.Module) -> None:
    """``adopt`` every block of ``model`` a recipe made ``follow`` its experts (``apply_plan``, after the chains
    went back in place: ``merge_and_unload`` before any forward works too)."""
    for block in model.modules():
        if getattr(block, _PATH, None) is not None:
            adopt(block)


def adopt(block: nn.Module) -> None:
    """Where a PEFT chain is around ``block``'s EP experts (``follow``'s path): check its code is the code read
    (``LiveStateError`` otherwise) and run its forward, and each wrapper's ``merge``/``unmerge``, under implicit
    replication (module docstring). A PEFT wrapper inside the EP experts raises ``LiveStateError``: their replaced
    forward would not call it. Nothing where no chain is there."""
    path = getattr(block, _PATH, None)
    top = block.get_submodule(path) if path is not None else None
    chain, base = adapters.wrapper_chain(top)
    if getattr(base, "_autoep_ep", None) is None:
        return  # not the experts a recipe bound (the block runs whatever is there, as before)
    where = f"{type(block).__name__}.{path}"
    for inner, module in base.named_modules():
        if inner and adapters.is_param_wrapper(module):
            raise inner_wrapper_error(base, f"{where}.{inner}", module)
    if chain and not _adapted(top):
        _install(chain, where, forward=True)
        _check(top)


def inner_wrapper_error(experts: nn.Module, where: str, wrapper: nn.Module) -> LiveStateError:
    """The refusal of a PEFT wrapper around a submodule of EP experts (``target_parameters`` on DBRX's
    ``experts.mlp.w1``): the experts' replaced forward computes with their weights itself and never calls it."""
    return LiveStateError(
        f"{where} is wrapped by PEFT's {type(wrapper).__name__} (LoraConfig(target_parameters=[..."
        f"{where.split('.', 1)[-1]}.{getattr(wrapper, 'parameter_name', '?')}])), inside the expert-parallel "
        f"{type(experts).__name__}, whose replaced forward computes with their weights itself and would not call "
        f"it: the adapter would be left out. PEFT's LoRA is supported on parameters of the experts module itself "
        f"(e.g. experts.gate_up_proj), and merge_and_unload() of this one is exact; else leave it out of "
        f"target_parameters, or this block out of parallel.plan")


def _install(chain: list[nn.Module], where: str, forward: bool) -> None:
    """The outermost wrapper's forward (``forward``) and every wrapper's ``merge``/``unmerge`` under implicit
    replication, each checking its chain's code first (``_check``)."""
    for wrapper in chain:
        wrapper.__dict__[_WHERE] = where
        # PEFT's merge adds the whole delta to the parameter (``param.data += delta``): replicated onto the shard,
        # each rank adds its experts' rows (merge_and_unload leaves the EP experts merged).
        wrapper.merge = InstanceMethod(wrapper, _adapted_merge)
        wrapper.unmerge = InstanceMethod(wrapper, _adapted_unmerge)
    if forward:
        chain[0].forward = InstanceMethod(chain[0], _adapted_forward)


def _adapted(wrapper: nn.Module) -> bool:
    own = vars(wrapper).get("forward")
    return isinstance(own, InstanceMethod) and own.fn is _adapted_forward and _checked(wrapper)


def _checked(wrapper: nn.Module) -> bool:
    return wrapper.__dict__.get(_CHECKED) == tuple(map(type, adapters.wrapper_chain(wrapper)[0]))


def _check(wrapper: nn.Module) -> None:
    """``LiveStateError`` unless every wrapper of the chain from ``wrapper`` in runs PEFT's code read here
    (``adapters.check_wrapper``); remembered per chain of classes (a class swapped later is checked again)."""
    if _checked(wrapper):
        return
    chain, _ = adapters.wrapper_chain(wrapper)
    try:
        for each in chain:
            adapters.check_wrapper(each, each.__dict__.get(_WHERE, type(each).__name__))
    except Refusal as exc:
        raise LiveStateError(f"{exc}; the expert-parallel experts under it would compute something autoep has not "
                             f"read") from None
    wrapper.__dict__[_CHECKED] = tuple(map(type, chain))


def _adapted_forward(wrapper: nn.Module, *args, **kwargs):
    """The wrapper's own forward, with DTensor's implicit replication on (module docstring)."""
    _check(wrapper)
    with _implicit_replication():
        return type(wrapper).forward(wrapper, *args, **kwargs)


def _adapted_merge(wrapper: nn.Module, *args, **kwargs):
    _check(wrapper)
    with _implicit_replication():
        return type(wrapper).merge(wrapper, *args, **kwargs)


def _adapted_unmerge(wrapper: nn.Module, *args, **kwargs):
    _check(wrapper)
    with _implicit_replication():
        return type(wrapper).unmerge(wrapper, *args, **kwargs)


for _fn in (_adapted_forward, _adapted_merge, _adapted_unmerge):
    _fn._autoep_adapted = True  # the instance methods ``adapters.check_wrapper`` accepts


@contextlib.contextmanager
def _implicit_replication():
    # NOTE: torch's ``implicit_replication()`` sets the flag and resets it to False on leaving (not to what it was):
    # a user's own ``with implicit_replication():`` around the model would end at the first block. Saved and
    # restored here instead (a private attribute of torch 2.13's DTensor dispatcher).
    dispatcher = DTensor._op_dispatcher
    before = dispatcher._allow_implicit_replication
    dispatcher._allow_implicit_replication = True
    try:
        yield
    finally:
        dispatcher._allow_implicit_replication = before


def check_parametrizations(experts: nn.Module) -> None:
    """Raise ``LiveStateError`` where a parametrization on the experts' parameters is not PEFT's LoRA known here
    (checked before any parameter is read: reading one runs the parametrization on this rank's shard)."""
    chains = experts._modules.get("parametrizations")
    if chains is None:
        return
    for name, chain in chains.items():
        if isinstance(chain.original, DTensor) and not all(adapters.known_proxy(p) for p in chain):
            raise LiveStateError(
                f"{type(experts).__name__}: [{name!r}] got a parametrization after apply_plan "
                f"({', '.join(type(p).__name__ for p in chain)}: weight_norm, an own one, ...); under expert "
                f"parallelism each rank holds only a Shard(0) slice of these 3-D expert weights, which the "
                f"parametrization's code would mix with full-size tensors. PEFT's LoRA (LoraConfig("
                f"target_parameters=...)) is supported; put other adapters on module experts' Linears, or leave "
                f"this block out of parallel.plan")


def local_weight(experts: nn.Module, path: str) -> Tensor:
    """This rank's rows of the expert parameter at ``path`` under ``experts`` as the experts' forward reads it:
    its local shard (differentiably), with PEFT's LoRA delta of those rows added where a PEFT wrapper's
    parametrization is on (module docstring); the parameter itself where it is not sharded."""
    owner_path, _, name = path.rpartition(".")
    owner = experts.get_submodule(owner_path) if owner_path else experts
    if adapters.is_param_wrapper(owner):  # the experts called without their block (its pre-hook refuses first)
        raise inner_wrapper_error(experts, f"{type(experts).__name__}.{owner_path}", owner)
    chains = owner._modules.get("parametrizations")
    chain = chains[name] if chains is not None and name in chains else None
    if chain is None:
        param = owner._parameters[name]
        return param.to_local() if isinstance(param, DTensor) else param
    original = chain.original
    if not isinstance(original, DTensor):
        return getattr(owner, name)  # whole (no mesh): the parametrization as it is
    first, rows = _local_rows(original, f"{type(experts).__name__}.{path}")
    weight = original.to_local()
    for proxy in chain:
        if not adapters.known_proxy(proxy):
            check_parametrizations(owner)  # raises, naming it
        weight = _on_rows(proxy, first, rows, tuple(original.shape), f"{type(experts).__name__}.{path}")(weight)
    return weight


def parameter(experts: nn.Module, path: str) -> Tensor:
    """The expert parameter at ``path`` under ``experts`` as registered (under a parametrization: its original),
    for its global shape and dtype."""
    owner_path, _, name = path.rpartition(".")
    owner = experts.get_submodule(owner_path) if owner_path else experts
    chains = owner._modules.get("parametrizations")
    return chains[name].original if chains is not None and name in chains else experts.get_parameter(path)


def _local_rows(param: DTensor, where: str) -> tuple[int, int]:
    """(first, count) of the rows of dim 0 this rank holds: only dim 0 is split (``Shard(0)`` over ``ep``)."""
    local, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(local[1:]) != tuple(param.shape[1:]) or any(offset[1:]):
        raise LiveStateError(f"{where}: placements {param.placements} split other dims than the experts' dim 0; "
                             f"PEFT's LoRA delta is applied per expert on its owner")
    return offset[0], local[0]


def _on_rows(proxy: nn.Module, first: int, rows: int, shape: tuple, where: str) -> nn.Module:
    """PEFT's proxy of the same kind on rows ``first .. first + rows`` of its operands: what it computes for those
    rows of ``W`` (each reads only its own rows: ``autoep.detect.adapters``)."""
    end = first + rows
    if hasattr(proxy, "delta_weight"):  # _LoraParameterProxy: W + delta, elementwise
        delta = proxy.delta_weight
        if tuple(delta.shape) != shape:
            raise LiveStateError(f"{where}: PEFT's delta has shape {tuple(delta.shape)}, the parameter {shape}")
        return type(proxy)(delta[first:end])
    lhs, rhs = proxy.lhs, proxy.rhs  # _LoraFactorsProxy: baddbmm(W, lhs, rhs) over dim 0
    if lhs.dim() != 3 or rhs.dim() != 3 or lhs.shape[0] != shape[0] or rhs.shape[0] != shape[0]:
        raise LiveStateError(f"{where}: PEFT's LoRA factors of shapes {tuple(lhs.shape)}, {tuple(rhs.shape)} are "
                             f"not batched over the parameter's {shape[0]} experts")
    return type(proxy)(lhs[first:end], rhs[first:end], proxy.scaling)
