"""PEFT's LoRA on batched experts' 3-D weights under expert parallelism (``autoep.runtime.adapters``,
``autoep.detect.adapters``), with the real peft library: ``get_peft_model(model, LoraConfig(target_parameters=
[...experts.gate_up_proj, ...experts.down_proj]))``, the way PEFT adapts transformers 5.x MoE experts.

Both orders a user writes: ``ExpertParallel`` then ``get_peft_model`` ("apply_first") and ``get_peft_model`` then
``ExpertParallel`` on the PEFT model ("peft_first"); the LoRA parameters alone trainable (PEFT's default), every
parameter trainable (base experts and routers too), and two adapters active at once (PEFT then folds their summed
delta, the other proxy). Whole tiny transformers 5.x models (Qwen3-MoE, Mixtral) from
configs, and a torchtitan-style model whose grouped experts ``experts(x_sorted, num_tokens_per_expert)`` hold
(E, ...) weights ``w1``/``w2``/``w3`` (``tests/grouped_lm.py``). The reference is the same PEFT model in one process, each rank's slice run separately (dense layers see
the same shapes); the EP run: each rank its slice, uneven, with a step where a rank has no tokens at all. Per
step: every rank's logits equal the reference's for its slice; at the first step every gradient (LoRA, base
experts gathered, routers and other dense ones summed over ranks) equals the reference's; after every SGD step
(momentum: a wrong scale moves the weights) every weight equals the reference's, PEFT left the experts as it
found them (no parametrization, their own class) and the experts hold the parameter objects the optimizer holds.

``merge_and_unload()`` after a step and before any forward (apply_first: PEFT's chain set after apply and never
called), in both orders: the merged weights and the merged model's logits equal the merged reference's.

Harmful twins (refused before any step): a PEFT wrapper whose class runs another forward (one edit: a subclass
doubling the experts' output), a PEFT version whose code autoep did not read (the digest), in both orders; a
wrapper class swapped after PEFT set it whose ``merge`` adds the delta twice: ``merge_and_unload()`` raises.
DBRX (``DbrxExperts``: flattened (E*F, D) weights on ``experts.mlp``) with ``target_parameters`` on them: the model
itself cannot run that forward (AttributeError through PEFT's wrapper); after apply the block raises
``LiveStateError`` naming the wrapper and the fix, and ``merge_and_unload()`` is exact; before apply resolve refuses.

``target_modules`` LoRA on ModuleList experts' Linears (examples/research_moe): after apply it runs in each
expert's own forward on the owner (the other ranks' adapters are meta stand-ins like the experts) and trains exactly
(same comparisons, the experts' gradients on their owners); before apply the proofs cannot read PEFT's
``lora.Linear`` and resolve refuses, naming it and the order that works.
"""
from __future__ import annotations

import pytest
from distributed import guarded, run_cases
import torch
from peft_training import FAMILIES, build, ep_model, inputs, raises, run, train_case, with_lora

pytest.importorskip("peft", reason="PEFT's LoRA cases need peft (pip install '.[test]')")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("transformers 5.x (4.x: tests/tools/test_transformers_v4.py)", allow_module_level=True)


# -- harmful twins ------------------------------------------------------------------------------------------------
def doubled_wrapper(model) -> None:
    """One edit: the outermost PEFT wrapper of every experts module becomes a subclass whose forward doubles the
    experts' output (not PEFT's code)."""
    from peft.tuners.lora.layer import ParamWrapper

    class Doubled(ParamWrapper):
        def forward(self, x, *args, **kwargs):
            return 2 * super().forward(x, *args, **kwargs)

    for name, m in model.named_modules():
        if name.endswith(".mlp"):
            m.experts.__class__ = Doubled


def twin_case(rank, world, order: str, twin: str):
    from autoep.detect import adapters
    from autoep.errors import LiveStateError, PlanError, UnsupportedModuleStructure

    saved = dict(adapters.READ)
    try:
        if twin == "peft_version":
            adapters.READ[("_LoraFactorsProxy", "forward")] = "0" * 16
        if order == "apply_first":
            from autoep import ExpertParallel

            model = build("qwen3_moe")
            ExpertParallel(model, {"ep_size": world, "plan": QWEN_PLAN})
            model = with_lora(model, "qwen3_moe", "lora")
            if twin == "doubled":
                doubled_wrapper(model)
            with raises(LiveStateError, match=_TWIN_ERRORS[twin]):
                run(model, "model", inputs("model", 0, world)[rank])
        else:
            model = with_lora(build("qwen3_moe"), "qwen3_moe", "lora")
            if twin == "doubled":
                doubled_wrapper(model)
            from autoep import ExpertParallel

            # Rank 0 resolves; the others say it could not (PlanError naming rank 0's refusal), before any step.
            with raises(UnsupportedModuleStructure if rank == 0 else PlanError, match=_TWIN_ERRORS[twin]):
                ExpertParallel(model, {"ep_size": world, "plan": QWEN_PLAN})
    finally:
        adapters.READ.clear()
        adapters.READ.update(saved)


def peft_first_module_list_case(rank, world):
    """``target_modules`` LoRA on ModuleList experts' Linears before autoep: the proofs do not read PEFT's
    ``lora.Linear`` forward; refused at resolve on every rank, naming it and the order that works (tested above)."""
    from autoep import ExpertParallel
    from autoep.errors import PlanError

    model = with_lora(build("research_moe"), "research_moe", "lora")
    with raises(PlanError, match=r"matched base_model\.model\.layers\.0\.moe \(SparseMoE\).*PEFT's Linear wraps "
                                 r"experts\.0\.w1: get_peft_model ran before autoep.*apply expert parallelism first"):
        ExpertParallel(model, {"ep_size": world, "plan": [{"match": "*layers.*.moe", "local_compute_fn": "auto"}]})


def merge_case(rank, world, order: str, stepped: bool = True):
    """``merge_and_unload()`` on the EP model after a step (what a user runs to export), or before any forward
    (``stepped=False``: loading an adapter to merge it; apply_first: PEFT's chain set after apply, never called):
    each expert's weight becomes ``W + delta`` on its owner, as in the merged reference; the merged model's logits
    equal the reference's."""
    ref = with_lora(build("qwen3_moe"), "qwen3_moe", "lora")
    model, ep = ep_model("qwen3_moe", order, "lora", world)
    ids = inputs("model", 0, world)[rank]
    if stepped:
        run(model, "model", ids).sum().backward()  # a forward and a backward first, as training does
    _merged_equal(model.merge_and_unload(), ref.merge_and_unload(), lambda net: run(net, "model", ids))


def _merged_equal(merged, want, forward) -> None:
    from peft_training import weights

    mine = weights(merged)
    assert sorted(mine) == sorted(n for n, _ in want.named_parameters())
    for name, p in want.named_parameters():
        torch.testing.assert_close(mine[name], p.detach(), msg=lambda m: f"merged {name}: {m}")
    torch.testing.assert_close(forward(merged), forward(want))


def merged_twice_wrapper(model) -> None:
    """One edit: the outermost PEFT wrapper of every experts module becomes a subclass whose ``merge`` adds the
    delta twice (not PEFT's code), after ``get_peft_model`` set it."""
    from peft.tuners.lora.layer import ParamWrapper

    class MergedTwice(ParamWrapper):
        def merge(self, *args, **kwargs):
            super().merge(*args, **kwargs)
            return super().merge(*args, **kwargs)

    for name, m in model.named_modules():
        if name.endswith(".mlp"):
            m.experts.__class__ = MergedTwice


def merge_twin_case(rank, world):
    """The harmful twin of merging before any forward: a wrapper class swapped after PEFT set it (adapted then)
    is checked when its merge runs; ``LiveStateError`` on every rank, nothing merged."""
    from autoep.errors import LiveStateError

    model, _ = ep_model("qwen3_moe", "apply_first", "lora", world)
    merged_twice_wrapper(model)
    with raises(LiveStateError, match=r"ParamWrapper\.merge of MergedTwice is not PEFT's own"):
        model.merge_and_unload()


def dbrx_case(rank, world, order: str, what: str):
    """DBRX's experts (transformers 5.x ``DbrxExperts``: flattened (E*F, D) weights on the submodule ``experts.mlp``,
    read by the experts' own loop) with ``target_parameters`` on them. The model itself cannot run that forward
    (``self.mlp.v1`` through PEFT's wrapper: AttributeError), so there is nothing exact to run: after apply the EP
    block raises ``LiveStateError`` at its call, naming the wrapper and the fix (was: AttributeError inside autoep's
    recipe); its ``merge_and_unload()`` (PEFT's 2-D delta, B @ A per weight) is exact: the merged weights and the
    merged block's output equal the merged reference's. Before apply: refused at resolve, naming the wrapper."""
    from autoep.errors import LiveStateError, PlanError, UnsupportedModuleStructure

    ref = with_lora(build("dbrx"), "dbrx", "lora")
    x = inputs("block", 0, world)[rank]
    with raises(AttributeError, match="has no attribute 'v1'"):
        ref(x)
    if order == "peft_first":
        with raises(UnsupportedModuleStructure if rank == 0 else PlanError,
                    match=r"ParamWrapper wraps experts\.mlp.*ParamWrapper \(LoraConfig\(target_parameters=\.\.\.\)\) "
                          r"inside expert-parallel experts is refused"):
            ep_model("dbrx", order, "lora", world)
        return
    model, _ = ep_model("dbrx", order, "lora", world)
    if what == "forward":
        with raises(LiveStateError, match=r"DbrxFFN\.experts\.mlp is wrapped by PEFT's ParamWrapper \(LoraConfig\("
                                          r"target_parameters=\[\.\.\.experts\.mlp\.w2\]\)\), inside the "
                                          r"expert-parallel DbrxExperts.*merge_and_unload\(\) of this one is exact"):
            model(x)
    else:
        _merged_equal(model.merge_and_unload(), ref.merge_and_unload(), lambda net: net(x))


_TWIN_ERRORS = {
    "doubled": r"ParamWrapper\.forward of Doubled is not PEFT's own peft\.tuners\.lora\.layer\.ParamWrapper\.forward",
    "peft_version": r"PEFT's _LoraFactorsProxy\.forward is not the code autoep read \(peft 0\.21\)",
}


QWEN_PLAN = [{"match": FAMILIES["qwen3_moe"][2], "local_compute_fn": "auto"}]
ORDERS, TRAINABLE, LEVELS = ("apply_first", "peft_first"), ("lora", "all"), ("model", "block")
TRAIN = [f"{f}-{o}-{t}-{lv}" for f in FAMILIES for o in ORDERS for t in TRAINABLE for lv in LEVELS
         if not (f == "research_moe" and o == "peft_first")]
TRAIN += [f"qwen3_moe-{o}-two-{lv}" for o in ORDERS for lv in LEVELS]  # two adapters active at once
TWINS = [f"twin-{t}-{o}" for o in ORDERS for t in _TWIN_ERRORS]
MERGES = [f"merge{unrun}-{o}" for o in ORDERS for unrun in ("", "_unrun")] + ["twin-merged_twice-apply_first"]
DBRX = ["dbrx-apply_first-forward", "dbrx-apply_first-merge", "dbrx-peft_first-resolve"]


def cases(rank, world, train=tuple(TRAIN)):
    results = {}
    for case in train:
        guarded(results, case, train_case, rank, world, *case.split("-"))
    if world == 2:
        guarded(results, "research_moe-peft_first", peft_first_module_list_case, rank, world)
        for order in ORDERS:
            guarded(results, f"merge-{order}", merge_case, rank, world, order)
            guarded(results, f"merge_unrun-{order}", merge_case, rank, world, order, False)
        guarded(results, "twin-merged_twice-apply_first", merge_twin_case, rank, world)
        for case in DBRX:
            guarded(results, case, dbrx_case, rank, world, *case.split("-")[1:])
        for case in TWINS:
            _, twin, order = case.split("-")
            guarded(results, case, twin_case, rank, world, order, twin)
    return results


_RESULTS: dict = {}


@pytest.mark.parametrize("case", TRAIN + TWINS + ["research_moe-peft_first"] + MERGES + DBRX)
def test_two_ranks(case):
    if not _RESULTS.get(2):
        _RESULTS[2] = run_cases(2, "test_adapters:cases")
    errors = _RESULTS[2][case]
    assert not errors, "\n".join(errors)


# At 4 ranks (each rank one expert), one case per family and order in the README's command: every parameter
# trained, the first MoE block, a rank without tokens at a step. The other 25 repeat the 2-rank ones at 4 ranks: the
# slow tier (``-m slow``, run by CI after the README's command), in a group of their own.
FOUR_KEPT = [c for c in TRAIN if c.endswith("-all-block")]


@pytest.mark.parametrize("case", [c if c in FOUR_KEPT else pytest.param(c, marks=pytest.mark.slow) for c in TRAIN])
def test_four_ranks(case):
    kept = case in FOUR_KEPT
    if (4, kept) not in _RESULTS:
        _RESULTS[4, kept] = run_cases(4, "test_adapters:cases", [c for c in TRAIN if (c in FOUR_KEPT) == kept])
    errors = _RESULTS[4, kept][case]
    assert not errors, "\n".join(errors)
