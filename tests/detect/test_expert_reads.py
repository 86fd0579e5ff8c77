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


# --- reads, not reachability (issue 31 item 5) -----------------------------------------------------------------


def test_a_tensor_library_on_the_routing_path_is_not_taken_for_a_read_of_the_experts():
    """``einops.reduce`` given the routing's top-k weights: its backend lookup reads ``sys.modules``, which reaches
    every module object, but nothing the block hands it can hold the experts."""
    pytest.importorskip("einops")
    import reads_blocks as R

    assert detect_moe_structure(R.moe(R.EinopsRoutingMoE)).expert_storage == "module_list"


def test_a_helper_refuses_only_where_the_block_hands_it_the_experts():
    """The same helper, one edit apart: given the routing's scores it reads no module; given ``self`` its
    ``value.parameters()`` reads every expert (stand-ins on other ranks under EP)."""
    import reads_blocks as R

    assert detect_moe_structure(R.moe(R.LoggedScoresMoE)).expert_storage == "module_list"
    reason = refusal(R.moe(R.LoggedSelfMoE))
    assert "LoggedSelfMoE.forward -> total line" in reason and "reads `parameters`" in reason, reason


def test_a_helper_reached_through_a_carrying_value_is_followed():
    """What the taint follows: a parameter of the block, a list holding a module of it, a method's result on one, a
    helper passed around as a value: each hands ``total`` something its ``parameters`` read may reach; a tensor of
    the input or a submodule's output does not."""
    from autoep.detect import expert_reads

    def check(body: str, refused: bool):
        source = f"def forward(self, x):\n{body}\n    return x\n"
        filename = f"<autoep reads: {body}>"
        import linecache

        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace = {"total": __import__("reads_blocks").total, "torch": torch, "map": map, "__name__": __name__}
        exec(compile(source, filename, "exec"), namespace)
        cls = type("Reads", (blocks.MoE,), {"forward": namespace["forward"]})
        namespace["forward"].__qualname__ = "Reads.forward"
        expert_reads._class_reads.cache_clear()
        expert_reads._carried.cache_clear()
        why = expert_reads._class_reads(cls, frozenset(), "experts")
        assert ("reads `parameters`" in why) == refused, (body, why)

    check("    total(x.sum(-1))", False)
    check("    w = self.gate.weight\n    total(w)", True)  # a parameter: the helper's read is of the block's
    check("    s = self.gate(x)\n    total(s)", False)  # a submodule's output
    check("    ms = [self.gate]\n    total(ms[0])", True)
    check("    total(self.gate.weight.t())", True)  # a method's result on a carrying value
    check("    list(map(total, [x]))", True)  # passed as a value: whoever calls it may give it anything


def test_a_raise_the_configuration_never_reaches_does_not_refuse():
    """A framework layer's unsupplied-weight check (``if weight is None: if self.weight is None: raise``) folds
    where the layer holds its weight; its one-edit twin, built without the weight, reaches the raise."""
    import reads_blocks as R

    assert detect_moe_structure(R.framework_moe()).expert_kind == "row_local"
    reason = refusal(R.framework_moe(skip_weight_param_allocation=True))
    assert "FrameworkLinear.forward line 4: `raise RuntimeError(" in reason and "raises on this path" in reason, reason
