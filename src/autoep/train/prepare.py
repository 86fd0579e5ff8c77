"""``autoep-prepare-data``: tokenize local text files once into a packed token file a run maps (``data.source=tokens``).

Commands (no download: the tokenizer is a local directory)::

    autoep-prepare-data corpus/*.txt --tokenizer path/to/tokenizer --out data/train.bin
    python -m autoep.train.prepare held_out.txt --tokenizer path/to/tokenizer --out data/val.bin
    autoep-train data.source=tokens data.path=data/train.bin data.val_path=data/val.bin trainer.val_every=50

Each input file is one document: its tokens (no special tokens), then the tokenizer's end-of-sequence id
where it has one. A file is encoded in pieces of about ``--chunk-mb`` MiB cut at line ends, so a big file
never sits in memory whole (a tokenizer that merges across a line end may cut a token there differently
than on the whole file; one piece per file when the file is smaller). The ids go to ``--out``
(``.bin``: raw uint16 ids when the vocabulary fits 16 bits, else uint32; ``.npy``: the same with numpy's
header) and the sidecar ``<out>.json`` (dtype, vocab size, token count, tokenizer), each written to a
temporary name and renamed, so a reader never sees half a file. Errors are one line, exit code 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autoep.errors import ConfigError
from autoep.train import tokens

PROG = "autoep-prepare-data"


def text_pieces(path: Path, chunk_bytes: int):
    """The text of ``path`` in pieces of about ``chunk_bytes``, each ending at a line end (or the file's end)."""
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        piece, size = [], 0
        for line in f:
            piece.append(line)
            size += len(line)
            if size >= chunk_bytes:
                yield "".join(piece)
                piece, size = [], 0
        if piece:
            yield "".join(piece)


def document_ids(files: list[Path], tokenizer, chunk_bytes: int):
    """The id lists to write: each file's pieces, then the end-of-sequence id after each file."""
    eos = tokenizer.eos_token_id
    for path in files:
        for piece in text_pieces(path, chunk_bytes):
            yield tokens.encode(tokenizer, [piece])[0]
        if eos is not None:
            yield [eos]


def prepare(files: list[str], tokenizer_path: str, out: str, chunk_mb: float = 1.0) -> dict:
    """Tokenize ``files`` with the local tokenizer ``tokenizer_path`` into packed file ``out``; returns its sidecar."""
    paths = [Path(f) for f in files]
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"{path}: {'a directory' if path.is_dir() else 'not found'}; give local text files")
    if not str(out).endswith(tokens.SUFFIXES):
        raise ConfigError(f"--out {out}: a packed token file ends in .bin or .npy")
    tokenizer = tokens.load_tokenizer(tokenizer_path, key="--tokenizer")
    extra = {"tokenizer": tokens.describe_tokenizer(tokenizer, tokenizer_path),
             "documents": [str(p.absolute()) for p in paths], "eos_appended": tokenizer.eos_token_id is not None}
    return tokens.write_tokens(out, document_ids(paths, tokenizer, int(chunk_mb * 2 ** 20)),
                               vocab_size=len(tokenizer), extra=extra)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="local text files; each is one document")
    parser.add_argument("--tokenizer", required=True, help="a local HF tokenizer directory (never a Hub id)")
    parser.add_argument("--out", required=True, help="the packed token file to write: <name>.bin or <name>.npy")
    parser.add_argument("--chunk-mb", type=float, default=1.0, help="MiB of text encoded at a time (default 1)")
    args = parser.parse_args(argv)
    try:
        meta = prepare(args.files, args.tokenizer, args.out, args.chunk_mb)
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{args.out}: {meta['num_tokens']} tokens ({meta['dtype']}, vocab {meta['vocab_size']}) from "
          f"{len(args.files)} file(s); sidecar {tokens.sidecar_path(args.out)}")


if __name__ == "__main__":
    main()
