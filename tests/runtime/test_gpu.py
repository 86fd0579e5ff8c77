"""GPU-only code paths (marker ``gpu``): skipped without CUDA, the NCCL case without 2 GPUs (one rank per GPU).

- CUDA ``grouped_mm`` in bf16 and its alignment rules: widths whose rows are 16-byte multiples take the grouped
  GEMM (sm80+), odd widths fall back to the exact per-expert loop, and neither crashes; both equal the per-expert
  loop computed in fp32 on the same bf16 values. Tolerance: bf16 keeps 8 mantissa bits (relative rounding
  2^-9 ~ 2e-3 per rounding); outputs and grads pass through two GEMMs and bf16 intermediates, whose rounding
  errors scale with the summands rather than with each result, so rtol=2e-2 and atol=2e-2 x the largest
  reference value.
- CUDA RNG under activation checkpointing: tiny Mixtral with router jitter (RNG inside the EP block) and
  attention dropout (RNG around it), EP applied; with transformers' gradient checkpointing the recomputation must
  draw the same numbers (torch's checkpoint restores the CUDA RNG state): loss and every grad equal the run
  without checkpointing, fp32 defaults; another seed gives another loss, so the RNG is really drawn.
- NCCL all-to-all with uneven splits (a rank that sends nothing, one that receives nothing): the exchange and the
  combine equal the naive per-(token, expert) loop on the whole batch (``test_dispatch``'s reference), fp32.

Each check takes its device (and backend), so the same code runs on CPU/gloo where the CPU suite covers it
(``test_experts``, ``test_checkpointing``, ``test_dispatch``).

    python -m pytest -q -m gpu tests/runtime/test_gpu.py      # on a GPU machine (2 GPUs for the NCCL case)
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed import guarded, run_cases

from autoep.runtime.experts import can_use_grouped_mm, glu_gate, grouped_swiglu

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (one NCCL rank each)")

GATE = glu_gate(F.silu)


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 against an fp32 reference (module docstring)."""
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max().clamp(min=1e-3)))


# (D, F): bf16 rows of 16-byte multiples (D, F multiples of 8) take the grouped GEMM; the others fall back
WIDTHS = [(64, 32), (32, 8), (17, 5), (24, 12), (8, 3)]
COUNTS = [3, 0, 5, 1]  # rows per local expert; one expert gets none


def grouped_case(device: str, D: int, Fi: int, dtype=torch.bfloat16) -> bool:
    """grouped_swiglu forward and backward on ``device`` vs the per-expert loop in fp32; returns whether the
    grouped GEMM ran."""
    g = torch.Generator().manual_seed(D * 100 + Fi)
    counts = torch.tensor(COUNTS)
    leaves = [torch.randn(int(counts.sum()), D, generator=g), torch.randn(len(COUNTS), 2 * Fi, D, generator=g) / D**0.5,
              torch.randn(len(COUNTS), D, Fi, generator=g) / Fi**0.5]
    x, gate_up, down = (t.to(device, dtype).requires_grad_() for t in leaves)
    out = grouped_swiglu(x, counts.to(device), gate_up, down, apply_gate=GATE)
    grad = torch.randn(out.shape, generator=g).to(device, dtype)
    out.backward(grad)
    ref_leaves = [t.detach().float().cpu().requires_grad_() for t in (x, gate_up, down)]
    rx, rgu, rdn = ref_leaves
    ref = torch.cat([GATE(chunk @ rgu[e].T) @ rdn[e].T for e, chunk in enumerate(torch.split(rx, COUNTS))])
    ref.backward(grad.float().cpu())
    assert_bf16_close(out, ref.detach())
    for got, want in zip((x, gate_up, down), ref_leaves):
        assert_bf16_close(got.grad, want.grad)
    return can_use_grouped_mm(x.detach(), gate_up.detach().transpose(-2, -1))


@needs_cuda
@pytest.mark.parametrize("D, Fi", WIDTHS)
def test_cuda_grouped_mm_bf16_aligned_or_falls_back(D, Fi):
    grouped = grouped_case("cuda", D, Fi)
    aligned = D % 8 == 0 and Fi % 8 == 0
    assert grouped == (aligned and torch.cuda.get_device_capability() >= (8, 0)), (D, Fi)


def rng_checkpoint_case(device: str) -> None:
    from hydra.utils import instantiate
    from test_resolve import model_cfg

    from autoep.plan.resolve import resolve_plan
    from autoep.runtime.apply import apply_plan

    torch.manual_seed(0)
    model = instantiate(model_cfg("mixtral"), router_jitter_noise=0.5, attention_dropout=0.3).to(device)
    parallel = resolve_plan({"plan": [{"match": "model.layers.*.mlp"}]}, model)
    assert parallel.plan[0].decision.structure["jitter"]
    apply_plan(model, parallel, None)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)

    calls: list = []
    model.model.layers[0].mlp.register_forward_hook(lambda *_: calls.append(1))

    def run(checkpointing: bool, seed: int = 5):
        model.zero_grad(set_to_none=True)
        (model.activation_checkpointing_enable if checkpointing else model.activation_checkpointing_disable)()
        torch.manual_seed(seed)  # CPU and every CUDA device
        # NOTE: early stop off: the recomputation runs the whole layer, the EP block (its jitter) included
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (loss, grads), (loss_ckpt, grads_ckpt) = run(False), run(True)
    assert len(calls) == 3, calls  # the block: once without checkpointing; forward and recomputation with it
    torch.testing.assert_close(loss_ckpt, loss)
    assert grads_ckpt.keys() == grads.keys() and any(".experts." in n for n in grads)
    for n in grads:
        torch.testing.assert_close(grads_ckpt[n], grads[n], msg=lambda m, n=n: f"{n}: {m}")
    assert run(True, seed=6)[0] != loss  # the jitter and the dropout draw from the RNG: another seed differs


@needs_cuda
def test_cuda_rng_under_activation_checkpointing():
    rng_checkpoint_case("cuda")


def exchange_case(rank: int, world_size: int, tokens_per_rank: list[int], device: torch.device) -> None:
    """``test_dispatch``'s exchange + combine check, the EP side on ``device``."""
    import functools

    import torch.distributed as dist
    from test_dispatch import E, _data, _gather, _local_experts, _naive

    from autoep.runtime.dispatch import ep_experts_forward

    D = 8
    x, idx, w, gate_up, down, grad = _data(tokens_per_rank, D)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
    ref = _naive(*ref_leaves[:1], idx, *ref_leaves[1:])
    if ref.requires_grad:
        (ref * grad).sum().backward()
    ref_grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ref_leaves]
    lo, L = sum(tokens_per_rank[:rank]), E // world_size
    hi = lo + tokens_per_rank[rank]
    x_r, w_r = (t[lo:hi].to(device).requires_grad_() for t in (x, w))
    gu_r, dn_r = (t[rank * L:(rank + 1) * L].to(device).requires_grad_() for t in (gate_up, down))
    fn = functools.partial(_local_experts, gate_up=gu_r, down=dn_r)
    out = ep_experts_forward(x_r, idx[lo:hi].to(device), w_r, num_experts=E, ep_group=dist.group.WORLD, expert_fn=fn)
    (out * grad[lo:hi].to(device)).sum().backward()
    torch.testing.assert_close(out.cpu(), ref[lo:hi].detach())
    torch.testing.assert_close(x_r.grad.cpu(), ref_grads[0][lo:hi])
    torch.testing.assert_close(w_r.grad.cpu(), ref_grads[1][lo:hi])
    torch.testing.assert_close(_gather(gu_r.grad, world_size).cpu(), ref_grads[2])
    torch.testing.assert_close(_gather(dn_r.grad, world_size).cpu(), ref_grads[3])


UNEVEN = ([3, 0], [0, 4], [5, 2], [1, 1])


def exchange_cases(rank: int, world_size: int, device_type: str) -> dict:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device(device_type)
    results: dict = {}
    for tokens in UNEVEN:
        guarded(results, f"tokens per rank {tokens}", exchange_case, rank, world_size, tokens, device)
    return results


@needs_two
def test_nccl_all_to_all_uneven_splits():
    failed = {c: e for c, e in run_cases(2, "test_gpu:exchange_cases", "cuda", backend="nccl").items() if e}
    assert not failed, "\n".join(f"{c}: {e[0]}" for c, e in failed.items())
