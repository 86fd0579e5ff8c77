"""Training-step throughput and peak memory per rank of the default model at ep=1 and ep=2 (dense params
replicated, and FSDP2-sharded with ``trainer.dense_sharding=fsdp2``), side by side.

All runs train on the same global batch (ep=1: one process with 2*B rows; ep=2: two gloo ranks with B
rows each), so tokens/s compare directly. Peak memory is the process's peak RSS on CPU (imports
included, so the difference is what matters) or ``torch.cuda.max_memory_allocated`` on GPU. ::

    python bench/train_step.py                       # defaults: 40 steps, B=8 per rank, seq_len 32
    python bench/train_step.py --steps 60 --batch-size 16 --seq-len 64
    python bench/train_step.py --smoke               # the smallest run, a code check (tests/test_bench_smoke.py)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hydra import compose, initialize_config_dir

WARMUP = 5  # steps excluded from the throughput median (allocator and thread-pool warm-up)
SMOKE = {"steps": WARMUP + 1, "batch_size": 2, "seq_len": 8}  # one step past the warm-up: the median has a value


def one_run(rank: int, world: int, port: int, ep: int, dense: str, args, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # one thread per rank: ep=1 and ep=2 use one core per rank, no oversubscription
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
    from autoep.train.config import CONF_DIR
    from autoep.train.trainer import train

    name = f"ep{ep}_{dense}"
    overrides = [f"parallel.ep_size={ep}", f"trainer.dense_sharding={dense}", f"trainer.steps={args.steps}", f"data.batch_size={args.batch_size * 2 // world}",
                 f"data.seq_len={args.seq_len}", "trainer.log_every=100000", f"run_dir={out_dir}/{name}"]
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    result = train(cfg)
    params = dict(result["model"].named_parameters())
    local_bytes = {n: (p.to_local() if hasattr(p, "to_local") else p).nbytes for n, p in params.items()}
    expert_bytes = sum(b for n, b in local_bytes.items() if ".experts." in n)
    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    with open(f"{out_dir}/{name}_rank{rank}.json", "w") as f:
        json.dump({"peak_bytes": peak, "expert_bytes": expert_bytes,
                   "dense_bytes": sum(local_bytes.values()) - expert_bytes}, f)
    if world > 1:
        dist.destroy_process_group()


def measure(ep: int, dense: str, args, out_dir: str) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(one_run, args=(ep, port, ep, dense, args, out_dir), nprocs=ep, join=True)
    name = f"ep{ep}_{dense}"
    rows = [json.loads(line) for line in open(f"{out_dir}/{name}/metrics.jsonl")]
    ranks = [json.load(open(f"{out_dir}/{name}_rank{r}.json")) for r in range(ep)]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[WARMUP:]),
            "final_loss": rows[-1]["loss"], "peak_mib": max(r["peak_bytes"] for r in ranks) / 2**20,
            "expert_kib": ranks[0]["expert_bytes"] / 1024, "dense_kib": ranks[0]["dense_bytes"] / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8, help="rows per rank at ep=2 (ep=1 gets twice as many)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--smoke", action="store_true",
                        help=f"the smallest run, a code check (tests/test_bench_smoke.py): {SMOKE}; flags given win")
    args = parser.parse_args()
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
    runs = ((1, "replicate"), (2, "replicate"), (2, "fsdp2"))
    with tempfile.TemporaryDirectory() as out_dir:
        results = [measure(ep, dense, args, out_dir) for ep, dense in runs]
    print(f"default model, {args.steps} steps, global batch {2 * args.batch_size} x {args.seq_len} tokens, CPU gloo")
    print(f"{'':28}{'ep=1 (1 rank)':>16}{'ep=2 replicate':>16}{'ep=2 fsdp2':>16}{'ep2/ep1':>10}{'fsdp2/repl':>12}")
    for key, label in (("tokens_per_s", "tokens/s (global)"), ("peak_mib", "peak memory/rank (MiB)"),
                       ("expert_kib", "expert params/rank (KiB)"), ("dense_kib", "dense params/rank (KiB)"),
                       ("final_loss", "final loss")):
        a, b, c = (r[key] for r in results)
        print(f"{label:28}{a:>16,.3f}{b:>16,.3f}{c:>16,.3f}{b / a:>10.2f}{c / b:>12.2f}")


if __name__ == "__main__":
    main()
