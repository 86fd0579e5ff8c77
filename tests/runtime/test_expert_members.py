"""Experts of several modules each (``MoeStructure.expert_members``, issue 31) after ``apply_plan`` on 2 gloo ranks:
each expert's modules lie together on its owner (``lora_A.i`` and ``lora_B.i``, ``lora_A{i}`` and ``lora_B{i}``;
``base_layer`` or ``adapters.i``; a multi-task block's shared experts once),
the rest of the block (routers, a dropout list) stays on every rank; the model's tools see the model's own names:
the full state dict gathered from the owners, ``model.apply(init)`` drawing for every expert as the model draws, a
full checkpoint loaded into the owners. Parity of the forward and backward: ``tests/runtime/test_one_pass.py``.

    pytest tests/runtime/test_expert_members.py
"""
from __future__ import annotations

import functools

import role_blocks as rb
import role_blocks_attrs as ra
import torch
from distributed import guarded, run_cases
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autoep.plan.resolve import resolve_plan
from autoep.runtime.apply import apply_plan
from autoep.runtime.recipes.local_experts import expert_owners, full_state_dict_of_experts, load_owned_state_dict

# name -> (builder, per expert: the prefixes of its modules' names)
BLOCKS = {
    "lora_mixture_3": (rb.LoraMixture3MoE, [(f"mlp.lora_A.{i}.", f"mlp.lora_B.{i}.") for i in range(rb.E)]),
    "forward_built": (rb.ForwardBuiltMoE, [("mlp.base_layer.",)] + [(f"mlp.adapters.{i}.",) for i in range(rb.E - 1)]),
    # numbered attributes (lora_A0, lora_B0 on one owner) and per-task lists (a shared expert once, on one owner)
    "numbered_lora": (ra.NumberedLoraMoE, [(f"mlp.lora_A{i}.", f"mlp.lora_B{i}.") for i in range(rb.E)]),
    "multi_task": (ra.MultiTaskMoE, [("mlp.task_experts.0.0.",), ("mlp.shared_experts.0.",), ("mlp.shared_experts.1.",),
                                     ("mlp.task_experts.1.0.",)]),
}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"mlp": BLOCKS[name][0]()})


def _ep_model(name: str, world_size: int) -> nn.Module:
    model = _model(name)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    apply_plan(model, resolve_plan({"ep_size": world_size, "plan": [{"match": "mlp"}]}, model), mesh)
    return model


def _init(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight)


def _placed_together(name: str, rank: int, world_size: int) -> None:
    model, experts = _ep_model(name, world_size), BLOCKS[name][1]
    owners = expert_owners(model)
    per_rank = len(experts) // world_size
    for e, prefixes in enumerate(experts):
        keys = [k for k in owners if k.startswith(prefixes)]
        assert keys and {owners[k].expert for k in keys} == {e}, keys
        assert {owners[k].local for k in keys} == {e // per_rank == rank}, (e, rank, keys)
    dense = [n for n, _ in model.named_parameters() if n not in owners]
    assert dense and all(p.device.type != "meta" for n, p in model.named_parameters() if n in dense)


def _full_state(name: str, rank: int, world_size: int) -> None:
    model, reference = _ep_model(name, world_size), _model(name)
    full = full_state_dict_of_experts(model)
    want = reference.state_dict()
    assert full.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(full[k], v, msg=lambda m: f"{k}: {m}")


def _apply_init(name: str, rank: int, world_size: int) -> None:
    """``model.apply(init)`` draws for every module in the model's order, remote experts included (allocated for
    their own ``apply``), so the global RNG and every local tensor match the model's after it."""
    model, reference = _ep_model(name, world_size), _model(name)
    torch.manual_seed(5)
    model.apply(_init)
    ep_rng = torch.get_rng_state()
    torch.manual_seed(5)
    reference.apply(_init)
    assert torch.equal(ep_rng, torch.get_rng_state())
    full, want = full_state_dict_of_experts(model), reference.state_dict()
    for k, v in want.items():
        torch.testing.assert_close(full[k], v, msg=lambda m: f"{k}: {m}")


def _load_full(name: str, rank: int, world_size: int) -> None:
    model, checkpoint = _ep_model(name, world_size), _model(name)
    with torch.no_grad():
        for p in checkpoint.parameters():
            p.add_(1.0)
    load_owned_state_dict(model, checkpoint.state_dict())
    full = full_state_dict_of_experts(model)
    for k, v in checkpoint.state_dict().items():
        torch.testing.assert_close(full[k], v, msg=lambda m: f"{k}: {m}")


CHECKS = {"placed_together": _placed_together, "full_state": _full_state, "apply_init": _apply_init,
          "load_full": _load_full}


def member_cases(rank: int, world_size: int) -> dict:
    results = {}
    for name in BLOCKS:
        for check, fn in CHECKS.items():
            guarded(results, f"{name}:{check}", fn, name, rank, world_size)
    return results


@functools.cache
def _results() -> dict:
    return run_cases(2, "test_expert_members:member_cases")


def test_each_experts_modules_lie_together_and_keep_the_models_names():
    failed = {case: errors for case, errors in _results().items() if errors}
    assert len(_results()) == len(BLOCKS) * len(CHECKS)
    assert not failed, "\n".join(f"{case}: {errors[0]}" for case, errors in failed.items())


def test_the_load_instrument_counts_each_token_once_per_expert():
    """``register_counts_hook`` (``autoep.train.load.ExpertLoad``) hears tokens per expert, not per module: a chain
    ``lora_B[e](lora_A[e](x))`` moves the same rows twice, counted once."""
    from replay_blocks import K, _top_k

    from autoep.runtime.recipes.local_experts import register_counts_hook

    model = _model("lora_mixture_3")
    apply_plan(model, resolve_plan({"ep_size": 1, "plan": [{"match": "mlp"}]}, model), None)
    counts = torch.zeros(rb.E, dtype=torch.long)

    def hook(first, tokens):
        counts[first:first + len(tokens)] += tokens

    register_counts_hook(model["mlp"], hook)
    x = torch.randn(2, 3, rb.D)
    model["mlp"](x)
    _, selected = _top_k(model["mlp"].router, x.reshape(-1, rb.D), K)
    assert torch.equal(counts, torch.bincount(selected.flatten(), minlength=rb.E))
