"""Detection of experts containers whose own forward is the expert loop (``autoep.detect.container_loop``):
what is accepted (transformers 5.x Switch Transformers and NLLB-MoE at dropout p=0, the idiom of
``blocks.DispatchMaskMoE`` and ``blocks.ExpertStackMoE``) and what is refused, naming the property and the line
(random dropout while training, a routing argument that is no per-row dispatch mask, experts reading other
rows, keys that do not number the experts in order). Their EP parity: ``tests/runtime/test_container_loop_recipe.py``.
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
    """Why the fast path's container-loop proof refuses ``block`` (record/exchange/replay may still run it)."""
    with pytest.raises(UnsupportedModuleStructure) as info:
        fast_path_structure(block)
    return str(info.value)


def test_switch_at_p0_is_accepted():
    """Its experts' dropout probability is folded (0 is a fact too: raised after apply, it would draw masks)."""
    s = detect_moe_structure(_switch(dropout_rate=0.0))
    assert (s.expert_storage, s.expert_kind, s.experts_path, s.folded) == ("module_list", "row_local", "experts",
                                                                          ("experts.*.dropout.p=0.0",))


def test_switch_default_is_refused_for_its_expert_dropout():
    """Switch's experts apply ``nn.Dropout(config.dropout_rate)`` (0.1 by default): random per expert call."""
    why = _refusal(_switch())
    assert "experts[0].dropout" in why and "p=0.1 while training" in why and "not deterministic" in why


def test_nllb_at_p0_is_accepted_with_the_token_dropout_folded():
    block = _nllb(moe_token_dropout=0.0)
    s = detect_moe_structure(block)
    assert (s.expert_storage, s.expert_kind, s.experts_path) == ("module_list", "row_local", "experts")
    assert s.folded == (*(f"experts.expert_{e}.dropout.p=0.0" for e in range(4)), "experts.moe_token_dropout=0.0")
    assert count_experts(block, s) == 4  # token_dropout is an entry of the container, not an expert


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_nllb_default_is_refused_for_its_token_dropout(mode):
    """NLLB drops each expert's weighted rows with ``token_dropout`` (p=0.2 by default) while training; a branch
    on the train/eval mode is never folded, so it is refused in eval too."""
    block = _nllb()
    getattr(block, mode)()
    why = _refusal(block)
    assert "NllbMoeExperts.forward line" in why and "if self.training:" in why
    assert "self.token_dropout (Dropout with p=0.2) while training" in why and "not deterministic" in why


def test_own_idioms_are_accepted():
    s = detect_moe_structure(blocks.DispatchMaskMoE())
    assert (s.experts_path, s.expert_kind, s.folded) == ("experts", "row_local", ("experts.output_scale=1.0",))
    s = detect_moe_structure(blocks.ExpertStackMoE())  # found by data flow under another name
    assert (s.experts_path, s.expert_kind) == ("ffns", "row_local")


# ---------------------------------------------------------------- unsound variants of the idiom


def _bank_variant(forward):
    class Bank(blocks.ExpertBank):
        pass

    Bank.forward = forward
    block = blocks.DispatchMaskMoE()
    block.experts.__class__ = Bank
    return block


def _summed_mask(self, tokens, dispatch, gates):
    out = torch.zeros_like(tokens)
    by_expert = dispatch.sum(0, keepdim=True).permute(2, 0, 1)
    for e in torch.greater(by_expert.sum(dim=(1, 2)), 0).nonzero().squeeze(-1):
        tok, slot = torch.where(by_expert[e])
        out.index_add_(0, tok, self[f"ffn{e}"](tokens[tok]) * gates[tok, slot, None])
    return out


def _swapped_axes(self, tokens, dispatch, gates):
    out = torch.zeros_like(tokens)
    by_expert = dispatch.permute(1, 0, 2)
    for e in torch.greater(by_expert.sum(dim=(1, 2)), 0).nonzero().squeeze(-1):
        tok, slot = torch.where(by_expert[e])
        out.index_add_(0, tok, self[f"ffn{e}"](tokens[tok]) * gates[tok, slot, None])
    return out


def _scaled_mask(self, tokens, dispatch, gates):
    out = torch.zeros_like(tokens)
    by_expert = (dispatch * tokens.sum()).permute(2, 0, 1)
    for e in torch.greater(by_expert.sum(dim=(1, 2)), 0).nonzero().squeeze(-1):
        tok, slot = torch.where(by_expert[e])
        out.index_add_(0, tok, self[f"ffn{e}"](tokens[tok]) * gates[tok, slot, None])
    return out


def _tokens_as_mask(self, tokens, dispatch, gates):
    out = torch.zeros_like(tokens)
    by_expert = tokens.permute(2, 0, 1)
    for e in torch.greater(by_expert.sum(dim=(1, 2)), 0).nonzero().squeeze(-1):
        tok, slot = torch.where(by_expert[e])
        out.index_add_(0, tok, self[f"ffn{e}"](tokens[tok]) * gates[tok, slot, None])
    return out


def _random_in_training(self, tokens, dispatch, gates):
    out = torch.zeros_like(tokens)
    by_expert = dispatch.permute(2, 0, 1)
    for e in torch.greater(by_expert.sum(dim=(1, 2)), 0).nonzero().squeeze(-1):
        tok, slot = torch.where(by_expert[e])
        rows = self[f"ffn{e}"](tokens[tok]) * gates[tok, slot, None]
        if self.training:
            rows = self.drop(rows)
        out.index_add_(0, tok, rows)
    return out


SCALE_ROWS = False  # a module-level flag: its value is not watched after detection, so no branch folds on it


def _global_branch(self, tokens, dispatch, gates):
    out = torch.zeros_like(tokens)
    by_expert = dispatch.permute(2, 0, 1)
    for e in torch.greater(by_expert.sum(dim=(1, 2)), 0).nonzero().squeeze(-1):
        tok, slot = torch.where(by_expert[e])
        rows = self[f"ffn{e}"](tokens[tok]) * gates[tok, slot, None]
        if SCALE_ROWS:
            rows = rows * 2
        out.index_add_(0, tok, rows)
    return out


def test_branch_on_a_global_is_refused():
    assert "branches on ['SCALE_ROWS'], not on the module's own constant attributes" in _refusal(
        _bank_variant(_global_branch))


@pytest.mark.parametrize("forward, why", [
    (_summed_mask, "`dispatch.sum(0, keepdim=True)` is not understood"),
    (_swapped_axes, "is not permute(2, 1, 0) or permute(2, 0, 1) of a (tokens, slots, experts) dispatch mask"),
    (_scaled_mask, "is not understood"),
    (_tokens_as_mask, "does not read hidden states, expert ids and weights from its three arguments"),
])
def test_routing_that_is_no_per_row_dispatch_mask_is_refused(forward, why):
    assert why in _refusal(_bank_variant(forward))


def test_random_module_while_training_is_refused():
    block = _bank_variant(_random_in_training)
    block.experts.drop = nn.Dropout(0.1)
    why = _refusal(block)
    assert "if self.training:" in why and "self.drop (Dropout with p=0.1) while training" in why


class _CenteredFFN(blocks.BiasedGeluFFN):
    def forward(self, x):
        return self.fc2(self.act(self.fc1(x - x.mean(0))))


def test_expert_reading_other_rows_is_refused():
    block = blocks.DispatchMaskMoE()
    block.experts["ffn2"].__class__ = _CenteredFFN
    why = _refusal(block)
    assert "_CenteredFFN.forward line 2: `x.mean(0)`" in why and "mixes rows" in why


def test_keys_must_number_the_experts_in_order():
    block = blocks.DispatchMaskMoE()
    entries = list(block.experts.items())
    block.experts.clear()
    for key, expert in [entries[1], entries[0], *entries[2:]]:  # ffn1 before ffn0: expert e is not entry e
        block.experts[key] = expert
    assert "first entry is not ffn0" in _refusal(block)
    block = blocks.DispatchMaskMoE()
    block.experts["other"] = nn.Identity()
    block.experts["ffn7"] = blocks.BiasedGeluFFN(16, 24)  # an expert key after a non-expert entry
    assert "does not index the experts by the loop's expert id" in _refusal(block)


def test_count_and_ids_follow_the_leading_keyed_entries():
    block = blocks.DispatchMaskMoE(num_experts=4)
    block.experts["scratch"] = nn.Identity()  # not an expert: no key of the loop names it
    s = detect_moe_structure(block)
    assert count_experts(block, s) == 4
    x = torch.randn(1, 3, 16)
    assert F.mse_loss(block(x), block(x)) == 0  # still the block's own forward (nothing applied)
