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
MIN_ACCEPTED = 22


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


def v4_block_cases(rank: int, world_size: int, classes: list) -> dict:
    from test_parity_hf import hf_class_case

    results = {}
    for family, module_name, cls_name, config_paths in classes:
        guarded(results, f"{family}/{cls_name}", hf_class_case, rank, world_size, module_name, cls_name, config_paths)
    return results


def test_every_accepted_class_equals_its_own_forward_on_two_ranks(rows):
    """Outputs, input grads, router/shared grads (summed) and expert grads (gathered) equal the block's own."""
    results = run_cases(2, "test_transformers_v4:v4_block_cases", accepted(rows))
    failed = {name: errors for name, errors in results.items() if errors}
    assert len(results) == len(accepted(rows))
    assert not failed, "\n".join(f"{n}: {e[0].strip().splitlines()[-1]}" for n, e in failed.items())
