"""Run-time state is part of the proof (issue 8): what a module would really run, not only its class source.

Each case changes one thing about a built block that its class source does not show (an instance
forward, a hook, a tied or frozen expert, another activation, a patched call), and checks the detector
refuses it naming what it saw; where autoep can keep the behaviour (a hook on the block itself, a hook
on the router, which runs as the model's own code) the block is accepted and exact.
"""
from __future__ import annotations

import copy
import functools

import blocks
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoep import UnsupportedModuleStructure, detect_moe_structure
from autoep.errors import OPT_OUT_HINT
from autoep.plan.archetypes import compute_fn_config
from autoep.targets import import_object


def refusal(module) -> str:
    with pytest.raises(UnsupportedModuleStructure) as info:
        detect_moe_structure(module)
    assert str(info.value).endswith(OPT_OUT_HINT)
    return info.value.reason


def _mixtral():
    torch.manual_seed(0)
    return blocks.MixtralStyleSparseMoeBlock(hidden=16, num_experts=4, top_k=2)


def _tie(block):
    block.experts[1].up_proj.weight = block.experts[0].up_proj.weight
    return block


def _freeze(block):
    block.experts[2].down_proj.weight.requires_grad_(False)
    return block


def _other_act(block):
    block.experts[3].act_fn = nn.GELU()
    return block


def _wider(block):
    block.experts[1].up_proj = nn.Linear(16, 48, bias=False)
    return block


def _instance_forward(block):
    block.forward = functools.partial(type(block).forward, block)
    return block


def _expert_instance_forward(block):
    block.experts[0].forward = lambda x: x
    return block


def _expert_hook(block):
    block.experts[1].register_forward_hook(lambda m, a, out: out * 2)
    return block


def _linear_pre_hook(block):
    block.experts[2].gate_proj.register_forward_pre_hook(lambda m, a: (a[0] * 2,))
    return block


class _LoudExpert(blocks.MixtralStyleMLP):
    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs) * 2


def _call_override(block):
    for expert in block.experts:
        expert.__class__ = _LoudExpert
    return block


class _Softmaxish(nn.Module):
    def forward(self, x):
        return F.softmax(x, dim=-1)


def _not_elementwise(block):
    for expert in block.experts:
        expert.act_fn = _Softmaxish()
    return block


class _PatchedSiLU(nn.SiLU):
    pass


def _activation_subclass(block):
    for expert in block.experts:
        expert.act_fn = _PatchedSiLU()
    return block


REFUSED = {
    "tied expert weights": (_tie, "experts[1].up_proj.weight is the same parameter as one of experts[0]"),
    "instance-level block forward": (_instance_forward, "instance-level forward"),
    "instance-level expert forward": (_expert_instance_forward, "experts[0] (MixtralStyleMLP) has an instance-level forward"),
    "forward hook on an expert": (_expert_hook, "experts[1] (MixtralStyleMLP) has forward_hooks registered"),
    "pre-hook on an expert projection": (_linear_pre_hook, "gate_proj (Linear) has forward_pre_hooks registered"),
    "__call__ override on the experts": (_call_override, "overrides __call__"),
}
# No longer the one SwiGLU the grouped fast path stacks, but each expert still row-local, deterministic and
# stateless: accepted as expert_kind="row_local" (only their own forward runs them; the plan table refuses them
# until the own-forward runtime is there).
ROW_LOCAL = {
    "one frozen expert": _freeze,
    "one expert with another activation": _other_act,
    "experts of different sizes": _wider,
    "a softmax over the features as activation": _not_elementwise,
    "an activation subclass": _activation_subclass,
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_run_time_state_the_recipe_would_not_keep_is_refused(case):
    change, message = REFUSED[case]
    assert message in refusal(change(_mixtral()))


@pytest.mark.parametrize("case", list(ROW_LOCAL))
def test_run_time_state_off_the_fast_path_is_row_local(case):
    structure = detect_moe_structure(ROW_LOCAL[case](_mixtral()))
    assert (structure.expert_kind, structure.expert_projs, structure.expert_act) == ("row_local", (), "")
    assert detect_moe_structure(_mixtral()).expert_kind == "swiglu"


def _ep1(block):
    """The block after its recipe, in one process (no exchange)."""
    structure = detect_moe_structure(block)
    fn = compute_fn_config(structure)
    ep = copy.deepcopy(block)
    import_object(fn.pop("_factory_"))(ep, ep_mesh=None, **fn)
    return ep


@pytest.mark.parametrize("where", ["block", "gate"])
def test_hooks_that_run_as_the_models_own_code_are_kept(where):
    block = _mixtral()
    owner = block if where == "block" else block.gate
    owner.register_forward_hook(lambda m, a, out: (out[0] * 0.5, out[1]) if isinstance(out, tuple) else out * 0.5)
    ep = _ep1(block)
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(ep(x), block(x))


def test_global_hooks_are_refused_for_stacked_experts():
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, out: out)
    try:
        assert "global module hooks" in refusal(_mixtral())
    finally:
        handle.remove()


# --- v5 batched experts: the contract around the replaced experts forward ------------------------------


def _v5_block():
    from test_structure import V5Block

    torch.manual_seed(0)
    return V5Block()


def test_instance_apply_gate_and_experts_hooks_are_refused():
    block = _v5_block()
    block.experts._apply_gate = lambda h: h[..., : h.shape[-1] // 2]
    assert "_apply_gate` is an instance-level override" in refusal(block)
    block = _v5_block()
    block.experts.register_forward_hook(lambda m, a, out: out * 2)
    assert "has forward_hooks registered" in refusal(block)


def _v5_variant(body: str, tmp_path):
    """A V5Block subclass whose forward is ``body``, with its source on disk (the detector reads source)."""
    import importlib.util

    path = tmp_path / f"v5_variant_{abs(hash(body))}.py"
    path.write_text("import torch\nfrom test_structure import V5Block\n\n\nclass Variant(V5Block):\n"
                    "    def forward(self, hidden_states):\n" + "".join(f"    {line}\n" for line in body.splitlines()))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Variant


@pytest.mark.parametrize("body, message", [
    ("    _, w, i = self.gate(hidden_states)\n    if hidden_states.shape[0] > 0:\n"
     "        return self.experts(hidden_states, i, w)\n    return hidden_states",
     "runs inside a `if`"),
    ("    _, w, i = self.gate(hidden_states)\n    if hidden_states.shape[0] == 0:\n        return hidden_states\n"
     "    return self.experts(hidden_states, i, w)", "may return before the experts call"),
    ("    _, w, i = self.gate(hidden_states)\n    return self.experts(hidden_states, i, w) if w.numel() else w",
     "sits in a conditional expression"),
])
def test_a_conditional_experts_call_is_refused(body, message, tmp_path):
    """A rank that skips the experts call would leave its peers waiting in the exchange."""
    assert message in refusal(_v5_variant(body, tmp_path)())


def test_replaced_experts_forward_binds_by_the_original_signature():
    block = _v5_block()
    ep = _ep1(block)
    x = torch.randn(5, 8)
    _, w, idx = block.gate(x)
    torch.testing.assert_close(ep.experts(x, top_k_weights=w, top_k_index=idx), block.experts(x, idx, w))
    with pytest.raises(TypeError):
        ep.experts(x, idx, w, scale=2.0)


def test_padding_ids_add_nothing_as_in_the_experts_own_loop():
    block = _v5_block()
    ep = _ep1(block)
    x = torch.randn(6, 8)
    _, w, idx = block.gate(x)
    idx = idx.clone()
    idx[::2, 0] = block.experts.num_experts  # the id transformers uses for dropped picks
    torch.testing.assert_close(ep.experts(x, idx, w), block.experts(x, idx, w))
