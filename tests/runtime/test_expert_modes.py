"""Mode-aware row-locality under EP (issue 31 item 4): experts whose row-locality depends on ``training`` (BatchNorm1d
and SyncBatchNorm with running statistics, ``F.batch_norm`` written out, a custom branch on ``self.training``,
dropout variants) run exactly in the mode they were proven for, on 1, 2 and 4 gloo ranks, through the spliced loop
and the one pass; a mode change after apply raises before the block's expert work, naming the mode.

Parity: ``tests/ep_parity.py`` (outputs, input grads, router grads summed over ranks, every expert grad from its
owner, a rank without tokens at W=4).
"""
from __future__ import annotations

import blocks
import ep_parity
import pytest
import torch
from distributed import guarded, run_cases
from test_row_local import CentresWhileTraining, DropsWith, FunctionalBatchNorm, Normed
from torch import nn

from autoep.errors import FactChanged

D = 16
FF = 32


def _stats(expert: nn.Module) -> nn.Module:
    """Running statistics that are not the identity's, so a wrong norm could not pass."""
    for m in expert.modules():
        if getattr(m, "running_mean", None) is not None:
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
    return expert


EXPERTS = {  # name: an expert builder, run in eval (GroupNorm, row-local in either mode: in training)
    "group_norm": lambda: Normed(nn.GroupNorm(4, FF)),
    "batch_norm_1d": lambda: _stats(Normed(nn.BatchNorm1d(FF))),
    "sync_batch_norm": lambda: _stats(Normed(nn.SyncBatchNorm(FF))),
    "functional_batch_norm": lambda: _stats(FunctionalBatchNorm()),
    "training_branch": CentresWhileTraining,
    "alpha_dropout": lambda: DropsWith(nn.AlphaDropout(0.3)),
    "dropout_1d": lambda: DropsWith(nn.Dropout1d(0.3)),
}
EXECUTIONS = ("auto", "replay")  # auto: the spliced loop (ExpertListMoE's loop is proven)


def _make(name: str):
    torch.manual_seed(sum(map(ord, name)))
    return blocks.ExpertListMoE([EXPERTS[name]() for _ in range(4)], hidden=D).train(name == "group_norm")


def mode_cases(rank: int, world_size: int) -> dict:
    results = {}
    for name in EXPERTS:
        for execution in EXECUTIONS:
            guarded(results, f"{name}/{execution}", _check, name, execution, rank, world_size)
    return results


def _check(name: str, execution: str, rank: int, world_size: int) -> None:
    ep_parity.check_parity(lambda: _make(name), rank, world_size, D, execution=execution)


@pytest.mark.parametrize("execution", EXECUTIONS)
@pytest.mark.parametrize("name", list(EXPERTS))
def test_single_process_parity_in_the_proven_mode(name, execution):
    _check(name, execution, 0, 1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_multi_rank_parity_in_the_proven_mode(world_size):
    results = run_cases(world_size, "test_expert_modes:mode_cases")
    failed = {case: errs for case, errs in results.items() if errs}
    assert len(results) == len(EXPERTS) * len(EXECUTIONS) and not failed, \
        "\n".join(f"{case}: {errs[0]}" for case, errs in failed.items())


@pytest.mark.parametrize("execution", EXECUTIONS)
@pytest.mark.parametrize("name", [n for n in EXPERTS if n != "group_norm"])
def test_train_after_apply_raises_naming_the_mode(name, execution):
    """A plan proven in eval: ``model.train()`` after apply would switch a norm to batch statistics, a branch to
    batch centring, a dropout to drawing; the block raises before its expert work. Back in eval it runs again."""
    model, _ = ep_parity.ep_model(_make(name), 1, execution=execution)
    x = ep_parity.data(1, D)[0][0]
    model.train()
    with pytest.raises(FactChanged, match=r"training was False when the experts were proven, now True"):
        model["mlp"](x)
    model.eval()
    torch.testing.assert_close(model["mlp"](x), _make(name)(x))
