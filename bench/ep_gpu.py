"""One MoE layer, forward+backward, EP over NCCL ranks (one per GPU), bf16, CUDA grouped_mm: autoep vs
transformers' own EP vs plain, side by side in one run.

    python bench/ep_gpu.py                                   # every visible GPU is one rank
    python bench/ep_gpu.py --tokens 16384 --hidden 2048 --ffn 768 --experts 64 --top-k 8
    python bench/ep_gpu.py --cpu-check                       # the same code on 2 gloo CPU ranks, fp32, small

The block, weights and per-rank tokens are bench/ep_layer.py's (Qwen3MoeSparseMoeBlock; its helpers build every
contender), moved to the rank's GPU in bf16:
  plain          each rank runs the whole block (all experts) on its own tokens, no exchange
  autoep         apply_plan, batched recipe: all-to-all + the grouped GEMM (torch._grouped_mm, bf16, sm80+)
  hf-grouped_mm  transformers.distributed expert parallelism, ep_implementation="all_to_all", grouped_mm experts
Printed per contender (the slowest rank sets each step): tokens/s per rank; TFLOP/s per rank, counting the
expert GEMMs (gate_up 2*D*2F and down 2*F*D per routed (token, expert) pair) and the router (2*D*E per token),
forward and backward (x3); all-to-all bytes per step over all ranks (token rows only) against the minimum
(tokens x top_k x hidden x 2 B, dispatch and combine, forward and backward); all-to-all GB/s: those bytes over
the time spent inside the exchange calls, measured in one extra step with a CUDA sync around each call (the
timed steps have none). transformers' exchange runs through functional collectives whose backward is not
visible here: its forward payload is counted and doubled (the backward is the reverse exchange).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import ep_layer  # noqa: E402  (also puts tests/ on the path)

STATS = {"bytes": 0, "seconds": 0.0, "sync": False}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _instrument(fn, device: torch.device):
    """``fn`` (an all-to-all) counting its token-row payload, and timing it with a sync around when asked."""
    def wrapped(*args, **kwargs):
        # dist.all_to_all_single(output, input, ...) counts the rows received, transformers' (x, ...) the rows
        # sent: summed over the ranks, the same payload
        rows = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2), None)
        if rows is not None:  # the 1-D split-size exchange is not token payload
            STATS["bytes"] += rows.numel() * rows.element_size()
        if not STATS["sync"]:
            return fn(*args, **kwargs)
        _sync(device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        _sync(device)
        STATS["seconds"] += time.perf_counter() - t0
        return out
    return wrapped


def step(block, x, grad) -> None:
    out = block(x.clone().requires_grad_())
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad)
    block.zero_grad(set_to_none=True)


def timed(block, x, grad, steps: int, device: torch.device) -> float:
    """Median seconds of a forward+backward step, after two untimed ones; every rank starts each step together."""
    for _ in range(2):
        step(block, x, grad)
    times = []
    for _ in range(steps):
        _sync(device)
        dist.barrier()  # NOTE: collective; start every step together on all ranks
        t0 = time.perf_counter()
        step(block, x, grad)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def exchange_stats(block, x, grad, device: torch.device) -> tuple[int, float]:
    """(all-to-all bytes, seconds inside the exchange calls) of one step, synced around each call."""
    STATS.update(bytes=0, seconds=0.0, sync=True)
    step(block, x, grad)
    STATS["sync"] = False
    return STATS["bytes"], STATS["seconds"]


def worker(rank: int, world_size: int, args, name: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed import expert_parallel as hf_ep

    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    dist.all_to_all_single = _instrument(dist.all_to_all_single, device)
    hf_ep.all_to_all_single_autograd = _instrument(hf_ep.all_to_all_single_autograd, device)
    block = ep_layer.build_block(args).to(device, dtype)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1, args.tokens, args.hidden, generator=g).to(device, dtype)
    grad = torch.randn(1, args.tokens, args.hidden, generator=g).to(device, dtype)
    if name == "plain":
        b = block
    elif name == "autoep":
        b = ep_layer.autoep_block(block, init_device_mesh(device.type, (world_size,), mesh_dim_names=("ep",)))
    else:
        mesh2 = init_device_mesh(device.type, (world_size, 1), mesh_dim_names=("ep", "tp"))
        b = ep_layer.hf_block(block, mesh2["ep"], mesh2["tp"], name.removeprefix("hf-"))
    sec = timed(b, x, grad, args.steps, device)
    a2a, a2a_sec = exchange_stats(b, x, grad, device)
    if name.startswith("hf-"):
        a2a *= 2  # forward payload only is visible (module docstring)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"sec": sec, "a2a": a2a, "a2a_sec": a2a_sec, "peak_gib": peak}


def flops_per_rank(args) -> float:
    expert = 2 * args.hidden * 2 * args.ffn + 2 * args.ffn * args.hidden
    return 3 * args.tokens * (args.top_k * expert + 2 * args.hidden * args.experts)


def report(results: dict[str, list[dict]], args) -> None:
    import transformers

    W, item = args.world_size, (2 if args.device == "cuda" else 4)
    minimum = W * 4 * args.tokens * args.top_k * args.hidden * item
    where = (f"{W} NCCL ranks on {torch.cuda.get_device_name(0)}, bf16" if args.device == "cuda"
             else f"{W} gloo CPU ranks, fp32 (--cpu-check: the code path, not a measurement)")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; {where}; T={args.tokens}/rank "
          f"D={args.hidden} F={args.ffn} E={args.experts} top_k={args.top_k}; median of {args.steps} fwd+bwd steps")
    base = max(r["sec"] for r in results["autoep"])
    print(f"{'contender':<15}{'tok/s/rank':>12}{'vs autoep':>10}{'TFLOP/s/rank':>13}{'a2a bytes/step':>16}"
          f"{'/ min':>7}{'a2a GB/s':>10}{'peak GiB':>10}")
    for name, rows in results.items():
        sec = max(r["sec"] for r in rows)  # the slowest rank sets the step
        a2a, a2a_sec = sum(r["a2a"] for r in rows), max(r["a2a_sec"] for r in rows)
        gbps = a2a / W / a2a_sec / 1e9 if a2a_sec > 0 else float("nan")
        print(f"{name:<15}{args.tokens / sec:>12.0f}{base / sec:>9.2f}x{flops_per_rank(args) / sec / 1e12:>13.2f}"
              f"{a2a:>16,}{a2a / minimum:>7.3f}{gbps:>10.2f}{max(r['peak_gib'] for r in rows):>10.2f}")
    print(f"minimum a2a bytes/step = {W} ranks x 4 x {args.tokens} x {args.top_k} x {args.hidden} x {item} B = "
          f"{minimum:,}; a2a GB/s = bytes one rank sends and receives per step / its seconds inside the exchanges")


def spawn(args, name: str) -> list:
    """One process per rank (NCCL, one GPU each; gloo with --cpu-check)."""
    from distributed import spawn as spawn_ranks

    return spawn_ranks(args.world_size, "ep_gpu:worker", args, name,
                       backend="nccl" if args.device == "cuda" else "gloo")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=None, help="ranks (default: every visible GPU)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--contenders", nargs="*", default=["plain", "autoep", "hf-grouped_mm"])
    p.add_argument("--cpu-check", action="store_true", help="2 gloo CPU ranks, fp32, small sizes: the code path only")
    args = p.parse_args(argv)
    if args.cpu_check:
        args.device, args.world_size = "cpu", args.world_size or 2
        args.tokens, args.hidden, args.ffn, args.experts, args.top_k, args.steps = 256, 64, 32, 8, 2, 2
    else:
        if not torch.cuda.is_available():
            sys.exit("bench/ep_gpu.py needs CUDA GPUs (one NCCL rank each); on CPU run bench/ep_layer.py, or "
                     "--cpu-check to exercise this script's code path on gloo")
        args.device, args.world_size = "cuda", args.world_size or torch.cuda.device_count()
        if args.world_size > torch.cuda.device_count():
            sys.exit(f"--world-size {args.world_size} but {torch.cuda.device_count()} GPU(s) are visible")
    # One process group per contender, so each rank's peak memory is that contender's alone.
    results = {name: spawn(args, name) for name in args.contenders}
    report(results, args)


if __name__ == "__main__":
    main()
