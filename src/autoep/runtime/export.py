"""The trained model as a directory ``from_pretrained`` loads (``trainer.export_hf=true``, ``ExpertParallel.export_hf``).

The directory gets the model's ``config.json`` and one ``model.safetensors`` with every parameter and
persistent buffer under the model's own names and in its own layout: batched experts as the model stores
them (``mlp.experts.gate_up_proj``), experts a ``module_list`` recipe stacked back in the model's
``experts.{e}.{proj}.weight`` form, tied parameters once. ``AutoModelForCausalLM.from_pretrained(dir)``
loads it to the same logits (tests/train/test_train.py), and so does ``model=hf_pretrained
model.pretrained_path=<run_dir>/hf``.

Expert shards (and FSDP2 dense shards) are gathered: a collective, every rank calls ``export_hf``; rank 0
holds the full state (its host memory must fit the model) and writes it (write-then-rename).
"""
from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

log = logging.getLogger("autoep.export")


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and persistent buffer, full, on CPU, in the model's own layout; tied ones once.
    A collective over the expert (and FSDP2) meshes: every rank calls it, in the same order."""
    from autoep.runtime.recipes.local_experts import full_state_dict_of_experts

    first_name: dict[int, str] = {}
    tied = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first_name:
            tied.add(name)
        first_name.setdefault(id(p), name)
    state = {}
    for name, value in full_state_dict_of_experts(model).items():
        if name in tied:
            continue
        if isinstance(value, DTensor):
            value = value.full_tensor()  # NOTE: collective (all-gather over the tensor's mesh)
        state[name] = value.detach().to("cpu").contiguous()
    return state


def export_hf(model: nn.Module, out) -> Path:
    """Write ``out`` (config.json + model.safetensors) from rank 0; a collective. Returns ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    state = full_state_dict(model)
    if dist.is_initialized() and dist.get_rank() != 0:
        return out
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = copy.deepcopy(model.config)
        config.architectures = [type(model).__name__]
        config.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)  # NOTE: the hf/ name appears only once both files are whole
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(t.numel() * t.element_size() for t in state.values())
    log.info("exported %d tensors (%.2f MiB) to %s: AutoModelForCausalLM.from_pretrained(%r) loads it",
             len(state), size / 2**20, out, str(out))
    return out
