"""What ``autoep-train`` and ``autoep-plan`` share on the command line: one-line errors, exit codes, logging.

Exit codes (README "Exit codes"):

    0  success
    1  an unexpected error: a bug in autoep or in the model's code, printed with its traceback
    2  the command or the config is wrong: a bad or unknown key, a plan autoep refuses, a run directory
       that holds another run, a checkpoint, pretrained or data file that cannot be used, nothing left to
       train. Found before any work: nothing already written changed.
    3  a peer rank failed in a collective (it died or hung): resume with trainer.resume=latest
    4  launch: not every rank joined within trainer.join_timeout_s
    5  the loss or the gradient norm was not finite: that step was not applied, earlier checkpoints are kept

An error prints once, as ``<prog>: error: <message>`` on stderr: by rank 0 when every rank finds it alike
(config, plan, checkpoint, a non-finite loss), else by the rank that found it. Under torchrun, torchrun
itself then exits 1 and lists each rank's exit code in its summary.

Progress goes through ``logging`` (logger ``autoep``): rank 0 logs INFO to stdout, other ranks only
warnings and errors; ``autoep.train.trainer`` also writes the run's log to ``<run_dir>/train.log``.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from autoep.errors import (
    CheckpointError,
    ConfigError,
    LaunchError,
    NonFiniteLoss,
    PeerFailure,
    PlanError,
    UnsupportedModuleStructure,
)

EXIT_OK, EXIT_BUG, EXIT_CONFIG, EXIT_PEER, EXIT_LAUNCH, EXIT_NONFINITE = 0, 1, 2, 3, 4, 5
GROUPS = ("model", "parallel", "data", "optim", "trainer")
_state = {"task_started": False}


def exit_code(exc: BaseException) -> int | None:
    """The exit code for an error autoep reports in one line; None for anything else (a bug)."""
    for kinds, code in (((NonFiniteLoss,), EXIT_NONFINITE), ((LaunchError,), EXIT_LAUNCH),
                        ((PeerFailure,), EXIT_PEER),
                        ((ConfigError, PlanError, CheckpointError, UnsupportedModuleStructure), EXIT_CONFIG)):
        if isinstance(exc, kinds):
            return code
    return None


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _every_rank_alike(exc: BaseException) -> bool:
    """Whether every rank of the launch raises this same error (then only rank 0 prints it)."""
    if isinstance(exc, PeerFailure):
        return False  # each survivor saw its own collective fail
    return getattr(exc, "every_rank", True)  # a LaunchError one rank alone saw says so


def fail(prog: str, exc: BaseException) -> None:
    """Print ``exc`` as one error line (once across ranks) and exit with its code. Under torchrun the line
    also goes to this rank's error file, so torchrun's failure summary shows it instead of "<N/A>"."""
    code = exit_code(exc)
    line = f"{prog}: error: {exc}"
    if _rank() == 0 or not _every_rank_alike(exc):
        print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # NOTE: the JSON torch.distributed.elastic's ErrorHandler writes and torchrun reads back
        import json
        import time

        try:
            with open(error_file, "w") as f:
                json.dump({"message": {"message": line, "extraInfo": {
                    "py_callstack": f"{line} (exit code {code}: see the README's exit codes)",
                    "timestamp": str(int(time.time()))}}}, f)
        except OSError:
            pass  # the summary then says <N/A>; the line above was printed all the same
    # NOTE: sys.exit, not leave(): a rank that leaves at once would let torchrun stop rank 0 before it
    # prints the one line every rank shares. For the same reason the silent ranks give rank 0 a moment first
    # (torchrun stops every rank as soon as one exits; seen on a loaded machine: no line at all).
    if _rank() != 0 and _every_rank_alike(exc) and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        import time

        time.sleep(3.0)
    sys.exit(code)


def leave(code: int) -> None:
    """Exit a finished run with ``code``. A rank of a multi-process launch leaves without interpreter finalization: the
    process group is destroyed and everything is flushed by then; what is left is gloo's thread teardown,
    which aborted a rank now and then ("terminate called without an active exception", turning exit 0
    into SIGABRT; tests/distributed.py notes the same for its spawned ranks)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def setup_logging() -> None:
    """Console logging of the ``autoep`` logger: INFO on rank 0 (stdout, the message alone), warnings and
    errors elsewhere. Hydra's own job logging is off (``hydra/job_logging: none`` in ``train.yaml``)."""
    logger = logging.getLogger("autoep")
    if any(getattr(h, "_autoep_console", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler._autoep_console = True
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if _rank() == 0 else logging.WARNING)
    logger.propagate = False


def task(prog: str, fn) -> None:
    """Run the Hydra task ``fn()``: its known errors become one line and their exit code."""
    _state["task_started"] = True
    setup_logging()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - known kinds are reported in one line, the rest re-raised
        if exit_code(e) is None:
            raise
        fail(prog, e)


def early_check(prog: str, argv: list[str]) -> None:
    """Compose the command line as the app will and check every value, in a second and without torch, so
    a typo fails at once. Skipped when Hydra flags (``--config-dir``, ``-m``, ``--help``, ...) are given:
    the app composes those itself and checks the same values again before any work."""
    if any(arg.startswith("-") for arg in argv) or os.environ.get("HYDRA_FULL_ERROR") == "1":
        return
    from hydra import compose, initialize_config_dir

    from autoep.train.config import CONF_DIR, check_config

    try:
        with initialize_config_dir(CONF_DIR, version_base="1.3"):
            cfg = compose("train", overrides=argv)
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors, reported in one line
        fail(prog, ConfigError(composition_message(e)))
    try:
        check_config(cfg)
    except ConfigError as e:
        fail(prog, e)


def main(prog: str, hydra_main) -> None:
    """The console script: check a replayed file, then run ``hydra_main`` with Hydra's composition errors
    (unknown key, wrong type, missing group option, bad override syntax) as one line and exit 2."""
    try:
        path = primary_file(sys.argv[1:])
        if path is not None:
            from autoep.plan.artifact import load_resolved, read_yaml
            from autoep.train.config import ResolvedConfig

            data = read_yaml(path)  # a file that is not YAML gets our error, not Hydra's parser traceback
            check_primary(path, data, prog)
            if isinstance(data, dict) and "resolved_schema" in (data.get("defaults") or []):
                load_resolved(path, ResolvedConfig)  # a replay: cut short or hand-edited (artifact.plan_hash) is refused by name
    except PlanError as e:
        fail(prog, e)
    # NOTE: with HYDRA_FULL_ERROR=1 Hydra re-raises composition errors instead of printing several lines
    # and a hint to add `+key=...` (which would be refused anyway); they are reported here in one line,
    # unless the user set HYDRA_FULL_ERROR=1 to see the whole stack.
    user_wants_stack = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        hydra_main()
    except Exception as e:  # noqa: BLE001 - composition errors only; a task's own errors are re-raised
        if _state["task_started"] or user_wants_stack:
            raise
        fail(prog, ConfigError(composition_message(e)))
    leave(0)


def check_primary(path: Path, data, prog: str) -> None:
    """Refuse a primary config that cannot be autoep's: an empty file, or a plan another app wrote (only
    its frozen ``parallel`` section), each naming what to run instead."""
    if data is None or data == {}:
        raise PlanError(f"{path} is empty, so there is nothing to replay (a resolved.yaml cut to nothing?); restore "
                        f"it, regenerate it with autoep-plan, or name another config")
    if isinstance(data, dict) and set(data) == {"parallel", "artifact"}:
        raise PlanError(f"{path} holds only a frozen parallel section: a plan another app wrote through "
                        f"autoep.ExpertParallel. Replay it in that app (the file's header shows the command), or "
                        f"with this app's model: {prog} ++parallel.replay={path}")


def composition_message(exc: BaseException) -> str:
    """One line for an error Hydra raised while composing the config from the command line."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ConfigTypeError, ValidationError

    from autoep.train.config import value_error_message

    cause = exc.__cause__ if exc.__cause__ is not None else exc
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    key = getattr(cause, "full_key", None)
    key = key.replace("[", ".").replace("]", "") if key else key
    if isinstance(exc, OverrideParseException):
        why = [ln.strip() for ln in str(exc).splitlines()
               if ln.strip() and not ln.startswith(("Error parsing override", "See https"))]
        return (f"cannot parse the override {getattr(exc, 'override', '')!r}: {why[0] if why else 'syntax error'}; "
                f"an override is key=value (docs/overrides.md)")
    if isinstance(exc, MissingConfigException):
        group = Path(getattr(exc, "missing_cfg_file", "") or "").parent.name
        options = getattr(exc, "options", None) or _options(group)
        return f"{first.replace('In ' + repr('train') + ': ', '')}; available {group or 'configs'}: {', '.join(options)}"
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and key:
        return unknown_key(key)
    if isinstance(cause, ConfigTypeError) and key and "deletion" in first:
        return f"{key}: declared keys cannot be deleted (~{key}); set a value instead, e.g. {key}=null where it may be null"
    if isinstance(cause, ValidationError) and key and key.startswith("parallel.plan.") and "PlanEntry" in first:
        index = key.split(".")[2]
        return (f"parallel.plan.{index} does not exist: the plan has fewer entries; change an existing entry by "
                f"index (parallel.plan.0.match=...) or give the whole list (parallel.plan=[{{match:...,"
                f"local_compute_fn:auto}}])")
    if isinstance(cause, ValidationError) and key:
        return value_error_message(cause)
    if key:
        return f"{key}: {first}"
    return f"cannot compose the config from this command line: {type(cause).__name__}: {first}"


def unknown_key(key: str) -> str:
    """``key`` is not in the schema, or not in the chosen model config: one line naming the closest key."""
    from autoep.train.config import schema_keys, unknown_key_message

    parent = key.rpartition(".")[0]
    known = schema_keys(parent)
    if known is None:  # free-form (model.*): the keys of the model config the command line chose
        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf

        from autoep.train.config import CONF_DIR

        choice = [a for a in sys.argv[1:] if a.startswith("model=")]
        try:
            with initialize_config_dir(CONF_DIR, version_base="1.3"):
                node = OmegaConf.select(compose("train", overrides=choice[-1:]), parent)
            known = [str(k) for k in node.keys()] if hasattr(node, "keys") else []
        except Exception:  # noqa: BLE001 - only for the hint
            known = []
    return unknown_key_message(key, known)


def _options(group: str) -> list[str]:
    from autoep.train.config import CONF_DIR, PLAN_CONF_DIR

    return sorted({p.stem for root in (CONF_DIR, PLAN_CONF_DIR) for p in (Path(root) / group).glob("*.yaml")}) \
        if group else []


def _flag(argv: list[str], names: tuple[str, ...]) -> str | None:
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def primary_file(argv: list[str]) -> Path | None:
    """The file ``--config-dir D --config-name N`` names, when it exists."""
    config_dir, name = _flag(argv, ("--config-dir", "-cd")), _flag(argv, ("--config-name", "-cn"))
    if config_dir and name:
        path = Path(config_dir) / (name if name.endswith(".yaml") else name + ".yaml")
        return path if path.is_file() else None
    return None
