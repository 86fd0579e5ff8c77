"""Record, exchange, replay: the general execution of module experts under EP, whatever the loop's spelling.

The block's own forward runs twice, as written; only its calls into the experts travel (DESIGN.md "Record,
exchange, replay"):

1. **Record.** The block's class forward runs with every expert module's call answered by a placeholder of
   the right shape and dtype (zeros; the shape from the expert's forward run on ``meta``) and recorded:
   ``(expert id, input rows)``. It runs on copies of the block's tensor inputs (``replay_state.record_inputs``,
   differentiable to them: one copy of each per call), so an in-place edit of its input (Switch's router
   jitter) lands on the copy and is made once, in pass 2, on the input itself. Pass 1 must leave nothing behind
   (``replay_state``): what it wrote in the Python state the block reaches (attributes, containers, class
   attributes, the globals and closure variables its methods read, random generators) is put back; a tensor it
   edited in place (a parameter, a buffer, a tensor attribute, an input it could not copy) raises, naming it.
2. **Exchange.** Every recorded call's rows go to the expert's owner (experts split contiguously, as
   ``local_experts.LocalExperts`` places them) in ONE differentiable all-to-all; the owner runs each called
   local expert's own forward once on the rows every rank sent it (row-local: concatenation changes nothing),
   and the outputs go back by the reverse all-to-all.
3. **Replay.** The RNG restored, the block's forward runs again; each expert call must be the call recorded
   at the same position, with a bit-identical input, and gets that call's true output. Any difference (another
   expert, another input, more or fewer calls) means the block's expert inputs depend on expert outputs: it
   raises, naming the block and the call. The block's output is pass 2's: the model's own computation.

Gradients: the expert path reaches the block's input and the routing only through pass 1's rows (the
exchange's backward); everything else (routing weights applied to expert outputs, residuals, shared branches)
through pass 2, whose expert inputs get no gradient through the experts. An expert called with zero rows is
called with zero rows on its owner (zero gradients, as the model gives); an expert no rank calls is not called
(its gradients stay ``None``). Every rank joins both exchanges and their backward, with nothing to send too.
A failed check on one rank raises on every rank (their flags travel with the exchange's counts, and one small
all-reduce after pass 2), so no peer is left waiting in a collective.

Experts in a plain dict/list attribute of the block (``autoep.detect.plain_experts``: ``self.expert_by_id =
{i: self.expert_i}``, each value registered on the block) are placed under their registered names, so the entry
and the registration reach the one placed module; each call checks the attribute still maps the same ids to
those modules (``_plain_changed``: a change after apply or in the forward raises ``ReplayError`` naming the entry).

N-D calls: an expert called on ``(..., D)`` (VitPose runs every expert on the whole ``(batch, seq, D)``
tensor) travels as its ``(prod(...), D)`` rows, and its output comes back reshaped to ``(..., P)``: exact
only for an expert proven to treat every dim before the last alike (``row_local.ExpertProof.
leading_dims_free``); for any other expert such a call raises ``ReplayError`` naming the block, the expert,
the shape and the construct that reads a leading dim. 2-D calls are the rows as they are. Every proof holds
for the experts' modules as they were at apply: before each call, an expert or a module of one replaced by
another class, or a ``forward`` set on one (replay calls the class forward: it would be dropped), raises
``FactChanged`` naming the expert (``recipes.watching_experts``, checked once per call with the folded facts).

Cost: pass 1 repeats the block's own work outside the experts (routing, masks, casts) once more per call,
on one copy of each of the block's tensor inputs (freed after pass 1 unless its rows' graph saved it).

Shape legend: S rows sent (all recorded calls, grouped by expert), R rows received, D the rows' width,
P the experts' output width, E routed experts, L experts local to this rank, W ep ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import marshal
import math
import types
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import Tensor, nn

from autoep.detect import plain_experts, replay_proof
from autoep.detect.module_list_proof import global_hooks
from autoep.detect.source import Refusal
from autoep.detect.structure import MoeStructure
from autoep.errors import UnsupportedModuleStructure
from autoep.runtime.dispatch import _exchanged, _Join, all_to_all
from autoep.runtime.recipes import (
    as_structure,
    check_proven,
    join_backward_exchanges,
    watching_experts,
    watching_facts,
    watching_folded,
)
from autoep.runtime.recipes.local_experts import (
    GROUP,
    place_experts,
    placed_experts,
    report_counts,
    spec_of,
)
from autoep.runtime.recipes.replay_state import ReplayError, Snapshot, record_inputs, rng_state, set_rng_state
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


@dataclass
class _Call:
    """One recorded expert call: the expert id, its input rows (pass 1's, with their graph; an N-D input's
    flattened to 2-D), the leading shape of the input (``(n,)`` for 2-D rows), the rows' version counter at the
    call, and the output's width and dtype (from the expert's forward on ``meta``)."""

    expert: int
    rows: Tensor
    lead: tuple[int, ...]
    version: int
    out_width: tuple[int, ...]
    out_dtype: torch.dtype


# ---------------------------------------------------------------------------------------------
# The factory
# ---------------------------------------------------------------------------------------------


def ep_replay_block(module: nn.Module, *, ep_mesh, structure: dict | MoeStructure, fast_path: bool = True) -> None:
    """Make a block with module experts EP-ready in place (factory contract: ``autoep.runtime.recipes``): its
    experts are placed (this rank keeps its own, the others become ``meta`` stand-ins; ``PlanError`` where
    ep_size does not divide the expert count; ``ep_mesh=None``: no exchange) and each call of the block runs
    record / exchange / replay around its own class forward. ``fast_path`` is accepted for the table's
    contract; the experts always run their own forward here."""
    facts = as_structure(structure)
    with watching_facts(module):
        validate(module, structure=facts)
    # The container's leading entries are the experts; entries its forward reads by name (NLLB's token dropout)
    # stay where the token is, as the rest of the block (``replay_proof.num_experts``, checked by validate).
    num_experts = replay_proof.num_experts(module, facts.experts_path)
    pinned = replay_proof.leading_dims_pinned(module, facts.experts_path)  # before the stand-ins replace experts
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
    join_backward_exchanges(module, ep_mesh)
    watching_folded(module, facts.folded)  # e.g. an expert's dropout proven idle in eval
    # An instance attribute shadows the class forward; nn.Module.__call__ (and the block's hooks) still run.
    module.forward = InstanceMethod(module, _replayed_forward)  # pickled by reference (``runtime.shared``)


def validate(module: nn.Module, *, structure: dict | MoeStructure, **_) -> None:
    """Resolve-time check (an explicit ``_target_`` included): the block's experts are the container at
    ``structure.experts_path`` its forward calls, each proven row-local, deterministic and stateless, and the
    folded facts are the proven ones. Raises ``UnsupportedModuleStructure`` naming the key otherwise."""
    facts, name = as_structure(structure), type(module).__name__
    if spec_of(module) is not None:
        raise UnsupportedModuleStructure(name, "the block is already EP-ready (apply_plan ran on it)")
    try:
        proven = replay_proof.replay_facts(module, facts.experts_path)
    except Refusal as exc:
        raise UnsupportedModuleStructure(name, str(exc)) from None
    for key, value in proven.items():
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
    # Raised in pass 1 (through the exchange's counts, so every peer stops too); its experts are not looked up.
    changed = _plain_changed(self, replay, "was changed after apply_plan")
    experts = placed_experts(self, spec)[:spec.num_experts] if changed is None else []
    group = getattr(self, GROUP).value if spec.ep_size > 1 else None
    rng = rng_state()
    recorder = _Recorder(self, replay, experts, _context())
    before = Snapshot(self, args, kwargs)
    try:
        # After every pre-hook (a user's, registered after apply, may change a value the proofs folded): raised
        # through the exchange's counts, so every peer stops too.
        check_proven(self)
        if changed is not None:
            raise changed
        if global_hooks():
            raise ReplayError(f"{cls.__name__}: global module hooks are registered; replay calls each expert twice "
                              "(answered in the block's forward, and on its owner's rows), so such a hook would run on "
                              "both, on other batches of rows than the model's own call: remove it around the forward "
                              "(or leave this block out of parallel.plan)")
        # On copies of the block's inputs: an in-place edit of its input (Switch's router jitter) lands on a
        # copy here and is made once, on the input itself, in pass 2, as in the block's own call.
        record_args, record_kwargs = record_inputs(args, kwargs)
        with _answering(experts, recorder.record):
            cls.forward(self, *record_args, **record_kwargs)
        del record_args, record_kwargs  # freed unless pass 1's rows saved them for the backward
        failure = None
    except Exception as exc:  # noqa: BLE001 - reported to every peer with the counts, then raised here
        failure = exc
    finally:
        set_rng_state(rng)
    try:
        before.undo(cls.__name__)
        _rows_unchanged(recorder)
    except Exception as exc:  # noqa: BLE001 - reported to every peer with the counts, then raised here
        failure = failure or exc
    outputs, returned = _exchange(self, spec, experts, recorder.calls, failure, group, _device(args, kwargs, self))
    replayer = _Replayer(self, replay, recorder.calls, outputs)
    try:
        with _answering(experts, replayer.answer):
            output = cls.forward(self, *args, **kwargs)
        replayer.finish()
        changed = _plain_changed(self, replay, "was changed by the block's forward")
        if changed is not None:
            raise changed
        failure = None
    except Exception as exc:  # noqa: BLE001 - agreed with every peer first, then raised
        failure = exc
    # A non-reentrant checkpoint's recomputation stops at the last tensor the forward saved, which may be in
    # pass 2 on one rank and past the block on another: no failure; this rank still joins the agreement.
    stop = failure if isinstance(failure, _CHECKPOINT_STOP) else None
    _agree(None if stop else failure, group, cls.__name__, _device(args, kwargs, self))
    if stop is not None:
        raise stop
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
    """``output``, its first tensor joined to the returned rows where the exchange needs a backward and no
    output tensor needs a gradient (a rank whose block made no expert call: the block's output may not depend
    on anything trainable, yet peers wait in the exchange's backward). Values unchanged; the hooks
    ``join_backward_exchanges`` installs join a dropped exchange to an output that does need a gradient."""
    if not returned.requires_grad:
        return output
    items = list(output) if isinstance(output, (tuple, list)) else [output]
    tensors = [i for i, t in enumerate(items) if isinstance(t, Tensor) and t.is_floating_point()]
    # A leaf output (the block returned its input as it is) is no path either: joined too.
    if not tensors or any(items[i].requires_grad and items[i].grad_fn is not None for i in tensors):
        return output
    items[tensors[0]] = _Join.apply(items[tensors[0]], returned)
    if isinstance(output, Tensor):
        return items[0]
    return type(output)(items) if isinstance(output, list) or type(output) is tuple else type(output)(*items)


@contextlib.contextmanager
def _answering(experts: list[nn.Module], answer):
    """Within: each expert's call (``expert(x)`` or ``expert.forward(x)``) is ``answer(e, expert, args,
    kwargs)``; the instance attributes go again on exit, whatever happens."""
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


class _Recorder:
    """Pass 1: records each expert call and answers it with zeros of its output's shape and dtype."""

    def __init__(self, block: nn.Module, replay: _Replay, experts: list[nn.Module], context: tuple):
        self.block, self.replay, self.experts, self.context = block, replay, experts, context
        self.calls: list[_Call] = []
        self._shapes: dict[tuple, tuple] = {}

    def record(self, e: int, expert: nn.Module, args: tuple, kwargs: dict) -> Tensor:
        rows, lead = _rows_of(self.block, self.replay, e, len(self.calls), args, kwargs)
        now = _context()
        if now != self.context:
            changed = [name for name, a, b in zip(_CONTEXT, self.context, now) if a != b]
            raise ReplayError(f"{type(self.block).__name__}: {self.replay.keys[e]} (expert call {len(self.calls)}) is "
                              f"called with {', '.join(changed)} changed by the block's forward around it; autoep runs "
                              "the experts on their owner under the state the block was called in, so they would "
                              "compute otherwise (move the autocast / no_grad outside the block, or opt out)")
        given = args[0]
        key = (e, given.shape[1:] if given.dim() == 2 else given.shape, given.dtype)
        if key not in self._shapes:
            self._shapes[key] = _output_of(expert, given, rows, self.block, self.replay.keys[e], self.context)
        width, dtype = self._shapes[key]
        self.calls.append(_Call(e, rows, lead, rows._version, width, dtype))
        return torch.zeros((*lead, *width), dtype=dtype, device=rows.device)


class _Replayer:
    """Pass 2: each expert call is checked against the call recorded at its position and gets its output."""

    def __init__(self, block: nn.Module, replay: _Replay, calls: list[_Call], outputs: list[Tensor]):
        self.block, self.replay, self.calls, self.outputs = block, replay, calls, outputs
        self.position = 0

    def answer(self, e: int, expert: nn.Module, args: tuple, kwargs: dict) -> Tensor:
        i, name, keys = self.position, type(self.block).__name__, self.replay.keys
        rows, lead = _rows_of(self.block, self.replay, e, i, args, kwargs)
        if i >= len(self.calls):
            raise ReplayError(f"{name}.forward: {keys[e]} (expert call {i}) was not called when the experts answered "
                              f"placeholders ({len(self.calls)} calls): which experts the block calls depends on an "
                              f"earlier expert's output{_last(self.calls, i, keys)}; {_ONE_EXCHANGE}")
        recorded = self.calls[i]
        if i == 0 and (recorded.expert != e or recorded.lead != lead or not _same(rows, recorded.rows)):
            raise ReplayError(f"{name}.forward: its first expert call went to {keys[recorded.expert]} in the record "
                              f"pass and to {keys[e]} in the replay{'' if recorded.expert != e else ', on other rows'}"
                              ": no expert output can explain it, so the forward's state changed between the passes "
                              "(something pass 1 wrote that autoep does not put back: a write outside the block's "
                              "modules, classes, the globals its methods read and their plain containers); "
                              "record/exchange/replay cannot run it (opt out: an explicit local_compute_fn._target_)")
        if recorded.expert != e:
            raise ReplayError(f"{name}.forward: expert call {i} went to {keys[recorded.expert]} when the experts "
                              f"answered placeholders and to {keys[e]} with their true outputs: which expert the block "
                              f"calls depends on an earlier expert's output{_last(self.calls, i, keys)}; {_ONE_EXCHANGE}")
        if recorded.lead != lead:
            raise ReplayError(f"{name}.forward: {keys[e]} (expert call {i}) got an input of leading shape {lead} "
                              f"with the experts' true outputs and {recorded.lead} with placeholders: its input "
                              f"depends on an earlier expert's output{_last(self.calls, i, keys)}; {_ONE_EXCHANGE}")
        if not _same(rows, recorded.rows):
            j = _source_call(rows, self.outputs, i)
            source = f"{keys[self.calls[j].expert]}'s output (expert call {j})" if j is not None else \
                f"an earlier expert's output{_last(self.calls, i, keys)}"
            raise ReplayError(f"{name}.forward: {keys[e]} (expert call {i}) got its input from {source}; "
                              f"{_ONE_EXCHANGE}")
        self.position += 1
        out = self.outputs[i]
        # Layout change: an N-D call's rows came back as (n, P); the expert would have returned (..., P).
        return out if len(lead) == 1 else out.reshape(*lead, *out.shape[1:])

    def finish(self) -> None:
        if self.position != len(self.calls):
            raise ReplayError(f"{type(self.block).__name__}.forward made {self.position} expert calls with the experts' "
                              f"true outputs and {len(self.calls)} with placeholders: which experts it calls depends "
                              f"on an earlier expert's output; {_ONE_EXCHANGE}")


_ONE_EXCHANGE = ("record/exchange/replay runs all of a call's experts in one exchange, so no expert's input or "
                 "choice may depend on another expert's output (opt out: an explicit local_compute_fn._target_)")


def _source_call(rows: Tensor, outputs: list[Tensor], upto: int) -> int | None:
    """The latest expert call before ``upto`` whose output ``rows`` were computed from, found in the autograd
    graph of ``rows`` (None where the outputs carry no graph: no_grad, frozen experts)."""
    nodes = [outputs[j].grad_fn for j in range(upto)]  # alive while their ids are compared
    held = {id(n): j for j, n in enumerate(nodes) if n is not None}
    stack, seen, found = [rows.grad_fn], {}, []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node  # held: an id is not reused while the walk compares ids
        if id(node) in held:
            found.append(held[id(node)])
        stack += [next_node for next_node, _ in node.next_functions]
    return max(found) if found else None


_CONTEXT = ("grad mode", "inference mode", "cpu autocast", "cpu autocast dtype", "cuda autocast",
            "cuda autocast dtype", "torch-function modes", "dispatch modes")


def _context() -> tuple:
    """What decides how an expert's forward computes besides its input: grad and inference mode, autocast,
    active modes. The owner runs the experts under the block's entry state; a call under another is refused."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"), torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
            torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack())


def _last(calls: list[_Call], i: int, keys: tuple[str, ...]) -> str:
    return f" (the expert called before it: {keys[calls[i - 1].expert]})" if i else ""


def _rows_of(block: nn.Module, replay: _Replay, e: int, i: int, args: tuple,
             kwargs: dict) -> tuple[Tensor, tuple]:
    """The rows an expert call passes, as (rows, features), and the leading shape of its input: the experts
    are proven row-local for ``expert(rows)`` on 2-D rows (``autoep.detect.row_local``), and an ``(..., D)``
    input is its ``(prod(...), D)`` rows only for an expert proven to treat its leading dims alike."""
    name, key = type(block).__name__, replay.keys[e]
    if kwargs or len(args) != 1 or not isinstance(args[0], Tensor):
        given = [type(a).__name__ for a in args] + [f"{k}=" for k in kwargs]
        raise ReplayError(f"{name}: {key} (expert call {i}) is called with ({', '.join(given)}); "
                          "autoep proves experts row-local for one (rows, features) tensor and moves only that")
    x = args[0]
    if x.dim() == 2:
        return x, (x.shape[0],)
    if x.dim() < 2:
        raise ReplayError(f"{name}: {key} (expert call {i}) is called on a tensor of shape {tuple(x.shape)}; autoep "
                          "proves experts row-local on (rows, features) and moves rows")
    if replay.pinned[e]:
        raise ReplayError(f"{name}: {key} (expert call {i}) is called on a tensor of shape {tuple(x.shape)}; autoep "
                          "moves such a call as its (prod(leading dims), features) rows only for an expert that treats "
                          f"every dim before the last alike, and this one does not: {replay.pinned[e]}")
    lead = tuple(x.shape[:-1])
    # Layout change: (..., D) -> (n, D). A view where the input allows (its version counter is the input's, so a
    # later in-place edit of it is caught); else a copy of the values the expert was called with.
    return x.reshape(math.prod(lead), x.shape[-1]), lead


# Per expert module, what ``_meta_output`` found for a 2-D call, by everything its output's width and dtype can
# depend on besides facts the proofs watch at every call (a changed one raises before the call): the rows' width,
# dtype and device, the grad/autocast/mode context, each of its tensors' dtype, shape and device, each of its
# modules' training flag. Running its forward on meta for every call cost the CPU layer ~20% of a step (16 experts).
_OUTPUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _output_of(expert: nn.Module, given: Tensor, rows: Tensor, block: nn.Module, key: str,
               context: tuple) -> tuple[tuple[int, ...], torch.dtype]:
    # An N-D call: its leading shape is checked against the expert's output each time. An active torch-function
    # or dispatch mode: the context holds how many, not which, so nothing is kept under one.
    if given.dim() != 2 or context[-1] or context[-2]:
        return _meta_output(expert, given, rows, block, key)
    tensors = tuple((t.dtype, t.shape, t.device) for t in (*expert.parameters(), *expert.buffers()))
    found = (given.shape[1], given.dtype, given.device, context, tensors, tuple(m.training for m in expert.modules()))
    known = _OUTPUTS.setdefault(expert, {})
    if found not in known:
        known[found] = _meta_output(expert, given, rows, block, key)
    return known[found]


def _meta_output(expert: nn.Module, given: Tensor, rows: Tensor, block: nn.Module,
                 key: str) -> tuple[tuple[int, ...], torch.dtype]:
    """The width and dtype of ``expert(given)``, from its own forward on ``meta`` (no data read, nothing
    allocated): its tensors as meta copies, its recorder stepped aside for the run. For an N-D input, its
    output must be ``(..., P)`` and the rows' ``(n, P)`` of the same dtype (what the owner returns, reshaped)."""
    answer = expert.__dict__.pop("forward")
    try:
        state = {n: t.to("meta") for n, t in [*expert.named_parameters(), *expert.named_buffers()]}
        with torch.no_grad():
            outs = [torch.func.functional_call(expert, state, (t.detach().to("meta"),))
                    for t in ((rows,) if given.dim() == 2 else (given, rows))]
    finally:
        expert.forward = answer
    out = outs[0]
    lead = tuple(given.shape[:-1])
    if not isinstance(out, Tensor) or out.dim() != given.dim() or tuple(out.shape[:-1]) != lead or not (
            len(outs) == 1 or isinstance(outs[1], Tensor) and outs[1].shape == (rows.shape[0], out.shape[-1])
            and outs[1].dtype == out.dtype):
        raise ReplayError(f"{type(block).__name__}: {key} returns {type(out).__name__} "
                          f"{tuple(getattr(out, 'shape', ()))} for an input of shape {tuple(given.shape)}; autoep moves "
                          "one row of output per row of input, of the same leading shape")
    return tuple(out.shape[-1:]), out.dtype


def _same(a: Tensor, b: Tensor) -> bool:
    """Bit-identical: shape, dtype, device and every element (NaN where the other is NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if torch.equal(a, b):
        return True
    if not a.is_floating_point():
        return False
    both_nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a == b) | both_nan).all())


# ---------------------------------------------------------------------------------------------
# Pass 1 leaves nothing behind: ``replay_state``
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


def _rows_unchanged(recorder: _Recorder) -> None:
    for i, call in enumerate(recorder.calls):
        if call.rows._version != call.version:
            raise ReplayError(f"{type(recorder.block).__name__}.forward wrote the rows it gave "
                              f"{recorder.replay.keys[call.expert]} (expert call {i}) in place after the call, during "
                              "the record pass")


# ---------------------------------------------------------------------------------------------
# The exchange
# ---------------------------------------------------------------------------------------------


def _device(args: tuple, kwargs: dict, block: nn.Module) -> torch.device:
    found = _tensors((args, kwargs), [])
    if found:
        return found[0].device
    return next((p.device for p in block.parameters() if not p.is_meta), torch.device("cpu"))


def _meta_row(spec, calls: list[_Call], failure, experts: list[nn.Module]) -> list[int]:
    """What this rank tells every peer before the rows move: rows and calls per expert, the rows' width and
    dtype, the outputs' width and dtype (-1: no calls), whether the exchange needs a backward here (rows or
    local experts needing gradients), and whether its pass 1 held."""
    E = spec.num_experts
    counts, called = [0] * E, [0] * E
    for c in calls:
        counts[c.expert] += c.rows.shape[0]
        called[c.expert] = 1
    shapes = {(c.rows.shape[1], c.rows.dtype, c.out_width, c.out_dtype) for c in calls}
    ok = failure is None and len(shapes) <= 1 and all(len(s[2]) == 1 and s[1] in _DTYPES and s[3] in _DTYPES
                                                      for s in shapes)
    width, dtype, out_width, out_dtype = next(iter(shapes)) if shapes and ok else (-1, None, (-1,), None)
    codes = [_DTYPES.index(d) if d is not None else -1 for d in (dtype, out_dtype)]
    local = experts[spec.first: spec.first + spec.num_local]
    grad = torch.is_grad_enabled() and (any(c.rows.requires_grad for c in calls) or any(
        p.requires_grad for expert in local for p in expert.parameters()))
    return counts + called + [width, codes[0], out_width[0], codes[1], int(grad), int(ok)]


def _exchange(block: nn.Module, spec, experts: list[nn.Module], calls: list[_Call], failure, group,
              device: torch.device) -> tuple[list[Tensor], Tensor]:
    """The true output of every recorded call (differentiable in pass 1's rows and the experts' parameters),
    and the rows the reverse exchange returned. Raises on every rank when any rank's pass 1 failed
    (``failure`` here: re-raised as it is)."""
    E, W, L = spec.num_experts, spec.ep_size, spec.num_local
    mine = _meta_row(spec, calls, failure, experts)
    if W > 1:
        # Layout: column block p of what this rank sends holds the counts of peer p's experts.
        per_peer = [torch.tensor(mine[p * L:(p + 1) * L] + mine[E + p * L:E + (p + 1) * L] + mine[2 * E:],
                                 dtype=torch.long, device=device) for p in range(W)]
        send = torch.stack(per_peer)
        meta_W = torch.empty_like(send)
        # NOTE: collective. Each rank learns what every peer sends its experts, and every peer's check.
        dist.all_to_all_single(meta_W, send, group=group)
    else:
        meta_W = torch.tensor([mine[:L] + mine[E:E + L] + mine[2 * E:]], dtype=torch.long, device=device)
    # NOTE: .tolist() syncs the host once per block call for the split sizes and the peers' checks.
    meta = meta_W.tolist()
    _raise_if_failed(block, failure, [row[2 * L + 5] for row in meta], mine)
    widths = {(row[2 * L], row[2 * L + 1], row[2 * L + 2], row[2 * L + 3]) for row in meta if row[2 * L] >= 0}
    if len(widths) > 1:
        raise ReplayError(f"{type(block).__name__}: ep ranks call its experts on rows of different widths or dtypes "
                          f"({sorted(widths)}); autoep sends one kind of rows per exchange")
    width, dtype_code, out_width, out_code = next(iter(widths)) if widths else (0, 0, 0, 0)
    recv_counts = [row[:L] for row in meta]  # recv_counts[r][l]: rows rank r sends to local expert l
    report_counts(block, torch.tensor([sum(c[l] for c in recv_counts) for l in range(L)], dtype=torch.long))
    called_L = [any(row[L + l] for row in meta) for l in range(L)]
    send_splits = [sum(mine[p * L:(p + 1) * L]) for p in range(W)]
    recv_splits = [sum(c) for c in recv_counts]

    order = sorted(range(len(calls)), key=lambda i: calls[i].expert)  # stable: call order within an expert
    x_send_SD = torch.cat([calls[i].rows for i in order]) if calls else \
        torch.empty((0, width), dtype=_DTYPES[dtype_code], device=device)
    # Every rank runs the exchanges' backward where any rank does (its peers wait in it): where a peer needs
    # gradients, rows that need none here become a leaf that does (its gradient is dropped).
    needs_grad = any(row[2 * L + 4] for row in meta)
    if needs_grad and not x_send_SD.requires_grad:
        x_send_SD = x_send_SD.detach().requires_grad_()
    x_recv_RD = all_to_all(x_send_SD, recv_splits, send_splits, group) if W > 1 else x_send_SD

    # Each called local expert's own forward, once, on the rows every rank sent it (grouped by source rank,
    # then by expert: regrouped here by expert, then by source rank). Layout change on the host's offsets.
    # One split (one backward node that concatenates the pieces' gradients), not a narrow per piece: each
    # narrow's backward fills a zero tensor of the whole exchange's size, W * L of them per block call.
    received = torch.split(x_recv_RD, [recv_counts[r][l] for r in range(W) for l in range(L)])
    pieces: dict[tuple[int, int], Tensor] = {}
    for l in range(L):
        if not called_L[l]:
            continue  # no rank called it: not called (its gradients stay None, as the model leaves them)
        n_r = [recv_counts[r][l] for r in range(W)]
        rows = torch.cat([received[r * L + l] for r in range(W)])
        out = experts[spec.first + l](rows)
        if not isinstance(out, Tensor) or out.shape[0] != rows.shape[0] or out.dim() != 2:
            raise ReplayError(f"{type(block).__name__}: expert {spec.first + l} returned "
                              f"{tuple(getattr(out, 'shape', ()))} for {tuple(rows.shape)} rows")
        for r, part in zip(range(W), torch.split(out, n_r)):
            pieces[(r, l)] = part
    out_dtype = _DTYPES[out_code] if widths else torch.float32
    back = [pieces[(r, l)] for r in range(W) for l in range(L) if (r, l) in pieces]
    y_send_RP = torch.cat(back) if back else torch.empty((0, out_width), dtype=out_dtype, device=device)
    if not back and x_recv_RD.requires_grad:
        # No local expert called: the received (zero) rows reach nothing, so their exchange's backward would
        # not run here. Joined to what goes back (an identity; their gradient is zero).
        y_send_RP = _Join.apply(y_send_RP, x_recv_RD)
    if W > 1:
        y_back_SP = all_to_all(y_send_RP, send_splits, recv_splits, group)
        _exchanged(y_back_SP)  # joined to the block's output if the block drops it (a rank without calls)
    else:
        y_back_SP = y_send_RP
    outputs: list[Tensor] = [None] * len(calls)  # type: ignore[list-item]
    # One split, as for the received rows: a narrow per call would fill a zero tensor of all the calls' rows in
    # each call's backward. Each piece is cloned (one copy of the rows in all): the block may edit an expert's
    # output in place, which autograd forbids on a view of a split, and each call's output keeps a grad_fn of its
    # own (``_source_call`` tells the calls apart by it).
    if order:
        for i, out in zip(order, torch.split(y_back_SP, [calls[i].rows.shape[0] for i in order])):
            outputs[i] = out.clone()
    return outputs, y_back_SP


def _raise_if_failed(block: nn.Module, failure, oks: list[int], mine: list[int]) -> None:
    if failure is not None:
        raise failure
    if not mine[-1]:
        raise ReplayError(f"{type(block).__name__}: its expert calls on this rank mix rows of different widths or "
                          "dtypes, or of a dtype the exchange does not send; autoep sends one kind of rows per "
                          "exchange")
    failed = [r for r, ok in enumerate(oks) if not ok]
    if failed:
        raise ReplayError(f"{type(block).__name__}: ep rank(s) {failed} failed their record check (their error "
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

