"""The archetype table: every row's factory exists and binds the kwargs an auto decision writes."""
import importlib
import inspect

import pytest

from autoep import MoeStructure, UnsupportedModuleStructure
from autoep.plan.archetypes import TABLE, compute_fn_config


@pytest.mark.parametrize("key", sorted(TABLE))
def test_every_row_imports_and_binds(key):
    router, storage = key
    structure = MoeStructure(router=router, shared_experts="none", expert_storage=storage, jitter=False)
    fn = compute_fn_config(structure)
    module_name, _, attr = fn.pop("_factory_").rpartition(".")
    factory = getattr(importlib.import_module(module_name), attr)
    inspect.signature(factory).bind(object(), ep_mesh=None, **fn)  # the contract apply_plan calls
    assert fn["structure"] == structure.as_dict()


def test_a_structure_without_a_row_is_refused():
    structure = MoeStructure(router="topk_router_module", shared_experts="none", expert_storage="sparse_mixer",
                             jitter=False)
    with pytest.raises(UnsupportedModuleStructure, match="no recipe for router=topk_router_module with "
                                                         "expert_storage=sparse_mixer"):
        compute_fn_config(structure, "SomeBlock")
