"""Splice fidelity and facts that can change (issue 17): the method autoep splices is the live one, the
source it proves is the code that runs, and what it folds from the block's attributes stays true.

- compiled in its class's scope: private ``self.__x`` names read as the class reads them;
- with the live function's own ``__defaults__`` / ``__kwdefaults__`` (never re-evaluated: a global
  rebound after the class was defined changes neither) and its closure *cells* (a closure variable
  rebound after apply is seen by the model and by its spliced twin alike);
- the source read is checked against ``fn.__code__``: a ``__code__`` edited after import, or a file edited
  on disk after import, is refused; proofs are cached per code object, so a ``__code__`` swapped after a
  detection is proven again; the fingerprint sees a swap; a swap after apply stops the spliced method;
- a property is not folded as a fact (refused); a plain number folded at apply and changed later stops the
  EP block, naming it.

EP parity on 1, 2 and 4 gloo ranks (one rank without tokens) against the blocks' own forward/backward.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import blocks
import pytest
import torch
import torch.nn.functional as F
from blocks import (
    CountedExpertsMoE,
    DefaultScaleMoE,
    FeedForward,
    GroupedExperts,
    HalfScaledMoE,
    MoE,
    PaddedGroupedExperts,
    PrivateNameMoE,
    PropertyCountMoE,
    TitanMoE,
    make_rebindable_moe_class,
)
from distributed import guarded, run_cases
from mutation import inputs, make_ep
from rank_parity import SPLITS, ep_mesh, parity
from torch import nn

from autoep.detect.structure import detect_moe_structure
from autoep.errors import UnsupportedModuleStructure
from autoep.plan.fingerprint import class_hashes


def _seeded(make):
    torch.manual_seed(0)
    return make().train()


def _fresh_class(cls: type, method: str = "forward") -> type:
    """A subclass of ``cls`` holding its own function object for ``method`` (same code, defaults and
    closure), so a test may swap that function's ``__code__`` without touching ``cls``."""
    f = getattr(cls, method)
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    g.__qualname__, g.__kwdefaults__ = f.__qualname__, f.__kwdefaults__
    return type(cls.__name__, (cls,), {method: g, "__module__": cls.__module__})


# ---------------------------------------------------------------------------------------------
# The cases run on 1, 2 and 4 ranks
# ---------------------------------------------------------------------------------------------


def _private_names(rank, world_size, mesh, split):
    parity(_seeded(PrivateNameMoE), rank, world_size, mesh, split)


def _default_arguments(rank, world_size, mesh, split):
    """``ROUTED_SCALE`` rebound before apply: the class's defaults were evaluated when it was defined."""
    block = _seeded(DefaultScaleMoE)
    was = blocks.ROUTED_SCALE
    blocks.ROUTED_SCALE = 4.0
    try:
        parity(block, rank, world_size, mesh, split)
    finally:
        blocks.ROUTED_SCALE = was


def _closure_rebound_after_apply(rank, world_size, mesh, split):
    cls, set_scale = make_rebindable_moe_class(1.5)
    parity(_seeded(cls), rank, world_size, mesh, split, after_apply=lambda: set_scale(2.5))


def _code_swapped_after_a_detection(rank, world_size, mesh, split):
    """Detected once, then its forward's ``__code__`` swapped for another (valid) forward's: detected
    again, the new code is what is proven and spliced."""
    cls = _fresh_class(MoE)
    block = _seeded(lambda: cls())
    detect_moe_structure(block)
    cls.forward.__code__ = HalfScaledMoE.forward.__code__
    parity(block, rank, world_size, mesh, split)


def _count_changed_after_apply(rank, world_size, mesh, split):
    """``num_experts`` was 4 when the plan was proven (the loop's ``range(self.num_experts)`` became the
    exchange over 4 experts); set to 3 afterwards, the block's own loop would skip expert 3: the EP block
    refuses to run, naming it. The count as it was runs exactly."""
    block = _seeded(CountedExpertsMoE)
    ep = make_ep(block, detect_moe_structure(block), mesh)
    ep.num_experts = 3
    with pytest.raises(RuntimeError, match=r"CountedExpertsMoE.num_experts is 3, but the expert-parallel plan was "
                                           r"proven with num_experts=4"):
        ep(inputs(block, batch=split[rank]))
    parity(block, rank, world_size, mesh, split)


CASES = {
    "private_names": _private_names,
    "count_changed_after_apply": _count_changed_after_apply,
    "default_arguments": _default_arguments,
    "closure_rebound_after_apply": _closure_rebound_after_apply,
    "code_swapped_after_a_detection": _code_swapped_after_a_detection,
}


def splice_cases(rank: int, world_size: int) -> dict:
    mesh = ep_mesh(world_size)
    results = {}
    for name, case in CASES.items():
        for split in SPLITS[world_size]:
            guarded(results, f"{name} split={split}", case, rank, world_size, mesh, split)
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_single_process_parity(name):
    CASES[name](0, 1, None, SPLITS[1][0])


@pytest.mark.parametrize("world_size", [2, 4])
def test_multi_rank_parity(world_size):
    results = run_cases(world_size, "test_splice:splice_cases")
    assert len(results) == len(CASES) * len(SPLITS[world_size]), sorted(results)
    failed = {name: errs for name, errs in results.items() if errs}
    assert not failed, f"world_size={world_size}: " + "\n".join(f"{n}:\n{e[0]}" for n, e in failed.items())


# ---------------------------------------------------------------------------------------------
# The source proven is the code that runs
# ---------------------------------------------------------------------------------------------


def test_a_code_object_edited_after_import_is_refused():
    """The file says ``* 0.5``; the code that runs (edited with ``code.replace``) multiplies by 3.0."""
    cls = _fresh_class(HalfScaledMoE)
    code = cls.forward.__code__
    cls.forward.__code__ = code.replace(co_consts=tuple(3.0 if c == 0.5 else c for c in code.co_consts))
    with pytest.raises(UnsupportedModuleStructure, match=r"HalfScaledMoE.forward .* is not the code that runs"):
        detect_moe_structure(_seeded(lambda: cls()))


def test_an_expert_forward_swapped_after_a_detection_is_proven_again():
    """The experts' proof is cached by code object: a swapped expert ``forward`` (no longer a plain SwiGLU)
    is read and proven again (refused, or accepted as what it now is), never the cached SwiGLU."""
    expert_cls = _fresh_class(FeedForward)

    class Block(MoE):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([expert_cls(16, 32) for _ in range(4)])

    block = _seeded(Block)
    before = detect_moe_structure(block)
    assert before.expert_storage == "module_list"
    expert_cls.forward.__code__ = _doubled_expert.__code__
    try:
        after = detect_moe_structure(block)
    except UnsupportedModuleStructure as exc:
        assert "FeedForward.forward" in str(exc)  # proven again, and refused
        return
    assert after != before, "the SwiGLU proof of the old code was reused for the new code"


def _doubled_expert(self, x):
    return self.w2(F.silu(self.w1(x)) * self.w3(x)) * 2.0


EDITABLE = '''import torch
import torch.nn.functional as F
from blocks import MoE


class EditedMoE(MoE):
    def forward(self, x):
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        top_scores, selected_experts = torch.topk(scores, self.config.top_k, dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token_idx, slot = torch.where(selected_experts == i)
            out.index_add_(0, token_idx, expert(x[token_idx]) * top_scores[token_idx, slot, None])
        return (out * SCALE).view(bs, slen, dim)
'''


def test_a_file_edited_on_disk_after_import_is_refused(tmp_path):
    """The module was imported with ``* 1.5``; its file now says ``* 2.5`` (same lines): what would be read
    is not what runs."""
    path = tmp_path / "edited_moe_model.py"
    path.write_text(EDITABLE.replace("SCALE", "1.5"))
    spec = importlib.util.spec_from_file_location("edited_moe_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["edited_moe_model"] = module
    try:
        spec.loader.exec_module(module)
        block = _seeded(module.EditedMoE)
        path.write_text(EDITABLE.replace("SCALE", "2.5"))
        os.utime(path, (os.path.getatime(path), os.path.getmtime(path) + 10))  # a later edit, as an editor's
        with pytest.raises(UnsupportedModuleStructure, match=r"EditedMoE.forward .*is not the code that runs \(the file was edited after import"):
            detect_moe_structure(block)
    finally:
        del sys.modules["edited_moe_model"]


def test_a_property_is_not_folded_as_a_fact():
    """``num_experts`` a property that leaves the last expert out in eval: read at detection (in train mode)
    it would be 4; the block is refused naming it, not run as 4 experts in eval."""
    with pytest.raises(UnsupportedModuleStructure, match=r"self.num_experts is a property of PropertyCountMoE, "
                                                         r"computed on each read"):
        detect_moe_structure(_seeded(PropertyCountMoE))


def test_a_code_swap_after_apply_stops_the_spliced_method():
    """After apply the block runs its spliced method; once the class's forward has other code, it raises
    instead of running the code proven at apply time."""
    cls = _fresh_class(MoE)
    block = _seeded(lambda: cls())
    ep = make_ep(block, detect_moe_structure(block), None)
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(ep(x), block(x))
    cls.forward.__code__ = HalfScaledMoE.forward.__code__
    with pytest.raises(RuntimeError, match=r"MoE.forward had its __code__ replaced after apply_plan"):
        ep(x)


def test_an_experts_code_swap_after_apply_stops_the_replaced_experts_forward():
    """Grouped experts: EP computes the experts' forward proven at apply; once their class runs other code,
    the EP experts raise instead."""
    block = _seeded(lambda: TitanMoE(hidden=16, num_experts=4, top_k=2))
    experts_cls = _fresh_class(GroupedExperts)
    block.experts.__class__ = experts_cls
    ep = make_ep(block, detect_moe_structure(block), None)
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(ep(x), block(x))
    experts_cls.forward.__code__ = PaddedGroupedExperts.forward.__code__
    with pytest.raises(RuntimeError, match=r"GroupedExperts.forward was replaced, or its __code__ swapped, after "
                                           r"apply_plan"):
        ep(x)


def test_the_fingerprint_sees_a_code_swap():
    """``class_hashes`` changes when the forward's ``__code__`` or a helper method's is swapped, and only then."""
    cls = _fresh_class(MoE)

    def helper(self):
        return 1

    cls.helper = helper
    block = _seeded(lambda: cls())
    name = f"{cls.__module__}.{cls.__qualname__}"
    before = class_hashes([block])[name]
    assert class_hashes([block])[name] == before
    cls.forward.__code__ = HalfScaledMoE.forward.__code__
    swapped = class_hashes([block])[name]
    assert swapped != before
    cls.helper.__code__ = _doubled_expert.__code__.replace(co_argcount=1, co_nlocals=1, co_varnames=("self",))
    assert class_hashes([block])[name] != swapped


def test_the_source_check_accepts_what_the_detector_accepted():
    """Methods of a class built in a function (closure, zero-arg ``super()``), private names, defaults,
    staticmethods and module-level helpers compile, in their own scopes, to the code that runs."""
    from autoep.detect.source import function_tree

    cls, _ = make_rebindable_moe_class(1.0)
    for fn in (cls.forward, PrivateNameMoE.forward, PrivateNameMoE.__init__, DefaultScaleMoE.forward,
               blocks.make_closure_moe_class(0.1).forward, blocks.grouped_gemm_loop, blocks.TitanMoE.forward):
        assert function_tree(fn).name == fn.__name__
