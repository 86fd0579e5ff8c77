"""Experts held as modules (a ``ModuleList`` or ``ModuleDict`` of expert modules) under expert parallelism:
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
    conversion gives, so a gather still receives the owner's dtype.

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

import types
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.hooks import RemovableHandle

from autoep.errors import PlanError, UnsupportedModuleStructure
from autoep.runtime.dispatch import CALL, Idle
from autoep.runtime.experts import glu_gate, grouped_swiglu, stacked_parameters

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


def container_keys(container: nn.Module) -> tuple[str, ...]:
    return tuple(container.keys()) if isinstance(container, nn.ModuleDict) else tuple(map(str, range(len(container))))


# ---------------------------------------------------------------------------------------------
# Apply time: keep the local experts, release the others
# ---------------------------------------------------------------------------------------------


def place_experts(block: nn.Module, *, path: str, num_experts: int, identity_experts: int, ep_mesh,
                  swiglu: tuple[str, str, str] | None, act: str, fast_path: bool, name: str) -> LocalExperts:
    """Record where ``block``'s experts live (``block._autoep_experts``) and release the ones another ep rank owns.

    ``PlanError`` where ep_size does not divide the computing experts; ``UnsupportedModuleStructure`` where
    an expert's tensor is shared with another expert or with the rest of the block (releasing it would
    drop it there too)."""
    ep_size = 1 if ep_mesh is None else ep_mesh.size()
    ep_rank = 0 if ep_mesh is None else ep_mesh.get_local_rank()
    if num_experts % ep_size:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise PlanError(f"parallel.ep_size={ep_size} does not divide num_experts={num_experts} of {name}; pick one "
                        f"of {divisors}")
    container = block.get_submodule(path)
    spec = LocalExperts(path=path, keys=container_keys(container), num_experts=num_experts,
                        identity_experts=identity_experts, ep_rank=ep_rank, ep_size=ep_size, swiglu=swiglu, act=act,
                        fast_path=fast_path)
    _check_unshared(block, spec, name)
    setattr(block, SPEC, spec)
    setattr(block, GROUP, _Shared(None if ep_mesh is None else ep_mesh.get_group()))
    setattr(block, STACKED, _Stacked())
    _release(block, spec)
    return spec


def _check_unshared(block: nn.Module, spec: LocalExperts, name: str) -> None:
    experts = expert_modules(container_of(block, spec))
    seen: dict[int, str] = {}
    for e, expert in enumerate(experts):
        for t in (*expert.parameters(), *expert.buffers()):
            if id(t) in seen and seen[id(t)] != str(e):
                raise UnsupportedModuleStructure(type(block).__name__, f"{name}: experts {seen[id(t)]} and {e} share "
                                                 f"a tensor; EP keeps each expert on one rank")
            seen[id(t)] = str(e)
    if not spec.path:
        return  # the block is the container (its own forward was replaced): every child is inside it
    inside = {id(m) for expert in experts for m in expert.modules()}
    for mname, m in block.named_modules(remove_duplicate=False):
        if mname == spec.path or mname.startswith(f"{spec.path}."):
            continue
        shared = id(m) in inside or any(id(t) in seen for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
        if shared:
            raise UnsupportedModuleStructure(type(block).__name__, f"{name}: {mname or 'the block'} "
                                             f"({type(m).__name__}) shares an expert's module or tensor outside the "
                                             f"experts; EP keeps each expert on one rank")


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _release(block: nn.Module, spec: LocalExperts) -> None:
    """Every remote expert's parameters and buffers become ``meta`` stand-ins (``requires_grad=False``) that
    module conversions keep on ``meta``."""
    for e, expert in enumerate(expert_modules(container_of(block, spec))[: spec.num_experts]):
        if not spec.is_local(e):
            _stand_in_apply(expert, lambda t: t)
            expert._apply = types.MethodType(_stand_in_apply, expert)


def _stand_in_apply(self: nn.Module, fn, recurse: bool = True) -> nn.Module:
    """``nn.Module._apply`` for an expert another rank owns: its tensors stay ``meta`` stand-ins, in the dtype
    ``fn`` would give (``.to(device)`` or ``to_empty`` allocate nothing; ``.bfloat16()`` changes the dtype)."""
    for m in self.modules():
        for name, p in m._parameters.items():
            if p is not None:
                meta = _meta_like(p, fn)
                if meta is not p or p.requires_grad:
                    m._parameters[name] = nn.Parameter(meta, requires_grad=False)
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = _meta_like(b, fn)
    return self


def _meta_like(t: Tensor, fn) -> Tensor:
    try:
        dtype = fn(torch.empty(0, dtype=t.dtype)).dtype  # the conversion on an empty probe: its dtype only
    except Exception:  # noqa: BLE001 - a conversion that cannot run on a probe keeps the dtype
        dtype = t.dtype
    if t.is_meta and dtype == t.dtype:
        return t
    return torch.empty(t.shape, dtype=dtype, device="meta")


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
        experts = expert_modules(container_of(block, spec))
        for e in range(spec.num_experts):
            place = ExpertOwner(block_name, e, spec.owner(e), spec.is_local(e))
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
        experts = expert_modules(container_of(block, spec))
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
        experts = expert_modules(container_of(block, spec))
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
    experts = expert_modules(container_of(block, spec))
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
                values.append(p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p).detach())
            else:
                values.append(p.detach().clone())
        if spec.ep_size > 1:
            _broadcast(values, owner, group)
        out.update((n, v) for (n, _), v in zip(named, values))
    return out


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


class _Shared:
    """A value a deep copy of the block shares instead of copying (a process group cannot be copied)."""

    def __init__(self, value):
        self.value = value

    def __deepcopy__(self, memo):
        return self


def _ep_group(block: nn.Module, spec: LocalExperts):
    return None if spec.ep_size == 1 else getattr(block, GROUP).value


# ---------------------------------------------------------------------------------------------
# Run time: the local experts' computation after the exchange
# ---------------------------------------------------------------------------------------------


def register_counts_hook(block: nn.Module, hook) -> RemovableHandle:
    """Call ``hook(first_local_expert, tokens_per_local_expert)`` each time the block's local experts run
    (rows received from every ep rank; ``autoep.train.loop.ExpertLoad`` counts tokens with it)."""
    hooks = block.__dict__.setdefault(COUNT_HOOKS, OrderedDict())
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def local_expert_fn(block: nn.Module):
    """``expert_fn(x_SD, tokens_per_local_expert, status_L=None) -> y_SD`` for the exchange: this rank's experts
    on their rows; with ``status_L`` (``autoep.runtime.dispatch.Idle``) only the experts it marks ``CALL`` run."""
    spec = spec_of(block)
    experts = expert_modules(container_of(block, spec))[spec.first: spec.first + spec.num_local]
    stacked = getattr(block, STACKED, None)

    def expert_fn(x_SD: Tensor, tokens_per_local_expert: Tensor, status_L: list[int] | None = None) -> Tensor:
        for hook in list(block.__dict__.get(COUNT_HOOKS, {}).values()):
            hook(spec.first, tokens_per_local_expert)
        called = [True] * len(experts) if status_L is None else [s == CALL for s in status_L]
        if fast_path_ok(spec, experts, x_SD):
            y_SD = _grouped(spec, experts, x_SD, tokens_per_local_expert, stacked, called)
            if y_SD is not None:
                return y_SD
        return own_forward(experts, x_SD, tokens_per_local_expert, called)

    return expert_fn


def local_idle(block: nn.Module, mode: str, visited_E: Tensor | None = None) -> Idle:
    """The exchange's ``Idle`` for ``block``'s module experts: its loop's ``mode`` for an expert without rows, each
    expert's parameters its own."""
    spec = spec_of(block)
    experts = expert_modules(container_of(block, spec))[spec.first: spec.first + spec.num_local]
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
    nonzero width, all of one shape (gate and up (F, D), down (D, F), D = ``x``'s width), no global hooks,
    no patched ``nn.Linear.forward``/``F.linear``, no torch-function mode."""
    if not spec.fast_path or spec.swiglu is None or x_SD.dim() != 2:
        return False
    if nn.Linear.forward is not _LINEAR_FORWARD or F.linear is not _F_LINEAR or _global_hooks():
        return False
    if torch._C._is_torch_function_mode_enabled():
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
    act = experts[0].act_fn if spec.act == "act_fn" else _ACTIVATIONS[spec.act]
    return grouped_swiglu(x_SD, tokens_per_local_expert, *weights, apply_gate=glu_gate(act))


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
