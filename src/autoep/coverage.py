"""Detection coverage over every MoE block class of the installed transformers.

    python -m autoep.coverage            # print the markdown table
    python -m autoep.coverage --write docs/coverage.md

Walks every ``modeling_*.py`` of ``transformers.models``, takes each ``nn.Module`` class whose
``__init__`` assigns ``self.experts``, builds it on the meta device from its own family's config
class (defaults, never downloaded), and runs ``detect_moe_structure``.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import re
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from autoep.errors import UnsupportedModuleStructure
from autoep.structure import MoeStructure, detect_moe_structure

ASSIGNS_EXPERTS = re.compile(r"self\.experts\s*(:[^=]*)?=")


@dataclass
class Row:
    family: str
    cls: str
    structure: MoeStructure | None = None
    reason: str = ""  # the refusal, or why the class could not be built
    module: str = ""  # import path of the class's module
    configs: list[str] = field(default_factory=list)  # import paths of the family's config classes
    untested: str = ""  # accepted but not parity-tested: why

    @property
    def decision(self) -> str:
        if self.structure is None:
            return ""
        s = self.structure
        return f"{s.router}, {s.shared_experts}, {s.expert_storage}, jitter={s.jitter}"


def moe_block_classes():
    """(family, class, config classes of the family) for every class whose __init__ assigns self.experts."""
    import transformers.models as models

    for info in pkgutil.iter_modules(models.__path__):
        try:
            package = importlib.import_module(f"transformers.models.{info.name}")
        except Exception:  # noqa: BLE001 - optional backends of unrelated families
            continue
        for sub in pkgutil.iter_modules(package.__path__):
            if not sub.name.startswith("modeling_"):
                continue
            try:
                mod = importlib.import_module(f"{package.__name__}.{sub.name}")
            except Exception:  # noqa: BLE001
                continue
            configs = _family_configs(package)
            for cls in vars(mod).values():
                if isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == mod.__name__:
                    try:
                        init_src = inspect.getsource(cls.__init__)
                    except (OSError, TypeError):
                        continue
                    if ASSIGNS_EXPERTS.search(init_src):
                        yield info.name, cls, configs


def _family_configs(package) -> list[type]:
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
            yield cfg
            yield from _layer_configs(cfg)


# Sizes that make any transformers MoE config tiny (only keys the config already has are set).
TINY = {
    "hidden_size": 32, "intermediate_size": 32, "moe_intermediate_size": 16, "expert_intermediate_size": 16,
    "shared_expert_intermediate_size": 16, "shared_intermediate_size": 16, "ffn_hidden_size": 32,
    "moe_ffn_hidden_size": 16, "num_experts": 8, "n_routed_experts": 8, "num_local_experts": 8,
    "moe_num_experts": 8, "num_routed_experts": 8, "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2,
    "moe_k": 2, "num_selected_experts": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
    "num_shared_experts": 1, "moe_num_shared_experts": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "vocab_size": 128, "num_hidden_layers": 2,
}
# Keys a config may leave None when its default is dense; a tiny build switches them on.
MAY_BE_NONE = ("num_experts_per_tok", "n_group", "topk_group", "n_routed_experts", "num_experts",
               "num_local_experts", "moe_intermediate_size", "intermediate_size", "n_shared_experts")


def _shrink(config) -> None:
    for key, value in TINY.items():
        cur = getattr(config, key, "absent")
        if (isinstance(cur, int) and not isinstance(cur, bool)) or (cur is None and key in MAY_BE_NONE):
            setattr(config, key, value)


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


def shipped_model_families() -> list[str]:
    """Families with a tiny whole-model config in conf/model (each gets whole-model parity)."""
    from pathlib import Path

    folder = Path(__file__).resolve().parent / "conf" / "model"
    return sorted(p.stem for p in folder.glob("*.yaml") if "config_class:" in p.read_text())


def parity_classes(rows: list["Row"]) -> list["Row"]:
    """The accepted rows the parity suite runs: every one whose tiny CPU build is accepted too."""
    return [r for r in rows if r.structure is not None and not r.untested]


def _tiny_mismatch(cls: type, configs: list[type]) -> str:
    """Why the parity suite cannot run this accepted class ("" when it can): its tiny CPU build must
    be accepted too (tiny configs may switch a shared branch on; that variant is what gets tested)."""
    try:
        block, _ = build_block(cls, configs, tiny=True)
        detect_moe_structure(block)
    except (RuntimeError, UnsupportedModuleStructure) as exc:
        return f"no tiny build: {str(exc)[:120]}"
    return ""


def survey(tiny: bool = True) -> list[Row]:
    """Every MoE block class, its decision on meta, and (``tiny``) whether its tiny CPU build can be parity-tested."""
    rows = []
    for family, cls, configs in moe_block_classes():
        row = Row(family, cls.__name__)
        row.module, row.configs = cls.__module__, [f"{c.__module__}.{c.__name__}" for c in configs]
        try:
            module, _ = build_block(cls, configs)
        except RuntimeError as exc:
            row.reason = f"not built: {str(exc)[:160]}"
            rows.append(row)
            continue
        try:
            row.structure = detect_moe_structure(module)
        except UnsupportedModuleStructure as exc:
            row.reason = exc.reason
        if row.structure is not None and tiny:
            row.untested = _tiny_mismatch(cls, configs)
        rows.append(row)
    return sorted(rows, key=lambda r: (r.family, r.cls))


def markdown(rows: list[Row]) -> str:
    import transformers

    accepted = sum(r.structure is not None for r in rows)
    lines = [
        "# Detection coverage",
        "",
        f"transformers {transformers.__version__}: {len(rows)} classes assign `self.experts`; "
        f"{accepted} accepted, {len(rows) - accepted} refused. Generated by `python -m autoep.coverage`.",
        "",
        "Parity (outputs, input grads, router/shared grads summed over ranks, expert grads gathered; fp32,",
        "default `assert_close`) is asserted in CI by `tests/test_parity_hf.py` on 2 and 4 gloo ranks with",
        "uneven tokens per rank: *block* for every accepted class built tiny from its own config, *model*",
        "(loss and every parameter gradient of a 2-layer causal LM) for the families with a config in",
        "`conf/model/`. Refused classes run nothing.",
        "",
        "| family | class | decision (router, shared, storage, jitter) | layout facts | parity | reason refused |",
        "|---|---|---|---|---|---|",
    ]
    families = set(shipped_model_families())
    for r in rows:
        facts = ""
        if r.structure is not None:
            s = r.structure
            facts = f"bias={s.expert_bias}, transposed={s.expert_transposed}, {s.gate_up_layout}, {s.activation}"
        reason = r.reason.replace("|", "\\|").replace("\n", " ")
        tested = ""
        if r.structure is not None:
            tested = f"not tested: {r.untested}" if r.untested else "block 2+4 ranks"
            tested += ", model 2+4 ranks" if r.family in families and not r.untested else ""
        lines.append(f"| {r.family} | {r.cls} | {r.decision} | {facts} | {tested} | {reason} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", help="write the markdown table to this file (write then rename)")
    args = parser.parse_args(argv)
    text = markdown(survey())
    if args.write:
        import os

        tmp = args.write + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.write)
    print(text)


if __name__ == "__main__":
    main()
