"""Experts by where they sit (issue 31): the blocks of ``tests/wrapper_blocks.py`` are found (experts two and three
wrappers down, each level a plain call chain; a container with its own forward passing per-row extras; two-level
routing over a ModuleList of ModuleLists or a flat list; experts slicing their own weights), the per-group routers
never taken for experts, the model's names kept in the plan and after apply, and every one-edit twin refused naming
why. Parity on 1, 2 and 4 ranks (a rank with no tokens, two SGD steps, router grads, Python state):
``tests/runtime/test_one_pass.py`` (the one pass, cases named as ``wrapper_blocks.BLOCKS``/``TWINS``/``RAISES``) and
``tests/runtime/test_wrapper_parity.py`` (the spliced loop ``auto`` picks for experts slicing their weights).

    pytest tests/detect/test_wrapper_blocks.py
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import wrapper_blocks as wb
from omegaconf import OmegaConf
from torch import nn

from autoep import UnsupportedModuleStructure, detect_moe_structure
from autoep.detect import call_chain
from autoep.detect.source import Refusal
from autoep.detect.structure import count_experts
from autoep.plan.resolve import resolve_plan
from autoep.runtime.apply import apply_plan
from autoep.runtime.recipes.local_experts import expert_owners

E = wb.E
LEAVES = tuple((f"experts.{g}.{j}",) for g in range(wb.GROUPS) for j in range(wb.PER_GROUP))


@pytest.mark.parametrize("name, execution, path, members", [
    ("two_wrappers", "replay", "ffn.moe.experts", ()),
    ("three_wrappers", "replay", "mlp.ffn.moe.experts", ()),
    ("wrapper_aux_tuple", "replay", "ffn.moe.experts", ()),  # the MoE returns (out, aux_loss)
    ("wrapper_aux_state", "replay", "ffn.moe.experts", ()),  # the wrapper keeps its count and the aux loss
    ("wrapper_shared_experts", "replay", "ffn.moe.experts", ()),  # ffn.moe.shared_experts stays where the token is
    ("per_row_extras", "replay", "experts", ()),
    ("keyword_extras", "replay", "experts", ()),  # the extras passed by their parameters' names
    ("grouped_routing", "replay", "experts", LEAVES),  # each leaf of the ModuleList of ModuleLists one expert
    ("flat_grouped_routing", "replay", "experts", ()),
    ("flat_grouped_lora", "replay", "experts", tuple((f"experts.{e}", f"lora.{e}") for e in range(E))),
    ("sliced_weights", "spliced", "experts", ()),  # the block's own loop is proven: the spliced fast path
    ("chunked_weights", "spliced", "experts", ()),
])
def test_experts_are_found_where_they_sit(name, execution, path, members):
    with torch.device("meta"):
        block = wb.BLOCKS[name]()
    found = detect_moe_structure(block)
    assert (found.execution, found.experts_path, found.expert_members) == (execution, path, members)
    assert count_experts(block, found) == E
    assert found.expert_kind == "row_local"


@pytest.mark.parametrize("name", list(wb.TWINS))
def test_one_edit_twins_are_refused_naming_why(name):
    make, reason = wb.TWINS[name]
    with pytest.raises(UnsupportedModuleStructure, match=reason):
        detect_moe_structure(make())


@pytest.mark.parametrize("make", [wb.GroupedRoutingMoE, wb.FlatGroupedRoutingMoE, wb.FlatGroupedLoraMoE])
def test_per_group_routers_stay_dense(make):
    """The routers per group are called with the rows the group's id picks, selected by that id, like experts; their
    output picks the next level's rows, so they route: never placed (before, ``expert_gates`` was taken for the
    experts and the real experts were left unplaced)."""
    model = nn.ModuleDict({"mlp": make()})
    keys = set(model.state_dict())
    resolved = resolve_plan({"ep_size": 2, "plan": [{"match": "mlp"}]}, model)
    assert resolved.plan[0].decision.num_experts == E
    apply_plan(model, OmegaConf.create({**OmegaConf.to_container(resolved), "ep_size": 1}), None)
    assert set(model.state_dict()) == keys  # the model's own names
    owned = set(expert_owners(model))
    assert owned == {k for k in keys if k.startswith(("mlp.experts.", "mlp.lora."))}
    owners = expert_owners(model)
    assert sorted({owners[k].expert for k in owned}) == list(range(E))


def test_the_plan_names_experts_by_the_models_paths():
    """``resolved.yaml`` keeps the model's names: the wrappers' path, and each leaf of a container of containers."""
    for make, path in ((wb.ThreeWrappersMoE, "mlp.ffn.moe.experts"), (wb.GroupedRoutingMoE, "experts")):
        model = nn.ModuleDict({"mlp": make()})
        keys = set(model.state_dict())
        resolved = resolve_plan({"ep_size": 2, "plan": [{"match": "mlp"}]}, model)
        again = OmegaConf.create(OmegaConf.to_yaml(resolved))  # as resolved.yaml holds it
        structure = OmegaConf.to_container(again.plan[0].decision.structure)
        assert structure["experts_path"] == path
        if make is wb.GroupedRoutingMoE:
            assert structure["expert_members"] == [list(m) for m in LEAVES]
        apply_plan(model, OmegaConf.create({**OmegaConf.to_container(again), "ep_size": 1}), None)
        assert set(model.state_dict()) == keys
        assert set(expert_owners(model)) == {k for k in keys if k.startswith(f"mlp.{path}.")}


def test_a_wrapper_level_is_read_as_a_call_chain():
    """Each level below the block is proven, naming what breaks the chain: a loop around the call, no rows
    returned (the MoE's aux loss in their place), a second module leading to containers."""
    class Looped(wb.MoeFeedForward):
        def forward(self, x):
            for _ in range(1):
                x = self.moe(self.norm(x))
            return x

    class Tupled(wb.AuxTupleFeedForward):  # the MoE's aux loss returned in place of its rows
        def forward(self, x):
            _, aux_loss = self.moe(self.norm(x))
            return aux_loss

    class TwoMoes(wb.MoeFeedForward):
        def __init__(self):
            super().__init__()
            self.other = wb.DeepseekStyleMoE()

        def forward(self, x):
            return self.moe(self.norm(x)) + self.other(x)

    for ffn, reason in ((Looped, "in a loop"), (Tupled, "does not return rows"), (TwoMoes, "ambiguous")):
        block = wb.TwoWrappersMoE()
        block.ffn = ffn()
        with pytest.raises(UnsupportedModuleStructure, match=reason):
            detect_moe_structure(block)
    block = wb.TwoWrappersMoE()
    call_chain.prove_level(block.ffn, "moe", "ffn")  # the accepted level, proven on its own
    with pytest.raises(Refusal, match="calls self.moe 0 times"):
        call_chain.prove_level(_NoCall(), "moe", "ffn")


class _NoCall(wb.MoeFeedForward):
    """A wrapper whose forward returns its normed rows, never calling the MoE it holds."""

    def forward(self, x):
        return self.norm(x)


def test_a_wrapper_level_keeps_plain_state_and_tuples():
    """What a call of the wrapped MoE returns is read from its ``return`` statements (a tuple: rows first, the rest
    opaque), handed up a level as that level returns it; a wrapper may assign plain attributes of its own it never
    reads back, not a submodule, parameter or buffer; each refusal names the construct."""
    wrapper = wb.AuxStateFeedForward()
    out = call_chain.prove_level(wrapper, "moe", "ffn", call_chain._returned(wrapper.moe))
    assert isinstance(out, call_chain.Row)  # `return out`: the tuple unpacked, its rows returned
    assert isinstance(call_chain._returned(wb.AuxLossMoE())[1], call_chain.Opaque)
    assert call_chain._returned(wb.DeepseekStyleMoE()) == call_chain.ROWS
    tupled = call_chain.prove_level(wb.AuxTupleFeedForward(), "moe", "ffn", call_chain._returned(wrapper.moe))
    assert isinstance(tupled[0], call_chain.Row) and isinstance(tupled[1], call_chain.Opaque)
    with pytest.raises(Refusal, match="cannot split"):  # a tuple unpacked from a MoE returning rows
        call_chain.prove_level(wb.AuxTupleFeedForward(), "moe", "ffn", call_chain.ROWS)

    class KeepsNorm(wb.AuxStateFeedForward):
        def forward(self, x):
            self.norm = nn.Identity()  # a submodule replaced: what the model computes changes
            out, _ = self.moe(self.norm(x))
            return out

    class Sums(wb.AuxStateFeedForward):
        def forward(self, x):
            out, aux_loss = self.moe(self.norm(x))
            self.total = self.total + aux_loss  # read back: the previous call's value at run time
            return out

    class HelperReads(wb.AuxStateFeedForward):
        def forward(self, x):
            self.calls += 1
            out, _ = self.moe(self.norm(x) * self.scale())
            return out

        def scale(self):
            return 2.0 if self.calls > 1 else 1.0  # read back in a method the forward calls

    class Getter(wb.AuxStateFeedForward):
        def get_aux_loss(self):  # read outside the forward's calls: accepted
            return self.aux_loss

    call_chain.prove_level(Getter(), "moe", "ffn", call_chain._returned(wb.AuxLossMoE()))
    for cls, reason in ((KeepsNorm, "assigns self.norm .* a submodule"), (Sums, "reads self.total .* also writes"),
                        (HelperReads, "reads self.calls .* also writes")):
        with pytest.raises(Refusal, match=reason):
            call_chain.prove_level(cls(), "moe", "ffn", call_chain._returned(wb.AuxLossMoE()))


def test_shared_experts_below_a_wrapper_stay_dense():
    """Routed ``ffn.moe.experts`` placed, one per expert id; ``ffn.moe.shared_experts`` (every row) never placed."""
    model = nn.ModuleDict({"mlp": wb.SharedBelowWrapperMoE()})
    keys = set(model.state_dict())
    resolved = resolve_plan({"ep_size": 2, "plan": [{"match": "mlp"}]}, model)
    assert resolved.plan[0].decision.num_experts == E
    apply_plan(model, OmegaConf.create({**OmegaConf.to_container(resolved), "ep_size": 1}), None)
    owners = expert_owners(model)
    assert set(owners) == {k for k in keys if k.startswith("mlp.ffn.moe.experts.")}
    assert sorted({owners[k].expert for k in owners}) == list(range(E))


def test_experts_looped_in_a_parents_forward_are_refused_not_misplaced():
    """A block (or an MoE below a wrapper) whose routed loop is its parent's (``super().forward(x)``) and whose own
    forward reads only its shared list: the shared list was taken for the experts (sharded; the routed experts left
    replicated). Refused naming the parent's read, as the block itself and two wrappers down."""
    for block in (wb.SharedViaSuperMoE(), wb.SharedViaSuperTwin()):
        with pytest.raises(UnsupportedModuleStructure, match=r"super\(\)\.forward\(\.\.\.\) .* reads self\.experts"):
            detect_moe_structure(block)


def test_experts_slicing_their_weights_by_values_known_only_at_run_time_are_refused():
    class RowSliced(wb.FusedSwiGLU):
        def forward(self, x):
            w1 = self.w13.weight[: x.shape[-1]]  # a size read from the rows: not a constant known at detection
            return self.w2(F.silu(F.linear(x, w1)))

    with pytest.raises(UnsupportedModuleStructure, match="indexes a parameter by a value not known at detection"):
        detect_moe_structure(wb.SlicedWeightsMoE(RowSliced))


def test_nearer_experts_keep_their_decision_whatever_another_child_holds_deeper():
    """Wrappers are descended only where nothing nearer is found: a block whose own experts container is read keeps
    it, although another child (a mixer whose forward is no plain call chain) holds a module list two levels down."""
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(wb.D, wb.D) for _ in range(2)])

        def forward(self, x):
            return sum(h(x) for h in self.heads)

    class Mixer(nn.Module):  # mixes rows: not a plain call chain
        def __init__(self):
            super().__init__()
            self.inner = Heads()

        def forward(self, x):
            return self.inner(x - x.mean(0))

    class WithMixer(wb.SlicedWeightsMoE):
        def __init__(self):
            super().__init__()
            self.mixer = Mixer()

        def forward(self, hidden_states):
            x = hidden_states.reshape(-1, wb.D)
            weights, selected = torch.topk(self.gate(x).softmax(-1), wb.K, dim=-1)
            y = self.mixer(x)
            for i, expert in enumerate(self.experts):
                tok, slot = torch.where(selected == i)
                y = y.index_add(0, tok, expert(x[tok]) * weights[tok, slot, None])
            return y.reshape(hidden_states.shape)

    found = detect_moe_structure(WithMixer())
    assert found.experts_path == "experts"


def test_per_group_routers_are_never_taken_for_experts_alone():
    """With the experts in no container the roles read (each group's experts a plain attribute list), the routers'
    container is the only one found: refused naming it, not placed as the experts."""
    class PlainGroups(wb.GroupedRoutingMoE):
        def __init__(self):
            super().__init__()
            groups = self.experts
            del self.experts
            for g, group in enumerate(groups):
                for j, expert in enumerate(group):
                    self.add_module(f"expert_{g}_{j}", expert)

        def forward(self, hidden_states):
            x = hidden_states.reshape(-1, wb.D)
            group_w, group_idx = torch.topk(self.group_gate(x).softmax(-1), 1, dim=-1)
            y = torch.zeros_like(x)
            for g in range(wb.GROUPS):
                rows = torch.where(group_idx[:, 0] == g)[0]
                w, idx = torch.softmax(self.expert_gates[g](x[rows]), dim=-1).max(dim=-1)
                for j in range(wb.PER_GROUP):
                    tok = torch.where(idx == j)[0]
                    out = getattr(self, f"expert_{g}_{j}")(x[rows[tok]]) * w[tok, None]
                    y.index_add_(0, rows[tok], out)
            return y.reshape(hidden_states.shape)

    with pytest.raises(UnsupportedModuleStructure, match="expert_gates route"):
        detect_moe_structure(PlainGroups())


def test_extras_by_keyword_to_parameters_defaulting_to_none_are_refused_naming_the_default():
    """``expert(x[tok], pos=pos_emb[tok], ...)`` into ``forward(self, x, pos=None, ...)``: the proof takes the
    default, so the refusal says so and how to have the extra moved (drop the default)."""
    with pytest.raises(UnsupportedModuleStructure, match=r"`pos` defaults to None, which the proof takes.*drop its "
                                                         "default"):
        detect_moe_structure(wb.KeywordDefaultedMoE())


@pytest.mark.xfail(strict=True, raises=UnsupportedModuleStructure,
                   reason="keyword extras bound to parameters with a default: the proof takes the default; proving "
                          "them as rows needs the keywords the routed calls pass, recorded in the plan (issue 31)")
def test_extras_by_keyword_to_parameters_defaulting_to_none_are_accepted():
    found = detect_moe_structure(wb.KeywordDefaultedMoE())
    assert (found.execution, found.experts_path) == ("replay", "experts")
