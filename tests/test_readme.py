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
    main = [c for c in commands if c.endswith("python -m pytest -q tests")]
    assert len(main) == 1 and len(commands) == 2  # the tests, and the transformers 4.x environment
    assert all(c in ci for c in commands)
