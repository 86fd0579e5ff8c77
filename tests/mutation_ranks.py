"""The soundness fuzzer on several gloo ranks: each rank its own slice of the batch.

Reference = the mutant's own forward/backward on each slice (every rank computes every slice, so ranks
agree on what is invalid); the EP copy runs this rank's slice. Outputs and the input grad compare per
rank, dense grads summed over ranks, expert grads gathered. Splits [1, 1] then [2, 0] (a rank without
tokens must still join every exchange). The ep group times out after ``HANG_S``: a rank that skips a
collective fails its mutant instead of hanging the run, and fresh processes take the remaining mutants.

    from mutation_ranks import gloo_check; gloo_check(["hf/qwen3_moe/block.forward/scale#0"], 2)
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import itertools
import re
import sys

import mutation
import torch
from mutation import Outcome, Run, detect, differences, forward_backward, inputs, param_grads, short_error
from mutation_runtime import RUNTIME_OPERATORS

from autoep.errors import FactChanged, LiveStateError
from autoep.runtime.recipes.replay import ReplayError
from autoep.runtime.recipes.local_experts import expert_owners

# Mutants whose failure shows only on several ranks (a rank without tokens skips a collective).
# mix_rows: an expert's rows are another set on another rank (in one process the same rows, reordered).
# drop_empty_output: only a rank without tokens drops the exchange's output; closure_rebound: a value copied
# at apply is another slice's (each rank runs under its own seed).
# The issue-20 operators: rows mixed by a dim given as ``axis=``, or under a default or a flag changed after apply.
RANK_SENSITIVE = {"conditional_experts_call", "early_return_empty", "padding_index", "mix_rows", "drop_empty_output",
                  "closure_rebound", "flag_and_tokens", "cumsum_axis", "sort_axis", "expert_default_global",
                  "expert_global_flag", "expert_class_flag", "expert_flag_by_hook",
                  # block weights (issue 31 item 3): a site's rows mixed (or cumulated in place), one rank's rows there
                  "site_mix_rows", "site_inplace"}
SPLITS = ([1, 1], [2, 0])  # sequences per rank: even, then one rank without tokens
HANG_S = 10  # a collective the peer never joins fails after this (the ep group's timeout)
# A failed collective leaves the ep group out of step: the processes are replaced after it.
COMMUNICATION_ERROR = re.compile(r"gloo|[Tt]imed out|timeout|[Cc]onnection closed|pair closure|process group")


def _slices(x: torch.Tensor, split: list[int]) -> list[torch.Tensor]:
    bounds = list(itertools.accumulate([0] + split))
    return [x[lo:hi] for lo, hi in zip(bounds, bounds[1:])]


def _ranks_round(block, structure, x, split, rank, group, mesh, flat=False, around=contextlib.nullcontext,
                 tol=None, after_apply=lambda block: block) -> str | None:
    """One split: reference grads summed over every slice (each rank computes all), EP on this rank's
    slice; outputs and input grad per rank, dense grads summed, expert grads gathered. None = equal.
    ``after_apply``: what the user does to the block after apply, done to the reference and the EP copy."""
    import torch.distributed as dist

    ref = after_apply(copy.deepcopy(block))
    with around():
        runs = [forward_backward(ref, s, seed=100 + r, flat=flat) for r, s in enumerate(_slices(x, split))]
    ref_run = Run(runs[rank].outputs, runs[rank].x_grad, param_grads(ref))  # grads accumulated over slices
    ep = after_apply(mutation.make_ep(block, structure, mesh))  # looked up at call time (tests replace it)
    with around():
        got = forward_backward(ep, _slices(x, split)[rank], seed=100 + rank, flat=flat)
    module_experts = expert_owners(ep)
    reduced = set()
    for name, p in ep.named_parameters(remove_duplicate=False):
        if hasattr(p, "full_tensor") or name not in got.grads or name in module_experts:
            continue  # expert shards and ModuleList experts: gathered by param_grads
        if got.grads[name] is None:  # every rank joins every all-reduce, with or without a grad
            got.grads[name] = torch.zeros_like(p)
        if id(got.grads[name]) not in reduced:  # a tied parameter's grad is one tensor: reduce it once
            reduced.add(id(got.grads[name]))
            dist.all_reduce(got.grads[name], group=group)  # NOTE: collective; dense grads sum over ranks
    diffs = differences(ref_run, got, **(tol or {}))
    return "; ".join(diffs[:3]) if diffs else None


def check_on_ranks(mutant: mutation.Mutant, rank: int, group, mesh) -> tuple[str, str, bool]:
    """``(verdict, detail, broken)`` of one mutant on this rank; ``broken``: the EP path raised on some rank,
    so ``group`` may be out of step (the caller starts fresh processes for the next mutant)."""
    import torch.distributed as dist

    block = mutant.build()
    structure, why = detect(block, mutant.target.replay)
    if why:
        return why.split(":")[0], why, False
    x, flat = inputs(block), mutant.target.flat
    splits = SPLITS if mutant.target.empty_rank else SPLITS[:1]
    try:
        for split in splits:
            for r, s in enumerate(_slices(x, split)):
                with mutant.around():
                    forward_backward(mutant.after_apply(copy.deepcopy(block)), s, seed=100 + r, flat=flat)
    except Exception as exc:  # noqa: BLE001 - the same on every rank: every rank computes every slice
        return "invalid", "own forward on a slice: " + short_error(exc), False
    try:  # apply's run-time-state checks: local, the same on every rank (no collective)
        mutation.make_ep(block, structure, mesh)
    except mutation.ApplyRefused as exc:
        return "refused", f"at apply: {exc}", False
    except Exception:  # noqa: BLE001 - the rounds below report it
        pass
    if mutation.reads_uninitialised(block, x, flat):  # the same on every rank: the same block and input
        return "invalid", "own forward returns uninitialised memory: no value to compare against", False
    dist.barrier()  # NOTE: default group: the ep group's short timeout counts from a common start
    for split in splits:
        refused = None
        try:
            why, raised = _ranks_round(block, structure, x, split, rank, group, mesh, flat, mutant.around,
                                       _tolerance(mutant), mutant.after_apply), False
        except (LiveStateError, FactChanged, ReplayError) as exc:  # refused on every rank alike, before any exchange
            why, raised, refused = None, False, str(exc)
        except Exception as exc:  # noqa: BLE001 - accepted, and the EP path fails (or a peer hung)
            why, raised = "EP path raised " + short_error(exc), bool(COMMUNICATION_ERROR.search(str(exc)))
        state = torch.tensor([2.0 if raised else float(why is not None) if refused is None else 0.5])
        # NOTE: collective on the default group: the ranks agree on the outcome and resync after a hang.
        dist.all_reduce(state, op=dist.ReduceOp.MAX)
        if state.item() == 0.5 and refused is not None:
            return "refused", f"at forward: {refused}", False
        if state.item():
            detail = f"split {split}, rank {rank}: {why}" if why else f"split {split}: failed on another rank"
            return "accepted_wrong", detail, state.item() >= 2
    return "accepted_exact", "", False


def gloo_cases(rank: int, world_size: int, names: list[str]) -> dict[str, tuple[str, str]]:
    """Worker (``distributed.spawn``): ``{mutant name: (verdict, detail)}`` on this rank, in order, up to
    and including the first mutant whose EP path raised (the group may be out of step after it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_num_threads(1)
    # The ep group times out fast: an accepted mutant whose rank skips a collective fails, not hangs.
    group = dist.new_group(list(range(world_size)), backend="gloo", timeout=datetime.timedelta(seconds=HANG_S))
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("ep",))
    out = {}
    for m in mutation.mutants_by_name(names):
        verdict, detail, broken = check_on_ranks(m, rank, group, mesh)
        out[m.name] = (verdict, detail)
        if broken:
            break
    return out


def target_of(name: str) -> str:
    return name.rsplit("/", 1 if name.endswith("/unmodified") else 2)[0]


def gloo_check(names: list[str], world_size: int = 2, breaks_per_target: int = 1) -> dict[str, tuple[str, str]]:
    """Run ``names`` on ``world_size`` gloo ranks; ``{name: (verdict, detail)}`` merged over ranks (a
    failing rank's detail first). Fresh processes continue after a failed collective; a target whose
    mutants broke ``breaks_per_target`` process groups is not run further (when its control breaks, its
    EP path, not a mutation, is what breaks): its mutants left are ``unchecked``."""
    from distributed import spawn

    def rank(result):  # a rank's own failure, then "failed on another rank", then the rest
        return (result[0] == "accepted_wrong") + (", rank " in result[1])

    merged: dict[str, tuple[str, str]] = {}
    breaks: dict[str, int] = {}
    while True:
        todo = [n for n in names if n not in merged and breaks.get(target_of(n), 0) < breaks_per_target]
        if not todo:
            break
        done = {}
        for per_rank in _spawn_twice_on_a_signal(spawn, world_size, todo):
            for name, result in per_rank.items():
                done[name] = max(done.get(name, result), result, key=rank)
        merged |= done
        if len(done) < len(todo):  # the last one run broke the group
            breaker = [n for n in todo if n in done][-1]
            breaks[target_of(breaker)] = breaks.get(target_of(breaker), 0) + 1
    why = f"not run: its target broke {breaks_per_target} process group(s) first"
    return merged | {n: ("unchecked", why) for n in names if n not in merged}


def _spawn_twice_on_a_signal(spawn, world_size: int, todo: list[str]) -> list[dict]:
    """``spawn`` the batch; where a rank died by a signal (seen twice in many CI runs: glibc aborting a gloo rank
    on a corrupted heap, ``munmap_chunk(): invalid pointer``; cause not found, not reproduced alone), run the
    same batch once more in fresh processes. A crash that repeats still fails; the first one is printed."""
    from torch.multiprocessing import ProcessExitedException

    try:
        return spawn(world_size, "mutation_ranks:gloo_cases", todo)
    except ProcessExitedException as exc:
        if not exc.signal_name:
            raise
        print(f"mutation_ranks: a rank died by {exc.signal_name} in a batch of {len(todo)} mutants; running the "
              f"batch once more", file=sys.stderr, flush=True)
        return spawn(world_size, "mutation_ranks:gloo_cases", todo)


def apply_rank_results(outcomes: list[Outcome], ranks: dict[str, tuple[str, str]], world_size: int) -> None:
    """A mutant exact in one process and wrong on several ranks becomes accepted_wrong; one refused there (state
    on expert parameters that sharding would replace: ``autoep.runtime.live_state``) becomes refused. A mutant
    refused at forward in one process (record/exchange/replay's checks) that did not raise on every rank (or
    hung) is accepted_wrong."""
    for o in outcomes:
        verdict, detail = ranks.get(o.name, (None, ""))
        if o.verdict == "accepted_exact" and verdict in ("accepted_wrong", "refused"):
            o.verdict, o.detail = verdict, f"on {world_size} ranks: {detail}"
        elif o.verdict == "refused" and verdict == "accepted_wrong":
            o.verdict, o.detail = verdict, f"on {world_size} ranks: {detail}"


# Mutants the per-slice reference cannot judge on several ranks: a post-accumulate-grad hook that edits ``.grad``
# in place is applied once per backward, and the reference runs one backward per rank's slice (the hook then
# rescales slice 0's gradient twice) while EP runs one backward over both: they differ by construction, not by
# EP. ModuleList experts keep such a hook on the owner rank since issue 16; in one process it is checked exactly.
# ``buffer_write``: the mutant keeps a call counter on the module and scales by it; the reference runs every slice
# on one copy (the counter is 2 at slice 1) where each rank holds its own replica (1 on every rank), so they differ
# by construction too (hf/switch_transformers/experts.forward/buffer_write#0, on stop 34's main as on this one).
# Judged exactly in one process; a per-rank replica reference is the fix that would let ranks judge it.
RANK_INCOMPARABLE = {"param_post_accumulate", "buffer_write"}
# Mutants that compute part of the block in bf16 (``autocast`` around a statement): on several ranks each expert
# runs on other batches of rows than the per-slice reference gives it (another GEMM blocking, fp32 round-off),
# and a bf16 cast downstream (the router's backward) can round that round-off up to one bf16 ulp. Judged there
# at bf16's ``assert_close`` tolerances, not on rounding luck (DESIGN.md "Parity"); in one process, exactly.
# ``batch_stats``: a batch norm over each expert call's rows (1 to 3 of them) in the block's own code, which
# record/exchange/replay runs as written: it divides by sqrt(var + eps), so the fp32 round-off of the expert's GEMM
# (another batch of rows on its owner) reaches the expert gradients (|g| up to 40) amplified. Measured on
# hf/nllb_moe/experts.forward/batch_stats#2: the fp32 per-slice reference itself is 2e-5 to 4e-5 off the fp64 one,
# EP 5.6e-5 off the fp32 one (exact in one process); a wrong row or statistic is off by O(1).
# Experts under autocast since the block's forward runs once (issue 30: they ran under the two passes' refusal
# before): each owner runs one bf16 GEMM over every rank's rows where the per-slice reference sums one bf16 GEMM per
# slice in fp32 (.grad), so an expert weight's gradient differs by up to one bf16 ulp of its magnitude (measured:
# 2^-8 = 0.0039 at gradients in [0.5, 1)): atol 8e-3, where a wrong row or expert is off by O(0.1-1).
# ``autocast_call`` (``mutation_replay``): one expert call under autocast inside the forward, the same judgement.
LOW_PRECISION = {"autocast": {"rtol": 1.6e-2, "atol": 8e-3}, "autocast_call": {"rtol": 1.6e-2, "atol": 8e-3},
                 "batch_stats": {"rtol": 1e-5, "atol": 1e-4}}


def _tolerance(mutant) -> dict | None:
    """``LOW_PRECISION`` by the mutant's operator, or by its target's name (a target written under autocast)."""
    if mutant.operator in LOW_PRECISION:
        return LOW_PRECISION[mutant.operator]
    return next((tol for key, tol in LOW_PRECISION.items() if key in mutant.target.name), None)


def raised_at_forward(outcomes: list[Outcome]) -> list[str]:
    """The mutants refused at forward in one process by record/exchange/replay's checks: on several ranks each
    must raise on every rank, none left waiting in a collective (``apply_rank_results``)."""
    return [o.name for o in outcomes if o.verdict == "refused" and o.detail.startswith("at forward: ")]


def rank_sample(outcomes: list[Outcome], every: int) -> list[str]:
    """What to run on several ranks: each target's unmodified control first, then the accepted-exact
    mutants: every run-time and rank-sensitive one, then those at every ``every``-th position of
    ``outcomes`` (fixed positions: the sample does not shift when verdicts elsewhere change)."""
    exact = [(i, o) for i, o in enumerate(outcomes) if o.verdict == "accepted_exact" and o.operator not in RANK_INCOMPARABLE]
    special = [o.name for _, o in exact if o.operator in RUNTIME_OPERATORS or o.operator in RANK_SENSITIVE]
    sampled = [o.name for i, o in exact if i % every == 0 and o.name not in set(special)]
    controls = [f"{t}/unmodified" for t in dict.fromkeys(o.target for o in outcomes)]
    return controls + special + sampled
