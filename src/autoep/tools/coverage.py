"""Detection coverage over every MoE block class of the installed transformers.

    python -m autoep.tools.coverage            # print the markdown table
    python -m autoep.tools.coverage --write docs/coverage.md

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
from dataclasses import dataclass, field

import torch.nn as nn

from autoep.detect.structure import MoeStructure, detect_moe_structure
from autoep.errors import UnsupportedModuleStructure
from autoep.plan.archetypes import compute_fn_config
from autoep.tools.tiny import build_block, build_tiny_model, family_configs, moe_blocks

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
    model_untested: str = ""  # the family's whole tiny causal LM is not parity-tested: why
    explicit: str = ""  # refused: whether an explicit shipped _target_ would run it, and why not

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
            configs = family_configs(package)
            for cls in vars(mod).values():
                if isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == mod.__name__:
                    try:
                        init_src = inspect.getsource(cls.__init__)
                    except (OSError, TypeError):
                        continue
                    if ASSIGNS_EXPERTS.search(init_src):
                        yield info.name, cls, configs


def shipped_model_families() -> list[str]:
    """Families with a tiny whole-model config in conf/model (each gets whole-model parity)."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "conf" / "model"
    return sorted(p.stem for p in folder.glob("*.yaml") if "config_class:" in p.read_text())


def parity_families(rows: list["Row"]) -> list[str]:
    """Families with an accepted class whose whole tiny model builds (each gets whole-model parity)."""
    return sorted({r.family for r in rows if r.structure is not None and not r.model_untested})


def _tiny_model_classes(family: str) -> tuple[set[str], str]:
    """(classes of the accepted blocks in the family's tiny whole model, why it has none: "" when built)."""
    try:
        model, _ = build_tiny_model(family)
    except Exception as exc:  # noqa: BLE001 - any failure of the family's own code is the reason
        return set(), f"no tiny model: {str(exc)[:160]}"
    return {type(model.get_submodule(n)).__name__ for n in moe_blocks(model)}, ""


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


def shipped_recipe_fit(module: nn.Module) -> str:
    """Whether naming a shipped recipe as ``local_compute_fn._target_`` would run a refused block: each
    recipe's ``validate`` (what ``resolve_plan`` runs for an explicit entry) re-proves what it needs."""
    from autoep.plan.archetypes import known_targets
    from autoep.train.models import import_object

    reasons = []
    for target in sorted(known_targets()):
        validate = getattr(importlib.import_module(target.rsplit(".", 1)[0]), "validate", None)
        storage = "module_list" if "module_list" in target else "batched_parameters"
        structure = MoeStructure(router="other", shared_experts="none", expert_storage=storage, jitter=False)
        try:
            import_object(target)
            validate(module, structure=structure.as_dict())
            return f"yes: {target}"
        except (UnsupportedModuleStructure, TypeError, ValueError, KeyError) as exc:
            reasons.append(f"{target.rsplit('.', 1)[1]}: {str(getattr(exc, 'reason', exc))[:80]}")
    return "no (" + "; ".join(reasons) + ")"


def survey(tiny: bool = True) -> list[Row]:
    """Every MoE block class, its decision on meta, and (``tiny``) whether its tiny CPU build can be parity-tested."""
    rows, model_classes = [], {}
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
            compute_fn_config(row.structure, cls.__name__)  # accepted = a recipe runs it (the table's gate)
        except UnsupportedModuleStructure as exc:
            row.structure = None
            row.reason = exc.reason
            row.explicit = shipped_recipe_fit(module)
        if row.structure is not None and tiny:
            row.untested = _tiny_mismatch(cls, configs)
            if family not in model_classes:
                model_classes[family] = _tiny_model_classes(family)
            classes, why = model_classes[family]
            row.model_untested = why or ("" if cls.__name__ in classes else
                                         f"the family's tiny text model has no {cls.__name__} (e.g. a vision tower)")
        rows.append(row)
    return sorted(rows, key=lambda r: (r.family, r.cls))


_V5_PARITY = (
    "Parity (outputs, input grads, router/shared grads summed over ranks, expert grads gathered; fp32,",
    "default `assert_close`) is asserted in CI by `tests/runtime/test_parity_hf.py` on 2 and 4 gloo ranks with",
    "uneven tokens per rank: *block* for every accepted class built tiny from its own config, *model*",
    "(loss and every parameter gradient of a 2-layer causal LM, every layer MoE) for every family with",
    "an accepted class: its `conf/model/` config where one ships, else its own causal LM (or text model)",
    "class built by `autoep.tools.tiny.build_tiny_model`. Refused classes run nothing.",
)
_V4_PARITY = (
    "Parity (the same comparison) is asserted in CI's second environment by `tests/tools/test_transformers_v4.py`:",
    "*block* parity on 2 gloo ranks with uneven tokens for every accepted class built tiny from its own config.",
)


def execution_counts(rows: list[Row]) -> str:
    """The accepted classes by execution, e.g. "70 grouped, 3 spliced, 5 replay"."""
    from autoep.detect.structure import EXECUTIONS

    counts = {e: sum(r.structure is not None and r.structure.execution == e for r in rows) for e in EXECUTIONS}
    return ", ".join(f"{n} {e}" for e, n in sorted(counts.items(), key=lambda kv: -kv[1]) if n)


def markdown(rows: list[Row]) -> str:
    import transformers

    accepted = sum(r.structure is not None for r in rows)
    v4 = int(transformers.__version__.split(".")[0]) < 5
    lines = [
        f"## transformers {transformers.__version__}",
        "",
        f"{len(rows)} classes assign `self.experts`; {accepted} accepted ({execution_counts(rows)}), "
        f"{len(rows) - accepted} refused. "
        f"Generated by `python -m autoep.tools.coverage --write docs/coverage.md` in an environment with this version.",
        "",
        "Execution (`MoeStructure.execution`, what `autoep-plan` records in `resolved.yaml`): *grouped* (batched,",
        "grouped or equal-group experts: their forward replaced by the exchange and grouped compute), *spliced*",
        "(module experts: the block's proven loop replaced by the exchange), *replay* (module experts whose loop",
        "is not proven: the block's forward runs once, its expert outputs deferred to the exchange).",
        "",
        *(_V4_PARITY if v4 else _V5_PARITY),
        "",
        "What runs under EP: the block's own forward. Only the region autoep replaces (the experts'",
        "forward for batched, grouped and equal-group experts; the block's expert loops, with DeepSeek's",
        "concatenation, for ModuleList experts, every path running exactly one) is proven, by a",
        "whitelist over every statement and call in it with call targets resolved to the objects they",
        "denote; run-time state (instance forwards, hooks, tied or frozen experts) is checked too. The",
        "router and shared columns are vocabulary: routing and shared branches are never re-implemented.",
        "`python bench/soundness.py` mutates accepted classes and checks every accepted mutant is exact.",
        "",
        "| family | class | execution | decision (router, shared, storage, jitter) | layout facts | parity | reason refused "
        "| explicit shipped `_target_` |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        facts = ""
        if r.structure is not None:
            s = r.structure
            facts = f"bias={s.expert_bias}, transposed={s.expert_transposed}, {s.gate_up_layout}, {s.activation}"
        reason = r.reason.replace("|", "\\|").replace("\n", " ")
        tested = ""
        if r.structure is not None and v4:
            tested = "block 2 ranks"
        elif r.structure is not None:
            tested = f"not tested: {r.untested}" if r.untested else "block 2+4 ranks"
            tested += f", model: not tested: {r.model_untested}" if r.model_untested else ", model 2+4 ranks"
        explicit = r.explicit.replace("|", "\\|").replace("\n", " ")
        execution = r.structure.execution if r.structure is not None else ""
        lines.append(f"| {r.family} | {r.cls} | {execution} | {r.decision} | {facts} | {tested} | {reason} | {explicit} |")
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
            f.write(merged_document(args.write, text))
        os.replace(tmp, args.write)
    print(text)


TITLE = "# Detection coverage\n\nOne section per transformers major version CI tests (5.x: the main suite; 4.x: the second environment).\n"


def merged_document(path: str, section: str) -> str:
    """The coverage document with this transformers major version's section replaced (others kept)."""
    import os

    old = open(path).read() if os.path.exists(path) else ""
    sections = re.split(r"(?m)^(?=## transformers )", old)[1:]
    major = section.split()[2].split(".")[0]
    kept = [s for s in sections if s.split()[2].split(".")[0] != major]
    ordered = sorted(kept + [section], key=lambda s: -int(s.split()[2].split(".")[0]))
    return TITLE + "\n" + "\n".join(x.rstrip("\n") + "\n" for x in ordered)


if __name__ == "__main__":
    main()
