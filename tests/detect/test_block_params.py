"""Expert weights held as 3-D parameters on the block itself (no experts module): a routing loop slicing them by its
expert id is taken (``autoep.detect.block_weights``, run by the one pass only: ``record_replay: false`` refuses it,
saying so); a forward that never slices them (every expert on every row, ``torch.einsum`` over the whole tensor) is
refused with a message that names the weights and the opt-out (``autoep.detect.structure.block_expert_params``); the
same weights in an experts submodule the block calls are the batched proof's, as before."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoep.detect.structure import detect_moe_structure, has_experts
from autoep.errors import OPT_OUT_SPELLING, UnsupportedModuleStructure, UnsupportedPlanEntry
from autoep.plan.resolve import resolve_plan

D, FF, E, K = 8, 16, 4, 2


class BlockParamsMoE(nn.Module):
    """Top-k routing and a loop over the block's own (E, F, D) / (E, D, F) weights (a paper implementation's
    spelling): each expert is a slice of a tensor, never a module call."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, FF, D) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, D, FF) * 0.1)

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = torch.topk(F.softmax(self.gate(x), dim=-1), K, dim=-1)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(selected == e)
            h = F.gelu(x[tok] @ self.w1[e].T) @ self.w2[e].T
            out.index_add_(0, tok, h * weights[tok, slot, None])
        return out.reshape(hidden_states.shape)


class UnslicedParamsMoE(BlockParamsMoE):
    """Every expert on every row (``einsum`` over the whole (E, F, D) tensor), the routed rows' outputs picked after:
    no slice by an expert id, so no expert call to make."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = torch.topk(F.softmax(self.gate(x), dim=-1), K, dim=-1)
        h = torch.einsum("ted,tdf->tef", F.gelu(torch.einsum("td,efd->tef", x, self.w1)), self.w2.transpose(1, 2)
                         .permute(1, 2, 0))[..., :D]
        picked = h.gather(1, selected[..., None].expand(-1, -1, D))
        return (picked * weights[..., None]).sum(1).reshape(hidden_states.shape)


class ScaledLayer(nn.Module):
    """A dense module with a 3-D parameter of leading size 1 (RWKV's ``time_mix_*`` shape): not experts."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Parameter(torch.ones(1, 1, D))
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        return self.proj(x * self.mix)


MESSAGE = (r"UnslicedParamsMoE: experts are 3-D parameters on the block itself \(w1 \(4, 16, 8\), w2 \(4, 8, 16\)\), "
           r"and its forward never slices them by an expert id .* opt out\. Declare an explicit local_compute_fn .*"
           + re.escape(OPT_OUT_SPELLING))


@pytest.mark.parametrize("replay", [False, True])
def test_unsliced_weights_refused_naming_the_weights_and_the_opt_out(replay):
    with pytest.raises(UnsupportedModuleStructure, match=MESSAGE):
        detect_moe_structure(UnslicedParamsMoE(), replay=replay)


def test_sliced_weights_are_taken_by_the_one_pass_only():
    structure = detect_moe_structure(BlockParamsMoE())
    assert (structure.expert_storage, structure.execution, structure.experts_path, structure.expert_projs) == (
        "block_weights", "replay", "", ("w1", "w2"))
    with pytest.raises(UnsupportedModuleStructure, match=r"BlockParamsMoE: its experts are 3-D weights its own routing "
                                                         r"loop slices .* \(record_replay: false refuses it\)"):
        detect_moe_structure(BlockParamsMoE(), replay=False)


@pytest.mark.parametrize("entry", [{}, {"record_replay": True}, {"execution": "replay"}, {"moe_only": False}])
def test_the_plan_takes_it(entry):
    model = nn.ModuleDict({"mlp": BlockParamsMoE()})
    resolved = resolve_plan({"ep_size": 2, "plan": [{"match": "mlp", **entry}]}, model)
    assert resolved["plan"][0]["decision"]["structure"]["expert_storage"] == "block_weights"
    assert resolved["plan"][0]["local_compute_fn"]["_factory_"].endswith("block_weights.ep_block_weights")


def test_the_plan_refuses_unsliced_weights_before_apply():
    """moe_only (the default) takes the block (it holds experts) so the refusal names them, not a missing
    ``experts`` submodule."""
    model = nn.ModuleDict({"mlp": UnslicedParamsMoE()})
    with pytest.raises(UnsupportedPlanEntry, match=r"parallel\.plan\.0\.match='mlp' matched mlp \(UnslicedParamsMoE\)"
                                                   r".*experts are 3-D parameters on the block itself"):
        resolve_plan({"ep_size": 2, "plan": [{"match": "mlp"}]}, model)


def test_dense_modules_with_a_3d_parameter_are_not_experts():
    assert has_experts(BlockParamsMoE()) and has_experts(UnslicedParamsMoE())
    assert not has_experts(ScaledLayer())


def test_batched_experts_module_itself_is_not_a_block():
    """The (E, ., .) weights of an experts submodule (routing reaches it as arguments, no router of its own)
    stay the batched proof's: the block holding it is found, not the experts module."""
    import blocks

    block = blocks.TitanMoE()
    assert has_experts(block) and not has_experts(block.experts)


def test_batched_experts_with_a_norm_of_their_own_are_not_a_block():
    """MuseSpark's experts hold a post-expert norm (a submodule with parameters) beside their 3-D weights; the
    routing reaches them as arguments, so they are experts, not a block with weights of its own."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.muse_spark import modeling_muse_spark as family

    from autoep.tools.tiny import build_block, family_configs

    block, _ = build_block(family.MuseSparkMoE, family_configs(transformers.models.muse_spark), tiny=True)
    assert has_experts(block) and not has_experts(block.experts)
