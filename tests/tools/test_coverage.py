"""Detection over every MoE block class of the installed transformers, built on meta (issue 2 item 5)."""
import pytest

from autoep.errors import OPT_OUT_HINT
from autoep.tools.coverage import markdown, survey

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def rows():
    return survey()  # raises if detection raises anything but UnsupportedModuleStructure


def by_class(rows):
    return {r.cls: r for r in rows}


# Measured on transformers 5.25 (docs/coverage.md has the table); a drop is a regression.
# 73 on 5.24 before record/exchange/replay became automatic, 75 after (+ NllbMoeSparseMLP, VitPoseBackboneMoeMLP);
# 5.25: 81 classes, 78 (+ Kolibri1_1SparseMoeBlock, MiniCPM5MoeMoE new; Step3p7SparseMoeBlock and BailingHybridMoE
# kept through their new `if self.limit is not None:` in _apply_gate, folded; ErgoMoE new and refused).
MIN_ACCEPTED = 78


def test_accepted_classes_do_not_drop(rows):
    accepted = [r.cls for r in rows if r.structure is not None]
    assert len(accepted) >= MIN_ACCEPTED, [(r.cls, r.reason) for r in rows if r.structure is None]


def test_walk_finds_the_families(rows):
    assert len(rows) > 40
    built = [r for r in rows if not r.reason.startswith("not built")]
    assert len(built) >= 0.9 * len(rows), [r.reason for r in rows if r.reason.startswith("not built")]


def test_known_decisions(rows):
    got = by_class(rows)

    def fields(cls):
        s = got[cls].structure
        assert s is not None, got[cls].reason
        return (s.router, s.shared_experts, s.expert_storage, s.jitter)

    assert fields("Qwen3MoeSparseMoeBlock") == ("topk_router_module", "none", "batched_parameters", False)
    assert fields("DeepseekV3MoE") == ("topk_router_module", "additive", "batched_parameters", False)
    assert fields("Qwen2MoeSparseMoeBlock")[1] == "gated"
    assert fields("MixtralSparseMoeBlock")[3] is True
    gpt = got["GptOssMLP"].structure
    assert (gpt.expert_bias, gpt.expert_transposed, gpt.gate_up_layout, gpt.activation) == (
        True, True, "interleaved", "clamped_glu")


def test_refusals_name_class_and_hint(rows):
    from autoep import UnsupportedModuleStructure

    refused = [r for r in rows if r.structure is None and not r.reason.startswith("not built")]
    assert refused, "some transformers blocks (e.g. a post-expert norm) must be refused"
    for r in refused:
        msg = str(UnsupportedModuleStructure(r.cls, r.reason))
        assert r.cls in msg and msg.endswith(OPT_OUT_HINT)


def test_a_row_local_post_expert_norm_is_accepted(rows):
    """MuseSparkExperts normalise each expert's output (a (D,)-weighted RMSNorm) before the routing weight."""
    s = by_class(rows)["MuseSparkMoE"].structure
    assert s is not None and (s.expert_storage, s.post_expert_norm) == ("batched_parameters", "post_expert_norm")


def test_llama4_experts_on_equal_groups_of_rows_are_accepted(rows):
    """Llama4TextExperts(rows): every token repeated once per expert, row block e for expert e."""
    s = by_class(rows)["Llama4TextMoe"].structure
    assert s is not None and (s.expert_storage, s.expert_projs) == ("equal_groups", ("gate_up_proj", "down_proj"))


def test_switch_is_refused_only_for_its_random_dropout_and_nllb_replays_its_own(rows):
    """Their experts containers loop over themselves, which record/exchange/replay runs as written (Switch accepted
    at p=0 or in eval, with parity in tests/runtime/test_container_loop_recipe.py). At its default config Switch
    stays refused for randomness EP
    cannot reproduce (``nn.Dropout(0.1)`` inside each expert, drawn on the owner). NLLB's token dropout (p=0.2
    while training) is on the experts' outputs, an entry of the container its forward reads by name: the fast
    path refuses it, record/exchange/replay runs it where the token is, drawn by the block's own RNG once per
    pass with the RNG restored in between, so it is accepted (block parity: tests/runtime/test_parity_hf.py, every
    accepted class), its experts counted without the dropout."""
    switch, nllb = by_class(rows)["SwitchTransformersSparseMLP"], by_class(rows)["NllbMoeSparseMLP"]
    assert switch.structure is None and "dropout with p=0.1 while training" in switch.reason, switch.reason
    assert nllb.structure is not None and nllb.structure.execution == "replay", nllb.reason
    assert not any(".token_dropout." in entry for entry in nllb.structure.folded), nllb.structure.folded


def test_markdown_lists_every_class(rows):
    text = markdown(rows)
    assert all(f"| {r.cls} |" in text for r in rows)


def test_markdown_names_each_accepted_class_execution_and_counts_them(rows):
    """The execution column (``MoeStructure.execution``) per class, and the accepted total split by execution."""
    text = markdown(rows)
    accepted = [r for r in rows if r.structure is not None]
    assert {r.structure.execution for r in accepted} <= {"grouped", "spliced", "replay"}
    for r in rows:
        assert f"| {r.cls} | {r.structure.execution if r.structure is not None else ''} |" in text, r.cls
    counts = {e: sum(r.structure.execution == e for r in accepted) for e in ("grouped", "spliced", "replay")}
    split = ", ".join(f"{n} {e}" for e, n in sorted(counts.items(), key=lambda kv: -kv[1]) if n)
    assert f"{len(accepted)} accepted ({split}), {len(rows) - len(accepted)} refused" in text


def test_an_if_on_a_constant_limit_in_apply_gate_is_folded(rows):
    """transformers 5.25: ``if self.limit is not None:`` (a per-layer SwiGLU clamp, None at the default config)
    in Step3p7's and BailingHybrid's ``_apply_gate`` (tests/detect/test_apply_gate_branch.py: limit on, drift,
    twins)."""
    for cls in ("Step3p7SparseMoeBlock", "BailingHybridMoE"):
        s = by_class(rows)[cls].structure
        assert s is not None and (s.execution, s.activation) == ("grouped", "own_gate"), by_class(rows)[cls].reason


def test_every_accepted_class_is_parity_tested(rows):
    """tests/runtime/test_parity_hf.py runs every class coverage.parity_classes returns; none may fall out."""
    from autoep.tools.coverage import parity_classes

    accepted = [r for r in rows if r.structure is not None]
    assert [r.cls for r in parity_classes(rows)] == [r.cls for r in accepted], [
        (r.cls, r.untested) for r in accepted if r.untested]
