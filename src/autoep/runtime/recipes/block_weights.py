"""Recipe for blocks whose experts are 3-D weights on the block itself, applied inside the block's own routing loop
(``MoeStructure.expert_storage == "block_weights"``; proven by ``autoep.detect.block_weights``).

The weights (``w1 (E, D, F)``, ...) become ``Shard(0)`` DTensors over ``ep`` under their own names (this rank holds
experts ``[r*L, (r+1)*L)`` whole; ``state_dict()`` keys and checkpoints keep the model's layout). The block's forward
runs once, by the one-pass execution (``autoep.runtime.recipes.replay``, ``deferred``): recompiled from its own source
(``autoep.detect.splice.compile_changed``) with each proven *site* (an expression ``g(R, self.w1[i], ...)``, or a
method call ``self._expert(i, R)``) replaced by one expert call, ``__autoep_block_expert_k__(self, i, R)``. Everything
else is the model's code, run once where the token is: the routing, ``R`` itself (the rows, as the model evaluates
them), what the block does with the site's value (the routing weight, ``index_add_``), which waits on the tape for
the exchange. The call answers a pending tensor; at the block's return the rows travel to expert ``i``'s owner, which
evaluates the site's own expression (an inline site: the model's expression compiled in its forward's scope; a
method site: the class's method itself) with ``self`` a view of the block whose weights are its local slices
(differentiable: gradients reach the DTensor parameters), on every rank's rows for that expert at once (the site is
proven row-local), and the values come back.

Gradients: what the model's one weight tensor gets, slice by slice: the rows' slices through the exchange, a zero
gradient for every local slice once any rank made an expert call (``replay.run_exchanges``' ``touch``: the model's
tensor gets zeros where no row reached an expert), ``None`` where no rank made one.

Each site is its own virtual expert of the exchange (``e * K + k`` for expert ``e``, site ``k`` of ``K``): rows of two
sites never meet in one evaluation. Shape legend: E experts, K sites, L experts local to this rank, W ep ranks.
"""

from __future__ import annotations

import contextvars
import functools
import operator
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from autoep.detect import block_weights, genuine, site_calls
from autoep.detect.block_weights import BlockWeightsProof
from autoep.detect.source import Refusal
from autoep.detect.splice import compile_changed
from autoep.detect.structure import MoeStructure
from autoep.errors import LiveStateError, UnsupportedModuleStructure
from autoep.runtime import live_state
from autoep.runtime.adapters import local_weight
from autoep.runtime.live_state import param_state
from autoep.runtime.recipes import (
    ProvenCode,
    as_structure,
    join_backward_exchanges,
    shard_weights_at,
    watching_facts,
)
from autoep.runtime.recipes.deferred import Deferring, ReplayError, Tape, _ctx
from autoep.runtime.recipes.replay import _device, run_exchanges
from autoep.runtime.reinit import install_sharded_apply
from autoep.runtime.shared import InstanceMethod, Shared

STATE = "_autoep_block_weights"  # the block attribute holding its ``_BlockWeights``
GROUP = "_autoep_ep_group"


@dataclass(frozen=True)
class _BlockWeights:
    """What the forward needs, fixed at apply time (plain values: a deep copy or a pickle stays consistent)."""

    proof: BlockWeightsProof
    code: ProvenCode  # the class forward's code proven at apply time
    ep_rank: int
    ep_size: int


@dataclass(frozen=True)
class _Spec:
    """The exchange's view (``replay._exchange``): K virtual experts per expert, L * K on each rank."""

    num_experts: int
    ep_size: int
    ep_rank: int
    members: int = 1  # one module per virtual expert: each call travels as it is (``chains``: nothing to fuse)

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first(self) -> int:
        return self.ep_rank * self.num_local


# ---------------------------------------------------------------------------------------------
# The factory
# ---------------------------------------------------------------------------------------------


def ep_block_weights(module: nn.Module, *, ep_mesh=None, structure: dict | MoeStructure) -> None:
    """Shard the block's 3-D expert weights ``Shard(0)`` over ``ep_mesh`` and run its forward by the one pass, each
    proven site an expert call (module docstring; factory contract: ``autoep.runtime.recipes``)."""
    with watching_facts(module):
        proof = validate(module, structure=structure)
    holder = module.get_submodule(proof.holder) if proof.holder else module
    name = type(module).__name__
    names = {}
    for n, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(n)
    for w in proof.weights:
        param = holder._parameters[w]
        if len(names[id(param)]) > 1:
            raise UnsupportedModuleStructure(name, f"the expert weight {w} is one tensor under several names "
                                                   f"({', '.join(names[id(param)])}); sharding it would untie them")
        if type(param) is not nn.Parameter and not hasattr(param, "to_local"):
            raise UnsupportedModuleStructure(name, f"{w} is a {type(param).__name__} (a tensor subclass weight); "
                                                   "autoep's sharding would not apply it")
        state = [s for s in param_state(param)]
        if state:
            raise LiveStateError(f"{name}.{w} carries {', '.join(state)}; sharding it makes a new parameter that "
                                 "would not: register it after apply_plan, on the sharded parameter")
    shard_weights_at(holder, proof.weights, ep_mesh, name=name)
    install_sharded_apply(holder)  # ``model.apply(init)`` draws for the full weights, as on the model
    ep_size = 1 if ep_mesh is None else ep_mesh.size()
    ep_rank = 0 if ep_mesh is None else ep_mesh.get_local_rank()
    setattr(module, STATE, _BlockWeights(proof, ProvenCode(_forward_code(type(module))), ep_rank, ep_size))
    setattr(module, GROUP, Shared(None if ep_mesh is None or ep_size == 1 else ep_mesh.get_group()))
    join_backward_exchanges(module, ep_mesh)
    module.forward = InstanceMethod(module, _block_forward)


def validate(module: nn.Module, *, structure: dict | MoeStructure, **_) -> BlockWeightsProof:
    """Resolve-time check (an explicit ``_target_`` included): the block's 3-D weights and sites are proven
    (``autoep.detect.block_weights``) and the structure names them. ``UnsupportedModuleStructure`` otherwise."""
    facts, name = as_structure(structure), type(module).__name__
    if getattr(module, STATE, None) is not None:
        raise UnsupportedModuleStructure(name, "the block is already EP-ready (apply_plan ran on it)")
    try:
        proof = block_weights.prove(module)
    except Refusal as exc:
        raise UnsupportedModuleStructure(name, str(exc)) from None
    proven = block_weights.facts(proof)
    for key, value in proven.items():
        if getattr(facts, key) != value:
            raise UnsupportedModuleStructure(name, f"structure.{key}={getattr(facts, key)!r}, but the block's expert "
                                                   f"weights are proven {key}={value!r}")
    return proof


def _forward_code(cls: type):
    return getattr(cls.forward, "__code__", None)


# ---------------------------------------------------------------------------------------------
# One call of the block
# ---------------------------------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("autoep_block_weights_caller", default=None)


@functools.cache
def _compiled(cls: type, code, proof: BlockWeightsProof) -> tuple:
    """``(the changed forward, each site's expert function)`` for ``cls`` whose forward is ``code`` (cached by both:
    a swapped ``__code__`` is a new key, and the changed forward's own guard raises)."""
    calls = {site_calls.call_name(k): functools.partial(_site_call, k) for k in range(len(proof.sites))}
    forward = compile_changed(cls.forward, "forward", site_calls.changed_forward(cls, proof), calls,
                              "with its expert expressions made expert calls")
    return forward, tuple(site_calls.expert_function(cls, proof, k) for k in range(len(proof.sites)))


def _site_call(k: int, block: nn.Module, expert_id, rows):
    caller = _ACTIVE.get()
    if caller is None or caller.block is not block:
        raise ReplayError(f"{type(block).__name__}: its expert expression {k} ran outside the block's own call")
    return caller.call(k, expert_id, rows)


def _block_forward(self: nn.Module, *args, **kwargs):
    state: _BlockWeights = getattr(self, STATE)
    cls = type(self)
    code = _forward_code(cls)
    if not state.code.matches(code):
        raise ReplayError(f"{cls.__name__}.forward was replaced, or its __code__ swapped, after apply_plan; apply the "
                          "plan again to a fresh model built with the new code")
    forward, fns = _compiled(cls, code, state.proof)
    sites = len(fns)
    spec = _Spec(state.proof.num_experts * sites, state.ep_size, state.ep_rank)
    group = getattr(self, GROUP).value
    device = _device(args, kwargs, self)
    tape = Tape(cls.__name__)
    caller = _Caller(self, state.proof, tape, fns)
    output, failure, local = None, None, {}
    token = _ACTIVE.set(caller)
    try:
        _no_patched_torch(cls.__name__)  # before any expert work, reported to every peer like any failure
        local = _local_weights(self, state)  # before the forward: a weight replaced after apply raises here
        with Deferring(tape):
            output = forward(self, *args, **kwargs)
        if tape.failure is not None:  # raised in the forward and caught there: still a failure
            raise tape.failure
        tape.check_unchanged()
    except Exception as exc:  # noqa: BLE001 - reported to every peer with the counts, then raised here
        failure = exc
    finally:
        _ACTIVE.reset(token)
    first = state.ep_rank * (state.proof.num_experts // state.ep_size)
    experts = [_SiteExpert(self, state.proof, local, fns[v % sites], v // sites - first)
               for v in range(spec.num_experts)]
    touch = tuple(t for t in local.values() if t.requires_grad)
    return run_exchanges(self, spec, experts, tape, output, failure, group, device,
                         functools.partial(_rows_of, tape), touch)


def _no_patched_torch(name: str) -> None:
    """Refuse the call while a torch object an expert computation reaches is patched (``F.silu`` replaced around the
    call, after apply). Block code the tape defers runs it wrong on several ranks: measured by the fuzzer
    (``replay/child_weights/block/patch_silu``, ``tests/detect/test_block_weight_soundness.py``): ``self.experts.act``
    applied to a site's pending output, ``F.silu`` patched to scale by 1.5, was off by 0.68 on 2 ranks (exact in one
    process)."""
    patched = genuine.patched_torch_objects(live_state._activation_classes())
    if patched:
        raise LiveStateError(f"{name}: {', '.join(patched)} is patched now (not at apply_plan); the block's deferred "
                             "code would not run it as the model does on several ranks: undo the patch around the "
                             "block's call, or patch before apply_plan and keep the block off autoep's plan")


def _local_weights(block: nn.Module, state: _BlockWeights) -> dict[str, Tensor]:
    """This rank's slices of the expert weights (differentiably), each checked to be the ``Shard(0)`` DTensor apply made
    (a weight set after apply, ``block.w1 = nn.Parameter(full)``, would be read at the wrong expert's rows)."""
    holder = block.get_submodule(state.proof.holder) if state.proof.holder else block
    expected = state.proof.num_experts // state.ep_size
    local = {}
    for w in state.proof.weights:
        t = local_weight(holder, w)
        param = holder._parameters.get(w)
        if t.dim() != 3 or t.shape[0] != expected or state.ep_size > 1 and not hasattr(param, "to_local"):
            raise LiveStateError(f"{type(block).__name__}.{w} is a {type(param).__name__} of shape "
                                 f"{tuple(getattr(param, 'shape', ()))}, not the Shard(0) DTensor apply_plan made "
                                 f"({expected} of {state.proof.num_experts} experts on this rank): it was replaced after "
                                 "apply_plan; load weights into it (load_state_dict, or .to_local().copy_), or apply the "
                                 "plan again to a fresh model")
        local[w] = t
    return local


def _rows_of(tape: Tape, call) -> Tensor:
    """The 2-D rows a call sends: its input's value, ``(..., D)`` flattened to ``(prod(...), D)`` (a layout change:
    every site is proven to act on the last dim alone)."""
    x = tape.value(call.x)
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


class _OwnerView:
    """The block as a site's expression reads it on the owner: its expert weights are ``weights`` (this rank's
    slices), everything else is the block's own (a child holding the weights: a view of it)."""

    __slots__ = ("_block", "_path", "_weights")

    def __init__(self, block: nn.Module, path: str, weights: dict[str, Tensor]):
        object.__setattr__(self, "_block", block)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_weights", weights)

    def __getattr__(self, name: str):
        if self._path and name == self._path:
            return _OwnerView(getattr(self._block, name), "", self._weights)
        if not self._path and name in self._weights:
            return self._weights[name]
        return getattr(self._block, name)


class _SiteExpert:
    """Virtual expert ``e * K + k`` of the exchange: site ``k``'s expression for expert ``e`` on this rank's slices
    (``local``: its index among this rank's experts)."""

    def __init__(self, block: nn.Module, proof: BlockWeightsProof, weights: dict[str, Tensor], fn, local: int):
        self.block, self.proof, self.weights, self.fn, self.local = block, proof, weights, fn, local

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(_OwnerView(self.block, self.proof.holder, self.weights), self.local, x)

    def parameters(self):
        return iter(self.weights.values())


class _Caller:
    """Answers each site's call in the forward with a pending output (``deferred.Tape.expert_call``)."""

    def __init__(self, block: nn.Module, proof: BlockWeightsProof, tape: Tape, fns: tuple):
        self.block, self.proof, self.tape, self.fns = block, proof, tape, fns

    def call(self, k: int, expert_id, rows) -> Tensor:
        E, name = self.proof.num_experts, type(self.block).__name__
        try:
            e = operator.index(expert_id)
        except TypeError:
            raise self.tape.fail(f"expert expression {k} slices the expert weights by {type(expert_id).__name__} "
                                 f"{expert_id!r}, not an integer expert id") from None
        if not -E <= e < E:
            raise IndexError(f"index {e} is out of bounds for dimension 0 with size {E}")
        e %= E
        if not isinstance(rows, Tensor) or rows.dim() < 2:
            raise self.tape.fail(f"expert expression {k} of {name} applies expert {e}'s weights to "
                                 f"{type(rows).__name__} {tuple(getattr(rows, 'shape', ()))}; autoep moves rows "
                                 "(rows, features)")
        shape, dtype = _output_of(self.block, self.proof, self.fns[k], k, rows)
        with torch._C.DisableTorchFunction():
            needs = self.tape.needs_grad(rows)
            shadow = torch.empty((*rows.shape[:-1], *shape), dtype=dtype, device="meta")
        holder = self.block.get_submodule(self.proof.holder) if self.proof.holder else self.block
        grad = torch.is_grad_enabled() and (needs or any(holder._parameters[w].requires_grad
                                                         for w in self.proof.weights))
        return self.tape.expert_call(e * len(self.fns) + k, rows, shadow, rows.device, grad)


# Per block, what ``_meta_output`` found for a site, by everything its output's width and dtype can depend on: the
# rows' trailing shape, dtype and device, the grad/autocast context and the weights' dtypes and shapes.
_OUTPUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _output_of(block: nn.Module, proof: BlockWeightsProof, fn, k: int, rows: Tensor) -> tuple[tuple[int, ...],
                                                                                               torch.dtype]:
    holder = block.get_submodule(proof.holder) if proof.holder else block
    weights = {w: holder._parameters[w] for w in proof.weights}
    found = (k, tuple(rows.shape[-1:]), rows.dtype, rows.device, _ctx(),
             tuple((w.dtype, tuple(w.shape[1:])) for w in weights.values()))
    known = _OUTPUTS.setdefault(block, {})
    if found not in known:
        known[found] = _meta_output(block, proof, fn, rows, weights)
    return known[found]


def _meta_output(block: nn.Module, proof: BlockWeightsProof, fn, rows: Tensor, weights: dict) -> tuple:
    """The trailing shape and dtype of site ``fn`` on two rows of ``rows``' width, on fake tensors of the rows'
    device (nothing computed, nothing allocated; autocast applies as on the rows)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch._C.DisableTorchFunction(), FakeTensorMode(allow_non_fake_inputs=False), torch.no_grad():
        fake = {w: torch.empty((1, *p.shape[1:]), dtype=p.dtype, device=rows.device) for w, p in weights.items()}
        x = torch.empty((2, rows.shape[-1]), dtype=rows.dtype, device=rows.device)
        out = fn(_OwnerView(block, proof.holder, fake), 0, x)
    if not isinstance(out, Tensor) or out.dim() != 2 or out.shape[0] != 2:
        raise ReplayError(f"{type(block).__name__}: an expert expression returns {type(out).__name__} "
                          f"{tuple(getattr(out, 'shape', ()))} for rows of shape (2, {rows.shape[-1]}); autoep moves "
                          "one row of output per row of input")
    return tuple(out.shape[1:]), out.dtype
