"""Parity of one MoE block under EP against its own forward, for blocks built in any mode (train or eval) and any
plan entry keys (``execution``, ``expert_draws``): the checks of ``tests/runtime/test_replay.py`` for a block a test
builds itself.

Parity (DESIGN.md): each rank feeds its own tokens (uneven, one rank empty at W=4); its output and input grad equal
the block's own on those tokens; dense (router) grads summed over ranks, and every expert parameter's grad (from the
rank owning it, by the model's own name) equal the block's own summed over every rank's tokens, ``None`` exactly
where the block's own leaves it ``None``. The plan is the real one: ``resolve_plan`` then ``apply_plan``.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autoep.plan.resolve import resolve_plan
from autoep.runtime.apply import apply_plan
from autoep.runtime.recipes.local_experts import expert_owners

SEQ = 3
BATCH_PER_RANK = {1: [4], 2: [1, 3], 4: [2, 0, 3, 1]}


def data(world_size: int, hidden: int, batches=None, seed: int = 7):
    """Each rank's ``(x, grad_out)``: ``(batch, SEQ, hidden)``, uneven batches (one rank empty at W=4)."""
    g = torch.Generator().manual_seed(seed)
    batches = batches or BATCH_PER_RANK[world_size]
    x = torch.randn(sum(batches), SEQ, hidden, generator=g)
    grad_out = torch.randn(x.shape, generator=g)
    bounds = [sum(batches[:r]) for r in range(world_size + 1)]
    return [(x[lo:hi], grad_out[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]


@functools.lru_cache(maxsize=None)
def mesh(world_size: int):
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)) if world_size > 1 else None


def ep_model(block: nn.Module, world_size: int, **entry) -> tuple[nn.Module, object]:
    """``block`` as ``mlp`` of a model, resolved with the plan entry's extra keys ``entry`` and applied."""
    model = nn.ModuleDict({"mlp": block})
    resolved = resolve_plan({"ep_size": world_size, "plan": [{"match": "mlp", **entry}]}, model)
    apply_plan(model, resolved, mesh(world_size))
    return model, resolved


def run(block: nn.Module, x: torch.Tensor, grad_out: torch.Tensor, seed: int = 0):
    """``(output, input grad)`` of one forward and backward of ``(out * grad_out).sum()``."""
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    out = block(x * 1)
    loss = (out * grad_out).sum()
    if loss.requires_grad:
        loss.backward()
    return out.detach(), x.grad if x.grad is not None else torch.zeros_like(x)


def grads(model: nn.Module, world_size: int) -> tuple[dict, dict]:
    """``(dense grads summed over ranks, {expert param: (value, grad)} gathered from the owners)``, by the model's
    own names under ``mlp.``. Collectives, in the same order on every rank."""
    return gathered_grads(model["mlp"], {k[len("mlp."):] for k in expert_owners(model)}, world_size)


def gathered_grads(block: nn.Module, experts: set[str], world_size: int) -> tuple[dict, dict]:
    """``grads`` of ``block`` whose expert parameters are named ``experts``: the dense grads summed over ranks
    (zeros where ``None``), each expert parameter's ``(value, grad)`` gathered from its owner."""
    dense = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in block.named_parameters() if n not in experts}
    mine = {n: (p.detach().clone(), None if p.grad is None else p.grad.clone())
            for n, p in block.named_parameters() if n in experts and p.device.type != "meta"}
    held = [mine]
    if world_size > 1:
        for g in dense.values():
            dist.all_reduce(g)  # NOTE: collective; replicated router grads sum over ranks
        held = [None] * world_size
        dist.all_gather_object(held, mine)  # NOTE: collective; each expert lives on its owner rank
    return dense, {k: v for part in held for k, v in part.items()}


def assert_grads_match(ref: nn.Module, dense: dict, experts: dict, exact: bool = False) -> None:
    """The gathered grads equal ``ref``'s (its grads summed over every rank's tokens); ``exact``: bit for bit."""
    check = (lambda a, b, msg: torch.equal(a, b) or _fail(msg)) if exact else \
        (lambda a, b, msg: torch.testing.assert_close(a, b, msg=lambda m: f"{msg}: {m}"))
    params = dict(ref.named_parameters())
    for n, g in dense.items():
        check(g, params[n].grad if params[n].grad is not None else torch.zeros_like(g), n)
    assert experts.keys() == {n for n in params if n not in dense}, sorted(experts)
    for n, (value, grad) in experts.items():
        check(value, params[n].detach(), n)
        want = params[n].grad
        assert (grad is None) == (want is None), f"{n}: grad {grad is None} under EP, {want is None} in the block's own"
        if want is not None:
            check(grad, want, n)


def _fail(msg: str):
    raise AssertionError(f"{msg}: not bit-identical")


def check_parity(make, rank: int, world_size: int, hidden: int, **entry) -> None:
    """``make()`` (a block, built in its mode) under EP on ``world_size`` ranks equals its own forward (module
    docstring); ``entry``: the plan entry's extra keys."""
    slices = data(world_size, hidden)
    ref = make()
    ref_results = [run(ref, *s, seed=100 + r) for r, s in enumerate(slices)]
    model, _ = ep_model(make(), world_size, **entry)
    assert model["mlp"].state_dict().keys() == ref.state_dict().keys()  # the model's own names
    out, x_grad = run(model["mlp"], *slices[rank], seed=100 + rank)
    dense, experts = grads(model, world_size)
    torch.testing.assert_close(out, ref_results[rank][0])
    torch.testing.assert_close(x_grad, ref_results[rank][1])
    assert_grads_match(ref, dense, experts)
