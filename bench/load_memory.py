"""Peak host memory per rank while loading a local HF checkpoint at ep=2: autoep's per-rank slice loading
against a full load, side by side.

- **slices**: ``autoep.train.trainer.build_model`` with ``model=hf_pretrained`` (meta -> resolve -> apply_plan ->
  each rank reads the dense tensors and only its own experts from the safetensors files).
- **full**: each rank ``AutoModelForCausalLM.from_pretrained(path)`` (every expert), then ``apply_plan``
  keeps its half: what loading without slicing costs.

Each variant runs in a fresh Python process that spawns its own 2 gloo ranks; a rank's figure is the growth
of its peak RSS (``ru_maxrss``) from just before the load to just after it (imports and process group
excluded). The checkpoint is a Qwen3-MoE written once by ``save_pretrained`` (fp32, safetensors). ::

    python bench/load_memory.py                          # 4 layers, 32 experts, hidden 256, expert FFN 512
    python bench/load_memory.py --layers 8 --experts 64
    python bench/load_memory.py --only state --world 4 --ep 2   # training state, (edp, ep) = (2, 2)
    python bench/load_memory.py --smoke                  # the smallest model, a code check (tests/test_bench_smoke.py)

Training state (``--only state``, also printed after the load table): bytes each rank holds after one AdamW step,
for params + grads + optimizer moments, experts and dense apart, ``trainer.expert_sharding`` replicate vs fsdp2
(``autoep.runtime.expert_fsdp``) on ``--world`` gloo ranks at ``ep = --ep``, against the 1/(ep*edp) limit of the
experts' total. Counted from the tensors' local storage (not RSS): what the rank keeps between steps.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile

VARIANTS = ("slices", "full")
SMOKE = {"layers": 1, "experts": 4, "hidden": 32, "expert_ffn": 32, "vocab": 128}


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class AnonPeak:
    """Peak of ``RssAnon`` (private memory: tensors, not the mmapped safetensors pages) sampled every 2 ms."""

    def __init__(self):
        import threading

        self.peak, self._stop = self.now(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.now())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.now())


def rank_main(rank: int, world: int, port: int, variant: str, path: str, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    from hydra import compose, initialize_config_dir
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    from autoep.plan.resolve import resolve_plan
    from autoep.runtime.apply import apply_plan
    from autoep.train.config import CONF_DIR
    from autoep.train.trainer import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("edp", "ep"))
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["model=hf_pretrained", f"model.pretrained_path={path}",
                                          f"parallel.ep_size={world}"])
    with torch.device("meta"):  # warm-up outside the measurement: modeling imports, detection caches
        resolve_plan(cfg.parallel, AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)))
    dist.barrier()
    before, anon_before, anon = rss_mib(), AnonPeak.now(), AnonPeak()
    if variant == "slices":
        model, _ = build_model(cfg, mesh, torch.device("cpu"))
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
        apply_plan(model, resolve_plan(cfg.parallel, model), mesh)
    peak, anon_peak = rss_mib() - before, anon.stop() - anon_before
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    expert = sum(t.nbytes for t, p in zip(local, model.parameters()) if hasattr(p, "to_local"))
    with open(f"{out_dir}/{variant}_rank{rank}.json", "w") as f:
        json.dump({"peak_mib": peak, "anon_mib": anon_peak, "params_mib": sum(t.nbytes for t in local) / 2**20, "expert_mib": expert / 2**20}, f)
    dist.barrier()
    dist.destroy_process_group()


SHARDINGS = ("replicate", "fsdp2")


def state_main(rank: int, world: int, port: int, ep: int, sharding: str, config: dict, out_dir: str) -> None:
    """One rank: the model at ``(world // ep, ep)``, experts ``sharding``; one AdamW step; local bytes to json."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    from hydra import compose, initialize_config_dir
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from autoep.plan.resolve import resolve_plan
    from autoep.runtime import grads
    from autoep.runtime.apply import apply_plan
    from autoep.runtime.expert_fsdp import shard_experts_over_edp
    from autoep.runtime.recipes import local_tensor
    from autoep.train.config import CONF_DIR
    from autoep.train.loop import causal_lm_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("edp", "ep"))
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        parallel = compose("train", overrides=[f"parallel.ep_size={ep}"]).parallel
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**config))
    parallel = resolve_plan(parallel, model)
    apply_plan(model, parallel, mesh)
    if sharding == "fsdp2":
        shard_experts_over_edp(model, [m for e in parallel.plan for m in e.decision.modules], mesh)
    dense, expert = grads.split_params(model)
    optimizer = torch.optim.AdamW(dense + expert, lr=1e-3, foreach=False)
    batch = torch.randint(config["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(rank))
    (causal_lm_loss(model, batch) / world).backward()
    grads.reduce_grads(dense, expert, dist.group.WORLD, mesh["edp"].get_group())
    optimizer.step()

    def nbytes(params) -> dict:
        local = [(local_tensor(p), p) for p in params]
        moments = [local_tensor(v) for _, p in local for k, v in optimizer.state[p].items() if k != "step"]
        return {"params": sum(t.nbytes for t, _ in local), "global": sum(p.numel() * p.element_size() for _, p in local),
                "grads": sum(local_tensor(p.grad).nbytes for _, p in local if p.grad is not None),
                "optim": sum(t.nbytes for t in moments)}

    with open(f"{out_dir}/state_{sharding}_rank{rank}.json", "w") as f:
        json.dump({"expert": nbytes(expert), "dense": nbytes(dense)}, f)
    dist.barrier()
    dist.destroy_process_group()


def run_state(sharding: str, out_dir: str, world: int, ep: int, config: dict) -> None:
    """In this (fresh) process: spawn ``world`` ranks measuring the training state with experts ``sharding``."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(state_main, args=(world, port, ep, sharding, config, out_dir), nprocs=world, join=True)


def state_table(args, tmp: str) -> None:
    """Bytes per rank of params + grads + AdamW moments, replicate vs fsdp2, against the 1/(ep*edp) limit."""
    config = qwen3_config(args)
    for sharding in SHARDINGS:
        subprocess.run([sys.executable, __file__, "--state", sharding, "--out", tmp, "--world", str(args.world),
                        "--ep", str(args.ep), "--config", json.dumps(config)], check=True)
    rows = {s: [json.load(open(f"{tmp}/state_{s}_rank{r}.json")) for r in range(args.world)] for s in SHARDINGS}
    mib = 2**20
    # The experts' total over the model: each global expert tensor once (a DTensor's numel is the global one),
    # times four: params + grads + two AdamW moments.
    expert_total = rows["replicate"][0]["expert"]["global"] * 4 / mib
    limit = expert_total / args.world
    print(f"\ntraining state after one AdamW step, fp32, (edp, ep) = ({args.world // args.ep}, {args.ep}) gloo ranks: "
          f"experts {expert_total:.1f} MiB in all (params + grads + 2 moments), 1/(ep*edp) = {limit:.2f} MiB per rank")
    print(f"{'rank':>4}{'experts replicate':>19}{'experts fsdp2':>15}{'fsdp2 / limit':>15}{'dense (both)':>14}")
    for r in range(args.world):
        rep, fsdp = (sum(rows[s][r]["expert"][k] for k in ("params", "grads", "optim")) / mib for s in SHARDINGS)
        dense = sum(rows["fsdp2"][r]["dense"][k] for k in ("params", "grads", "optim")) / mib
        print(f"{r:>4}{rep:>19.2f}{fsdp:>15.2f}{fsdp / limit:>15.3f}{dense:>14.2f}")


def qwen3_config(args) -> dict:
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                moe_intermediate_size=args.expert_ffn, num_hidden_layers=args.layers, num_attention_heads=4,
                num_key_value_heads=2, num_experts=args.experts, num_experts_per_tok=2)


def run_variant(variant: str, path: str, out_dir: str, world: int) -> None:
    """In this (fresh) process: spawn ``world`` ranks that load ``path`` the ``variant`` way."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(world, port, variant, path, out_dir), nprocs=world, join=True)


def write_checkpoint(path: str, args) -> float:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**qwen3_config(args))
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return sum(p.nbytes for p in model.parameters()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--expert-ffn", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--ep", type=int, default=2, help="ep size of the training-state table (world // ep = edp)")
    parser.add_argument("--only", choices=("load", "state"), help="print one of the two tables")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: one fresh process
    parser.add_argument("--state", choices=SHARDINGS, help=argparse.SUPPRESS)  # internal: one fresh process
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true",
                        help=f"the smallest model, a code check (tests/test_bench_smoke.py): {SMOKE}; flags given win")
    args = parser.parse_args()
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
    if args.variant:
        return run_variant(args.variant, args.path, args.out, args.world)
    if args.state:
        return run_state(args.state, args.out, args.world, args.ep, json.loads(args.config))
    if args.only != "state":
        load_table(args)
    if args.only != "load":
        with tempfile.TemporaryDirectory() as tmp:
            state_table(args, tmp)


def load_table(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        total = write_checkpoint(f"{tmp}/ckpt", args)
        for variant in VARIANTS:
            subprocess.run([sys.executable, __file__, "--variant", variant, "--path", f"{tmp}/ckpt", "--out", tmp,
                            "--world", str(args.world)], check=True)
        rows = {v: [json.load(open(f"{tmp}/{v}_rank{r}.json")) for r in range(args.world)] for v in VARIANTS}
    expert_total = rows["slices"][0]["expert_mib"] * args.world
    dense = total - expert_total
    print(f"Qwen3-MoE {args.layers} layers, {args.experts} experts, hidden {args.hidden}, expert FFN {args.expert_ffn}, "
          f"fp32: {total:.1f} MiB ({dense:.1f} dense + {expert_total:.1f} experts), ep={args.world} gloo ranks")
    print(f"dense + experts/ep = {dense + expert_total / args.world:.1f} MiB per rank")
    print("peak growth during the load, MiB per rank; private = RssAnon (tensors), RSS = ru_maxrss (adds the "
          "mmapped safetensors pages it touched)")
    print(f"{'rank':>4}{'private slices':>16}{'private full':>14}{'ratio':>7}{'RSS slices':>12}{'RSS full':>10}"
          f"{'ratio':>7}{'params kept':>13}")
    for r in range(args.world):
        s, f = rows["slices"][r], rows["full"][r]
        print(f"{r:>4}{s['anon_mib']:>16.1f}{f['anon_mib']:>14.1f}{s['anon_mib'] / f['anon_mib']:>7.2f}"
              f"{s['peak_mib']:>12.1f}{f['peak_mib']:>10.1f}{s['peak_mib'] / f['peak_mib']:>7.2f}{s['params_mib']:>13.1f}")


if __name__ == "__main__":
    main()
