"""autoep.train.command: the exit codes the README documents are the ones the entry points return, and Hydra's
composition errors read as one line naming the key."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from autoep.errors import ConfigError, LaunchError, NonFiniteLoss, PeerFailure, PlanError, UnsupportedModuleStructure
from autoep.train import command as cli
from autoep.train.checkpoint import CheckpointError
from autoep.train.config import CONF_DIR

ROOT = Path(__file__).resolve().parents[2]


def test_readme_exit_codes_are_the_ones_returned():
    readme = (ROOT / "README.md").read_text()
    table = dict(re.findall(r"^\| (\d) \| (.*) \|$", readme.split("## Exit codes")[1].split("##")[0], flags=re.M))
    assert sorted(table) == ["0", "1", "2", "3", "4", "5"]
    examples = {2: [ConfigError("x"), PlanError("x"), CheckpointError("x"), UnsupportedModuleStructure("C", "x")],
                3: [PeerFailure("x")], 4: [LaunchError("x")], 5: [NonFiniteLoss("x")]}
    for code, errors in examples.items():
        assert all(cli.exit_code(e) == code for e in errors), code
    assert "wrong" in table["2"] and "peer" in table["3"] and "joined" in table["4"] and "not finite" in table["5"]
    assert cli.exit_code(RuntimeError("a bug")) is None  # printed with its traceback, exit 1


@pytest.mark.parametrize("override, message", [
    ("trainer.max_steps=2", "trainer.max_steps: no such key; did you mean trainer.steps?"),
    ("trainer.steps=abc", "trainer.steps: Value 'abc' of type 'str' could not be converted to Integer; give "
                          "trainer.steps a value of type int"),
    ("parallel.plan.3.match=x", "parallel.plan.3 does not exist"),
    ("model=nope", "Could not find 'model/nope'; available model: deepseek_v3, gpt_oss, hf_pretrained"),
    ("trainer.steps", "cannot parse the override 'trainer.steps': missing EQUAL at '<EOF>'"),
])
def test_composition_errors_read_as_one_line_naming_the_key(override, message):
    with pytest.raises(Exception) as info, initialize_config_dir(CONF_DIR, version_base="1.3"):
        compose("train", overrides=[override])
    text = cli.composition_message(info.value)
    assert text.startswith(message) and "\n" not in text, text


def test_an_error_every_rank_finds_is_printed_by_rank_zero_only(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as info:
        cli.fail("autoep-train", ConfigError("trainer.steps=0: must be ..."))
    assert info.value.code == 2 and capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as info:
        cli.fail("autoep-train", PeerFailure("rank 1 failed in step 3"))  # each survivor's own
    assert info.value.code == 3 and capsys.readouterr().err == "autoep-train: error: rank 1 failed in step 3\n"
