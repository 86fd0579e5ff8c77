"""Batched experts with a training test (transformers 4.57's Qwen3-VL-MoE and GPT-OSS idioms, written out in
``tests/blocks.py`` so that this file runs under transformers 5 too): the per-expert loop over dense (T, E)
routing weights is proven and runs as the exchange; the dense all-experts branch is refused at forward time.

Parity (DESIGN.md) on 2 and 4 gloo ranks through the real detector, table and ``apply_plan``
(``test_parity_hf._block_parity``: outputs, input grads, router grads summed, expert grads gathered).
Refusals: each unsound variant of the loop names the construct and its line.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import sys
import textwrap

import blocks
import pytest
import torch
from distributed import guarded, run_cases

from autoep.detect.structure import detect_moe_structure
from autoep.errors import UnsupportedModuleStructure
from autoep.runtime.recipes.batched import ep_batched_experts

BLOCKS = {
    "dense_weights_swiglu": lambda: blocks.DenseWeightsMoE(hidden=16, ffn=24, num_experts=4, top_k=2),
    "dense_weights_top3": lambda: blocks.DenseWeightsMoE(hidden=16, ffn=24, num_experts=8, top_k=3),
    "inline_clamped_glu": lambda: blocks.InlineGateMoE(hidden=16, ffn=24, num_experts=4, top_k=2),
}


def _make(name: str):
    torch.manual_seed(sum(map(ord, name)))
    return BLOCKS[name]().train()


def branch_cases(rank: int, world_size: int) -> dict:
    from test_parity_hf import _block_parity

    results = {}
    for name in BLOCKS:
        guarded(results, name, _block_parity, rank, world_size, _make(name), 16)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_on_ranks(world_size):
    results = run_cases(world_size, "test_training_branch:branch_cases")
    assert results.keys() == BLOCKS.keys()
    failed = {n: e for n, e in results.items() if e}
    assert not failed, "\n".join(f"{n}:\n{e[0]}" for n, e in failed.items())


def test_detected_facts():
    s = detect_moe_structure(_make("dense_weights_swiglu"))
    assert (s.expert_storage, s.activation, s.expert_bias, s.expert_transposed) == \
        ("batched_parameters", "inline_gate", False, True)
    s = detect_moe_structure(_make("inline_clamped_glu"))
    assert (s.expert_storage, s.activation, s.expert_bias, s.expert_transposed) == \
        ("batched_parameters", "inline_gate", True, True)


def _ep(block):
    ep = copy.deepcopy(block)
    ep_batched_experts(ep, ep_mesh=None, structure=detect_moe_structure(block))
    return ep


@pytest.mark.parametrize("name", list(BLOCKS))
def test_one_process_equals_the_loop_branch(name):
    block = _make(name)
    ep = _ep(block)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ep(x)[0], block(x)[0])
    # The proof reads the gate back from the source; a different clamp limit must change the result (the
    # replacement computes what the source writes, not a fixed SwiGLU).
    if name == "inline_clamped_glu":
        ep.experts.limit = 0.1
        with pytest.raises(Exception, match="limit"):
            ep(x)


def test_dense_branch_is_refused_at_forward_time():
    block = _make("dense_weights_swiglu")
    ep = _ep(block).eval()
    with pytest.raises(RuntimeError, match=r"DenseWeightsExperts.forward line \d+: not training.*dense branch"):
        ep(torch.randn(1, 3, 16))


def test_cpu_or_training_runs_the_loop_in_eval_on_cpu():
    block = _make("inline_clamped_glu").eval()  # on CPU the model's own forward takes the loop in eval too
    ep = _ep(block)
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(ep(x)[0], block(x)[0])


def _variant(cls: type, old: str, new: str) -> type:
    """``cls`` with one line of its forward's source replaced (a real file, so the detector reads it)."""
    src = textwrap.dedent(inspect.getsource(cls))
    assert old in src, old
    src = src.replace(old, new, 1).replace(f"class {cls.__name__}(", f"class {cls.__name__}Variant(", 1)
    path = _variant.tmp / f"variant_{abs(hash((cls.__name__, old, new)))}.py"
    path.write_text("import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n" + src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return getattr(module, f"{cls.__name__}Variant")


@pytest.fixture(autouse=True)
def _tmp(tmp_path):
    _variant.tmp = tmp_path


REFUSED = [
    # The weights of one fixed expert, not the loop's expert: not w[t, e] of the routed pair.
    (blocks.DenseWeightsExperts, "routing_weights[token_idx, expert_idx, None]", "routing_weights[token_idx, 0, None]",
     r"line \d+: `routing_weights\[token_idx, 0, None\]` is not x\[tok\] or w\[tok, slot\]"),
    # A reduction over the expert's rows inside the gate: not row-local.
    (blocks.DenseWeightsExperts, "gated_output = up * self.act_fn(gate)",
     "gated_output = up * self.act_fn(gate) - gate.mean(0)", r"line \d+: `gate.mean\(0\)` is not understood"),
    # The first row of the expert's rows (no leading 1-dim to take off): only that token would be computed.
    (blocks.InlineGateExperts, "weighted_output = out * routing_weights", "weighted_output = out[0] * routing_weights",
     r"line \d+: `out\[0\]` takes the first row of the expert's rows"),
    # The expert count from the hidden states' shape, not from the weights the loop reads per expert.
    (blocks.InlineGateExperts, "num_experts = routing_weights.shape[1]", "num_experts = router_indices.shape[1]",
     "expert count from the shape of a tensor other than its routing weights"),
    # A test the proof does not know: which branch runs is not the training flag.
    (blocks.InlineGateExperts, 'if hidden_states.device.type == "cpu" or self.training:', "if self.alpha > 1:",
     "is not one loop over experts"),
    # The gate reads the routed rows themselves besides the projection: not the two-projection shape.
    (blocks.InlineGateExperts, "gated_output = (up + 1) * glu", "gated_output = (up + 1) * glu + current_state",
     r"not act_fn\(gate\) \* up, the experts' own _apply_gate, or element-wise operations on the first projection"),
    # A number from a global (here torch.pi): it could be rebound after apply, unlike self.alpha (watched).
    (blocks.InlineGateExperts, "torch.sigmoid(gate * self.alpha)", "torch.sigmoid(gate * torch.pi)",
     r"`torch.pi` is a number read from a global or closure variable"),
    # A sort inside the gate mixes features across the rows' order: not element-wise.
    (blocks.InlineGateExperts, "glu = gate * torch.sigmoid(gate * self.alpha)",
     "glu = gate * torch.sort(gate, dim=0).values", r"line \d+: `torch.sort\(gate, dim=0\)` calls .*sort, which the proof does not know"),
]


@pytest.mark.parametrize("cls,old,new,why", REFUSED, ids=[r[2][:40] for r in REFUSED])
def test_unsound_variants_are_refused(cls, old, new, why):
    variant = _variant(cls, old, new)
    block_cls = blocks.DenseWeightsMoE if issubclass(cls, blocks.DenseWeightsExperts) else blocks.InlineGateMoE
    torch.manual_seed(0)
    block = block_cls(experts_cls=variant).train()
    with pytest.raises(UnsupportedModuleStructure, match=why):
        detect_moe_structure(block)
