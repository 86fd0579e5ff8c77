"""Real data (``autoep.train.tokens``, ``autoep.train.prepare``): a tokenizer built here from a few lines of text
(never downloaded), a packed token file prepared from it, and training on it.

- prepare writes exactly the tokenizer's ids (+ EOS per file), .bin and .npy alike, with its sidecar, and
  leaves no temporary file;
- training windows: each epoch reads every window once, in a seeded order; validation reads them in order;
- a tokens run on 2 ranks at ep_size=2 equals one process (losses, validation losses, weights), and a run
  of 6 steps equals 3 steps + a resume for 3 more, in one process and on 2 ranks resuming at ep_size=1;
- every file or key that cannot be used is refused naming the key, the value and the fix.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import spawn
from hydra import compose, initialize_config_dir
from torch.distributed.tensor import DTensor

from autoep.errors import ConfigError
from autoep.train import tokens
from autoep.train.config import CONF_DIR, check_config
from autoep.train.data import Loader, TokenWindows, Validation, make_source, make_splits
from autoep.train.prepare import main as prepare_main
from autoep.train.prepare import prepare

SUBJECTS = ["the cat", "a dog", "my bird", "the old man", "a small child"]
VERBS = ["sees", "likes", "follows", "finds", "hears"]
OBJECTS = ["the ball", "a tree", "the river", "a red house", "the moon"]


def write_tokenizer(directory: Path, lines: list[str]) -> Path:
    """A word-level tokenizer trained on ``lines``, saved as a HF tokenizer directory (AutoTokenizer loads it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Two text files, a tokenizer dir and their packed file (plus its .npy twin)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    lines = [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} ." for _ in range(600)]
    texts = [root / "a.txt", root / "b.txt"]
    texts[0].write_text("\n".join(lines[:400]) + "\n")
    texts[1].write_text("\n".join(lines[400:]) + "\n")
    tok = write_tokenizer(root / "tok", lines)
    out = {"root": root, "texts": texts, "tok": tok, "bin": root / "data" / "train.bin",
           "npy": root / "data" / "train.npy"}
    out["meta"] = prepare([str(t) for t in texts], str(tok), str(out["bin"]), chunk_mb=0.001)  # many pieces per file
    prepare([str(t) for t in texts], str(tok), str(out["npy"]))
    return out


def test_prepare_writes_the_tokenizers_ids_with_a_sidecar(corpus):
    tokenizer = tokens.load_tokenizer(corpus["tok"])
    expected = [i for t in corpus["texts"] for i in tokenizer(t.read_text(), add_special_tokens=False)["input_ids"]
                + [tokenizer.eos_token_id]]
    ids, meta = tokens.open_tokens(corpus["bin"])
    assert ids.tolist() == expected and meta == corpus["meta"]
    assert meta["dtype"] == "uint16" and meta["num_tokens"] == len(expected) and meta["vocab_size"] == len(tokenizer)
    assert meta["tokenizer"]["path"] == str(corpus["tok"].absolute())
    npy, npy_meta = tokens.open_tokens(corpus["npy"])
    assert npy.tolist() == expected and npy_meta["num_tokens"] == len(expected)
    assert sorted(p.name for p in corpus["bin"].parent.iterdir()) == [
        "train.bin", "train.bin.json", "train.npy", "train.npy.json"]  # no temporary file left behind


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_a_vocabulary_past_16_bits_is_written_as_uint32(tmp_path, suffix):
    ids = [[0, 65535, 65536], [69999]]
    meta = tokens.write_tokens(tmp_path / f"big{suffix}", iter(ids), vocab_size=70000, extra={})
    read, read_meta = tokens.open_tokens(tmp_path / f"big{suffix}")
    assert meta == read_meta and meta["dtype"] == "uint32" and read.tolist() == [0, 65535, 65536, 69999]
    with pytest.raises(ConfigError, match="an id 70000 is outside its vocabulary of 70000"):
        tokens.write_tokens(tmp_path / f"bad{suffix}", iter([[1, 70000]]), vocab_size=70000, extra={})
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"big{suffix}", f"big{suffix}.json"]


def test_text_source_with_the_tokenizer_reads_its_ids(corpus):
    text, tok = corpus["texts"][0], corpus["tok"]
    ids = tokens.load_tokenizer(tok)(text.read_text(), add_special_tokens=False)["input_ids"]
    src = make_source("text", vocab_size=128, seq_len=5, seed=0, path=str(text), tokenizer_path=str(tok))
    windows = torch.tensor(ids[:len(ids) // 5 * 5]).view(-1, 5)
    torch.testing.assert_close(src.in_order(0, len(windows)), windows)


def test_training_windows_cover_every_window_once_per_epoch_in_a_seeded_order():
    ids = torch.arange(50).numpy()  # 10 windows of 5
    src = TokenWindows(ids, 5, seed=1, what="x")
    rows = torch.cat([src.global_batch(i, 4) for i in range(5)])  # 20 rows: two epochs, one batch straddling them
    for epoch in (rows[:10], rows[10:]):
        assert sorted(epoch[:, 0].tolist()) == list(range(0, 50, 5))
        torch.testing.assert_close(epoch, epoch[:, :1] + torch.arange(5))  # whole windows, never across two
    assert not torch.equal(rows[:10], rows[10:])  # each epoch its own order
    torch.testing.assert_close(TokenWindows(ids, 5, seed=1, what="x").global_batch(3, 4), rows[12:16])
    single = Loader(src, batch_size=4, rank=0, world_size=1)
    ranks = [Loader(src, batch_size=2, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        torch.testing.assert_close(single.next(), torch.cat([r.next() for r in ranks]))


def test_held_out_fraction_and_validation_batches(corpus):
    train, held = make_splits("tokens", vocab_size=128, seq_len=8, seed=0, path=str(corpus["bin"]), val_fraction=0.25)
    n = corpus["meta"]["num_tokens"]
    assert len(train.tokens) + len(held.tokens) == n and len(held.tokens) == int(n * 0.25)
    assert held.tokens.tolist() == tokens.open_tokens(corpus["bin"])[0][n - len(held.tokens):].tolist()
    whole = [b for b in Validation(held, batch_size=4, rank=0, world_size=1, batches=3).batches()]
    halves = [[b for b in Validation(held, batch_size=2, rank=r, world_size=2, batches=3).batches()] for r in range(2)]
    assert len(whole) == 3
    for i, batch in enumerate(whole):
        torch.testing.assert_close(batch, torch.cat([halves[0][i], halves[1][i]]))
        torch.testing.assert_close(batch, held.in_order(i, 4))


def _compose(*overrides: str):
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_unusable_files_and_keys_are_refused_by_name(corpus, tmp_path, capsys):
    bin_, tok, text = corpus["bin"], corpus["tok"], corpus["texts"][0]
    cases = [
        (lambda: tokens.load_tokenizer(tmp_path / "nope"), r"data.tokenizer_path=.*nope: not found .*never downloads"),
        (lambda: tokens.load_tokenizer(tmp_path), r"data.tokenizer_path=.*: not a loadable HF tokenizer directory"),
        (lambda: make_splits("tokens", vocab_size=16, seq_len=8, seed=0, path=str(bin_)),
         r"data.path=.*train.bin holds ids of a 24-token vocabulary .* model.vocab_size=16; .*model.vocab_size>=24"),
        (lambda: make_source("text", vocab_size=16, seq_len=8, seed=0, path=str(text), tokenizer_path=str(tok)),
         r"data.tokenizer_path=.* has 24 tokens but model.vocab_size=16"),
        (lambda: Validation(make_splits("tokens", vocab_size=128, seq_len=8, seed=0, path=str(bin_),
                                        val_fraction=0.01)[1], batch_size=8, rank=0, world_size=2, batches=0),
         r"validation split holds 4 rows of data.seq_len=8, fewer than one global batch \(data.batch_size=8 x 2 "),
        (lambda: make_splits("tokens", vocab_size=128, seq_len=8, seed=0, path=str(bin_), val_fraction=0.001),
         r"data.val_fraction=0.001 of data.path=.* holds 3 tokens, fewer than one row of data.seq_len=8"),
        (lambda: check_config(_compose("data.source=tokens")), r"data.source=tokens needs data.path="),
        (lambda: check_config(_compose("data.source=tokens", f"data.path={text}")),
         r"data.path=.*a.txt: a packed token file ends in .bin or .npy"),
        (lambda: check_config(_compose("trainer.val_every=5")), r"trainer.val_every=5 needs a validation split"),
        (lambda: check_config(_compose(f"data.tokenizer_path={tok}")), r"data.tokenizer_path=.* is only read with "
                                                                       r"data.source=text or data.source=tokens"),
        (lambda: check_config(_compose("data.source=tokens", f"data.path={bin_}", f"data.val_path={bin_}",
                                       "data.val_fraction=0.1")), "give one validation split"),
        (lambda: check_config(_compose("data.val_fraction=1")), r"data.val_fraction=1.0: must be a finite number >= 0 "
                                                                r"and < 1"),
    ]
    other = write_tokenizer(tmp_path / "other", ["just two"])
    cases.append((lambda: make_splits("tokens", vocab_size=128, seq_len=8, seed=0, path=str(bin_),
                                      tokenizer_path=str(other)), r"has 4 tokens but data.path=.* 24-token vocabulary"))
    lone = tmp_path / "lone.bin"
    lone.write_bytes(b"\0\0" * 10)
    cases.append((lambda: tokens.open_tokens(lone), r"data.path=.*lone.bin: no lone.bin.json beside it"))
    cut = tmp_path / "cut.bin"
    cut.write_bytes(bin_.read_bytes()[:-2])
    (tmp_path / "cut.bin.json").write_text(tokens.sidecar_path(bin_).read_text())
    cases.append((lambda: tokens.open_tokens(cut), rf"cut.bin holds {2 * corpus['meta']['num_tokens'] - 2} bytes, its "
                                                   rf"sidecar says {corpus['meta']['num_tokens']} uint16 ids"))
    for call, message in cases:
        with pytest.raises(ConfigError, match=message):
            call()
    with pytest.raises(SystemExit) as exit_info:
        prepare_main([str(text), "--tokenizer", str(tmp_path / "nope"), "--out", str(tmp_path / "x.bin")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("autoep-prepare-data: error: --tokenizer=")
    assert not (tmp_path / "x.bin").exists()


# ---- training on a packed file ------------------------------------------------------------------

GLOBAL_ROWS = 4
SMALL = ["trainer.log_every=100", "data.seq_len=16", "trainer.device=cpu", "data.source=tokens",
         "data.val_fraction=0.2", "trainer.val_every=2", "trainer.val_batches=2",
         # constant lr after warmup: a 3-step run continued to 6 steps has the 6-step run's schedule
         "optim.warmup_steps=2", "optim.min_lr_ratio=1.0", "optim.lr=0.01"]


def train_run(data: str, *overrides: str) -> dict:
    from autoep.train.trainer import train

    result = train(_compose(*SMALL, f"data.path={data}", *overrides))
    model = result.pop("model")
    if dist.is_initialized():
        dist.barrier()  # rank 0 writes metrics.jsonl: every rank reads it after rank 0's last row (ep_size=1 has no
        # expert DTensor whose gather below would wait for it)
    result["weights"] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                         for n, p in model.named_parameters()}  # NOTE: gathers expert shards (collective)
    rows = [json.loads(line) for line in (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    result["val"] = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    result["all_losses"] = [r["loss"] for r in rows]
    return result


def two_rank_worker(rank: int, world_size: int, data: str, tmp: str) -> dict:
    rows = f"data.batch_size={GLOBAL_ROWS // world_size}"
    out = {"full": train_run(data, "parallel.ep_size=2", rows, "trainer.steps=6", f"run_dir={tmp}/ep2")}
    train_run(data, "parallel.ep_size=2", rows, "trainer.steps=3", "trainer.ckpt_every=3", f"run_dir={tmp}/ep2_half")
    out["resumed_ep1"] = train_run(data, "parallel.ep_size=1", rows, "trainer.steps=6", f"run_dir={tmp}/ep1_resumed",
                                   f"trainer.resume={tmp}/ep2_half/checkpoints/step_00000003")
    return out


def assert_same_training(a: dict, b: dict, *, losses_from: int = 0) -> None:
    """Same losses and final weights; the same validation losses at the steps ``a`` trained (a run that was
    resumed also holds its first part's rows, validated at that part's last step)."""
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"][losses_from:]))
    val_a, val_b = ({s: v for s, v in x["val"].items() if s > losses_from} for x in (a, b))
    assert val_a.keys() == val_b.keys() and val_a
    torch.testing.assert_close(torch.tensor(list(val_a.values())), torch.tensor(list(val_b.values())))
    assert a["weights"].keys() == b["weights"].keys()
    for name in a["weights"]:
        torch.testing.assert_close(a["weights"][name], b["weights"][name], msg=lambda m, n=name: f"{n}: {m}")


def test_tokens_run_ep2_equals_one_process_and_resumes_exactly(corpus, tmp_path):
    data = str(corpus["bin"])
    ranks = spawn(2, "test_tokens:two_rank_worker", data, str(tmp_path))
    rows = f"data.batch_size={GLOBAL_ROWS}"
    single = train_run(data, rows, "trainer.steps=6", f"run_dir={tmp_path}/one")
    assert list(single["val"]) == [2, 4, 6] and single["val"][6] < single["val"][2]  # it learns, measured held out
    train_run(data, rows, "trainer.steps=3", "trainer.ckpt_every=3", f"run_dir={tmp_path}/half")
    resumed = train_run(data, rows, "trainer.steps=6", "trainer.resume=latest", f"run_dir={tmp_path}/half")
    assert_same_training(resumed, single, losses_from=3)  # 3 steps + resume 3 == 6 steps
    assert resumed["all_losses"] == single["all_losses"]  # metrics.jsonl holds the whole run, once
    for r in ranks:
        assert_same_training(r["full"], single)  # EP ranks each evaluate their share: the global mean
        assert_same_training(r["resumed_ep1"], single, losses_from=3)  # resumed at another ep_size
