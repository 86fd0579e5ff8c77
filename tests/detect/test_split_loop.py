"""split_loop + regions: DeepSeek's argsort/split loop, its masked-assignment training loop, trailing identity
experts, and the rule that every path through a block's forward runs exactly one expert exchange.

Each variant is the accepted test block with one edit to its source (the class is rebuilt from the edited
method source with the block module's globals); an edit that changes what the region computes, or lets a
rank skip or repeat the exchange, must be refused, naming the construct. Accepted edits are checked exact
by the fuzzer (``bench/soundness.py``; targets ``v4/sorted_split*``, ``v4/deepseek_remote*``,
``v4/zero_experts``); parity on 2 and 4 ranks lives in ``tests/runtime/test_module_list_recipe.py``.
"""
from __future__ import annotations

import inspect
import textwrap

import blocks
import pytest
import torch
from mutation_source import exec_subclass
from torch import nn

from autoep.detect.structure import detect_moe_structure, fast_path_structure
from autoep.errors import UnsupportedModuleStructure
from autoep.runtime.recipes.module_list import ep_module_list_block


def variant(cls: type, method: str, old: str, new: str) -> type:
    """``cls`` with ``method`` rebuilt from its own source with ``old`` replaced by ``new`` (once, exactly), as
    if the model file had been edited (``mutation_source.exec_subclass``: same name, same module globals,
    source readable; the method's own decorators kept)."""
    src = textwrap.dedent(inspect.getsource(getattr(cls, method)))
    assert src.count(old) == 1, (old, src)
    return exec_subclass(cls, textwrap.indent(src.replace(old, new), "    "), check=method)


def reason(block: nn.Module) -> str:
    """Why the fast path's loop proof refuses ``block`` (record/exchange/replay may still run it)."""
    with pytest.raises(UnsupportedModuleStructure) as info:
        fast_path_structure(block)
    return info.value.reason


SPLIT = blocks.SortedSplitMoE


@pytest.mark.parametrize("old,new,why", [
    ("start_idx = end_idx", "start_idx = start_idx", "end offset"),
    ("sorted_tokens[start_idx:end_idx]", "sorted_tokens[start_idx:end_idx + 1]", "`end_idx + 1` is not understood"),
    ("outputs.append(expert_out)", "outputs.append(expert_out * 2)", "`expert_out * 2` is not understood"),
    ("outputs.append(expert_out)", "outputs.append(expert_out)\n        outputs.append(expert_out)", "appends 2"),
    ("torch.cat(outputs, dim=0)", "torch.cat(outputs, dim=1)", "torch.cat"),
    ("if num_tokens == 0:", "if num_tokens == 1:", "`num_tokens == 1` is not understood"),
    ("self.experts[i + self.ep_rank * self.experts_per_rank]", "self.experts[i + 1]", "`i + 1` is not understood"),
    ("outputs = []\n", "outputs = []\n    outputs.append(hidden_states)\n", "preceded"),
    ("outs = torch.cat(outputs, dim=0) if outputs else sorted_tokens.new_empty(0)",
     "outs = torch.cat(outputs, dim=0) if outputs else hidden_states", "new_empty"),
    ("new_x = torch.empty_like(outs)", "new_x = torch.empty_like(outs) + end_idx", "used after"),
])
def test_split_loop_edits_that_change_the_region_are_refused(old, new, why):
    assert why in reason(variant(SPLIT, "moe", old, new)())


def test_split_loop_edits_outside_the_region_run_as_the_model_writes_them():
    """The unsort and weighting after the concatenation are the model's own code: a scale there is kept."""
    cls = variant(SPLIT, "moe", ".sum(dim=1)", ".sum(dim=1).mul(0.5)")
    torch.manual_seed(0)
    block = cls(hidden=16, num_experts=4, top_k=2)
    detect_moe_structure(block)
    ep = nn.ModuleDict({"mlp": cls(hidden=16, num_experts=4, top_k=2)})
    ep["mlp"].load_state_dict(block.state_dict())
    ep_module_list_block(ep["mlp"], ep_mesh=None, structure=detect_moe_structure(block))
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(ep["mlp"](x), block(x))


REMOTE = blocks.DeepseekRemoteMoE


@pytest.mark.parametrize("method,old,new,why", [
    # a path without the exchange, or with two
    ("forward", "    else:\n        y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)\n",
     "    else:\n        y = hidden_states.view(*orig_shape)\n", "times"),
    ("forward", "y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)",
     "y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)\n"
     "        y = y + self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)", "times"),
    ("forward", "y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)",
     "y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape) if hidden_states.numel() "
     "else hidden_states", "conditional expression"),
    # the masked assignment itself
    ("forward", "y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])",
     "y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx != i])", "ids == i"),
    ("forward", "y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])",
     "y[flat_topk_idx == i] = 2 * expert(hidden_states[flat_topk_idx == i])", "expert's output"),
    ("forward", "y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])",
     "y[flat_topk_idx == i] = expert(y[flat_topk_idx == i])", "same tensor"),
    ("forward", "y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])",
     "flat_topk_idx = flat_topk_idx == i\n            y[flat_topk_idx] = expert(hidden_states[flat_topk_idx])",
     "rebinds"),
    ("forward", "for i, expert in enumerate(self.experts):", "for i, expert in enumerate(self.experts[:2]):",
     "does not iterate over the experts"),
])
def test_remote_code_edits_that_break_a_region_or_a_path_are_refused(method, old, new, why):
    assert why in reason(variant(REMOTE, method, old, new)())


def test_remote_code_unknown_decorator_on_the_helper_is_refused():
    cls = type("DeepseekRemoteMoE", (REMOTE,), {"moe_infer": _noop_decorator(REMOTE.moe_infer.__wrapped__),
                                                 "__module__": REMOTE.__module__})
    assert "decorated" in reason(cls())


def _noop_decorator(fn):
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def test_remote_code_records_both_regions_and_the_no_grad_helper():
    from autoep.detect.module_list_proof import module_list_plan

    plans = module_list_plan(REMOTE())
    assert [(p.method, p.kind, p.no_grad, bool(p.path)) for p in plans] == [
        ("forward", "masked", False, True), ("moe_infer", "split", True, False)]


def test_identity_experts_must_trail_the_computing_ones():
    block = blocks.ZeroExpertMoE(hidden=16, num_experts=4, zero_experts=2, top_k=2)
    assert detect_moe_structure(block).identity_experts == 2
    block.experts.insert(0, nn.Identity())  # not the fast path's trailing identities: each expert runs as itself
    assert (detect_moe_structure(block).expert_kind, detect_moe_structure(block).identity_experts) == ("row_local", 0)
    hooked = blocks.ZeroExpertMoE(hidden=16, num_experts=4, zero_experts=2, top_k=2)
    hooked.experts[-1].register_forward_hook(lambda m, a, out: out * 2)
    assert "hook" in reason(hooked)


def test_identity_experts_are_not_sharded_and_ep_divides_the_computing_ones():
    from autoep.detect.structure import count_experts

    assert count_experts(blocks.ZeroExpertMoE(hidden=16, num_experts=4, zero_experts=3, top_k=2)) == 4
