"""Experts by role (issue 31, ``autoep.detect.expert_roles``): the blocks of ``tests/role_blocks.py`` are found by
data flow from the routing, across containers (one expert's modules recorded, placed together, named as the model
names them), their one-edit twins refused naming the line, and the fuzzer's role operators (aligned containers
misaligned, a shared list reached by routed rows) never accepted and wrong. Parity on 1, 2 and 4 ranks, SGD steps
and a rank with no tokens included: ``tests/runtime/test_one_pass.py`` (cases ``lora_mixture``, ``lora_mixture_3``,
``shared_list``, ``forward_built`` and the twins).

    pytest tests/detect/test_expert_roles.py
"""
from __future__ import annotations

import mutation
import one_pass_blocks as ob
import pytest
import role_blocks as rb
import torch
from omegaconf import OmegaConf
from torch import nn

from autoep import UnsupportedModuleStructure, detect_moe_structure
from autoep.detect.structure import count_experts
from autoep.plan.resolve import resolve_plan
from autoep.plan.table import plan_rows
from autoep.runtime.apply import apply_plan
from autoep.runtime.recipes.local_experts import expert_owners

E = rb.E


def _lora_members(containers=("lora_A", "lora_B")) -> tuple:
    return tuple(tuple(f"{c}.{i}" for c in containers) for i in range(E))


@pytest.mark.parametrize("make, path, members", [
    (rb.DropoutListMoE, "experts", ()),  # the dropout list holds no tensor: the experts are one container again
    (rb.LoraMixture3MoE, "lora_A", _lora_members()),  # lora_dropout[i] holds no tensor: it stays where the token is
    (ob.LoraMixtureMoE, "lora_A", _lora_members()),  # one dropout module, two containers
    (rb.LoraDictMoE, "lora_A", tuple((f"lora_A.e{i}", f"lora_B.e{i}") for i in range(E))),  # iterated: its keys
    (rb.SharedListMoE, "experts", ()),  # the shared list every row reaches stays: one container of experts
    (rb.ForwardBuiltMoE, "base_layer", (("base_layer",),) + tuple((f"adapters.{i}",) for i in range(E - 1))),
])
def test_experts_are_found_by_role(make, path, members):
    with torch.device("meta"):
        block = make()
    found = detect_moe_structure(block)
    assert (found.execution, found.experts_path, found.expert_members) == ("replay", path, members)
    assert count_experts(block, found) == E
    assert found.expert_kind == "row_local"


def test_one_adapter_counts_two_experts_and_never_the_router():
    """The issue's report: with one adapter, the router list was taken for the experts (``ep_size=2 does not divide
    num_experts=1``). The experts are the base layer and the adapter; the router stays dense."""
    model = nn.ModuleDict({"mlp": rb.ForwardBuiltMoE(adapters=1)})
    resolved = resolve_plan({"ep_size": 2, "plan": [{"match": "mlp"}]}, model)
    decision = resolved.plan[0].decision
    assert decision.num_experts == 2
    assert OmegaConf.to_container(decision.structure.expert_members) == [["base_layer"], ["adapters.0"]]
    apply_plan(model, OmegaConf.create({**OmegaConf.to_container(resolved), "ep_size": 1}), None)
    owned = set(expert_owners(model))
    assert owned == {f"mlp.{n}" for n, _ in model["mlp"].named_parameters()
                     if n.startswith(("base_layer.", "adapters."))}
    assert not any("routers" in n or "base_gate" in n for n in owned)


def test_the_plan_names_each_experts_modules_by_the_models_names():
    """``resolved.yaml`` lists each expert's modules; after apply the state-dict keys and the ownership query use
    the model's own names (``lora_A.0.weight``), one expert per owner: expert i's modules lie together."""
    model = nn.ModuleDict({"mlp": rb.LoraMixture3MoE()})
    keys = set(model.state_dict())
    resolved = resolve_plan({"ep_size": 2, "plan": [{"match": "mlp"}]}, model)
    structure = OmegaConf.to_container(resolved.plan[0].decision.structure)
    assert structure["expert_members"] == [list(m) for m in _lora_members()]
    again = OmegaConf.create(OmegaConf.to_yaml(resolved))  # as resolved.yaml holds it
    apply_plan(model, OmegaConf.create({**OmegaConf.to_container(again), "ep_size": 1}), None)
    assert set(model.state_dict()) == keys
    owners = expert_owners(model)
    assert set(owners) == {k for k in keys if ".lora_A." in k or ".lora_B." in k}
    assert {owners[f"mlp.lora_A.{i}.weight"].expert for i in range(E)} == set(range(E))
    assert all(owners[f"mlp.lora_A.{i}.weight"].expert == owners[f"mlp.lora_B.{i}.weight"].expert for i in range(E))
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".lora_" in n)
    assert plan_rows(model, resolved)[-1][-1] == expert_bytes // 2  # the table counts both containers as experts


@pytest.mark.parametrize("name", list(rb.TWINS))
def test_one_edit_twins_are_refused_naming_why(name):
    make, reason = rb.TWINS[name]
    with pytest.raises(UnsupportedModuleStructure, match=reason):
        detect_moe_structure(make())


def test_aligned_containers_of_different_lengths_are_refused():
    block = rb.LoraMixture3MoE()
    block.lora_B.append(nn.Linear(rb.RANK, rb.D, bias=False))
    with pytest.raises(UnsupportedModuleStructure, match=r"self.lora_\w+ and self.lora_B are both indexed by the expert "
                                                         r"id .* but hold different entries"):
        detect_moe_structure(block)


def test_a_forward_built_list_holding_one_module_twice_is_refused():
    class Twice(rb.ForwardBuiltMoE):
        def forward(self, hidden_states):
            x = hidden_states.reshape(-1, rb.D)
            experts = [self.base_layer, self.adapters[0], self.adapters[1], self.base_layer]
            weights, selected = torch.topk(self.base_gate(x).expand(-1, len(experts)).softmax(-1), 2, dim=-1)
            y = torch.zeros_like(x)
            for i, expert in enumerate(experts):
                tok, slot = torch.where(selected == i)
                y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
            return y.reshape(hidden_states.shape)

    with pytest.raises(UnsupportedModuleStructure, match=r"builds experts with the module base_layer at entries 0 "
                                                         r"and 3; one module is one expert"):
        detect_moe_structure(Twice())


# ---------------------------------------------------------------------------------------------
# The fuzzer's role operators
# ---------------------------------------------------------------------------------------------

ROLE_OPERATORS = ("misalign_containers", "route_shared")


@pytest.fixture(scope="module")
def role_outcomes():
    targets = [t for t in mutation.replay_targets() if t.name.removeprefix("replay/") in rb.BLOCKS]
    mutants = [m for t in targets for m in mutation.target_mutants(t) if m.operator in ROLE_OPERATORS]
    controls = [mutation.unmodified(t) for t in targets]
    return mutation.evaluate_all(controls + mutants)


def test_every_accepted_role_mutant_is_exact(role_outcomes):
    bad = [o for o in role_outcomes if o.verdict in ("accepted_wrong", "crash")]
    assert not bad, "\n".join(f"{o.name}: {o.verdict}: {o.detail}" for o in bad)
    controls = [o for o in role_outcomes if o.operator == "none"]
    assert len(controls) == len(rb.BLOCKS) and all(o.verdict == "accepted_exact" for o in controls), controls


def test_role_operators_are_not_vacuous(role_outcomes):
    """Misaligned containers are refused; a shared list reached by routed rows is refused; the same list called on
    some rows only (no expert id picks them) is accepted and exact."""
    by_operator = {op: [o for o in role_outcomes if o.operator == op] for op in ROLE_OPERATORS}
    misaligned = by_operator["misalign_containers"]
    assert misaligned and all(o.verdict in ("refused", "invalid") for o in misaligned), misaligned
    assert any(o.verdict == "refused" and "not selected by that id" in o.detail for o in misaligned), misaligned
    assert any(o.verdict == "refused" and "different entries" in o.detail for o in misaligned), misaligned
    routed = by_operator["route_shared"]
    assert any(o.verdict == "refused" and "not selected by that id" in o.detail for o in routed), routed
    assert any(o.verdict == "accepted_exact" for o in routed), routed


class _FakeQuant(nn.Parameter):
    """A tensor-subclass weight (fake-quant style): no recipe applies it."""


def test_apply_checks_every_container_holding_an_experts_modules():
    """``apply_plan``'s run-time checks cover each child holding the experts' modules, not only ``experts_path``:
    a tensor-subclass weight in ``lora_B`` is refused naming it."""
    model = nn.ModuleDict({"mlp": rb.LoraMixture3MoE()})
    resolved = resolve_plan({"ep_size": 1, "plan": [{"match": "mlp"}]}, model)
    model["mlp"].lora_B[1].weight = _FakeQuant(model["mlp"].lora_B[1].weight.detach().clone())
    with pytest.raises(UnsupportedModuleStructure, match=r"mlp\.lora_B\.1\.weight is a _FakeQuant"):
        apply_plan(model, resolved, None)
