"""3-D expert weights on the block itself (issue 31 item 3, ``autoep.runtime.recipes.block_weights``): the blocks of
``tests/block_weight_blocks.py`` under EP on 1, 2 and 4 gloo ranks (one rank without tokens at 4), two steps each
(forward, backward, SGD at lr 0.1) then one in eval under ``no_grad``, compared after every step with the block's
own forward run on every rank's slice (its grads summed over them): output and input grad of this rank's slice, what
the block keeps in attributes (as its own copy on this rank's slices keeps it), the router's (dense) grads summed
over ranks, every expert weight's value and grad gathered from the owners' slices (``None`` exactly where the
block's own is ``None``), the weights still ``Shard(0)`` DTensors under the model's own names. A seeded
``model.apply(init)`` draws the model's weights; under activation checkpointing (reentrant or not) it is exact; a
weight replaced after apply by a plain full tensor raises on every rank.

    pytest tests/runtime/test_block_weights.py
"""
from __future__ import annotations

import copy
import functools

import block_weight_blocks as bwb
import pytest
import torch
import torch.distributed as dist
from distributed import guarded, run_cases
from ep_parity import data, mesh, run
from torch import nn

from autoep.errors import LiveStateError
from autoep.plan.resolve import resolve_plan
from autoep.runtime.apply import apply_plan

LR = 0.1
STEPS = 2


def _weights(block: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in block.named_parameters() if p.dim() == 3}


def _gathered(t, world_size: int):
    """The full tensor of an expert weight (or its grad) from every rank's local slice; None where every rank's is
    None; a rank with None beside ranks with a slice is an error (the model's one tensor is all or nothing)."""
    local = None if t is None else (t.to_local() if hasattr(t, "to_local") else t).detach().clone()
    if world_size == 1:
        return local
    held = [None] * world_size
    dist.all_gather_object(held, local)  # NOTE: collective; each rank holds its experts' slices
    if all(h is None for h in held):
        return None
    assert all(h is not None for h in held), f"grad None on ranks {[r for r, h in enumerate(held) if h is None]}"
    return torch.cat(held)


def _check_block(name: str, rank: int, world_size: int) -> None:
    torch.manual_seed(3)
    ref = bwb.BLOCKS[name]()
    model = nn.ModuleDict({"mlp": copy.deepcopy(ref)})
    mine = copy.deepcopy(ref)  # the block's own copy on this rank's slices alone (its Python state)
    resolved = resolve_plan({"ep_size": world_size, "plan": [{"match": "mlp"}]}, model)
    assert resolved["plan"][0]["decision"]["structure"]["expert_storage"] == "block_weights"
    apply_plan(model, resolved, mesh(world_size))
    block = model["mlp"]
    assert block.state_dict().keys() == ref.state_dict().keys()  # the model's own names
    experts = _weights(ref).keys()
    for n in experts:
        p = block.get_parameter(n)
        assert world_size == 1 or type(p.data).__name__ == "DTensor" and p.to_local().shape[0] == p.shape[0] // world_size
    for step in range(STEPS):
        slices = data(world_size, bwb.D, seed=11 + step)
        want = [run(ref, *s, seed=100 + r) for r, s in enumerate(slices)]  # ref's grads: summed over every slice
        out, x_grad = run(block, *slices[rank], seed=100 + rank)
        torch.testing.assert_close(out, want[rank][0])
        torch.testing.assert_close(x_grad, want[rank][1])
        if hasattr(ref, "visible_state"):  # what the block kept: as its own copy on this rank's slices keeps it
            mine.load_state_dict(ref.state_dict())
            run(mine, *slices[rank], seed=100 + rank)
            got, wanted = block.visible_state(), mine.visible_state()
            assert got.keys() == wanted.keys()
            for key in got:
                if isinstance(wanted[key], torch.Tensor):
                    assert type(got[key]) is torch.Tensor, f"{key}: {type(got[key]).__name__}"
                torch.testing.assert_close(got[key], wanted[key], msg=lambda m, k=f"step {step} {key}": f"{k}: {m}")
        ep_params, ref_params = dict(block.named_parameters()), dict(ref.named_parameters())
        for n, p in ref_params.items():
            got = ep_params[n]
            if n in experts:
                value, grad = _gathered(got, world_size), _gathered(got.grad, world_size)
            else:
                value, grad = got.detach(), got.grad.clone() if got.grad is not None else torch.zeros_like(got)
                if world_size > 1:
                    dist.all_reduce(grad)  # NOTE: collective; dense grads summed over ranks
            torch.testing.assert_close(value, p.detach(), msg=lambda m, w=f"step {step} {n} value": f"{w}: {m}")
            assert (grad is None) == (p.grad is None), f"step {step} {n}: grad None {grad is None} vs {p.grad is None}"
            if grad is not None:
                torch.testing.assert_close(grad, p.grad, msg=lambda m, w=f"step {step} {n} grad": f"{w}: {m}")
            if n not in experts:
                got.grad = grad if p.grad is not None else None  # summed, as a trainer's all-reduce leaves it
        with torch.no_grad():
            for p in ref_params.values():
                if p.grad is not None:
                    p.sub_(LR * p.grad)
                p.grad = None
            for p in ep_params.values():
                if p.grad is not None:
                    (p.to_local() if hasattr(p, "to_local") else p).sub_(
                        LR * (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad))
                p.grad = None
    with torch.no_grad():  # eval: no backward, nothing touched; the output still exact
        block.eval(), ref.eval()
        x, _ = data(world_size, bwb.D, seed=5)[rank]
        torch.testing.assert_close(block(x), ref(x))


def _checkpointed(rank: int, world_size: int) -> None:
    """Under ``torch.utils.checkpoint`` (non-reentrant and reentrant) the block recomputes its forward and exchanges
    in backward; output, input grad and gathered weight grads equal the block's own (one step; a chained site)."""
    from torch.utils.checkpoint import checkpoint

    for name in ("block_weights", "child_weights"):
        for reentrant in (False, True):
            torch.manual_seed(3)
            ref = bwb.BLOCKS[name]()
            model = nn.ModuleDict({"mlp": copy.deepcopy(ref)})
            apply_plan(model, resolve_plan({"ep_size": world_size, "plan": [{"match": "mlp"}]}, model),
                       mesh(world_size))
            slices = data(world_size, bwb.D, seed=21)
            want = [run(ref, *sl) for sl in slices]
            x, grad_out = slices[rank]
            x = x.clone().requires_grad_()
            out = checkpoint(model["mlp"], x * 1, use_reentrant=reentrant)
            (out * grad_out).sum().backward()
            where = f"{name} use_reentrant={reentrant}"
            torch.testing.assert_close(out.detach(), want[rank][0], msg=lambda m, w=where: f"{w} output: {m}")
            torch.testing.assert_close(x.grad, want[rank][1], msg=lambda m, w=where: f"{w} input grad: {m}")
            for n, p in _weights(ref).items():
                grad = _gathered(model["mlp"].get_parameter(n).grad, world_size)
                torch.testing.assert_close(grad, p.grad, msg=lambda m, w=f"{where} {n}": f"{w} grad: {m}")


def _replaced_weight(rank: int, world_size: int) -> None:
    """A weight replaced after apply by a plain full tensor (``block.w1 = nn.Parameter(full)``) raises naming it on
    every rank, before anything is computed with it (its slice would be read at another expert's rows)."""
    torch.manual_seed(3)
    full = bwb.BlockWeightsMoE()
    model = nn.ModuleDict({"mlp": copy.deepcopy(full)})
    apply_plan(model, resolve_plan({"ep_size": world_size, "plan": [{"match": "mlp"}]}, model), mesh(world_size))
    model["mlp"].w1 = nn.Parameter(full.w1.detach().clone())
    x, _ = data(world_size, bwb.D)[rank]
    with pytest.raises(LiveStateError, match=r"BlockWeightsMoE\.w1 is a Parameter of shape \(4, 8, 16\), not the "
                                             r"Shard\(0\) DTensor apply_plan made"):
        model["mlp"](x)


def _apply_init(rank: int, world_size: int) -> None:
    """A seeded ``model.apply(init)`` after apply draws every weight as on the model: full tensors, this rank's slice
    kept (``reinit.install_sharded_apply`` on the block holding them); dense ones after them included."""
    for make in (bwb.BlockWeightsMoE, bwb.ChildWeightsMoE):
        ref = make()
        model = nn.ModuleDict({"mlp": copy.deepcopy(ref)})
        apply_plan(model, resolve_plan({"ep_size": world_size, "plan": [{"match": "mlp"}]}, model), mesh(world_size))

        def init(m: nn.Module) -> None:
            for p in m.parameters(recurse=False):
                nn.init.normal_(p)

        torch.manual_seed(9)
        model.apply(init)
        torch.manual_seed(9)
        ref.apply(init)
        for n, p in ref.named_parameters():
            got = model["mlp"].get_parameter(n)
            value = _gathered(got, world_size) if p.dim() == 3 else got.detach()
            assert torch.equal(value, p.detach()), f"{make.__name__}.{n} after model.apply(init)"


def block_weight_cases(rank: int, world_size: int, names: tuple[str, ...] = tuple(bwb.BLOCKS)) -> dict:
    results = {}
    for name in names:
        guarded(results, name, _check_block, name, rank, world_size)
    guarded(results, "apply_init", _apply_init, rank, world_size)
    guarded(results, "checkpointed", _checkpointed, rank, world_size)
    if world_size > 1:
        guarded(results, "replaced_weight", _replaced_weight, rank, world_size)
    return results


@functools.cache
def _results(world_size: int) -> dict:
    return run_cases(world_size, "test_block_weights:block_weight_cases")


def _assert_exact(world_size: int) -> None:
    results = _results(world_size)
    assert results.keys() == {*bwb.BLOCKS, "apply_init", "checkpointed", "replaced_weight"}
    failed = {case: errors for case, errors in results.items() if errors}
    assert not failed, "\n".join(f"{case}: {errors[0]}" for case, errors in failed.items())


@pytest.mark.parametrize("name", list(bwb.BLOCKS))
def test_single_process(name):
    _check_block(name, 0, 1)


def test_two_ranks():
    _assert_exact(2)


def test_four_ranks_one_without_tokens():
    _assert_exact(4)


@pytest.mark.parametrize("name", ["block_weights", "method_weights", "child_weights"])
def test_copies_and_pickles_run_their_own_weights(name):
    """``copy.deepcopy`` and ``torch.save``/``load`` of the EP-ready block run the copy's own weights."""
    import io

    model = nn.ModuleDict({"mlp": bwb.BLOCKS[name]()})
    apply_plan(model, resolve_plan({"ep_size": 1, "plan": [{"match": "mlp"}]}, model), None)
    x = torch.randn(2, 3, bwb.D)
    with torch.no_grad():  # (the block keeps its last expert output: a graph tensor would not deepcopy)
        want = model["mlp"](x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        with torch.no_grad():
            assert torch.equal(copied["mlp"](x), want)
            for p in copied["mlp"].parameters():
                p.mul_(2.0)  # the copy's own weights: the original's output must not move
            assert not torch.equal(copied["mlp"](x), want)
        with torch.no_grad():
            assert torch.equal(model["mlp"](x), want)
