"""Load a local HF safetensors checkpoint into an EP-ready model: every rank reads only its own experts.

The trainer's flow for ``model.pretrained_path=<dir>`` (``autoep.train.trainer.build_model``)::

    with parameters_on_meta(): model = instantiate(cfg.model)   # params on meta, buffers computed for real
    resolve_plan -> apply_plan(model, ...)                       # expert params: meta Shard(0) DTensors
    load_pretrained(model, dir, device)                          # allocate, then read slices from disk

What is read from where:
  - a parameter whose name is a checkpoint key: dense ones in full; an expert ``Shard(0)`` DTensor
    only its rows, with ``safe_open(...).get_slice(key)[start:stop]`` (rows = this rank's experts).
  - a batched expert parameter (``...experts.gate_up_proj`` (E, 2F, D), ``...experts.down_proj``) stored
    per expert. transformers 5.x ``save_pretrained`` writes MoE experts in the legacy per-expert layout
    (``mlp.experts.{e}.gate_proj.weight``; Mixtral ``block_sparse_moe.experts.{e}.w1.weight``) and
    converts on load with the model's conversion mapping (``transformers.conversion_mapping``). Here the
    same mapping is read, not run: its renamings are applied to the keys, and each converter made of
    ``MergeModulelist(dim=0)`` [+ ``Concatenate(dim=d)``] becomes "stack these per-expert keys for my
    experts, then concatenate the parts on dim d". Any other converter that matches a key is refused.
  - ModuleList/ModuleDict experts (``module_list`` recipe) keep the model's own names: a rank reads its own
    experts' keys and never the others' (their parameters stay ``meta`` stand-ins; ``local_experts``).
  - non-persistent buffers (rotary ``inv_freq``) are in no checkpoint: ``parameters_on_meta`` lets the
    modules' own ``__init__`` compute them for real, and ``materialise`` keeps them.
  - tied parameters (``lm_head.weight`` is ``embed_tokens.weight``) stay one tensor, read once.

So the peak host memory of a rank is about dense + experts/ep (``bench/load_memory.py`` measures it).
Shape legend: E experts (global), F expert intermediate size, D hidden.
"""
from __future__ import annotations

import json
import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from autoep.errors import ConfigError
from autoep.runtime.recipes import local_tensor
from autoep.runtime.recipes.local_experts import expert_owners

log = logging.getLogger(__name__)
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


class PretrainedError(ConfigError):
    """The checkpoint directory cannot fill the model; the message names the key and the fix."""


def local_checkpoint_dir(path) -> Path:
    """``model.pretrained_path`` as an absolute local directory holding ``config.json`` (a relative path is
    taken from the working directory). Never a Hub lookup: a path that does not exist is an error."""
    if not isinstance(path, (str, Path)) or not str(path).strip():
        raise PretrainedError(f"model.pretrained_path={path!r} is not a path; give a local directory written by "
                              f"save_pretrained, e.g. model.pretrained_path=/ckpt/my-moe")
    given = Path(path).expanduser()
    local = given if given.is_absolute() else Path.cwd() / given
    if not local.is_dir():
        hub = ""
        if not given.is_absolute() and HUB_ID.fullmatch(str(path)):
            hub = (f"; it looks like a Hub repo id, and autoep reads local directories only (no download): fetch "
                   f"it first (huggingface-cli download {path} --local-dir /ckpt/{given.name}) and pass that directory")
        what = "is a file, not a directory" if local.exists() else "does not exist"
        raise PretrainedError(f"model.pretrained_path={path}: {local} {what}{hub or '; give a directory written by save_pretrained'}")
    if not (local / "config.json").is_file():
        raise PretrainedError(f"model.pretrained_path={path}: {local} holds no config.json; give a directory "
                              f"written by save_pretrained (config.json + *.safetensors)")
    return local.resolve()


@contextmanager
def parameters_on_meta():
    """Build modules with every parameter on ``meta`` and every buffer real.

    A parameter moves to meta as it is registered, before the module's own init runs on it, so no
    weight is initialised; buffers (rotary ``inv_freq``) keep the values their module computed.
    """
    register = nn.Module.register_parameter

    def to_meta(self, name, param):
        register(self, name, param)
        if param is not None and not param.is_meta:
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _remote_ids(model: nn.Module) -> set[int]:
    """Tensors of experts another ep rank owns (``meta`` stand-ins this rank never allocates)."""
    remote = {k for k, place in expert_owners(model).items() if not place.local}
    if not remote:
        return set()
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    return {id(tensors[k]) for k in remote if k in tensors}


def materialise(model: nn.Module, device) -> None:
    """Allocate every meta parameter (uninitialised) on ``device``, except the ``meta`` stand-ins of experts
    another ep rank owns; a parameter shared by several modules (tied embeddings) stays one tensor. Real
    buffers move to ``device`` with their values."""
    allocated: dict[int, nn.Parameter] = {}
    remote = _remote_ids(model)
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta and id(p) not in remote:
                if id(p) not in allocated:
                    allocated[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                module._parameters[name] = allocated[id(p)]
        for name, b in module._buffers.items():
            if b is not None and id(b) not in remote:
                module._buffers[name] = torch.empty_like(b, device=device) if b.is_meta else b.to(device)


# ---------------------------------------------------------------------------------------------
# The checkpoint directory
# ---------------------------------------------------------------------------------------------


class SafetensorsDir:
    """The tensors of a local checkpoint directory (``model.safetensors`` or a sharded index), read lazily."""

    def __init__(self, path):
        from safetensors import safe_open

        self.path = Path(path)
        fix = "give a directory written by save_pretrained (safetensors), e.g. model.pretrained_path=/ckpt/my-moe"
        if not self.path.is_dir():
            raise PretrainedError(f"model.pretrained_path={str(path)!r} is not a directory; {fix}")
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise PretrainedError(f"model.pretrained_path={str(path)}: model.safetensors.index.json is damaged "
                                      f"({type(e).__name__}: {e}); re-download or re-save the checkpoint") from None
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise PretrainedError(f"model.pretrained_path={str(path)!r} holds no *.safetensors files; {fix}")
        # NOTE: safe_open maps the file; nothing is read until get_tensor/get_slice.
        self.files = {f: self._open(safe_open, f) for f in files}
        self.file_of = {k: f for f, h in self.files.items() for k in h.keys()}
        self.tensors_read, self.bytes_read = 0, 0

    def _open(self, safe_open, name: str):
        file = self.path / name
        if not file.is_file():
            raise PretrainedError(f"model.pretrained_path={self.path}: {name} is listed in "
                                  f"model.safetensors.index.json but missing; re-download or re-save the checkpoint")
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PretrainedError(f"model.pretrained_path={self.path}: {name} is not a readable safetensors file "
                                  f"({first}): truncated or damaged; re-download or re-save the checkpoint") from None
        return handle  # NOTE: safe_open checks that the header's offsets cover the file: a cut file fails here

    def keys(self) -> list[str]:
        return list(self.file_of)

    def read(self, key: str, rows: slice | None = None) -> Tensor:
        """The tensor ``key``, or only its rows ``rows`` along dim 0 (the rest is never read)."""
        handle = self.files[self.file_of[key]]
        tensor = handle.get_tensor(key) if rows is None else handle.get_slice(key)[rows.start:rows.stop]
        self.tensors_read += 1
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


# ---------------------------------------------------------------------------------------------
# Where each model parameter comes from
# ---------------------------------------------------------------------------------------------


@dataclass
class PerExpert:
    """A batched expert parameter stored per expert: ``parts[i][e]`` is expert e's key of part i; each part
    is stacked over experts, then the parts are concatenated on ``concat_dim`` (gate | up)."""

    parts: list[dict[int, str]]
    concat_dim: int = 1

    def read_into(self, ckpt: SafetensorsDir, rows: slice, target_ELD: Tensor, name: str) -> None:
        """Copy experts ``rows`` into ``target`` (this rank's shard) one expert tensor at a time: the only
        temporary is one expert's tensor, never a stacked copy of the shard."""
        if target_ELD.shape[0] != rows.stop - rows.start:
            raise PretrainedError(f"{name}: {rows.stop - rows.start} experts to read, the shard holds {target_ELD.shape[0]}")
        # Every part (gate, up) fills an equal share along the concat dim of one expert's slot.
        part_shape = list(target_ELD.shape[1:])
        part_shape[self.concat_dim - 1] //= len(self.parts)  # per-expert tensors lack the expert dim
        offset = 0
        for part in self.parts:
            absent = [e for e in range(rows.start, rows.stop) if e not in part]
            if absent:
                raise PretrainedError(f"{name}: the checkpoint has no keys for experts {absent} "
                                      f"(found {sorted(part)[:8]}...); is it the same model?")
            for e in range(rows.start, rows.stop):
                expert = ckpt.read(part[e])
                if list(expert.shape) != part_shape:
                    raise PretrainedError(f"model.pretrained_path={ckpt.path}: {name}: checkpoint key {part[e]} has shape {tuple(expert.shape)}, the model "
                                          f"expects {tuple(part_shape)}; build the model from the checkpoint's config.json "
                                          f"(model=hf_pretrained)")
                target_ELD[e - rows.start].narrow(self.concat_dim - 1, offset, part_shape[self.concat_dim - 1]).copy_(expert)
            offset += part_shape[self.concat_dim - 1]


def _hf_conversions(model: nn.Module) -> tuple[list, list]:
    """(renamings, converters) transformers applies when loading ``model`` (empty for other models)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:
        return [], []
    if not isinstance(model, PreTrainedModel):
        return [], []
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return [t for t in transforms if not isinstance(t, WeightConverter)], converters


def _concat_dim(converter) -> int:
    """The concat dim of a ``MergeModulelist(dim=0)`` [+ ``Concatenate``] converter; anything else is refused."""
    ops = [type(op).__name__ for op in converter.operations]
    dims = [getattr(op, "dim", None) for op in converter.operations]
    if ops == ["MergeModulelist"] and dims == [0]:
        return 1
    if ops == ["MergeModulelist", "Concatenate"] and dims[0] == 0:
        return dims[1]
    raise PretrainedError(f"transformers converts {converter.source_patterns} -> {converter.target_patterns} with "
                          f"{converter.operations}; autoep's per-rank loader reads only MergeModulelist(dim=0) "
                          f"[+ Concatenate] conversions: convert the checkpoint to the model's own layout first "
                          f"(from_pretrained + save_pretrained of the converted state dict)")


def _expert_index(pattern: str, key: str) -> int:
    match = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    if match is None:
        raise PretrainedError(f"checkpoint key {key!r} matched {pattern!r} but its expert index cannot be read")
    return int(match.group(1))


def source_map(model: nn.Module, keys: list[str]) -> dict[str, str | PerExpert]:
    """``{model state name: checkpoint key, or PerExpert}`` for every checkpoint key the model can use."""
    renamings, converters = _hf_conversions(model)
    sources: dict[str, str | PerExpert] = {}
    for key in keys:
        renamed = key
        for renaming in renamings:
            renamed, _ = renaming.rename_source_key(renamed)
        for converter in converters:
            target, pattern = converter.rename_source_key(renamed)
            if pattern is not None:
                entry = sources.setdefault(target, PerExpert([{} for _ in converter.source_patterns],
                                                             _concat_dim(converter)))
                entry.parts[converter.source_patterns.index(pattern)][_expert_index(pattern, renamed)] = key
                break
        else:
            sources[renamed] = key
    return sources


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def expert_rows(param: Tensor) -> slice | None:
    """The rows (experts) of the global tensor this rank holds: the ``Shard(0)`` mesh dim's chunk; None if plain."""
    if not isinstance(param, DTensor):
        return None
    sharded = [i for i, p in enumerate(param.placements) if isinstance(p, Shard)]
    if len(sharded) != 1 or param.placements[sharded[0]] != Shard(0):
        raise PretrainedError(f"expert parameter placements {param.placements}; the loader reads Shard(0) over one mesh dim")
    size, coord = param.device_mesh.size(sharded[0]), param.device_mesh.get_local_rank(sharded[0])
    per_rank = param.shape[0] // size
    return slice(coord * per_rank, (coord + 1) * per_rank)


def _state_tensors(model: nn.Module):
    """(name, tensor) of every parameter and persistent buffer, each shared tensor once."""
    yield from model.named_parameters()
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buf


@torch.no_grad()
def load_pretrained(model: nn.Module, path, device) -> dict:
    """Allocate ``model``'s meta parameters on ``device`` and fill them from the safetensors in ``path``,
    each expert DTensor with only this rank's experts, and log what was read. Returns ``{"loaded", "unused"}``
    (model tensors filled, checkpoint entries left unused), ``tensors_read``/``bytes_read`` (what this rank
    read from disk) and ``experts`` (this rank's expert rows ``(start, stop)`` of ``num_experts``, or None)."""
    ckpt = SafetensorsDir(path)
    sources = source_map(model, ckpt.keys())
    materialise(model, device)
    missing, used, own, num_experts = [], 0, set(), None
    owners = expert_owners(model)
    for name, tensor in _state_tensors(model):
        place = owners.get(name)
        if place is not None and not place.local:
            continue  # another ep rank's expert: never read here
        source = sources.get(name)
        if source is None:
            missing.append(name)
            continue
        rows, target = expert_rows(tensor), local_tensor(tensor)
        if rows is not None:
            own.add((rows.start, rows.stop))
            num_experts = tensor.shape[0]
        if isinstance(source, PerExpert):
            source.read_into(ckpt, rows or slice(0, tensor.shape[0]), target, name)
            used += 1
            continue
        value = ckpt.read(source, rows)
        if tuple(value.shape) != tuple(target.shape):
            raise PretrainedError(f"model.pretrained_path={path}: {name}: the checkpoint holds shape {tuple(value.shape)} for this rank, the model "
                                  f"expects {tuple(target.shape)}; build the model from the checkpoint's config.json "
                                  f"(model=hf_pretrained)")
        target.copy_(value)
        used += 1
    if missing:
        raise PretrainedError(f"model.pretrained_path={str(path)!r} lacks {len(missing)} tensors the model has, "
                              f"e.g. {missing[:3]}; it was saved from another model, point it at a matching checkpoint")
    if owners and not own:  # module experts (module_list recipe): this rank's own ids, whole expert keys
        ids = sorted({p.expert for p in owners.values() if p.local})
        num_experts = 1 + max(p.expert for p in owners.values())
        own = {(ids[0], ids[-1] + 1)} if ids and len(ids) < num_experts else set()
    experts = sorted(own)[0] if len(own) == 1 else None
    log.info("loaded %d model tensors from %s: read %d checkpoint tensors, %.2f MiB%s", used, path, ckpt.tensors_read,
             ckpt.bytes_read / 2**20, f"; experts {experts[0]}-{experts[1] - 1} of {num_experts} (this rank's own)"
             if experts else "; every expert (no EP)")
    return {"loaded": used, "unused": len(sources) - used, "tensors_read": ckpt.tensors_read,
            "bytes_read": ckpt.bytes_read, "experts": experts}
