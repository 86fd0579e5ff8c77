"""autoep: expert parallelism for PyTorch MoE training, driven by Hydra YAML.

The package tree is the flow, each layer importing only those before it:
``detect`` (prove a block's structure from source) -> ``plan`` (freeze decisions into config; Hydra lives
here) -> ``runtime`` (apply the plan: shard, exchange, compute) -> ``train`` (autoep's own trainer) and
``integrations`` (other trainers'). ``errors`` is shared by all; ``cli`` holds the console scripts;
``tools`` (tiny models, the coverage report) stands apart.
"""

from autoep.errors import UnsupportedModuleStructure

__all__ = [
    "MoeStructure",
    "UnsupportedModuleStructure",
    "detect_router_kind",
    "detect_moe_structure",
    "resolve_plan",
    "apply_plan",
    "ExpertParallel",
    "load_plan",
]


def __getattr__(name):
    # Imported lazily: the structure names and apply_plan pull in torch, resolve_plan Hydra/OmegaConf, and the
    # command lines report a config error before importing torch (autoep.train.command).
    if name in ("MoeStructure", "detect_moe_structure", "detect_router_kind"):
        from autoep.detect import structure

        return getattr(structure, name)
    if name == "resolve_plan":
        from autoep.plan.resolve import resolve_plan

        return resolve_plan
    if name == "apply_plan":
        from autoep.runtime.apply import apply_plan

        return apply_plan
    if name in ("ExpertParallel", "load_plan"):
        from autoep.integrations import handle

        return getattr(handle, name)
    raise AttributeError(name)
