"""grouped_proof: what ``experts(x_sorted, num_tokens_per_expert)`` computes, proven from source or refused.

Each mutant below is a one-line edit of an accepted spelling (torchtitan, torchtune, the Aria-style grouped
GEMM and its module-level offset loop), defined from edited source as a subclass (``mutation_source``);
it must be refused, naming the construct, or accepted and exact against its own forward and backward.
"""

from __future__ import annotations

import ast
import copy
import inspect
import textwrap

import blocks
import pytest
import torch
import torch.nn as nn
from mutation_source import with_method

from autoep import UnsupportedModuleStructure, detect_moe_structure
from autoep.detect.grouped_proof import grouped_proof
from autoep.runtime.recipes.grouped import ep_grouped_experts

D = 16


def _edit(cls: type, method: str, old: str, new: str, prelude: str = "") -> type:
    src = textwrap.dedent(inspect.getsource(getattr(cls, method)))
    assert src.count(old) == 1, (cls.__name__, old)
    return with_method(cls, method, ast.parse(src.replace(old, new)).body[0], prelude)


def _helper_edit(fn, caller: type, old: str, new: str) -> type:
    """``caller`` (a module whose forward calls the module-level ``fn``) calling an edited copy of ``fn``."""
    src = inspect.getsource(fn)
    assert src.count(old) == 1, old
    prelude = src.replace(old, new).replace(f"def {fn.__name__}(", "def edited_helper(")
    return _edit(caller, "forward", f"{fn.__name__}(", "edited_helper(", prelude)


def _gemm_loop_edit(old: str, new: str) -> type:
    """The Aria-style GEMM module calling an edited copy of the module-level offset loop."""
    return _helper_edit(blocks.grouped_gemm_loop, blocks.AriaStyleGroupedGemm, old, new)


def _padded_edit(old: str, new: str) -> type:
    """torchtitan's padded experts calling an edited copy of their module-level for-loop."""
    return _helper_edit(blocks.run_experts_for_loop, blocks.PaddedGroupedExperts, old, new)


def _block(kind: str, edited: type | None = None) -> nn.Module:
    torch.manual_seed(0)
    block = {"titan": blocks.TitanMoE, "tune": blocks.TuneMoE, "aria": blocks.AriaStyleMoELayer,
             "padded": blocks.TitanPaddedMoE}[kind]()
    if edited is not None:
        for m in block.modules():
            if isinstance(m, edited.__mro__[1]):
                m.__class__ = edited
    return block.train()


def _run(block, x):
    x = x.clone().requires_grad_()
    out = block(x)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


def refused_or_exact(block: nn.Module) -> str:
    """"refused: <reason>" or "exact" (the recipe equals the block's own forward and backward); fails
    the test where an accepted block computes something else."""
    try:
        structure = detect_moe_structure(block)
    except UnsupportedModuleStructure as exc:
        return f"refused: {exc}"
    ep = copy.deepcopy(block)
    ep_grouped_experts(ep, ep_mesh=None, structure=structure.as_dict())
    x = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_run(ep, x), _run(block, x))
    return "exact"


TITAN = blocks.GroupedExperts
MUTANTS = {  # name: (block kind, edited class, what the verdict must say)
    "scale_inside": ("titan", lambda: _edit(TITAN, "forward", "h = h * torch", "h = 2.0 * h * torch"), "refused"),
    "extra_term": ("titan", lambda: _edit(TITAN, "forward", "out.append(torch.matmul(h,",
                                          "out.append(x_expert + torch.matmul(h,"), "refused"),
    "non_row_local": ("titan", lambda: _edit(TITAN, "forward", "torch.matmul(x_expert, self.w1",
                                             "torch.matmul(x_expert.flip(0), self.w1"), "refused"),
    "other_expert": ("titan", lambda: _edit(TITAN, "forward", "self.w3[expert_idx]", "self.w3[0]"), "refused"),
    "no_transpose": ("titan", lambda: _edit(TITAN, "forward", "self.w2[expert_idx].transpose(-2, -1)",
                                            "self.w2[expert_idx]"), "refused"),
    "cat_dim": ("titan", lambda: _edit(TITAN, "forward", "torch.cat(out, dim=0)", "torch.cat(out, dim=-1)"),
                "refused"),
    "gelu": ("titan", lambda: _edit(TITAN, "forward", "F.silu(", "F.gelu("), "exact"),
    "same_weight_twice": ("titan", lambda: _edit(TITAN, "forward", "self.w1[expert_idx].transpose(-2, -1)))",
                                                 "self.w3[expert_idx].transpose(-2, -1)))"), "refused"),
    "chunk_order": ("aria", lambda: _edit(blocks.AriaStyleGroupedMLP, "forward", "projection, gate = ",
                                          "gate, projection = "), "refused"),
    "chunk_dim": ("aria", lambda: _edit(blocks.AriaStyleGroupedMLP, "forward", "2, dim=-1", "2, dim=0"),
                  "refused"),
    "scale_counts": ("aria", lambda: _edit(blocks.AriaStyleGroupedGemm, "forward", "tokens_per_expert.cpu()",
                                           "tokens_per_expert.cpu() * 2"), "refused"),
    "end_off_by_one": ("aria", lambda: _gemm_loop_edit("[expert_num + 1]", "[expert_num + 2]"), "refused"),
    "start_off_by_one": ("aria", lambda: _gemm_loop_edit("start = cumsum_num_tokens[expert_num]",
                                                         "start = cumsum_num_tokens[expert_num + 1]"), "refused"),
    "no_leading_zero": ("aria", lambda: _gemm_loop_edit("cumsum_num_tokens = torch.cat((zero_tensor, "
                                                        "cumsum_num_tokens))", "pass"), "refused"),
    "fewer_experts": ("aria", lambda: _gemm_loop_edit("range(expert_weights.shape[0])",
                                                      "range(expert_weights.shape[0] - 1)"), "refused"),
    "ones_accumulator": ("aria", lambda: _gemm_loop_edit("output = torch.zeros(", "output = torch.ones("), "refused"),
    "float64_accumulator": ("aria", lambda: _gemm_loop_edit("dtype=token_states.dtype, device",
                                                            "dtype=torch.float64, device"), "refused"),
    "scale_in_loop": ("aria", lambda: _gemm_loop_edit("output[start:end] = out", "output[start:end] = out * 2"),
                      "refused"),
    "pad_one_more": ("padded", lambda: _padded_edit("num_padding = x.shape[0] - sum(", "num_padding = 1 + "
                                                    "x.shape[0] - sum("), "refused"),
    "head_short": ("padded", lambda: _padded_edit("x[: sum(num_tokens_per_expert)]",
                                                  "x[: sum(num_tokens_per_expert) - 1]"), "refused"),
    "pad_ones": ("padded", lambda: _padded_edit("out.new_zeros(", "out.new_ones("), "refused"),
    "pad_first": ("padded", lambda: _padded_edit("torch.vstack((out, out.new_zeros((num_padding, out.shape[-1]))))",
                                                 "torch.vstack((out.new_zeros((num_padding, out.shape[-1])), out))"),
                  "refused"),
    "no_pad": ("padded", lambda: _padded_edit("out = torch.vstack(", "out2 = torch.vstack("), "refused"),
    "whole_rows_in_loop": ("aria", lambda: _gemm_loop_edit("tokens = token_states[start:end]",
                                                           "tokens = token_states"), "refused"),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_one_line_mutants_are_refused_or_exact(name):
    kind, make, want = MUTANTS[name]
    verdict = refused_or_exact(_block(kind, make()))
    assert verdict.startswith(want), verdict


def test_the_accepted_spellings_are_exact():
    for kind in ("titan", "tune", "aria", "padded"):
        assert refused_or_exact(_block(kind)) == "exact"


def test_roles_follow_the_source_not_the_names():
    """w3 as the activated half and w1 as the multiplier: the proof reads which weight is which."""
    edited = _edit(TITAN, "forward", "self.w1[expert_idx].transpose(-2, -1)))\n        h = h * torch.matmul("
                   "x_expert, self.w3[", "self.w3[expert_idx].transpose(-2, -1)))\n        h = h * "
                   "torch.matmul(x_expert, self.w1[")
    block = _block("titan", edited)
    assert (grouped_proof(block.experts).gate, grouped_proof(block.experts).up) == ("w3", "w1")
    assert refused_or_exact(block) == "exact"


def test_an_activation_module_on_the_experts_is_called_as_theirs():
    block = _block("tune")
    block.experts.act_fn = nn.GELU(approximate="tanh")
    assert detect_moe_structure(block).expert_act == "act_fn"
    assert refused_or_exact(block) == "exact"


@pytest.mark.parametrize("change,reason", [
    (lambda b: setattr(b.experts, "w3", b.experts.w1), "tie some weights"),
    (lambda b: b.experts.register_parameter("scale", nn.Parameter(torch.ones(4, 1, 1))), "does not use"),
    (lambda b: b.experts.register_buffer("mask", torch.ones(4)), "buffers"),
    (lambda b: b.experts.w2.requires_grad_(False), "frozen"),
    (lambda b: b.experts.register_forward_hook(lambda m, a, o: o * 2), "forward_hooks"),
])
def test_run_time_state_of_titan_experts_is_refused(change, reason):
    block = _block("titan")
    change(block)
    assert reason in refused_or_exact(block)


@pytest.mark.parametrize("change,reason", [
    (lambda b: b.experts.fc1.register_forward_pre_hook(lambda m, a: None), "forward_pre_hooks"),
    (lambda b: setattr(b.experts.fc2, "forward", lambda x, c: x), "instance-level forward"),
    (lambda b: b.experts.fc1.register_parameter("bias", nn.Parameter(torch.zeros(4, 64))), "does not use"),
])
def test_run_time_state_of_nested_gemm_modules_is_refused(change, reason):
    block = _block("aria")
    change(block)
    assert reason in refused_or_exact(block)


def test_a_name_left_bound_by_the_loop_is_not_read_after_it():
    edited = _edit(TITAN, "forward", "return torch.cat(out, dim=0)", "return torch.cat(out, dim=0) * h")
    assert "last expert's rows" in refused_or_exact(_block("titan", edited))


def test_global_module_hooks_are_refused():
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, o: o)
    try:
        assert "global module hooks" in refused_or_exact(_block("aria"))
    finally:
        handle.remove()
    assert refused_or_exact(_block("aria")) == "exact"
