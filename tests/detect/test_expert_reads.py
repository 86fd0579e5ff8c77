"""Every read of the experts outside the proven region is found by following calls, and refused naming it;
sharing inside a block; torch objects compared with the genuine ones, not a snapshot (issue 17 items 1-5).

Each refused case is accepted by the region proofs alone (the detector before issue 17 took it) and would
be wrong or crash under EP: the experts it reads are stacked, sharded into DTensors or spliced out.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import blocks
import live_state_blocks as L
import pytest
import torch
from test_runtime_state import refusal

from autoep import detect_moe_structure


@pytest.mark.parametrize("cls, message", [
    (L.PenaltyMoE, "PenaltyMoE.forward -> l2_penalty line"),  # a module-level function given self
    (L.HelperChainMoE, "HelperChainMoE.forward -> HelperChainMoE._aux -> HelperChainMoE._expert_norm line"),
    (L.StateDictMoE, "StateDictMoE.forward -> StateDictMoE.num_weights line"),  # a property
])
def test_a_read_of_the_experts_any_calls_deep_is_refused_naming_the_chain(cls, message):
    reason = refusal(L.moe(cls))
    assert message in reason
    assert ("reads `experts` outside the expert region" in reason) or ("reaches every submodule" in reason)


def test_the_same_block_without_the_read_is_accepted():
    assert detect_moe_structure(L.moe()).expert_storage == "module_list"


def test_a_cached_list_of_the_experts_is_refused():
    block = L.mixtral()
    block.gate.cached_experts = list(block.experts)
    assert "MixtralStyleSparseMoeBlock.gate.cached_experts holds experts.0 outside the module tree" in refusal(block)
    block = L.mixtral()
    object.__setattr__(block.experts[0], "owner", block)  # an unregistered back-reference to the block
    assert "holds the block itself" in refusal(block)


def test_a_block_pre_hook_that_renorms_every_expert_weight_is_refused_naming_it():
    block = L.qwen3()
    block.register_forward_pre_hook(L.renorm_experts)
    assert "the forward pre hook renorm_experts line" in refusal(block)


def test_a_block_hook_that_leaves_the_experts_alone_is_still_accepted():
    block = L.qwen3()
    block.register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))
    assert detect_moe_structure(block).expert_storage == "batched_parameters"


def test_a_routed_expert_tied_to_the_shared_expert_is_refused_naming_both():
    block = L.qwen2_shared()
    block.shared_expert.up_proj.weight = block.experts[0].up_proj.weight
    assert "experts.0.up_proj.weight is also shared_expert.up_proj.weight" in refusal(block)


def test_an_expert_registered_twice_in_its_block_is_refused():
    block = L.qwen3()
    block.experts_alias = block.experts
    assert "experts.gate_up_proj is also experts_alias.gate_up_proj" in refusal(block)


def test_a_patched_silu_is_not_a_known_activation():
    import torch.nn.functional as F

    block = blocks.MoE(hidden=16)  # experts write F.silu: the stacked compute would run nn.SiLU instead
    original = F.silu
    try:
        F.silu = lambda x, inplace=False: original(x) * 2
        assert "torch.nn.functional.silu is not torch's own (patched process-wide)" in refusal(block)
    finally:
        F.silu = original
    assert detect_moe_structure(block).expert_act == "silu"


def test_linear_patched_before_autoep_is_imported_is_refused():
    """The batched proof compared ``F.linear`` with a snapshot taken when autoep was imported: a fake-quant
    ``F.linear`` installed before that import was taken for torch's (and the grouped GEMM bypassed it)."""
    code = textwrap.dedent("""
        import sys
        sys.path[:0] = ["tests", "tests/runtime"]
        import torch.nn.functional as F
        real = F.linear
        F.linear = lambda x, w, b=None: real(x, w * 2, b)
        from live_state_blocks import qwen3
        from autoep import UnsupportedModuleStructure, detect_moe_structure
        try:
            detect_moe_structure(qwen3())
            print("ACCEPTED")
        except UnsupportedModuleStructure as exc:
            print("REFUSED", exc.reason)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.startswith("REFUSED"), out.stdout + out.stderr[-2000:]


def test_genuine_tells_a_wrapper_from_torchs_own():
    import functools

    from autoep.detect import genuine

    assert genuine.genuine(torch.nn.functional.silu) and genuine.genuine(torch.sigmoid)
    assert genuine.genuine_forward(torch.nn.Linear) and genuine.genuine_forward(torch.nn.SiLU)
    wrapped = functools.wraps(torch.nn.functional.silu)(lambda x, inplace=False: x)
    assert not genuine.genuine(wrapped)
    assert not genuine.genuine(functools.partial(torch.nn.functional.silu))
    assert genuine.patched_torch_objects() == []
    real = torch.matmul
    try:
        torch.matmul = lambda a, b: real(a, b)  # a region matched by identity would take it for torch's
        assert genuine.patched_torch_objects() == ["torch.matmul"]
    finally:
        torch.matmul = real
