"""dispatch.ep_experts_forward: exchange + combine equal a naive per-(token, expert) loop, on 1, 2, 4 ranks.

Multi-rank cases run in one spawned gloo group per world size (see tests/distributed.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import guarded, run_cases

from autoep.runtime.dispatch import CALL, Idle, ep_experts_forward
from autoep.runtime.experts import glu_gate, grouped_swiglu

E, K = 8, 2
GATE = glu_gate(F.silu)


def _naive(x_TD, idx_TK, w_TK, gate_up_EHD, down_EDF):
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for k in range(idx_TK.shape[1]):
            e = idx_TK[t, k]
            h = GATE(x_TD[t] @ gate_up_EHD[e].T) @ down_EDF[e].T
            out[t] = out[t] + w_TK[t, k] * h
    return out


def _data(tokens_per_rank, D, seed=0, owner_only_rank=None, world_size=1):
    """Full-batch inputs identical on every rank; ``owner_only_rank`` routes that rank's tokens only to its own experts."""
    g = torch.Generator().manual_seed(seed)
    T = sum(tokens_per_rank)
    x = torch.randn(T, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.long)
    w = torch.rand(T, K, generator=g)
    gate_up = torch.randn(E, 2 * 4, D, generator=g) / D**0.5
    down = torch.randn(E, D, 4, generator=g) / 2
    grad = torch.randn(T, D, generator=g)
    if owner_only_rank is not None:
        lo = sum(tokens_per_rank[:owner_only_rank])
        L = E // world_size
        for t in range(lo, lo + tokens_per_rank[owner_only_rank]):
            idx[t] = torch.randperm(L, generator=g)[:K] + owner_only_rank * L
    return x, idx, w, gate_up, down, grad


def _check(rank, world_size, tokens_per_rank, D, owner_only_rank=None):
    x, idx, w, gate_up, down, grad = _data(tokens_per_rank, D, owner_only_rank=owner_only_rank, world_size=world_size)
    # Reference: the whole batch, all experts, one process.
    ref_params = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
    ref = _naive(ref_params[0], idx, ref_params[1], ref_params[2], ref_params[3])
    if ref.requires_grad:  # a zero-token batch has no graph; its reference grads are zeros
        (ref * grad).sum().backward()
    ref_grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ref_params]

    lo = sum(tokens_per_rank[:rank])
    hi = lo + tokens_per_rank[rank]
    L = E // world_size
    x_r = x[lo:hi].clone().requires_grad_()
    w_r = w[lo:hi].clone().requires_grad_()
    gu_r = gate_up[rank * L : (rank + 1) * L].clone().requires_grad_()
    dn_r = down[rank * L : (rank + 1) * L].clone().requires_grad_()
    group = dist.group.WORLD if world_size > 1 else None
    fn = functools.partial(_local_experts, gate_up=gu_r, down=dn_r)
    out = ep_experts_forward(x_r, idx[lo:hi], w_r, num_experts=E, ep_group=group, expert_fn=fn)
    (out * grad[lo:hi]).sum().backward()

    gathered = [_gather(gu_r.grad, world_size), _gather(dn_r.grad, world_size)]
    torch.testing.assert_close(out, ref[lo:hi])
    torch.testing.assert_close(x_r.grad, ref_grads[0][lo:hi])
    torch.testing.assert_close(w_r.grad, ref_grads[1][lo:hi])
    torch.testing.assert_close(gathered[0], ref_grads[2])
    torch.testing.assert_close(gathered[1], ref_grads[3])


def _local_experts(x_SD, counts, *, gate_up, down):
    return grouped_swiglu(x_SD, counts, gate_up, down, apply_gate=GATE)


def _gather(t, world_size):
    if world_size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world_size)]
    # NOTE: collective; test-side gather of expert grads.
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _check_idle_module_experts(rank, world_size):
    """Module experts whose loop skips idle ones: every token of every rank goes to expert 0 (rank 0's), so the
    other ranks run no expert yet get results back (their empty share takes rank 0's width and dtype). Values
    and input grads equal the loop's; only expert 0 runs and has a grad, every other expert's stays None."""
    D, T = 6, 3
    torch.manual_seed(0)
    experts = [torch.nn.Linear(D, 2 * D, bias=False) for _ in range(E)]  # the same on every rank; output 2D wide
    x = torch.randn(world_size * T, D)
    L, called = E // world_size, []
    local = experts[rank * L:(rank + 1) * L]

    def expert_fn(x_SD, counts, status):
        called.extend(rank * L + e for e, s in enumerate(status) if s == CALL)
        chunks = torch.split(x_SD, counts.tolist())
        return torch.cat([local[e](c) for e, (c, s) in enumerate(zip(chunks, status)) if s == CALL])

    x_r = x[rank * T:(rank + 1) * T].clone().requires_grad_()
    idx = torch.zeros(T, 1, dtype=torch.long)
    idle = Idle("skip", per_expert=True, params=lambda e: list(local[e].parameters()))
    out = ep_experts_forward(x_r, idx, torch.ones(T, 1), num_experts=E, ep_group=dist.group.WORLD,
                             expert_fn=expert_fn, out_dtype="experts", idle=idle)
    out.sum().backward()
    x_ref = x[rank * T:(rank + 1) * T].clone().requires_grad_()
    experts[0](x_ref).sum().backward()
    torch.testing.assert_close(out, experts[0](x_ref).detach())
    torch.testing.assert_close(x_r.grad, x_ref.grad)
    assert called == ([0] if rank == 0 else [])
    assert [p.weight.grad is not None for p in local] == [rank == 0 and e == 0 for e in range(L)]


def _check_idle_batched_experts(rank, world_size):
    """3-D experts whose loop skips idle ones: with only padding ids on every rank no expert runs and every rank's
    shard keeps ``grad is None``; with one routed pair anywhere every rank's shard gets a gradient (zeros where no
    row came), as the model's whole tensor does."""
    L, D = E // world_size, 4
    shard = torch.randn(L, D, D, requires_grad=True)

    def expert_fn(x_SD, counts):
        return torch.cat([c @ shard[e] for e, c in enumerate(torch.split(x_SD, counts.tolist()))])

    for routed, has_grad in ((False, False), (True, True)):
        shard.grad = None
        idx = torch.full((2, 1), E)  # padding
        if routed and rank == 0:
            idx[0, 0] = E - 1  # the last rank's expert
        out = ep_experts_forward(torch.randn(2, D, requires_grad=True), idx, torch.ones(2, 1), num_experts=E,
                                 ep_group=dist.group.WORLD, expert_fn=expert_fn, idle=Idle("skip"))
        out.sum().backward()
        assert (shard.grad is not None) == has_grad, (routed, rank)
        if has_grad:
            assert bool(shard.grad.any()) == (rank == world_size - 1)


SPLITS = {2: [(7, 3), (1, 9), (0, 6)], 4: [(5, 0, 3, 1), (2, 2, 2, 2)]}


def dispatch_cases(rank, world_size):
    results = {}
    for tokens in SPLITS[world_size]:
        for D in (16, 6):  # 16: grouped_mm path; 6: unaligned rows take the exact loop
            guarded(results, f"tokens={tokens},D={D}", _check, rank, world_size, list(tokens), D)
    guarded(results, "owner_only", _check, rank, world_size, list(SPLITS[world_size][0]), 16, 0)
    guarded(results, "idle_module_experts", _check_idle_module_experts, rank, world_size)
    guarded(results, "idle_batched_experts", _check_idle_batched_experts, rank, world_size)
    return results


def test_single_process_matches_naive():
    _check(0, 1, [9], 16)
    _check(0, 1, [5], 6)


def test_zero_tokens_single_process():
    _check(0, 1, [0], 16)


@pytest.fixture(scope="module", params=[2, 4])
def multi_rank(request):
    return request.param, run_cases(request.param, "test_dispatch:dispatch_cases")


def test_multi_rank_matches_naive(multi_rank):
    world_size, results = multi_rank
    assert results, "no case ran"
    failed = {name: errs for name, errs in results.items() if errs}
    assert not failed, f"world_size={world_size}: " + "\n".join(f"{n}:\n{e[0]}" for n, e in failed.items())
