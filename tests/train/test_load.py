"""load.py and plot.py: a default tiny run (one process) writes each planned block's tokens per expert into
``metrics.jsonl`` at its logged steps (every block's counts sum to tokens x top_k per step, and the logged windows
add up to the per-step totals), names the worst block in the progress line, and draws ``load.png`` at its end;
``python -m autoep.tools.plot <run_dir>`` (``autoep-plot``) draws it again from the run dir: a valid PNG of the
documented size; without matplotlib, one line saying how to get it."""
from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from autoep.train import plot
from autoep.train.config import CONF_DIR
from autoep.train.load import imbalance

OVERRIDES = ["trainer.steps=3", "trainer.log_every=2", "data.seq_len=16", "data.batch_size=2", "trainer.device=cpu"]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    from autoep.train.trainer import train

    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[*OVERRIDES, f"run_dir={tmp_path_factory.mktemp('run')}"])
    result = train(cfg)
    run_dir = Path(result["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"cfg": cfg, "run_dir": run_dir, "rows": rows, "model": result["model"]}


def png_facts(path: Path) -> tuple[int, int, int, int]:
    """(width, height, bit depth, colour type) of a PNG whose every chunk's CRC holds and whose pixel data
    inflates to exactly the size its header promises."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, pos = [], 8
    while pos < len(data):
        n = int.from_bytes(data[pos:pos + 4], "big")
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        assert zlib.crc32(kind + body) == int.from_bytes(data[pos + 8 + n:pos + 12 + n], "big"), kind
        chunks.append((kind, body))
        pos += 12 + n
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height, depth, colour = struct.unpack(">IIBB", chunks[0][1][:10])
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[colour]
    pixels = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    assert len(pixels) == height * (1 + width * channels * depth // 8)  # one filter byte per scanline
    return width, height, depth, colour


def assert_heatmap(path: Path) -> None:
    import matplotlib.image

    assert png_facts(path) == (plot.WIDTH_PX, plot.HEIGHT_PX, 8, 6)  # 8-bit RGBA
    pixels = matplotlib.image.imread(path)
    assert pixels.shape == (plot.HEIGHT_PX, plot.WIDTH_PX, 4) and pixels[..., :3].std() > 0.05  # not blank


def test_a_default_run_writes_per_block_loads_at_its_logged_steps(default_run):
    cfg, rows, model = default_run["cfg"], default_run["rows"], default_run["model"]
    resolved = OmegaConf.load(default_run["run_dir"] / "resolved.yaml")
    blocks = [m for entry in resolved.parallel.plan for m in entry.decision.modules]
    pairs_per_step = cfg.data.batch_size * cfg.data.seq_len * model.config.num_experts_per_tok
    logged = [row for row in rows if "layer_load" in row]
    assert [row["step"] for row in logged] == [1, 2, 3]  # the first, every log_every-th, the last
    assert sum(row["layer_load_steps"] for row in logged) == len(rows)
    for row in logged:
        load_LE = torch.tensor(row["layer_load"])
        assert load_LE.shape == (len(blocks), model.config.num_experts)
        assert load_LE.sum(dim=1).tolist() == [pairs_per_step * row["layer_load_steps"]] * len(blocks)
        assert row["layer_imbalance"] == [imbalance(c) for c in load_LE]
    # the logged windows hold every step's tokens, block by block
    total_E = sum(torch.tensor(row["layer_load"]).sum(dim=0) for row in logged)
    assert total_E.tolist() == torch.tensor([row["expert_load"] for row in rows]).sum(dim=0).tolist()


def test_the_progress_line_names_the_worst_block(default_run):
    last = default_run["rows"][-1]
    worst = max(range(len(last["layer_imbalance"])), key=last["layer_imbalance"].__getitem__)
    lines = (default_run["run_dir"] / "train.log").read_text().splitlines()
    (line,) = [line for line in lines if f"step     {last['step']}/" in line]
    assert line.endswith(f"(worst model.layers.{worst}.mlp {last['layer_imbalance'][worst]:.2f})")


def test_the_run_draws_the_heatmap_and_the_plot_command_draws_it_again(default_run):
    png = default_run["run_dir"] / plot.PNG
    assert_heatmap(png)
    png.unlink()
    done = subprocess.run([sys.executable, "-m", "autoep.tools.plot", str(default_run["run_dir"])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(png)
    assert_heatmap(png)


def test_without_matplotlib_one_line_says_how_to_get_it(default_run, monkeypatch, capsys, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert plot.main([str(default_run["run_dir"])]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'autoep[plot]'" in err
    with caplog.at_level(logging.INFO, logger="autoep.train.plot"):
        plot.draw_at_end(default_run["run_dir"])
    assert "pip install 'autoep[plot]'" in caplog.text


def test_the_plot_command_reads_the_trainers_metrics_file():
    from autoep.train.rundir import METRICS

    assert plot.METRICS == METRICS


def test_the_plot_command_refuses_a_dir_without_loads(tmp_path, capsys):
    assert plot.main([str(tmp_path)]) == 2
    assert "autoep-plot: error:" in capsys.readouterr().err and not (tmp_path / plot.PNG).exists()
