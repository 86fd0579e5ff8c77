"""Model builders that Hydra ``model/`` configs name as ``_target_``.

``build_hf_causal_lm(config_class="transformers.Qwen3MoeConfig", hidden_size=32, ...)`` builds a
transformers causal LM from its own config class. Under ``with torch.device("meta"):`` (how
``autoep-plan`` calls it) no weights are allocated.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect


def import_object(path: str):
    """``pkg.mod.Name`` -> the object; raises ImportError/AttributeError naming the path."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ImportError(f"{path!r} is not a dotted path like pkg.module.Name")
    return getattr(importlib.import_module(module_name), attr)


def config_kwarg_names(config_cls) -> set[str]:
    """The keyword arguments a transformers config class really knows (it silently keeps unknown ones)."""
    names = set(inspect.signature(config_cls.__init__).parameters) - {"self", "kwargs"}
    if dataclasses.is_dataclass(config_cls):
        names |= {f.name for f in dataclasses.fields(config_cls)}
    return names


def check_config_kwargs(config_class: str, config_kwargs: dict) -> None:
    """Raise ``TypeError`` naming every key ``config_class`` does not define (a typo would be ignored)."""
    unknown = sorted(set(config_kwargs) - config_kwarg_names(import_object(config_class)))
    if unknown:
        raise TypeError(f"{config_class} has no field(s) {unknown}; check the spelling in the model config")


def build_hf_causal_lm(config_class: str, dtype: str | None = None, **config_kwargs):
    """``AutoModelForCausalLM.from_config(config_class(**config_kwargs))``; unknown keys are an error."""
    from transformers import AutoModelForCausalLM

    check_config_kwargs(config_class, config_kwargs)
    config = import_object(config_class)(**config_kwargs)
    extra = {"dtype": dtype} if dtype is not None else {}
    return AutoModelForCausalLM.from_config(config, **extra)


def build_hf_pretrained(pretrained_path: str, dtype: str | None = None, **config_overrides):
    """The architecture of the local HF checkpoint ``pretrained_path`` (its ``config.json``), weights not loaded.

    The trainer reads the same ``model.pretrained_path`` and loads the weights per rank after
    ``apply_plan`` (``autoep.pretrained``): ``autoep-train model=hf_pretrained model.pretrained_path=/ckpt``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(pretrained_path, **config_overrides)
    extra = {"dtype": dtype} if dtype is not None else {}
    return AutoModelForCausalLM.from_config(config, **extra)
