"""Experts containers whose own forward is the expert loop (transformers 5.x Switch Transformers and NLLB-MoE,
and the idiom written here: ``blocks.DispatchMaskMoE``, ``blocks.ExpertStackMoE``) run exactly under EP.

Parity (DESIGN.md): each rank feeds its own sequences (uneven, one rank empty at W=4); its output and input grad
equal the block's own on that slice; dense (router) grads summed over ranks, and every expert parameter's grad
(from the rank that holds it, by the model's own name) equal the block's own summed over the slices; the
state-dict keys stay the model's own. The plan is the real detector's, through the archetype table and
``apply_plan``. Switch and NLLB are built with their in-expert dropout and token dropout at p=0: at their
default p>0 they are refused (``tests/detect/test_container_loop.py``).

The dispatch mask a Switch-style container is given is turned into expert ids exactly for any mask
(``test_any_dispatch_mask``): several nonzero entries per slot, negative entries that make an expert's mask
sum nonpositive (the loop then skips it), bool and float masks, slots routing nowhere.
"""

from __future__ import annotations

import copy
import importlib

import blocks
import pytest
import torch
import torch.distributed as dist
from distributed import guarded, run_cases
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autoep.detect.structure import detect_moe_structure
from autoep.plan.archetypes import compute_fn_config
from autoep.runtime.apply import apply_plan

D, FF, SEQ = 16, 24, 6
SEQS_PER_RANK = {1: [4], 2: [1, 3], 4: [2, 0, 3, 1]}


def _switch(jitter: float = 0.0) -> nn.Module:
    from transformers.models.switch_transformers import modeling_switch_transformers as m

    config = m.SwitchTransformersConfig(d_model=D, d_ff=FF, num_experts=4, expert_capacity=2, dropout_rate=0.0,
                                        router_jitter_noise=jitter)
    return m.SwitchTransformersSparseMLP(config)


def _nllb() -> nn.Module:
    from transformers.models.nllb_moe import modeling_nllb_moe as m

    config = m.NllbMoeConfig(d_model=D, num_experts=4, expert_capacity=3, moe_token_dropout=0.0)
    return m.NllbMoeSparseMLP(config, FF)


BLOCKS = {
    "switch_p0": _switch,
    # the router multiplies its input by uniform noise in place (seeded alike on both sides)
    "switch_p0_jitter": lambda: _switch(jitter=0.1),
    "nllb_p0": _nllb,
    "dispatch_mask": lambda: blocks.DispatchMaskMoE(hidden=D, ffn=FF, num_experts=4, capacity=3),
    "expert_stack": lambda: blocks.ExpertStackMoE(hidden=D, ffn=FF, num_experts=4, top_k=2),
}


def _make(name: str) -> nn.Module:
    torch.manual_seed(sum(map(ord, name)))
    block = BLOCKS[name]().train()
    with torch.no_grad():  # nonzero biases and routers that make every path matter
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


def _data(world_size: int):
    g = torch.Generator().manual_seed(7)
    seqs = SEQS_PER_RANK[world_size]
    x = torch.randn(sum(seqs), SEQ, D, generator=g)
    grad_out = torch.randn(x.shape, generator=g)
    bounds = [sum(seqs[:r]) for r in range(world_size + 1)]
    return [(x[lo:hi], grad_out[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]


def _run(block, x, grad_out, seed: int):
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)  # jitter draws the same noise on both sides
    out = block(x * 1.0)  # not a leaf: Switch's router edits its input in place when it jitters
    loss = (out * grad_out).sum()
    if loss.requires_grad:
        loss.backward()
    return out.detach(), x.grad if x.grad is not None else torch.zeros_like(x)


def _check_block(name: str, rank: int, world_size: int) -> None:
    slices = _data(world_size)
    ref = _make(name)
    ref_results = [_run(ref, *s, seed=100 + r) for r, s in enumerate(slices)]
    structure = detect_moe_structure(_make(name))
    assert (structure.expert_storage, structure.expert_kind) == ("module_list", "row_local"), structure
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)) if world_size > 1 else None
    model = nn.ModuleDict({"mlp": _make(name)})
    plan = [{"match": "mlp", "local_compute_fn": compute_fn_config(structure),
             "decision": {"source": "auto", "structure": structure.as_dict(), "modules": ["mlp"]}}]
    apply_plan(model, {"plan": plan}, mesh)
    block = model["mlp"]
    assert block.state_dict().keys() == ref.state_dict().keys()  # the model's own names
    out, x_grad = _run(block, *slices[rank], seed=100 + rank)

    path = structure.experts_path
    experts = {n for n, _ in ref.named_parameters() if n.startswith(path + ".")}
    # Collectives first, in the same order on every rank; compare after.
    dense = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in block.named_parameters() if n not in experts}
    if world_size > 1:
        for g in dense.values():
            dist.all_reduce(g)  # NOTE: collective; replicated router grads sum over ranks
    mine = {n: (p.detach().clone(), None if p.grad is None else p.grad.clone())
            for n, p in block.named_parameters() if n in experts and p.device.type != "meta"}
    held = [mine]
    if world_size > 1:
        held = [None] * world_size
        dist.all_gather_object(held, mine)  # NOTE: collective; each expert's params live on its owner rank

    ref_out, ref_x_grad = ref_results[rank]
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(x_grad, ref_x_grad)
    ref_params = dict(ref.named_parameters())
    for n, g in dense.items():
        want = ref_params[n].grad if ref_params[n].grad is not None else torch.zeros_like(g)
        torch.testing.assert_close(g, want, msg=lambda m, n=n: f"{n}: {m}")
    gathered = {}
    for part in held:
        gathered.update(part)
    assert gathered.keys() == experts, sorted(experts - gathered.keys())
    for n, (value, grad) in gathered.items():
        torch.testing.assert_close(value, ref_params[n].detach(), msg=lambda m, n=n: f"{n}: {m}")
        want = ref_params[n].grad if ref_params[n].grad is not None else torch.zeros_like(value)
        torch.testing.assert_close(grad if grad is not None else torch.zeros_like(value), want,
                                   msg=lambda m, n=n: f"{n}: {m}")


def container_cases(rank: int, world_size: int) -> dict:
    results = {}
    for name in BLOCKS:
        guarded(results, name, _check_block, name, rank, world_size)
    return results


@pytest.mark.parametrize("name", list(BLOCKS))
def test_single_process_parity(name):
    _check_block(name, 0, 1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_multi_rank_parity(world_size):
    results = run_cases(world_size, "test_container_loop_recipe:container_cases")
    assert results.keys() == BLOCKS.keys(), f"only {sorted(results)} ran"
    failed = {name: errs for name, errs in results.items() if errs}
    assert not failed, f"world_size={world_size}: " + "\n".join(f"{n}:\n{e[0]}" for n, e in failed.items())


# ---------------------------------------------------------------- the dispatch mask, any mask


def _ep_copy(block: nn.Module) -> nn.Module:
    structure = detect_moe_structure(block)
    cfg = dict(compute_fn_config(structure))
    module, _, attr = cfg.pop("_factory_").rpartition(".")
    ep = copy.deepcopy(block)
    getattr(importlib.import_module(module), attr)(ep, ep_mesh=None, **cfg)
    return ep


def _masks(T: int, K: int, E: int):
    g = torch.Generator().manual_seed(3)
    one_hot = torch.nn.functional.one_hot(torch.randint(0, E, (T, K), generator=g), E)
    several = (torch.rand(T, K, E, generator=g) < 0.4).long()  # slots meeting 0..E experts
    signed = torch.randint(-2, 3, (T, K, E), generator=g).float()  # some experts' sums <= 0: skipped
    signed[:, :, 0] = -signed[:, :, 0].abs() - 1  # expert 0's sum is negative: hit by no pair
    yield "one_hot", one_hot
    yield "capacity_dropped", one_hot * (torch.arange(T)[:, None, None] < T // 2)
    yield "several_per_slot", several
    yield "bool", several.bool()
    yield "signed_float", signed
    yield "nothing_routed", torch.zeros(T, K, E, dtype=torch.long)
    yield "fewer_experts", one_hot[..., : E - 1]


@pytest.mark.parametrize("case", [name for name, _ in _masks(5, 2, 4)])
def test_any_dispatch_mask(case):
    """The replaced container forward equals the container's own loop for any (T, K, E) mask, outputs and
    gradients (hidden rows, gate weights, every expert parameter)."""
    ref = blocks.DispatchMaskMoE(hidden=D, ffn=FF, num_experts=4).train()
    ep = _ep_copy(ref)
    mask = dict(_masks(5, 2, 4))[case]
    g = torch.Generator().manual_seed(11)
    x, gates, cot = torch.randn(5, D, generator=g), torch.rand(5, 2, generator=g), torch.randn(5, D, generator=g)
    runs = []
    for block in (ref, ep):
        xs, ws = x.clone().requires_grad_(), gates.clone().requires_grad_()
        out = block.experts(xs, mask, ws)
        if out.requires_grad:  # the loop's output of a mask routing nothing is a constant zero
            (out * cot).sum().backward()
        runs.append((out, xs.grad, ws.grad, {n: p.grad for n, p in block.experts.named_parameters()}))
    (out, xg, wg, pg), (ep_out, ep_xg, ep_wg, ep_pg) = runs
    torch.testing.assert_close(ep_out, out)
    for got, want in ((ep_xg, xg), (ep_wg, wg)):
        torch.testing.assert_close(got if got is not None else torch.zeros_like(want if want is not None else x),
                                   want if want is not None else torch.zeros_like(got))
    for n in pg:
        a, b = pg[n], ep_pg[n]
        if a is None and b is None:
            continue
        torch.testing.assert_close(b if b is not None else torch.zeros_like(a), a if a is not None else torch.zeros_like(b),
                                   msg=lambda m, n=n: f"{n}: {m}")


def test_mask_routing_to_a_missing_expert_fails_as_the_loop_does():
    ref = blocks.DispatchMaskMoE(hidden=D, ffn=FF, num_experts=4).train()
    ep = _ep_copy(ref)
    mask = torch.nn.functional.one_hot(torch.tensor([[0], [4]]), 5)  # expert 4: the container has ffn0..ffn3
    x, gates = torch.randn(2, D), torch.rand(2, 1)
    with pytest.raises(KeyError):
        ref.experts(x, mask, gates)
    with pytest.raises(RuntimeError, match="an expert past its 4"):
        ep.experts(x, mask, gates)


def test_folded_constant_is_watched():
    """NLLB's ``moe_token_dropout`` was folded at 0 when the plan was applied: a later change raises, naming it."""
    ref = _make("nllb_p0")
    ep = _ep_copy(ref)
    x = torch.randn(1, SEQ, D)
    torch.testing.assert_close(ep(x), ref(x))
    ep.experts.moe_token_dropout = 0.2
    with pytest.raises(RuntimeError, match="moe_token_dropout"):
        ep(x)


def test_expert_load_counts_the_rows_each_expert_got():
    """``ExpertLoad`` (train/load.py) hears the container's local experts: every routed (token, slot) of the
    dispatch mask once, over-capacity slots nowhere."""
    from autoep.train.load import ExpertLoad

    block = _make("dispatch_mask")
    model = nn.ModuleDict({"mlp": _ep_copy(block)})
    load = ExpertLoad(model, ["mlp"], 4)
    dispatch = {}
    block.experts.register_forward_pre_hook(lambda m, args: dispatch.update(mask=args[1]))
    x = torch.randn(2, SEQ, D)
    block(x)
    model["mlp"](x)
    assert load.layers == 1
    assert load.counts_E.tolist() == dispatch["mask"].sum(dim=(0, 1)).tolist()


def test_expert_dropout_proven_idle_in_eval_is_watched():
    """Switch at its default ``dropout_rate=0.1``, planned in eval (the experts' dropout folded idle): exact in eval;
    back in training the dropout would draw per expert call, so the block refuses to run, naming it."""
    from transformers.models.switch_transformers import modeling_switch_transformers as m

    torch.manual_seed(0)
    ref = m.SwitchTransformersSparseMLP(m.SwitchTransformersConfig(d_model=D, d_ff=FF, num_experts=4)).eval()
    assert "experts.*.dropout.training=False" in detect_moe_structure(ref).folded
    ep = _ep_copy(ref)
    x = torch.randn(2, SEQ, D)
    torch.testing.assert_close(ep(x), ref(x))
    ep.train()
    with pytest.raises(RuntimeError, match=r"experts\.\*\.dropout\.training was False .* now True"):
        ep(x)


def test_v4_loop_expert_dropout_proven_idle_in_eval_is_watched():
    """The same watch for experts a block's own loop calls (the module_list recipe): fairseq-style experts with
    dropout p=0.1, planned in eval."""
    torch.manual_seed(0)
    ref = blocks.FairseqStyleMoE(hidden=D, ffn=FF)
    for e, expert in enumerate(ref.local_experts):
        ref.local_experts[e] = blocks.FairseqStyleFFN(D, FF, "gelu", dropout=0.1)
    ref.eval()
    ep = _ep_copy(ref)
    x = torch.randn(2, SEQ, D)
    torch.testing.assert_close(ep(x), ref(x))
    ep.train()
    with pytest.raises(RuntimeError, match=r"dropout_module\.training was False .* now True"):
        ep(x)


def test_folded_entries_of_module_dict_experts_name_their_keys():
    """Experts that differ (one GELU among ReLUs) are folded per expert, by their ModuleDict keys, so the per-call
    watch reads the right modules (an index would name no entry and raise on every call)."""
    torch.manual_seed(0)
    ref = blocks.ModuleDictExpertsMoE(hidden=D, ffn=FF).train()
    ref.experts["expert_2"] = blocks.FairseqStyleFFN(D, FF, "gelu")
    folded = detect_moe_structure(ref).folded
    assert any(f.startswith("experts.expert_2.activation_fn=") for f in folded), folded
    ep = _ep_copy(ref)
    x = torch.randn(2, SEQ, D)
    torch.testing.assert_close(ep(x), ref(x))
