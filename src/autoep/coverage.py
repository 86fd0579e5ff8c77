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
from dataclasses import dataclass

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


def _candidate_configs(configs: list[type]):
    for config_cls in configs:
        try:
            config = config_cls()
        except Exception:  # noqa: BLE001
            continue
        yield config
        for attr in ("text_config", "language_config", "llm_config", "thinker_config", "talker_config"):
            sub = getattr(config, attr, None)
            if sub is not None and hasattr(sub, "to_dict"):
                yield sub
                for attr2 in ("text_config",):
                    if getattr(sub, attr2, None) is not None:
                        yield getattr(sub, attr2)


def build_on_meta(cls: type, configs: list[type]) -> nn.Module:
    """Instantiate ``cls`` on meta from one of its family's configs; raises the last error if none fits."""
    last = None
    required = [
        p.name
        for p in list(inspect.signature(cls.__init__).parameters.values())[2:]
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    for config in _candidate_configs(configs):
        # Extra required arguments: a layer index, or a size the family's config also carries.
        extra = {n: 0 if n == "layer_idx" else getattr(config, n, getattr(config, "intermediate_size", 64))
                 for n in required}
        for kwargs in (extra, {**extra, "layer_idx": 0}):
            try:
                with torch.device("meta"), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return cls(config, **kwargs)
            except Exception as exc:  # noqa: BLE001 - try the next config shape
                last = exc
    raise RuntimeError(f"could not build from {[c.__name__ for c in configs]}: {type(last).__name__}: {last}")


def survey() -> list[Row]:
    rows = []
    for family, cls, configs in moe_block_classes():
        row = Row(family, cls.__name__)
        try:
            module = build_on_meta(cls, configs)
        except RuntimeError as exc:
            row.reason = f"not built: {str(exc)[:160]}"
            rows.append(row)
            continue
        try:
            row.structure = detect_moe_structure(module)
        except UnsupportedModuleStructure as exc:
            row.reason = exc.reason
        rows.append(row)
    return sorted(rows, key=lambda r: (r.family, r.cls))


def markdown(rows: list[Row], parity: dict[str, str] | None = None) -> str:
    import transformers

    parity = parity or {}
    accepted = sum(r.structure is not None for r in rows)
    lines = [
        "# Detection coverage",
        "",
        f"transformers {transformers.__version__}: {len(rows)} classes assign `self.experts`; "
        f"{accepted} accepted, {len(rows) - accepted} refused. Generated by `python -m autoep.coverage`.",
        "",
        "| family | class | decision (router, shared, storage, jitter) | layout facts | reason refused |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        facts = ""
        if r.structure is not None:
            s = r.structure
            facts = f"bias={s.expert_bias}, transposed={s.expert_transposed}, {s.gate_up_layout}, {s.activation}"
        reason = r.reason.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.family} | {r.cls} | {r.decision} | {facts} | {reason} |")
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
