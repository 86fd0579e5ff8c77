"""One pass, deferred expert outputs: the general execution of module experts under EP, whatever the loop's spelling.

The block's own forward runs ONCE, as written (DESIGN.md "One pass, deferred expert outputs"); only its calls
into the experts travel, and only the tensor work that depends on their outputs waits for them:

1. **The forward.** The block's class forward runs under ``deferred.Deferring``. Each expert module's call
   (inside ``nn.Module.__call__``: the expert's own hooks run here, at the caller, once) answers a pending
   tensor (shape and dtype from the expert's class forward on fake tensors, cached per expert) and is taped
   with its input and its grad/autocast context. Torch calls that read a pending value, or a tensor one was
   written into, are taped too; everything else (routing, masks, Python side effects, hooks, random draws,
   logging) happens now, once, as in the model. What needs a pending value on the host (``item``, ``bool``,
   a data-dependent shape, printing) raises ``ReplayError`` naming the block's line.
2. **Exchange.** Every call whose input is available goes to the expert's owner (experts split contiguously,
   as ``local_experts.LocalExperts`` places them) in ONE differentiable all-to-all; the owner runs each called
   local expert's class forward once on the rows every rank sent it (row-local: concatenation changes
   nothing), under the calls' context, and the outputs go back by the reverse all-to-all.
3. **Deferred calls.** The taped torch calls run for real, in the forward's order, under their contexts
   (autograd records them now). A call on another expert's output (a chained call: ``B(A(x))``, an expert fed
   the running sum) travels in the next exchange, after the calls it reads, unless it continues a chain over one
   expert's modules, which runs whole on the owner in one exchange (``chains``: ``lora_B[i](lora_A[i](x))``);
   every rank joins each exchange some rank has calls for, until no rank has pending work (``deferred.Tape``
   stages). Every pending object the block kept (its
   output, attributes, lists, hook stores) then becomes its real tensor.

Gradients flow as in the model: through the rows (the exchange's backward) to the block's input and the
routing, through the deferred calls to whatever scales or chains the outputs. An expert called with zero rows
is called with zero rows on its owner (zero gradients, as the model gives); an expert no rank calls is not
called (its gradients stay ``None``). Every rank joins every exchange and its backward, with nothing to send
too; a rank whose output does not reach the exchange (no tokens) joins its backward through the block's first
floating output. A failure on one rank (its forward raised, a host read, a changed fact) raises on every rank
(the flags travel with the exchange's counts, and one small all-reduce at the end), so no peer is left waiting.

What the owner cannot reproduce raises before any exchange: a value the experts' proofs read (an expert's
attribute, a global) changed by the forward around a call; a hook on a module inside an expert, or a global
module hook (they would run on the owner's rows); an in-place write into a tensor a deferred call or an expert
reads, made after the call (``Tape.check_unchanged``).

Experts in a plain dict/list attribute of the block (``autoep.detect.plain_experts``: ``self.expert_by_id =
{i: self.expert_i}``, each value registered on the block) are placed under their registered names, so the entry
and the registration reach the one placed module; each call checks the attribute still maps the same ids to
those modules (``_plain_changed``: a change after apply or in the forward raises ``ReplayError`` naming the entry).

N-D calls: an expert called on ``(..., D)`` (VitPose runs every expert on the whole ``(batch, seq, D)``
tensor) travels as its ``(prod(...), D)`` rows, and its output comes back reshaped to ``(..., P)``: exact
only for an expert proven to treat every dim before the last alike (``row_local.ExpertProof.
leading_dims_free``); for any other expert such a call raises ``ReplayError`` naming the block, the expert,
the shape and the construct that reads a leading dim. Every proof holds for the experts' modules as they were
at apply: before each call, an expert or a module of one replaced by another class, or a ``forward`` set on
one (the owner calls the class forward: it would be dropped), raises ``FactChanged`` naming the expert.

Shape legend: S rows sent (all calls of one exchange, grouped by expert), R rows received, D the rows' width,
P the experts' output width, E routed experts, L experts local to this rank, W ep ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import marshal
import math
import sys
import types
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import Tensor, nn

from autoep.detect import plain_experts, replay_proof, row_local
from autoep.detect.module_list_proof import global_hooks
from autoep.detect.source import Refusal
from autoep.detect.structure import MoeStructure
from autoep.errors import FactChanged, UnsupportedModuleStructure
from autoep.runtime.dispatch import _exchanged, _Join, all_to_all
from autoep.runtime.recipes import (
    as_structure,
    chains,
    check_facts,
    check_proven,
    join_backward_exchanges,
    watching_experts,
    watching_facts,
    watching_folded,
)
from autoep.runtime.recipes.deferred import (
    Call,
    Deferring,
    ReplayError,
    Tape,
    _ctx,
    entered,
)
from autoep.runtime.recipes.local_experts import (
    GROUP,
    place_experts,
    place_new_tensors,
    placed_experts,
    report_counts,
    spec_of,
)
from autoep.runtime.shared import InstanceMethod

REPLAY = "_autoep_replay"  # the block attribute holding its ``_Replay``
PLACED = "_autoep_placed"  # on an expert held in a plain dict/list: (the attribute, its entry) when it was placed
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # the rows' dtypes the exchange sends


@dataclass(frozen=True)
class _Replay:
    """What the replayed forward needs, fixed at apply time (plain values: a deep copy stays consistent)."""

    proven_code: object  # the class forward's code object proven at apply time
    keys: tuple[str, ...]  # how the model names each expert: ``experts[2]``, ``experts['a']``
    # per expert: "" where a call on (..., D) may travel as (prod(...), D) rows (``leading_dims_free``), else
    # the construct of its forward that reads a leading dim or the rank (the ReplayError names it)
    pinned: tuple[str, ...]
    # experts in a plain dict/list attribute of the block: which entry is which registered child (checked per call)
    plain: plain_experts.PlainExperts | None = None

    def __reduce__(self):
        # A code object does not pickle; its marshalled bytes do (``torch.save(model)``), read back at load.
        fields = [getattr(self, f.name) for f in dataclasses.fields(self)]
        return _unmarshalled, (marshal.dumps(self.proven_code), *fields[1:])


def _unmarshalled(code: bytes, *fields) -> _Replay:
    return _Replay(marshal.loads(code), *fields)


# ---------------------------------------------------------------------------------------------
# The factory
# ---------------------------------------------------------------------------------------------


def ep_replay_block(module: nn.Module, *, ep_mesh, structure: dict | MoeStructure, fast_path: bool = True) -> None:
    """Make a block with module experts EP-ready in place (factory contract: ``autoep.runtime.recipes``): its
    experts are placed (this rank keeps its own, the others become ``meta`` stand-ins; ``PlanError`` where
    ep_size does not divide the expert count; ``ep_mesh=None``: no exchange) and each call of the block runs
    its own class forward once, its expert outputs deferred to the exchange (module docstring). ``fast_path`` is accepted for the table's
    contract; the experts always run their own forward here."""
    facts = as_structure(structure)
    with watching_facts(module):
        validate(module, structure=facts)
    if facts.expert_members:
        _place_members(module, facts, ep_mesh)
    else:
        _place_container(module, facts, ep_mesh)
    join_backward_exchanges(module, ep_mesh)
    watching_folded(module, facts.folded)  # e.g. an expert's dropout proven idle in eval
    # An instance attribute shadows the class forward; nn.Module.__call__ (and the block's hooks) still run.
    module.forward = InstanceMethod(module, _replayed_forward)  # pickled by reference (``runtime.shared``)


def _place_container(module: nn.Module, facts: MoeStructure, ep_mesh) -> None:
    """The experts are the entries of one container (or of a plain dict/list attribute of the block)."""
    # The container's leading entries are the experts; entries its forward reads by name (NLLB's token dropout)
    # stay where the token is, as the rest of the block (``replay_proof.num_experts``, checked by validate).
    num_experts = replay_proof.num_experts(module, facts.experts_path)
    # before the stand-ins replace experts
    pinned = replay_proof.leading_dims_pinned(module, facts.experts_path, bool(facts.expert_draws))
    labels, _ = replay_proof.expert_labels(module, facts.experts_path)
    # Experts in a plain dict/list attribute are the block's own registered children: placed under their names
    # (the attribute and the registration are one object each, so both reach the placed expert or its stand-in).
    plain = plain_experts.holder(module, facts.experts_path) if replay_proof.is_plain(module, facts.experts_path) \
        else None
    place_experts(module, path="" if plain else facts.experts_path, num_experts=num_experts, identity_experts=0,
                  ep_mesh=ep_mesh, swiglu=None, act="", fast_path=False, name=type(module).__name__,
                  keys=plain.names if plain else None)
    for i, name in enumerate(plain.names if plain else ()):  # which entry each placed module is (``_plain_changed``)
        setattr(module._modules[name], PLACED, (plain.attr, i))
    names = tuple(labels[:num_experts])
    setattr(module, REPLAY, _Replay(_forward_code(type(module)), names, pinned, plain))
    # The proofs hold for these modules: one of another class, or a forward set on one (replay calls the class
    # forward and would drop it), raises before each call (``check_proven``), naming the expert.
    watching_experts(module, "" if plain else facts.experts_path, spec_of(module).keys[:num_experts], names)


def _place_members(module: nn.Module, facts: MoeStructure, ep_mesh) -> None:
    """One expert is several modules (``MoeStructure.expert_members``: aligned containers, or a list the forward
    builds): each module is placed as one "expert" of the exchange, expert e's modules consecutive, so all of them
    lie on e's owner (``LocalExperts.members``) and a chained call (``lora_B[e](lora_A[e](x))``) runs there in the
    next exchange stage. Their names stay the model's (``lora_A.0.weight``)."""
    members = facts.expert_members
    slots = tuple(path for expert in members for path in expert)
    pinned = replay_proof.leading_dims_pinned(module, facts.experts_path, bool(facts.expert_draws), members)
    names = tuple(replay_proof.member_label(path) for path in slots)
    place_experts(module, path="", num_experts=len(slots), identity_experts=0, ep_mesh=ep_mesh, swiglu=None, act="",
                  fast_path=False, name=type(module).__name__, keys=slots, members=len(members[0]))
    setattr(module, REPLAY, _Replay(_forward_code(type(module)), names, pinned, None))
    watching_experts(module, "", slots, names)


def validate(module: nn.Module, *, structure: dict | MoeStructure, **_) -> None:
    """Resolve-time check (an explicit ``_target_`` included): the block's experts are the container at
    ``structure.experts_path`` its forward calls, each proven row-local, deterministic and stateless, and the
    folded facts are the proven ones (random draws accepted where ``structure.expert_draws`` records them:
    ``PlanEntry.expert_draws=on_owner``). Raises ``UnsupportedModuleStructure`` naming the key otherwise."""
    facts, name = as_structure(structure), type(module).__name__
    if spec_of(module) is not None:
        raise UnsupportedModuleStructure(name, "the block is already EP-ready (apply_plan ran on it)")
    try:
        proven = replay_proof.replay_facts(module, facts.experts_path, bool(facts.expert_draws))
    except Refusal as exc:
        raise UnsupportedModuleStructure(name, str(exc)) from None
    for key, value in {"expert_members": (), **proven}.items():  # members recorded only where proven
        given = getattr(facts, key)
        if given != value:
            raise UnsupportedModuleStructure(name, f"structure.{key}={given!r}, but the experts are proven "
                                                   f"{key}={value!r}")


def _forward_code(cls: type):
    return getattr(inspect.unwrap(cls.forward), "__code__", None)


# ---------------------------------------------------------------------------------------------
# One call of the block
# ---------------------------------------------------------------------------------------------


def _replayed_forward(self: nn.Module, *args, **kwargs):
    replay: _Replay = getattr(self, REPLAY)
    cls = type(self)
    code = _forward_code(cls)
    if code is not replay.proven_code and code != replay.proven_code:  # equal: the same bytecode (a pickle's copy)
        raise ReplayError(f"{cls.__name__}.forward was replaced, or its __code__ swapped, after apply_plan; apply "
                          "the plan again to a fresh model built with the new code")
    spec = spec_of(self)
    # Raised before the forward (through the exchange's counts, so every peer stops too); experts not looked up.
    changed = _plain_changed(self, replay, "was changed after apply_plan")
    experts = placed_experts(self, spec)[:spec.num_experts] if changed is None else []
    place_new_tensors(self, spec, experts)
    group = getattr(self, GROUP).value if spec.ep_size > 1 else None
    device = _device(args, kwargs, self)
    tape = Tape(cls.__name__)
    output, failure = None, None
    try:
        # After every pre-hook (a user's, registered after apply, may change a value the proofs folded).
        check_proven(self)
        if changed is not None:
            raise changed
        _check_hooks(self, replay, experts)
        with _answering(experts, _Caller(self, replay, tape).call), Deferring(tape):
            output = cls.forward(self, *args, **kwargs)
        if tape.failure is not None:  # raised in the forward and caught there: still a failure
            raise tape.failure
        changed = _plain_changed(self, replay, "was changed by the block's forward")
        if changed is not None:
            raise changed
        _facts_unchanged(self, "after its last expert call")
        tape.check_unchanged()
    except Exception as exc:  # noqa: BLE001 - reported to every peer with the counts, then raised here
        failure = exc
    return run_exchanges(self, spec, experts, tape, output, failure, group, device,
                         lambda c: _rows_of_call(self, replay, tape, c))


def run_exchanges(block: nn.Module, spec, experts: list, tape: Tape, output, failure, group, device: torch.device,
                  rows_of, touch: tuple[Tensor, ...] = ()):
    """After the block's forward (``output``, or its ``failure``): every exchange the tape needs, each stage's taped
    calls run, every rank joining each exchange; then the pending objects settled. ``rows_of(call)``: the 2-D rows a
    call sends. ``touch``: local expert tensors that get a zero gradient wherever any rank made an expert call (3-D
    expert weights: the model gives every slice a gradient, zeros where no row reached it)."""
    cls = type(block)
    items = []
    try:  # each call, or a chain of calls fused on its owner (``chains``)
        items = chains.sent(tape, spec.members, experts) if failure is None else []
    except Exception as exc:  # noqa: BLE001 - reported to every peer with the counts
        failure = exc
    stages, stage, exchange_at = 1, 0, 1
    while stage < stages:  # every rank joins each exchange some rank has calls for, until no rank has pending work
        stage += 1
        if stage == exchange_at:
            sent = [s for s in items if s.stage == stage] if failure is None else []
            later = min((s.stage for s in items if s.stage > stage), default=0) if failure is None else 0
            try:
                rows = [rows_of(s.head) for s in sent]
            except Exception as exc:  # noqa: BLE001 - reported to every peer with the counts
                failure, rows = exc, []
            outputs, returned, stages, exchange_at = _exchange(
                block, spec, experts, sent, rows, [s.last.edited(tape) for s in sent], failure, group, device,
                tape.stages if stage == 1 else stages, later, touch if stage == 1 else ())
            for item, out in zip(sent, outputs):
                tape.answer(item.last, out)
            del sent, rows, outputs  # the tape's references alone (``Tape.settle``)
        try:
            tape.run(stage)
        except Exception as exc:  # noqa: BLE001 - agreed with every peer (the next exchange, or below)
            failure = exc
    del items
    # A non-reentrant checkpoint's recomputation stops at the last tensor the forward saved, which may be in the
    # deferred calls on one rank and past the block on another: no failure; this rank still joins the agreement.
    stop = failure if isinstance(failure, _CHECKPOINT_STOP) else None
    _agree(None if stop else failure, group, cls.__name__, device)
    if stop is not None:
        raise stop
    tape.settle()
    return _needing_grad(output, returned) if group is not None else output


_CHECKPOINT_STOP = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())


def _plain_changed(block: nn.Module, replay: _Replay, when: str) -> ReplayError | None:
    """Experts in a plain dict/list attribute: the error to raise where it no longer maps the same ids to the
    registered children autoep placed (an entry replaced or added, or a registered expert replaced with the entry
    still holding the old one, would run a module autoep never placed, whose parameters may not be the model's)."""
    if replay.plain is None:
        return None
    drift = replay.plain.drift(block)
    if not drift:  # the same map; each entry still the module placed there (not a new one, nor two swapped)
        drift = next((f"{replay.plain.label(i)} is no longer the module autoep placed there" for i, entry in
                      enumerate(replay.plain.entries(block)) if getattr(entry, PLACED, None) != (replay.plain.attr, i)),
                     "")
    if drift:
        return ReplayError(f"{type(block).__name__}.{replay.plain.attr} {when}: {drift}; autoep placed the experts it "
                          f"held then. Apply the plan again to a fresh model built with the new experts")
    return None


def _needing_grad(output, returned: Tensor):
    """``output``, its first floating tensor (the block's hidden states; a layer may drop the rest, e.g. router
    logits) joined to the returned rows where the exchange needs a backward and that tensor has no graph (a rank
    whose block made no expert call: peers wait in the exchange's backward). Values unchanged; the hooks
    ``join_backward_exchanges`` installs join a dropped exchange to that tensor where it has a graph."""
    if not returned.requires_grad:
        return output
    items = list(output) if isinstance(output, (tuple, list)) else [output]
    head = next((i for i, t in enumerate(items) if isinstance(t, Tensor) and t.is_floating_point()), None)
    # A leaf output (the block returned its input as it is) is no path either: joined too.
    if head is None or items[head].requires_grad and items[head].grad_fn is not None:
        return output
    items[head] = _Join.apply(items[head], returned)
    if isinstance(output, Tensor):
        return items[0]
    return type(output)(items) if isinstance(output, list) or type(output) is tuple else type(output)(*items)


def _facts_unchanged(block: nn.Module, when: str) -> None:
    """The values the proofs folded (an expert's attribute, a global its forward reads) as at apply: the owner runs
    the experts after the block's forward, so one the forward changes around a call would not reach it."""
    try:
        check_facts(block)
    except FactChanged as exc:
        raise ReplayError(f"{type(block).__name__}.forward changed a value its experts' proofs read ({exc}) {when}; "
                          "autoep runs the experts on their owner once the forward returns, so they would not see "
                          "it: set it outside the block's forward, or opt out") from None


def _check_hooks(block: nn.Module, replay: _Replay, experts: list[nn.Module]) -> None:
    """Hooks on an expert run at the caller, around its pending call, as in the model; hooks on a module inside an
    expert (and global module hooks) would run on the owner's rows: refused."""
    if global_hooks():
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        modes = [f"{type(m).__module__}.{type(m).__qualname__}"
                 for m in (*_get_current_function_mode_stack(), *_get_current_dispatch_mode_stack())]
        who = (f"the active mode {', '.join(modes)} registered global module hooks" if modes else
               "global module hooks are registered (torch.nn.modules.module.register_module_forward_hook and friends)")
        raise ReplayError(f"{type(block).__name__}: {who}; the experts' modules run on their owner, on every rank's "
                          "rows together, so such a hook would see other rows than in the model: leave it off around "
                          "the forward (or leave this block out of parallel.plan)")
    for key, expert in zip(replay.keys, experts):
        for name, module in expert.named_modules():
            if name and (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                         or module._backward_pre_hooks):
                raise ReplayError(f"{type(block).__name__}: {key}.{name} has a hook; the expert's modules run on its "
                                  "owner on every rank's rows together, so the hook would see other rows than in the "
                                  f"model: register it on {key} itself (it runs at the caller), or remove it")


@contextlib.contextmanager
def _answering(experts: list[nn.Module], answer):
    """Within: each expert's call (``expert(x)`` or ``expert.forward(x)``) is ``answer(e, expert, args,
    kwargs)``, inside ``nn.Module.__call__`` (so the expert's own hooks run around it, at the caller, once); the
    instance attributes go again on exit, whatever happens."""
    for e, expert in enumerate(experts):
        expert.forward = types.MethodType(_Answer(e, answer), expert)
    try:
        yield
    finally:
        for expert in experts:
            expert.__dict__.pop("forward", None)


class _Answer:
    def __init__(self, e: int, answer):
        self.e, self.answer = e, answer

    def __call__(self, expert: nn.Module, *args, **kwargs):
        return self.answer(self.e, expert, args, kwargs)


class _Caller:
    """Answers each expert call in the block's forward with a pending output (``deferred.Tape.expert_call``)."""

    def __init__(self, block: nn.Module, replay: _Replay, tape: Tape):
        self.block, self.replay, self.tape = block, replay, tape

    def call(self, e: int, expert: nn.Module, args: tuple, kwargs: dict) -> Tensor:
        i = len(self.tape.calls)
        arity = row_local.row_arity(expert)
        args, kwargs = _by_position(expert, arity, args, kwargs)
        if kwargs or len(args) != arity or not all(isinstance(a, Tensor) for a in args):
            given = [type(a).__name__ for a in args] + [f"{k}=" for k in kwargs]
            raise self.tape.fail(f"{self.replay.keys[e]} (expert call {i}) is called with ({', '.join(given)}); autoep "
                                 f"proves it row-local for {arity} per-row tensor(s), its forward's parameters without "
                                 "a default (the rows, then per-row extras), passed by position or by their names, "
                                 "and moves only those")
        x, extras = _packed(self.tape, self.replay.keys[e], i, args)
        _facts_unchanged(self.block, f"before {self.replay.keys[e]} (expert call {i})")
        inside = _inside_function()
        if inside:
            raise self.tape.fail(f"{self.replay.keys[e]} (expert call {i}) is called inside {inside}'s forward (a "
                                 "custom autograd.Function, or torch.utils.checkpoint(..., use_reentrant=True)); its "
                                 "backward would recompute or differentiate the expert where it does not run: use "
                                 "use_reentrant=False, or opt out")
        if x.dim() != 2:
            _lead_of(self.block, self.replay, e, i, x)  # raises where the expert may not take N-D rows
        width, dtype = _output_of(expert, x, self.block, self.replay.keys[e], extras)
        grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in expert.parameters()))
        with torch._C.DisableTorchFunction():
            shadow = torch.empty((*x.shape[:-1], *width), dtype=dtype, device="meta")
        return self.tape.expert_call(e, x, shadow, x.device, grad, extras)


def _by_position(expert: nn.Module, arity: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``expert(x[tok], pos_emb=pos[tok])`` as ``expert(x[tok], pos[tok])``: keywords that name the class forward's
    parameters without a default after those given by position (the ones its proof binds to rows, in order), all of
    them, moved into place; anything else as given (the caller raises: a keyword for a parameter with a default
    would change a value the proof took at its default)."""
    fn = getattr(type(expert), "forward", None)
    if not kwargs or not inspect.isfunction(fn) or len(args) + len(kwargs) != arity:
        return args, kwargs
    names = fn.__code__.co_varnames[1 + len(args):1 + arity]
    if set(kwargs) != set(names):
        return args, kwargs
    return (*args, *(kwargs[n] for n in names)), {}


MAX_EXTRAS = 6  # per-row tensors an expert call may pass after its rows (slots in the exchange's metadata)


def _packed(tape: Tape, key: str, i: int, args: tuple) -> tuple[Tensor, tuple[int, ...]]:
    """The rows of a call and its per-row extras (``expert(x[tok], pos[tok], w[tok, slot, None])``) as one
    ``(n, D + sum(widths))`` tensor, the extras after the rows' features, and the extras' widths: the pairs (row i,
    extra row i) travel together, as the expert reads them (its proof binds each extra to rows). Concatenated now, at
    the call, inside ``Deferring`` (taped where one of them is pending), differentiable in each: the gradient of a
    routing probability passed to the expert reaches the router. Each extra must be ``(n, w)`` of the rows' ``n``
    and dtype (one tensor moves); anything else raises naming the call."""
    x, extras = args[0], args[1:]
    if not extras:
        return x, ()
    bad = next((a for a in extras if a.dim() != 2 or a.shape[0] != x.shape[0] or a.dtype != x.dtype), None)
    if x.dim() != 2 or bad is not None or len(extras) > MAX_EXTRAS:
        shapes = ", ".join(f"{tuple(a.shape)} {a.dtype}".replace("torch.", "") for a in args)
        raise tape.fail(f"{key} (expert call {i}) is called on ({shapes}); autoep moves per-row extras with the rows "
                        f"only as (rows, width) tensors of the rows' count and dtype, at most {MAX_EXTRAS}, beside 2-D "
                        "rows (pass `w[tok, slot, None]`, not `w[tok, slot]`; cast a mask to the rows' dtype)")
    return torch.cat([x, *extras], dim=-1), tuple(a.shape[1] for a in extras)


def _inside_function() -> str:
    """The ``torch.autograd.Function`` whose forward is running on the stack (its ``ctx`` argument), if any, up to the
    block's call: an expert answered inside it would leave that Function's backward to a value the owner computes."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not _replayed_forward.__code__:
        ctx = frame.f_locals.get("ctx") if frame.f_code.co_name == "forward" else None
        if isinstance(ctx, torch.autograd.function.FunctionCtx):
            return type(ctx).__name__.removesuffix("Backward")
        frame = frame.f_back
    return ""


def _rows_of_call(block: nn.Module, replay: _Replay, tape: Tape, call: Call) -> Tensor:
    """The 2-D rows a call sends: its input's value, ``(..., D)`` flattened to ``(prod(...), D)`` (a layout change;
    exact for an expert proven to treat its leading dims alike, ``_lead_of``)."""
    x = tape.value(call.x)
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _lead_of(block: nn.Module, replay: _Replay, e: int, i: int, x: Tensor) -> tuple:
    """The leading shape of an N-D call, where the expert is proven to treat every dim before the last alike."""
    name, key = type(block).__name__, replay.keys[e]
    if x.dim() < 2:
        raise ReplayError(f"{name}: {key} (expert call {i}) is called on a tensor of shape {tuple(x.shape)}; autoep "
                          "proves experts row-local on (rows, features) and moves rows")
    if replay.pinned[e]:
        raise ReplayError(f"{name}: {key} (expert call {i}) is called on a tensor of shape {tuple(x.shape)}; autoep "
                          "moves such a call as its (prod(leading dims), features) rows only for an expert that treats "
                          f"every dim before the last alike, and this one does not: {replay.pinned[e]}")
    return tuple(x.shape[:-1])


# Per expert module, what ``_meta_output`` found for a call, by everything its output's width and dtype can depend on
# besides facts the proofs watch at every call (a changed one raises before the call): the input's trailing shape
# (all of it for an N-D call), dtype and device, the grad/autocast context, each of its tensors' dtype, shape and
# device, each of its modules' training flag. Running its forward for every call cost the CPU layer ~20% of a step.
_OUTPUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _output_of(expert: nn.Module, x: Tensor, block: nn.Module, key: str, extras: tuple[int, ...] = ()
               ) -> tuple[tuple[int, ...], torch.dtype]:
    tensors = tuple((t.dtype, t.shape, t.device) for t in (*expert.parameters(), *expert.buffers()))
    found = (tuple(x.shape[1:]) if x.dim() == 2 else tuple(x.shape), x.dtype, x.device, _ctx(), tensors,
             tuple(m.training for m in expert.modules()), extras)
    known = _OUTPUTS.setdefault(expert, {})
    if found not in known:
        known[found] = _meta_output(expert, x, block, key, extras)
    return known[found]


def _meta_output(expert: nn.Module, x: Tensor, block: nn.Module, key: str, extras: tuple[int, ...] = ()
                 ) -> tuple[tuple[int, ...], torch.dtype]:
    """The width and dtype of ``expert(x)`` (its class forward, no hooks) on fake tensors of the rows' device (no
    data read, nothing allocated; autocast applies as on the rows). For an N-D input, its output must be
    ``(..., P)`` and the rows' ``(n, P)`` of the same dtype (what the owner returns, reshaped)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    shapes = [(x.shape[0], x.shape[-1])] if x.dim() == 2 else [tuple(x.shape), (math.prod(x.shape[:-1]), x.shape[-1])]
    with torch._C.DisableTorchFunction(), FakeTensorMode(allow_non_fake_inputs=False) as fake:
        state = {n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=x.device)
                 for n, t in [*expert.named_parameters(), *expert.named_buffers()]}
        outs = []
        with torch.nn.utils.stateless._reparametrize_module(expert, state), torch.no_grad():
            for shape in shapes:
                rows = chains.unpacked(torch.empty(shape, dtype=x.dtype, device=x.device), extras)
                outs.append(type(expert).forward(expert, *rows))
        del fake
    out = outs[0]
    lead = tuple(x.shape[:-1])
    if not isinstance(out, Tensor) or out.dim() != x.dim() or tuple(out.shape[:-1]) != lead or not (
            len(outs) == 1 or isinstance(outs[1], Tensor) and tuple(outs[1].shape) == (shapes[1][0], out.shape[-1])
            and outs[1].dtype == out.dtype):
        raise ReplayError(f"{type(block).__name__}: {key} returns {type(out).__name__} "
                          f"{tuple(getattr(out, 'shape', ()))} for an input of shape {tuple(x.shape)}; autoep moves "
                          "one row of output per row of input, of the same leading shape")
    return tuple(out.shape[-1:]), out.dtype


# ---------------------------------------------------------------------------------------------
# The exchange
# ---------------------------------------------------------------------------------------------


def _tensors(value, out: list) -> list:
    if isinstance(value, Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, out)
    return out


def _device(args: tuple, kwargs: dict, block: nn.Module) -> torch.device:
    found = _tensors((args, kwargs), [])
    if found:
        return found[0].device
    return next((p.device for p in block.parameters() if not p.is_meta), torch.device("cpu"))


def _ctx_code(ctx: tuple) -> int:
    """A call's context (``deferred._ctx``) as one number the exchange carries: every rank's calls of one exchange
    run on their owners under one context."""
    grad, inference, cpu, cpu_dtype, cuda, cuda_dtype = ctx
    return (int(grad) + 2 * int(inference) + 4 * int(cpu) + 8 * _DTYPES.index(cpu_dtype) + 64 * int(cuda)
            + 128 * _DTYPES.index(cuda_dtype))


def _ctx_of(code: int) -> tuple:
    return (bool(code & 1), bool(code & 2), bool(code & 4), _DTYPES[(code >> 3) & 7], bool(code & 64),
            _DTYPES[(code >> 7) & 7])


def _meta_row(spec, items: list[chains.Sent], rows: list[Tensor], failure, experts: list[nn.Module], stages: int,
              later: int) -> list[int]:
    """What this rank tells every peer before the rows move: rows and calls per slot (an expert's route,
    ``chains.routes``: with one module per expert, the expert; where outputs go back flat, ``chains.flat``, one
    number per slot, rows + 1 where called and 0 where not, then each expert's activation per pair of members,
    ``chains.op_code``), the rows' width and dtype, the outputs' width (0 where they go back flat) and dtype (-1: no
    calls), whether the exchange needs a backward here (rows or local experts needing gradients), the calls'
    context (-1: none), how many exchanges its forward needs, the next stage it has calls for (0: none), and
    whether its forward held."""
    M, table = spec.members, chains.routes(spec.members)
    slots = spec.num_experts // M * len(table)
    counts, called = [0] * slots, [0] * slots
    ops = [0] * (spec.num_experts // M * (M - 1))
    for s, r in zip(items, rows):
        counts[s.slot] += r.shape[0]
        called[s.slot] = 1
        if s.op is not None:
            ops[s.slot // len(table) * (M - 1) + s.head.expert % M] = chains.op_code(s.op)
    flat = chains.flat(M)
    slot_part = [c + 1 if k else 0 for c, k in zip(counts, called)] + ops if flat else counts + called
    shapes = {(r.shape[1], r.dtype, (0,) if flat else tuple(s.last.out.shape[-1:]), s.last.out.dtype, s.head.extras)
              for s, r in zip(items, rows)}
    ctxs = {s.head.ctx for s in items}
    ok = failure is None and len(shapes) <= 1 and len(ctxs) <= 1 and all(
        len(s[2]) == 1 and s[1] in _DTYPES and s[3] in _DTYPES for s in shapes)
    width, dtype, out_width, out_dtype, extras = next(iter(shapes)) if shapes and ok else (-1, None, (-1,), None, ())
    codes = [_DTYPES.index(d) if d is not None else -1 for d in (dtype, out_dtype)]
    ctx = next(iter(ctxs)) if ctxs and ok else None
    local = experts[spec.first: spec.first + spec.num_local]
    grad = (ctx[0] if ctx else torch.is_grad_enabled()) and not (ctx or _ctx())[1] and (
        any(r.requires_grad for r in rows) or any(p.requires_grad for expert in local for p in expert.parameters()))
    return slot_part + [width, codes[0], out_width[0], codes[1], int(grad), _ctx_code(ctx) if ctx else -1,
                        *_padded(extras), stages, later, int(ok)]


def _padded(extras: tuple[int, ...]) -> list[int]:
    """The extras' widths (``Call.extras``) in ``MAX_EXTRAS`` slots of the exchange's metadata (0: unused)."""
    return [*extras, *[0] * (MAX_EXTRAS - len(extras))]



def _exchange(block: nn.Module, spec, experts: list[nn.Module], items: list[chains.Sent], rows: list[Tensor],
              edited: list[bool], failure, group, device: torch.device, stages: int,
              later: int, touch: tuple[Tensor, ...] = ()) -> tuple[list[Tensor], Tensor, int, int]:
    """The true output of every item of this exchange (a call, or a chain fused on its owner: its last call's;
    differentiable in its rows and the experts' parameters), the rows the reverse exchange returned, how many
    stages the slowest rank's forward needs, and the stage of the next exchange (the first any rank has calls
    for, ``later`` here; past the last stage: none). Raises on every rank when any rank's forward failed
    (``failure`` here: re-raised as it is). ``touch``: tensors given a zero gradient where the exchange needs a
    backward and any rank's forward made an expert call."""
    M, W = spec.members, spec.ep_size
    E, L = (n // M * len(chains.routes(M)) for n in (spec.num_experts, spec.num_local))  # slots, local slots
    flat = chains.flat(M)
    # Per peer: its slots' numbers (flat: one per slot; else counts, then called flags), its experts' activations
    # (flat only), then this rank's checks; X: where the checks start in a row.
    O, P = (n // M * (M - 1) for n in (spec.num_experts, spec.num_local)) if flat else (0, 0)
    blocks = [(0, L), (E, P)] if flat else [(0, L), (E, L)]
    X, tail = L + P if flat else 2 * L, E + O if flat else 2 * E
    mine = _meta_row(spec, items, rows, failure, experts, stages, later)
    if W > 1:
        # Layout: column block p of what this rank sends holds peer p's slots.
        per_peer = [torch.tensor([v for start, n in blocks for v in mine[start + p * n:start + (p + 1) * n]]
                                 + mine[tail:], dtype=torch.long, device=device) for p in range(W)]
        send = torch.stack(per_peer)
        meta_W = torch.empty_like(send)
        # NOTE: collective. Each rank learns what every peer sends its experts, and every peer's check.
        dist.all_to_all_single(meta_W, send, group=group)
    else:
        meta_W = torch.tensor([[v for start, n in blocks for v in mine[start:start + n]] + mine[tail:]],
                              dtype=torch.long, device=device)
    # NOTE: .tolist() syncs the host once per exchange for the split sizes and the peers' checks.
    meta = meta_W.tolist()
    _raise_if_failed(block, failure, [row[-1] for row in meta], mine)
    stages = max(row[-3] for row in meta)
    exchange_at = min([row[-2] for row in meta if row[-2] > 0], default=stages + 1)
    widths = {(row[X], row[X + 1], row[X + 2], row[X + 3], tuple(w for w in row[X + 6:X + 6 + MAX_EXTRAS] if w))
              for row in meta if row[X] >= 0}
    ctxs = {row[X + 5] for row in meta if row[X + 5] >= 0}
    if len(widths) > 1 or len(ctxs) > 1:
        raise ReplayError(f"{type(block).__name__}: ep ranks call its experts on rows of different widths or dtypes, "
                          f"or under different grad/autocast states, in one exchange ({sorted(widths)}, contexts "
                          f"{sorted(ctxs)}); autoep sends one kind of rows per exchange")
    width, dtype_code, out_width, out_code, extras = next(iter(widths)) if widths else (0, 0, 0, 0, ())
    ctx = _ctx_of(next(iter(ctxs))) if ctxs else _ctx()
    # recv_counts[r][l]: rows rank r sends to local slot l
    recv_counts = [[max(v - 1, 0) for v in row[:L]] if flat else row[:L] for row in meta]
    report_counts(block, torch.tensor(chains.rows_per_module(M, recv_counts), dtype=torch.long))
    called_L = [any(row[l] if flat else row[L + l] for row in meta) for l in range(L)]
    send_splits = [sum(r.shape[0] for s, r in zip(items, rows) if s.slot // L == p) for p in range(W)]
    recv_splits = [sum(c) for c in recv_counts]

    order = sorted(range(len(items)), key=lambda i: items[i].slot)  # stable: call order within a slot
    with entered(ctx):
        x_send_SD = torch.cat([rows[i] for i in order]) if items else \
            torch.empty((0, width), dtype=_DTYPES[dtype_code], device=device)
        # Every rank runs the exchanges' backward where any rank does (its peers wait in it): where a peer needs
        # gradients, rows that need none here become a leaf that does (its gradient is dropped).
        needs_grad = any(row[X + 4] for row in meta)
        if needs_grad and not x_send_SD.requires_grad:
            x_send_SD = x_send_SD.detach().requires_grad_()
        x_recv_RD = all_to_all(x_send_SD, recv_splits, send_splits, group) if W > 1 else x_send_SD

        # Each called local module's class forward (its own hooks ran at the caller), once per level of the routes
        # (``chains.run_routes``; one level where one module is one expert), on the rows every rank sent it
        # (grouped by source rank, then by slot: regrouped here by slot, then by source rank). One split (one
        # backward node that concatenates the pieces' gradients), not a narrow per piece: each narrow's backward
        # fills a zero tensor of the whole exchange's size, W * L of them per exchange.
        received = torch.split(x_recv_RD, [recv_counts[r][l] for r in range(W) for l in range(L)])
        pieces = chains.run_routes(M, experts[spec.first: spec.first + spec.num_local], received, called_L, W,
                                   type(block).__name__, [row[L:L + P] for row in meta], extras)
        out_dtype = _DTYPES[out_code] if widths else torch.float32
        back = [pieces[(r, l)] for r in range(W) for l in range(L) if (r, l) in pieces]
        if flat:  # layout change: each piece's (rows, P) as its elements, whatever its P (a fused chain's, or not)
            y_send_RP = torch.cat([p.reshape(-1) for p in back]) if back else \
                torch.empty((0,), dtype=out_dtype, device=device)
            out_splits = [sum(pieces[(r, l)].numel() for l in range(L) if (r, l) in pieces) for r in range(W)]
            back_splits = [sum(items[i].out_numel for i in order if items[i].slot // L == p) for p in range(W)]
        else:
            y_send_RP = torch.cat(back) if back else torch.empty((0, out_width), dtype=out_dtype, device=device)
            out_splits, back_splits = recv_splits, send_splits
        if not back and x_recv_RD.requires_grad:
            # No local expert called: the received (zero) rows reach nothing, so their exchange's backward would
            # not run here. Joined to what goes back (an identity; their gradient is zero).
            y_send_RP = _Join.apply(y_send_RP, x_recv_RD)
        if touch and needs_grad and stages >= 1:
            # 3-D expert weights: the model's one tensor gets a gradient for every slice once any expert ran on any
            # rank (zeros where none did); here a slice no rank's rows reached would keep None. Zero, joined.
            y_send_RP = _Join.apply(y_send_RP, *touch)
        if W > 1:
            y_back_SP = all_to_all(y_send_RP, back_splits, out_splits, group)
            _exchanged(y_back_SP)  # joined to the block's output if the block drops it (a rank without calls)
        else:
            y_back_SP = y_send_RP
        outputs: list[Tensor] = [None] * len(items)  # type: ignore[list-item]
        # One split, as for the received rows. A piece the block edits in place is cloned (autograd forbids an
        # in-place edit of a split's view). Layout change: an N-D call's rows (or a flat piece) go back to its
        # (..., P).
        if order:
            sizes = [items[i].out_numel if flat else rows[i].shape[0] for i in order]
            for i, out in zip(order, torch.split(y_back_SP, sizes)):
                out = out.clone() if edited[i] else out
                shape = items[i].last.out.shape
                outputs[i] = out if out.shape == shape else out.view(shape)
    return outputs, y_back_SP, stages, exchange_at


def _raise_if_failed(block: nn.Module, failure, oks: list[int], mine: list[int]) -> None:
    if failure is not None:
        raise failure
    if not mine[-1]:
        raise ReplayError(f"{type(block).__name__}: its expert calls on this rank mix rows of different widths or "
                          "dtypes, or of a dtype the exchange does not send; autoep sends one kind of rows per "
                          "exchange")
    failed = [r for r, ok in enumerate(oks) if not ok]
    if failed:
        raise ReplayError(f"{type(block).__name__}: ep rank(s) {failed} failed in the block's forward (their error "
                          "names it); every rank stops here rather than wait in an exchange")


def _agree(failure, group, name: str, device: torch.device) -> None:
    """Every rank raises when any rank's replay failed (one small all-reduce), so none waits in a backward."""
    if group is not None:
        flag = torch.tensor([0 if failure is None else 1], dtype=torch.long, device=device)
        # NOTE: collective and host sync, once per block call: whether every rank's replay held.
        dist.all_reduce(flag, group=group)
        if failure is None and flag.item():
            raise ReplayError(f"{name}: another ep rank's replay check failed (its error names it); every rank "
                              "stops here rather than wait in a backward exchange")
    if failure is not None:
        raise failure

