"""Training data with no download: a synthetic learnable task and a local text file, byte-tokenised.

Every source yields *global* batches: micro-batch ``i`` of the whole run is a fixed function of
``(seed, i)`` and the global batch size, never of the world size. Rank ``r`` of ``W`` takes rows
``[r*B, (r+1)*B)`` of the global batch of ``W*B`` rows, so a run on 2 ranks sees exactly the rows
a single process with ``batch_size=2*B`` sees, and the position to resume from is one integer
(micro-batches consumed).

Shape legend: N rows in the global batch, B rows per rank, L sequence length, V vocabulary.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from autoep.errors import ConfigError
from autoep.train.config import DATA_SOURCES, check_text_file

BYTE_VOCAB = 256


class SyntheticBigram:
    """Sequences that follow a fixed random permutation of the vocabulary: ``x[t+1] = perm[x[t]]``.

    Only the first token of each row is random, so a model that learns the map drives the loss
    towards ``ln(V) / L``: the loss falls visibly within a few hundred steps of a tiny model.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        if vocab_size < 2:
            raise ConfigError(f"model.vocab_size={vocab_size}: the synthetic data needs a vocabulary of at least 2 "
                              f"tokens; give the model a larger vocab_size")
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.perm_V = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))

    def global_batch(self, index: int, rows: int) -> Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        x_NL = torch.empty(rows, self.seq_len, dtype=torch.long)
        x_NL[:, 0] = torch.randint(self.vocab_size, (rows,), generator=g)
        for t in range(1, self.seq_len):
            x_NL[:, t] = self.perm_V[x_NL[:, t - 1]]
        return x_NL


class TextBytes:
    """Random windows of ``seq_len`` bytes from a local text file (byte-level tokenizer, V = 256)."""

    def __init__(self, path: str, seq_len: int, seed: int, vocab_size: int):
        if vocab_size < BYTE_VOCAB:
            raise ConfigError(f"data.source=text needs a model vocab_size >= {BYTE_VOCAB} (bytes), the model has "
                              f"{vocab_size}; use a model with model.vocab_size={BYTE_VOCAB} or data.source=synthetic")
        check_text_file(path, seq_len)  # before reading: an empty buffer is not even a tensor
        self.tokens = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long()
        self.seq_len, self.seed = seq_len, seed

    def global_batch(self, index: int, rows: int) -> Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        starts_N = torch.randint(self.tokens.numel() - self.seq_len, (rows,), generator=g)
        return self.tokens[starts_N.unsqueeze(1) + torch.arange(self.seq_len)]


def make_source(source: str, *, vocab_size: int, seq_len: int, seed: int, path: str | None = None):
    """The data source named by ``data.source`` (``synthetic`` or ``text``)."""
    if source == "synthetic":
        return SyntheticBigram(vocab_size, seq_len, seed)
    if source == "text":
        return TextBytes(path, seq_len, seed, vocab_size)
    raise ConfigError(f"data.source={source}: must be one of {', '.join(DATA_SOURCES)}; e.g. data.source=synthetic")


class Loader:
    """This rank's micro-batches in order; ``position`` (micro-batches consumed) is all resume needs."""

    def __init__(self, source, *, batch_size: int, rank: int, world_size: int, position: int = 0):
        self.source, self.batch_size, self.rank, self.world_size = source, batch_size, rank, world_size
        self.position = position

    def next(self) -> Tensor:
        rows = self.batch_size * self.world_size
        x_NL = self.source.global_batch(self.position, rows)
        self.position += 1
        return x_NL[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
