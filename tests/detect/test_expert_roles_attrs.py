"""Experts not in one registered container (issue 31, ``autoep.detect.expert_roles`` and ``built_lists``): the blocks of
``tests/role_blocks_attrs.py`` (numbered attributes, lists built with ``extend``, slices and concatenation, multi-task
lists) are found by data flow from the routing, each expert's modules recorded by the model's names; their one-edit
twins are refused naming why; the fuzzer's role operators over them never accepted and wrong. Parity on 1, 2 and 4
ranks, SGD steps and a rank with no tokens included: ``tests/runtime/test_one_pass.py`` (the same case names).

    pytest tests/detect/test_expert_roles_attrs.py
"""
from __future__ import annotations

import mutation
import pytest
import role_blocks_attrs as ra
import torch
from omegaconf import OmegaConf
from torch import nn

from autoep import UnsupportedModuleStructure, detect_moe_structure
from autoep.detect.structure import count_experts
from autoep.plan.resolve import resolve_plan
from autoep.runtime.apply import apply_plan
from autoep.runtime.recipes.local_experts import expert_owners

E = ra.E


def _each(*paths: str) -> tuple:
    return tuple((p,) for p in paths)


@pytest.mark.parametrize("make, path, members", [
    (ra.NumberedExpertsMoE, "expert_0", _each(*(f"expert_{i}" for i in range(E)))),
    (ra.NumberedListMoE, "expert_0", _each(*(f"expert_{i}" for i in range(E)))),
    (ra.NumberedAppendMoE, "expert_0", _each(*(f"expert_{i}" for i in range(E)))),  # appended in a loop over ids
    (ra.AppendListMoE, "experts", ()),  # every entry of self.experts in order: that container
    (ra.NumberedLoraMoE, "lora_A0", tuple((f"lora_A{i}", f"lora_B{i}") for i in range(E))),  # the block's order
    (ra.InitExtendMoE, "experts", ()),  # ordinary containers, however __init__ filled them
    (ra.InitConcatMoE, "experts", ()),
    (ra.ForwardExtendMoE, "shared_experts", _each("shared_experts.0", *(f"routed_experts.{i}" for i in range(E - 1)))),
    (ra.ForwardConcatMoE, "shared_experts", _each("shared_experts.0", *(f"routed_experts.{i}" for i in range(E - 1)))),
    (ra.ForwardSliceMoE, "experts", _each(*(f"experts.{i}" for i in range(E)))),  # the spares stay dense
    # task 0's list, then task 1's new entry: a shared expert reached by both tasks' loops is one expert
    (ra.MultiTaskMoE, "task_experts", _each("task_experts.0.0", "shared_experts.0", "shared_experts.1",
                                            "task_experts.1.0")),
    (ra.MultiTaskInlineMoE, "task_experts", _each("task_experts.0.0", "shared_experts.0", "shared_experts.1",
                                                  "task_experts.1.0")),
])
def test_experts_are_found_by_role(make, path, members):
    with torch.device("meta"):
        block = make()
    found = detect_moe_structure(block)
    assert (found.execution, found.experts_path, found.expert_members) == ("replay", path, members)
    assert count_experts(block, found) == E
    assert found.expert_kind == "row_local"


@pytest.mark.parametrize("name", list(ra.TWINS))
def test_one_edit_twins_are_refused_naming_why(name):
    make, reason = ra.TWINS[name]
    with pytest.raises(UnsupportedModuleStructure, match=reason):
        detect_moe_structure(make())


def test_a_numbered_name_that_is_not_a_module_is_refused():
    block = ra.NumberedExpertsMoE()
    block.register_buffer(f"expert_{E}", torch.zeros(1))
    with pytest.raises(UnsupportedModuleStructure, match=rf"self.expert_{E} is a Tensor, not a module"):
        detect_moe_structure(block)


def test_a_numbered_member_named_as_a_string_is_refused():
    class Logged(ra.NumberedExpertsMoE):
        def forward(self, hidden_states):
            self.note("expert_2")
            x = hidden_states.reshape(-1, ra.D)
            weights, selected = ra._top_k(self.gate, x, ra.K)
            y = torch.zeros_like(x)
            for i in range(self.num_experts):
                tok, slot = torch.where(selected == i)
                y.index_add_(0, tok, getattr(self, f"expert_{i}")(x[tok]) * weights[tok, slot, None])
            return y.reshape(hidden_states.shape)

        def note(self, name):
            self.last = name

    with pytest.raises(UnsupportedModuleStructure, match="reads self.expert_2 by its name"):
        detect_moe_structure(Logged())


def test_a_numbered_family_no_routed_loop_reaches_is_the_blocks_own_code():
    """1-based numbered norms applied to every row after the experts (a gap at ``norm0``): not experts, so neither
    their gap nor a read by name refuses the block; the experts stay the ModuleList."""

    class Normed(ra.InitExtendMoE):
        def __init__(self):
            super().__init__()
            for k in (1, 2):
                setattr(self, f"norm{k}", nn.LayerNorm(ra.D))

        def forward(self, hidden_states):
            x = hidden_states.reshape(-1, ra.D)
            y = self.route(x, self.experts)
            for k in (1, 2):
                y = getattr(self, f"norm{k}")(y)
            return (y + self.norm1(x)).reshape(hidden_states.shape)

    found = detect_moe_structure(Normed())
    assert (found.experts_path, found.expert_members) == ("experts", ())


def test_per_task_experts_with_shared_ones_on_every_row():
    """Each task's own experts routed (``enumerate(self.task_experts[t])``), the shared ones run on every row: the
    task experts are the experts, the shared ones stay where the token is."""

    class TaskRouted(ra.MultiTaskMoE):
        def forward(self, hidden_states):
            x = hidden_states.reshape(-1, ra.D)
            outputs = []
            for t in range(len(self.task_experts)):
                weights, selected = ra._top_k(self.gates[t], x, 1)
                y = torch.zeros_like(x)
                for i, expert in enumerate(self.task_experts[t]):
                    tok, slot = torch.where(selected == i)
                    y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
                for shared in self.shared_experts:
                    y = y + shared(x)
                outputs.append(y.reshape(hidden_states.shape))
            return tuple(outputs)

    found = detect_moe_structure(TaskRouted())
    assert found.expert_members == _each("task_experts.0.0", "task_experts.1.0")


def test_numbered_attributes_in_the_plan_keep_the_models_names():
    """``resolved.yaml`` names each expert's modules (``lora_A0``, ``lora_B0``); after apply the state-dict keys are the
    model's and expert i's two modules lie on one owner."""
    model = nn.ModuleDict({"mlp": ra.NumberedLoraMoE()})
    keys = set(model.state_dict())
    resolved = resolve_plan({"ep_size": 2, "plan": [{"match": "mlp"}]}, model)
    structure = OmegaConf.to_container(resolved.plan[0].decision.structure)
    assert structure["expert_members"] == [[f"lora_A{i}", f"lora_B{i}"] for i in range(E)]
    apply_plan(model, OmegaConf.create({**OmegaConf.to_container(resolved), "ep_size": 1}), None)
    assert set(model.state_dict()) == keys
    owners = expert_owners(model)
    assert set(owners) == {k for k in keys if k.startswith(("mlp.lora_A", "mlp.lora_B"))}
    assert [owners[f"mlp.lora_B{i}.weight"].expert for i in range(E)] == list(range(E))
    assert all(owners[f"mlp.lora_A{i}.weight"].expert == i for i in range(E))


def test_the_slices_spares_and_the_task_gates_stay_dense():
    for make, dense in ((ra.ForwardSliceMoE, ("gate.", f"experts.{E}.", f"experts.{E + 1}.")),
                        (ra.MultiTaskMoE, ("gates.",))):
        model = nn.ModuleDict({"mlp": make()})
        resolved = resolve_plan({"ep_size": 2, "plan": [{"match": "mlp"}]}, model)
        assert resolved.plan[0].decision.num_experts == E
        apply_plan(model, OmegaConf.create({**OmegaConf.to_container(resolved), "ep_size": 1}), None)
        owned = set(expert_owners(model))
        names = {n for n, _ in model.named_parameters()}
        assert owned == {n for n in names if not n.removeprefix("mlp.").startswith(dense)}, make


def test_a_list_changed_in_a_branch_or_handed_to_a_function_is_not_read():
    """Mutations the detector does not follow leave the list unread (the block is refused, naming the statement),
    never evaluated to other modules than the forward calls."""

    class Branch(ra.ForwardExtendMoE):
        def forward(self, hidden_states):
            x = hidden_states.reshape(-1, ra.D)
            experts = list(self.shared_experts)
            if self.training:
                experts.extend(self.routed_experts)
            weights, selected = ra._top_k(self.gate, x, ra.K)
            y = torch.zeros_like(x)
            for i, expert in enumerate(experts):
                tok, slot = torch.where(selected == i)
                y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
            return y.reshape(hidden_states.shape)

    class Handed(ra.ForwardExtendMoE):
        def forward(self, hidden_states):
            x = hidden_states.reshape(-1, ra.D)
            experts = list(self.shared_experts) + list(self.routed_experts)
            _shuffle(experts)
            weights, selected = ra._top_k(self.gate, x, ra.K)
            y = torch.zeros_like(x)
            for i, expert in enumerate(experts):
                tok, slot = torch.where(selected == i)
                y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
            return y.reshape(hidden_states.shape)

    with pytest.raises(UnsupportedModuleStructure, match=r"`experts.extend\(self.routed_experts\)` \(line 5\) reads"):
        detect_moe_structure(Branch())
    with pytest.raises(UnsupportedModuleStructure, match=r"`_shuffle\(experts\)` \(line 4\) reads experts"):
        detect_moe_structure(Handed())


def _shuffle(experts: list) -> None:
    experts.reverse()


# ---------------------------------------------------------------------------------------------
# The fuzzer's role operators over these blocks
# ---------------------------------------------------------------------------------------------

ROLE_OPERATORS = ("misalign_containers", "route_shared")


@pytest.fixture(scope="module")
def role_outcomes():
    targets = [t for t in mutation.replay_targets() if t.name.removeprefix("replay/") in ra.BLOCKS]
    mutants = [m for t in targets for m in mutation.target_mutants(t) if m.operator in ROLE_OPERATORS]
    controls = [mutation.unmodified(t) for t in targets]
    return mutation.evaluate_all(controls + mutants)


def test_every_accepted_role_mutant_is_exact(role_outcomes):
    bad = [o for o in role_outcomes if o.verdict in ("accepted_wrong", "crash")]
    assert not bad, "\n".join(f"{o.name}: {o.verdict}: {o.detail}" for o in bad)
    controls = [o for o in role_outcomes if o.operator == "none"]
    assert len(controls) == len(ra.BLOCKS) and all(o.verdict == "accepted_exact" for o in controls), controls


def test_role_operators_reach_these_blocks(role_outcomes):
    """Numbered families misaligned (``getattr(self, f"lora_B{(i + 1) % n}")``) are refused, as containers are."""
    misaligned = [o for o in role_outcomes if o.operator == "misalign_containers"]
    assert {o.target for o in misaligned} == {"replay/numbered_lora"}, misaligned
    assert all(o.verdict in ("refused", "invalid") for o in misaligned), misaligned
    assert any(o.verdict == "refused" and "not selected by that id" in o.detail for o in misaligned), misaligned
