"""``_apply_gate`` with an ``if`` on constants (transformers 5.25's Step3p7 and BailingHybrid experts:
``if self.limit is not None:`` clamps gate and up to a per-layer SwiGLU limit, ``None`` when the config has none).

``autoep.detect.experts_proof._RowLocal.branch`` folds such an ``if``: only the branch the experts' constant
attributes select is proven, and those attributes (``None`` included) are facts the runtime re-checks before each
call. Shown here: both classes accepted with the limit off and on, the recipe exact in one process and on 2 gloo
ranks (``_block_parity`` of ``test_parity_hf``) with the clamp biting, a change of the limit after apply raising
``FactChanged``, and each harmful one-edit twin of the ``if`` refused, naming it.
"""
from __future__ import annotations

import importlib
import textwrap

import pytest
import torch
import torch.nn as nn
from distributed import run_cases
from mutation import make_ep
from mutation_source import exec_subclass

from autoep.detect.structure import detect_moe_structure
from autoep.errors import FactChanged, UnsupportedModuleStructure

pytest.importorskip("transformers.models.step3p7.modeling_step3p7")

LIMIT = 0.2  # gate_up rows are ~N(0, 0.3) at the tiny size with randomize_'s weights: the clamp bites
CLASSES = {
    "step3p7": ("transformers.models.step3p7.modeling_step3p7", "Step3p7SparseMoeBlock"),
    "bailing_hybrid": ("transformers.models.bailing_hybrid.modeling_bailing_hybrid", "BailingHybridMoE"),
}


def tiny_block(family: str, limit=None) -> nn.Module:
    from test_parity_hf import eager_experts_, randomize_

    from autoep.tools.tiny import build_block, family_configs

    module, cls = CLASSES[family]
    configs = list(family_configs(importlib.import_module(f"transformers.models.{family}")))
    block, config = build_block(getattr(importlib.import_module(module), cls), configs, tiny=True)
    block.experts.limit = limit  # what ``swiglu_limits[layer_idx]`` sets in __init__ (0 or missing: None)
    randomize_(block, 0)
    eager_experts_(block)
    return block.float().train(), config


def _x(block: nn.Module) -> torch.Tensor:
    return torch.randn(2, 5, block.experts.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(0))


def _assert_exact(block: nn.Module, ep: nn.Module) -> None:
    xa, xb = _x(block).requires_grad_(), _x(block).requires_grad_()
    ya, yb = block(xa), ep(xb)
    torch.testing.assert_close(yb, ya)
    ya.square().sum().backward()
    yb.square().sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad)
    for (name, p), (_, q) in zip(block.named_parameters(), ep.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


@pytest.mark.parametrize("family", list(CLASSES))
def test_accepted_with_the_limit_off_and_on_and_exact(family):
    off, _ = tiny_block(family)
    on, _ = tiny_block(family, LIMIT)
    assert torch.all(off.experts.gate_up_proj == on.experts.gate_up_proj)
    assert not torch.allclose(off(_x(off)), on(_x(on))), "the clamp must change the block's output"
    for block, activation in ((off, "own_gate"), (on, "clamped_glu")):
        s = detect_moe_structure(block)
        assert (s.execution, s.expert_storage, s.activation) == ("grouped", "batched_parameters", activation)
        _assert_exact(block, make_ep(block, s, None))


@pytest.mark.parametrize("family", list(CLASSES))
@pytest.mark.parametrize("before, after", [(None, LIMIT), (LIMIT, None), (LIMIT, 2 * LIMIT)])
def test_a_limit_changed_after_apply_raises_naming_it(family, before, after):
    block, _ = tiny_block(family, before)
    ep = make_ep(block, detect_moe_structure(block), None)
    x = _x(block)
    torch.testing.assert_close(ep(x), block(x))
    ep.experts.limit = after
    with pytest.raises(FactChanged, match=r"experts.limit"):
        ep(x)
    ep.experts.limit = before
    torch.testing.assert_close(ep(x), block(x))  # set back: the plan runs again


# One-edit twins of ``if self.limit is not None:`` (the original line below) that would make EP wrong if
# accepted: a test on the rows' values or their number (EP hands the gate other rows than the block's own
# forward does), on the train/eval mode (not a fact: it changes by design), on a tensor attribute, and a taken
# branch that mixes rows.
GATE = '''
def _apply_gate(self, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    gate = self.act_fn(gate)
    {test}
        gate = {clamp}
        up = up.clamp(min=-self.limit, max=self.limit)
    return gate * up
'''
ORIGINAL = dict(test="if self.limit is not None:", clamp="gate.clamp(max=self.limit)")
TWINS = [
    (dict(test="if gate_up.sum() > 0:"), "is computed from the rows"),
    (dict(test="if up.shape[0] > 3:"), r"`up.shape\[0\]` is computed from the rows \(up\)"),
    (dict(test="if self.training:"), "train/eval"),
    (dict(test="if self.limit_t is not None:"), "not a number"),
    (dict(test="if self.limit is not self.limit_same:"), "compares numbers by identity"),
    (dict(clamp="gate.clamp(max=self.limit) - gate.mean(0)"), "not proven row-local"),
]


def _twin(block: nn.Module, **edit) -> nn.Module:
    src = GATE.format(**{**ORIGINAL, **edit})
    block.experts.__class__ = exec_subclass(type(block.experts), textwrap.indent(src, "    "), check="_apply_gate")
    block.experts.limit_t = torch.tensor(LIMIT)
    block.experts.limit_same = block.experts.limit  # the same object now; an equal one set later need not be
    return block


@pytest.mark.parametrize("family", list(CLASSES))
@pytest.mark.parametrize("test", [ORIGINAL["test"], "if self.limit is not None and self.limit > 0:"])
def test_the_original_written_again_is_accepted(family, test):
    """The twins below differ from this by one edit: their refusal is the edit's, not the rewrite's. A
    short-circuit reads only what Python reads (``None > 0`` is never evaluated)."""
    for limit, activation in ((None, "own_gate"), (LIMIT, "clamped_glu")):
        block = _twin(tiny_block(family, limit)[0], test=test)
        s = detect_moe_structure(block)
        assert s.activation == activation
        ep = make_ep(block, s, None)
        _assert_exact(block, ep)
        ep.experts.limit = LIMIT if limit is None else None
        with pytest.raises(FactChanged, match=r"experts.limit"):
            ep(_x(block))


@pytest.mark.parametrize("family", list(CLASSES))
@pytest.mark.parametrize("edit, why", TWINS, ids=[t[0].get("test", t[0].get("clamp")) for t in TWINS])
def test_harmful_twins_of_the_if_are_refused(family, edit, why):
    with pytest.raises(UnsupportedModuleStructure, match=why):
        detect_moe_structure(_twin(tiny_block(family, LIMIT)[0], **edit))


# ---------------------------------------------------------------- 2 gloo ranks, the clamp on


def limit_cases(rank: int, world_size: int) -> dict:
    from distributed import guarded
    from test_parity_hf import _block_parity

    def case(family):
        block, config = tiny_block(family, LIMIT)
        _block_parity(rank, world_size, block, config.hidden_size, config)

    results = {}
    for family in CLASSES:
        guarded(results, family, case, family)
    return results


def test_parity_on_two_ranks_with_the_limit_on():
    results = run_cases(2, "test_apply_gate_branch:limit_cases")
    assert set(results) == set(CLASSES)
    assert not any(results.values()), results
