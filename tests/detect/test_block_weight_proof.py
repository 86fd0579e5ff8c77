"""3-D expert weights on the block (issue 31 item 3, ``autoep.detect.block_weights``): the blocks of
``tests/block_weight_blocks.py`` are taken, each site found where the model writes it; every one-edit twin is refused,
naming the line and what fails; a forward changed after apply raises. Parity: ``tests/runtime/test_block_weights.py``.

    pytest tests/detect/test_block_weight_proof.py
"""
from __future__ import annotations

import block_weight_blocks as bwb
import pytest
import torch
from torch import nn

from autoep.detect import block_weights
from autoep.detect.structure import detect_moe_structure
from autoep.errors import UnsupportedModuleStructure
from autoep.plan.resolve import resolve_plan
from autoep.runtime.apply import apply_plan
from autoep.runtime.recipes.deferred import ReplayError

# name -> (holder, weights, kinds of its sites, dense params)
ACCEPTED = {
    "block_weights": ("", ("w1", "w2"), ("inline",), ()),
    "swiglu_weights": ("", ("w1", "w3", "w2"), ("inline",), ()),
    "method_weights": ("", ("w1", "w2"), ("method",), ()),
    "einsum_weights": ("", ("w1", "w2"), ("inline",), ()),
    "child_weights": ("experts", ("w1", "w2"), ("inline", "inline"), ("gamma",)),
    "idle_expert": ("", ("w1", "w2"), ("inline",), ()),
}
# name -> what the refusal must say
REFUSED = {
    "next_expert": r"`self\.w2\[\(i \+ 1\) % E\]` reads an expert weight other than sliced by a name",
    "summed_weight": r"`self\.w2\[i\]\.sum` reads an attribute autoep does not prove row-local",
    "all_rows": r"applies the expert's weights to `x`, which reads no name the loop derives from its expert id",
    "mean_penalty": r"`self\.w1` reads an expert weight other than sliced by a name",
    "softmax_rows": r"calls \.softmax\(\.\.\.\), outside what autoep proves row-local",
    "method_all_rows": r"`self\._expert\(i, x\)` applies the expert's weights to `x`",
    "child_parameters": r"`self\.experts\.parameters` reads self\.experts other than by slicing",
    "two_ids": r"slices the expert weight by other than the expert id",
    "einsum_sum": r"is torch\.einsum other than contracting rows' last dim with a 2-D weight",
    "by_name": r"`getattr\(self, 'w1'\)` reads an attribute of the block by name",
}


def test_every_block_and_twin_is_listed():
    assert ACCEPTED.keys() == bwb.BLOCKS.keys() and REFUSED.keys() == bwb.TWINS.keys()


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_taken_with_its_sites(name):
    holder, weights, kinds, dense = ACCEPTED[name]
    block = bwb.BLOCKS[name]()
    proof = block_weights.prove(block)
    assert (proof.holder, proof.weights, tuple(s.kind for s in proof.sites), proof.dense) == (holder, weights, kinds,
                                                                                              dense)
    assert proof.num_experts == bwb.E
    structure = detect_moe_structure(block)
    assert (structure.expert_storage, structure.execution, structure.experts_path, structure.expert_projs,
            structure.dense_params) == ("block_weights", "replay", holder, weights, dense)


def test_the_sites_are_the_models_expressions():
    """The inline site is the whole expert computation as written, its rows the routed rows; the method site is the
    call with the id and the rows."""
    (site,) = block_weights.prove(bwb.BlockWeightsMoE()).sites
    assert (site.id_name, site.rows) == ("i", "x[tok]")
    (site,) = block_weights.prove(bwb.SwiGLUWeightsMoE()).sites  # the rows read twice, in the gate and the up
    assert site.rows == "x[idx]"
    (site,) = block_weights.prove(bwb.MethodWeightsMoE()).sites
    assert (site.method, site.rows) == ("_expert", "x[tok]")
    # the activation module call of the child holder runs where the token is: two sites, the second on its output
    assert [s.rows for s in block_weights.prove(bwb.ChildWeightsMoE()).sites] == ["x[tok]", "h"]


@pytest.mark.parametrize("name", list(REFUSED))
def test_harmful_twin_refused(name):
    with pytest.raises(UnsupportedModuleStructure, match=REFUSED[name]):
        detect_moe_structure(bwb.TWINS[name]())


def test_forward_swapped_after_apply_raises():
    model = nn.ModuleDict({"mlp": bwb.BlockWeightsMoE()})
    apply_plan(model, resolve_plan({"ep_size": 1, "plan": [{"match": "mlp"}]}, model), None)
    x = torch.randn(2, 3, bwb.D)
    model["mlp"](x)
    cls = type(model["mlp"])
    code = cls.forward.__code__
    try:
        cls.forward.__code__ = bwb.SoftmaxRowsTwin.forward.__code__
        with pytest.raises(ReplayError, match=r"BlockWeightsMoE\.forward was replaced, or its __code__ swapped"):
            model["mlp"](x)
    finally:
        cls.forward.__code__ = code


def test_the_plan_counts_the_weights_alone_as_experts():
    """``autoep-plan``'s table and ``ep_size: auto`` weigh the 3-D weights as experts, the router and a child's own
    scale as dense (the block itself is their holder: not every parameter of it is an expert's)."""
    from omegaconf import OmegaConf

    from autoep.plan.table import param_bytes

    model = nn.ModuleDict({"a": bwb.BlockWeightsMoE(), "b": bwb.ChildWeightsMoE()})
    resolved = OmegaConf.create(resolve_plan({"ep_size": 2, "plan": [{"match": "a"}, {"match": "b"}]}, model))
    weights = [p for n, p in model.named_parameters() if p.dim() == 3]
    expert_bytes, dense_bytes = param_bytes(model, resolved)
    assert expert_bytes == sum(p.numel() * 4 for p in weights)
    assert dense_bytes == sum(p.numel() * 4 for p in model.parameters()) - expert_bytes
