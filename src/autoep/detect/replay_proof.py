"""What record/exchange/replay needs of a block with module experts (``autoep.runtime.recipes.replay``): no
proof of its loop at all, only of where its experts are and what they are.

The block's forward runs as written, twice; only its calls into the experts travel, and the run-time checks
(pass 2 makes the calls pass 1 recorded, bit for bit; pass 1 writes nothing) catch a block whose expert inputs
depend on expert outputs. Proven here, from source and attributes, never by running anything:

- the experts: the modules of one container the block's forward reads (``self.<name>`` in its forward or the
  methods it calls), a ``ModuleList``/``ModuleDict`` (a subclass with a forward of its own too), a child of the
  block or of a child module the block calls (``self.moe`` whose forward reads ``self.experts``), found by
  data flow, not by the name ``experts``; several such containers are ambiguous and refused;
- each expert row-local, deterministic and stateless (``autoep.detect.row_local``, through
  ``module_list_proof.row_local_facts``): heterogeneous experts are fine, each runs its own forward;
- the block's forward is its class's, undecorated, its ``__call__`` nn.Module's (the replay calls the class
  forward twice inside one call of the block).

``replay_facts(block, path)`` returns the ``MoeStructure`` facts or raises ``Refusal``.
"""
from __future__ import annotations

import torch.nn as nn

from autoep.detect import module_list_proof
from autoep.detect.loop_context import plain_method, self_reads
from autoep.detect.source import Refusal, function_tree


def members(container: nn.Module) -> list[nn.Module]:
    """The experts of a container: a ModuleDict's values in insertion order, a ModuleList's in index order."""
    return list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)


def _is_container(m) -> bool:
    return isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) > 0 and all(
        not isinstance(e, (nn.ModuleList, nn.ModuleDict)) for e in members(m))


def _reads(fns, attr: str) -> bool:
    return any(self_reads(function_tree(fn), attr) for fn in fns)


def find_container(block: nn.Module) -> str:
    """The path of the block's experts container (module docstring), or ``Refusal`` naming what was seen."""
    cls = type(block)
    forward_fns = [fn for fn, _, _ in module_list_proof.block_methods(block).values()]
    found = []
    for name, child in block._modules.items():
        if child is None or not _reads(forward_fns, name):
            continue
        if _is_container(child):
            found.append(name)
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) or type(child).forward is nn.Module.forward:
            continue
        try:
            child_forward = [plain_method(type(child), "forward", child)]
        except Refusal:
            continue
        found += [f"{name}.{sub}" for sub, grandchild in child._modules.items()
                  if _is_container(grandchild) and _reads(child_forward, sub)]
    if not found:
        raise Refusal(f"{cls.__name__}: no ModuleList/ModuleDict of expert modules that its forward (or a module it "
                      "calls) reads")
    if len(found) > 1:
        raise Refusal(f"{cls.__name__}.forward reads several module containers ({found}); which one holds the "
                      "experts is ambiguous")
    return found[0]


def replay_facts(block: nn.Module, path: str) -> dict:
    """The facts a replay structure records: the experts at ``path`` proven row-local (``expert_kind``,
    ``folded``), the block's forward fit to be run twice. ``Refusal`` otherwise."""
    cls = type(block)
    plain_method(cls, "forward", block)  # no instance forward, no decorator (it runs twice per call)
    if cls.__call__ is not nn.Module.__call__:
        raise Refusal(f"{cls.__name__} overrides __call__")
    if find_container(block) != path:
        raise Refusal(f"{cls.__name__}: its experts are not at {path!r}")
    container = block.get_submodule(path)
    return module_list_proof.row_local_facts(container, path, members(container))
