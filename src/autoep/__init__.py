"""autoep: expert parallelism for PyTorch MoE training, driven by Hydra YAML."""

from autoep.errors import UnsupportedModuleStructure
from autoep.structure import MoeStructure, detect_moe_structure, detect_router_kind

__all__ = [
    "MoeStructure",
    "UnsupportedModuleStructure",
    "detect_router_kind",
    "detect_moe_structure",
    "resolve_plan",
    "apply_plan",
]


def __getattr__(name):
    # resolve_plan pulls in Hydra/OmegaConf and apply_plan pulls in torch.distributed; import lazily.
    if name == "resolve_plan":
        from autoep.resolve import resolve_plan

        return resolve_plan
    if name == "apply_plan":
        from autoep.apply import apply_plan

        return apply_plan
    raise AttributeError(name)
