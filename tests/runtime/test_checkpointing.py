"""Activation checkpointing of a block whose experts exchange tokens (``autoep.runtime.checkpointing``):
exact under torch's own ``checkpoint`` (reentrant and not), refused at the block's call under any other
``_gradient_checkpointing_func``. Gemma-4's decoder layer (a ``GradientCheckpointingLayer``) on 2 gloo ranks,
against its own forward without checkpointing."""
from __future__ import annotations

import functools

import pytest
import torch
from distributed import guarded, run_cases
from test_parity_hf import _block_parity, eager_experts_, randomize_
from torch.utils.checkpoint import checkpoint

pytest.importorskip("transformers")


def gemma4_layer():
    import transformers.models.gemma4 as family
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextDecoderLayer

    from autoep.tools.tiny import build_block, family_configs

    block, config = build_block(Gemma4TextDecoderLayer, family_configs(family), tiny=True)
    randomize_(block, 0)
    eager_experts_(block)
    return block, config


def _checkpointed(fn, calls: list):
    def prepare(ep_block):
        ep_block.gradient_checkpointing = True
        ep_block._gradient_checkpointing_func = fn
        ep_block.experts.register_forward_hook(lambda *_: calls.append(1))

    return prepare


def exact_case(rank: int, world_size: int, use_reentrant: bool) -> None:
    block, config = gemma4_layer()
    calls: list = []
    fn = functools.partial(checkpoint, use_reentrant=use_reentrant)
    _block_parity(rank, world_size, block, config.hidden_size, config, prepare_ep=_checkpointed(fn, calls))
    # The experts ran twice: the forward and its recomputation in backward (the exchange ran again, in step).
    assert len(calls) == 2, calls


def model_case(rank: int, world_size: int) -> None:
    """The tiny Gemma-4 causal LM (every layer MoE) with transformers' own switch, after ``apply_plan``:
    loss and every parameter grad equal the model's own without checkpointing."""
    from test_parity_hf import MODEL_TOL, _model_parity, build_tiny_family_lm, reached_moe_blocks

    calls: list = []

    def prepare(ep_model):
        ep_model.activation_checkpointing_enable()  # {"use_reentrant": False}, every decoder layer
        for layer in ep_model.model.layers:
            layer.experts.register_forward_hook(lambda *_: calls.append(1))

    model = build_tiny_family_lm("gemma4")
    _model_parity(rank, world_size, model, reached_moe_blocks, MODEL_TOL.get("gemma4"), prepare_ep=prepare)
    assert len(calls) == 2 * len(model.model.layers), calls  # each layer's experts ran again in backward


def empty_rank_case(rank: int, world_size: int, use_reentrant: bool, split: list[int]) -> None:
    """A rank with no tokens still runs (and recomputes) every exchange: a Gemma-style layer (tests/gc_blocks.py)
    against its own forward on each rank's slice, grads summed over slices (expert grads gathered)."""
    import copy

    import gc_blocks
    from mutation import forward_backward, inputs, make_ep, param_grads
    from rank_parity import ep_mesh

    from autoep.detect.structure import detect_moe_structure

    torch.manual_seed(0)
    block = gc_blocks.GemmaStyleMoeLayer().train()
    ep = make_ep(block, detect_moe_structure(block), ep_mesh(world_size))
    calls: list = []
    _checkpointed(functools.partial(checkpoint, use_reentrant=use_reentrant), calls)(ep)
    x = inputs(block, batch=sum(split))
    bounds = [sum(split[:r]) for r in range(world_size + 1)]
    refs = [forward_backward(copy.deepcopy(block), x[a:b], seed=r) for r, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    got = forward_backward(ep, x[bounds[rank]:bounds[rank + 1]], seed=rank)
    torch.testing.assert_close(got.outputs[0], refs[rank].outputs[0])
    torch.testing.assert_close(got.x_grad, refs[rank].x_grad)
    grads = param_grads(ep)  # NOTE: collective (expert grads gathered over ep)
    params = dict(block.named_parameters())
    for name, g in grads.items():
        zero = torch.zeros_like(params[name])
        g = zero if g is None else g.clone()
        if not name.startswith("experts."):
            torch.distributed.all_reduce(g)  # NOTE: collective (dense grads summed over ranks)
        want = sum((r.grads[name] for r in refs if r.grads[name] is not None), zero)
        torch.testing.assert_close(g, want, msg=lambda m, n=name: f"grad of {n}: {m}")
    assert len(calls) == 2, calls


def refused_case(rank: int, world_size: int, fn) -> None:
    block, config = gemma4_layer()
    with pytest.raises(RuntimeError, match=r"Gemma4TextDecoderLayer\.gradient_checkpointing is True .*"
                                           r"gradient_checkpointing_enable"):
        _block_parity(rank, world_size, block, config.hidden_size, config, prepare_ep=_checkpointed(fn, []))


def _no_context():
    return torch.utils.checkpoint.noop_context_fn()


REFUSED = {
    "context_fn": functools.partial(checkpoint, use_reentrant=False, context_fn=_no_context),
    "own_function": lambda function, *args: function(*args),
    "positional": functools.partial(checkpoint, lambda *a: a),
}


def checkpointing_cases(rank: int, world_size: int) -> dict:
    results = {}
    for reentrant in (False, True):
        guarded(results, f"exact/reentrant={reentrant}", exact_case, rank, world_size, reentrant)
    guarded(results, "model", model_case, rank, world_size)
    for reentrant in (False, True):
        for split in ([2, 0], [0, 2]):
            guarded(results, f"empty_rank/reentrant={reentrant}/{split}", empty_rank_case, rank, world_size,
                    reentrant, split)
    for name, fn in REFUSED.items():
        guarded(results, f"refused/{name}", refused_case, rank, world_size, fn)
    return results


_RESULTS: dict = {}


def _case(name: str) -> None:
    if not _RESULTS:
        _RESULTS.update(run_cases(2, "test_checkpointing:checkpointing_cases"))
    assert name in _RESULTS, f"case {name} did not run"
    assert not _RESULTS[name], "\n".join(_RESULTS[name])


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_exact_under_torch_checkpoint(use_reentrant):
    """Outputs, input grads, router and dense grads summed, expert grads gathered equal the layer's own
    forward without checkpointing, while every rank recomputes its layer (and the exchange) in backward."""
    _case(f"exact/reentrant={use_reentrant}")


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("split", [[2, 0], [0, 2]])
def test_a_rank_without_tokens_recomputes_too(use_reentrant, split):
    _case(f"empty_rank/reentrant={use_reentrant}/{split}")


def test_whole_model_with_transformers_own_switch():
    _case("model")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_other_checkpoint_functions_are_refused_at_the_call(name):
    _case(f"refused/{name}")


def test_unknown_checkpoint_reasons():
    from autoep.runtime.checkpointing import unknown_checkpoint

    assert unknown_checkpoint(checkpoint) == ""
    assert unknown_checkpoint(functools.partial(checkpoint, use_reentrant=True, preserve_rng_state=False)) == ""
    assert "context_fn" in unknown_checkpoint(REFUSED["context_fn"])
    assert "use_reentrant" in unknown_checkpoint(functools.partial(checkpoint, use_reentrant="yes"))
    assert unknown_checkpoint(REFUSED["own_function"]) == "not torch.utils.checkpoint.checkpoint"

    @functools.wraps(checkpoint)
    def patched(function, *args, **kwargs):  # a wrapper copying torch's names is not torch's checkpoint
        return checkpoint(function, *args, **kwargs)

    assert unknown_checkpoint(patched) == "not torch.utils.checkpoint.checkpoint"
