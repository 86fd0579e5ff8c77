"""autograd_functions + grouped_loops: grouped experts applying their 3-D weights through the model's own
``torch.autograd.Function`` (ScatterMoE's ``ParallelLinear.apply(x, counts, W)``) are accepted where its forward and
hand-written backward are per-group loops, and the grouped recipe then runs that Function itself on the owner's
slice; every one-edit twin (``tests/function_blocks.py``) is refused naming the Function. Parity on 1, 2 and 4 ranks
and five SGD steps of a tiny LM: ``tests/runtime/test_grouped_recipe.py`` (``own_function*``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from function_blocks import (
    TWIN_FUNCTIONS,
    ExpertWeightScaleExperts,
    FirstFeatureScaleExperts,
    FunctionExperts,
    FunctionMoE,
    FusedFunctionExperts,
    LayerScaleExperts,
    MixedExperts,
    ParallelExpertsMLP,
    ParallelLinear,
    UnusedScaleExperts,
    twin_experts,
)
from torch import nn

from autoep.detect.grouped_proof import grouped_proof
from autoep.detect.structure import detect_moe_structure
from autoep.errors import UnsupportedModuleStructure
from autoep.runtime.recipes.grouped import ep_grouped_experts


@pytest.mark.parametrize("experts_cls,projs,layout,through", [
    (None, ("w1", "w3", "w2"), "separate", ("w1", "w3", "w2")),
    (FusedFunctionExperts, ("gate_up", "down"), "concatenated", ("gate_up",)),  # down by the experts' own loop
    (ParallelExpertsMLP, ("input_linear.weight", "output_linear.weight"), "concatenated",  # one module down
     ("input_linear.weight", "output_linear.weight")),
])
def test_accepted_as_grouped_experts_with_the_function_recorded(experts_cls, projs, layout, through):
    block = FunctionMoE(experts_cls) if experts_cls else FunctionMoE()
    structure = detect_moe_structure(block)
    assert (structure.expert_storage, structure.execution) == ("grouped", "grouped")
    assert (structure.expert_projs, structure.gate_up_layout) == (projs, layout)
    functions = grouped_proof(block.experts).functions
    assert {p: use.cls.__name__ for p, use in functions.items()} == {p: "ParallelLinear" for p in through}
    assert {use.roles for use in functions.values()} == {("x", "counts", "weight")}


@pytest.mark.parametrize("twin", list(TWIN_FUNCTIONS))
@pytest.mark.parametrize("replay", [False, True])
def test_one_edit_twins_are_refused_naming_the_function(twin, replay):
    fn = TWIN_FUNCTIONS[twin]
    with pytest.raises(UnsupportedModuleStructure, match=rf"custom autograd Function {fn.__name__} applied at .* "
                                                         r"is not proven per-group: .*opt out"):
        detect_moe_structure(FunctionMoE(twin_experts(fn)), replay=replay)


def test_a_weight_applied_through_the_function_and_by_the_experts_own_code_is_refused():
    with pytest.raises(UnsupportedModuleStructure, match=r"apply \['w1'\] both through a Function and by their own"):
        detect_moe_structure(FunctionMoE(MixedExperts))


def _backward_nodes(t: torch.Tensor) -> set[str]:
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
    return {type(n).__name__ for n in seen}


@pytest.mark.parametrize("experts_cls", [None, FusedFunctionExperts])
def test_the_recipe_runs_the_models_own_function_forward_and_backward(experts_cls):
    """The EP experts forward calls ParallelLinear.apply (its backward node is on the tape), once per weight the
    experts apply through it, and gives what the experts' own forward gives, gradients included."""
    torch.manual_seed(0)
    own = FunctionMoE(experts_cls) if experts_cls else FunctionMoE()
    block = FunctionMoE(experts_cls) if experts_cls else FunctionMoE()
    block.load_state_dict(own.state_dict())
    ep_grouped_experts(block, ep_mesh=None, structure=detect_moe_structure(block))
    x, counts = torch.randn(7, 16), torch.tensor([2, 0, 4, 1])
    results = []
    for experts in (own.experts, block.experts):
        xr = x.clone().requires_grad_()
        y = experts(xr, counts)
        nodes = _backward_nodes(y)
        (y * torch.arange(y.numel()).reshape(y.shape)).sum().backward()
        results.append((y.detach(), xr.grad, [p.grad for p in experts.parameters()]))
    assert "ParallelLinearBackward" in nodes
    torch.testing.assert_close(results[1], results[0])


def test_a_function_applied_to_something_else_than_rows_counts_weight_is_refused():
    class CountsTwice(FunctionExperts):
        def forward(self, x, num_tokens_per_expert):
            h = F.silu(ParallelLinear.apply(x, num_tokens_per_expert, num_tokens_per_expert))
            h = h * ParallelLinear.apply(x, num_tokens_per_expert, self.w3)
            return ParallelLinear.apply(h, num_tokens_per_expert, self.w2)

    with pytest.raises(UnsupportedModuleStructure, match=r"passes \['x', 'counts', 'counts'\]"):
        detect_moe_structure(FunctionMoE(CountsTwice))


@pytest.mark.parametrize("patch", ["backward", "global"])
def test_a_function_patched_after_apply_raises_instead_of_running_unproven_code(patch, monkeypatch):
    """The Function's forward and backward (class attributes) and the global naming it are facts of the proof:
    the model would run the patch, the recipe would run it too, unproven (here: an averaging backward)."""
    import function_blocks

    from autoep.errors import FactChanged

    block = FunctionMoE()
    ep_grouped_experts(block, ep_mesh=None, structure=detect_moe_structure(block))
    block(torch.randn(1, 3, 16))  # runs as applied
    if patch == "backward":
        monkeypatch.setattr(function_blocks.ParallelLinear, "backward",
                            staticmethod(function_blocks.AveragedWeightGrad.backward))
    else:
        monkeypatch.setattr(function_blocks, "ParallelLinear", function_blocks.AveragedWeightGrad)
    with pytest.raises(FactChanged, match="ParallelLinear"):
        block(torch.randn(1, 3, 16))


# ---------------------------------------------------------------------------------------------
# An experts container holding one parameter of its own (a LayerScale) beside its 3-D expert weights
# ---------------------------------------------------------------------------------------------


def test_a_scale_of_the_experts_own_is_accepted_as_dense():
    """Parity (1, 2, 4 ranks, an idle-experts variant, five SGD steps of a tiny LM): test_grouped_recipe's
    ``layer_scale*``; there no rank keeps ``gamma.grad`` None and ``gamma`` stays a plain tensor."""
    structure = detect_moe_structure(FunctionMoE(LayerScaleExperts))
    assert (structure.expert_storage, structure.dense_params, structure.expert_projs) == (
        "grouped", ("gamma",), ("w1", "w3", "w2"))
    assert grouped_proof(FunctionMoE(LayerScaleExperts).experts).scale == "gamma"


@pytest.mark.parametrize("experts_cls,match", [
    (FirstFeatureScaleExperts, r"`self\.gamma\[0\]` is not a construct"),
    (ExpertWeightScaleExperts, r"multiply their output by w2 \(4, 16, 32\), not a 1-D per-feature scale"),
    (UnusedScaleExperts, r"hold parameters \['gamma'\] the proven forward does not use"),
])
def test_one_edit_twins_of_the_scale_are_refused(experts_cls, match):
    with pytest.raises(UnsupportedModuleStructure, match=match):
        detect_moe_structure(FunctionMoE(experts_cls))


def test_apply_leaves_the_experts_own_scale_dense():
    """``apply_plan`` marks (one process) or shards (a mesh: the 2- and 4-rank runs) every parameter registered on
    the experts but the ones the proof names dense: ``gamma`` lands in the dense parameter group."""
    from autoep.plan.archetypes import compute_fn_config
    from autoep.runtime.apply import apply_plan, unsharded_expert_names

    model = nn.ModuleDict({"mlp": FunctionMoE(LayerScaleExperts)})
    structure = detect_moe_structure(model["mlp"])
    decision = {"source": "auto", "structure": structure.as_dict(), "modules": ["mlp"]}
    apply_plan(model, {"plan": [{"match": "mlp", "local_compute_fn": compute_fn_config(structure),
                                 "decision": decision}]}, None)
    assert unsharded_expert_names(model) == {"mlp.experts.w1", "mlp.experts.w2", "mlp.experts.w3"}


def test_fewer_counts_than_experts_fail_loudly_as_the_functions_backward_does():
    """The model's Function stacks a weight gradient per group: with 3 counts for 4 experts autograd refuses its
    backward; the EP forward refuses the call (a rank's slice has a count per local expert, and would not)."""
    own = FunctionMoE()
    x, counts = torch.randn(5, 16, requires_grad=True), torch.tensor([2, 0, 3])
    with pytest.raises(RuntimeError, match="invalid gradient"):
        own.experts(x, counts).sum().backward()
    ep_grouped_experts(own, ep_mesh=None, structure=detect_moe_structure(own))
    with pytest.raises(ValueError, match=r"3 num_tokens_per_expert for 4 experts; their autograd Function "
                                         r"\(ParallelLinear\) needs one per expert"):
        own.experts(x, counts)
