"""Data sources: deterministic global batches, per-rank slices that tile them, resumable position."""
from __future__ import annotations

import pytest
import torch

from autoep.errors import ConfigError
from autoep.train.data import Loader, SyntheticBigram, make_source


def test_ranks_tile_the_single_process_batch():
    src = SyntheticBigram(vocab_size=16, seq_len=8, seed=3)
    single = Loader(src, batch_size=4, rank=0, world_size=1)
    ranks = [Loader(src, batch_size=2, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        torch.testing.assert_close(single.next(), torch.cat([r.next() for r in ranks]))


def test_synthetic_task_follows_its_permutation():
    src = SyntheticBigram(vocab_size=16, seq_len=8, seed=0)
    x = src.global_batch(0, 5)
    assert torch.equal(x[:, 1:], src.perm_V[x[:, :-1]])
    assert not torch.equal(src.global_batch(0, 5), src.global_batch(1, 5))


def test_resume_position_replays_the_stream():
    src = SyntheticBigram(vocab_size=16, seq_len=8, seed=0)
    a = Loader(src, batch_size=2, rank=1, world_size=2)
    a.next()
    b = Loader(src, batch_size=2, rank=1, world_size=2)
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(a.next(), b.next())


def test_text_bytes_windows(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 4)
    x = make_source("text", vocab_size=256, seq_len=10, seed=0, path=str(text)).global_batch(0, 3)
    assert x.shape == (3, 10) and torch.equal(x[:, 1:], (x[:, :-1] + 1) % 256)


def test_bad_sources_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="data.source=csv: must be one of synthetic, text"):
        make_source("csv", vocab_size=16, seq_len=4, seed=0)
    with pytest.raises(ConfigError, match="vocab_size >= 256"):
        make_source("text", vocab_size=128, seq_len=4, seed=0, path=str(tmp_path))
    with pytest.raises(ConfigError, match="data.path=.*missing.txt: not found"):
        make_source("text", vocab_size=256, seq_len=4, seed=0, path=str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_bytes(b"")  # an empty buffer is not even a tensor: refused before reading
    with pytest.raises(ConfigError, match="data.path=.*empty.txt holds 0 bytes, not more than data.seq_len=4"):
        make_source("text", vocab_size=256, seq_len=4, seed=0, path=str(tmp_path / "empty.txt"))
