"""Soundness of the one-pass execution of module experts (issues 21 item 6, 30 item 7): every mutant of the replay targets (the blocks of
``tests/replay_blocks.py``, mutated by the fuzzer's operators and by ``mutation_replay.REPLAY_OPERATORS``) is
refused at resolve, raises at run time on every rank, or is exact on 2 ranks; none is accepted and wrong, none
crashes the detector.

The replay targets include the block-weight blocks (issue 31 item 3; their own operators' sample:
``tests/detect/test_block_weight_soundness.py``). A fixed sample (``bench/soundness.py --replay --ranks 2`` runs every
mutant): every replay-operator mutant of the
``FULL`` targets (the doors' operators, ``DOORS``: every ``DOORS_EVERY``-th of each FULL target's), and every
``OTHERS_EVERY``-th of the rest, in one process (ep_mesh=None: the forward, the exchange and the deferred calls all
run); then on 2 gloo ranks each target's control, every ``RANK_EVERY``-th accepted-exact mutant and every mutant
raised at forward in one process (each must raise on every rank; the ep group's timeout, ``mutation_ranks.HANG_S``,
turns a rank left waiting into a failure, not a hang).
Measured: 323 mutants in one process (20 s), 137 on 2 ranks (73 s); about 2 min of wall time for the whole file,
imports and spawns included, on 2 cores shared at a load of 9.

    pytest tests/detect/test_replay_soundness.py
    python bench/soundness.py --replay --ranks 2      # every mutant, per operator
"""

from __future__ import annotations

import mutation
import mutation_ranks
import pytest
from mutation_replay import REPLAY_OPERATORS

FULL = ("replay/comprehension", "replay/batch_rows", "replay/optional_arg_container", "replay/cast_masked")
# The one pass's doors (issue 30 item 7: ``mutation_replay``'s side effects, hooks, generators held elsewhere, chains
# whose forward values match, contexts around a call): on the FULL targets every DOORS_EVERY-th of each target's, from
# the target's position in FULL (each target's doors list the same variants in the same order: the offsets cover
# every variant).
DOORS = ("side_effects", "expert_hooks", "rng_held_elsewhere", "matching_chain", "call_context", "autocast_call")
DOORS_EVERY = 3
OTHERS_EVERY = 25  # of the rest: the fuzzer's operators on every replay target, the replay operators elsewhere
RANK_EVERY = 3  # of the accepted-exact mutants, on 2 ranks
# What each replay operator's sample shows on 2 ranks, the block's forward running once (issue 30): some mutant
# raised on every rank (a branch on an expert output's value: read on the host before the exchange), some exact
# (an expert input computed from an expert output: a chained call; state written in the forward, once; random
# draws between calls, once; a cached call order; an expert called on its rows with leading dims added; the
# block's input edited in place).
# The doors: a logging handler formatting an expert output's norm, a buffer the output reads edited in place after
# the call, a hook on a module inside an expert raise; every other write, hook, draw, chain and context is exact.
RAISE = {"branch_on_output", "side_effects", "expert_hooks"}
EXACT = {"chain_expert_input", "state_write", "rng_between_calls", "cache_order", "nd_expert_call",
         "block_input_inplace", *DOORS}


@pytest.fixture(scope="module")
def replay_mutants():
    return [m for t in mutation.replay_targets() for m in mutation.target_mutants(t)]


@pytest.fixture(scope="module")
def fuzzed(replay_mutants):
    chosen = [m for m in replay_mutants if m.operator in REPLAY_OPERATORS and m.operator not in DOORS
              and m.target.name in FULL]
    for k, target in enumerate(FULL):
        chosen += mutation.sample([m for m in replay_mutants if m.operator in DOORS and m.target.name == target],
                                  DOORS_EVERY, offset=k % DOORS_EVERY)
    names = {m.name for m in chosen}
    chosen += mutation.sample([m for m in replay_mutants if m.name not in names], OTHERS_EVERY)
    controls = [mutation.unmodified(t) for t in mutation.replay_targets()]
    outcomes = mutation.evaluate_all(controls + chosen)
    on_ranks = mutation_ranks.rank_sample(outcomes, RANK_EVERY) + mutation_ranks.raised_at_forward(outcomes)
    for operator in EXACT:  # the sample keeps one exact mutant of each such operator on the ranks, whatever the stride
        exact = [o.name for o in outcomes if o.operator == operator and o.verdict == "accepted_exact"]
        if exact and not set(exact) & set(on_ranks):
            on_ranks.append(exact[0])
    ranks = mutation_ranks.gloo_check(on_ranks, 2)
    mutation_ranks.apply_rank_results(outcomes, ranks, 2)
    return outcomes, ranks


def _listing(outcomes, verdict: str) -> str:
    bad = [o for o in outcomes if o.verdict == verdict]
    return f"{len(bad)} {verdict}:\n" + "\n".join(f"{o.name}: {o.detail}" for o in bad[:40])


def test_no_replay_operator_is_dead(replay_mutants):
    used = {m.operator for m in replay_mutants}
    assert set(REPLAY_OPERATORS) <= used, f"operators without a mutant: {set(REPLAY_OPERATORS) - used}"


def test_no_mutant_is_accepted_and_wrong(fuzzed):
    outcomes, _ = fuzzed
    assert not any(o.verdict == "accepted_wrong" for o in outcomes), _listing(outcomes, "accepted_wrong")


def test_the_detector_never_crashes(fuzzed):
    outcomes, _ = fuzzed
    assert not any(o.verdict == "crash" for o in outcomes), _listing(outcomes, "crash")


def test_controls_are_exact_in_one_process_and_on_2_ranks(fuzzed):
    outcomes, ranks = fuzzed
    controls = {o.name: o for o in outcomes if o.operator == "none"}
    assert len(controls) == len(mutation.replay_targets())
    assert all(o.verdict == "accepted_exact" for o in controls.values()), _listing(controls.values(), "refused")
    assert all(ranks[n][0] == "accepted_exact" for n in controls), {n: ranks[n] for n in controls}


def test_the_sample_is_not_vacuous(fuzzed):
    """Each replay operator's mutants both run (exact) and raise somewhere in the sample, and both kinds ran on
    2 ranks: a pass says something about each obligation."""
    outcomes, ranks = fuzzed
    for operator in REPLAY_OPERATORS:
        mine = [o for o in outcomes if o.operator == operator]
        raised = [o for o in mine if o.verdict == "refused" and o.detail.startswith("at forward")]
        if operator in RAISE:
            assert any(ranks.get(o.name, ("",))[0] == "refused" for o in raised), f"{operator}: none raised on 2 ranks"
        if operator in EXACT:
            assert any(ranks.get(o.name, ("",))[0] == "accepted_exact" for o in mine), \
                f"{operator}: no mutant was exact on 2 ranks"
