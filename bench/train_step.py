"""Training-step throughput and peak memory per rank of the default model at ep=1 and ep=2, side by side.

Both runs train on the same global batch (ep=1: one process with 2*B rows; ep=2: two gloo ranks with B
rows each), so tokens/s compare directly. Peak memory is the process's peak RSS on CPU (imports
included, so the difference is what matters) or ``torch.cuda.max_memory_allocated`` on GPU. ::

    python bench/train_step.py                       # defaults: 40 steps, B=8 per rank, seq_len 32
    python bench/train_step.py --steps 60 --batch-size 16 --seq-len 64
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


def one_run(rank: int, world: int, port: int, ep: int, args, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # one thread per rank: ep=1 and ep=2 use one core per rank, no oversubscription
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
    from autoep.plan import CONF_DIR
    from autoep.train import train

    overrides = [f"parallel.ep_size={ep}", f"trainer.steps={args.steps}", f"data.batch_size={args.batch_size * 2 // world}",
                 f"data.seq_len={args.seq_len}", "trainer.log_every=100000", f"run_dir={out_dir}/ep{ep}"]
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    result = train(cfg)
    expert_bytes = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes
                       for n, p in result["model"].named_parameters() if ".experts." in n)
    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    with open(f"{out_dir}/ep{ep}_rank{rank}.json", "w") as f:
        json.dump({"peak_bytes": peak, "expert_bytes": expert_bytes}, f)
    if world > 1:
        dist.destroy_process_group()


def measure(ep: int, args, out_dir: str) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(one_run, args=(ep, port, ep, args, out_dir), nprocs=ep, join=True)
    rows = [json.loads(line) for line in open(f"{out_dir}/ep{ep}/metrics.jsonl")]
    ranks = [json.load(open(f"{out_dir}/ep{ep}_rank{r}.json")) for r in range(ep)]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[WARMUP:]),
            "final_loss": rows[-1]["loss"], "peak_mib": max(r["peak_bytes"] for r in ranks) / 2**20,
            "expert_kib": ranks[0]["expert_bytes"] / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8, help="rows per rank at ep=2 (ep=1 gets twice as many)")
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out_dir:
        results = {ep: measure(ep, args, out_dir) for ep in (1, 2)}
    print(f"default model, {args.steps} steps, global batch {2 * args.batch_size} x {args.seq_len} tokens, CPU gloo")
    print(f"{'':28}{'ep=1 (1 rank)':>16}{'ep=2 (2 ranks)':>16}{'ratio ep2/ep1':>16}")
    for key, label in (("tokens_per_s", "tokens/s (global)"), ("peak_mib", "peak memory/rank (MiB)"),
                       ("expert_kib", "expert params/rank (KiB)"), ("final_loss", "final loss")):
        a, b = results[1][key], results[2][key]
        print(f"{label:28}{a:>16,.3f}{b:>16,.3f}{b / a:>16.2f}")


if __name__ == "__main__":
    main()
