"""The archetype table: one source of truth from a proven MoeStructure to the recipe that executes it.

Every consumer (``resolve_plan``, the ``autoep-plan`` printer, ``apply_plan``) reads only this table.
A structure with no row is refused with the opt-out hint.

Compute-fn factory contract (what a ``local_compute_fn._factory_`` or ``._target_`` names):

    factory(module: nn.Module, *, ep_mesh: DeviceMesh, **kwargs) -> None

The factory is called once per matched module by ``apply_plan``. Parameter roles: the parameters
registered directly on ``module.experts`` are the expert parameters (dim 0 = expert); ``apply_plan``
shards them ``Shard(0)`` over ``ep`` before calling the factory. A recipe that restructures the experts
(``module_list``: stacks a ModuleList into ``experts.gate_up_proj``/``experts.down_proj``) shards what it
creates itself with ``autoep.runtime.apply.shard_expert_tensor``; so does ``grouped`` for expert weights on
nested submodules (``experts.fc1.weight``). Every other parameter of the block (router,
shared branch) is dense. The factory makes ``module`` EP-ready in place and returns nothing; it moves
only the expert work (the experts' forward, or the block's expert loop spliced out of its own
forward): routing, jitter, scaling, shared branches and the return structure stay the model's own code.
A recipe module may define ``validate(module, **kwargs)``; ``resolve_plan`` calls it for explicit
``_target_``s so a recipe that does not fit a module is an error at resolve time, naming the module. ``kwargs`` are the keys written next to ``_target_`` in
the config (for auto decisions: the row's kwargs plus ``structure``, every MoeStructure field).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autoep.detect.structure import MoeStructure
from autoep.errors import UnsupportedModuleStructure
from autoep.targets import FACTORY_KEY, RECIPES  # noqa: F401  (resolve reads archetypes.RECIPES)


@dataclass(frozen=True)
class Archetype:
    """One row: the factory ``_target_`` and its kwargs (parameter roles: see the module docstring)."""

    target: str
    kwargs: dict = field(default_factory=dict)


BATCHED = Archetype(target=f"{RECIPES}.batched.ep_batched_experts")
MODULE_LIST_BLOCK = Archetype(target=f"{RECIPES}.module_list.ep_module_list_block")
GROUPED = Archetype(target=f"{RECIPES}.grouped.ep_grouped_experts")
EQUAL_GROUPS = Archetype(target=f"{RECIPES}.equal_groups.ep_equal_group_experts")
# Module experts whose loop no fast-path spec proves: the block's forward runs once, its expert outputs deferred
# to the exchange (one pass), each expert's own forward on its owner. Chosen by ``MoeStructure.execution``, for any router.
REPLAY = Archetype(target=f"{RECIPES}.replay.ep_replay_block")
# 3-D expert weights the block's own routing loop slices (``autoep.detect.block_weights``): the forward runs once,
# each proven expert expression an expert call on the weights' owner. Chosen by ``expert_storage``, for any router.
BLOCK_WEIGHTS = Archetype(target=f"{RECIPES}.block_weights.ep_block_weights")

# (router, expert_storage) -> recipe. The remaining MoeStructure fields are passed to the factory as
# its ``structure`` kwarg, so the decision's full lookup key is every field (jitter included).
# batched_parameters rows keep the block's own forward and replace only the experts' forward by the
# token exchange + grouped compute, honouring the proven layout facts. module_list rows run the block's
# own forward recompiled with only its proven expert loop replaced by the exchange.
# The router kind never changes the recipe (routing runs as the block writes it); it is in the key so
# the table stays the one place that says which (router, storage) pairs have been proven to run.
TABLE: dict[tuple[str, str], Archetype] = {
    **{(router, "batched_parameters"): BATCHED for router in ("topk_router_module", "softmax_topk", "sigmoid_group", "other")},
    **{(router, "module_list"): MODULE_LIST_BLOCK for router in ("topk_router_module", "softmax_topk", "sigmoid_group", "other")},
    # grouped rows keep the block's own forward; only its experts(x_sorted, num_tokens_per_expert) call
    # becomes the exchange of each group's rows to the rank owning that expert, computed there grouped.
    **{(router, "grouped"): GROUPED for router in ("topk_router_module", "softmax_topk", "sigmoid_group", "other")},
    # equal_groups rows keep the block's own forward; only its experts(rows) call (E equal groups of rows,
    # Llama-4) becomes the grouped exchange, zero rows skipped where the proven expert is zero at zero.
    **{(router, "equal_groups"): EQUAL_GROUPS for router in ("topk_router_module", "softmax_topk", "sigmoid_group", "other")},
}


# The expert kinds (``MoeStructure.expert_kind``) a recipe runs, per storage: "swiglu" everywhere; "row_local"
# experts only through their own forward, which the module_list recipe runs (runtime/recipes/local_experts.py).
RUNNABLE_EXPERT_KINDS = ("swiglu", "row_local")
OWN_FORWARD_STORAGE = ("module_list",)  # where "row_local" experts run (their own forward)


def archetype_for(structure: MoeStructure, cls_name: str = "module") -> Archetype:
    """The row for ``structure``, or ``UnsupportedModuleStructure`` naming what has no recipe."""
    if structure.expert_storage == "block_weights":
        return BLOCK_WEIGHTS
    if structure.execution == "replay":
        if structure.expert_storage != "module_list":
            raise UnsupportedModuleStructure(cls_name, f"execution=replay runs module experts only, not "
                                                       f"expert_storage={structure.expert_storage}")
        return REPLAY
    if structure.expert_kind not in RUNNABLE_EXPERT_KINDS or (
            structure.expert_kind == "row_local" and structure.expert_storage not in OWN_FORWARD_STORAGE):
        raise UnsupportedModuleStructure(
            cls_name, f"its experts ({structure.experts_path}) are proven row-local (expert_kind="
                      f"{structure.expert_kind}) but not the SwiGLU the grouped-GEMM recipes compute; only their own "
                      "forward can run them under EP, and only the module_list recipe runs experts' own forward")
    row = TABLE.get((structure.router, structure.expert_storage))
    if row is None:
        raise UnsupportedModuleStructure(
            cls_name, f"no recipe for router={structure.router} with expert_storage={structure.expert_storage}"
        )
    return row


def compute_fn_config(structure: MoeStructure, cls_name: str = "module") -> dict:
    """The ``local_compute_fn`` mapping an auto decision writes: ``_factory_`` plus its kwargs."""
    row = archetype_for(structure, cls_name)
    return {FACTORY_KEY: row.target, **row.kwargs, "structure": structure.as_dict()}


def known_targets() -> set[str]:
    return {row.target for row in TABLE.values()} | {REPLAY.target, BLOCK_WEIGHTS.target}
