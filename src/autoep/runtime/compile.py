"""``torch.compile`` of the dense layers around the EP blocks (torchtitan compiles per decoder layer).

Each module that holds a planned block (a decoder layer) has its other children compiled in place
(``nn.Module.compile``: parameter names, ``state_dict`` keys, hooks and checkpoints stay the model's own):
attention, norms, and the dense MLP of a layer ``moe_only`` skipped. The planned blocks stay eager: their
exchange syncs the host for the split sizes and runs collectives on DTensor shards, which would break the
graph at every call. The layer's own forward (residual adds) stays eager too, as do modules outside any
layer (embeddings, the final norm, the LM head), so compiled and eager runs execute the same modules.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from autoep.errors import ConfigError


def compile_dense(model: nn.Module, planned: list[str], skipped: list[str] = (), *,
                  backend: str = "inductor") -> list[str]:
    """Compile, in place with ``backend``, every child of the layers holding ``planned`` blocks (or ``skipped``
    dense ones) that contains no planned block; returns the compiled module names."""
    layers = dict.fromkeys(name.rpartition(".")[0] for name in [*planned, *skipped])
    compiled = []
    for layer in layers:
        for child_name, child in model.get_submodule(layer).named_children():
            name = f"{layer}.{child_name}" if layer else child_name
            if any(p == name or p.startswith(name + ".") for p in planned):
                continue  # EP region: eager (module docstring)
            child.compile(backend=backend)
            compiled.append(name)
    return compiled


def check_backend(key: str, backend: str) -> None:
    """``backend`` is one ``torch.compile`` knows (``ConfigError`` naming ``key`` and the choices otherwise)."""
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ConfigError(f"{key}={backend}: not a torch.compile backend of torch {torch.__version__}; pick one of "
                          f"{known} (inductor: fused kernels, needs a C++ compiler on CPU; aot_eager: compiles fast, "
                          f"fuses nothing)")
