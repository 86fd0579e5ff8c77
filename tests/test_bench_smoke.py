"""Every ``bench/`` script in its smallest configuration, so a change that breaks a benchmark fails here and not
when someone next measures (``bench/ep_layer.py`` once patched a private runtime function whose signature then
moved: the first command of ``docs/benchmarks.md`` crashed and nothing noticed). Each runs as its user runs it, a
fresh ``python bench/<script>.py`` process, and must exit 0 and print the figures that cannot vary with the
machine (bytes exchanged against the minimum, expert memory per rank, losses, limits). Timings are not checked.

    python -m pytest -q -m slow tests/test_bench_smoke.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(*args: str) -> str:
    """``python bench/<args>`` from the repository root; its stdout, after asserting it exited 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join("bench", args[0]), *args[1:]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"bench/{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def row(out: str, name: str, which: int = -1) -> list[str]:
    """The columns of the table row starting with ``name`` (``which``: of several tables, the last by default)."""
    lines = [line.split() for line in out.splitlines() if line.split()[:1] == [name]]
    assert lines, f"no row {name!r} in:\n{out}"
    return lines[which]


def test_ep_layer_interleaved_every_contender():
    """Every contender the interleaved comparison builds, in one process group (ratios are to the first)."""
    out = run_bench("ep_layer.py", "--smoke", "--contenders")
    names = ("ml-stacked", "ml-copy", "ml-fast", "ml-own", "ml-replay", "ml-plain", "autoep", "split-plain",
             "split-auto", "split-replay")
    for name in names:
        assert row(out, name)  # a timing row and a saved-for-backward row
    assert row(out, "ml-stacked", 0)[2] == "1.000x"  # the timing table's base (the saved-bytes table follows)


def test_ep_layer_saved_bytes_of_replay():
    """The memory autograd saves for backward is measured for the replay contender too (the bench's
    ``saved_tensors_hooks``: what activation offloading such as ``save_on_cpu`` does to a block)."""
    out = run_bench("ep_layer.py", "--smoke", "--contenders", "--interleave", "ml-own", "ml-replay")
    assert "not measurable" not in out, out


def test_ep_layer_table():
    """The side-by-side table, each contender in its own process group: every EP contender exchanges exactly
    the minimum bytes (transformers adds its 2-D split sizes) and keeps half the experts."""
    out = run_bench("ep_layer.py", "--smoke", "--interleave")
    assert row(out, "plain")[4:6] == ["0.000", "0.02"]
    assert row(out, "autoep")[3:7] == ["131,072", "1.000", "0.01", "0.500"]
    for name in ("hf-eager", "hf-grouped_mm"):
        assert row(out, name)[3:4] == ["131,136"] and row(out, name)[6] == "0.500"


def test_chained_experts():
    """Fused LoRA chains: 1 / n of the staged execution's all-to-alls for chains of n links, D / (D + R) of its
    payload for two (D = 8, R = 4), less in all bytes (the counts' exchange included)."""
    out = run_bench("chained_experts.py", "--smoke")
    for block in ("LoraMixture3MoE", "LoraDictMoE", "AdapterMixtureMoE"):
        assert row(out, block)[1] == "fused" and row(out, block)[5:7] == ["0.500", "0.667"], row(out, block)
        assert float(row(out, block)[7]) < 0.7
    assert row(out, "LoraChain3MoE")[5:7] == ["0.333", "0.500"]


def test_ep_layer_profile():
    out = run_bench("ep_layer.py", "--smoke", "--profile", "ml-stacked")
    assert "profile of ml-stacked" in out and "Self CPU" in out


def test_ep_layer_ops():
    """``--ops`` (docs/benchmarks.md's ops and host syncs per step): a row per contender, with its collectives."""
    out = run_bench("ep_layer.py", "--smoke", "--ops", "ml-own", "ml-replay", "autoep")
    for name in ("ml-own", "ml-replay", "autoep"):
        ops, _, syncs, collectives = row(out, name)[1:5]
        assert ops.count("/") == 1 and syncs.count("/") == 1 and int(collectives) > 0, row(out, name)
    assert row(out, "ml-own")[2] == "1.00"


def test_ep_gpu_cpu_check():
    out = run_bench("ep_gpu.py", "--cpu-check")
    for name in ("autoep", "hf-grouped_mm"):
        assert row(out, name)[5] == "1.000"  # bytes exchanged / minimum


def test_detect():
    out = run_bench("detect.py")
    assert "58 MoE blocks" in out and re.search(r"detect \(warm\)\s+:\s+[\d.]+ ms", out)


def test_train_step():
    """ep=1, ep=2 replicated and ep=2 FSDP2 train to the same loss; experts halve at ep=2, FSDP2 halves dense."""
    out = run_bench("train_step.py", "--smoke")
    assert row(out, "final")[-2:] == ["1.00", "1.00"]
    assert row(out, "expert")[-2:] == ["0.50", "1.00"]
    assert row(out, "dense")[-2:] == ["1.00", "0.50"]


def test_load_memory_load():
    out = run_bench("load_memory.py", "--smoke", "--only", "load")
    assert row(out, "0") and row(out, "1")


def test_load_memory_state():
    """fsdp2 experts hold exactly 1/(ep*edp) of the experts' training state on every rank."""
    out = run_bench("load_memory.py", "--smoke", "--only", "state", "--world", "2", "--ep", "1")
    for rank in ("0", "1"):
        assert row(out, rank)[3] == "1.000"


@pytest.mark.parametrize("replay", [False, True], ids=["splice", "replay"])
def test_soundness(replay):
    out = run_bench("soundness.py", "--smoke", *(["--replay"] if replay else []))
    assert re.search(r"ranks: [1-9]\d* compared on 2 ranks", out), out
    assert re.search(r"^total: mutants=[1-9].* accepted_wrong=0 crashes=0", out, re.M), out
