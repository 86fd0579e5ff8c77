"""One MoE layer, forward+backward, EP over 2 gloo ranks on CPU: autoep vs transformers' own EP vs plain.

    python bench/ep_layer.py                       # defaults below, 2 ranks, prints one table
    python bench/ep_layer.py --tokens 1024 --steps 5
    python bench/ep_layer.py --contenders --rounds 21  # only the interleaved comparison (ModuleList paths vs before)
    python bench/ep_layer.py --profile ml-stacked ml-fast   # where a step's time goes (torch.profiler, rank 0)
    python bench/ep_layer.py --smoke                # the smallest run of every contender (tests/test_bench_smoke.py)
    python bench/ep_layer.py --ops ml-plain ml-replay ml-own ml-fast autoep   # aten ops and host syncs per step

Every contender runs the same block (Qwen3MoeSparseMoeBlock from a small config), the same weights
and the same per-rank tokens, side by side in one spawned gloo group:
  plain        each rank runs the whole block (all experts) on its own tokens, no exchange
  autoep       apply_plan with the batched recipe (all-to-all + grouped local experts)
  hf-<impl>    transformers.distributed expert parallelism, ep_implementation="all_to_all", experts
               implementation <impl> (eager, batched_mm, grouped_mm; from_config's default is grouped_mm)
The same routing and weights as a v4-style block with ModuleList experts (tests/blocks.py
MixtralStyleSparseMoeBlock, softmax top-k renormalised, as Qwen3-MoE with norm_topk_prob), module_list recipe:
  ml-plain     the block's own per-expert loop, all experts, no exchange
  ml-stacked   the grouped GEMM on weights stacked once at apply time into tensors of their own (what the recipe
               did before the experts stayed the model's own modules: the "today" of the fast path)
  ml-copy      the grouped GEMM on the experts' own weights stacked every step (torch.stack, a copy: the fast
               path of the first own-forward increment)
  ml-fast      the fast path: the grouped GEMM reading the experts' own parameters in place (their memory lives
               in one stacked buffer per projection; gradients handed back as views)
  ml-own       the experts' own forward (fast_path=False), one nn.Linear chain per local expert (execution=spliced)
  ml-replay    the same block with execution=replay (plan entry ``execution: replay``): the block's forward
               once, its expert outputs deferred to the exchange (one pass), each local expert's own forward on
               its owner
The transformers 4.x DeepseekV2 spelling (tests/blocks.py SortedSplitMoE: argsort, a loop over the counts, cat):
  split-plain  its own forward, all experts, no exchange
  split-auto   what the plan picks for it (``--interleave split-auto split-replay``: the same time when auto is
               replay; before issue 21's split-splice deletion auto spliced the loop out)
  split-replay execution=replay
Executions side by side (``--interleave ml-own ml-replay ml-fast autoep``): replay vs spliced (ml-own: the same
experts' own forward; ml-fast: with the grouped GEMM) vs grouped (autoep: the batched twin's grouped recipe).
Memory per layer (interleaved comparison): the bytes autograd saves for backward in one forward of the layer
(``torch.autograd.graph.saved_tensors_hooks``, counted once per storage, parameters excluded): "packed" is every
tensor saved during the forward (a lower bound: a freed storage's address may be reused), "held" what the graph
still holds when backward starts.
The interleaved comparison (``--interleave``, on by default) builds its contenders in ONE process group and runs
``--rounds`` rounds of one timed fwd+bwd step of each, in an order shuffled every round; each round's ratio is
ml-stacked's step time over the contender's (the slowest rank's times, same round), and the median ratio and its
interquartile range over the rounds are printed side by side: load that comes and goes on a shared machine hits
both sides of a ratio alike, which per-contender medians minutes apart do not.
Printed per contender: tokens/s per rank, ratio to autoep, bytes exchanged per step against the minimum
(tokens x top_k x hidden x dtype bytes, each of dispatch and combine, forward and backward),
expert parameter bytes per rank against the dense block's, and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
__import__("testpaths").add()  # the tests' package folders too (mutation.py imports test_parity_hf)

BYTES = {"a2a": 0}


def _count_bytes(fn):
    def wrapped(output, input, *args, **kwargs):
        if input.dim() >= 2:  # token rows; the 1-D split-size exchange is not token payload
            BYTES["a2a"] += input.numel() * input.element_size()
        return fn(output, input, *args, **kwargs)

    return wrapped


def build_block(args) -> nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=args.hidden, moe_intermediate_size=args.ffn, num_experts=args.experts,
        num_experts_per_tok=args.top_k, norm_topk_prob=True,
    )
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
    return block


def module_list_block(block, top_k: int) -> nn.Module:
    """The v4-style twin of the Qwen3 block: same gate, each expert's gate/up/down rows of the batched weights."""
    from blocks import MixtralStyleSparseMoeBlock

    return _twin(block, MixtralStyleSparseMoeBlock, top_k, ("gate_proj", "up_proj", "down_proj"))


def split_block(block, top_k: int) -> nn.Module:
    """The transformers 4.x DeepseekV2 spelling of the Qwen3 block's experts (``tests/blocks.py`` SortedSplitMoE:
    argsort, a loop over the counts, ``torch.cat``; its own softmax top-k, not renormalised): each expert's w1/w3/w2
    the gate/up/down rows of the batched weights."""
    from blocks import SortedSplitMoE

    return _twin(block, SortedSplitMoE, top_k, ("w1", "w3", "w2"))


def _twin(block, cls, top_k: int, names: tuple[str, str, str]) -> nn.Module:
    """``cls`` built at the Qwen3 block's sizes with its gate, each expert's (gate, up, down) projections, named
    ``names``, the rows of the batched weights."""
    E, twoF, D = block.experts.gate_up_proj.shape
    twin = cls(hidden=D, ffn=twoF // 2, num_experts=E, top_k=top_k)
    gate, up, down = names
    with torch.no_grad():
        twin.gate.weight.copy_(block.gate.weight)
        for e, expert in enumerate(twin.experts):
            getattr(expert, gate).weight.copy_(block.experts.gate_up_proj[e, : twoF // 2])
            getattr(expert, up).weight.copy_(block.experts.gate_up_proj[e, twoF // 2:])
            getattr(expert, down).weight.copy_(block.experts.down_proj[e])
    return twin


def autoep_block(block, mesh, execution: str = "auto", **fn_kwargs):
    """``block`` under EP as the plan runs it: the detector's structure (``execution="replay"``: the plan entry's
    ``execution: replay``, record/exchange/replay although the fast path is proven too)."""
    from autoep.detect.structure import detect_moe_structure, replay_structure
    from autoep.plan.archetypes import compute_fn_config
    from autoep.runtime.apply import apply_plan

    holder = nn.Module()
    holder.mlp = copy.deepcopy(block)
    s = replay_structure(holder.mlp) if execution == "replay" else detect_moe_structure(holder.mlp)
    assert execution in ("auto", s.execution), (execution, s.execution)
    fn = {**compute_fn_config(s), **fn_kwargs}
    plan = {"plan": [{"match": "mlp", "local_compute_fn": fn, "decision": {"modules": ["mlp"]}}]}
    apply_plan(holder, plan, mesh)
    return holder.mlp


class StackedOnce(nn.Module):
    """ml-stacked: the ModuleList twin's routing (``MixtralStyleSparseMoeBlock.forward``'s lines) and autoep's
    exchange (``autoep.runtime.dispatch.ep_experts_forward``) around the grouped GEMM (``grouped_swiglu``) on this
    rank's expert weights stacked once into leaves of their own: the layout the module_list recipe kept before the
    experts stayed the model's own modules. Built from public runtime functions; nothing in the runtime is patched."""

    def __init__(self, twin: nn.Module, ep_mesh):
        super().__init__()
        E, W = twin.num_experts, ep_mesh.size()
        first = ep_mesh.get_local_rank() * (E // W)
        local = list(twin.experts)[first: first + E // W]
        self.gate, self.top_k, self.num_experts, self.ep_group = twin.gate, twin.top_k, E, ep_mesh.get_group()
        with torch.no_grad():
            self.gate_up = nn.Parameter(torch.stack([torch.cat([x.gate_proj.weight, x.up_proj.weight]) for x in local]))
            self.down = nn.Parameter(torch.stack([x.down_proj.weight for x in local]))

    def forward(self, hidden_states):
        from autoep.runtime.dispatch import ep_experts_forward

        B, S, D = hidden_states.shape
        x_TD = hidden_states.view(-1, D)
        router_logits = self.gate(x_TD)
        weights_TK, index_TK = torch.topk(F.softmax(router_logits, dim=1, dtype=torch.float), self.top_k, dim=-1)
        weights_TK = (weights_TK / weights_TK.sum(dim=-1, keepdim=True)).to(x_TD.dtype)
        out_TD = ep_experts_forward(x_TD, index_TK, weights_TK, num_experts=self.num_experts, ep_group=self.ep_group,
                                    expert_fn=self.local_experts)
        return out_TD.view(B, S, D), router_logits

    def local_experts(self, x_SD, tokens_per_local_expert, status_L=None):
        from autoep.runtime.experts import glu_gate, grouped_swiglu

        return grouped_swiglu(x_SD, tokens_per_local_expert, self.gate_up, self.down, apply_gate=glu_gate(F.silu))


def copy_each_step(block) -> nn.Module:
    """The module_list fast path stacking the experts' own weights every step (a copy) instead of reading them in
    place: the recipe's own fallback for a block without a stacked home (``local_experts.STACKED`` unset)."""
    from autoep.runtime.recipes import local_experts

    setattr(block, local_experts.STACKED, None)
    return block


def hf_block(block, ep_mesh, tp_mesh, impl: str):
    from transformers.distributed import expert_parallel as hf_ep

    b = copy.deepcopy(block)
    b.experts.config = copy.copy(b.experts.config)
    b.experts.config._experts_implementation = impl
    plan = {"experts.gate_up_proj": "grouped_gemm", "experts.down_proj": "grouped_gemm", "experts": "ep_dispatch_experts"}
    hf_ep.apply_expert_parallelism(b, ep_mesh, tp_mesh, plan, ep_implementation="all_to_all")
    return b


def time_step(block, x, grad, steps: int, warmup: bool = True) -> tuple[float, int]:
    """Median seconds per forward+backward and all-to-all input bytes per step (after one untimed step)."""
    times = []
    for i in range(steps + 1) if warmup else range(1, steps + 1):
        xi = x.clone().requires_grad_()
        BYTES["a2a"] = 0
        dist.barrier()  # NOTE: collective; start every contender's step together on all ranks
        t0 = time.perf_counter()
        out = block(xi)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)
        dist.barrier()  # NOTE: collective; a step ends when the slowest rank ends
        if i:  # first step warms up
            times.append(time.perf_counter() - t0)
        block.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2], BYTES["a2a"]


def expert_bytes(block) -> int:
    total = 0
    if isinstance(block, StackedOnce):
        return sum(t.numel() * t.element_size() for t in (block.gate_up, block.down))
    for p in block.experts.parameters():
        if p.is_meta:
            continue  # another rank's ModuleList expert: a meta stand-in, nothing allocated
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(rank: int, world_size: int, args, name: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed import expert_parallel as hf_ep

    torch.set_num_threads(args.threads)
    dist.all_to_all_single = _count_bytes(dist.all_to_all_single)
    hf_ep.all_to_all_single = _count_bytes(hf_ep.all_to_all_single)
    hf_count = {"fwd": 0}
    orig_autograd = hf_ep.all_to_all_single_autograd

    def counted_autograd(x, out_sizes, in_sizes, group):
        hf_count["fwd"] += x.numel() * x.element_size()
        return orig_autograd(x, out_sizes, in_sizes, group)

    hf_ep.all_to_all_single_autograd = counted_autograd

    mesh2 = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("ep", "tp"))
    ep_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    block = build_block(args)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1, args.tokens, args.hidden, generator=g)
    grad = torch.randn(1, args.tokens, args.hidden, generator=g)

    if name.startswith("interleaved:"):
        return interleaved(block, ep_mesh, x, grad, args, name.removeprefix("interleaved:").split(","))
    if name.startswith("profile:"):
        return profiled(build(name.removeprefix("profile:"), block, ep_mesh, args), x, grad)
    if name.startswith("ops:"):
        return {n: op_counts(build(n, block, ep_mesh, args), x, grad) for n in name.removeprefix("ops:").split(",")}
    if name == "plain":
        b = block
    elif name == "autoep":
        b = autoep_block(block, ep_mesh)
    elif name == "ml-plain":
        b = module_list_block(block, args.top_k)
    elif name.startswith("ml-"):
        b = build(name, block, ep_mesh, args)
    else:
        b = hf_block(block, mesh2["ep"], mesh2["tp"], name.removeprefix("hf-"))
    del block
    rss0 = _rss_mb()
    sec, a2a = time_step(b, x, grad, args.steps)
    # transformers' token exchange runs through functional collectives whose backward we cannot see:
    # count its forward payload and assume the backward mirrors it (it is the reverse exchange).
    a2a += 2 * hf_count["fwd"] // (args.steps + 1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"sec": sec, "tok_s": args.tokens / sec, "a2a_bytes": a2a, "expert_bytes": expert_bytes(b),
            "peak_mb": peak, "step_mb": max(peak - rss0, 0.0)}


def build(name: str, block, ep_mesh, args) -> nn.Module:
    if name == "autoep":
        return autoep_block(block, ep_mesh)
    if name == "ml-plain":
        return module_list_block(block, args.top_k)
    if name == "ml-stacked":
        return StackedOnce(module_list_block(block, args.top_k), ep_mesh)
    if name in ("ml-fast", "ml-copy"):
        b = autoep_block(module_list_block(block, args.top_k), ep_mesh)
        return copy_each_step(b) if name == "ml-copy" else b
    if name == "ml-own":
        return autoep_block(module_list_block(block, args.top_k), ep_mesh, fast_path=False)
    if name == "ml-replay":
        return autoep_block(module_list_block(block, args.top_k), ep_mesh, execution="replay")
    if name == "split-plain":
        return split_block(block, args.top_k)
    if name == "split-auto":
        return autoep_block(split_block(block, args.top_k), ep_mesh)
    if name == "split-replay":
        return autoep_block(split_block(block, args.top_k), ep_mesh, execution="replay")
    raise ValueError(f"--interleave takes autoep and ml-* contenders, not {name!r}")


def interleaved(block, ep_mesh, x, grad, args, names: list[str]) -> dict:
    """The contenders in one process group: two warm-up steps each, then ``args.rounds`` rounds of one timed step
    of each, in a shuffled order every round. Returns this rank's wall and CPU times per contender, round by round."""
    blocks = {n: build(n, block, ep_mesh, args) for n in names}
    for b in blocks.values():
        time_step(b, x, grad, 1)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        # A fresh order each round (seeded: the same on every rank): no contender always follows the same one.
        for n in random.Random(r).sample(names, len(names)):
            c0 = time.process_time()
            times[n].append(time_step(blocks[n], x, grad, 1, warmup=False)[0])
            cpu[n].append(time.process_time() - c0)
    return {"wall": times, "cpu": cpu, "saved": {n: saved_bytes(b, x, grad) for n, b in blocks.items()}}


class _Saved:
    """One tensor autograd saved for backward (a weak-referenceable holder: alive while the graph holds it)."""

    def __init__(self, t):
        self.t = t


def saved_bytes(block, x, grad) -> tuple[int, int] | str:
    """(bytes packed during one forward, bytes the graph still holds when backward starts) of the tensors
    autograd saves, each storage counted once, the block's parameters excluded; then the backward runs. Where
    the block cannot run under ``saved_tensors_hooks`` (or saves a tensor without storage of its own), the
    error's first line instead: the comparison's other figures are still printed."""
    import weakref

    def storage(t):  # (data pointer, bytes) of the storage behind ``t`` (a DTensor: its local shard's)
        t = t.to_local() if hasattr(t, "to_local") else t
        return (None, 0) if t.device.type == "meta" else (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())

    params = {storage(p)[0] for p in block.parameters()}
    live: weakref.WeakSet = weakref.WeakSet()
    packed: dict[int, int] = {}

    def pack(t):
        holder = _Saved(t)
        ptr, nbytes = storage(t)
        if ptr not in params:
            live.add(holder)
            packed[ptr] = nbytes
        return holder

    xi = x.clone().requires_grad_()
    dist.barrier()  # NOTE: collective; every rank measures the same step
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda holder: holder.t):
            out = block(xi)
        out = out[0] if isinstance(out, tuple) else out
        held = dict(storage(h.t) for h in list(live))
    except RuntimeError as e:
        # Every rank fails alike (the same block and step; autoep raises on every rank); the step's graph is
        # dropped unrun, so no rank waits in its backward's exchanges.
        return f"not measurable: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    out.backward(grad)
    block.zero_grad(set_to_none=True)
    return sum(packed.values()), sum(held.values())


def profiled(block, x, grad, steps: int = 3) -> str:
    """``torch.profiler`` op table (self CPU time) of ``steps`` fwd+bwd steps after two warm-up steps."""
    from torch.profiler import ProfilerActivity, profile

    time_step(block, x, grad, 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        time_step(block, x, grad, steps - 1)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)


# Host syncs on CPU: a scalar read (``item``: aten::_local_scalar_dense), a data-dependent shape (aten::nonzero;
# on CUDA each waits for the device), and ``tolist`` (reads the data without an aten op: counted by a patch).
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")


def op_counts(block, x, grad) -> dict:
    """One fwd+bwd step after two warm-up steps: the aten ops called from Python or autograd (not from inside another
    aten op), and the host syncs among them (``SYNC_OPS``) plus ``tolist`` calls."""
    from torch.profiler import ProfilerActivity, profile

    time_step(block, x, grad, 1)
    tolist, calls = torch.Tensor.tolist, [0]

    def counted(self, *a, **k):
        calls[0] += 1
        return tolist(self, *a, **k)

    torch.Tensor.tolist = counted  # NOTE: bench instrumentation, put back below
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            time_step(block, x, grad, 1, warmup=False)
    finally:
        torch.Tensor.tolist = tolist
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return {"ops": len(top), "syncs": sum(e.name in SYNC_OPS for e in events) + calls[0],
            "collectives": sum(e.name.startswith(("gloo:", "nccl:", "c10d::")) for e in prof.events())}


def report_ops(per_rank: list[dict], base: str) -> None:
    """Per contender, rank 0's and the mean over ranks' ops and syncs per fwd+bwd step, against ``base``."""
    names = list(per_rank[0])
    print(f"aten ops and host syncs per fwd+bwd step of the layer (rank 0 / mean over {len(per_rank)} ranks); "
          f"vs {base}, the model's own loop")
    print(f"{'contender':<14}{'ops':>14}{'vs ' + base:>14}{'host syncs':>14}{'collectives':>13}")
    for n in names:
        ops = [r[n]["ops"] for r in per_rank]
        syncs = [r[n]["syncs"] for r in per_rank]
        print(f"{n:<14}{ops[0]:>7}/{sum(ops) / len(ops):<6.0f}{ops[0] / per_rank[0][base]['ops']:>14.2f}"
              f"{syncs[0]:>7}/{sum(syncs) / len(syncs):<6.0f}{per_rank[0][n]['collectives']:>13}")


def _quantile(values: list[float], q: float) -> float:
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


def report_interleaved(per_rank: list[dict], args) -> None:
    """Per round: the slowest rank's wall time of the step, and the CPU time of all ranks together (what the
    step costs the machine; time a rank waits descheduled behind other jobs is not in it). Ratio = the base
    contender's time / the contender's, in the same round; median and interquartile range over the rounds."""
    names = list(per_rank[0]["wall"])
    base = names[0]
    wall = {n: [max(r["wall"][n][i] for r in per_rank) for i in range(args.rounds)] for n in names}
    cpu = {n: [sum(r["cpu"][n][i] for r in per_rank) for i in range(args.rounds)] for n in names}
    print(f"interleaved: {args.rounds} rounds of one fwd+bwd step of each contender (order shuffled per round), "
          f"{args.world_size} gloo ranks, T={args.tokens}/rank D={args.hidden} F={args.ffn} E={args.experts} "
          f"top_k={args.top_k} fp32, {args.threads} thread(s)/rank, load average {os.getloadavg()[0]:.1f}; "
          f"ratio per round = {base}'s time / the contender's, > 1 is faster")
    print(f"{'contender':<12}{'tok/s/rank':>11}{'wall vs ' + base:>20}{'[p25, p75]':>17}"
          f"{'cpu s/step':>12}{'cpu vs ' + base:>19}{'[p25, p75]':>17}")
    for n in names:
        rw = [b / t for b, t in zip(wall[base], wall[n])]
        rc = [b / t for b, t in zip(cpu[base], cpu[n])]
        print(f"{n:<12}{args.tokens / _quantile(wall[n], 0.5):>11.0f}{_quantile(rw, 0.5):>19.3f}x"
              f"  [{_quantile(rw, 0.25):.3f}, {_quantile(rw, 0.75):.3f}]{_quantile(cpu[n], 0.5):>12.3f}"
              f"{_quantile(rc, 0.5):>18.3f}x  [{_quantile(rc, 0.25):.3f}, {_quantile(rc, 0.75):.3f}]", flush=True)
    print("saved for backward per layer, rank 0 (MB, parameters excluded): packed during the forward / held when "
          "backward starts; ratio of held to " + base)
    saved = per_rank[0]["saved"]
    for n in names:
        if isinstance(saved[n], str):
            print(f"{n:<12} {saved[n]}", flush=True)
            continue
        ratio = "" if isinstance(saved[base], str) else f"{saved[n][1] / saved[base][1]:>9.2f}x"
        print(f"{n:<12}{saved[n][0] / 2**20:>11.2f}{saved[n][1] / 2**20:>11.2f}{ratio}", flush=True)


# Every contender ``build`` knows in one process group, the table's reference contenders each in their own.
SMOKE = {"tokens": 64, "hidden": 32, "ffn": 16, "experts": 4, "top_k": 2, "steps": 1, "rounds": 1,
         "interleave": ["ml-stacked", "ml-copy", "ml-fast", "ml-own", "ml-replay", "ml-plain", "autoep",
                        "split-plain", "split-auto", "split-replay"],
         "contenders": ["plain", "autoep", "hf-eager", "hf-grouped_mm"]}


def main(argv=None) -> None:
    from distributed import spawn

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    # batched_mm gathers a (2F x D) weight per (token, expert) pair: ~100x slower here; opt in by name.
    p.add_argument("--hf-impls", nargs="*", default=["eager", "grouped_mm"])
    p.add_argument("--interleave", nargs="*",
                   default=["ml-stacked", "ml-copy", "ml-fast", "ml-own", "ml-replay", "autoep"],
                   help="contenders compared in one process group, one step of each per round; ratios are to the "
                        "first ([] to skip)")
    p.add_argument("--rounds", type=int, default=15, help="rounds of the interleaved comparison")
    p.add_argument("--contenders", nargs="*", default=None,
                   help="the contenders of the table, each in its own process group (default: all; none: only "
                        "the interleaved comparison)")
    p.add_argument("--profile", nargs="*", default=[],
                   help="contenders (autoep, ml-*) to profile: rank 0's op table over 3 steps, then exit")
    p.add_argument("--ops", nargs="*", default=[],
                   help="contenders whose aten ops, host syncs and collectives per fwd+bwd step are counted "
                        "(torch.profiler, every rank), the first the base (e.g. ml-plain ml-replay ml-own ml-fast "
                        "autoep split-plain split-replay); then exit")
    p.add_argument("--smoke", action="store_true",
                   help="the smallest configuration, a code check (tests/test_bench_smoke.py): " + ", ".join(
                       f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}" for k, v in SMOKE.items())
                   + "; flags given explicitly win")
    args = p.parse_args(argv)
    if args.smoke:
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    for name in args.profile:
        print(f"profile of {name} (rank 0, 3 fwd+bwd steps):\n" + spawn(args.world_size, "ep_layer:worker", args,
                                                                       f"profile:{name}")[0], flush=True)
    if args.ops:
        report_ops(spawn(args.world_size, "ep_layer:worker", args, "ops:" + ",".join(args.ops)), args.ops[0])
    if args.profile or args.ops:
        return
    names = ["plain", "autoep"] + [f"hf-{impl}" for impl in args.hf_impls]
    names += ["ml-plain", "ml-stacked", "ml-copy", "ml-fast", "ml-own", "ml-replay"]
    names = names if args.contenders is None else args.contenders
    if args.interleave:
        per_rank = spawn(args.world_size, "ep_layer:worker", args, "interleaved:" + ",".join(args.interleave))
        report_interleaved(per_rank, args)
    # One spawned group per contender, so each rank's peak memory is that contender's alone.
    results = {name: spawn(args.world_size, "ep_layer:worker", args, name) for name in names}
    if results:
        report(results, args)


def report(results: dict[str, list[dict]], args) -> None:
    import transformers

    W = args.world_size
    # Every (token, expert) row crosses twice (dispatch, combine) forward and twice backward, fp32.
    minimum = W * 4 * args.tokens * args.top_k * args.hidden * 4
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; {W} gloo ranks, "
          f"{args.threads} thread(s)/rank; T={args.tokens}/rank D={args.hidden} F={args.ffn} E={args.experts} "
          f"top_k={args.top_k} fp32; median of {args.steps} fwd+bwd steps")
    base = min(r["tok_s"] for r in results["autoep"])
    dense = results["plain"][0]["expert_bytes"]
    print(f"{'contender':<15}{'tok/s/rank':>11}{'vs autoep':>10}{'a2a bytes/step':>16}{'/ min':>7}"
          f"{'expert MB/rank':>15}{'/ dense':>8}{'peak RSS MB':>12}{'step peak MB':>13}")
    for name, rows in results.items():
        tok_s = min(r["tok_s"] for r in rows)  # the slowest rank sets the step
        a2a = sum(r["a2a_bytes"] for r in rows)
        print(f"{name:<15}{tok_s:>11.0f}{tok_s / base:>9.2f}x{a2a:>16,}{a2a / minimum:>7.3f}"
              f"{rows[0]['expert_bytes'] / 2**20:>15.2f}{rows[0]['expert_bytes'] / dense:>8.3f}"
              f"{max(r['peak_mb'] for r in rows):>12.0f}{max(r['step_mb'] for r in rows):>13.0f}")
    print(f"minimum a2a bytes/step, all ranks = {W} x 4 x {args.tokens} x {args.top_k} x {args.hidden} x 4 B = {minimum:,}; "
          "step peak MB = peak RSS growth during the timed steps (max over ranks)")
    if "ml-stacked" in results:
        today = min(r["tok_s"] for r in results["ml-stacked"])
        ratios = ", ".join(f"{n} {min(r['tok_s'] for r in results[n]) / today:.2f}x"
                           for n in ("ml-copy", "ml-fast", "ml-own", "ml-replay", "ml-plain") if n in results)
        print(f"ModuleList experts vs ml-stacked (weights stacked once, the recipe before): {ratios}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main()
