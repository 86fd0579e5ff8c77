"""Chained experts run together on their owner (issue 31 item 2): ``lora_B[i](lora_A[i](x[tok]))`` in one exchange.

Where one expert is several modules (``MoeStructure.expert_members``: ``lora_A[i]`` and ``lora_B[i]``, placed
together on expert i's owner), a call on another call's pending output would travel one exchange later: the rows
go to the owner and back for A, then again for B. Here such a link is *fused*: the rows of the chain's first call
go to the owner once, the owner runs the chain's modules one after the other on them, and only the last output
comes back. A link is fused only where the staged execution would compute the same thing from the same values:

- the next call's input is the previous call's pending output itself, or, in a chain of two, one element-wise
  activation of it (``OPS``: ``up[i](F.gelu(down[i](x)))``), a taped call the owner then applies between the
  links instead of the caller (it leaves the tape);
- both modules are members of one expert (one owner), the next call's the member listed after the previous
  call's (``routes``), at most ``MAX_LINKS`` of them;
- both calls were made under one grad/autocast context (the owner runs an exchange under one), and the chain's
  last output has its first output's dtype (one dtype per exchange, as before);
- the intermediate module has no hooks (they ran at the caller on its pending output; a value they keep would
  never exist), and nothing but the next call (or the activation) holds the intermediate output: no other taped
  call reads or writes it, and the block, a hook or a list keeps no reference to it (``_released``: the tape lets
  go of it and checks it is gone; anything still holding it, a reference cycle included, keeps the link staged).

The owner runs an exchange's modules level by level (``run_routes``): first every called module on the rows its
chains start with, then the modules of every chain's second link, and so on, each module once per level on every
rank's rows (rank by rank, as the staged exchange concatenates them). A fused chain therefore runs each module on
the same rows as the staged exchanges did, in their order (within one rank's rows, grouped by route where one
module starts chains of both kinds, a row-local reordering), and its gradients flow through the same operations:
outputs and gradients are bit-equal to the staged execution, and the intermediate never leaves the owner. Random
draws inside the experts (``expert_draws: on_owner``) come in the staged order too: level by level, module by
module.

Encoding: an exchange carries rows per (expert, route), a route being the run of member indices its chain visits,
with ``"op"`` between two where an activation sits there (``routes``: each member alone first, so with one module
per expert, or with ``FUSE`` off, nothing changes); which activation, each rank says per expert and pair of members
in the exchange's counts (``op_code``: ranks may differ, the owner applies each rank's to its rows). Every rank
learns, in each exchange, the next stage any rank has calls for, and exchanges are skipped where no rank has (a
chain fused into exchange s leaves exchange s + 1 empty). Outputs of one exchange may then differ in width (A's
rank-wide outputs beside a chain's full-width ones): blocks with several modules per expert return their outputs
as one flat buffer (``flat``).
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoep.runtime.recipes.deferred import Call, Entry, Pending, ReplayError, Tape, _key, _tensors

MAX_LINKS = 3  # the longest chain fused
FUSE = True  # False: every link in its own exchange (the staged execution; bench/chained_experts.py compares)
# Element-wise activations a two-link chain may apply between its links on the owner (``lora_B[i](F.gelu(
# lora_A[i](x)))``), by name: what the owner runs. Each is deterministic, reads no other tensor and no value but its
# input's element, so it gives the same bits on any grouping of the rows, forward and backward.
OPS = {"relu": torch.relu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
       "silu": F.silu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}
_OP_CALLS = {torch.relu: "relu", Tensor.relu: "relu", F.relu: "relu", F.gelu: "gelu", F.silu: "silu",
             torch.tanh: "tanh", Tensor.tanh: "tanh", torch.sigmoid: "sigmoid", Tensor.sigmoid: "sigmoid"}


def routes(members: int) -> tuple[tuple[int | str, ...], ...]:
    """What one exchange carries per expert, as the member indices its chain visits (``"op"`` between two: one of
    ``OPS``, which each rank names per expert and pair in the exchange's counts, ``op_code``): each member alone
    first (route m is member m, an unfused call), then (where ``FUSE``) every run of 2 to ``MAX_LINKS`` consecutive
    members, and every two consecutive members with an activation between them: a chain visits an expert's members
    in the order ``MoeStructure.expert_members`` lists them, the forward's order."""
    return _routes(members, FUSE)


@functools.cache
def _routes(members: int, fuse: bool) -> tuple[tuple[int | str, ...], ...]:
    singles = tuple((m,) for m in range(members))
    if not fuse:
        return singles
    runs = tuple(tuple(range(m, m + k)) for k in range(2, min(members, MAX_LINKS) + 1) for m in range(members - k + 1))
    return singles + runs + tuple((m, "op", m + 1) for m in range(members - 1))


def op_code(name: str | None) -> int:
    """An activation's number in the exchange's counts (0: none)."""
    return 0 if name is None else list(OPS).index(name) + 1


def _links(route: tuple) -> list[tuple[str | None, int]]:
    """A route's modules, each with the activation applied to its input on the owner (None: none)."""
    return [(route[i - 1] if i and isinstance(route[i - 1], str) else None, m)
            for i, m in enumerate(route) if isinstance(m, int)]


def flat(members: int) -> bool:
    """Whether an exchange's outputs go back as one flat buffer (their widths may differ: fused chains)."""
    return members > 1 and FUSE


@dataclass(frozen=True)
class Sent:
    """What travels to an owner in one exchange: a call, or a fused chain of calls (the first's rows go; the
    last's output comes back)."""

    calls: tuple[Call, ...]
    route: int  # index into ``routes(members)``
    slot: int  # the exchange's slot: expert * len(routes(members)) + route
    op: str | None = None  # the activation between its two links (a route with "op")

    @property
    def head(self) -> Call:
        return self.calls[0]

    @property
    def last(self) -> Call:
        return self.calls[-1]

    @property
    def stage(self) -> int:
        """The exchange it travels in."""
        return self.head.stage + 1

    @property
    def out_numel(self) -> int:
        return math.prod(self.last.out.shape)


def sent(tape: Tape, members: int, experts: list[nn.Module]) -> list[Sent]:
    """Every call of the tape, in the forward's order, each fused with the calls that continue it on its owner
    where the module docstring allows (``FUSE``); the calls a chain absorbs are not listed on their own, and an
    activation it absorbs leaves the tape."""
    table = routes(members)
    if len(table) == members:  # nothing to fuse: each call its member's route, its slot its module's
        return [Sent((c,), c.expert % members, c.expert) for c in tape.calls]
    readers: dict[int, list] = {}  # id(pending value) -> the calls, then the taped calls, reading it
    for call in tape.calls:
        if type(call.x) is Pending:  # a real input is no other call's output
            readers.setdefault(id(call.x), []).append(call)
    for entry in tape.entries:
        for t in {id(t): t for t in _tensors((entry.args, entry.kwargs), []) if type(t) is Pending}.values():
            readers.setdefault(id(t), []).append(entry)
    absorbed: set[int] = set()
    named: dict[tuple, str] = {}  # (stage, expert, pair) -> the activation its chains apply (one per exchange)
    items = []
    for call in tape.calls:
        if id(call) in absorbed:
            continue
        chain, route, name = [call], [call.expert % members], None
        while len(chain) < MAX_LINKS:
            link = _link(tape, members, experts, chain, readers, named)
            if link is None:
                break
            op, nxt = link
            chain.append(nxt)
            route += ["op", nxt.expert % members] if op else [nxt.expert % members]
            absorbed.add(id(nxt))
            if op is not None:  # the owner applies it (by identity: entries compare their tensors with ==)
                tape.entries[:] = [e for e in tape.entries if e is not op]
                name = _op_name(op)
                named[(call.stage, call.expert // members, call.expert % members)] = name
                break
        index = table.index(tuple(route))
        items.append(Sent(tuple(chain), index, (call.expert // members) * len(table) + index, name))
    return items


def _link(tape: Tape, members: int, experts: list[nn.Module], chain: list[Call], readers: dict, named: dict):
    """``(activation entry or None, the next call)`` where the chain continues on its owner, else None (also for an
    activation other than the one this expert's chains apply in this exchange: ``named``)."""
    last = chain[-1]
    reading = readers.get(id(last.out), [])
    if len(reading) != 1:
        return None
    if isinstance(reading[0], Call):
        nxt = reading[0]
        ok = _next_member(tape, members, experts, chain, nxt) and _released(
            tape, [(last, "out")], [(last, "out"), (nxt, "x")])
        return (None, nxt) if ok else None
    op = reading[0]
    following = readers.get(id(op.out), []) if type(op.out) is Pending else []
    name = _op_name(op)
    if len(chain) != 1 or name is None or op.args[0] is not last.out or len(following) != 1 \
            or not isinstance(following[0], Call) \
            or named.get((last.stage, last.expert // members, last.expert % members), name) != name:
        return None
    nxt = following[0]
    ok = (op.ctx == last.ctx and _key(op.out) not in tape.written and _next_member(tape, members, experts, chain, nxt)
          and _released(tape, [(last, "out"), (op, "out")], [(last, "out"), (op, "args"), (op, "out"), (nxt, "x")]))
    return (op, nxt) if ok else None


def _op_name(entry: Entry) -> str | None:
    """The name in ``OPS`` of a taped call applying one of them to its one argument, as the owner would."""
    try:
        name = _OP_CALLS.get(entry.func) if not entry.writes and len(entry.args) == 1 else None
    except TypeError:  # an unhashable callable: none of them
        return None
    kwargs = dict(entry.kwargs)
    if name in ("relu", "silu") and kwargs.pop("inplace", False) is False and not kwargs:
        return name
    if name == "gelu" and set(kwargs) <= {"approximate"}:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(kwargs.get("approximate", "none"))
    return name if name in ("tanh", "sigmoid") and not kwargs else None


def _next_member(tape: Tape, members: int, experts: list[nn.Module], chain: list[Call], nxt: Call) -> bool:
    """Whether ``nxt`` may run right after the chain's last call on the owner (module docstring), its output
    aside."""
    last = chain[-1]
    module = experts[last.expert]
    return (nxt.expert // members == last.expert // members
            and nxt.expert % members == last.expert % members + 1
            and nxt.ctx == last.ctx and nxt.out.dtype == chain[0].out.dtype
            and not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                     or module._backward_pre_hooks)
            and _key(last.out) not in tape.written)


def _released(tape: Tape, values: list[tuple[object, str]], holders: list[tuple[object, str]]) -> bool:
    """Whether nothing but the tape holds the pending values at ``values`` (``(call, "out")``): in ``holders``
    (attributes of its calls and taped calls: the value, or arguments holding it) and its ``keep`` list, each
    becomes its metadata (its shadow: the same storage key), and each value must then be gone. Where one is not,
    each goes back (a value that did go, by a new pending value of its metadata: nothing else could tell them
    apart) and the link stays staged."""
    metas = []
    for obj, attr in values:
        value = getattr(obj, attr)
        metas.append((weakref.ref(value), value.shadow, value.device, value.stage, value.needs_grad))
    _swap(tape, holders, {id(getattr(obj, attr)): meta[1] for (obj, attr), meta in zip(values, metas)})
    del value
    held = [ref() for ref, *_ in metas]
    if all(h is None for h in held):
        return True
    back = {}
    for h, (_, shadow, device, stage, grad) in zip(held, metas):
        if h is None:
            h = Pending(shadow, device, stage, grad)
            tape.pendings.append(weakref.ref(h))
        back[id(shadow)] = h
    _swap(tape, holders, back)
    return False


def _swap(tape: Tape, holders: list[tuple[object, str]], swap: dict) -> None:
    for obj, attr in holders:
        setattr(obj, attr, _swapped(getattr(obj, attr), swap))
    tape.keep[:] = [swap.get(id(t), t) for t in tape.keep]


def _swapped(value, swap: dict):
    if isinstance(value, Tensor):
        return swap.get(id(value), value)
    if isinstance(value, (list, tuple)):
        items = [_swapped(v, swap) for v in value]
        return items if isinstance(value, list) else (type(value)(*items) if hasattr(value, "_fields")
                                                      else type(value)(items))
    if isinstance(value, dict):
        return {k: _swapped(v, swap) for k, v in value.items()}
    return value


def unpacked(rows: Tensor, extras: tuple[int, ...]) -> tuple[Tensor, ...]:
    """The rows and the per-row extras a call packed beside them (``replay._packed``: ``extras`` their widths), split
    again on the owner."""
    if not extras:
        return (rows,)
    return tuple(torch.split(rows, [rows.shape[-1] - sum(extras), *extras], dim=-1))


def run_routes(members: int, experts: list[nn.Module], received: list[Tensor], called: list[bool], ep_size: int,
               name: str, ops: list[list[int]] | None = None, extras: tuple[int, ...] = ()) -> dict[tuple[int, int], Tensor]:
    """The output of each called local slot's route for each rank's rows (``received[r * V + v]``: rank r's rows
    of local slot v; ``experts``: this rank's modules, expert by expert; ``ops[r][x * (members - 1) + m]``: rank
    r's ``op_code`` for local expert x's pair (m, m + 1)), computed level by level (module docstring): at level k,
    each module once on the rows of every route whose k-th member it is; ``extras``: the widths of the per-row
    tensors packed after the rows' features, passed to the first level's modules after the rows."""
    links = [_links(route) for route in routes(members)]
    V, W = len(links), ep_size
    current = {(r, v): received[r * len(called) + v] for r in range(W) for v in range(len(called)) if called[v]}
    depth = max((len(links[v % V]) for v in range(len(called)) if called[v]), default=0)
    for k in range(depth):
        for x in range(len(called) // V):
            for m in range(members):
                keys = [(r, v) for r in range(W) for v in range(x * V, (x + 1) * V)
                        if called[v] and len(links[v % V]) > k and links[v % V][k][1] == m]
                if not keys:
                    continue
                for r, v in keys:  # the activation between two links, rank r's: element-wise, so per piece
                    if links[v % V][k][0]:
                        code = ops[r][x * (members - 1) + m - 1]
                        if not code:
                            raise ReplayError(f"{name}: rank {r} sent rows to an activation route naming none")
                        current[(r, v)] = list(OPS.values())[code - 1](current[(r, v)])
                expert = experts[x * members + m]
                rows = torch.cat([current[key] for key in keys])
                # The received rows carry the calls' per-row extras (level 0 only: a call passing extras is never
                # a later link, its input being their concatenation, no other call's output)
                out = type(expert).forward(expert, *(unpacked(rows, extras) if k == 0 else (rows,)))
                if not isinstance(out, Tensor) or out.dim() != 2 or out.shape[0] != rows.shape[0]:
                    raise ReplayError(f"{name}: expert module {x * members + m} (local) returned "
                                      f"{tuple(getattr(out, 'shape', ()))} for {tuple(rows.shape)} rows")
                for key, part in zip(keys, torch.split(out, [current[key].shape[0] for key in keys])):
                    current[key] = part
    return current


def rows_per_module(members: int, recv_counts: list[list[int]]) -> list[int]:
    """The rows each local module runs on in one exchange (every rank's, every level): ``recv_counts[r][v]`` rows
    from rank r for local slot v."""
    table = routes(members)
    V = len(table)
    slots = len(recv_counts[0]) if recv_counts else 0
    counts = [0] * (slots // V * members)
    for row in recv_counts:
        for v, n in enumerate(row):
            for _, m in _links(table[v % V]):
                counts[v // V * members + m] += n
    return counts
