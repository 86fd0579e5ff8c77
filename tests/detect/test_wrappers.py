"""transformers' wrappers around a block's forward (``autoep.detect.wrappers``): looked through where their
code is the one autoep read, refused otherwise; an experts call under ``if self.<flag>:`` folded on the
instance and watched per call."""
from __future__ import annotations

import dataclasses
import functools

import pytest

pytest.importorskip("transformers")

import gc_blocks  # noqa: E402 - needs transformers
import torch  # noqa: E402

from autoep.detect import wrappers  # noqa: E402
from autoep.detect.structure import detect_moe_structure  # noqa: E402
from autoep.errors import OPT_OUT_HINT, UnsupportedModuleStructure  # noqa: E402


def refusal(block) -> str:
    with pytest.raises(UnsupportedModuleStructure) as info:
        detect_moe_structure(block)
    assert str(info.value).endswith(OPT_OUT_HINT)
    return info.value.reason


def test_both_wrappers_are_peeled_and_the_flag_folded():
    block = gc_blocks.GemmaStyleMoeLayer()
    peeled = wrappers.peel_forward(type(block))
    assert peeled.kinds == ("checkpointing", "kwarg_rename") and peeled.factories == ("deprecate_kwarg",)
    assert peeled.forward.__code__.co_qualname == "GemmaStyleMoeLayer.forward"
    s = detect_moe_structure(block)
    assert (s.expert_storage, s.experts_path, s.folded) == ("batched_parameters", "experts", ("enable_moe_block=True",))


def test_gemma4_decoder_layer_is_accepted():
    import transformers.models.gemma4 as family
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextDecoderLayer

    from autoep.tools.tiny import build_block, family_configs

    block, _ = build_block(Gemma4TextDecoderLayer, family_configs(family))  # meta, full size, MoE switched on
    assert block.experts.gate_up_proj.is_meta
    s = detect_moe_structure(block)
    assert (s.router, s.expert_storage, s.folded) == ("topk_router_module", "batched_parameters",
                                                      ("enable_moe_block=True",))


def test_a_subclass_wrapped_twice_is_peeled_twice():
    class Sub(gc_blocks.GemmaStyleMoeLayer):  # __init_subclass__ wraps the wrapper again (FSDP2 does this)
        pass

    assert wrappers.peel_forward(Sub).kinds == ("checkpointing", "checkpointing", "kwarg_rename")
    assert detect_moe_structure(Sub()).folded == ("enable_moe_block=True",)


def test_a_wrapper_copying_the_names_is_not_the_known_one():
    def forward_with_checkpointing_like(forward):
        @functools.wraps(forward)
        def forward_with_checkpointing(self, *args, **kwargs):
            return forward(self, *args, **kwargs) * 2
        return forward_with_checkpointing

    class Fake(gc_blocks.GemmaStyleMoeLayer):
        pass

    Fake.forward = forward_with_checkpointing_like(gc_blocks.GemmaStyleMoeLayer.forward)
    assert "forward_with_checkpointing, which autoep does not know" in refusal(Fake())


def test_a_wrapped_attribute_that_is_not_what_the_wrapper_calls_is_refused():
    class Liar(gc_blocks.GemmaStyleMoeLayer):
        pass

    Liar.forward.__wrapped__ = gc_blocks.ElseBranchLayer.forward  # the proofs would read another function
    assert "calls another function than its __wrapped__" in refusal(Liar())


def test_a_changed_wrapper_is_refused(monkeypatch):
    """A transformers version whose wrapper's code differs from the one read here is not looked through."""
    changed = tuple(dataclasses.replace(k, digest="0" * 16) if k.kind == "checkpointing" else k
                    for k in wrappers.KNOWN)
    monkeypatch.setattr(wrappers, "KNOWN", changed)
    assert "whose code is not the one autoep read" in refusal(gc_blocks.GemmaStyleMoeLayer())


def test_a_wrapper_reading_a_patched_global_is_refused(monkeypatch):
    import transformers.modeling_layers as layers

    monkeypatch.setattr(layers, "partial", lambda fn, *a, **k: functools.partial(fn, *a, **k))
    assert "reads `partial`, which is not functools.partial" in refusal(gc_blocks.GemmaStyleMoeLayer())


def test_an_unknown_decorator_is_refused():
    assert "decorated; autoep does not know what the decorator does" in refusal(gc_blocks.UnknownDecoratorLayer())


@pytest.mark.parametrize("flag", [False, 1, "yes"])
def test_the_flag_must_be_the_constant_true(flag):
    reason = refusal(gc_blocks.GemmaStyleMoeLayer(enable_moe_block=flag))
    assert f"runs under `if self.enable_moe_block:`, and self.enable_moe_block is {flag!r}" in reason


def test_a_mode_is_not_a_flag():
    class TrainingGuard(gc_blocks.GemmaStyleMoeLayer):
        def forward(self, hidden_states, cache=None, **kwargs):
            flat = hidden_states.reshape(-1, hidden_states.shape[-1])
            out = flat
            if self.training:
                _, top_k_weights, top_k_index = self.router(flat)
                out = self.experts(flat, top_k_index, top_k_weights)
            return out.reshape(hidden_states.shape)

    assert "under `if self.training:`, a mode that changes by design" in refusal(TrainingGuard().train())


def test_the_experts_call_in_an_else_branch_is_refused():
    assert "the experts call runs inside a `if`" in refusal(gc_blocks.ElseBranchLayer())


def test_a_flag_switched_off_after_apply_stops_the_block():
    """Folded True at detection and apply; switched off afterwards, the block would skip its experts call
    on this rank only: the EP block refuses to run, naming the flag. The plan re-made on it is refused."""
    from mutation import make_ep

    block = gc_blocks.GemmaStyleMoeLayer()
    ep = make_ep(block, detect_moe_structure(block), None)
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(ep(x), block(x))
    ep.enable_moe_block = False
    with pytest.raises(RuntimeError, match=r"GemmaStyleMoeLayer.enable_moe_block is False, but the expert-parallel "
                                           r"plan was proven with enable_moe_block=True"):
        ep(x)
    off = gc_blocks.GemmaStyleMoeLayer(enable_moe_block=False)  # a plan made with the flag on, applied to it off
    with pytest.raises(UnsupportedModuleStructure, match=r"self.enable_moe_block was True when the plan was made"):
        make_ep(off, detect_moe_structure(block), None)


def test_a_flag_changed_before_a_replay_is_drift():
    from autoep.detect.row_local import folded_drift

    block = gc_blocks.GemmaStyleMoeLayer()
    folded = detect_moe_structure(block).folded
    assert folded_drift(block, folded) == []
    block.enable_moe_block = False
    assert folded_drift(block, folded) == ["enable_moe_block was True when the experts were proven, now False"]
