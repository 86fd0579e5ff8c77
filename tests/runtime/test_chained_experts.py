"""Chained experts fused on their owner (issue 31 item 2, ``autoep.runtime.recipes.chains``): a LoRA chain
``lora_B[i](lora_A[i](x))`` travels in one exchange instead of one per link, where nothing but the next link reads
the intermediate. Per case, on 1, 2 and 4 gloo ranks (one rank with no tokens), two steps (forward, backward, SGD):

- **parity with the model**: ``test_one_pass``'s comparison (output, input grad, the global RNG after the call,
  dense grads summed over ranks, expert values and grads from their owners, the block's visible state);
- **bit-equal to the staged execution** (``chains.FUSE = False``: each link in its own exchange): output, input
  grad, RNG, every local grad (router and both LoRA matrices) and the visible state, ``torch.equal``;
- **what was fused**: exchanges per forward and the chains each one carried (calls per item), fused and staged.

Fused: LoRA chains of two and three modules (ModuleList, ModuleDict, numbered attributes), an adapter with ``F.gelu`` between its links
(applied on the owner). Cases that must not fuse (each as exact): a hook on ``lora_A[i]``, an intermediate (or an
activation's output) the block reads or keeps, a ``no_grad`` around one link, dropout between the links. A chain
across two owners is refused before it could run (``lora_B[(i + 1) % E]``, the misaligned twin): no accepted
spelling makes one.

    pytest tests/runtime/test_chained_experts.py
"""
from __future__ import annotations

import datetime
import functools

import one_pass_blocks as ob
import pytest
import role_blocks as rb
import role_blocks_attrs as ra
import test_one_pass as top
import torch
import torch.distributed as dist
from distributed import guarded, run_cases
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autoep.errors import UnsupportedModuleStructure
from autoep.plan.resolve import resolve_plan
from autoep.runtime.recipes import chains, replay

SPLITS = ob.EMPTY_RANK  # batch rows per rank: one rank with no tokens
# name -> (block, exchanges per forward fused, staged, calls per item fused)
CASES = {
    "lora_mixture_3": (rb.LoraMixture3MoE, 1, 2, [2] * rb.E),
    "lora_dict": (rb.LoraDictMoE, 1, 2, [2] * rb.E),
    "numbered_lora": (ra.NumberedLoraMoE, 1, 2, [2] * rb.E),  # getattr(self, f"lora_B{i}")(getattr(...)(x))
    "lora_chain_3": (rb.LoraChain3MoE, 1, 3, [3] * rb.E),
    "adapter_gelu": (rb.AdapterMixtureMoE, 1, 2, [2] * rb.E),  # the activation between the links on the owner
    # must not fuse: dropout between the links (its draws are the caller's, in the forward's order)
    "adapter_dropout": (rb.AdapterDropoutMoE, 2, 2, [1] * 2 * rb.E),
    # expert 0's activation output and expert 1's first output kept by the block: those two stay staged
    "adapter_keeps": (rb.AdapterKeepsMoE, 2, 2, [1, 1, 1, 1, 2, 2]),
    # must not fuse: a hook on the intermediate module; a no_grad around one link
    "hook_on_lora_A": (rb.LoraHookedMoE, 2, 2, [1] * 2 * rb.E),
    "no_grad_link": (rb.LoraNoGradLinkMoE, 2, 2, [1] * 2 * rb.E),
    # expert 0's intermediate read by a taped call, expert 1's kept by the block: those two stay staged
    "reads_intermediate": (rb.LoraReadsIntermediateMoE, 2, 2, [1, 1, 1, 1, 2, 2]),
}


def _register() -> None:
    ob.CASES.update({name: ob.Case(block, splits=SPLITS) for name, (block, *_) in CASES.items()})


class _Counted:
    """Exchanges (``replay._exchange`` calls), the calls per item they carried, all-to-alls and the bytes of the
    rows, outputs and gradients they moved."""

    def __init__(self):
        self.exchanges, self.items, self.a2a, self.bytes = 0, [], 0, 0

    def __enter__(self):
        self.saved = replay._exchange, chains.sent, dist.all_to_all_single

        def exchange(*args, **kwargs):
            self.exchanges += 1
            return self.saved[0](*args, **kwargs)

        def sent(*args, **kwargs):
            items = self.saved[1](*args, **kwargs)
            self.items += [len(s.calls) for s in items]
            return items

        def a2a(output, input, *args, **kwargs):
            self.a2a += 1
            if input.is_floating_point():  # rows, outputs and their gradients (not the counts)
                self.bytes += input.numel() * input.element_size()
            return self.saved[2](output, input, *args, **kwargs)

        replay._exchange, chains.sent, dist.all_to_all_single = exchange, sent, a2a
        return self

    def __exit__(self, *exc):
        replay._exchange, chains.sent, dist.all_to_all_single = self.saved


def _steps(name: str, rank: int, world_size: int, fuse: bool) -> list[dict]:
    """The EP model's two steps with fusion on or off: per step what this rank sees and what travelled."""
    group = mesh = None
    if world_size > 1:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
        mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("ep",))
    chains.FUSE = fuse
    try:
        model = top._ep_model(name, world_size, mesh, None)
        params = {n: p for n, p in model.named_parameters() if p.device.type != "meta"}
        case, steps = ob.CASES[name], []
        for t, mode in enumerate(case.modes):
            x, grad_out = top._data(case, world_size, t)[rank]
            with _Counted() as counted:
                out, x_grad, rng = top._call(model, x, grad_out, top._seed(t, rank), mode)
            grads = {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}
            steps.append({"out": out, "x_grad": x_grad, "rng": rng, "grads": grads, "state": top._visible(model),
                          "exchanges": counted.exchanges, "items": counted.items, "a2a": counted.a2a,
                          "bytes": counted.bytes})
            top._sgd(params, grads)
        return steps
    finally:
        chains.FUSE = True


def _equal(got, want, path: str = "") -> list[str]:
    if isinstance(want, torch.Tensor):
        return [] if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want) else [path]
    if isinstance(want, dict):
        if got.keys() != want.keys():
            return [f"{path} keys"]
        return [d for k in want for d in _equal(got[k], want[k], f"{path}.{k}")]
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [f"{path} length"]
        return [d for i, (a, b) in enumerate(zip(got, want)) for d in _equal(a, b, f"{path}[{i}]")]
    return [] if got == want else [f"{path}: {got!r} fused, {want!r} staged"]


def _check(name: str, rank: int, world_size: int) -> None:
    _, fused_exchanges, staged_exchanges, items = CASES[name]
    result, said = top.verdict(name, top.case_outcome(name, rank, world_size))
    assert result == "pass", f"parity with the model: {said}"
    fused, staged = _steps(name, rank, world_size, True), _steps(name, rank, world_size, False)
    for t, (f, s) in enumerate(zip(fused, staged)):
        travelled = ("exchanges", "items", "a2a", "bytes")
        diffs = _equal({k: v for k, v in f.items() if k not in travelled},
                       {k: v for k, v in s.items() if k not in travelled})
        assert not diffs, f"step {t}: fused differs from staged in {diffs[:6]}"
        counts = (f["exchanges"], s["exchanges"])
        assert counts == (fused_exchanges, staged_exchanges), (t, counts)
        assert sorted(f["items"]) == sorted(items), f["items"]
        assert s["items"] == [1] * len(s["items"])
        if world_size > 1:  # 3 all-to-alls per exchange forward (counts, rows, outputs), 2 backward where it needs
            assert (f["a2a"] < s["a2a"]) == (fused_exchanges < staged_exchanges), (f["a2a"], s["a2a"])
            assert f["a2a"] <= s["a2a"] and f["bytes"] <= s["bytes"], (f["a2a"], s["a2a"], f["bytes"], s["bytes"])
            if items == [1] * len(items):  # nothing fused: the same exchanges, the same bytes
                assert f["bytes"] == s["bytes"], (f["bytes"], s["bytes"])


def chain_cases(rank: int, world_size: int) -> dict:
    _register()
    results: dict = {}
    for name in CASES:
        guarded(results, name, _check, name, rank, world_size)
    return results


@functools.cache
def _results(world_size: int) -> dict:
    return run_cases(world_size, "test_chained_experts:chain_cases")


@pytest.fixture
def registered(monkeypatch):
    for name, (block, *_) in CASES.items():
        monkeypatch.setitem(ob.CASES, name, ob.Case(block, splits=SPLITS))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(CASES))
def test_one_rank(name, registered):
    _check(name, 0, 1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks(world_size):
    results = _results(world_size)
    assert results.keys() == CASES.keys()
    failed = {case: errors for case, errors in results.items() if errors}
    assert not failed, "\n".join(f"{case}: {errors[0][-1500:]}" for case, errors in failed.items())


def test_a_chain_across_two_owners_is_refused():
    """The one spelling of a chain over two experts' modules (``lora_B[(i + 1) % E]``, an expert's A into the next
    expert's B, on another owner) is refused at detection: it never reaches the exchange."""
    model = nn.ModuleDict({"mlp": rb.LoraMisalignedTwin()})
    with pytest.raises(UnsupportedModuleStructure, match="not selected by that id"):
        resolve_plan({"ep_size": 1, "plan": [{"match": "mlp", "execution": "replay"}]}, model)
