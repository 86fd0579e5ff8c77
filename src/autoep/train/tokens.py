"""Real data: a tokenizer from a local directory, packed token files, and windows over a token stream.

A packed token file is one flat array of token ids, prepared once (``python -m autoep.train.prepare``) and
read memory-mapped: ``<name>.bin`` (raw ids, the machine's byte order, dtype uint16 or uint32) or
``<name>.npy``. Beside it, the sidecar ``<name>.bin.json`` says what the ids are::

    {"format": "autoep-tokens", "dtype": "uint16", "vocab_size": 32000, "num_tokens": 123456789,
     "tokenizer": {"path": "/abs/tok", "class": "...", "vocab_size": 32000, "eos_token_id": 2}}

(``dtype``, ``vocab_size`` and ``num_tokens`` are required; a file prepared elsewhere gets a sidecar of
those three). A run checks the sidecar against its model before any step: ids of a larger vocabulary
than ``model.vocab_size`` are refused, and so is a ``data.tokenizer_path`` of another vocabulary.

Rows over the ids: ``autoep.train.data.TokenWindows``. Nothing here imports torch: ``check_config`` reads
sidecars on the command line before torch is imported.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from autoep.errors import ConfigError

FORMAT = "autoep-tokens"
SUFFIXES = (".bin", ".npy")
DTYPES = ("uint16", "uint32")
PREPARE = "python -m autoep.train.prepare <text files> --tokenizer <dir> --out <file.bin>"


def sidecar_path(path) -> Path:
    """``data/train.bin`` -> ``data/train.bin.json``."""
    return Path(str(path) + ".json")


def _numpy(key: str, value):
    try:
        import numpy
    except ImportError:
        raise ConfigError(f"{key}={value}: reading a packed token file needs numpy, which is not installed; "
                          f"pip install numpy (it comes with autoep[hf])") from None
    return numpy


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------


def check_tokenizer_dir(path, key: str = "data.tokenizer_path") -> Path:
    """``path`` is a local directory (a Hub id is never looked up); returns it."""
    directory = Path(str(path)).expanduser()
    if not directory.is_dir():
        what = "a file, not a directory" if directory.is_file() else "not found"
        raise ConfigError(f"{key}={path}: {what} (looked at {directory.absolute()}); give a local HF tokenizer "
                          f"directory (tokenizer.json / tokenizer_config.json, as tokenizer.save_pretrained(dir) "
                          f"writes it); autoep never downloads one")
    return directory


def load_tokenizer(path, key: str = "data.tokenizer_path"):
    """``AutoTokenizer`` from the local directory ``path`` (``local_files_only=True``: never a Hub lookup)."""
    directory = check_tokenizer_dir(path, key)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(f"{key}={path}: loading a tokenizer needs transformers; pip install 'autoep[hf]'") from None
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises for a directory that is no tokenizer
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"{key}={path}: not a loadable HF tokenizer directory ({type(e).__name__}: {first}); "
                          f"give a directory written by tokenizer.save_pretrained(dir)") from None


def describe_tokenizer(tokenizer, path) -> dict:
    """What a sidecar records of the tokenizer; ``vocab_size`` counts added tokens (``len(tokenizer)``)."""
    return {"path": str(Path(str(path)).expanduser().absolute()), "class": type(tokenizer).__name__,
            "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id}


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens. Fast tokenizers encode the batch in parallel (and
    without transformers' warning about texts longer than the model's context)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def check_tokenizer_vocab(tokenizer, tokenizer_path, model_vocab: int) -> None:
    if len(tokenizer) > model_vocab:
        raise ConfigError(f"data.tokenizer_path={tokenizer_path} has {len(tokenizer)} tokens but model.vocab_size="
                          f"{model_vocab}: ids past the model's embedding; use a model with model.vocab_size>="
                          f"{len(tokenizer)}, or the model's own tokenizer")


# ---------------------------------------------------------------------------------------------
# Packed token files
# ---------------------------------------------------------------------------------------------


def read_sidecar(path, key: str = "data.path") -> dict:
    """The sidecar of packed token file ``path``, checked (before any file is mapped)."""
    if not path:
        raise ConfigError(f"data.source=tokens needs {key}=<a packed token file>; e.g. {key}=data/train.bin "
                          f"(written by {PREPARE})")
    file, side = Path(str(path)).expanduser(), sidecar_path(Path(str(path)).expanduser())
    if not file.is_file():
        what = "a directory" if file.is_dir() else "not found"
        raise ConfigError(f"{key}={path}: {what} (looked at {file.absolute()}); give a packed token file "
                          f"written by {PREPARE}")
    if file.suffix not in SUFFIXES:
        raise ConfigError(f"{key}={path}: a packed token file ends in .bin or .npy (written by {PREPARE}); for a "
                          f"text file use data.source=text")
    need = 'a JSON sidecar {"dtype": "uint16", "vocab_size": V, "num_tokens": N} beside it'
    if not side.is_file():
        raise ConfigError(f"{key}={path}: no {side.name} beside it (dtype, vocab size, token count); prepare the "
                          f"file with {PREPARE}, or write {need}")
    try:
        meta = json.loads(side.read_text())
        meta["num_tokens"], meta["vocab_size"] = int(meta["num_tokens"]), int(meta["vocab_size"])
        assert meta["dtype"] in DTYPES
    except Exception:  # noqa: BLE001 - any malformed sidecar gets the same line
        raise ConfigError(f"{key}={path}: its sidecar {side} is not {need} (dtype one of {', '.join(DTYPES)}); "
                          f"prepare the file again with {PREPARE}") from None
    return meta


def open_tokens(path, key: str = "data.path"):
    """``(tokens, sidecar)``: the ids of packed token file ``path``, memory-mapped read-only (a numpy array),
    after checking the file holds exactly what its sidecar says."""
    meta = read_sidecar(path, key)
    np = _numpy(key, path)
    file, dtype, n = Path(str(path)).expanduser(), meta["dtype"], meta["num_tokens"]
    if file.suffix == ".npy":
        try:
            tokens = np.load(file, mmap_mode="r")
        except Exception as e:  # noqa: BLE001 - a damaged .npy header
            raise ConfigError(f"{key}={path}: not a readable .npy file ({type(e).__name__}); prepare it again with "
                              f"{PREPARE}") from None
        if tokens.ndim != 1 or tokens.dtype != np.dtype(dtype) or len(tokens) != n:
            raise ConfigError(f"{key}={path} holds {tokens.dtype} ids of shape {tuple(tokens.shape)}, its sidecar "
                              f"says {n} {dtype} ids in one row; prepare it again with {PREPARE}")
        return tokens, meta
    expected = n * np.dtype(dtype).itemsize
    if file.stat().st_size != expected:
        raise ConfigError(f"{key}={path} holds {file.stat().st_size} bytes, its sidecar says {n} {dtype} ids "
                          f"({expected} bytes): cut short, or not the file the sidecar describes; prepare it again "
                          f"with {PREPARE}")
    if n == 0:
        return np.zeros(0, dtype=dtype), meta
    return np.memmap(file, dtype=dtype, mode="r", shape=(n,)), meta


def check_token_vocab(meta: dict, path, model_vocab: int, key: str = "data.path") -> None:
    """The ids of a packed file fit the model's embedding."""
    if meta["vocab_size"] > model_vocab:
        raise ConfigError(f"{key}={path} holds ids of a {meta['vocab_size']}-token vocabulary (its sidecar) but "
                          f"model.vocab_size={model_vocab}; use a model with model.vocab_size>={meta['vocab_size']}, "
                          f"or prepare the data with the model's tokenizer")


def check_same_tokenizer(meta: dict, path, tokenizer, tokenizer_path) -> None:
    """``data.tokenizer_path`` given with a packed file: it is the vocabulary the file was written with."""
    if len(tokenizer) != meta["vocab_size"]:
        made = (meta.get("tokenizer") or {}).get("path")
        raise ConfigError(f"data.tokenizer_path={tokenizer_path} has {len(tokenizer)} tokens but data.path={path} "
                          f"was written with a {meta['vocab_size']}-token vocabulary"
                          f"{f' ({made})' if made else ''}; give the tokenizer it was prepared with, or drop "
                          f"data.tokenizer_path")


def write_tokens(out, chunks, *, vocab_size: int, extra: dict) -> dict:
    """Write the id chunks (lists of ints) to packed file ``out`` (.bin or .npy) and its sidecar, each
    write-then-rename: a reader never sees a half-written file under the final name. Returns the sidecar."""
    out = Path(out)
    if out.suffix not in SUFFIXES:
        raise ConfigError(f"--out {out}: a packed token file ends in .bin or .npy")
    np = _numpy("--out", out)
    dtype = "uint16" if vocab_size <= 2 ** 16 else "uint32"
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp", delete=False)
    tmp = [raw.name]
    try:
        n = 0
        with raw:
            for ids in chunks:
                arr = np.asarray(ids, dtype=np.int64)
                if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
                    raise ConfigError(f"--tokenizer: an id {int(arr.max())} is outside its vocabulary of {vocab_size}")
                raw.write(arr.astype(dtype).tobytes())
                n += arr.size
            raw.flush()
            os.fsync(raw.fileno())
        if out.suffix == ".npy":  # the same ids behind an .npy header
            tmp.append(f"{raw.name}.npy")
            target = np.lib.format.open_memmap(tmp[-1], mode="w+", dtype=dtype, shape=(n,))
            if n:
                target[:] = np.memmap(raw.name, dtype=dtype, mode="r", shape=(n,))
            target.flush()
            del target
        meta = {"format": FORMAT, "dtype": dtype, "vocab_size": vocab_size, "num_tokens": n, **extra}
        _replace(tmp[-1], out)
        _write_text_atomic(sidecar_path(out), json.dumps(meta, indent=1) + "\n")
        return meta
    finally:
        for t in tmp:
            Path(t).unlink(missing_ok=True)


def _replace(tmp: str, final: Path) -> None:
    os.chmod(tmp, 0o644)
    os.replace(tmp, final)


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        _replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
