"""The soundness fuzzer, every mutant: accepted ⇒ exact, or the detector is unsound (issue 8).

    python bench/soundness.py                 # every mutant in one process (ep_mesh=None)
    python bench/soundness.py --ranks 2       # and accepted-exact ones again on 2 gloo ranks (CPU)
    python bench/soundness.py --limit 200     # the first 200 mutants of the fixed enumeration
    python bench/soundness.py --every 10      # every 10th mutant of each target (a quick look)
    python bench/soundness.py --target hf/nemotron_h --target v4/   # only these targets (name prefixes)
    python bench/soundness.py --ranks 2 --operator param_grad_hook --operator patch_f_linear   # only these operators
    python bench/soundness.py --replay --ranks 2   # the record/exchange/replay targets (``mutation.replay_targets``),
                                                   # old and replay operators; mutants refused at forward too
    python bench/soundness.py --smoke         # a code check (tests/test_bench_smoke.py): the first target,
                                              # every 40th mutant, on 2 ranks too (also with --replay)

Prints one line per accepted-wrong, crash or invalid mutant, then per target and in total
``mutants=… refused=… accepted_exact=… accepted_wrong=… crashes=… invalid=…``. Exits 1 when any mutant
is accepted and wrong or crashes the detector, or (``--ranks``) a target as written fails on the ranks.
The engine is ``tests/mutation.py`` (several ranks: ``tests/mutation_ranks.py``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
__import__("testpaths").add()  # the tests' package folders too (mutation.py imports test_parity_hf)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import mutation  # noqa: E402 - after the tests dir is on the path
import mutation_ranks  # noqa: E402

LISTED = ("accepted_wrong", "crash", "invalid")


def print_listed(outcomes) -> None:
    for o in outcomes:
        if o.verdict in LISTED:
            print(f"{o.verdict:15s} {o.name}: {o.detail}")


def print_rank_controls(ranks: dict, world_size: int) -> int:
    """Print unmodified targets that fail on several ranks, and how many mutants were left unchecked;
    return the number of failing controls."""
    failed = 0
    for name, (verdict, detail) in ranks.items():
        if name.endswith("/unmodified") and verdict != "accepted_exact":
            failed += 1
            print(f"control fails on {world_size} ranks: {name}: {detail}")
    unchecked = sum(verdict == "unchecked" for verdict, _ in ranks.values())
    print(f"ranks: {len(ranks) - unchecked} compared on {world_size} ranks, {unchecked} unchecked")
    return failed


def print_operator_lines(outcomes) -> None:
    """One line per operator: its mutants, refused at detection or apply, raised at forward (the run-time
    checks), accepted and exact, accepted and wrong, crashes, invalid."""
    for operator in sorted({o.operator for o in outcomes}):
        mine = [o for o in outcomes if o.operator == operator]
        c = mutation.counts(mine)
        raised = sum(o.verdict == "refused" and o.detail.startswith("at forward") for o in mine)
        print(f"  {operator}: mutants={c['mutants']} refused={c['refused'] - raised} raised={raised} "
              f"accepted_exact={c['accepted_exact']} accepted_wrong={c['accepted_wrong']} crashes={c['crash']} "
              f"invalid={c['invalid']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1,
                        help="also recheck accepted-exact mutants on this many gloo ranks")
    parser.add_argument("--limit", type=int, default=None, help="only the first N mutants of the enumeration")
    parser.add_argument("--every", type=int, default=1, help="every N-th mutant of each target ")
    parser.add_argument("--target", action="append", default=[],
                        help="only targets whose name starts with this (repeatable)")
    parser.add_argument("--operator", action="append", default=[],
                        help="only mutants of this operator (repeatable; the targets' controls still run on ranks)")
    parser.add_argument("--rank-every", type=int, default=1,
                        help="on several ranks: every run-time and rank-sensitive mutant, every N-th of the others")
    parser.add_argument("--replay", action="store_true",
                        help="the record/exchange/replay targets instead; on several ranks, every mutant its run-time "
                             "checks refused in one process must raise on every rank")
    parser.add_argument("--breaks-per-target", type=int, default=1,
                        help="process groups a target's mutants may break before the rest of it is left unchecked")
    parser.add_argument("--smoke", action="store_true",
                        help="a code check (tests/test_bench_smoke.py): --ranks 2 --every 40 and only the first target "
                             "unless --target names some; flags given win")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(ranks=2, every=40)
        args = parser.parse_args(argv)

    failed_controls = 0
    t0 = time.perf_counter()
    every_target = mutation.replay_targets() if args.replay else mutation.targets()
    targets = [t for t in every_target if not args.target or t.name.startswith(tuple(args.target))]
    targets = targets[:1] if args.smoke and not args.target else targets
    mutants = mutation.sample([m for t in targets for m in mutation.target_mutants(t)
                               if not args.operator or m.operator in args.operator], args.every)[: args.limit]
    outcomes = mutation.evaluate_all(mutants)
    t1 = time.perf_counter()
    if args.ranks > 1:
        names = mutation_ranks.rank_sample(outcomes, args.rank_every)
        names += mutation_ranks.raised_at_forward(outcomes) if args.replay else []
        print(f"rechecking {len(names)} controls and accepted-exact mutants on {args.ranks} gloo ranks", flush=True)
        ranks = mutation_ranks.gloo_check(names, args.ranks, breaks_per_target=args.breaks_per_target)
        mutation_ranks.apply_rank_results(outcomes, ranks, args.ranks)
        failed_controls = print_rank_controls(ranks, args.ranks)
    t2 = time.perf_counter()

    print_listed(outcomes)
    for target, group in itertools.groupby(outcomes, key=lambda o: o.target):
        print(mutation.summary_line(target, list(group)))
    print(mutation.summary_line("total", outcomes))
    print_operator_lines(outcomes)
    print(f"operators={len(mutation.REPLAY_TARGET_OPERATORS if args.replay else mutation.OPERATORS)} in-process {t1 - t0:.1f} s, ranks {t2 - t1:.1f} s")
    c = mutation.counts(outcomes)
    return 1 if c["accepted_wrong"] or c["crash"] or failed_controls else 0


if __name__ == "__main__":
    sys.exit(main())
