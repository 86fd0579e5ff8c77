"""Soundness of expert weights on the block itself (issue 31 item 3): every mutant of the blocks of
``tests/block_weight_blocks.py`` (replay targets, mutated by the fuzzer's operators, the one pass's and
``mutation_block_weight_operators``': a weight indexed otherwise, a site's rows mixed, a weight read outside a site,
an expert-dependent scale, two weights swapped, an in-place op in a site) is refused, raises at forward on every
rank, or is exact in one process and on 2 gloo ranks; none is accepted and wrong, none crashes the detector.

A fixed sample here: every block-weight operator's mutant in one process (391 mutants, 13 s), then on 2 ranks each
target's control, every accepted-exact mutant of the rank-sensitive operators (``site_mix_rows``, ``site_inplace``:
in one process the owner sees the same rows), every ``RANK_EVERY``-th other exact one and every one raised at forward;
and the mutant that found the bug: ``F.silu`` patched around the call of ``ChildWeightsMoE``, whose activation
module runs on a site's pending output in the block's deferred code (off by 0.68 on 2 ranks, exact in one process),
now refused at forward. Every mutant of the targets, all operators, on 2 ranks: the ``slow`` test, or

    python bench/soundness.py --replay --ranks 2 --target replay/block_weights --target replay/swiglu_weights \\
        --target replay/method_weights --target replay/einsum_weights --target replay/child_weights \\
        --target replay/idle_expert
"""

from __future__ import annotations

import mutation
import mutation_ranks
import pytest
from mutation_block_weight_operators import BLOCK_WEIGHT_OPERATORS

RANK_EVERY = 4  # of the accepted-exact mutants not rank-sensitive, on 2 ranks
PATCHED = "replay/child_weights/block/patch_silu"  # accepted_wrong on 2 ranks before ``_no_patched_torch``


def _targets():
    return [t for t in mutation.replay_targets() if t.block_weights]


@pytest.fixture(scope="module")
def weight_mutants():
    return [m for t in _targets() for m in mutation.target_mutants(t)]


def _on_ranks(outcomes, every: int) -> dict:
    names = mutation_ranks.rank_sample(outcomes, every) + mutation_ranks.raised_at_forward(outcomes)
    ranks = mutation_ranks.gloo_check(list(dict.fromkeys(names)), 2)
    mutation_ranks.apply_rank_results(outcomes, ranks, 2)
    return ranks


@pytest.fixture(scope="module")
def fuzzed(weight_mutants):
    chosen = [m for m in weight_mutants if m.operator in BLOCK_WEIGHT_OPERATORS]
    chosen += mutation.mutants_by_name([PATCHED])
    outcomes = mutation.evaluate_all([mutation.unmodified(t) for t in _targets()] + chosen)
    return outcomes, _on_ranks(outcomes, RANK_EVERY)


def _listing(outcomes, verdict: str) -> str:
    bad = [o for o in outcomes if o.verdict == verdict]
    return f"{len(bad)} {verdict}:\n" + "\n".join(f"{o.name}: {o.detail}" for o in bad[:40])


def test_every_block_weight_target_gets_every_operator(weight_mutants):
    for target in _targets():
        used = {m.operator for m in weight_mutants if m.target.name == target.name}
        assert set(BLOCK_WEIGHT_OPERATORS) - {"swap_weights"} <= used, (target.name, set(BLOCK_WEIGHT_OPERATORS) - used)
    assert any(m.operator == "swap_weights" for m in weight_mutants)


def test_no_mutant_is_accepted_and_wrong(fuzzed):
    outcomes, _ = fuzzed
    assert not any(o.verdict == "accepted_wrong" for o in outcomes), _listing(outcomes, "accepted_wrong")


def test_the_detector_never_crashes(fuzzed):
    outcomes, _ = fuzzed
    assert not any(o.verdict == "crash" for o in outcomes), _listing(outcomes, "crash")


def test_controls_are_exact_in_one_process_and_on_2_ranks(fuzzed):
    outcomes, ranks = fuzzed
    controls = [o for o in outcomes if o.operator == "none"]
    assert len(controls) == len(_targets())
    assert all(o.verdict == "accepted_exact" for o in controls), _listing(controls, "refused")
    assert all(ranks[o.name][0] == "accepted_exact" for o in controls), {o.name: ranks[o.name] for o in controls}


def test_a_patched_activation_around_the_call_is_refused_at_forward_on_every_rank(fuzzed):
    outcomes, ranks = fuzzed
    patched = next(o for o in outcomes if o.name == PATCHED)
    assert patched.verdict == "refused" and patched.detail.startswith("at forward") and "silu" in patched.detail, \
        patched
    assert ranks[PATCHED][0] == "refused", ranks[PATCHED]


def test_the_sample_is_not_vacuous(fuzzed):
    """Each operator has refused mutants; those that keep a site row-local have exact ones, and the rank-sensitive
    ones ran exact on 2 ranks (where one rank's rows of an expert are not the owner's): a pass says something."""
    outcomes, ranks = fuzzed
    for operator in BLOCK_WEIGHT_OPERATORS:
        mine = [o for o in outcomes if o.operator == operator]
        assert any(o.verdict == "refused" for o in mine), operator
        assert any(o.verdict == "accepted_exact" for o in mine), operator
    for operator in ("site_mix_rows", "site_inplace", "id_scale"):
        assert any(ranks.get(o.name, ("",))[0] == "accepted_exact" for o in outcomes if o.operator == operator), \
            operator


@pytest.mark.slow
def test_every_mutant_on_2_ranks(weight_mutants):
    """Every mutant of the block-weight targets (the fuzzer's, the one pass's and the block-weight operators), every
    accepted-exact one and every one raised at forward on 2 ranks."""
    outcomes = mutation.evaluate_all([mutation.unmodified(t) for t in _targets()] + weight_mutants)
    _on_ranks(outcomes, 1)
    assert not any(o.verdict in ("accepted_wrong", "crash") for o in outcomes), \
        _listing(outcomes, "accepted_wrong") + "\n" + _listing(outcomes, "crash")
