"""Every fact a proof uses is re-checked where it can change (issue 20, "proof holes at the edges").

- dims given by keyword (``dim=``, numpy's ``axis=``, negative and positive) are read where torch reads them;
- a default argument is the one the function object holds (``__defaults__``/``__kwdefaults__``), not its
  source's expression evaluated again in today's globals;
- module globals, module attributes and plain settings classes' attributes a proof folds are recorded at apply
  and checked before each call; a change raises ``FactChanged`` naming the value, both values and the fix;
- a dropout probability inside the experts is a fact at p=0 too (fast path and own forward);
- the per-call check also runs where the recipe's replaced code runs, after every user hook: a pre-hook
  registered after apply that flips a flag is caught.

The reference is each block's own forward: an accepted expert must give each row what it gives that row alone.
"""
import copy
import linecache
import sys
import types

import blocks
import mutation
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mutation import inputs, make_ep

from autoep import UnsupportedModuleStructure, detect_moe_structure
from autoep.detect import row_local
from autoep.detect.source import Refusal
from autoep.errors import FactChanged

D, FF = 16, 32


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, FF)
        self.fc2 = nn.Linear(FF, D)


def _experts(cls, n=4):
    torch.manual_seed(0)
    return blocks.ExpertListMoE([cls() for _ in range(n)])


def _row_by_row(expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([expert(x[i:i + 1]) for i in range(x.shape[0])])


# --- dims by keyword --------------------------------------------------------------------------------------


def _expert_computing(body: str) -> type:
    """An expert whose forward is ``h = gelu(fc1(x)); return fc2(<body>)``."""
    source = f"def forward(self, x):\n    h = F.gelu(self.fc1(x))\n    return self.fc2({body})\n"
    filename = f"<autoep test: {body}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # inspect reads it here
    namespace = {"F": F, "torch": torch, "__name__": __name__}
    exec(compile(source, filename, "exec"), namespace)
    namespace["forward"].__qualname__ = "KeywordDims.forward"
    return type("KeywordDims", (Expert,), {"forward": namespace["forward"]})


MIXING = {  # the rows mixed, whatever the spelling of the dim
    "h.cumsum(axis=0)": "works along dim 0",
    "h.sort(axis=0).values": "works along dim 0",
    "h - h.sum(axis=0, keepdim=True)": "works along dim 0",
    "torch.cumsum(h, axis=0)": "works along dim 0",
    "h.softmax(dim=-2)": "works along dim -2",
    "h - h.norm(1)": "reduces over every row",  # p=1 positional: no dim given
    "h - h.std(True)": "works along dim True",  # unbiased=True: no dim given
    "h.cumsum(dim=-1, axis=0)": "gives its dim more than once",
    "h.cumsum(-1, out=h)": "passes ['out']",
}
ROW_LOCAL = ["h.cumsum(axis=-1)", "h.cumsum(axis=1)", "h.sort(axis=-1, descending=True).values",
             "h - h.sum(axis=1, keepdim=True)", "h.softmax(dim=-1)", "h / h.norm(2, -1, keepdim=True)",
             "h.topk(FF // 2, axis=1).values.sum(-1, keepdim=True) + h"]


@pytest.mark.parametrize("body", list(MIXING))
def test_a_dim_by_keyword_that_mixes_rows_is_refused(body):
    with pytest.raises(Refusal, match=rf"KeywordDims.forward line 3: .* {MIXING[body].replace('[', '.')}"):
        row_local.prove_expert(_expert_computing(body)(), "experts[0]")


@pytest.mark.parametrize("body", ROW_LOCAL)
def test_a_last_dim_by_keyword_is_row_local(body):
    expert = _expert_computing(body.replace("FF", str(FF)))()
    row_local.prove_expert(expert, "experts[0]")
    x = torch.randn(5, D)
    torch.testing.assert_close(expert(x), _row_by_row(expert, x))


# --- defaults: the function object's ----------------------------------------------------------------------

MIX = True


class DefaultMixes(Expert):
    def forward(self, x, mix=MIX):  # True: what every call runs with, whatever MIX is rebound to later
        h = F.gelu(self.fc1(x))
        if mix:
            h = h - h.mean(0, keepdim=True)
        return self.fc2(h)


class KeywordDefaultMixes(Expert):
    def forward(self, x, *, mix=MIX):
        h = F.gelu(self.fc1(x))
        if mix:
            h = h - h.mean(0, keepdim=True)
        return self.fc2(h)


MIX = False


class DefaultRowLocal(Expert):
    def forward(self, x, mix=MIX):  # False when defined; MIX rebound to True below
        h = F.gelu(self.fc1(x))
        if mix:
            h = h - h.mean(0, keepdim=True)
        return self.fc2(h)


MIX = True


@pytest.mark.parametrize("cls", [DefaultMixes, KeywordDefaultMixes])
def test_a_default_is_read_from_the_function_not_todays_global(cls):
    with pytest.raises(UnsupportedModuleStructure, match=rf"{cls.__name__}.forward line 4: `h.mean\(0, "
                                                         r"keepdim=True\)` works along dim 0: mixes rows"):
        detect_moe_structure(_experts(cls))


def test_a_default_bound_before_its_global_was_rebound_is_row_local():
    block = _experts(DefaultRowLocal)
    assert detect_moe_structure(block).expert_kind == "row_local"
    x = torch.randn(5, D)
    torch.testing.assert_close(block.experts_list[0](x), _row_by_row(block.experts_list[0], x))


# --- globals, module attributes and class attributes: recorded at apply, checked before each call ----------

USE_MIX = False


class Settings:
    mix = False


settings = types.ModuleType("autoep_test_expert_settings")
settings.MIX = False
sys.modules[settings.__name__] = settings


class GlobalFlag(Expert):
    def forward(self, x):
        h = F.gelu(self.fc1(x))
        if USE_MIX:
            h = h - h.mean(0, keepdim=True)
        return self.fc2(h)


class ClassFlag(Expert):
    def forward(self, x):
        h = F.gelu(self.fc1(x))
        if Settings.mix:
            h = h - h.mean(0, keepdim=True)
        return self.fc2(h)


class ModuleFlag(Expert):
    def forward(self, x):
        h = F.gelu(self.fc1(x))
        if settings.MIX:
            h = h - h.mean(0, keepdim=True)
        return self.fc2(h)


FLAGS = {  # expert class: (owner, attribute, how the error names it)
    GlobalFlag: (sys.modules[__name__], "USE_MIX", rf"the global {__name__}.USE_MIX"),
    ClassFlag: (Settings, "mix", rf"the class attribute {__name__}.Settings.mix"),
    ModuleFlag: (settings, "MIX", r"the global autoep_test_expert_settings.MIX"),
}


def _applied(block):
    return make_ep(block, detect_moe_structure(block), None)


@pytest.mark.parametrize("cls", list(FLAGS), ids=lambda c: c.__name__)
def test_a_flag_read_from_a_global_or_a_class_and_changed_after_apply_raises_naming_it(cls, monkeypatch):
    block = _experts(cls)
    ep = _applied(block)
    x = torch.randn(2, 3, D)
    torch.testing.assert_close(ep(x), block(x))
    owner, name, spelled = FLAGS[cls]
    monkeypatch.setattr(owner, name, True)
    with pytest.raises(FactChanged, match=rf"{spelled} is True, but the expert-parallel plan was proven with "
                                          rf".*{name}=False when it was applied; set it back, or apply the plan"):
        ep(x)
    monkeypatch.undo()
    torch.testing.assert_close(ep(x), block(x))  # set back: the plan runs again


# --- dropout probabilities -------------------------------------------------------------------------------


class Dropping(Expert):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return self.fc2(self.drop(F.gelu(self.fc1(x))))


@pytest.mark.parametrize("build, named", [
    (lambda: _experts(Dropping), r"experts_list.\*.drop.p was 0.0 when the experts were proven, now 0.1"),
    (lambda: blocks.DropoutExpertsMoE(dropout=0.0), r"DropoutExpertsMoE.experts.0.dropout.p is 0.1, but the "
                                                    r"expert-parallel plan was proven with experts.0.dropout.p=0.0"),
], ids=["own_forward", "fast_path"])
def test_a_dropout_at_zero_raised_after_apply_raises_naming_it(build, named):
    block = build()
    ep = _applied(block)
    x = torch.randn(2, 3, D)
    torch.testing.assert_close(ep(x), block(x))
    for m in ep.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.1
    with pytest.raises(FactChanged, match=named):
        ep(x)


# --- the check after every user hook ----------------------------------------------------------------------


class InstanceFlag(Expert):
    def __init__(self):
        super().__init__()
        self.mix = False

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        if self.mix:
            h = h - h.mean(0, keepdim=True)
        return self.fc2(h)


def _gpt_oss_block():
    return next(t for t in mutation.targets() if t.name == "hf/gpt_oss").build()


def _flip_experts_mix(module, args):
    for expert in module.experts_list:
        expert.mix = True


def _double_gpt_oss_limit(module, args):
    module.experts.limit = 14.0  # its SwiGLU clamp (7.0), read by the experts' proof


@pytest.mark.parametrize("build, hook, named", [
    (lambda: _experts(InstanceFlag), _flip_experts_mix, r"experts_list.\*.mix was False when the experts were "
                                                        r"proven, now True"),
    (_gpt_oss_block, _double_gpt_oss_limit, r"GptOssExperts.limit is 14.0, but the expert-parallel plan was proven "
                                            r"with limit=7.0"),
], ids=["spliced_loop", "batched_experts_call"])
def test_a_user_pre_hook_registered_after_apply_that_changes_a_fact_is_caught(build, hook, named):
    """autoep's per-call check is a pre-hook registered at apply; a user's registered later runs after it. The
    check runs again where the replaced code runs (the spliced loop's exchange, the experts' replaced forward)."""
    block = build()
    ep = _applied(block)
    x = inputs(block)
    ref = copy.deepcopy(block)
    ref.register_forward_pre_hook(hook)
    ep.register_forward_pre_hook(hook)
    with pytest.raises(FactChanged, match=named):
        ep(x)
    ref(x)  # the model itself runs with the hook
