"""Model builders that Hydra ``model/`` configs name as ``_target_``.

``build_hf_causal_lm(config_class="transformers.Qwen3MoeConfig", hidden_size=32, ...)`` builds a
transformers causal LM from its own config class. Under ``with torch.device("meta"):`` (how
``autoep-plan`` calls it) no weights are allocated.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect

from autoep.errors import ConfigError
from autoep.targets import import_object, moved_to

# What a model's constructor or first forward raises when its config values do not fit together (sizes that
# must divide, a zero count, an unknown option): reported as a config error, in one line.
MODEL_CONFIG_ERRORS = (ValueError, TypeError, OSError, KeyError, IndexError, ArithmeticError, AssertionError)
# Sizes and counts of transformers MoE configs that must be positive (a 0 fails deep inside the model).
POSITIVE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "num_local_experts",
                  "n_routed_experts", "num_experts_per_tok")
# Config attributes transformers MoE configs use for the routed experts per token.
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "moe_k", "num_selected_experts")


def config_kwarg_names(config_cls) -> set[str]:
    """The keyword arguments a transformers config class really knows (it silently keeps unknown ones)."""
    names = set(inspect.signature(config_cls.__init__).parameters) - {"self", "kwargs"}
    if dataclasses.is_dataclass(config_cls):
        names |= {f.name for f in dataclasses.fields(config_cls)}
    return names


def check_config_kwargs(config_class: str, config_kwargs: dict) -> None:
    """Raise ``TypeError`` naming every key ``config_class`` does not define (a typo would be ignored)."""
    known = config_kwarg_names(import_object(config_class))
    unknown = sorted(set(config_kwargs) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f"; did you mean model.{close[0]}?" if close else "; check the spelling in the model config"
        raise TypeError(f"{config_class} has no field(s) {unknown}{hint}")


def check_model_config(cfg) -> dict:
    """``cfg.model`` checked without building anything: set, a ``_target_`` that imports, every key binding
    to it (and, for ``build_hf_causal_lm``, known to its transformers config class), no ``???`` left.
    Returns the keyword arguments; raises ``ConfigError`` naming the key, the value and the fix."""
    from omegaconf import DictConfig, OmegaConf

    if OmegaConf.is_missing(cfg, "model") or cfg.model is None:
        raise ConfigError("model is not set; pick a model config, e.g. model=qwen3_moe (conf/model/*.yaml)")
    model_cfg = cfg.model
    if not isinstance(model_cfg, (DictConfig, dict)) or "_target_" not in model_cfg:
        raise ConfigError(f"model={model_cfg!r} needs a _target_: the function or class that builds the "
                          f"nn.Module, e.g. model._target_=autoep.train.models.build_hf_causal_lm")
    for key in model_cfg.keys():
        if isinstance(model_cfg, DictConfig) and OmegaConf.is_missing(model_cfg, key):
            raise ConfigError(f"model.{key} is required by this model config (it is ???); pass model.{key}=<value>")
    plain = OmegaConf.to_container(model_cfg, resolve=True) if isinstance(model_cfg, DictConfig) else dict(model_cfg)
    target = plain.pop("_target_")
    kwargs = {k: v for k, v in plain.items() if not (k.startswith("_") and k.endswith("_"))}
    new = moved_to(target)
    if new is not None:
        raise ConfigError(f"model._target_={target}: autoep's modules moved into packages and this path is gone; "
                          f"write model._target_={new} (a resolved.yaml written before the move: regenerate it "
                          f"with autoep-plan)")
    try:
        builder = import_object(target)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"model._target_={target}: cannot be imported ({e}); check the spelling and that its "
                          f"package is installed") from None
    _check_binds(builder, target, kwargs)
    if builder is build_hf_causal_lm:
        config_kwargs = {k: v for k, v in kwargs.items() if k not in ("config_class", "dtype")}
        for key in POSITIVE_SIZES:
            value = config_kwargs.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value < 1:
                raise ConfigError(f"model.{key}={value}: must be a positive integer; e.g. model.{key}=8")
        try:
            check_config_kwargs(kwargs.get("config_class", ""), config_kwargs)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"model.config_class={kwargs.get('config_class')}: cannot be imported ({e}); name a "
                              f"transformers config class, e.g. transformers.Qwen3MoeConfig") from None
        except TypeError as e:
            raise ConfigError(f"model: {e}") from None
    return kwargs


def _check_binds(builder, target: str, kwargs: dict) -> None:
    try:
        params = inspect.signature(builder).parameters
    except (TypeError, ValueError):
        return  # a builtin or C callable: its own call will say what it takes
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(params), n=1)
        hint = f"did you mean model.{close[0]}?" if close else f"it takes {', '.join(params)}"
        raise ConfigError(f"model.{unknown[0]}: {target} takes no argument {unknown[0]}; {hint}")
    missing = [n for n, p in params.items() if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and n not in kwargs]
    if missing:
        raise ConfigError(f"model.{missing[0]} is required by {target}; pass model.{missing[0]}=<value>")


def instantiate_model(model_cfg):
    """``hydra.utils.instantiate(model_cfg)`` (under the caller's device context); a builder that refuses its
    values (``MODEL_CONFIG_ERRORS``) is a ``ConfigError`` naming the target, anything else propagates as the
    builder raised it."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(model_cfg)
    except InstantiationException as e:
        cause = e.__cause__ or e
        if isinstance(cause, ConfigError):
            raise cause from None
        if isinstance(cause, MODEL_CONFIG_ERRORS):
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
            raise ConfigError(f"model (_target_={model_cfg.get('_target_')}) refused its config: "
                              f"{type(cause).__name__}: {first}; fix the model.* values") from None
        raise cause from None


def check_top_k(model, plan) -> None:
    """Routed experts per token (``model.num_experts_per_tok`` and its spellings) fit the expert count of
    every planned block; else top-k would fail inside the first forward."""
    config = getattr(model, "config", None)
    for entry in plan:
        n = entry.decision.num_experts
        for key in TOP_K_KEYS if n else ():
            k = getattr(config, key, None)
            if isinstance(k, int) and not isinstance(k, bool) and k > n:
                raise ConfigError(f"model.{key}={k} exceeds the {n} experts of {entry.decision.modules[0]}; "
                                  f"pick model.{key} <= {n}")


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
    ``apply_plan`` (``autoep.train.pretrained``): ``autoep-train model=hf_pretrained model.pretrained_path=/ckpt``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from autoep.train.pretrained import PretrainedError, local_checkpoint_dir

    path = local_checkpoint_dir(pretrained_path)
    try:  # NOTE: local_files_only: a directory that exists is read, nothing is ever looked up on the Hub
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PretrainedError(f"model.pretrained_path={pretrained_path}: its config.json cannot be read as a "
                              f"transformers config ({first}); give a directory written by save_pretrained") from None
    for key, value in config_overrides.items():  # from_pretrained would keep a misspelt key without a word
        if not hasattr(config, key):
            close = difflib.get_close_matches(key, sorted(config.to_dict()), n=1)
            hint = f"did you mean model.{close[0]}?" if close else "check the spelling"
            raise ConfigError(f"model.{key}: {type(config).__name__} (from {path}/config.json) has no field {key}; {hint}")
        setattr(config, key, value)
    extra = {"dtype": dtype} if dtype is not None else {}
    try:
        return AutoModelForCausalLM.from_config(config, **extra)
    except ValueError as e:
        first = str(e).strip().splitlines()[0]
        raise PretrainedError(f"model.pretrained_path={pretrained_path}: {type(config).__name__} has no causal LM "
                              f"class ({first}); autoep trains causal LMs") from None
