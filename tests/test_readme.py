"""The README's first screen and its override strings stay what the tested docs say."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_override_lines_are_the_tested_ones():
    readme = (ROOT / "README.md").read_text()
    doc = (ROOT / "docs" / "overrides.md").read_text()
    lines = [ln.strip() for ln in re.findall(r"^autoep-plan .*$", readme, flags=re.M)]
    assert len(lines) >= 4
    for line in lines:
        assert line in doc, f"README shows an override line docs/overrides.md (tested verbatim) lacks: {line}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = re.findall(r"^(python -m venv .*pytest.*)$", readme, flags=re.M)
    main = [c for c in commands if c.endswith("python -m pytest -q -n 2 --dist loadfile --durations=10 tests")]
    assert len(main) == 1 and len(commands) == 2  # the tests, and the transformers 4.x environment
    assert all(c in ci for c in commands)
    # The slow tier that command 2 leaves out (pyproject's addopts): once, right after it, as the README says.
    slow = "python -m pytest -q -n 2 --dist loadfile --durations=10 -m slow tests"
    assert slow in readme.splitlines()
    ci_lines = ci.splitlines()
    assert sum("-m slow" in line for line in ci_lines) == 1
    assert ci_lines[ci_lines.index(main[0]) + 1] == slow


def test_the_main_jobs_extra_installs_what_draws_its_picture():
    """README command 1 installs ``.[hf]`` and its run leaves ``load.png`` in the run dir: the ``hf`` extra carries
    matplotlib, as the ``plot`` extra does (the installed package's metadata, what pip reads)."""
    from importlib.metadata import requires

    readme = (ROOT / "README.md").read_text()
    assert re.search(r"^python -m venv .*pip install '\.\[hf\]' && autoep-train$", readme, flags=re.M)
    extras = {}
    for req in requires("autoep"):
        found = re.match(r"^([A-Za-z0-9_.-]+).*;\s*extra\s*==\s*\"(\w+)\"", req)
        if found:
            extras.setdefault(found.group(2), set()).add(found.group(1).lower())
    assert "matplotlib" in extras["hf"] and "matplotlib" in extras["plot"]
