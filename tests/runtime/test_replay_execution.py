"""The plan entry's ``execution`` key at run time (``autoep.plan.resolve``; ``autoep.runtime.recipes.replay``),
and activation checkpointing around record / exchange / replay, on 2 gloo ranks.

- ``execution: replay`` on a block whose loop the fast path proves (the v4 Mixtral-style ModuleList block,
  spliced under auto) runs it by record / exchange / replay, exactly as its own forward.
- ``torch.utils.checkpoint`` (reentrant and not) around a layer holding a replay block: the recomputation in
  backward runs the block's two passes and the exchange again, the RNG restored by the checkpoint and by the
  replay alike; output, input, router, norm and expert grads equal the same layer's own under the same
  checkpointing (each rank on its own tokens: dense grads summed over ranks, expert grads from their owner);
  also with a rank that has no tokens (non-reentrant: its recomputation must start before the exchange's
  backward, and an early stop inside pass 2 must not count as a failed check).
"""

from __future__ import annotations

import copy

import blocks
import pytest
import replay_blocks as rb
import torch
import torch.distributed as dist
from distributed import guarded, run_cases
from test_replay import _data, _mesh, _run
from torch import nn
from torch.utils.checkpoint import checkpoint

from autoep.plan.resolve import resolve_plan
from autoep.runtime.apply import apply_plan


class Layer(nn.Module):
    """A decoder layer's MoE half: ``x + mlp(norm(x))``, its forward through ``torch.utils.checkpoint`` where
    ``use_reentrant`` is not None (the way transformers' ``GradientCheckpointingLayer`` calls it)."""

    def __init__(self, mlp: nn.Module, use_reentrant: bool | None):
        super().__init__()
        self.norm = nn.LayerNorm(rb.D)
        self.mlp = mlp
        self.use_reentrant = use_reentrant
        self.calls = 0  # the block's calls, the recomputation's included

    def forward(self, x):
        if self.use_reentrant is None:
            return self._inner(x)
        return checkpoint(self._inner, x, use_reentrant=self.use_reentrant)

    def _inner(self, x):
        self.calls += 1
        out = self.mlp(self.norm(x))
        return x + (out[0] if isinstance(out, tuple) else out)


def _mixtral() -> nn.Module:
    return blocks.MixtralStyleSparseMoeBlock(hidden=rb.D, ffn=16, num_experts=rb.E, top_k=rb.K)


MLPS = {"mixtral_forced": _mixtral, "dropout_between_calls": rb.DropoutBetweenCallsMoE}


def _layer(mlp: str, use_reentrant: bool | None) -> nn.Module:
    torch.manual_seed(sum(map(ord, mlp)))
    layer = Layer(MLPS[mlp](), use_reentrant).train()
    with torch.no_grad():  # a norm that is not the identity
        layer.norm.weight.uniform_(0.5, 1.5)
        layer.norm.bias.uniform_(-0.5, 0.5)
    return layer


def _ep_layer(ref: nn.Module, world_size: int, entry: dict) -> tuple[nn.Module, dict]:
    model = nn.ModuleDict({"layer": copy.deepcopy(ref)})
    resolved = resolve_plan({"ep_size": world_size, "plan": [{"match": "layer.mlp", **entry}]}, model)
    apply_plan(model, resolved, _mesh(world_size))
    return model["layer"], resolved.plan[0]


def _slices(batches: list[int]):
    """Each rank's (x, grad_out): ``batches[r]`` sequences for rank r (0: a rank without tokens)."""
    x, grad_out = _data(1)[0]
    bounds = [sum(batches[:r]) for r in range(len(batches) + 1)]
    return [(x[lo:hi], grad_out[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]


def _check(rank: int, world_size: int, mlp: str, use_reentrant: bool | None, entry: dict,
           batches: list[int] = (1, 3)) -> None:
    slices = _slices(list(batches))
    ref = _layer(mlp, use_reentrant)
    layer, resolved = _ep_layer(ref, world_size, entry)
    assert resolved.decision.structure.execution == "replay", resolved.decision.structure.execution
    ref_results = [_run(ref, *s, seed=100 + r) for r, s in enumerate(slices)]
    out, x_grad, rng_after = _run(layer, *slices[rank], seed=100 + rank)
    assert layer.calls == (1 if use_reentrant is None else 2), layer.calls  # recomputed in backward

    experts = {n for n, _ in ref.named_parameters() if n.startswith("mlp.experts.")}
    # Collectives first, in the same order on every rank; compare after.
    dense = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in layer.named_parameters() if n not in experts}
    mine = {n: None if p.grad is None else p.grad.clone()
            for n, p in layer.named_parameters() if n in experts and p.device.type != "meta"}
    for g in dense.values():
        dist.all_reduce(g)  # NOTE: collective; replicated router and norm grads sum over ranks
    held = [None] * world_size
    dist.all_gather_object(held, mine)  # NOTE: collective; each expert lives on its owner rank

    ref_out, ref_x_grad, ref_rng = ref_results[rank]
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(x_grad, ref_x_grad)
    assert torch.equal(rng_after, ref_rng), "the RNG after the layer differs from the layer's own run"
    ref_params = dict(ref.named_parameters())
    assert {"norm.weight", "mlp.gate.weight"} <= dense.keys()
    for n, g in dense.items():
        want = ref_params[n].grad if ref_params[n].grad is not None else torch.zeros_like(g)
        torch.testing.assert_close(g, want, msg=lambda m: f"{n}: {m}")
    gathered = {k: v for part in held for k, v in part.items()}
    assert gathered.keys() == experts, sorted(experts - gathered.keys())
    for n, grad in gathered.items():
        want = ref_params[n].grad
        assert (grad is None) == (want is None), f"{n}: grad None under EP xor in the layer's own run"
        if want is not None:
            torch.testing.assert_close(grad, want, msg=lambda m: f"{n}: {m}")


CASES = {
    # execution: replay forced on a block whose loop the fast path proves (auto would splice it)
    "forced/plain": ("mixtral_forced", None, {"execution": "replay"}),
    **{f"checkpoint/{mlp}/reentrant={r}": (mlp, r, {"execution": "replay"} if mlp == "mixtral_forced"
                                           else {"record_replay": True})
       for mlp in MLPS for r in (False, True)},
    # a rank without tokens recomputes (and exchanges) in step with its peer
    **{f"checkpoint/empty_rank/reentrant={r}": ("dropout_between_calls", r, {"record_replay": True}, [0, 4])
       for r in (False, True)},
}


def execution_cases(rank: int, world_size: int) -> dict:
    results = {}
    for name, case in CASES.items():
        guarded(results, name, _check, rank, world_size, *case)
    return results


_RESULTS: dict = {}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks(case):
    if not _RESULTS:
        _RESULTS.update(run_cases(2, "test_replay_execution:execution_cases"))
    assert case in _RESULTS, f"case {case} did not run"
    assert not _RESULTS[case], "\n".join(_RESULTS[case])
