"""The bad-input catalogue (issue 10): bad or unusual inputs through the real ``autoep-train`` and ``autoep-plan``
(one subprocess each) and through the public Python API. Every case must end in one error line that names the
key, with the documented exit code; no traceback, no hang (a time limit guards), nothing already written changed
(every case that can touch a finished run gets its own copy of one, hashed before and after).

The cases run four at a time, once per module; each test then reads its case's outcome.
``test_catalogue_outcomes`` counts them: clear error / silent / traceback / hang / unclear.

Where each case runs. The cases the early check refuses (``EARLY``: before torch is imported, under a second each) and
one case per later stage (``STAGES``: a model built and planned, a checkpoint loaded, a rendezvous, the dry run, a
replayed file) run as the user runs them: a real ``autoep-train`` / ``autoep-plan`` process. Every other case runs
the same console-script function (``autoep.cli:train_main``) with its argv, environment and working directory in a
process forked from the tests' warm fork server (``distributed.run_command``): the CLI's own code from its first
line, exit code and stderr included, without the 3-7 s of interpreter start and imports each real process pays
(53 cases: 136 s serial as real processes). ``STAGES`` run both ways, and ``test_forked_is_the_console_script``
asserts the two give the same exit code and stderr.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml
from distributed import free_port, run_command
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from autoep.train.checkpoint import CheckpointError
from autoep.train.config import CONF_DIR

BIN = Path(sys.executable).parent
HANG_GUARD_S = 180  # far above any case (a few seconds); reaching it is a hang
SMALL = ["data.batch_size=2", "data.seq_len=16", "trainer.device=cpu"]


@dataclass
class Case:
    id: str
    args: list[str]  # placeholders: {RUN} a finished run (own copy), {FRESH} a new dir, {W} the shared fixtures
    expect: str  # what the one error line must contain: the key, and the value or the problem
    cli: str = "train"
    code: int = 2
    env: dict = field(default_factory=dict)
    damage: str | None = None  # what to break in this case's copy of the run first


CASES = [
    # ---- values, each checked where the schema declares it (run_dir holds a finished run: it must not change)
    Case("steps_zero", ["run_dir={RUN}", "trainer.steps=0"], "trainer.steps=0: must be an integer >= 1"),
    Case("grad_accum_zero", ["run_dir={RUN}", "trainer.grad_accum=0"], "trainer.grad_accum=0: must be an integer >= 1"),
    Case("device_gpu", ["run_dir={RUN}", "trainer.device=gpu"], "trainer.device=gpu: must be one of auto, cpu, cuda"),
    Case("device_cuda", ["run_dir={RUN}", "trainer.device=cuda"], "trainer.device=cuda: this machine has no usable CUDA"),
    Case("seq_len_one", ["run_dir={RUN}", "data.seq_len=1"], "data.seq_len=1: must be an integer >= 2"),
    Case("batch_size_zero", ["run_dir={RUN}", "data.batch_size=0"], "data.batch_size=0: must be an integer >= 1"),
    Case("text_empty_file", ["run_dir={RUN}", "data.source=text", "data.path={W}/empty.txt"], "empty.txt holds 0 bytes"),
    Case("lr_inf", ["run_dir={RUN}", "optim.lr=inf"], "optim.lr=inf: must be a finite number > 0"),
    Case("betas_one", ["run_dir={RUN}", "optim.betas=[0.9]"], "optim.betas=[0.9]: must be two numbers in [0, 1)"),
    # ---- keys and types, as Hydra composes the command line
    Case("steps_not_int", ["run_dir={RUN}", "trainer.steps=abc"], "trainer.steps: Value 'abc' of type 'str' could not be converted to Integer; give trainer.steps a value of type int"),
    Case("unknown_key", ["run_dir={RUN}", "trainer.max_steps=2"], "trainer.max_steps: no such key; did you mean trainer.steps?"),
    Case("unknown_key_added", ["run_dir={RUN}", "+trainer.max_steps=2"], "trainer.max_steps: no such key; did you mean trainer.steps?"),
    Case("unknown_model_key", ["run_dir={RUN}", "model.num_expertz=4"], "model.num_expertz: no such key; did you mean model.num_experts?"),
    Case("unknown_model_key_added", ["run_dir={FRESH}", "+model.num_expertz=4"], "['num_expertz']; did you mean model.num_experts?"),
    Case("plan_index_out_of_range", ["run_dir={RUN}", "parallel.plan.5.match=x"], "parallel.plan.5 does not exist"),
    Case("plan_entry_typo", ["run_dir={RUN}", "parallel.plan.0.mtch=x"], "parallel.plan.0.mtch: no such key; did you mean parallel.plan.0.match?"),
    Case("model_option_missing", ["run_dir={RUN}", "model=nonexistent"], "Could not find 'model/nonexistent'; available model: deepseek_v3"),
    Case("override_without_value", ["run_dir={RUN}", "trainer.steps"], "cannot parse the override 'trainer.steps': missing EQUAL"),
    Case("delete_declared_key", ["run_dir={RUN}", "~trainer.steps"], "trainer.steps: declared keys cannot be deleted"),
    Case("interpolation_missing", ["run_dir={RUN}", "trainer.steps=${{oops}}"], "trainer.steps: Interpolation key 'oops' not found"),
    Case("list_expected", ["run_dir={RUN}", "optim.betas=abc"], "optim.betas: Invalid value assigned: str is not a ListConfig"),
    # ---- the model section
    Case("model_zero_heads", ["run_dir={FRESH}", "model.num_attention_heads=0"], "model.num_attention_heads=0: must be a positive integer"),
    Case("top_k_above_experts", ["run_dir={FRESH}", "model.num_experts_per_tok=9"], "model.num_experts_per_tok=9 exceeds the 8 experts of model.layers.0.mlp"),
    Case("pretrained_no_path", ["run_dir={FRESH}", "model=hf_pretrained"], "model.pretrained_path is required by this model config"),
    Case("pretrained_missing_abs", ["run_dir={FRESH}", "model=hf_pretrained", "model.pretrained_path=/no/such/ckpt"], "model.pretrained_path=/no/such/ckpt: /no/such/ckpt does not exist"),
    Case("pretrained_hub_id", ["run_dir={FRESH}", "model=hf_pretrained", "model.pretrained_path=Qwen/Qwen3-30B-A3B"], "model.pretrained_path=Qwen/Qwen3-30B-A3B: .* it looks like a Hub repo id"),
    Case("pretrained_truncated", ["run_dir={FRESH}", "model=hf_pretrained", "model.pretrained_path={W}/hf_cut"], "model.safetensors is not a readable safetensors file"),
    Case("pretrained_other_model", ["run_dir={FRESH}", "model=hf_pretrained", "model.pretrained_path={W}/hf", "+model.intermediate_size=8"], "model.pretrained_path=.* the model expects"),
    Case("pretrained_unknown_field", ["run_dir={FRESH}", "model=hf_pretrained", "model.pretrained_path={W}/hf", "+model.moe_intermediate_size=8"], "model.moe_intermediate_size: MixtralConfig (from"),
    # ---- run directories and checkpoints
    Case("fresh_run_into_used_dir", ["run_dir={RUN}"], "already holds a run (metrics.jsonl with 2 steps"),
    Case("nothing_left_to_train", ["run_dir={RUN}", "trainer.resume=latest", "trainer.steps=2"], "so nothing is left to train; raise trainer.steps"),
    Case("resume_another_model", ["run_dir={RUN}", "trainer.resume=latest", "trainer.steps=5", "model=mixtral"], "was saved from a different model"),
    Case("resume_another_runs_checkpoint", ["run_dir={RUN}", "trainer.resume={W}/other/checkpoints/step_00000001", "trainer.steps=5"], "is not a checkpoint of run_dir="),
    Case("resume_corrupt_checkpoint", ["run_dir={RUN}", "trainer.resume=latest", "trainer.steps=5"], "DCP load failed, the checkpoint is damaged", damage="truncate_shards"),
    Case("resume_incomplete_checkpoint", ["run_dir={RUN}", "trainer.resume=latest", "trainer.steps=5"], "is incomplete (no DCP .metadata", damage="drop_metadata"),
    Case("run_dir_is_a_file", ["run_dir={W}/afile"], "run_dir={W}/afile: cannot write there"),
    Case("run_dir_uncreatable", ["run_dir=/proc/autoep/run"], "run_dir=/proc/autoep/run: cannot write there"),
    Case("ep_size_world", ["run_dir={FRESH}", "parallel.ep_size=2"], "parallel.ep_size=2 does not divide the world size 1"),
    # ---- launch
    Case("missing_peer", ["run_dir={FRESH}", "trainer.join_timeout_s=2"], "only 1 of WORLD_SIZE=2 ranks joined within trainer.join_timeout_s=2",
         code=4, env={"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{PORT}"}),
    Case("no_rendezvous_address", ["run_dir={FRESH}"], "WORLD_SIZE=2 but MASTER_ADDR, MASTER_PORT not set", code=4,
         env={"WORLD_SIZE": "2", "RANK": "0"}),
    Case("world_size_not_int", ["run_dir={FRESH}"], "WORLD_SIZE='two' is not an integer", code=4, env={"WORLD_SIZE": "two"}),
    # ---- autoep-plan
    Case("plan_into_training_run", ["run_dir={RUN}"], "holds a training run", cli="plan"),
    Case("plan_value", ["run_dir={FRESH}", "parallel.ep_size=3"], "parallel.ep_size=3 does not divide num_experts=8", cli="plan"),
    Case("plan_pretrained_no_path", ["run_dir={FRESH}", "model=hf_pretrained"], "model.pretrained_path is required", cli="plan"),
    Case("plan_detect_false", ["run_dir={FRESH}", "parallel.detect=false"], "parallel.plan.0.local_compute_fn=auto but parallel.detect=false", cli="plan"),
    Case("plan_match_nothing", ["run_dir={FRESH}", "parallel.plan.0.match=nothing.*"], "parallel.plan.0.match='nothing.*' matches no module", cli="plan"),
    Case("plan_target_not_allowed", ["run_dir={FRESH}", "parallel.plan.0.local_compute_fn={{_target_:os.system}}"], "local_compute_fn._target_='os.system' is not under an allowed prefix", cli="plan"),
    Case("plan_unknown_key_added", ["run_dir={FRESH}", "+parallel.ep_sise=2"], "parallel.ep_sise: no such key; did you mean parallel.ep_size?", cli="plan"),
    Case("replay_hash_edited", ["--config-dir", "{W}/replay_hash", "--config-name", "resolved", "run_dir={FRESH}"], "does not match its parallel section", cli="plan"),
    Case("replay_plan_edited", ["--config-dir", "{W}/replay_edit", "--config-name", "resolved", "run_dir={FRESH}"], "artifact.plan_hash=", cli="plan"),
    Case("replay_truncated", ["--config-dir", "{W}/replay_cut", "--config-name", "resolved", "run_dir={FRESH}"], "truncated", cli="plan"),
    Case("replay_not_yaml", ["--config-dir", "{W}/replay_junk", "--config-name", "resolved", "run_dir={FRESH}"], "not valid YAML", cli="plan"),
    Case("replay_into_training", ["--config-dir", "{W}/run", "--config-name", "resolved", "trainer.resume=latest", "trainer.steps=2", "run_dir={RUN}"], "so nothing is left to train"),
]

# Refused by the early check (autoep.train.command.early_check), before torch is imported: real processes, cheap.
EARLY = {"steps_zero", "grad_accum_zero", "device_gpu", "device_cuda", "seq_len_one", "batch_size_zero",
         "text_empty_file", "lr_inf", "betas_one", "steps_not_int", "unknown_key", "unknown_key_added",
         "unknown_model_key", "plan_index_out_of_range", "plan_entry_typo", "model_option_missing",
         "override_without_value", "delete_declared_key", "interpolation_missing", "list_expected",
         "plan_unknown_key_added"}
# One case per stage past it, run as a real process and forked: the model built on meta and planned, a damaged
# checkpoint loaded, a rendezvous that times out (exit 4), autoep-plan, a replayed resolved.yaml (--config-dir).
STAGES = {"top_k_above_experts", "resume_corrupt_checkpoint", "missing_peer", "plan_value", "replay_hash_edited"}


# The same checks through the Python API: ``autoep.train.trainer.train(cfg)`` on the composed config, run_dir a finished
# run's copy ({RUN}; {FRESH} a new dir, {W} the shared fixtures). Every one must raise the one-line error before
# any work and change nothing.
API_TRAIN_CASES = [
    ("steps_negative", ["run_dir={RUN}", "trainer.steps=-3"], "trainer.steps=-3: must be an integer >= 1"),
    ("ckpt_every_negative", ["run_dir={RUN}", "trainer.ckpt_every=-1"], "trainer.ckpt_every=-1: must be an integer >= 0"),
    ("log_every_zero", ["run_dir={RUN}", "trainer.log_every=0"], "trainer.log_every=0: must be an integer >= 1"),
    ("timeout_zero", ["run_dir={RUN}", "trainer.timeout_s=0"], "trainer.timeout_s=0: must be an integer >= 1"),
    ("join_timeout_zero", ["run_dir={RUN}", "trainer.join_timeout_s=0"], "trainer.join_timeout_s=0: must be"),
    ("seed_negative", ["run_dir={RUN}", "trainer.seed=-1"], "trainer.seed=-1: must be an integer >= 0"),
    ("dense_sharding_ddp", ["run_dir={RUN}", "trainer.dense_sharding=ddp"], "trainer.dense_sharding=ddp: must be one of"),
    ("on_nonfinite_bad", ["run_dir={RUN}", "trainer.on_nonfinite=ignore"], "trainer.on_nonfinite=ignore: must be one of"),
    ("resume_empty", ["run_dir={RUN}", "trainer.resume="], "trainer.resume=: must be latest, a checkpoints/step_*"),
    ("source_csv", ["run_dir={RUN}", "data.source=csv"], "data.source=csv: must be one of synthetic, text"),
    ("text_without_path", ["run_dir={RUN}", "data.source=text"], "data.source=text needs data.path"),
    ("text_missing_file", ["run_dir={RUN}", "data.source=text", "data.path={W}/nope.txt"], "nope.txt: not found"),
    ("text_directory", ["run_dir={RUN}", "data.source=text", "data.path={W}/adir"], "adir: a directory"),
    ("path_without_text", ["run_dir={RUN}", "data.path={W}/empty.txt"], "is only read with data.source=text"),
    ("lr_nan", ["run_dir={RUN}", "optim.lr=nan"], "optim.lr=nan: must be a finite number > 0"),
    ("lr_zero", ["run_dir={RUN}", "optim.lr=0"], "optim.lr=0.0: must be a finite number > 0"),
    ("lr_negative", ["run_dir={RUN}", "optim.lr=-0.001"], "optim.lr=-0.001: must be a finite number > 0"),
    ("betas_above_one", ["run_dir={RUN}", "optim.betas=[0.9,1.5]"], "optim.betas=[0.9,1.5]: must be two numbers"),
    ("eps_zero", ["run_dir={RUN}", "optim.eps=0"], "optim.eps=0.0: must be a finite number > 0"),
    ("weight_decay_negative", ["run_dir={RUN}", "optim.weight_decay=-0.1"], "optim.weight_decay=-0.1: must be"),
    ("grad_clip_negative", ["run_dir={RUN}", "optim.grad_clip=-1"], "optim.grad_clip=-1.0: must be"),
    ("warmup_negative", ["run_dir={RUN}", "optim.warmup_steps=-1"], "optim.warmup_steps=-1: must be an integer >= 0"),
    ("min_lr_ratio_two", ["run_dir={RUN}", "optim.min_lr_ratio=2"], "optim.min_lr_ratio=2.0: must be a finite number >= 0 and <= 1"),
    ("ep_size_zero", ["run_dir={RUN}", "parallel.ep_size=0"], "parallel.ep_size=0: must be an integer >= 1"),
    ("on_drift_bad", ["run_dir={RUN}", "parallel.on_drift=maybe"], "parallel.on_drift=maybe: must be one of error, redetect"),
    ("unknown_top_key_added", ["run_dir={RUN}", "+foo=1"], "foo: no such key; the config has model, parallel"),
    ("model_zero_vocab", ["run_dir={FRESH}", "model.vocab_size=0"], "model.vocab_size=0: must be a positive integer"),
    ("model_target_missing", ["run_dir={FRESH}", "model._target_=nope.build"], "model._target_=nope.build: cannot be imported"),
    ("model_config_class_missing", ["run_dir={FRESH}", "model.config_class=transformers.Nope"], "model.config_class=transformers.Nope: cannot be imported"),
    ("pretrained_no_config", ["run_dir={FRESH}", "model=hf_pretrained", "model.pretrained_path={W}/hf_noconfig"], "holds no config.json"),
    ("pretrained_bad_config", ["run_dir={FRESH}", "model=hf_pretrained", "model.pretrained_path={W}/hf_badconfig"], "its config.json cannot be read as a transformers config"),
    ("resume_missing_checkpoint", ["run_dir={FRESH}", "trainer.resume={W}/nope/step_00000001"], "no such checkpoint directory"),
    ("resume_latest_nothing_saved", ["run_dir={FRESH}", "trainer.resume=latest"], "trainer.resume=latest: no complete checkpoint"),
    ("run_dir_under_a_file", ["run_dir={W}/afile/sub"], "run_dir={W}/afile/sub: cannot write there"),
]


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()} if root.exists() else {}


def _damage(run: Path, how: str) -> None:
    latest = sorted((run / "checkpoints").glob("step_*"))[-1]
    if how == "truncate_shards":
        for f in latest.glob("*.distcp"):
            f.write_bytes(f.read_bytes()[:100])
    elif how == "drop_metadata":
        (latest / ".metadata").unlink()


def _fixtures(world: Path) -> None:
    """A finished run (through the real CLI: .hydra/ included), a tiny HF checkpoint and damaged variants,
    replay files, and files that are not what a key wants."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([str(BIN / "autoep-train"), f"run_dir={world}/run", "trainer.steps=2", "trainer.ckpt_every=1",
                    *SMALL], check=True, capture_output=True, env=env, timeout=HANG_GUARD_S)
    shutil.copytree(world / "run", world / "other")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(MixtralConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts_per_tok=2, intermediate_size=16, head_dim=8, num_local_experts=4)).save_pretrained(world / "hf")
    for name in ("hf_cut", "hf_noconfig", "hf_badconfig"):
        shutil.copytree(world / "hf", world / name)
    cut = world / "hf_cut" / "model.safetensors"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    (world / "hf_noconfig" / "config.json").unlink()
    config = json.loads((world / "hf_badconfig" / "config.json").read_text())
    (world / "hf_badconfig" / "config.json").write_text(json.dumps({**config, "model_type": "no_such_model"}))
    text = (world / "run" / "resolved.yaml").read_text()
    written = yaml.safe_load(text)["artifact"]["plan_hash"]
    for name, content in {"replay_hash": text.replace(written, "sha256:" + "0" * 64),
                          "replay_edit": text.replace("ep_size: 1", "ep_size: 2"),
                          "replay_cut": text[: len(text) // 2], "replay_junk": "\x00\x01 not: [yaml"}.items():
        (world / name).mkdir()
        (world / name / "resolved.yaml").write_text(content)
    (world / "empty.txt").write_bytes(b"")
    (world / "adir").mkdir()
    (world / "afile").write_text("not a directory")


def _run_case(case: Case, forked: bool, world: Path) -> dict:
    home = world / "cases" / (case.id + "_forked" * forked)
    run, fresh = home / "run", home / "fresh"
    shutil.copytree(world / "run", run)
    if case.damage:
        _damage(run, case.damage)
    before = snapshot(run)
    fill = {"RUN": run, "FRESH": fresh, "W": world, "PORT": free_port()}
    args = [a.format(**fill) for a in case.args]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", **{k: v.format(**fill) for k, v in case.env.items()}})
    if forked:
        out = run_command(f"autoep.cli:{case.cli}_main", [f"autoep-{case.cli}", *args], env, home, HANG_GUARD_S)
    else:
        try:
            proc = subprocess.run([str(BIN / f"autoep-{case.cli}"), *args], cwd=home, env=env, capture_output=True,
                                  text=True, timeout=HANG_GUARD_S)
            out = {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
        except subprocess.TimeoutExpired:
            out = {"rc": None, "stdout": "", "stderr": ""}
    out["run_unchanged"] = snapshot(run) == before
    out["fresh_files"] = sorted(snapshot(fresh))
    out["expect"] = case.expect.format(**fill)
    out["own"] = {str(home): "<home>", f":{fill['PORT']}": ":<port>"}  # what differs between two runs of a case
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    _fixtures(root)
    shared = {name: snapshot(root / name) for name in ("run", "other", "hf", "replay_hash", "replay_edit")}
    return root, shared


@pytest.fixture(scope="module")
def runs(world):
    """``{case id: outcome}`` as the user runs it where the module docstring says so, else forked; and the
    forked outcome of each of ``STAGES``."""
    root, _ = world
    cases = [c for c in CASES if not (c.id == "device_cuda" and torch.cuda.is_available())]
    jobs = [(c, c.id not in EARLY | STAGES) for c in cases] + [(c, True) for c in cases if c.id in STAGES]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda job: _run_case(*job, root), jobs))
    outcomes = {c.id: r for (c, _), r in zip(jobs[:len(cases)], results)}
    twins = {c.id: r for (c, _), r in zip(jobs[len(cases):], results[len(cases):])}
    return outcomes, twins


@pytest.fixture(scope="module")
def outcomes(runs):
    return runs[0]


def classify(case: Case, out: dict) -> str:
    """clear | silent | traceback | hang | unclear (exit code, line count, prefix or the named key is off)."""
    import re

    if out["rc"] is None:
        return "hang"
    if "Traceback" in out["stdout"] + out["stderr"]:
        return "traceback"
    if out["rc"] == 0:
        return "silent"
    lines = out["stderr"].strip().splitlines()
    prefix = f"autoep-{case.cli}: error: "
    named = out["expect"] in lines[0] if lines else False
    if not named and lines and ".*" in out["expect"]:
        named = re.search(out["expect"], lines[0]) is not None
    if out["rc"] != case.code or len(lines) != 1 or not lines[0].startswith(prefix) or not named:
        return "unclear"
    return "clear"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cli_case(case, outcomes):
    if case.id not in outcomes:
        pytest.skip("this machine has CUDA: trainer.device=cuda is valid here")
    out = outcomes[case.id]
    kind = classify(case, out)
    assert kind == "clear", f"{kind}: rc={out['rc']} expected {case.code}, stderr:\n{out['stderr'][-3000:]}\n" \
                            f"wanted: {out['expect']}"
    assert out["run_unchanged"], "the finished run's files changed"
    assert out["fresh_files"] == [], f"a refused run wrote {out['fresh_files']}"


def _seen(out: dict) -> tuple:
    text = out["stderr"]
    for own, common in out["own"].items():
        text = text.replace(own, common)
    return out["rc"], text


def test_forked_is_the_console_script(runs):
    """The forked cases stand for real processes: at each stage past the early check, the console script run as a
    real process and run forked give the same exit code and stderr (the case's paths and port aside)."""
    outcomes, twins = runs
    assert EARLY | STAGES <= {c.id for c in CASES} and set(twins) == STAGES
    for case_id, forked in twins.items():
        assert _seen(forked) == _seen(outcomes[case_id]), case_id
        assert forked["run_unchanged"] and forked["fresh_files"] == [], case_id


# ---------------------------------------------------------------- the Python API


def _cfg(*overrides: str):
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return compose("train", overrides=[*SMALL, *overrides])


def _meta_model():
    from hydra.utils import instantiate

    with torch.device("meta"):
        return instantiate(_cfg().model)


def _train(cfg, *_):
    from autoep.train.trainer import train

    return train(cfg)


def _without_model(cfg):
    cfg.model = "???"  # as a config with no model chosen composes
    return cfg


def _untyped(**trainer):
    """A plain (untyped) config, as a caller of the Python API might build one."""
    plain = OmegaConf.to_container(_cfg(), resolve=True)
    plain["trainer"].update(trainer)
    return OmegaConf.create(plain)


def api_cases(world: Path) -> list[tuple]:
    """(id, call, error type name, what the message must contain)."""
    from autoep import apply_plan, detect_moe_structure, resolve_plan
    from autoep.plan.artifact import load_resolved
    from autoep.train.config import ResolvedConfig, check_config
    from autoep.train.data import make_source
    from autoep.train.dry_run import plan
    from autoep.train.export import check_exportable
    from autoep.train.models import build_hf_pretrained

    return [
        ("resolve_ep_size_zero", lambda r: resolve_plan({"ep_size": 0, "plan": []}, _meta_model()), "PlanError", "parallel.ep_size"),
        ("resolve_unknown_key", lambda r: resolve_plan({"foo": 1}, _meta_model()), "PlanError", "parallel.foo"),
        ("resolve_entry_without_match", lambda r: resolve_plan({"plan": [{"local_compute_fn": "auto"}]}, _meta_model()),
         "PlanError", "parallel.plan.0.match is required"),
        ("resolve_on_drift_bad", lambda r: resolve_plan({"on_drift": "maybe"}, _meta_model()), "PlanError", "parallel.on_drift='maybe'"),
        ("resolve_match_nothing", lambda r: resolve_plan({"plan": [{"match": "nothing.*"}]}, _meta_model()),
         "PlanError", "parallel.plan.0.match='nothing.*' matches no module"),
        ("resolve_target_not_dotted", lambda r: resolve_plan(
            {"plan": [{"match": "model.layers.*.mlp", "local_compute_fn": {"_target_": "nodots"}}]}, _meta_model()),
         "PlanError", "parallel.plan.0.local_compute_fn._target_='nodots' is not a dotted import path"),
        ("resolve_detect_false", lambda r: resolve_plan({"detect": False, "plan": [{"match": "model.layers.*.mlp"}]},
                                                        _meta_model()), "PlanError", "parallel.detect=false"),
        ("apply_unresolved", lambda r: apply_plan(_meta_model(), {"plan": [{"match": "model.layers.*.mlp"}]}, None),
         "PlanError", "parallel.plan.0 has no decision"),
        ("detect_not_moe", lambda r: detect_moe_structure(torch.nn.Linear(2, 2)), "UnsupportedModuleStructure",
         "Declare an explicit local_compute_fn to opt out of structure detection: {_factory_: "),
        ("train_steps_zero", lambda r: _train(_cfg(f"run_dir={r}", "trainer.steps=0")), "ConfigError", "trainer.steps=0"),
        ("train_untyped_unknown_key", lambda r: _train(_untyped(max_steps=2, **{"steps": 2})), "ConfigError",
         "trainer.max_steps: no such key; did you mean trainer.steps?"),
        ("train_untyped_wrong_type", lambda r: _train(_untyped(steps="abc")), "ConfigError", "trainer.steps"),
        ("train_model_missing", lambda r: _train(_without_model(_cfg(f"run_dir={r}/fresh"))), "ConfigError", "model is not set"),
        ("train_into_used_run_dir", lambda r: _train(_cfg(f"run_dir={r}")), "ConfigError", "already holds a run"),
        ("train_nothing_left", lambda r: _train(_cfg(f"run_dir={r}", "trainer.resume=latest", "trainer.steps=1")),
         "ConfigError", "nothing is left to train"),
        ("train_betas", lambda r: check_config(_cfg("optim.betas=[0.9]")), "ConfigError", "optim.betas=[0.9]"),
        ("load_resolved_edited", lambda r: load_resolved(world / "replay_hash" / "resolved.yaml", ResolvedConfig), "PlanError",
         "artifact.plan_hash="),
        ("pretrained_hub_id", lambda r: build_hf_pretrained("Qwen/Qwen3-30B-A3B"), "PretrainedError",
         "model.pretrained_path=Qwen/Qwen3-30B-A3B"),
        ("text_empty_file", lambda r: make_source("text", vocab_size=256, seq_len=8, seed=0, path=str(world / "empty.txt")),
         "ConfigError", "data.path="),
        ("plan_into_training_run", lambda r: plan(_cfg(), str(r)), "ConfigError", "holds a training run"),
        ("export_not_hf", lambda r: check_exportable(torch.nn.Linear(2, 2)), "ConfigError",
         "trainer.export_hf=true needs a transformers model"),
    ]


def _api_ids():
    return [c[0] for c in api_cases(Path("."))]


@pytest.mark.parametrize("case_id", _api_ids())
def test_api_case(case_id, world, tmp_path):
    root, _ = world
    cases = {c[0]: c for c in api_cases(root)}
    _, call, kind, expect = cases[case_id]
    run = Path(shutil.copytree(root / "run", tmp_path / "run"))
    before = snapshot(run)
    with pytest.raises(Exception) as info:
        call(run)
    names = [k.__name__ for k in type(info.value).__mro__]
    assert kind in names, f"{type(info.value).__name__}: {info.value}"
    assert expect in str(info.value) and "\n" not in str(info.value).strip(), str(info.value)
    assert snapshot(run) == before


@pytest.mark.parametrize("case_id, overrides, expect", API_TRAIN_CASES, ids=[c[0] for c in API_TRAIN_CASES])
def test_api_train_case(case_id, overrides, expect, world, tmp_path):
    from autoep.errors import ConfigError
    from autoep.train.trainer import train

    root, _ = world
    run, fresh = Path(shutil.copytree(root / "run", tmp_path / "run")), tmp_path / "fresh"
    before = snapshot(run)
    fill = {"RUN": run, "FRESH": fresh, "W": root}
    with pytest.raises((ConfigError, CheckpointError)) as info:
        train(_cfg(*[o.format(**fill) for o in overrides]))
    message = str(info.value)
    assert expect.format(**fill) in message and "\n" not in message.strip(), message
    assert snapshot(run) == before and snapshot(fresh) == {}


def test_catalogue_outcomes(world, outcomes):
    """The catalogue as the issue counted it: at least 60 cases, every one a clear error, and the shared
    fixtures (a finished run, an HF checkpoint, replay files) unchanged by all of them."""
    root, shared = world
    counts: dict[str, int] = {}
    for case in CASES:
        if case.id in outcomes:
            kind = classify(case, outcomes[case.id])
            counts[kind] = counts.get(kind, 0) + 1
    api = len(_api_ids()) + len(API_TRAIN_CASES)
    total = sum(counts.values()) + api
    print(f"\nbad-input catalogue: {total} cases ({sum(counts.values())} CLI, {api} API); CLI outcomes {counts}")
    assert total >= 60 and counts.get("clear") == sum(counts.values()), counts
    assert {name: snapshot(root / name) for name in shared} == shared
