"""The package tree is the architecture: each layer imports only the layers before it, and no module
imports itself back through others (every import counted, also those inside functions)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import autoep

PKG = Path(autoep.__file__).resolve().parent
# The checkout (CI installs a wheel, so the installed package has no pyproject.toml beside it).
REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "autoep"
# What each layer may import, besides itself. ``errors`` is shared by all.
SHARED = {"errors", "targets", "conf"}  # leaves every layer may import (errors, _target_ paths, the YAML tree)
MAY_IMPORT = {
    "errors": set(),
    "targets": {"errors"},
    "conf": set(),
    "detect": SHARED,
    "plan": SHARED | {"detect"},
    "runtime": SHARED | {"detect"},
    "integrations": SHARED | {"detect", "plan", "runtime"},
    "train": SHARED | {"detect", "plan", "runtime"},
    "cli": {"train"},  # console entry points: autoep/cli.py and every package's __main__
    "tools": SHARED | {"detect", "plan", "runtime", "train"},
    "": SHARED | {"detect", "plan", "runtime", "integrations"},  # autoep/__init__.py: the public names
}
# Third-party packages a layer must not touch (the runtime knows nothing of Hydra; detection runs before any
# process group exists).
FORBIDDEN = {
    "detect": ("torch.distributed", "hydra", "omegaconf"),
    "runtime": ("hydra", "omegaconf"),
}


def module_name(path: Path) -> str:
    parts = ["autoep", *path.relative_to(PKG).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (lazy imports inside functions too)."""
    name = module_name(path)
    return imports_in(path.read_text(), name if path.name == "__init__.py" else name.rpartition(".")[0])


def imports_in(text: str, package: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                kept = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(kept + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from autoep.detect import structure`
    return found


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}
GRAPH = {m: {i for i in imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[-1] == "__main__":
        return "cli"
    return parts[1] if len(parts) > 1 else ""


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_lower_layers(module):
    mine = layer(module)
    assert mine in MAY_IMPORT, f"{module}: autoep/{mine} is a new layer; say in MAY_IMPORT what it may import"
    allowed = MAY_IMPORT[mine] | {mine}
    upward = sorted(i for i in GRAPH[module] if layer(i) not in allowed)
    assert not upward, f"{module} ({mine or 'autoep'}) imports a layer it may not: {upward}"
    bad = sorted(i for i in imports(MODULES[module]) for f in FORBIDDEN.get(mine, ()) if i == f or i.startswith(f + "."))
    assert not bad, f"{module} imports {bad}, which its layer {mine} must not"


def test_no_import_cycles():
    """Depth-first search over every autoep module; a back edge is a cycle, printed as its path."""
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for n in sorted(GRAPH[m]):
            if n.startswith(m + ".") or m.startswith(n + "."):
                continue  # a package and its own submodules (``from autoep.detect import x`` runs the __init__)
            if state.get(n) == "open":
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_check_sees_upward_and_lazy_imports():
    """The checker itself (a test that cannot fail is a defect): an import inside a function, absolute or
    relative, is found and placed in its layer."""
    text = "def f():\n    from autoep.runtime import apply\n    from ..train import trainer\n"
    found = {i for i in imports_in(text, "autoep.detect") if i in MODULES}
    assert {layer(i) for i in found} == {"runtime", "train"}


def test_each_package_says_its_job():
    for pkg in ("detect", "plan", "runtime", "train", "integrations", "tools"):
        doc = ast.get_docstring(ast.parse((PKG / pkg / "__init__.py").read_text()))
        assert doc and "import" in doc, f"autoep/{pkg}/__init__.py must say its job and what it may import"


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_console_scripts_name_callables():
    """``[project.scripts]`` is what ``pip install`` writes into bin/: each must import (an editable install made
    before a move keeps the old entry points, so this is checked against the file, not the installed scripts)."""
    import importlib

    scripts = _pyproject()["project"]["scripts"]
    assert set(scripts) == {"autoep-plan", "autoep-train", "autoep-prepare-data", "autoep-plot"}
    for name, spec in scripts.items():
        module, _, attr = spec.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), f"{name} = {spec}"


def test_every_shipped_yaml_is_package_data():
    """A wheel carries only what ``package-data`` globs match: every YAML under src/autoep must be matched."""
    globs = _pyproject()["tool"]["setuptools"]["package-data"]["autoep"]
    shipped = {p.relative_to(SRC) for g in globs for p in SRC.glob(g)}
    missing = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.yaml") if p.relative_to(SRC) not in shipped)
    assert not missing, f"YAML files a wheel would leave out (add them to package-data): {missing}"
