"""The train-mode harness (issue 20): the same user training loop on the model and on its EP copy, step by step.

For one fuzz target (``mutation.targets()``) on ``world_size`` gloo ranks: the **model** (one process: every rank
runs it on every rank's slice, gradients summed over slices) and the **EP model** (``mutation.make_ep``: the recipe
the detector and table choose, as ``apply_plan`` runs it; each rank its own slice, dense gradients finished by
``autoep.runtime.grads.finish_grads`` with ``grad_convention="sum"``) train with the same optimizer (SGD with
momentum 0.9, or AdamW with weight decay 0.1) for ``STEPS`` steps. After every step the loss of each rank's slice,
every parameter's gradient (``None`` where the model's is ``None``, zeros where it is zero; expert shards and
module experts on their owners) and every weight must be the model's (fp32, ``assert_close`` defaults); then
EP's weights are set to the model's (``resync``: rounding does not compound; optimizer state is never synced).

Routing is forced (``force_routing``): the router row of expert ``E - 1`` reads only feature 0 with weight -8;
every token holds it at -1 in step 0 (expert E-1 takes every token) and at +1 afterwards (no rank's token picks
it: an idle expert whose momentum and Adam state the model leaves alone). The row of expert 0 reads only feature
1 with weight +8, which only rank 0's tokens hold at +1 (others -1): tokens from one rank only. Whether the routing happened is measured, not assumed (``Routing``: the (token, expert) pairs of every
exchange, counted per expert and rank).

    from train_loop import check_target; check_target("hf/qwen3_moe", rank, world_size, mesh, "sgd")
    python tests/train_loop.py --ranks 2 4          # every fuzz target, both optimizers; prints the counts
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from mutation import cotangent, inputs, make_ep, targets
from mutation_runtime import router_of
from torch import nn

from autoep.detect.structure import count_experts, detect_moe_structure
from autoep.runtime import dispatch, grads
from autoep.runtime.recipes import replay
from autoep.runtime.recipes.local_experts import expert_owners

STEPS = 5
# Small steps, so five of them move no routing decision onto a near-tie (where rounding would pick the expert);
# AdamW's eps well above rounding noise, so a gradient that is zero up to rounding moves nothing (Adam divides
# noise by its own size: lr * sign(noise) at the default 1e-8).
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, eps=1e-4),
}
SPLITS = {1: [2], 2: [1, 1], 4: [1, 0, 2, 1]}  # sequences per rank; on 4 ranks one rank has none
FULL_SPLITS = {1: [2], 2: [1, 1], 4: [1, 1, 1, 1]}  # targets whose own forward cannot run an empty batch


# ---------------------------------------------------------------------------------------------
# Forced routing, measured
# ---------------------------------------------------------------------------------------------


def router_weight(block: nn.Module, num_experts: int) -> torch.Tensor | None:
    """The (E, D) weight the block's router scores experts with, where it has one (a Linear gate)."""
    router = router_of(block)
    candidates = [router] if router is not None else []
    candidates += [m for m in (router.modules() if router is not None else block.modules()) if isinstance(m, nn.Linear)]
    for m in candidates:
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == num_experts:
            return w
    return None


def force_routing(block: nn.Module, num_experts: int) -> bool:
    """Make expert E-1 idle and expert 0 rank 0's alone (module docstring); False where no router weight fits."""
    w = router_weight(block, num_experts)
    if w is None:
        return False
    with torch.no_grad():
        w[-1].zero_()
        w[-1, 0] = -8.0
        w[0].zero_()
        w[0, 1] = 8.0
    return True


def step_inputs(block: nn.Module, split: list[int], step: int) -> torch.Tensor:
    """(sum(split), SEQ, D) inputs of one step: feature 0 is -1 in step 0 and +1 after it, everywhere; feature 1
    +1 on rank 0's sequences, -1 on the others'."""
    x = inputs(block, batch=sum(split)) * 0.5 + 0.1 * step
    x[..., 0] = 1.0 if step else -1.0
    x[..., 1] = -1.0
    x[: split[0], :, 1] = 1.0
    return x


@dataclass
class Routing:
    """Tokens per (rank, expert) of every exchange of one step on this rank (``dispatch._status`` sees them;
    ``replay._meta_row`` for the one-pass execution)."""

    counts: list = field(default_factory=list)

    def __enter__(self):
        self._status, self._meta_row = dispatch._status, replay._meta_row

        def status(tokens_per_expert_E, idle):
            self.counts.append(tokens_per_expert_E.detach().clone())
            return self._status(tokens_per_expert_E, idle)

        def meta_row(spec, *args):  # the one-pass execution's rows per expert from this rank, per exchange
            row = self._meta_row(spec, *args)
            self.counts.append(torch.tensor(row[:spec.num_experts]))
            return row

        # NOTE: test instrumentation of private functions: the counts, nothing else
        dispatch._status, replay._meta_row = status, meta_row
        return self

    def __exit__(self, *exc):
        dispatch._status, replay._meta_row = self._status, self._meta_row


def routing_seen(counts: torch.Tensor) -> tuple[bool, bool]:
    """(some expert got no token from any rank, some expert got tokens from exactly one rank) for one exchange's
    (W, E) token counts."""
    hit_WE = counts > 0
    return bool((~hit_WE.any(dim=0)).any()), bool((hit_WE.sum(dim=0) == 1).any())


# ---------------------------------------------------------------------------------------------
# One step on each side
# ---------------------------------------------------------------------------------------------


def _loss(out) -> torch.Tensor:
    outputs = out if isinstance(out, tuple) else (out,)
    terms = [(o * cotangent(i, o)).sum() for i, o in enumerate(outputs)
             if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad]
    return sum(terms) if terms else torch.zeros(())


def _run(block: nn.Module, x: torch.Tensor, seed: int, flat: bool) -> torch.Tensor:
    torch.manual_seed(seed)  # jitter and sampling routers draw the same numbers on both sides
    loss = _loss(block(x.reshape(-1, x.shape[-1]) if flat else x))
    if loss.requires_grad:
        loss.backward()
    return loss.detach()


def _slices(x: torch.Tensor, split: list[int]) -> list[torch.Tensor]:
    bounds = list(itertools.accumulate([0, *split]))
    return [x[lo:hi] for lo, hi in zip(bounds, bounds[1:])]


def _local(ref: torch.Tensor, p: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The part of the model's tensor ``ref`` that ``p`` (an expert shard, ``Shard(0)`` over ep) holds here."""
    return ref.chunk(world_size, dim=0)[rank] if hasattr(p, "to_local") else ref


def compare(model: nn.Module, ep: nn.Module, rank: int, world_size: int, what: str) -> list[str]:
    """Every parameter's gradient (None-ness included) and weight of ``ep`` on this rank against ``model``'s."""
    owners = expert_owners(ep)
    ref = dict(model.named_parameters())
    diffs = []
    for name, p in ep.named_parameters():
        if name in owners and not owners[name].local:
            continue  # another rank's expert: its owner compares it
        mine = p.to_local() if hasattr(p, "to_local") else p
        theirs = _local(ref[name].detach(), p, rank, world_size)
        if what == "weight":
            diffs += _close(f"weight {name}", mine.detach(), theirs)
            continue
        g_ref, g = ref[name].grad, p.grad
        if (g_ref is None) != (g is None):
            diffs.append(f"grad {name}: model {'None' if g_ref is None else 'a tensor'}, EP "
                         f"{'None' if g is None else 'a tensor'}")
        elif g is not None:
            diffs += _close(f"grad {name}", g.to_local() if hasattr(g, "to_local") else g,
                            _local(g_ref, p, rank, world_size))
    return diffs


def _close(what: str, got: torch.Tensor, want: torch.Tensor) -> list[str]:
    try:
        torch.testing.assert_close(got, want)
    except AssertionError:
        if got.shape != want.shape:
            return [f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"]
        return [f"{what}: max abs diff {(got.double() - want.double()).abs().max().item():.3g} (largest value "
                f"{want.abs().max().item():.3g})"]
    return []


@torch.no_grad()
def resync(model: nn.Module, ep: nn.Module, rank: int, world_size: int) -> None:
    """Set EP's weights (this rank's part) to the model's. Compared before, within fp32 rounding: set equal, so
    the next step starts from the same weights and rounding cannot compound over steps into another routing
    decision (a chaotic amplifier no EP error is needed for). Optimizer state is never synced: a momentum or Adam
    state the model does not have still shows in the next step's weights."""
    owners, ref = expert_owners(ep), dict(model.named_parameters())
    for name, p in ep.named_parameters():
        if name in owners and not owners[name].local:
            continue
        (p.to_local() if hasattr(p, "to_local") else p).copy_(_local(ref[name], p, rank, world_size))


@dataclass
class Report:
    """What one target's run saw on this rank."""

    diffs: list[str] = field(default_factory=list)
    idle_seen: bool = False  # some exchange had an expert no rank sent a token to
    solo_seen: bool = False  # some exchange had an expert only one rank sent tokens to
    forced: bool = False


class Calls:
    """Which module experts ran their forward (a pre-hook on each: it also turns the grouped fast path off, so
    the experts' own forwards run)."""

    def __init__(self, block: nn.Module, structure):
        self.ran: set[int] = set()
        container = block.get_submodule(structure.experts_path)
        self.experts = list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)
        for e, expert in enumerate(self.experts):
            expert.register_forward_pre_hook(lambda module, args, e=e: self.ran.add(e))

    def gathered(self, world_size: int) -> set[int]:
        """The experts run on any rank (a collective on several ranks)."""
        ran = torch.zeros(len(self.experts), dtype=torch.long)
        ran[list(self.ran)] = 1
        if world_size > 1:
            dist.all_reduce(ran)  # NOTE: collective (the measurement)
        return set(ran.nonzero().flatten().tolist())


def train_both(target, rank: int, world_size: int, mesh, optimizer: str, steps: int = STEPS,
               hooks: bool = False) -> Report:
    """Train the model and its EP copy side by side (module docstring); collectives stay in step on every rank
    (each rank computes everything before it compares). ``hooks``: module experts carry a forward pre-hook on both
    sides, and the experts EP runs in a step must be those the model runs (on any rank's slice)."""
    block = target.build()
    structure = detect_moe_structure(block)
    report = Report(forced=force_routing(block, count_experts(block, structure)))
    split = (SPLITS if target.empty_rank else FULL_SPLITS)[world_size]
    watch = hooks and structure.expert_storage == "module_list"
    ep = make_ep(block, structure, mesh)
    model = copy.deepcopy(block)
    # Hooks added after apply, as a user adds them: on the EP side every expert module is still there (another
    # rank's as a stand-in, never called here).
    calls_model, calls_ep = (Calls(model, structure), Calls(ep, structure)) if watch else (None, None)
    opt_model = OPTIMIZERS[optimizer]([p for p in model.parameters() if p.requires_grad])
    dense, expert = grads.split_params(ep)
    opt_ep = OPTIMIZERS[optimizer](dense + expert)
    world = dist.group.WORLD if world_size > 1 else None
    if world is not None:
        # NOTE: collective. Building a target may import a transformers model for many seconds on one rank; the
        # ep group's short timeout (``rank_parity.HANG_S``) is for hangs in the exchange, not for imports.
        dist.barrier()
    for step in range(steps):
        x = step_inputs(block, split, step)
        losses = [_run(model, s, 1000 * step + r, target.flat) for r, s in enumerate(_slices(x, split))]
        with Routing() as routing:
            loss = _run(ep, _slices(x, split)[rank], 1000 * step + rank, target.flat)
        grads.finish_grads(dense, expert, world_group=world, edp_group=None, world_size=world_size,
                           convention="sum", dense_synced=False)
        for counts_E in routing.counts:
            gathered = [torch.empty_like(counts_E) for _ in range(world_size)]
            if world_size > 1:
                dist.all_gather(gathered, counts_E)  # NOTE: collective (the measurement, not the run)
            else:
                gathered = [counts_E]
            idle, solo = routing_seen(torch.stack(gathered))
            report.idle_seen |= idle
            report.solo_seen |= solo
        diffs = _close("loss", loss, losses[rank]) + compare(model, ep, rank, world_size, "grad")
        if watch:
            ran_ep = calls_ep.gathered(world_size)
            if ran_ep != calls_model.ran:
                diffs.append(f"experts run: model {sorted(calls_model.ran)}, EP {sorted(ran_ep)}")
            calls_model.ran.clear()
            calls_ep.ran.clear()
        opt_model.step()
        opt_ep.step()
        opt_model.zero_grad(set_to_none=True)
        opt_ep.zero_grad(set_to_none=True)
        diffs += compare(model, ep, rank, world_size, "weight")
        report.diffs += [f"step {step}: {d}" for d in diffs]
        resync(model, ep, rank, world_size)
    return report


def target_named(name: str):
    return next(t for t in targets() if t.name == name)


# ---------------------------------------------------------------------------------------------
# Running over fuzz targets on gloo ranks (also as a module command)
# ---------------------------------------------------------------------------------------------


def worker(rank: int, world_size: int, cases: list[tuple[str, str, bool]]) -> dict:
    """For ``run_cases``: per case ``(target, optimizer, hooks)``, ``{"<target> <optimizer>[ hooks]": None | what
    differed}`` and ``{"... routing": None | which forced routing never happened}``."""
    from rank_parity import ep_mesh

    mesh = ep_mesh(world_size)
    results = {}
    for name, opt, hooks in cases:
        key = f"{name} {opt}{' hooks' if hooks else ''}"
        try:
            report = train_both(target_named(name), rank, world_size, mesh, opt, hooks=hooks)
        except Exception as exc:  # noqa: BLE001 - recorded per case; the group may be out of step after it
            results[key] = f"{type(exc).__name__}: {str(exc)[:300]}"
            results[f"{key} routing"] = None
            continue
        results[key] = "; ".join(report.diffs[:4]) if report.diffs else None
        missing = [w for w, seen in (("an idle expert", report.idle_seen), ("a one-rank expert", report.solo_seen))
                   if not seen]
        results[f"{key} routing"] = f"routing never gave {' or '.join(missing)}" if missing else None
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--targets", nargs="*", default=None, help="target names (default: every fuzz target)")
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    args = parser.parse_args(argv)
    from distributed import run_cases

    names = args.targets or [t.name for t in targets()]
    cases = [(n, o, False) for n, o in itertools.product(names, args.optimizers)]
    failed = 0
    for world_size in args.ranks:
        merged = run_cases(world_size, "train_loop:worker", cases)
        runs = [k for k in merged if not k.endswith(" routing")]
        bad = [k for k in runs if merged[k]]
        unforced = [k for k in merged if k.endswith(" routing") and merged[k]]
        print(f"{world_size} ranks: {len(runs)} runs ({len(names)} targets x {len(args.optimizers)} optimizers), "
              f"{len(runs) - len(bad)} exact, {len(bad)} differ; {len(unforced)} without both routings")
        for k in bad:
            print(f"  DIFF {k}: {merged[k][0][:400]}")
        for k in unforced:
            print(f"  ROUTING {k}: {merged[k][0][:200]}")
        failed += len(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    import testpaths

    testpaths.add()
    sys.exit(main())
