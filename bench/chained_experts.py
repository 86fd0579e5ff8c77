"""All-to-alls and bytes exchanged per forward+backward of a LoRA-mixture block, its chains staged (each link in an
exchange of its own) against fused on the owner (``autoep.runtime.recipes.chains``), side by side in one gloo group.

    python bench/chained_experts.py                 # 2 ranks, 64 tokens per rank
    python bench/chained_experts.py --world 4 --tokens 256
    python bench/chained_experts.py --smoke         # the smallest run (tests/test_bench_smoke.py)

Blocks (``tests/role_blocks.py``, hidden D = 8, LoRA rank R = 4, E = 4 experts, top-2): ``LoraMixture3MoE``
(``lora_B[i](lora_A[i](lora_dropout[i](x[tok])))``), ``LoraDictMoE`` (the same in ModuleDicts), ``LoraChain3MoE``
(three modules per expert: ``lora_B[i](lora_M[i](lora_A[i](x)))``) and ``AdapterMixtureMoE`` (``up[i](F.gelu(
down[i](x)))``: the activation runs on the owner too). Each runs one untimed step per execution on
the same weights and tokens; counted on every rank and summed: ``all_to_all_single`` calls (the counts' exchange,
the rows, the outputs, and the backward's two), their payload bytes (floating rows and gradients) and the counts'
bytes; ratios are to the staged run. Per (token, expert) pair a staged chain of n links sends D + R(n - 1) wide
rows each way, forward and backward, against D when fused: the payload ratio is D / (D + R) for two links (0.667
here; ~0.996 at D = 4096, R = 16), while the all-to-alls per step drop to 1 / n whatever the sizes. Nothing is
timed.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
__import__("testpaths").add()

BLOCKS = ("LoraMixture3MoE", "LoraDictMoE", "LoraChain3MoE", "AdapterMixtureMoE")
EXECUTIONS = ("staged", "fused")


class Counter:
    """``all_to_all_single`` calls and the bytes each rank puts in (floating payload and integer counts apart)."""

    def __init__(self):
        self.calls = self.payload = self.counts = 0
        self.original = dist.all_to_all_single

    def __call__(self, output, input, *args, **kwargs):
        self.calls += 1
        nbytes = input.numel() * input.element_size()
        if input.is_floating_point():
            self.payload += nbytes
        else:
            self.counts += nbytes
        return self.original(output, input, *args, **kwargs)


def step(block_name: str, execution: str, rank: int, world: int, tokens: int) -> dict:
    """One forward+backward of the block under EP with ``execution``; what this rank exchanged."""
    import role_blocks as rb
    from torch.distributed.device_mesh import init_device_mesh

    from autoep.plan.resolve import resolve_plan
    from autoep.runtime.apply import apply_plan
    from autoep.runtime.recipes import chains

    torch.manual_seed(0)
    model = nn.ModuleDict({"mlp": getattr(rb, block_name)()})
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    apply_plan(model, resolve_plan({"ep_size": world, "plan": [{"match": "mlp", "execution": "replay"}]}, model), mesh)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1, tokens, rb.D, generator=g, requires_grad=True)
    grad = torch.randn(1, tokens, rb.D, generator=g)
    counter = Counter()
    chains.FUSE, dist.all_to_all_single = execution == "fused", counter
    try:
        torch.manual_seed(1 + rank)
        (model["mlp"](x) * grad).sum().backward()
    finally:
        chains.FUSE, dist.all_to_all_single = True, counter.original
    return {"calls": counter.calls, "payload": counter.payload, "counts": counter.counts}


def rank_main(rank: int, world: int, port: int, tokens: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    rows = {(b, e): step(b, e, rank, world, tokens) for b in BLOCKS for e in EXECUTIONS}
    torch.save(rows, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    parser.add_argument("--smoke", action="store_true", help="2 ranks, 8 tokens per rank")
    args = parser.parse_args()
    if args.smoke:
        args.world, args.tokens = 2, 8
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(rank_main, args=(args.world, port, args.tokens, out_dir), nprocs=args.world, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(args.world)]
    print(f"LoRA chains under EP, {args.world} gloo ranks, {args.tokens} tokens per rank, one forward+backward, "
          "summed over ranks")
    print(f"{'block':<19}{'execution':<10}{'all-to-alls':>12}{'payload B':>11}{'counts B':>10}"
          f"{'a2a ratio':>11}{'payload ratio':>15}{'bytes ratio':>13}")
    for block in BLOCKS:
        total = {e: {k: sum(r[(block, e)][k] for r in ranks) for k in ("calls", "payload", "counts")}
                 for e in EXECUTIONS}
        for e in EXECUTIONS:
            t, base = total[e], total["staged"]
            print(f"{block:<19}{e:<10}{t['calls']:>12,}{t['payload']:>11,}{t['counts']:>10,}"
                  f"{t['calls'] / base['calls']:>11.3f}{t['payload'] / base['payload']:>15.3f}"
                  f"{(t['payload'] + t['counts']) / (base['payload'] + base['counts']):>13.3f}")


if __name__ == "__main__":
    main()
