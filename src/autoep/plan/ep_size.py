"""``parallel.ep_size: auto``: the EP degree decided once, at resolve time, and frozen as a number.

The candidates are the degrees that divide the world size and every planned block's expert count (the
``(edp, ep)`` mesh needs the first, whole experts per rank the second). Without ``parallel.memory_gb`` the
largest candidate wins (fewest experts, so fewest expert bytes, per rank); with it the smallest candidate
whose per-rank parameter bytes (``autoep.plan.table.param_bytes``: dense replicated, experts split over ep)
fit, since a smaller ep exchanges tokens among fewer ranks; none fitting is a ``PlanError``.
When no candidate is above 1 (one process, or a world and expert counts with no common factor) the answer is
1, with a warning where the world has several ranks: every rank then holds every expert (plain data
parallelism), which is what the run would do anyway, so autoep says it rather than refusing.
``resolved.yaml`` holds the number; a replay uses it and never decides again.
"""
from __future__ import annotations

import logging
from typing import Callable

from autoep.errors import PlanError

log = logging.getLogger("autoep.plan.ep_size")

AUTO = "auto"
GB = 10**9  # parallel.memory_gb is in units of 10^9 bytes


def is_auto(ep_size) -> bool:
    return isinstance(ep_size, str) and ep_size == AUTO


def valid_ep_size(ep_size) -> bool:
    """What ``parallel.ep_size`` may be written as: ``auto`` or an integer >= 1 (not a bool)."""
    return is_auto(ep_size) or (type(ep_size) is int and ep_size >= 1)


def candidates(world: int, expert_counts: list[int]) -> list[int]:
    """Degrees dividing ``world`` and every count, ascending (1 always qualifies)."""
    return [d for d in range(1, world + 1) if world % d == 0 and all(n % d == 0 for n in expert_counts)]


def choose(world: int, expert_counts: dict[str, int], bytes_per_rank: Callable[[int], int],
           memory_gb: float | None) -> tuple[int, str]:
    """(the degree, one line saying why). ``expert_counts``: planned block -> its expert count;
    ``bytes_per_rank(d)``: parameter bytes one rank holds at ``ep_size=d``."""
    counts = sorted(set(expert_counts.values()))
    fits = candidates(world, counts)
    shown = "/".join(str(n) for n in counts) or "no"
    divides = f"divides world {world} and every block's {shown} experts (candidates {fits})"
    if memory_gb is None:
        return fits[-1], f"parallel.ep_size=auto -> {fits[-1]}: {divides}; the largest"
    fitting = [d for d in fits if bytes_per_rank(d) <= memory_gb * GB]
    if not fitting:
        raise PlanError(f"parallel.ep_size=auto with parallel.memory_gb={memory_gb:g}: even {fits[-1]}, the largest "
                        f"degree that {divides}, leaves {bytes_per_rank(fits[-1]) / GB:.3g} GB of parameters per "
                        f"rank; launch more ranks, raise parallel.memory_gb, or set parallel.memory_gb=null")
    d = fitting[0]
    return d, (f"parallel.ep_size=auto -> {d}: {divides}; the smallest whose {bytes_per_rank(d) / GB:.3g} GB of "
               f"parameters per rank fit parallel.memory_gb={memory_gb:g}")


def decide(world: int | None, expert_counts: dict[str, int | None], bytes_per_rank: Callable[[int], int],
           memory_gb: float | None) -> int:
    """The number ``ep_size: auto`` becomes, logged (info) with why; ``PlanError`` where it cannot be decided."""
    if world is None:
        raise PlanError("parallel.ep_size=auto needs the world size, which this caller did not give; pass "
                        "resolve_plan(parallel, model, world_size=N), or set parallel.ep_size to a number")
    unknown = [name for name, n in expert_counts.items() if n is None]
    if unknown:
        raise PlanError(f"parallel.ep_size=auto cannot count the experts of {unknown[0]} (an explicit factory over "
                        f"modules autoep cannot count experts in); set parallel.ep_size to a number that divides "
                        f"its expert count and the world size {world}")
    ep_size, why = choose(world, expert_counts, bytes_per_rank, memory_gb)
    if ep_size == 1 and world > 1:
        log.warning("%s: no degree above 1 divides both, so every rank holds every expert (no expert "
                    "parallelism); launch a world that shares a factor with the expert counts", why)
    else:
        log.info("%s", why)
    return ep_size


def check_fits(ep_size: int, bytes_per_rank: Callable[[int], int], memory_gb: float | None) -> None:
    """A fixed ``ep_size`` under ``parallel.memory_gb``: its per-rank parameter bytes fit, or a ``PlanError``."""
    if memory_gb is None or bytes_per_rank(ep_size) <= memory_gb * GB:
        return
    raise PlanError(f"parallel.ep_size={ep_size} leaves {bytes_per_rank(ep_size) / GB:.3g} GB of parameters per "
                    f"rank, over parallel.memory_gb={memory_gb:g}; raise parallel.ep_size (or set it to auto to "
                    f"take the smallest that fits), or raise parallel.memory_gb")
