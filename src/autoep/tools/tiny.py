"""Building any transformers MoE family without downloading anything: one block class on the meta
device at the config's own sizes, or a tiny CPU block or whole causal LM with real tensors for parity.

Used by ``autoep.tools.coverage`` (the detection table) and the parity suite (tests/runtime/test_parity_hf.py).
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import warnings

import torch
import torch.nn as nn

from autoep.detect.structure import MoeStructure, detect_moe_structure
from autoep.errors import UnsupportedModuleStructure


def family_configs(package) -> list[type]:
    from transformers import PretrainedConfig

    out = []
    for sub in pkgutil.iter_modules(package.__path__):
        if sub.name.startswith("configuration_"):
            try:
                mod = importlib.import_module(f"{package.__name__}.{sub.name}")
            except Exception:  # noqa: BLE001
                continue
            out += [c for c in vars(mod).values() if isinstance(c, type) and issubclass(c, PretrainedConfig)
                    and c.__module__ == mod.__name__]
    return out


def _layer_configs(config):
    """Per-layer views of a heterogeneous config (transformers' ``per_layer_config``), first MoE layers."""
    view = getattr(config, "per_layer_config", None)
    if view is None:
        return
    try:
        layers = [view[i] for i in range(min(int(config.num_hidden_layers), 4))]
    except Exception:  # noqa: BLE001 - a view this code does not understand: no per-layer candidates
        return
    yield from layers


def _candidate_configs(configs: list[type]):
    """Every config a block of the family might take: each config class's default, its nested
    sub-configs (text, language, thinker, talker), and their per-layer views."""
    for config_cls in configs:
        try:
            config = config_cls()
        except Exception:  # noqa: BLE001
            continue
        nested = [config]
        for attr in ("text_config", "language_config", "llm_config", "thinker_config", "talker_config"):
            sub = getattr(config, attr, None)
            if sub is not None and hasattr(sub, "to_dict"):
                nested.append(sub)
                if getattr(sub, "text_config", None) is not None:
                    nested.append(sub.text_config)
        for cfg in nested:
            _checkpoint_keys(cfg)
            _moe_on(cfg)
            yield cfg
            yield from _layer_configs(cfg)


# Keys a block reads that its config class does not define, so only a checkpoint's config.json sets them
# (Qwen3-Omni's talker text config has no shared-expert width, yet its MoE block reads one): set where
# absent, sized like the routed experts, so the class can be built here at all.
CHECKPOINT_ONLY_KEYS = {"Qwen3OmniMoeTalkerTextConfig": ("shared_expert_intermediate_size",)}


def _checkpoint_keys(config) -> None:
    for key in CHECKPOINT_ONLY_KEYS.get(type(config).__name__, ()):
        if not hasattr(config, key):
            setattr(config, key, getattr(config, "moe_intermediate_size", None) or config.intermediate_size)


# Switches that turn a dense-by-default config's MoE on (only keys the config holds as False are set): Gemma-4's
# decoder layer builds its router and experts only with ``enable_moe_block``.
MOE_SWITCHES = {"enable_moe_block": True}
# Full (meta) sizes for the MoE keys such a config leaves None (only where a switch above was turned on): those
# of a released fine-grained MoE (128 experts, top-8, each expert a quarter of the dense MLP's width).
FULL_MOE = {"num_experts": 128, "top_k_experts": 8, "num_experts_per_tok": 8, "moe_intermediate_size": 0.25}


def _moe_on(config) -> None:
    switched = [k for k, v in MOE_SWITCHES.items() if getattr(config, k, None) is False]
    if not switched:
        return
    for key in switched:
        setattr(config, key, MOE_SWITCHES[key])
    for key, value in FULL_MOE.items():
        if hasattr(config, key) and getattr(config, key) is None:
            setattr(config, key, value if isinstance(value, int) else max(1, int(config.intermediate_size * value)))


# Sizes that make any transformers MoE config tiny (only keys the config already has are set).
TINY = {
    "hidden_size": 32, "intermediate_size": 32, "moe_intermediate_size": 16, "expert_intermediate_size": 16,
    "shared_expert_intermediate_size": 16, "shared_intermediate_size": 16, "ffn_hidden_size": 32,
    "moe_ffn_hidden_size": 16, "num_experts": 8, "n_routed_experts": 8, "num_local_experts": 8,
    "moe_num_experts": 8, "num_routed_experts": 8, "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2,
    "moe_k": 2, "moe_top_k": 2, "num_selected_experts": 2, "top_k_experts": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
    "num_shared_experts": 1, "moe_num_shared_experts": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "vocab_size": 128, "num_hidden_layers": 2,
    "moe_hidden_size": 24,  # MuseSpark's experts' own width (projected to and from hidden_size around them)
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 128,  # Gemma-4's per-layer input embeddings
    "part_features": 8,  # VitPose's experts' output width (a slice of hidden_size; its default 256 exceeds it)
}
# Keys a config may leave None when their layers are switched off by default (indexers): set for the tiny model.
NONE_PER_LAYER = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
# Keys a config may leave None when its default is dense; a tiny build switches them on.
MAY_BE_NONE = ("num_experts_per_tok", "top_k_experts", "n_group", "topk_group", "n_routed_experts", "num_experts",
               "num_local_experts", "moe_intermediate_size", "intermediate_size", "n_shared_experts")


# Sub-configs that hold one part of every layer (DBRX's attention and FFN configs): shrunk with their parent.
LAYER_SUB_CONFIGS = ("attn_config", "ffn_config")


def _shrink(config) -> None:
    layers = getattr(config, "num_hidden_layers", None)
    for key, value in TINY.items():
        cur = getattr(config, key, "absent")
        if (isinstance(cur, int) and not isinstance(cur, bool)) or (cur is None and key in MAY_BE_NONE):
            setattr(config, key, value)
    n = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and n != layers:  # per-layer kinds follow the layer count (Gemma-4 checks them)
        for key, value in list(vars(config).items()):
            if key.endswith("_types") and isinstance(value, list) and len(value) == layers:
                setattr(config, key, _layer_kinds(value, n))
    for key in LAYER_SUB_CONFIGS:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            _shrink(sub)


def build_block(cls: type, configs: list[type], *, tiny: bool = False):
    """``(block, config)``: ``cls`` built from the first of its family's configs that fits.

    Default: on the meta device (nothing allocated), the config's own (full) sizes, or when no default
    config fits, the config shrunk by ``TINY``. ``tiny``: shrunk by ``TINY`` and built on CPU with real
    tensors (for parity tests). Raises RuntimeError naming the last failure when no config fits.
    """
    if not tiny:
        try:
            return _build(cls, configs, shrink=False, device="meta")
        except RuntimeError:
            pass  # e.g. a dense-by-default config: its MoE sizes are None until shrunk
    return _build(cls, configs, shrink=True, device="cpu" if tiny else "meta")


def _build(cls: type, configs: list[type], *, shrink: bool, device: str):
    last = None
    required = [
        p.name
        for p in list(inspect.signature(cls.__init__).parameters.values())[2:]
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    for config in _candidate_configs(configs):
        try:
            if shrink:
                _shrink(config)
            # Extra required arguments: a layer index, or a size the family's config also carries.
            extra = {n: 0 if n == "layer_idx" else getattr(config, n, getattr(config, "intermediate_size", 64))
                     for n in required}
        except Exception as exc:  # noqa: BLE001 - e.g. a per-layer attribute read globally: next config
            last = exc
            continue
        for kwargs in (extra, {**extra, "layer_idx": 0}):
            try:
                with torch.device(device), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    torch.manual_seed(0)
                    return cls(config, **kwargs), config
            except Exception as exc:  # noqa: BLE001 - try the next config shape
                last = exc
    raise RuntimeError(f"could not build from {[c.__name__ for c in configs]}: {type(last).__name__}: {last}")


# Switches that make every layer of a tiny model MoE (only keys the config already has are set).
ALL_LAYERS_MOE = {
    "first_k_dense_replace": 0, "num_dense_layers": 0, "moe_layer_start_index": 0, "moe_layer_end_index": 1,
    "decoder_sparse_step": 1, "moe_layer_freq": 1, "moe_layer_interval": 1, "mlp_only_layers": [], **MOE_SWITCHES,
}
# Attention sizes of the tiny model (MLA ranks, indexers) that TINY's block-level keys do not cover.
TINY_ATTENTION = {
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "index_head_dim": 8, "index_n_heads": 2, "index_topk": 4, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "index_kpool": 2,
    "linear_head_dim": 8, "linear_num_heads": 4,
    "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 4,
    "indexer_compress_ratio": 2, "num_sliding_attention_heads": 4, "mamba_n_heads": 4, "mamba_d_state": 8,
    "num_expert_group": 2, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 1,
    "expert_layer_offset": 0,
}
# Sizes a family ties together in ways no generic rule above keeps (checked by its config's validator).
FAMILY_TINY = {
    "dots3_note": {"head_dim": 16},  # SWA head_dim = qk_nope_head_dim + qk_rope_head_dim
    "lfm2_moe": {"layer_types": ["full_attention", "conv"]},  # its default layer_types is None
    # Sizes live in the attention and FFN sub-configs (F != D, so a transposed weight cannot pass). Its
    # attention reads attn_config.rope_theta, which the config class lacks, and clamps by clip_qkv, which
    # fails at its default None: both are set.
    "dbrx": {"d_model": 32, "n_heads": 4, "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 16, "moe_num_experts": 8, "moe_top_k": 2}},
}
MODEL_SUFFIXES = ("ForCausalLM", "TextModel", "Model")  # preference order of the family's own classes


def build_tiny_model(family: str):
    """``(model, config)``: the family's text causal LM (or, where it has none, its text base model)
    from its own config class shrunk by ``TINY`` to 2 layers, every layer MoE, on CPU with real tensors.
    Raises RuntimeError naming the last failure when no class of the family builds to a model with a
    block the detector accepts."""
    tried = []
    for cls in _model_classes(family):
        try:
            config = _tiny_model_config(cls, FAMILY_TINY.get(family, {}))
            if getattr(config, "is_encoder_decoder", False):
                # NLLB-MoE: its decoder needs inputs the whole-model harness (input_ids only) does not give
                raise RuntimeError("an encoder-decoder; the whole-model harness feeds input_ids only")
            with torch.device("cpu"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.manual_seed(0)
                model = cls(config)
        except Exception as exc:  # noqa: BLE001 - the next candidate class
            tried.append(f"{cls.__name__}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            continue
        if moe_blocks(model):
            return model, config
        tried.append(f"{cls.__name__} has no block the detector accepts")
    raise RuntimeError("; ".join(tried) or "no causal LM or text model class")


def _model_classes(family: str) -> list[type]:
    """The family's text-only model classes: causal LMs (transformers' auto mapping first, then any
    ``*ForCausalLM`` of its modeling module), then text base models."""
    from transformers import PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    package = importlib.import_module(f"transformers.models.{family}")
    found: list[type] = []
    for sub in pkgutil.iter_modules(package.__path__):
        if sub.name.startswith("modeling_"):
            mod = importlib.import_module(f"{package.__name__}.{sub.name}")
            found += [c for c in vars(mod).values() if isinstance(c, type) and issubclass(c, PreTrainedModel)
                      and c.__module__ == mod.__name__ and _text_only(getattr(c, "config_class", None))]
    mapped = {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(c.config_class.model_type) for c in found}
    ranked = sorted(found, key=lambda c: (c.__name__ not in mapped, _suffix_rank(c.__name__), c.__name__))
    return [c for c in ranked if _suffix_rank(c.__name__) < len(MODEL_SUFFIXES) and "PreTrained" not in c.__name__]


def _suffix_rank(name: str) -> int:
    return next((i for i, s in enumerate(MODEL_SUFFIXES) if name.endswith(s)), len(MODEL_SUFFIXES))


def _text_only(config_cls) -> bool:
    if config_cls is None or not isinstance(config_cls, type):
        return False
    sub = set(getattr(config_cls, "sub_configs", None) or {}) - set(LAYER_SUB_CONFIGS)
    return not sub and "vision" not in config_cls.__name__.lower() and "audio" not in config_cls.__name__.lower()


def _tiny_model_config(model_cls: type, overrides: dict):
    """``config_cls`` rebuilt with tiny sizes, 2 layers, every layer MoE; per-layer lists cut to 2 layers
    (attention kinds: the first two distinct ones, so a hybrid model keeps both)."""
    config_cls = model_cls.config_class
    default = config_cls().to_dict()  # plain values: a per-layer config's getattr may refuse global reads
    kwargs = {}
    for key, value in {**TINY, **TINY_ATTENTION}.items():
        cur = default.get(key, "absent")
        if isinstance(cur, int) and not isinstance(cur, bool) and cur == 0:
            continue  # a size of 0 switches a part off (glm5_next's NoPE attention): keep it off
        if (isinstance(cur, int) and not isinstance(cur, bool)) or (cur is None and key in MAY_BE_NONE + NONE_PER_LAYER):
            kwargs[key] = value
        elif isinstance(cur, list) and cur and all(isinstance(v, int) for v in cur):
            kwargs[key] = [value] * len(cur)  # one size per modality (ernie's text and vision experts)
    kwargs.update({k: v for k, v in ALL_LAYERS_MOE.items() if k in default})
    kwargs.update(_tiny_relations(default, kwargs))
    n = kwargs["num_hidden_layers"] = 2
    for key, value in default.items():
        if isinstance(value, list) and len(value) == default["num_hidden_layers"] and key.endswith("_types"):
            kwargs[key] = _layer_kinds(value, n, moe=key == "mlp_layer_types")
    if default.get("per_layer_config"):
        kwargs["per_layer_config"] = {}  # one tiny shape for every layer
    if "mlp_layer_types" in default and default["mlp_layer_types"] is None:
        kwargs["mlp_layer_types"] = ["sparse"] * n
    if default.get("sliding_window", 0) is None:
        kwargs["sliding_window"] = 4
    kwargs["use_cache"] = False  # training: no cache (hybrid caches refuse a model without attention layers)
    kwargs.update(overrides)
    if "mrope_section" in inspect.getsource(inspect.getmodule(model_cls)):
        kwargs["rope_parameters"] = _tiny_mrope(default, {**kwargs, **overrides})
    return config_cls(**kwargs)


def _layer_kinds(kinds: list, n: int, moe: bool = False) -> list:
    """A per-layer list of kinds (attention, MLP) cut to ``n`` layers, keeping its first ``n`` distinct kinds
    in order (a hybrid model keeps both; layer 0 keeps its kind); ``moe``: dense MLP kinds left out."""
    distinct = list(dict.fromkeys(kinds))
    if moe:
        distinct = [k for k in distinct if "dense" not in str(k)] or distinct
    return (distinct * n)[:n]


def _tiny_mrope(default: dict, tiny: dict) -> dict:
    """Multimodal rope: (time, height, width) sections that fill the tiny rotary half-dim."""
    rope = dict(default.get("rope_parameters") or {})
    rotary = tiny.get("qk_rope_head_dim") or int(tiny.get("head_dim", 8) * rope.get("partial_rotary_factor", 1.0))
    half = rotary // 2
    rope["mrope_section"] = [1, 1, half - 2]
    return rope


def _tiny_relations(default: dict, tiny: dict) -> dict:
    """Sizes the family ties together, kept tied: MHA stays MHA (MLA needs it), an MLA ``head_dim`` stays
    the rope part or the whole query-key head."""
    out = {}
    if default.get("num_key_value_heads") == default.get("num_attention_heads") and "num_key_value_heads" in tiny:
        out["num_key_value_heads"] = tiny["num_attention_heads"]
    for i, key in enumerate(("pad_token_id", "bos_token_id", "eos_token_id")):  # inside the tiny vocab
        if isinstance(default.get(key), (int, list)) and "vocab_size" in tiny:
            out[key] = i
    rope, nope = default.get("qk_rope_head_dim"), default.get("qk_nope_head_dim")
    if "head_dim" in tiny and rope and nope and default.get("head_dim") == rope + nope:
        out["head_dim"] = tiny["qk_rope_head_dim"] + tiny["qk_nope_head_dim"]
    return out


def moe_blocks(model: nn.Module) -> dict[str, MoeStructure]:
    """Every outermost module with ``experts`` the detector accepts, by name."""
    found: dict[str, MoeStructure] = {}
    for name, module in model.named_modules():
        if not hasattr(module, "experts") or any(name.startswith(f"{n}.") for n in found):
            continue
        try:
            found[name] = detect_moe_structure(module)
        except UnsupportedModuleStructure:
            continue
    return found
