"""The user's own compute function, declared with an explicit ``_target_`` (no detection).

Factory contract (autoep.plan.archetypes): ``factory(module, *, ep_mesh, **kwargs) -> None``, called by
``apply_plan`` once per matched module; it makes the module EP-ready in place.
"""
import torch.nn as nn


def replicated_experts(module: nn.Module, *, ep_mesh=None, count_tokens: bool = True) -> None:
    """Keep every expert on every rank and run the block's own forward (no exchange).

    Useful to debug a model before sharding it; with ``count_tokens`` it records how many tokens the
    block saw, so the example can show the function really ran.
    """
    if ep_mesh is not None and ep_mesh.size() > 1:
        raise ValueError("replicated_experts keeps all experts on every rank; run it with parallel.ep_size=1")
    module.tokens_seen = 0
    if count_tokens:
        module.register_forward_pre_hook(_count)


def _count(module, args):
    module.tokens_seen += args[0].shape[:-1].numel()
