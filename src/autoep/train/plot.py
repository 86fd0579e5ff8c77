"""The expert load picture of a run: a PNG heatmap of every planned block's experts over the logged steps,
written beside ``metrics.jsonl`` (``<run_dir>/load.png``) at the end of a run and on demand::

    autoep-plot runs/a                      # python -m autoep.tools.plot runs/a

Each column is a logged row of ``metrics.jsonl`` (``layer_load``: the tokens each block sent to each expert
since the row before); each row of the picture one (block, expert) pair, blocks in plan order, separated by
lines. The colour is the expert's share of its block's tokens over the mean share: 1 is a perfectly even
load, 2 an expert that got twice its share. matplotlib comes with the ``hf`` extra (README command 1) and the
``plot`` extra (``pip install 'autoep[plot]'``); without it the run and ``autoep-plot`` say so in one line.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from omegaconf import OmegaConf

from autoep.errors import ConfigError

# autoep.train.rundir.METRICS, not imported from there: rundir pulls in torch (seconds) for a file name, and
# autoep-plot needs no torch (tests/train/test_load.py checks the two agree)
METRICS = "metrics.jsonl"
PNG = "load.png"
WIDTH_PX, HEIGHT_PX, DPI = 1200, 800, 100
INSTALL = "pip install 'autoep[plot]'"
log = logging.getLogger(__name__)


def load_rows(run_dir: Path) -> tuple[list[int], list[list[list[int]]]]:
    """The logged steps of ``metrics.jsonl`` and each one's ``layer_load`` (blocks x experts); a ``ConfigError``
    where the run dir holds none."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no {METRICS}; pass the run_dir of an autoep-train run")
    steps, loads = [], []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run: the rows before it still draw
        if isinstance(row, dict) and row.get("layer_load"):
            steps.append(int(row["step"]))
            loads.append(row["layer_load"])
    if not loads:
        raise ConfigError(f"{path}: no row holds layer_load (per-block expert loads, written by autoep-train at each "
                          f"logged step of a run with a parallel.plan); nothing to draw")
    return steps, loads


def block_names(run_dir: Path, count: int) -> list[str]:
    """The planned blocks in plan order, from ``resolved.yaml`` (``block i`` where it does not say)."""
    try:
        plan = OmegaConf.load(Path(run_dir) / "resolved.yaml").parallel.plan
        names = [m for entry in plan for m in entry.decision.modules]
    except Exception:  # noqa: BLE001 - the names are labels only; the counts are what is drawn
        names = []
    return names if len(names) == count else [f"block {i}" for i in range(count)]


def write_heatmap(run_dir) -> Path:
    """Draw ``<run_dir>/load.png`` (WIDTH_PX x HEIGHT_PX) from its ``metrics.jsonl``; returns its path.
    Raises ``ImportError`` without matplotlib, ``ConfigError`` without loads to draw."""
    import matplotlib

    matplotlib.use("Agg")  # NOTE: no display needed; set before pyplot is imported
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    run_dir = Path(run_dir)
    steps, loads = load_rows(run_dir)
    counts_SLE = np.asarray(loads, dtype=np.float64)  # S logged rows, L blocks, E experts
    S, L, E = counts_SLE.shape
    mean_SL1 = counts_SLE.mean(axis=2, keepdims=True)
    share_SLE = np.divide(counts_SLE, mean_SL1, out=np.zeros_like(counts_SLE), where=mean_SL1 > 0)
    image = share_SLE.reshape(S, L * E).T  # rows: (block, expert) pairs; columns: logged steps
    fig, ax = plt.subplots(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI, layout="constrained")
    shown = ax.imshow(image, aspect="auto", interpolation="nearest", cmap="RdBu_r",
                      norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(2.0, float(image.max()))),
                      extent=(-0.5, S - 0.5, L * E - 0.5, -0.5))
    for boundary in range(1, L):
        ax.axhline(boundary * E - 0.5, color="black", linewidth=0.8)
    names = block_names(run_dir, L)
    ax.set_yticks([i * E + (E - 1) / 2 for i in range(L)], names, fontsize=max(4, min(9, 400 // max(L, 1))))
    ticks = sorted({round(x) for x in np.linspace(0, S - 1, min(S, 10))})
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
    ax.set_xlabel("step")
    ax.set_title(f"tokens per expert / mean, per block ({E} experts each, top to bottom)")
    fig.colorbar(shown, ax=ax, label="load / mean load (1 = even)")
    out = run_dir / PNG
    tmp = out.with_name(f".{PNG}.tmp")
    fig.savefig(tmp, dpi=DPI, format="png")  # NOTE: write-then-rename, as every run-dir file
    plt.close(fig)
    tmp.replace(out)
    return out


def draw_at_end(run_dir: Path) -> None:
    """The end of a run (rank 0): write the picture, or say in one line how to get matplotlib."""
    try:
        log.info("expert load heatmap: %s", write_heatmap(run_dir))
    except ImportError:
        log.info("no expert load heatmap: matplotlib is not installed (%s)", INSTALL)
    except ConfigError as e:
        log.info("no expert load heatmap: %s", e)


def main(argv: list[str] | None = None) -> int:
    """``autoep-plot <run_dir>``: write ``<run_dir>/load.png``; exit 2 with one line when it cannot."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: autoep-plot <run_dir>  (writes <run_dir>/load.png from its metrics.jsonl)", file=sys.stderr)
        return 2
    try:
        print(write_heatmap(args[0]))
    except ImportError:
        print(f"autoep-plot: error: the heatmap needs matplotlib: {INSTALL}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"autoep-plot: error: {e}", file=sys.stderr)
        return 2
    return 0
