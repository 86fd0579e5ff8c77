"""A module's mode changed after apply (issue 31 item 4): the fuzzer's run-time operator ``mode_changed``
(``mutation_runtime.rt_mode_changed``: ``train()``/``eval()`` on the whole block or on one expert, after apply, on
the reference and the EP copy alike) over the mode targets (``mutation.mode_targets``: BatchNorm1d with running
statistics and dropout at p=0.3 proven in eval, through the spliced loop and the one pass; GroupNorm and dropout at
p=0 built in train) and the DeepSeek remote-code and Switch targets (their eval paths: ``moe_infer`` under
``@torch.no_grad()``, the router's jitter switched off). Every mutant is refused (a mode the proofs folded,
``FactChanged`` before the expert work) or exact, in one process and (the slow tier) on 2 gloo ranks, a rank with no
tokens included; none is accepted and wrong, none crashes.

    pytest tests/detect/test_mode_changes.py             # in one process
    pytest -m slow tests/detect/test_mode_changes.py     # on 2 ranks
"""
from __future__ import annotations

import mutation
import mutation_ranks
import pytest

OPERATOR = "mode_changed"
EXTRA = ("v4/deepseek_remote", "v4/deepseek_remote_eval", "hf/switch_transformers")


@pytest.fixture(scope="module")
def mode_outcomes():
    """Every mode mutant and control in one process (ep_mesh=None)."""
    targets = mutation.mode_targets() + [t for t in mutation.targets() if t.name in EXTRA]
    mutants = [m for t in targets for m in mutation.target_mutants(t) if m.operator == OPERATOR]
    return mutation.evaluate_all([mutation.unmodified(t) for t in targets] + mutants)


@pytest.fixture(scope="module")
def on_ranks(mode_outcomes):
    """The exact ones and those raised at forward again on 2 gloo ranks (one rank with no tokens)."""
    outcomes = [o for o in mode_outcomes]
    names = [o.name for o in outcomes if o.verdict == "accepted_exact"] + mutation_ranks.raised_at_forward(outcomes)
    ranks = mutation_ranks.gloo_check(names, 2)
    mutation_ranks.apply_rank_results(outcomes, ranks, 2)
    return outcomes, ranks


def test_every_mode_change_is_exact_or_raises(mode_outcomes):
    _check(mode_outcomes)


@pytest.mark.slow
def test_every_mode_change_is_exact_or_raises_on_2_ranks(on_ranks):
    outcomes, ranks = on_ranks
    _check(outcomes)
    exact = [o.name for o in outcomes if o.operator == OPERATOR and o.verdict == "accepted_exact"]
    assert exact and all(ranks[name][0] == "accepted_exact" for name in exact), {n: ranks[n] for n in exact}


def _check(outcomes) -> None:
    bad = [o for o in outcomes if o.verdict in ("accepted_wrong", "crash")]
    assert not bad, "\n".join(f"{o.name}: {o.verdict}: {o.detail}" for o in bad)
    controls = [o for o in outcomes if o.operator == "none"]
    assert controls and all(o.verdict == "accepted_exact" for o in controls), controls


def test_the_mode_operator_is_not_vacuous(mode_outcomes):
    """A mode proven in eval switched to train raises naming the mode, through both executions; a flip where the
    experts are row-local in either mode (and the DeepSeek/Switch eval paths) is exact."""
    changed = [o for o in mode_outcomes if o.operator == OPERATOR]
    raised = {o.target for o in changed if o.verdict == "refused" and "training was False" in o.detail}
    assert {"mode/batch_norm_eval", "mode/batch_norm_eval_one_pass", "mode/dropout_eval_one_pass"} <= raised, changed
    exact = {o.name for o in changed if o.verdict == "accepted_exact"}
    assert {"mode/dropout_p0_train_one_pass/expert/mode_changed", "v4/deepseek_remote/block/mode_changed",
            "hf/switch_transformers/block/mode_changed"} <= exact, changed
