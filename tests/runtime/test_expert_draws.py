"""Randomness in experts (issue 31 item 6): ``PlanEntry.expert_draws=on_owner`` lets module experts draw (an
element-wise dropout with p > 0 while training), each expert's masks drawn on the rank that owns it. Equal in
distribution to the model, not bit-equal, so the proof here is not parity of values but:

- the drop rate: each element of an expert's output is dropped with probability p (a binomial bound, 6 sigma),
  kept ones scaled by 1/(1-p);
- one mask, forward and backward: with the mask the forward drew (read off the output) applied to the block's own
  forward in eval, the output, the input grad, the router grads (summed over ranks) and every expert grad (from its
  owner) equal EP's, on 1, 2 and 4 ranks (a rank without tokens at W=4), through the spliced loop and the one pass;
- the opt-in changes nothing else: at p=0 while training, and at p > 0 in eval, the structure, outputs and every
  grad are bit-identical with it and without it;
- without it the refusal names the key; with it, a draw that is not element-wise (``Dropout1d``, ``randn_like``)
  is still refused (one-edit twins); modes switch freely after apply (nothing about the dropout is folded).
"""
from __future__ import annotations

import blocks
import ep_parity
import pytest
import torch
import torch.distributed as dist
from distributed import guarded, run_cases
from omegaconf import OmegaConf
from test_row_local import DropsWith, Noisy
from torch import nn

from autoep.errors import PlanError, UnsupportedPlanEntry
from autoep.plan.resolve import resolve_plan
from autoep.plan.table import plan_rows

D, P = 16, 0.5
EXECUTIONS = ("auto", "replay")  # auto: the spliced loop (ExpertListMoE's loop is proven)


class Dropped(nn.Module):
    """An expert whose output is its dropout's: ``drop(fc(x))`` (the mask is visible in the block's output)."""

    def __init__(self, p: float, drop=nn.Dropout):
        super().__init__()
        self.fc, self.drop = nn.Linear(D, D), drop(p)

    def forward(self, x):
        return self.drop(self.fc(x))


def _block(p: float = P, mode: str = "train", top_k: int = 1, drop=nn.Dropout) -> nn.Module:
    """Top-1 routing: a token's output is its one expert's (weight 1), so its zeros are that expert's mask."""
    torch.manual_seed(3)
    return blocks.ExpertListMoE([Dropped(p, drop) for _ in range(4)], hidden=D, top_k=top_k).train(mode == "train")


def _masked_reference(x, grad_out, mask):
    """The block's own forward in eval with ``mask`` (the one EP drew) applied as dropout applies it."""
    ref = _block(mode="eval")
    x = x.clone().requires_grad_()
    out = ref(x * 1) * mask / (1 - P)
    (out * grad_out).sum().backward()
    return ref, out.detach(), x.grad


def _check_draws(rank: int, world_size: int, execution: str) -> None:
    slices = ep_parity.data(world_size, D, batches=[16, 0, 24, 8][:world_size] if world_size > 1 else [40])
    model, _ = ep_parity.ep_model(_block(), world_size, execution=execution, expert_draws="on_owner")
    x, grad_out = slices[rank]
    out, x_grad = ep_parity.run(model["mlp"], x, grad_out, seed=100 + rank)
    mask = (out != 0).to(out.dtype)
    ref, ref_out, ref_x_grad = _masked_reference(x, grad_out, mask)
    dense, experts = ep_parity.grads(model, world_size)
    ref_grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in ref.named_parameters()}
    dropped = torch.tensor([float((mask == 0).sum()), float(mask.numel())])
    if world_size > 1:
        for g in ref_grads.values():
            dist.all_reduce(g)  # NOTE: collective; the references' grads sum over ranks as EP's do
        dist.all_reduce(dropped)  # NOTE: collective; the drop count over every rank's outputs
    torch.testing.assert_close(out, ref_out)  # kept elements scaled by 1/(1-p), dropped ones zero
    torch.testing.assert_close(x_grad, ref_x_grad)  # the backward through the mask the forward drew
    for n, p in ref.named_parameters():
        p.grad = ref_grads[n]
    ep_parity.assert_grads_match(ref, dense, experts)
    zeros, n = dropped.tolist()
    assert abs(zeros / n - P) < 6 * (P * (1 - P) / n) ** 0.5, f"drop rate {zeros / n:.3f} over {n:.0f}, p={P}"


def draw_cases(rank: int, world_size: int) -> dict:
    results = {}
    for execution in EXECUTIONS:
        guarded(results, f"draws/{execution}", _check_draws, rank, world_size, execution)
        for p, mode in ((0.0, "train"), (P, "eval")):
            guarded(results, f"unchanged/{execution}/p={p}/{mode}", _check_unchanged, rank, world_size, execution, p,
                    mode)
    return results


def _check_unchanged(rank: int, world_size: int, execution: str, p: float, mode: str) -> None:
    """With the opt-in and without it: bit-identical outputs and grads (and, at p=0, the same structure)."""
    x, grad_out = ep_parity.data(world_size, D)[rank]
    seen = []
    for draws in ("exact", "on_owner"):
        model, resolved = ep_parity.ep_model(_block(p, mode, top_k=2), world_size, execution=execution,
                                             expert_draws=draws)
        out, x_grad = ep_parity.run(model["mlp"], x, grad_out, seed=100 + rank)
        seen.append((OmegaConf.to_container(resolved.plan[0].decision.structure), out, x_grad,
                     *ep_parity.grads(model, world_size)))
    (s0, out0, xg0, dense0, experts0), (s1, out1, xg1, dense1, experts1) = seen
    if p == 0:  # nothing draws: the same structure
        assert s0 == s1 and s1["expert_draws"] == [], (s0, s1)
    else:  # in eval the dropout is the identity; with the opt-in it is a draw site for train mode (recorded)
        assert s1["expert_draws"] == ["experts_list.*.drop=Dropout(p=0.5)"], s1
    assert torch.equal(out0, out1) and torch.equal(xg0, xg1)
    assert dense0.keys() == dense1.keys() and all(torch.equal(dense0[n], dense1[n]) for n in dense0)
    assert experts0.keys() == experts1.keys()
    for n, (v0, g0) in experts0.items():
        v1, g1 = experts1[n]
        assert torch.equal(v0, v1) and (g0 is None) == (g1 is None) and (g0 is None or torch.equal(g0, g1)), n


@pytest.mark.parametrize("execution", EXECUTIONS)
def test_single_process_draws_at_the_drop_rate_through_one_mask(execution):
    _check_draws(0, 1, execution)


@pytest.mark.parametrize("execution", EXECUTIONS)
@pytest.mark.parametrize("p, mode", [(0.0, "train"), (P, "eval")])
def test_single_process_the_opt_in_changes_nothing_at_p0_or_in_eval(execution, p, mode):
    _check_unchanged(0, 1, execution, p, mode)


@pytest.mark.parametrize("world_size", [2, 4])
def test_multi_rank_draws_and_nothing_else_changed(world_size):
    results = run_cases(world_size, "test_expert_draws:draw_cases")
    failed = {case: errs for case, errs in results.items() if errs}
    assert len(results) == 3 * len(EXECUTIONS) and not failed, \
        "\n".join(f"{case}: {errs[0]}" for case, errs in failed.items())


def test_without_the_opt_in_the_refusal_names_the_key():
    model = nn.ModuleDict({"mlp": _block()})
    with pytest.raises(UnsupportedPlanEntry) as info:
        resolve_plan({"ep_size": 1, "plan": [{"match": "mlp"}]}, model)
    text = str(info.value)
    assert "is dropout with p=0.5 while training: it draws random numbers" in text and \
        "parallel.plan.0.expert_draws=on_owner" in text, text


def test_the_opt_in_is_recorded_in_resolved_yaml_and_the_plan_table():
    model = nn.ModuleDict({"mlp": _block()})
    resolved = resolve_plan({"ep_size": 2, "plan": [{"match": "mlp", "expert_draws": "on_owner"}]}, model)
    entry = resolved.plan[0]
    assert entry.expert_draws == "on_owner"
    assert list(entry.decision.structure.expert_draws) == ["experts_list.*.drop=Dropout(p=0.5)"]
    assert not any("drop." in f for f in entry.decision.structure.folded)  # p and mode free: drawn either way
    assert "expert_draws=on_owner (equal in distribution, not bit-equal)" in plan_rows(model, resolved)[0][1]
    again = resolve_plan(OmegaConf.to_container(resolved), model)  # the artifact replays
    assert again.plan[0].decision.fingerprint == entry.decision.fingerprint
    dropped = OmegaConf.to_container(resolved)
    dropped["plan"][0]["expert_draws"] = "exact"
    with pytest.raises(PlanError, match=r"parallel.plan.0.expert_draws=exact, but its frozen decision draws"):
        resolve_plan(dropped, model)


def test_the_key_is_validated_and_only_for_autoeps_own_executions():
    model = nn.ModuleDict({"mlp": _block()})
    with pytest.raises(PlanError, match=r"parallel.plan.0.expert_draws='sometimes' is not one of"):
        resolve_plan({"ep_size": 1, "plan": [{"match": "mlp", "expert_draws": "sometimes"}]}, model)
    explicit = {"_factory_": "autoep.runtime.recipes.replay.ep_replay_block"}
    with pytest.raises(PlanError, match=r"expert_draws=on_owner is a choice of autoep's own executions"):
        resolve_plan({"ep_size": 1, "plan": [{"match": "mlp", "local_compute_fn": explicit,
                                               "expert_draws": "on_owner"}]}, model)


@pytest.mark.parametrize("expert, why", [
    (lambda: DropsWith(nn.Dropout1d(0.1)), "expert_draws=on_owner takes element-wise dropout only"),
    (Noisy, "`torch.randn_like(x[..., :1])` draws random numbers"),
])
def test_draws_that_are_not_element_wise_dropout_are_refused_with_the_opt_in(expert, why):
    """One-edit twins of the accepted ``nn.Dropout``: a channel-wise mask, a draw of another shape."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"mlp": blocks.ExpertListMoE([expert() for _ in range(4)], hidden=D).train()})
    with pytest.raises(UnsupportedPlanEntry, match=None) as info:
        resolve_plan({"ep_size": 1, "plan": [{"match": "mlp", "expert_draws": "on_owner"}]}, model)
    assert why in str(info.value), str(info.value)


@pytest.mark.parametrize("execution", EXECUTIONS)
def test_modes_switch_freely_after_apply_with_the_opt_in(execution):
    """train -> eval -> train: nothing about the dropout is folded, so no mode raises; in eval the block is exact."""
    model, _ = ep_parity.ep_model(_block(), 1, execution=execution, expert_draws="on_owner")
    x = ep_parity.data(1, D)[0][0]
    model["mlp"](x)
    model.eval()
    torch.testing.assert_close(model["mlp"](x), _block(mode="eval")(x))
    model.train()
    assert (model["mlp"](x) == 0).any()


def test_switch_at_its_default_config_is_taken_with_the_opt_in():
    """transformers' Switch Transformers at its default ``dropout_rate=0.1`` (its experts' dropout while training):
    refused without the key, taken with it; in eval exact, in training its experts draw."""
    from transformers.models.switch_transformers import modeling_switch_transformers as m

    torch.manual_seed(0)
    config = m.SwitchTransformersConfig(d_model=D, d_ff=24, num_experts=4, expert_capacity=4)
    ref = m.SwitchTransformersSparseMLP(config).train()
    model = nn.ModuleDict({"mlp": m.SwitchTransformersSparseMLP(config)})
    model["mlp"].load_state_dict(ref.state_dict())
    with pytest.raises(UnsupportedPlanEntry, match=r"parallel.plan.0.expert_draws=on_owner"):
        resolve_plan({"ep_size": 1, "plan": [{"match": "mlp"}]}, model)
    model, resolved = ep_parity.ep_model(model["mlp"], 1, expert_draws="on_owner")
    assert list(resolved.plan[0].decision.structure.expert_draws) == ["experts.*.dropout=Dropout(p=0.1)"]
    x = torch.randn(2, 6, D)
    model.eval(), ref.eval()
    torch.testing.assert_close(model["mlp"](x), ref(x))
    model.train()
    assert not torch.allclose(model["mlp"](x), ref(x))  # drawn: 10% of each expert's hidden units dropped


@pytest.mark.parametrize("execution", EXECUTIONS)
def test_checkpointing_recomputes_the_same_masks(execution):
    """Activation checkpointing around the block (non-reentrant) recomputes its forward with the RNG state restored:
    the owner draws the same masks again, so output, input grad and every parameter grad equal the run without it
    (a different mask in the recomputation would give the backward another mask than the forward's, silently)."""
    import torch.utils.checkpoint as cp

    seen = []
    for checkpointed in (False, True):
        model, _ = ep_parity.ep_model(_block(), 1, execution=execution, expert_draws="on_owner")
        x, grad_out = ep_parity.data(1, D, batches=[40])[0]
        torch.manual_seed(5)
        x = x.clone().requires_grad_()
        out = cp.checkpoint(model["mlp"], x * 1, use_reentrant=False) if checkpointed else model["mlp"](x * 1)
        (out * grad_out).sum().backward()
        seen.append((out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}))
    (out0, x0, grads0), (out1, x1, grads1) = seen
    assert (out0 == 0).any() and torch.equal(out0, out1) and torch.equal(x0, x1)
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)
