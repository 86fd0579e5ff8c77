"""Training data with no download: a synthetic learnable task, a local text file (its bytes, or the tokens
of a local tokenizer) and packed token files (``autoep.train.tokens``), with a validation split.

Every source yields *global* batches: micro-batch ``i`` of the whole run is a fixed function of
``(seed, i)`` and the global batch size, never of the world size. Rank ``r`` of ``W`` takes rows
``[r*B, (r+1)*B)`` of the global batch of ``W*B`` rows, so a run on 2 ranks sees exactly the rows
a single process with ``batch_size=2*B`` sees, and the position to resume from is one integer
(micro-batches consumed).

Text and packed token files are read as the non-overlapping windows of L tokens of each split (R of them).
Training draws them shuffled, one permutation per epoch fixed by ``(seed, epoch)``: row ``g`` of the run
is window ``perm_{g // R}[g % R]``; validation reads its windows in order.

Shape legend: N rows in the global batch, B rows per rank, L sequence length, V vocabulary, R windows.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from autoep.errors import ConfigError
from autoep.train import tokens
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


class TokenWindows:
    """The non-overlapping windows of ``seq_len`` tokens of one split (a numpy array of ids, mapped or not).

    ``global_batch(i, N)``: rows ``i*N .. (i+1)*N - 1`` of the run, shuffled per epoch (training);
    ``in_order(i, N)``: windows ``i*N .. (i+1)*N - 1`` as they lie (validation).
    """

    def __init__(self, tokens, seq_len: int, seed: int, what: str):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.num_windows = len(tokens) // seq_len
        if self.num_windows < 1:
            raise ConfigError(f"{what} holds {len(tokens)} tokens, fewer than one row of data.seq_len={seq_len}; "
                              f"give more data or a smaller data.seq_len")
        self._order = (None, None)  # (epoch, its permutation): one epoch's order is kept, not recomputed per batch

    def _epoch_order(self, epoch: int) -> Tensor:
        if self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(self.num_windows, generator=g))
        return self._order[1]

    def global_batch(self, index: int, rows: int) -> Tensor:
        row_N = torch.arange(index * rows, (index + 1) * rows)
        epoch_N, pos_N = row_N // self.num_windows, row_N % self.num_windows
        window_N = torch.empty_like(row_N)
        for epoch in epoch_N.unique().tolist():  # one or two epochs (more only if a batch exceeds the split)
            mask = epoch_N == epoch
            window_N[mask] = self._epoch_order(epoch)[pos_N[mask]]
        return self.rows(window_N)

    def in_order(self, index: int, rows: int) -> Tensor:
        return self.rows(torch.arange(index * rows, (index + 1) * rows))

    def rows(self, window_N: Tensor) -> Tensor:
        """The windows' tokens as int64 ``[N, L]`` (a copy out of the mapped file)."""
        import numpy as np

        idx_NL = (window_N * self.seq_len).unsqueeze(1) + torch.arange(self.seq_len)
        return torch.from_numpy(np.asarray(self.tokens[idx_NL.numpy()], dtype=np.int64))


def _text_tokens(path: str, seq_len: int, vocab_size: int, tokenizer_path: str | None, key: str):
    """The ids of a local text file: its bytes (V = 256), or ``data.tokenizer_path``'s tokens of it."""
    import numpy as np

    if tokenizer_path is None and vocab_size < BYTE_VOCAB:
        raise ConfigError(f"data.source=text needs a model vocab_size >= {BYTE_VOCAB} (bytes), the model has "
                          f"{vocab_size}; use a model with model.vocab_size={BYTE_VOCAB}, give data.tokenizer_path, "
                          f"or use data.source=synthetic")
    check_text_file(path, seq_len, key)  # before reading: an empty buffer is not even a tensor
    if tokenizer_path is None:
        return np.frombuffer(Path(path).read_bytes(), dtype=np.uint8)
    tokenizer = tokens.load_tokenizer(tokenizer_path)
    tokens.check_tokenizer_vocab(tokenizer, tokenizer_path, vocab_size)
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return np.asarray(tokens.encode(tokenizer, [text])[0], dtype=np.int64)


def _packed_tokens(path: str, vocab_size: int, tokenizer_path: str | None, key: str):
    """The mapped ids of a packed token file, checked against the model (and the tokenizer, where given)."""
    ids, meta = tokens.open_tokens(path, key)
    tokens.check_token_vocab(meta, path, vocab_size, key)
    if tokenizer_path is not None:
        tokens.check_same_tokenizer(meta, path, tokens.load_tokenizer(tokenizer_path), tokenizer_path)
    return ids


def make_splits(source: str, *, vocab_size: int, seq_len: int, seed: int, path: str | None = None,
                tokenizer_path: str | None = None, val_path: str | None = None, val_fraction: float = 0.0):
    """``(training source, validation split or None)`` as ``data.*`` names them.

    ``text`` and ``tokens`` hold out the last ``data.val_fraction`` of ``data.path``'s tokens, or read
    ``data.val_path`` (a file of the same kind, tokenized alike), for validation."""
    if source == "synthetic":
        return SyntheticBigram(vocab_size, seq_len, seed), None
    if source not in ("text", "tokens"):
        raise ConfigError(f"data.source={source}: must be one of {', '.join(DATA_SOURCES)}; e.g. data.source=synthetic")

    def read(file: str, key: str):
        if source == "text":
            return _text_tokens(file, seq_len, vocab_size, tokenizer_path, key)
        return _packed_tokens(file, vocab_size, tokenizer_path, key)

    ids = read(path, "data.path")
    held_out = int(len(ids) * val_fraction)
    what = f"data.path={path}" + (f" without its last data.val_fraction={val_fraction}" if held_out else "")
    train = TokenWindows(ids[:len(ids) - held_out], seq_len, seed, what)
    if val_path is not None:
        return train, TokenWindows(read(val_path, "data.val_path"), seq_len, seed, f"data.val_path={val_path}")
    if val_fraction:
        return train, TokenWindows(ids[len(ids) - held_out:], seq_len, seed,
                                          f"data.val_fraction={val_fraction} of data.path={path}")
    return train, None


def make_source(source: str, *, vocab_size: int, seq_len: int, seed: int, path: str | None = None,
                tokenizer_path: str | None = None):
    """The training source named by ``data.source`` (``synthetic``, ``text`` or ``tokens``)."""
    return make_splits(source, vocab_size=vocab_size, seq_len=seq_len, seed=seed, path=path,
                       tokenizer_path=tokenizer_path)[0]


class Validation:
    """The held-out rows the validation loss reads: the first ``batches`` global batches of the split, in
    order (0: all it holds), each of ``batch_size * world_size`` rows; rank ``r`` takes its rows of each
    as ``Loader`` does, so every rank runs the same number of forwards (the exchange needs every rank)."""

    def __init__(self, split, *, batch_size: int, rank: int, world_size: int, batches: int):
        self.split, self.batch_size, self.rank = split, batch_size, rank
        self.rows = batch_size * world_size
        held = split.num_windows // self.rows
        if held < 1:
            raise ConfigError(f"the validation split holds {split.num_windows} rows of data.seq_len={split.seq_len}, "
                              f"fewer than one global batch (data.batch_size={batch_size} x {world_size} ranks); "
                              f"hold out more (data.val_fraction, data.val_path) or lower data.batch_size")
        self.num_batches = min(held, batches) if batches else held

    def batches(self):
        for index in range(self.num_batches):
            yield self.split.in_order(index, self.rows)[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]


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
