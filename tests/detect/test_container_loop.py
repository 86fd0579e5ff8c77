"""Detection of experts containers whose own forward is the expert loop (transformers 5.x Switch Transformers and
NLLB-MoE: a ``ModuleDict`` subclass looping over ``self[f"expert_{e}"]``; the idiom of ``blocks.DispatchMaskMoE``
and ``blocks.ExpertStackMoE``). No fast path reads a loop inside the container: the fast paths refuse it naming
the container, and the block is detected for record/exchange/replay (``execution="replay"``,
``autoep.detect.replay_proof``), its loop running as written. What is refused names the property and the line
(random dropout inside the experts while training, experts reading other rows, a forward reading an expert's
parameters). Edits of the loop that no exchange of ids could reproduce (another mask, swapped axes, a global
flag, dropout between the calls) run as written: they are accepted here, and exact on 2 and 4 ranks in
``tests/runtime/test_container_loop_recipe.py``.
"""

from __future__ import annotations

import blocks
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoep.detect.structure import count_experts, detect_moe_structure, fast_path_structure
from autoep.errors import UnsupportedModuleStructure


def _switch(**overrides):
    from transformers.models.switch_transformers import modeling_switch_transformers as m

    return m.SwitchTransformersSparseMLP(m.SwitchTransformersConfig(d_model=16, d_ff=24, num_experts=4, **overrides))


def _nllb(**overrides):
    from transformers.models.nllb_moe import modeling_nllb_moe as m

    return m.NllbMoeSparseMLP(m.NllbMoeConfig(d_model=16, num_experts=4, **overrides), 24)


def _refusal(block: nn.Module) -> str:
    with pytest.raises(UnsupportedModuleStructure) as info:
        detect_moe_structure(block)
    return str(info.value)


def test_switch_at_p0_is_accepted_for_replay():
    """Its experts' dropout probability is folded (0 is a fact too: raised after apply, it would draw masks)."""
    block = _switch(dropout_rate=0.0)
    s = detect_moe_structure(block)
    assert (s.execution, s.expert_storage, s.expert_kind, s.experts_path, s.folded) == (
        "replay", "module_list", "row_local", "experts", ("experts.*.dropout.p=0.0",))
    assert count_experts(block, s) == 4


def test_switch_default_is_refused_for_its_expert_dropout():
    """Switch's experts apply ``nn.Dropout(config.dropout_rate)`` (0.1 by default): random per expert call."""
    why = _refusal(_switch())
    assert "experts[0].dropout" in why and "p=0.1 while training" in why and "not deterministic" in why


def test_switch_default_in_eval_is_accepted_with_its_dropout_folded_idle():
    s = detect_moe_structure(_switch().eval())
    assert s.execution == "replay"
    assert s.folded == ("experts.*.dropout.p=0.1", "experts.*.dropout.training=False")


@pytest.mark.parametrize("token_dropout", [0.0, 0.2])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_nllb_is_accepted_with_its_token_dropout_left_where_the_token_is(token_dropout, mode):
    """NLLB's ``token_dropout`` is an entry of the experts' ModuleDict its forward reads by name: no expert, it
    runs where the token is (replayed with the RNG restored), so its p is no fact and any p is accepted."""
    block = _nllb(moe_token_dropout=token_dropout)
    getattr(block, mode)()
    s = detect_moe_structure(block)
    assert (s.execution, s.expert_kind, s.experts_path) == ("replay", "row_local", "experts")
    # the experts' own dropout is p=0 (NLLB's default): folded by p alone, in either mode
    assert s.folded == tuple(f"experts.expert_{e}.dropout.p=0.0" for e in range(4))
    assert count_experts(block, s) == 4  # token_dropout is an entry of the container, not an expert


def test_own_idioms_are_accepted_for_replay():
    s = detect_moe_structure(blocks.DispatchMaskMoE())
    assert (s.execution, s.experts_path, s.expert_kind) == ("replay", "experts", "row_local")
    s = detect_moe_structure(blocks.ExpertStackMoE())  # found by data flow under another name
    assert (s.execution, s.experts_path, s.expert_kind) == ("replay", "ffns", "row_local")


@pytest.mark.parametrize("make, where", [
    (lambda: _switch(dropout_rate=0.0), "experts is a SwitchTransformersExperts"),
    (lambda: _nllb(moe_token_dropout=0.0), "experts is a NllbMoeExperts"),
    (blocks.DispatchMaskMoE, "experts is a ExpertBank"),
    (blocks.ExpertStackMoE, "ffns is a ExpertStack"),
])
def test_the_fast_paths_refuse_a_loop_inside_the_container(make, where):
    """``replay=False`` (a plan entry's ``record_replay: false``) refuses, naming the container."""
    with pytest.raises(UnsupportedModuleStructure) as info:
        fast_path_structure(make())
    assert f"{where} with a forward of its own: no fast path proves a loop inside the experts container" in str(
        info.value)


# ---------------------------------------------------------------- variants of the idiom


def _bank_variant(forward):
    class Bank(blocks.ExpertBank):
        pass

    Bank.forward = forward
    block = blocks.DispatchMaskMoE()
    block.experts.__class__ = Bank
    return block


def summed_mask(self, tokens, dispatch, gates):
    out = torch.zeros_like(tokens)
    by_expert = dispatch.sum(0, keepdim=True).permute(2, 0, 1)
    for e in torch.greater(by_expert.sum(dim=(1, 2)), 0).nonzero().squeeze(-1):
        tok, slot = torch.where(by_expert[e])
        out.index_add_(0, tok, self[f"ffn{e}"](tokens[tok]) * gates[tok, slot, None])
    return out


def swapped_axes(self, tokens, dispatch, gates):
    out = torch.zeros_like(tokens)
    by_expert = dispatch.permute(1, 0, 2)
    for e in torch.greater(by_expert.sum(dim=(1, 2)), 0).nonzero().squeeze(-1):
        tok, slot = torch.where(by_expert[e])
        out.index_add_(0, tok, self[f"ffn{e}"](tokens[tok]) * gates[tok, slot, None])
    return out


def scaled_mask(self, tokens, dispatch, gates):
    out = torch.zeros_like(tokens)
    by_expert = (dispatch * tokens.sum()).permute(2, 0, 1)
    for e in torch.greater(by_expert.sum(dim=(1, 2)), 0).nonzero().squeeze(-1):
        tok, slot = torch.where(by_expert[e])
        out.index_add_(0, tok, self[f"ffn{e}"](tokens[tok]) * gates[tok, slot, None])
    return out


def random_in_training(self, tokens, dispatch, gates):
    out = torch.zeros_like(tokens)
    by_expert = dispatch.permute(2, 0, 1)
    for e in torch.greater(by_expert.sum(dim=(1, 2)), 0).nonzero().squeeze(-1):
        tok, slot = torch.where(by_expert[e])
        rows = self[f"ffn{e}"](tokens[tok]) * gates[tok, slot, None]
        if self.training:
            rows = self.drop(rows)
        out.index_add_(0, tok, rows)
    return out


SCALE_ROWS = False  # a module-level flag, read as written at every call


def global_branch(self, tokens, dispatch, gates):
    out = torch.zeros_like(tokens)
    by_expert = dispatch.permute(2, 0, 1)
    for e in torch.greater(by_expert.sum(dim=(1, 2)), 0).nonzero().squeeze(-1):
        tok, slot = torch.where(by_expert[e])
        rows = self[f"ffn{e}"](tokens[tok]) * gates[tok, slot, None]
        if SCALE_ROWS:
            rows = rows * 2
        out.index_add_(0, tok, rows)
    return out


def chained(self, tokens, dispatch, gates):
    """Harmful: each expert reads the sum of the earlier experts' outputs (replay raises at run time)."""
    out = torch.zeros_like(tokens)
    by_expert = dispatch.permute(2, 0, 1)
    for e in torch.greater(by_expert.sum(dim=(1, 2)), 0).nonzero().squeeze(-1):
        tok, slot = torch.where(by_expert[e])
        out.index_add_(0, tok, self[f"ffn{e}"]((tokens + out)[tok]) * gates[tok, slot, None])
    return out


def reads_parameters(self, tokens, dispatch, gates):
    """Harmful: reads every weight of an expert another rank owns (a stand-in there)."""
    out = torch.zeros_like(tokens)
    by_expert = dispatch.permute(2, 0, 1)
    for e in torch.greater(by_expert.sum(dim=(1, 2)), 0).nonzero().squeeze(-1):
        tok, slot = torch.where(by_expert[e])
        rows = self[f"ffn{e}"](tokens[tok]) * gates[tok, slot, None]
        out.index_add_(0, tok, rows + 0 * sum(p.sum() for p in self[f"ffn{e}"].parameters()))
    return out


# Edits the dispatch-mask splice refused (they change which rows an expert gets, or add a branch no fact
# watches); record/exchange/replay runs them as written: accepted, exact (runtime parity).
AS_WRITTEN = [summed_mask, swapped_axes, scaled_mask, random_in_training, global_branch, chained]


@pytest.mark.parametrize("forward", AS_WRITTEN, ids=lambda f: f.__name__)
def test_variants_replay_runs_as_written_are_accepted(forward):
    block = _bank_variant(forward)
    if forward is random_in_training:
        block.experts.drop = nn.Dropout(0.1)  # read by name: no expert, it stays (and draws) where the token is
    s = detect_moe_structure(block)
    assert (s.execution, s.experts_path) == ("replay", "experts")
    assert count_experts(block, s) == 4


def test_random_module_inside_an_expert_while_training_is_refused():
    block = blocks.DispatchMaskMoE()
    block.experts["ffn1"] = nn.Sequential(blocks.BiasedGeluFFN(16, 24), nn.Dropout(0.1))
    why = _refusal(block)
    assert "experts" in why and "p=0.1 while training" in why and "not deterministic" in why


def test_forward_reading_an_experts_parameters_is_refused():
    why = _refusal(_bank_variant(reads_parameters))
    assert "reads_parameters line" in why and "reads .parameters of a module" in why


class _CenteredFFN(blocks.BiasedGeluFFN):
    def forward(self, x):
        return self.fc2(self.act(self.fc1(x - x.mean(0))))


def test_expert_reading_other_rows_is_refused():
    block = blocks.DispatchMaskMoE()
    block.experts["ffn2"].__class__ = _CenteredFFN
    why = _refusal(block)
    assert "_CenteredFFN.forward line 2: `x.mean(0)`" in why and "mixes rows" in why


def test_every_leading_entry_not_read_by_name_travels():
    """Under replay an expert is whichever module the forward calls: keys out of order are fine (expert e is the
    e-th entry wherever its key points), and an entry no forward reads by name counts as an expert (an unused
    ``nn.Identity`` travels too: 5 experts, which ep_size 2 or 4 does not divide, so the plan refuses it)."""
    block = blocks.DispatchMaskMoE()
    entries = list(block.experts.items())
    block.experts.clear()
    for key, expert in [entries[1], entries[0], *entries[2:]]:  # ffn1 before ffn0
        block.experts[key] = expert
    s = detect_moe_structure(block)
    assert (s.execution, count_experts(block, s)) == ("replay", 4)
    block = blocks.DispatchMaskMoE(num_experts=4)
    block.experts["scratch"] = nn.Identity()
    s = detect_moe_structure(block)
    assert count_experts(block, s) == 5
    x = torch.randn(1, 3, 16)
    assert F.mse_loss(block(x), block(x)) == 0  # still the block's own forward (nothing applied)
