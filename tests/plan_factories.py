"""A compute-fn factory outside autoep, for explicit-target tests (allowed via parallel.allowed_targets)."""


def scaled_experts(module, *, ep_mesh, scale: float = 1.0) -> None:
    """Factory contract: factory(module, *, ep_mesh, **kwargs) -> None. Records its call only."""
    module.ep_test_scale = scale
