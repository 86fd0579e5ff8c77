"""The transformers 4.x environment (the ModuleList era many training repos pin): detection over every
MoE block class of the installed transformers 4.57, and 2-rank block parity for every accepted one.

Runs only where transformers < 5 is installed (CI's second environment, see README):

    python -m venv .venv-tf4 && . .venv-tf4/bin/activate && pip install torch==2.13.0 \\
      && pip install transformers==4.57.1 safetensors pytest hydra-core omegaconf && pip install --no-deps -e . \\
      && python -m pytest -q tests/tools/test_transformers_v4.py

Elsewhere it skips. The v5 suite (tests/runtime/test_parity_hf.py) covers transformers 5.x the same way.
"""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) >= 5:
    pytest.skip("the transformers 4.x environment only (this is transformers 5)", allow_module_level=True)

from distributed import guarded, run_cases  # noqa: E402

from autoep.tools.coverage import survey  # noqa: E402

# Measured on transformers 4.57.1 (docs/coverage.md has the table); a drop is a regression.
MIN_ACCEPTED = 26  # 25 before record/exchange/replay became automatic: + NllbMoeSparseMLP


@pytest.fixture(scope="module")
def rows():
    return survey(tiny=False)


def accepted(rows) -> list[tuple[str, str, str, list[str]]]:
    return [(r.family, r.module, r.cls, r.configs) for r in rows if r.structure is not None]


def test_detection_accepts_the_module_list_era_classes(rows):
    got = {r.cls: r for r in rows}
    assert len(accepted(rows)) >= MIN_ACCEPTED, [(r.cls, r.reason) for r in rows if r.structure is None]
    for cls in ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "DeepseekV3MoE"):
        s = got[cls].structure
        assert s is not None and s.expert_storage == "module_list", (cls, got[cls].reason)
    aria = got["AriaTextMoELayer"].structure  # experts(permuted_tokens, tokens_per_expert), nested grouped GEMMs
    assert aria is not None and aria.expert_storage == "grouped", got["AriaTextMoELayer"].reason
    llama4 = got["Llama4TextMoe"].structure  # experts(rows): every token once per expert, pre-scaled
    assert llama4 is not None and llama4.expert_storage == "equal_groups", got["Llama4TextMoe"].reason
    for cls in TRAINING_BRANCH:  # a per-expert loop while training, every expert on every token otherwise
        s = got[cls].structure
        assert s is not None and s.activation == "inline_gate", (cls, got[cls].reason)
    vitpose = got["VitPoseBackboneMoeMLP"].structure  # every expert on every row, masked by the sequence's id
    assert vitpose is not None and (vitpose.expert_kind, vitpose.execution) == ("row_local", "replay"), \
        got["VitPoseBackboneMoeMLP"].reason


# Accepted since issue 16's session 2: batched experts whose forward tests ``self.training`` (the dense branch is
# refused at forward time, ``autoep.detect.training_branch``); they also get a 4-rank run below.
TRAINING_BRANCH = ("Qwen3VLMoeTextSparseMoeBlock", "GptOssMLP")
# Also new then: every expert on every row, masked by the sequence's id, summed (first a splice of its own; since
# detector version 7 record/exchange/replay, each expert called on the whole (batch, seq, features) tensor).
ADDED = (*TRAINING_BRANCH, "VitPoseBackboneMoeMLP")


def v4_block_cases(rank: int, world_size: int, classes: list) -> dict:
    from test_parity_hf import hf_class_case

    results = {}
    for family, module_name, cls_name, config_paths in classes:
        guarded(results, f"{family}/{cls_name}", hf_class_case, rank, world_size, module_name, cls_name, config_paths)
    return results


# Accepted classes the block harness cannot call (no reference): NLLB-MoE 4.57 (taken by record/exchange/replay
# since detector version 6) reads ``len(padding_mask.shape)`` with its default ``padding_mask=False``, so its own
# forward raises without the mask the harness does not give. Checked below to still raise so; its parity with a
# mask is NOT tested on 4.57 (the 5.x class, which takes no mask, is, in tests/runtime/test_parity_hf.py).
NO_REFERENCE = {"NllbMoeSparseMLP": "'bool' object has no attribute 'shape'"}


def test_every_accepted_class_equals_its_own_forward_on_two_ranks(rows):
    """Outputs, input grads, router/shared grads (summed) and expert grads (gathered) equal the block's own."""
    results = run_cases(2, "test_transformers_v4:v4_block_cases", accepted(rows))
    for name, text in NO_REFERENCE.items():
        errors = results.pop(next(n for n in results if n.endswith("/" + name)))
        assert errors and all(text in e for e in errors), errors  # its own forward, not EP, raises
    failed = {name: errors for name, errors in results.items() if errors}
    assert len(results) == len(accepted(rows)) - len(NO_REFERENCE)
    assert not failed, "\n".join(f"{n}: {e[0].strip().splitlines()[-1]}" for n, e in failed.items())


def test_added_classes_equal_their_own_forward_on_four_ranks(rows):
    classes = [c for c in accepted(rows) if c[2] in ADDED]
    assert len(classes) == len(ADDED), [c[2] for c in classes]
    results = run_cases(4, "test_transformers_v4:v4_block_cases", classes)
    failed = {name: errors for name, errors in results.items() if errors}
    assert len(results) == len(classes)
    assert not failed, "\n".join(f"{n}: {e[0].strip().splitlines()[-1]}" for n, e in failed.items())


def test_training_branch_classes_refuse_their_dense_branch(rows):
    """In eval off CPU (GPT-OSS) or in eval (Qwen3-VL) their own forward computes every expert on every token;
    the EP replacement raises there, naming the line, instead of computing something else."""
    import copy
    import importlib

    import torch

    from autoep.runtime.recipes.batched import ep_batched_experts
    from autoep.tools.tiny import build_block

    row = next(r for r in rows if r.cls == "Qwen3VLMoeTextSparseMoeBlock")
    cls = getattr(importlib.import_module(row.module), row.cls)
    configs = [getattr(importlib.import_module(p.rpartition(".")[0]), p.rpartition(".")[2]) for p in row.configs]
    block, config = build_block(cls, configs, tiny=True)
    ep = copy.deepcopy(block)
    ep_batched_experts(ep, ep_mesh=None, structure=row.structure)
    with pytest.raises(RuntimeError, match=r"Qwen3VLMoeTextExperts.forward line \d+: not training"):
        ep.eval()(torch.randn(1, 3, config.hidden_size))


def switch_cases(rank: int, world_size: int) -> dict:
    """transformers 4.57 ``SwitchTransformersSparseMLP`` (rows assigned from a one-hot mask with capacity, a loop no
    fast path reads: record/exchange/replay runs it as written) with expert dropout 0: its default 0.1 is refused while training (the coverage
    survey says so), so the idiom's parity is checked on a config that has none; without router jitter, and with
    it (0.1: the router multiplies its input by noise in place while training; a non-leaf input, as a layer gets
    it, since a leaf with a gradient refuses that in the model's own forward too)."""
    import functools

    from test_parity_hf import _block_parity, randomize_
    from transformers.models.switch_transformers import modeling_switch_transformers as m

    results = {}
    for jitter in (0.0, 0.1):
        config = m.SwitchTransformersConfig(d_model=32, d_ff=24, num_experts=8, expert_capacity=2, dropout_rate=0.0,
                                             router_jitter_noise=jitter)
        block = m.SwitchTransformersSparseMLP(config)
        randomize_(block, 0)
        name = "switch_transformers" + ("_jitter" if jitter else "")
        guarded(results, name, functools.partial(_block_parity, non_leaf=bool(jitter)), rank, world_size, block, 32)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_switch_loop_equals_its_own_forward(world_size):
    results = run_cases(world_size, "test_transformers_v4:switch_cases")
    failed = {name: errors for name, errors in results.items() if errors}
    assert len(results) == 2 and not failed, "\n".join(f"{n}: {e[0]}" for n, e in failed.items())


def test_switch_default_dropout_refused_while_training_accepted_in_eval(rows):
    import copy

    import torch
    from transformers.models.switch_transformers import modeling_switch_transformers as m

    from autoep.detect.structure import detect_moe_structure
    from autoep.errors import UnsupportedModuleStructure
    from autoep.plan.archetypes import compute_fn_config
    from autoep.runtime.recipes.replay import ep_replay_block

    row = next(r for r in rows if r.cls == "SwitchTransformersSparseMLP")
    assert row.structure is None and "dropout with p=0.1 while training" in row.reason, row.reason
    nllb = next(r for r in rows if r.cls == "NllbMoeSparseMLP")  # moe_token_dropout 0.2: on the experts' outputs,
    assert nllb.structure is not None and nllb.structure.execution == "replay", nllb.reason  # replayed in place
    config = m.SwitchTransformersConfig(d_model=32, d_ff=24, num_experts=4, expert_capacity=3)
    torch.manual_seed(0)
    block = m.SwitchTransformersSparseMLP(config)
    with pytest.raises(UnsupportedModuleStructure, match="dropout with p=0.1 while training"):
        detect_moe_structure(block)
    block.eval()
    structure = detect_moe_structure(block)
    assert structure.execution == "replay" and compute_fn_config(structure)["_factory_"].endswith(".ep_replay_block")
    ep = copy.deepcopy(block)
    ep_replay_block(ep, ep_mesh=None, structure=structure)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(ep(x)[0], block(x)[0])


# PEFT's LoRA (``target_modules``) on the ModuleList experts' Linears of Qwen3-MoE and Mixtral as transformers 4.x
# writes them (``tests/peft_training.py``: the model's logits, gradients and SGD steps on 2 ranks). After apply the
# adapters run in each expert's own forward on its owner (the other ranks' are meta stand-ins, as the experts are);
# before apply resolve refuses, naming PEFT's layer and the order that works.
V4_LORA = {"qwen3_moe_v4": (["gate_proj", "up_proj", "down_proj"], "*model.layers.*.mlp"),
           "mixtral_v4": (["w1", "w2", "w3"], "*model.layers.*.block_sparse_moe")}
V4_LORA_CASES = [f"{f}-{t}" for f in V4_LORA for t in ("lora", "all", "peft_first")]


def _v4_families() -> None:
    import peft_training as T

    def qwen3_moe_v4():
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=T.VOCAB, hidden_size=T.HIDDEN, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True))

    def mixtral_v4():
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=T.VOCAB, hidden_size=T.HIDDEN, intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))

    for name, build in (("qwen3_moe_v4", qwen3_moe_v4), ("mixtral_v4", mixtral_v4)):
        targets, match = V4_LORA[name]
        T.FAMILIES[name] = (build, {"target_modules": targets}, match)


def _peft_first_case(rank: int, world_size: int, family: str) -> None:
    import peft_training as T

    from autoep import ExpertParallel
    from autoep.errors import PlanError

    model = T.with_lora(T.build(family), family, "lora")
    with T.raises(PlanError, match=r"PEFT's Linear wraps experts\.0\.\w+: get_peft_model ran before autoep.*"
                                   r"apply expert parallelism first"):
        ExpertParallel(model, {"ep_size": world_size, "plan": [{"match": V4_LORA[family][1],
                                                                "local_compute_fn": "auto"}]})


def peft_v4_cases(rank: int, world_size: int) -> dict:
    import peft_training as T

    _v4_families()
    results = {}
    for case in V4_LORA_CASES:
        family, how = case.split("-")
        if how == "peft_first":
            guarded(results, case, _peft_first_case, rank, world_size, family)
        else:
            guarded(results, case, T.train_case, rank, world_size, family, "apply_first", how, "model")
    return results


_PEFT: dict = {}


@pytest.mark.parametrize("case", V4_LORA_CASES)
def test_peft_lora_on_module_list_experts(case):
    pytest.importorskip("peft", reason="needs peft (pip install '.[test-tf4]')")
    if not _PEFT:
        _PEFT.update(run_cases(2, "test_transformers_v4:peft_v4_cases"))
    assert not _PEFT[case], "\n".join(_PEFT[case])
