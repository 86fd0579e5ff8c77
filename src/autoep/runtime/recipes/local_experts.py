"""Experts held as modules (a ``ModuleList`` or ``ModuleDict`` of expert modules, or modules registered on the
block one by one that a plain dict/list attribute maps expert ids to) under expert parallelism:
which rank owns which expert, what a rank keeps, and how its local experts compute.

After ``apply_plan`` the block keeps its container and every expert module, so parameter names and
``state_dict()`` keys stay the model's own (``experts.{e}.gate_proj.weight``). Ep rank r owns the
contiguous experts ``[r*L, (r+1)*L)`` (L = E // ep_size), as the exchange sends them
(``autoep.runtime.dispatch``):
  - its local experts keep their parameters and buffers AS THE SAME OBJECTS (tensor hooks,
    post-accumulate-grad hooks, optimizer-in-backward and tensor-subclass weights keep working);
  - every other expert's parameters and buffers become ``meta`` stand-ins with ``requires_grad=False``
    (never allocated, never trained here). ``model.to(device)``, ``.cuda()``, ``.to_empty(...)``, ``.bfloat16()``
    keep them on ``meta`` (the expert's ``_apply`` is replaced on the instance) while taking the dtype the
    conversion gives, so a gather still receives the owner's dtype. ``model.apply(fn)`` (and a stand-in module's
    ``reset_parameters()``) allocates a remote expert for the call, so an init draws for it as on the model
    (``autoep.runtime.reinit``); a draw on a stand-in outside it (``nn.init.normal_`` over ``model.parameters()``)
    draws on a temporary of its shape on its home device (``autoep.runtime.stand_in``). Reading one into a tensor
    with values raises naming the expert and its owner (``autoep.runtime.stand_in``); ``model.load_state_dict`` keeps
    them (a single-process checkpoint's tensors for them are skipped, their keys are never missing). What is set
    on one after apply (``experts[3].act_fn = nn.PReLU()``: a module with a parameter of its own) becomes a stand-in
    too before the next exchange (``place_new_tensors``): it lives, computes and trains on the owner.

The ownership query (used by checkpoints, export and trainer integrations)::

    expert_owners(model) -> {state_dict key: ExpertOwner(block, expert, owner, local)}

covers every parameter and persistent buffer of such experts; the keys of ``expert_owners`` whose
``local`` is False are the ones this rank must neither save nor load (``owned_state_dict``), and
``gather_experts`` / ``full_state_dict_of_experts`` bring every expert to every rank (a collective).

Computation after the exchange (``local_expert_fn``): each local expert's own ``forward`` (its module's
``__call__``, hooks included) runs on its rows (the own-forward path). Where the experts are proven
bias-free SwiGLUs, plain ``nn.Linear``\\ s with plain weights and nothing hooked, the grouped-GEMM fast path
runs instead, on the local experts' own parameters: their memory is re-homed once into one stacked buffer
per projection (``p.data = buffer[e]``: the same ``nn.Parameter`` objects, hooks untouched), the grouped GEMM
reads the buffers without a copy, and each parameter gets its gradient as a view of one stacked gradient
through its own ``AccumulateGrad`` (``autoep.runtime.experts.stacked_parameters``). Each forward checks the
parameters still live there (a ``p.data = ...``, ``load_state_dict(assign=True)``, ``to_empty`` or dtype
conversion moves them out) and re-homes them only where nothing but these parameters holds their memory;
otherwise (memory shared with another tensor, shared memory, inference mode) it stacks them per forward
(``torch.stack``, a copy; exact either way).

Shape legend: S rows grouped by local expert, D hidden, F expert intermediate size, L local experts.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.utils.hooks import RemovableHandle

from autoep.detect import elementwise
from autoep.detect.source import Refusal
from autoep.errors import LiveStateError, PlanError, UnsupportedModuleStructure
from autoep.runtime.idle import CALL, Idle
from autoep.runtime.experts import grouped_split_glu, stacked_parameters
from autoep.runtime.reinit import allocated
from autoep.runtime.shared import InstanceMethod, Shared
from autoep.runtime.stand_in import RemoteExpert, RemoteExpertTensor, home_of, stand_in

SPEC = "_autoep_experts"  # the block attribute holding its ``LocalExperts``
GROUP = "_autoep_ep_group"  # the block attribute holding its ep process group
COUNT_HOOKS = "_autoep_count_hooks"  # the block attribute holding ``register_counts_hook``'s hooks
STACKED = "_autoep_stacked"  # the block attribute holding its local experts' stacked weight home (``_Stacked``)

_ACTIVATIONS = {"silu": F.silu, "relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh}
_LINEAR_FORWARD, _F_LINEAR = nn.Linear.forward, F.linear


@dataclass(frozen=True)
class LocalExperts:
    """Where a block's expert modules live across the ep ranks (fixed at apply time; plain values only, so
    a deep copy of the block stays consistent)."""

    path: str  # the experts container inside the block
    keys: tuple[str, ...]  # its keys in expert-id order (computing experts first, then identity experts)
    num_experts: int  # computing experts E (ids [0, E))
    identity_experts: int  # trailing ``nn.Identity`` experts (ids [E, E + this)), computed where the token is
    ep_rank: int
    ep_size: int
    swiglu: tuple[str, str, str] | None = None  # (gate, up, down) where the grouped fast path may run
    act: str = ""  # the SwiGLU's activation: "act_fn" (each expert's own module) or a name in _ACTIVATIONS
    fast_path: bool = True
    # Modules per expert where one expert is several (``MoeStructure.expert_members``): ``keys`` then name every
    # module by its path in the block, expert by expert (``lora_A.0``, ``lora_B.0``, ``lora_A.1``, ...), and each
    # "expert" above is one module: ids [m*e, m*(e+1)) are expert e's, all on its owner (ep_size divides E).
    members: int = 1

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first(self) -> int:
        return self.ep_rank * self.num_local

    def owner(self, expert: int) -> int:
        return expert // self.num_local

    def is_local(self, expert: int) -> bool:
        return self.owner(expert) == self.ep_rank


@dataclass(frozen=True)
class ExpertOwner:
    """One expert tensor's place: its block's name, expert id, the ep rank holding it, and whether that is
    this rank (False: a ``meta`` stand-in here)."""

    block: str
    expert: int
    owner: int
    local: bool


def spec_of(block: nn.Module) -> LocalExperts | None:
    return getattr(block, SPEC, None)


def container_of(block: nn.Module, spec: LocalExperts) -> nn.Module:
    return block.get_submodule(spec.path)


def expert_modules(container: nn.Module) -> list[nn.Module]:
    """A ``ModuleList``'s experts in index order, a ``ModuleDict``'s in insertion order (expert id = position)."""
    if isinstance(container, nn.ModuleDict):
        return list(container.values())
    if isinstance(container, nn.ModuleList):
        return list(container)
    raise TypeError(f"experts container is a {type(container).__name__}, not a ModuleList or ModuleDict")


def placed_experts(block: nn.Module, spec: LocalExperts) -> list[nn.Module]:
    """The block's expert modules in expert-id order (identity experts after the computing ones): its container's
    entries, or, where the block itself holds them (``spec.path`` "", experts registered on it one by one and
    mapped by a plain dict/list attribute: ``autoep.detect.plain_experts``), its children named by ``spec.keys``."""
    return _entries(container_of(block, spec), spec)


def _entries(container: nn.Module, spec: LocalExperts) -> list[nn.Module]:
    if isinstance(container, (nn.ModuleList, nn.ModuleDict)):
        return expert_modules(container)
    return [container.get_submodule(k) for k in spec.keys]  # a child, or a path (``lora_A.0``: ``spec.members``)


def container_keys(container: nn.Module) -> tuple[str, ...]:
    return tuple(container.keys()) if isinstance(container, nn.ModuleDict) else tuple(map(str, range(len(container))))


# ---------------------------------------------------------------------------------------------
# Apply time: keep the local experts, release the others
# ---------------------------------------------------------------------------------------------


def place_experts(block: nn.Module, *, path: str, num_experts: int, identity_experts: int, ep_mesh,
                  swiglu: tuple[str, str, str] | None, act: str, fast_path: bool, name: str,
                  keys: tuple[str, ...] | None = None, members: int = 1) -> LocalExperts:
    """Record where ``block``'s experts live (``block._autoep_experts``) and release the ones another ep rank owns.
    ``keys``: the block's own children that are its experts, in expert-id order, where ``path`` is "" and the
    block is no container (experts registered on the block one by one; default: the container's keys), or the
    paths of its modules where one expert is ``members`` modules (``num_experts`` counts modules then).

    ``PlanError`` where ep_size does not divide the computing experts; ``UnsupportedModuleStructure`` where
    an expert's tensor is shared with another expert or with the rest of the block (releasing it would
    drop it there too)."""
    ep_size = 1 if ep_mesh is None else ep_mesh.size()
    ep_rank = 0 if ep_mesh is None else ep_mesh.get_local_rank()
    experts = num_experts // members
    if experts % ep_size:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        raise PlanError(f"parallel.ep_size={ep_size} does not divide num_experts={experts} of {name}; pick one "
                        f"of {divisors}")
    container = block.get_submodule(path)
    spec = LocalExperts(path=path, keys=container_keys(container) if keys is None else keys, num_experts=num_experts,
                        identity_experts=identity_experts, ep_rank=ep_rank, ep_size=ep_size, swiglu=swiglu, act=act,
                        fast_path=fast_path, members=members)
    _check_unshared(block, spec, name)
    setattr(block, SPEC, spec)
    setattr(block, GROUP, Shared(None if ep_mesh is None else ep_mesh.get_group()))
    setattr(block, STACKED, _Stacked())
    _release(block, spec)
    # ``model.apply(fn)`` recurses through ``container.apply``: remote experts drawn as on the model (reinit).
    container.apply = functools.partial(_experts_apply, container, spec)
    block.register_load_state_dict_pre_hook(_keep_stand_ins)
    return spec


def _keep_stand_ins(block: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    """``load_state_dict`` skips the experts another rank owns: their entries (a single-process checkpoint's
    tensors, another rank's) are replaced by this rank's stand-ins, and absent ones are not reported missing
    (``assign=True`` keeps the stand-ins). Within ``remote_experts_hidden`` they have no entries at all."""
    spec = spec_of(block)
    experts = placed_experts(block, spec)
    for e in range(spec.num_experts):
        if not spec.is_local(e):
            base = prefix + _join(spec.path, spec.keys[e])
            state_dict.update((f"{base}.{k}", t) for k, t in experts[e].state_dict(keep_vars=True).items())


def _check_unshared(block: nn.Module, spec: LocalExperts, name: str) -> None:
    experts = placed_experts(block, spec)
    seen: dict[int, str] = {}
    for e, expert in enumerate(experts):
        for t in (*expert.parameters(), *expert.buffers()):
            if id(t) in seen and seen[id(t)] != str(e):
                raise UnsupportedModuleStructure(type(block).__name__, f"{name}: experts {seen[id(t)]} and {e} share "
                                                 f"a tensor; EP keeps each expert on one rank")
            seen[id(t)] = str(e)
    if isinstance(container_of(block, spec), (nn.ModuleList, nn.ModuleDict)):
        if not spec.path:
            return  # the block is the container (its own forward was replaced): every child is inside it
        roots = [spec.path]
    else:  # experts registered on the block itself: everything else on it is outside them
        roots = list(spec.keys)
    inside = {id(m) for expert in experts for m in expert.modules()}
    for mname, m in block.named_modules(remove_duplicate=False):
        if any(mname == root or mname.startswith(f"{root}.") for root in roots):
            continue
        shared = id(m) in inside or any(id(t) in seen for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
        if shared:
            raise UnsupportedModuleStructure(type(block).__name__, f"{name}: {mname or 'the block'} "
                                             f"({type(m).__name__}) shares an expert's module or tensor outside the "
                                             f"experts; EP keeps each expert on one rank")


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _release(block: nn.Module, spec: LocalExperts) -> None:
    """Every remote expert's parameters and buffers become ``meta`` stand-ins (``requires_grad=False``,
    ``autoep.runtime.stand_in``) that module conversions keep on ``meta``."""
    container = container_of(block, spec)
    for e, expert in enumerate(_entries(container, spec)[: spec.num_experts]):
        if not spec.is_local(e):
            remote = RemoteExpert(type(block).__name__, e // spec.members, spec.owner(e), spec.ep_rank)
            for m in expert.modules():  # every module of it: a submodule's own conversion makes stand-ins too
                m._autoep_remote = remote
            _stand_in_apply(expert, _unchanged)
            expert._apply = InstanceMethod(expert, _stand_in_apply)
            for m in expert.modules():  # ``m.reset_parameters()`` called directly draws as on the model too
                if callable(getattr(type(m), "reset_parameters", None)):
                    m.reset_parameters = functools.partial(_stand_in_reset, m, container)


def _stand_in_apply(self: nn.Module, fn, recurse: bool = True) -> nn.Module:
    """``nn.Module._apply`` for an expert another rank owns: its tensors stay ``meta`` stand-ins, in the dtype
    ``fn`` would give (``.to(device)`` or ``to_empty`` allocate nothing; ``.bfloat16()`` changes the dtype)."""
    remote = getattr(self, "_autoep_remote", None)
    for m in self.modules():
        for name, p in m._parameters.items():
            if p is not None:
                dtype, home = _after(p, fn)
                if not _is_stand_in(p, dtype) or p.requires_grad:
                    m._parameters[name] = stand_in(p, dtype, remote, parameter=True, home=home)
                else:
                    p.home = home
        for name, b in m._buffers.items():
            if b is not None:
                dtype, home = _after(b, fn)
                if not _is_stand_in(b, dtype):
                    m._buffers[name] = stand_in(b, dtype, remote, parameter=False, home=home)
                else:
                    b.home = home
    return self


def _experts_apply(container: nn.Module, spec: LocalExperts, fn) -> nn.Module:
    """``nn.Module.apply`` for an experts container (``autoep.runtime.reinit``): each remote expert is allocated in
    full on the local experts' device for the time of its own ``apply``, then becomes a stand-in again, so ``fn``
    draws for every expert, in the model's order."""
    experts = _entries(container, spec)
    remote = {id(experts[e]) for e in range(spec.num_experts) if not spec.is_local(e)}
    _apply_around(container, remote, _device_of(container), fn)
    return container


def _apply_around(module: nn.Module, remote: set[int], device, fn) -> None:
    """``module.apply(fn)``, each module in ``remote`` allocated for its own ``apply`` (children first, in order,
    then ``module``, as ``nn.Module.apply``); into a child holding a remote expert deeper (``lora_A`` of experts
    named ``lora_A.0``, ...) it goes the same way."""
    for child in module.children():
        if id(child) in remote:
            try:
                with allocated(child, device):
                    child.apply(fn)
            finally:
                _stand_in_apply(child, _unchanged)  # NOTE: frees the expert's tensors (meta stand-ins again)
        elif any(id(m) in remote for m in child.modules()):
            _apply_around(child, remote, device, fn)
        else:
            child.apply(fn)
    fn(module)


def _stand_in_reset(module: nn.Module, container: nn.Module) -> None:
    """``reset_parameters`` of a module inside a remote expert: its class's own, on tensors allocated for the call
    (it draws what the model's module draws), then stand-ins again; as is where an enclosing ``apply`` allocated
    them already (``_experts_apply`` releases them)."""
    if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        type(module).reset_parameters(module)
        return
    try:
        with allocated(module, _device_of(container)):
            type(module).reset_parameters(module)
    finally:
        _stand_in_apply(module, _unchanged)


def _unchanged(t: Tensor) -> Tensor:
    return t


def _after(t: Tensor, fn) -> tuple[torch.dtype, torch.device]:
    """The dtype and the home (``stand_in.home_of``) the conversion ``fn`` gives ``t``'s tensor on the model."""
    home = home_of(t)
    try:
        probe = fn(torch.empty(0, dtype=t.dtype, device=home))  # the conversion on an empty probe: metadata only
        return probe.dtype, probe.device
    except Exception:  # noqa: BLE001 - a conversion that cannot run on a probe keeps the dtype and the home
        return t.dtype, home


def _is_stand_in(t: Tensor, dtype: torch.dtype) -> bool:
    return isinstance(t, RemoteExpertTensor) and t.dtype == dtype


def place_new_tensors(block: nn.Module, spec: LocalExperts, experts: list[nn.Module]) -> None:
    """Tensors an expert another ep rank owns got after apply (a module set on it, ``experts[3].act_fn =
    nn.PReLU()``; a parameter or buffer registered on it; a tensor assigned to one of its parameters) become frozen
    stand-ins here, as apply made its own: the same user code ran on the owner, which computes the expert with them
    and trains them in its expert group. Kept here, they would be a copy that never computes nor trains, which
    ``model.parameters()``, an optimizer, DDP and a state dict would take for this rank's own. Called before each
    exchange, on every rank (idempotent; a scan of the remote experts' tensors). A module or tensor so added that
    the block holds elsewhere too (one ``nn.PReLU`` set on every expert: a local expert computes with it) raises
    ``LiveStateError``: each expert lives on one rank, and the block's other users need its values here."""
    for e, expert in enumerate(experts[: spec.num_experts]):
        if spec.is_local(e):
            continue
        new = [(name, m) for name, m in expert.named_modules() if any(
            t is not None and not isinstance(t, RemoteExpertTensor) for t in (*m._parameters.values(),
                                                                                 *m._buffers.values()))]
        if not new:
            continue
        _check_new_unshared(block, spec, e, new)
        remote = getattr(expert, "_autoep_remote", None)
        for _, m in new:
            m._autoep_remote = remote  # a module set on it after apply: its own conversions make stand-ins too
            for store, parameter in ((m._parameters, True), (m._buffers, False)):
                for name, t in store.items():
                    if t is not None and not isinstance(t, RemoteExpertTensor):
                        # A plain meta tensor (a pickled stand-in loaded back) is on the block's device on the model.
                        home = _device_of(block) if t.is_meta else t.device
                        store[name] = stand_in(t, t.dtype, remote, parameter=parameter, home=home)


def _check_new_unshared(block: nn.Module, spec: LocalExperts, e: int, new: list) -> None:
    root = _join(spec.path, spec.keys[e])
    held = {}
    for name, m in block.named_modules(remove_duplicate=False):
        if name == root or name.startswith(f"{root}."):
            continue
        for t in (m, *m._parameters.values(), *m._buffers.values()):
            if t is not None:
                held.setdefault(id(t), name or "the block")
    for name, m in new:
        for what, t in ((name, m), *((_join(name, n), t) for n, t in (*m._parameters.items(), *m._buffers.items())
                                     if t is not None)):
            if id(t) in held:
                where = _join(spec.path, spec.keys[e], what)
                raise LiveStateError(
                    f"{type(block).__name__}.{where} was set after apply_plan to a {type(t).__name__} that "
                    f"{held[id(t)]} holds too; under expert parallelism expert {e} lives on ep rank {spec.owner(e)} "
                    f"only (a meta stand-in here), so the two cannot share it. Give each expert its own module "
                    f"(e.g. copy.deepcopy of it per expert)")


def release_remote_experts(model: nn.Module) -> None:
    """Make every remote expert a ``meta`` stand-in again (idempotent; e.g. after a tensor was assigned to one)."""
    for block in model.modules():
        spec = spec_of(block)
        if spec is not None:
            _release(block, spec)


# ---------------------------------------------------------------------------------------------
# The ownership query
# ---------------------------------------------------------------------------------------------


def expert_owners(model: nn.Module) -> dict[str, ExpertOwner]:
    """``{state_dict key: ExpertOwner}`` for every parameter and persistent buffer of module experts that
    ``apply_plan`` placed, anywhere in ``model`` (keys as ``model.state_dict()`` and ``named_parameters`` give them)."""
    owners: dict[str, ExpertOwner] = {}
    for block_name, block in model.named_modules():
        spec = spec_of(block)
        if spec is None:
            continue
        prefix = ".".join(p for p in (block_name, spec.path) if p)
        experts = placed_experts(block, spec)
        for e in range(spec.num_experts):
            place = ExpertOwner(block_name, e // spec.members, spec.owner(e), spec.is_local(e))
            for key in _state_keys(experts[e]):
                owners[_join(prefix, spec.keys[e], key)] = place
    return owners


def _state_keys(expert: nn.Module) -> list[str]:
    return [k for k in expert.state_dict(keep_vars=True)]


def remote_names(block: nn.Module) -> set[str]:
    """Names (relative to ``block``) of the ``meta`` stand-ins of experts another ep rank owns: their own
    tensors (and any hooks on them) live on that rank."""
    return {k for k, place in expert_owners(block).items() if not place.local}


def owned_state_dict(model: nn.Module, state: dict | None = None) -> dict:
    """``state`` (default ``model.state_dict()``) without the remote experts' stand-ins: what this rank saves
    and loads. Each expert's tensors are in exactly the state of the ranks owning it (one per edp replica)."""
    state = model.state_dict() if state is None else state
    remote = {k for k, place in expert_owners(model).items() if not place.local}
    return {k: v for k, v in state.items() if k not in remote}


@contextmanager
def remote_experts_hidden(model: nn.Module):
    """Within the block, the remote experts' stand-ins are taken out of their modules: state-dict tools
    (``torch.distributed.checkpoint.state_dict``, DCP) then see exactly this rank's tensors, and a full-state load
    finds no ``meta`` tensor (which would make it assign new parameter objects)."""
    stash = []
    for block in model.modules():
        spec = spec_of(block)
        if spec is None:
            continue
        experts = placed_experts(block, spec)
        for e in range(spec.num_experts):
            if not spec.is_local(e):
                for m in experts[e].modules():
                    stash.append((m, dict(m._parameters), dict(m._buffers)))
                    m._parameters.clear()
                    m._buffers.clear()
    try:
        yield
    finally:
        for m, params, buffers in stash:
            m._parameters.update(params)
            m._buffers.update(buffers)


def gather_expert_optim_state(model: nn.Module, optim_state: dict) -> dict:
    """A full optimizer state dict keyed by parameter name (``get_optimizer_state_dict(..., full_state_dict=True)``
    of this rank) completed with every other rank's module experts: their state and their place in the param
    groups, from the rank owning them. A collective over every block's ep group; returns ``optim_state``."""
    for block_name, block in model.named_modules():
        spec = spec_of(block)
        if spec is None or spec.ep_size == 1:
            continue
        group = _ep_group(block, spec)
        experts = placed_experts(block, spec)
        prefix = ".".join(p for p in (block_name, spec.path) if p)
        for owner in range(spec.ep_size):
            fqns = [_join(prefix, spec.keys[e], n) for e in range(owner * spec.num_local, (owner + 1) * spec.num_local)
                    for n, _ in experts[e].named_parameters()]
            payload = [None]
            if owner == spec.ep_rank:
                groups = {f: i for i, g in enumerate(optim_state["param_groups"]) for f in g["params"]}
                payload = [{f: (groups.get(f), _to_cpu(optim_state["state"].get(f))) for f in fqns}]
            # NOTE: collective; one pickled broadcast per owner rank (full-state checkpoints only).
            dist.broadcast_object_list(payload, src=dist.get_global_rank(group, owner), group=group)
            if owner != spec.ep_rank:
                for f, (g, st) in payload[0].items():
                    if st is not None:
                        optim_state["state"][f] = st
                    if g is not None:
                        optim_state["param_groups"][g]["params"].append(f)
    return optim_state


def _to_cpu(state):
    return None if state is None else {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in state.items()}


def owned_optim_state(model: nn.Module, optim_state: dict) -> dict:
    """A name-keyed optimizer state dict without the entries of experts another rank owns (what this rank loads)."""
    remote = {k for k, place in expert_owners(model).items() if not place.local}
    return {**optim_state, "state": {k: v for k, v in optim_state["state"].items() if k not in remote},
            "param_groups": [{**g, "params": [f for f in g["params"] if f not in remote]}
                             for g in optim_state["param_groups"]]}


def load_owned_state_dict(model: nn.Module, state: dict, *, strict: bool = True):
    """``model.load_state_dict`` of a state dict in the model's own layout (a full one, or only this rank's
    share): this rank's entries are copied, the remote experts' are skipped. ``strict``: every key the model
    has except the remote experts' must be in ``state``, and ``state`` holds nothing the model lacks.
    Returns ``load_state_dict``'s result."""
    remote = {k for k, place in expert_owners(model).items() if not place.local}
    result = model.load_state_dict({k: v for k, v in state.items() if k not in remote}, strict=False)
    missing = [k for k in result.missing_keys if k not in remote]
    if strict and (missing or result.unexpected_keys):
        raise RuntimeError(f"state dict does not fit {type(model).__name__}: missing {missing[:4]}, unexpected "
                           f"{result.unexpected_keys[:4]}")
    result.missing_keys[:] = missing
    return result


def local_expert_names(model: nn.Module) -> set[str]:
    """Names of the parameters of this rank's own module experts (trainable here, summed over ``edp``)."""
    return {k for k, place in expert_owners(model).items() if place.local}


def gather_experts(block: nn.Module, *, grad: bool = False) -> dict[str, Tensor]:
    """Every expert's parameters (or, ``grad=True``, their gradients; zeros where none) as full tensors on every
    rank, keyed relative to the block (``experts.{e}.gate_proj.weight``). A collective over the ep group: every
    ep rank calls it. Tensors are detached clones."""
    spec = spec_of(block)
    experts = placed_experts(block, spec)
    group = _ep_group(block, spec)
    out: dict[str, Tensor] = {}
    for owner in range(spec.ep_size):
        ids = range(owner * spec.num_local, (owner + 1) * spec.num_local)
        named = [(_join(spec.path, spec.keys[e], n), p) for e in ids for n, p in experts[e].named_parameters()]
        values = []
        for _, p in named:
            if owner != spec.ep_rank:
                values.append(torch.empty(p.shape, dtype=p.dtype, device=_device_of(block)))
            elif grad:
                values.append(_whole(p.grad).detach().clone() if p.grad is not None else
                              torch.zeros(p.shape, dtype=p.dtype, device=_device_of(block)))
            else:
                values.append(_whole(p).detach().clone())
        if spec.ep_size > 1:
            _broadcast(values, owner, group)
        out.update((n, v) for (n, _), v in zip(named, values))
    return out


def _whole(t: Tensor) -> Tensor:
    """An expert tensor at its full shape: FSDP2's ``edp`` shard (``trainer.expert_sharding=fsdp2``) gathered (a
    collective over ``edp``: every peer of this ep rank gathers the same experts in the same order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict_of_experts(model: nn.Module, state: dict | None = None) -> dict:
    """``state`` (default ``model.state_dict()``) with every remote expert's stand-in replaced by the owner's
    tensor (full model layout on every rank). A collective over every block's ep group."""
    state = dict(model.state_dict() if state is None else state)
    for block_name, block in model.named_modules():
        if spec_of(block) is None:
            continue
        prefix = f"{block_name}." if block_name else ""
        state.update({prefix + k: v for k, v in gather_experts(block).items()})
    return state


def _device_of(block: nn.Module) -> torch.device:
    for p in block.parameters():
        if not p.is_meta:
            return p.device
    return torch.device("cpu")


def _broadcast(values: list[Tensor], owner: int, group) -> None:
    """Broadcast ``values`` from ep rank ``owner`` (one flat buffer per dtype)."""
    src = dist.get_global_rank(group, owner)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, v in enumerate(values):
        by_dtype.setdefault(v.dtype, []).append(i)
    for idx in by_dtype.values():
        flat = _flatten_dense_tensors([values[i] for i in idx])
        dist.broadcast(flat, src=src, group=group)  # NOTE: collective; one per owner rank and dtype
        for i, v in zip(idx, _unflatten_dense_tensors(flat, [values[i] for i in idx])):
            values[i].copy_(v)


def _ep_group(block: nn.Module, spec: LocalExperts):
    return None if spec.ep_size == 1 else getattr(block, GROUP).value


# ---------------------------------------------------------------------------------------------
# Run time: the local experts' computation after the exchange
# ---------------------------------------------------------------------------------------------


def register_counts_hook(block: nn.Module, hook) -> RemovableHandle:
    """Call ``hook(first_local_expert, tokens_per_local_expert)`` each time the block's local experts run
    (rows received from every ep rank; ``autoep.train.load.ExpertLoad`` counts tokens with it)."""
    hooks = block.__dict__.setdefault(COUNT_HOOKS, OrderedDict())
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def report_counts(block: nn.Module, tokens_per_local_expert: Tensor) -> None:
    """Call the block's ``register_counts_hook`` hooks with the rows its local experts got in this call."""
    hooks = list(block.__dict__.get(COUNT_HOOKS, {}).values())
    spec = spec_of(block)
    if hooks and spec.members > 1:  # one expert is several modules: its tokens are the rows its first one got
        # (a chain ``lora_B[e](lora_A[e](x))`` sends the same rows again in the next exchange: counted once)
        tokens_per_local_expert = tokens_per_local_expert.view(-1, spec.members)[:, 0]
    for hook in hooks:
        hook(spec.first // spec.members, tokens_per_local_expert)


def local_expert_fn(block: nn.Module):
    """``expert_fn(x_SD, tokens_per_local_expert, status_L=None) -> y_SD`` for the exchange: this rank's experts
    on their rows; with ``status_L`` (``autoep.runtime.dispatch.Idle``) only the experts it marks ``CALL`` run.
    Called before the exchange: raises ``LiveStateError`` (on every rank alike) where an expert carries state
    drawn or updated per call that EP cannot keep as the model does (``_check_drawn_state``)."""
    spec = spec_of(block)
    every = placed_experts(block, spec)
    place_new_tensors(block, spec, every)
    _check_drawn_state(block, spec, every)
    experts = every[spec.first: spec.first + spec.num_local]
    stacked = getattr(block, STACKED, None)

    def expert_fn(x_SD: Tensor, tokens_per_local_expert: Tensor, status_L: list[int] | None = None) -> Tensor:
        report_counts(block, tokens_per_local_expert)
        called = [True] * len(experts) if status_L is None else [s == CALL for s in status_L]
        if fast_path_ok(spec, experts, x_SD):
            y_SD = _grouped(spec, experts, x_SD, tokens_per_local_expert, stacked, called)
            if y_SD is not None:
                return y_SD
        return own_forward(experts, x_SD, tokens_per_local_expert, called)

    return expert_fn


def _check_drawn_state(block: nn.Module, spec: LocalExperts, experts: list[nn.Module]) -> None:
    """Refuse parametrizations holding buffers (``spectral_norm``'s ``_u``/``_v``) and ``spectral_norm`` hooks on
    any expert (remote stand-ins included, so every rank decides alike): they draw their state at registration,
    where a ``meta`` stand-in draws nothing, so the local experts' draws come from another point of the RNG stream
    than on the model (and the power iteration then updates it from there)."""
    for e, expert in enumerate(experts[: spec.num_experts]):
        for name, m in expert.named_modules():
            found = [f"the forward pre hook {type(h).__name__}" for h in m._forward_pre_hooks.values()
                     if isinstance(h, SpectralNorm)]
            for attr, chain in (m._modules.get("parametrizations") or {}).items():
                found += [f"the parametrization {type(p).__name__} of {attr} (buffers "
                          f"{', '.join(n for n, _ in p.named_buffers())})" for p in chain if _holds_buffers(p)]
            if found:
                where = _join(spec.path, spec.keys[e], name)
                raise LiveStateError(
                    f"{type(block).__name__}.{where} carries {found[0]}, state drawn from the RNG when it was "
                    f"registered; under expert parallelism the experts other ranks own are meta stand-ins here, "
                    f"which draw nothing, so this rank's experts got other draws than the model's. Remove it "
                    f"(torch.nn.utils.parametrize.remove_parametrizations), use one without drawn state "
                    f"(weight_norm), or leave the block out of parallel.plan")


def _holds_buffers(m: nn.Module) -> bool:
    return any(True for _ in m.buffers())


def local_idle(block: nn.Module, mode: str, visited_E: Tensor | None = None) -> Idle:
    """The exchange's ``Idle`` for ``block``'s module experts: its loop's ``mode`` for an expert without rows, each
    expert's parameters its own."""
    spec = spec_of(block)
    experts = placed_experts(block, spec)[spec.first: spec.first + spec.num_local]
    return Idle(mode, per_expert=True, visited_E=visited_E, params=lambda e: list(experts[e].parameters()))


def own_forward(experts: list[nn.Module], x_SD: Tensor, tokens_per_local_expert: Tensor,
                called: list[bool] | None = None) -> Tensor:
    """Each local expert's own module on its contiguous rows, in order: those ``called`` (default all), on zero
    rows too where the model's loop calls an expert without rows; the others (no rows) are not called, so their
    parameters keep the gradient the model leaves them (None)."""
    # NOTE: .tolist() syncs the host once per layer for the group sizes.
    chunks = torch.split(x_SD, tokens_per_local_expert.tolist())
    called = called or [True] * len(experts)
    return torch.cat([expert(chunk) for expert, chunk, call in zip(experts, chunks, called) if call])


def fast_path_ok(spec: LocalExperts, experts: list[nn.Module], x_SD: Tensor) -> bool:
    """The grouped GEMM computes exactly what the experts' own forwards would: proven SwiGLU experts whose
    projections are plain, unhooked, bias-free ``nn.Linear``\\ s with plain weights of ``x``'s dtype and a
    nonzero width, all of one shape (gate and up (F, D), down (D, F), D = ``x``'s width), one known element-wise
    activation on every expert (``_activation``), no global hooks, no patched ``nn.Linear.forward``/``F.linear``,
    no torch-function mode. Under autocast the grouped GEMM casts as ``F.linear`` does (``grouped_linear``)."""
    if not spec.fast_path or spec.swiglu is None or x_SD.dim() != 2:
        return False
    if nn.Linear.forward is not _LINEAR_FORWARD or F.linear is not _F_LINEAR or _global_hooks():
        return False
    if torch._C._is_torch_function_mode_enabled() or _activation(spec, experts) is None:
        return False
    D = x_SD.shape[1]
    shapes = None
    for expert in experts:
        if _hooked(expert):
            return False
        for name in spec.swiglu:
            lin = getattr(expert, name, None)
            if type(lin) is not nn.Linear or lin.bias is not None or _hooked(lin):
                return False
            w = lin.weight
            if type(w) is not nn.Parameter or w.dtype != x_SD.dtype or w.device != x_SD.device or 0 in w.shape:
                return False
        gate, up, down = (getattr(expert, n).weight.shape for n in spec.swiglu)
        shapes = shapes or (gate, (gate[1], gate[0]))
        if gate != shapes[0] or up != shapes[0] or down != shapes[1] or gate[1] != D:
            return False  # experts of different widths (each own forward runs its own shapes)
    return True


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                or "forward" in m.__dict__)


def _global_hooks() -> bool:
    from torch.nn.modules import module as m

    names = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
             "_global_backward_pre_hooks")
    return any(getattr(m, n, None) for n in names)


def _grouped(spec: LocalExperts, experts: list[nn.Module], x_SD: Tensor, tokens_per_local_expert: Tensor,
             stacked: _Stacked | None = None, called: list[bool] | None = None) -> Tensor | None:
    """The grouped GEMM on the local experts' own weights (``fast_path_ok`` holds): read in place from their
    stacked home where they live there (or can be moved there), stacked per forward (a copy) otherwise. The
    experts not ``called`` (no rows) get no gradient from the home; where their weights would be copied (a copy
    gives every expert a zero gradient) None is returned and their own forwards run instead."""
    idle = tuple(not c for c in called) if called is not None and not all(called) else ()
    weights = _stacked_weights(spec, experts, stacked, x_SD, idle)
    if weights is None:
        return None
    gate_up_L2FD, down_LDF = weights
    Fi = gate_up_L2FD.shape[1] // 2
    # The experts' own gate and up Linears are two GEMMs, each rounded to the rows' dtype, whose input gradients
    # autograd adds: two grouped GEMMs here too (views of the home, no copy). One fused (2F)-wide GEMM would sum
    # both halves' products before rounding once, and bf16 input gradients would differ by an ulp here and there.
    return grouped_split_glu(x_SD, tokens_per_local_expert, gate_up_L2FD[:, :Fi].transpose(-2, -1),
                             gate_up_L2FD[:, Fi:].transpose(-2, -1), down_LDF.transpose(-2, -1),
                             act_fn=_activation(spec, experts))


def _activation(spec: LocalExperts, experts: list[nn.Module]):
    """The activation every local expert's own forward applies now, or None where one applies another (an
    ``act_fn`` swapped on one expert after apply) or one the fast path does not know to be element-wise:
    only each expert's own forward applies those."""
    if spec.act != "act_fn":
        return _ACTIVATIONS.get(spec.act)
    first = getattr(experts[0], "act_fn", None)
    for e, expert in enumerate(experts):
        act = getattr(expert, "act_fn", None)
        try:
            elementwise.check_activation_module(act, f"experts[{e}].act_fn")
        except Refusal:
            return None
        if act is not first and not (isinstance(act, nn.Module) and isinstance(first, nn.Module)
                                     and elementwise.same_activation(act, first)):
            return None
    return first


def _stacked_weights(spec: LocalExperts, experts: list[nn.Module], stacked: _Stacked | None,
                     x_SD: Tensor, idle: tuple[bool, ...] = ()) -> tuple[Tensor, Tensor] | None:
    """(gate_up (L, 2F, D), down (L, D, F)) as differentiable functions of the local experts' own parameters
    (none for the ``idle`` ones; None where only a copy could give them and some expert is idle)."""
    gate, up, down = spec.swiglu
    gates = [getattr(x, gate).weight for x in experts]
    ups = [getattr(x, up).weight for x in experts]
    downs = [getattr(x, down).weight for x in experts]
    if stacked is not None and stacked.holds(gates, ups, downs):
        return stacked.weights(gates, ups, downs, x_SD, idle)
    if any(idle):
        return None
    # Layout change per forward: the weights stacked (a differentiable copy; gradients land on the parameters).
    return torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups)]), torch.stack(downs)


class _Stacked:
    """The stacked home of a block's local SwiGLU expert weights: ``gate_up`` (L, 2F, D) holds expert e's gate
    weight in ``gate_up[e, :F]`` and its up weight in ``gate_up[e, F:]``, ``down`` (L, D, F) its down weight in
    ``down[e]``. While the experts' own ``nn.Parameter`` objects live there (``p.data`` is that slice), the
    grouped GEMM reads the buffers as they are. A deep copy or a pickle of the block gets an empty home (its
    parameters are new tensors; they are re-homed at the copy's first fast-path forward)."""

    def __init__(self):
        self.gate_up: Tensor | None = None
        self.down: Tensor | None = None
        self.ptrs: tuple[int, ...] = ()  # each parameter's address in its home, in ``_order`` order
        self.index: tuple[tuple, tuple] = ((), ())  # each slot of gate_up (gate_0, up_0, gate_1, ...) / of down

    def __deepcopy__(self, memo):
        return _Stacked()

    def __reduce__(self):
        return (_Stacked, ())

    def holds(self, gates: list[Tensor], ups: list[Tensor], downs: list[Tensor]) -> bool:
        """Whether the parameters live in their home now, moving them there first where that is unobservable."""
        return self._intact(gates, ups, downs) or self._rehome(gates, ups, downs)

    def weights(self, gates: list[Tensor], ups: list[Tensor], downs: list[Tensor],
                x_SD: Tensor, idle: tuple[bool, ...] = ()) -> tuple[Tensor, Tensor]:
        """The two homes as differentiable functions of the parameters (no copy), no gradient for the experts
        marked ``idle``. A backward reads the gate/up weights where ``x`` needs a gradient, the down weights where
        their input does (as ``F.linear`` saves)."""
        gate_ups = [w for pair in zip(gates, ups) for w in pair]
        grad_in = torch.is_grad_enabled() and x_SD.requires_grad
        grad_h = torch.is_grad_enabled() and (x_SD.requires_grad or any(w.requires_grad for w in gate_ups))
        idle_gate_ups = tuple(i for i in idle for _ in range(2))
        return (stacked_parameters(self.gate_up, self.index[0], gate_ups, read_in_backward=grad_in, idle=idle_gate_ups),
                stacked_parameters(self.down, self.index[1], downs, read_in_backward=grad_h, idle=idle))

    def _intact(self, gates, ups, downs) -> bool:
        # Same address, shape, dtype and row-major layout as its slice: the parameter reads exactly that slice
        # (the home is alive, held here, so no other tensor can own that memory). fast_path_ok checked the shapes.
        home = self.gate_up
        if home is None or home.shape[0] != len(gates) or home.dtype != gates[0].dtype or home.device != gates[0].device:
            return False
        if home.shape[1:] != (2 * gates[0].shape[0], gates[0].shape[1]):
            return False
        return all(w.data_ptr() == ptr and w.is_contiguous() for w, ptr in zip(_order(gates, ups, downs), self.ptrs))

    def _rehome(self, gates, ups, downs) -> bool:
        """Copy the parameters into new stacked buffers and point each one's ``.data`` at its slice, where no
        one can tell: nothing but these parameters (and this home) holds their memory, no two overlap, the
        memory is not shared between processes or pinned, and autograd is not in inference mode. Else False."""
        params = _order(gates, ups, downs)
        if torch.is_inference_mode_enabled() or not _only_these_hold(params, self):
            return False
        L, (Fi, D) = len(gates), gates[0].shape
        like = {"dtype": gates[0].dtype, "device": gates[0].device}
        gate_up, down = torch.empty((L, 2 * Fi, D), **like), torch.empty((L, D, Fi), **like)
        index_gu = tuple(i for e in range(L) for i in ((e, slice(0, Fi)), (e, slice(Fi, 2 * Fi))))
        index_down = tuple((e,) for e in range(L))
        with torch.no_grad():
            slots = [gate_up[i] for i in index_gu] + [down[i] for i in index_down]
            owners = [w for pair in zip(gates, ups) for w in pair] + list(downs)
            for slot, w in zip(slots, owners):
                slot.copy_(w)
            for slot, w in zip(slots, owners):
                w.data = slot  # the same Parameter object, its memory now the slot (its hooks and grad untouched)
        self.gate_up, self.down, self.index = gate_up, down, (index_gu, index_down)
        self.ptrs = tuple(w.data_ptr() for w in params)
        return True


def _order(gates: list[Tensor], ups: list[Tensor], downs: list[Tensor]) -> list[Tensor]:
    return [*gates, *ups, *downs]


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _only_these_hold(params: list[Tensor], home: _Stacked) -> bool:
    """No tensor but ``params`` (and ``home``'s buffers) holds the memory of ``params``, and no two of them
    overlap: moving them elsewhere changes nothing anyone can observe but their addresses."""
    if _use_count is None:
        return False
    ours = {t.untyped_storage().data_ptr() for t in (home.gate_up, home.down) if t is not None}
    by_storage: dict[tuple, list[Tensor]] = {}
    for w in params:
        if not w.is_contiguous() or w.is_shared() or (w.device.type == "cpu" and w.is_pinned()):
            return False
        by_storage.setdefault((w.device, w.untyped_storage().data_ptr()), []).append(w)
    for (_, base), group in by_storage.items():
        # Holders of the storage: each parameter's tensor, this home's buffer, and the probe ``untyped_storage()``.
        holders = _use_count(group[0].untyped_storage()._cdata) - 1
        if holders != len(group) + (base in ours):
            return False
        spans = sorted((w.storage_offset(), w.storage_offset() + w.numel()) for w in group)
        if any(end > start for (_, end), (start, _) in zip(spans, spans[1:])):
            return False  # two parameters on the same memory (tied through .data): keep them tied
    return True
