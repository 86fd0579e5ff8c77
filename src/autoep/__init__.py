"""autoep: expert parallelism for PyTorch MoE training, driven by Hydra YAML."""

from autoep.errors import UnsupportedModuleStructure

__all__ = [
    "MoeStructure",
    "UnsupportedModuleStructure",
    "detect_router_kind",
    "detect_moe_structure",
    "resolve_plan",
    "apply_plan",
]


def __getattr__(name):
    # Imported lazily: the structure names and apply_plan pull in torch, resolve_plan Hydra/OmegaConf, and the
    # command lines report a config error before importing torch (autoep.cli).
    if name in ("MoeStructure", "detect_moe_structure", "detect_router_kind"):
        from autoep import structure

        return getattr(structure, name)
    if name == "resolve_plan":
        from autoep.resolve import resolve_plan

        return resolve_plan
    if name == "apply_plan":
        from autoep.apply import apply_plan

        return apply_plan
    raise AttributeError(name)
