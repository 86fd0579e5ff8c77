"""Chained experts run together on their owner (issue 31 item 2): ``lora_B[i](lora_A[i](x[tok]))`` in one exchange.

Where one expert is several modules (``MoeStructure.expert_members``: ``lora_A[i]`` and ``lora_B[i]``, placed
together on expert i's owner), a call on another call's pending output would travel one exchange later: the rows
go to the owner and back for A, then again for B. Here such a link is *fused*: the rows of the chain's first call
go to the owner once, the owner runs the chain's modules one after the other on them, and only the last output
comes back. A link is fused only where the staged execution would compute the same thing from the same values:

- the next call's input is the previous call's pending output itself (no taped op between them);
- both modules are members of one expert (one owner), the next call's the member listed after the previous
  call's (``routes``), at most ``MAX_LINKS`` of them;
- both calls were made under one grad/autocast context (the owner runs an exchange under one), and the chain's
  last output has its first output's dtype (one dtype per exchange, as before);
- the intermediate module has no hooks (they ran at the caller on its pending output; a value they keep would
  never exist), and nothing but the next call holds the intermediate output: no taped call reads or writes it,
  and the block, a hook or a list keeps no reference to it (``_only_link``: the tape lets go of it and checks it
  is gone; anything still holding it, a reference cycle included, keeps the link staged).

The owner runs an exchange's modules level by level (``run_routes``): first every called module on the rows its
chains start with, then the modules of every chain's second link, and so on, each module once per level on every
rank's rows (rank by rank, as the staged exchange concatenates them). A fused chain therefore runs each module on
the same rows as the staged exchanges did, in their order (within one rank's rows, grouped by route where one
module starts chains of both kinds, a row-local reordering), and its gradients flow through the same operations:
outputs and gradients are bit-equal to the staged execution, and the intermediate never leaves the owner. Random
draws inside the experts (``expert_draws: on_owner``) come in the staged order too: level by level, module by
module.

Encoding: an exchange carries rows per (expert, route), a route being the run of member indices its chain visits
(``routes``: each member alone first, so with one module per expert, or with ``FUSE`` off, nothing changes). Every
rank learns, in each exchange, the next stage any rank has calls for, and exchanges are skipped where no rank has
(a chain fused into exchange s leaves exchange s + 1 empty). Outputs of one exchange may then differ in width
(A's rank-wide outputs beside a chain's full-width ones): blocks with several modules per expert return their
outputs as one flat buffer (``flat``).
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from autoep.runtime.recipes.deferred import Call, Pending, ReplayError, Tape, _key

MAX_LINKS = 3  # the longest chain fused
FUSE = True  # False: every link in its own exchange (the staged execution; bench/chained_experts.py compares)


def routes(members: int) -> tuple[tuple[int, ...], ...]:
    """The member sequences one exchange carries per expert: each member alone first (route m is member m, an
    unfused call), then (where ``FUSE``) every run of 2 to ``MAX_LINKS`` consecutive members: a chain visits an
    expert's members in the order ``MoeStructure.expert_members`` lists them, the forward's order of calls."""
    return _routes(members, FUSE)


@functools.cache
def _routes(members: int, fuse: bool) -> tuple[tuple[int, ...], ...]:
    singles = tuple((m,) for m in range(members))
    return singles + tuple(tuple(range(m, m + k)) for k in range(2, min(members, MAX_LINKS) + 1) if fuse
                           for m in range(members - k + 1))


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
    where the module docstring allows (``FUSE``); the calls a chain absorbs are not listed on their own."""
    table, readers = routes(members), {}
    if len(table) == members:  # nothing to fuse: each call its member's route, its slot its module's
        return [Sent((c,), c.expert % members, c.expert) for c in tape.calls]
    for call in tape.calls:
        if type(call.x) is Pending:  # a real input is no other call's output
            readers.setdefault(id(call.x), []).append(call)
    absorbed: set[int] = set()
    items = []
    for call in tape.calls:
        if id(call) in absorbed:
            continue
        chain = [call]
        while len(chain) < MAX_LINKS:
            nxt = readers.get(id(chain[-1].out), [])
            if len(nxt) != 1 or not _fusable(tape, members, experts, chain, nxt[0]):
                break
            chain.append(nxt[0])
            absorbed.add(id(nxt[0]))
        route = table.index(tuple(c.expert % members for c in chain))
        items.append(Sent(tuple(chain), route, (call.expert // members) * len(table) + route))
    return items


def _fusable(tape: Tape, members: int, experts: list[nn.Module], chain: list[Call], nxt: Call) -> bool:
    last = chain[-1]
    module = experts[last.expert]
    return (nxt.expert // members == last.expert // members
            and nxt.expert % members == last.expert % members + 1
            and nxt.ctx == last.ctx and nxt.out.dtype == chain[0].out.dtype
            and not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                     or module._backward_pre_hooks)
            and _key(last.out) not in tape.written
            and _only_link(tape, last, nxt))


def _only_link(tape: Tape, first: Call, nxt: Call) -> bool:
    """Whether nothing but the tape's record of the two calls holds ``first``'s pending output: the tape's
    references become its metadata (the shadow: the same storage key), and the output must then be gone. Where it
    is not, they are put back and the link stays staged."""
    pending = first.out
    alive = weakref.ref(pending)
    kept = [i for i, t in enumerate(tape.keep) if t is pending]
    first.out = nxt.x = pending.shadow
    for i in kept:
        tape.keep[i] = pending.shadow
    del pending
    held = alive()
    if held is None:
        return True
    first.out = nxt.x = held
    for i in kept:
        tape.keep[i] = held
    return False


def run_routes(members: int, experts: list[nn.Module], received: list[Tensor], called: list[bool], ep_size: int,
               name: str) -> dict[tuple[int, int], Tensor]:
    """The output of each called local slot's route for each rank's rows (``received[r * V + v]``: rank r's rows
    of local slot v; ``experts``: this rank's modules, expert by expert), computed level by level (module
    docstring): at level k, each module once on the rows of every route whose k-th member it is."""
    table = routes(members)
    V, W = len(table), ep_size
    current = {(r, v): received[r * len(called) + v] for r in range(W) for v in range(len(called)) if called[v]}
    depth = max((len(table[v % V]) for v in range(len(called)) if called[v]), default=0)
    for k in range(depth):
        for x in range(len(called) // V):
            for m in range(members):
                keys = [(r, v) for r in range(W) for v in range(x * V, (x + 1) * V)
                        if called[v] and len(table[v % V]) > k and table[v % V][k] == m]
                if not keys:
                    continue
                expert = experts[x * members + m]
                rows = torch.cat([current[key] for key in keys])
                out = type(expert).forward(expert, rows)
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
            for m in table[v % V]:
                counts[v // V * members + m] += n
    return counts
