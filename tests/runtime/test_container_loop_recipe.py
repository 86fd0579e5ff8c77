"""Experts containers whose own forward is the expert loop (transformers 5.x Switch Transformers and NLLB-MoE,
and the idiom written here: ``blocks.DispatchMaskMoE``, ``blocks.ExpertStackMoE``) run exactly under EP, by
record/exchange/replay: the block's and the container's forwards run as written, only the calls of the experts
travel (``autoep.runtime.recipes.replay``).

Parity (DESIGN.md): each rank feeds its own sequences (uneven, one rank empty at W=4); its output and input grad
equal the block's own on that slice; dense (router) grads summed over ranks, and every expert parameter's grad
(from the rank that holds it, by the model's own name) equal the block's own summed over the slices; the
state-dict keys and parameter names stay the model's own. The plan is the real detector's, through the archetype
table and ``apply_plan``. Switch is built with its experts' dropout at p=0 (at its default 0.1 it is refused while
training: ``tests/detect/test_container_loop.py``); NLLB at p=0 and at its default token dropout p=0.2 (drawn where
the token is, the RNG restored for the replay). The loop edits the dispatch-mask splice refused run as written and
are exact too; one whose expert inputs depend on expert outputs raises on every rank.
"""

from __future__ import annotations

import copy
import importlib

import blocks
import pytest
import test_container_loop as variants
import torch
import torch.distributed as dist
from distributed import guarded, run_cases
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autoep.detect.structure import detect_moe_structure
from autoep.plan.archetypes import compute_fn_config
from autoep.runtime.apply import apply_plan
from autoep.runtime.recipes.replay import ReplayError

D, FF, SEQ = 16, 24, 6
SEQS_PER_RANK = {1: [4], 2: [1, 3], 4: [2, 0, 3, 1]}


def _switch(jitter: float = 0.0) -> nn.Module:
    from transformers.models.switch_transformers import modeling_switch_transformers as m

    config = m.SwitchTransformersConfig(d_model=D, d_ff=FF, num_experts=4, expert_capacity=2, dropout_rate=0.0,
                                        router_jitter_noise=jitter)
    return m.SwitchTransformersSparseMLP(config)


def _nllb(token_dropout: float = 0.0) -> nn.Module:
    from transformers.models.nllb_moe import modeling_nllb_moe as m

    config = m.NllbMoeConfig(d_model=D, num_experts=4, expert_capacity=3, moe_token_dropout=token_dropout)
    return m.NllbMoeSparseMLP(config, FF)


def _variant(forward) -> nn.Module:
    block = variants._bank_variant(forward)
    if forward is variants.random_in_training:
        block.experts.drop = nn.Dropout(0.3)
    return block


BLOCKS = {
    "switch_p0": _switch,
    "switch_jitter": lambda: _switch(jitter=0.1),  # the router multiplies the block's input by noise in place
    "nllb_p0": _nllb,
    "nllb_token_dropout": lambda: _nllb(0.2),
    "dispatch_mask": lambda: blocks.DispatchMaskMoE(hidden=D, ffn=FF, num_experts=4, capacity=3),
    "expert_stack": lambda: blocks.ExpertStackMoE(hidden=D, ffn=FF, num_experts=4, top_k=2),
    # the loop edits the splice refused: replay runs them as written (DispatchMaskMoE's sizes); swapped_axes
    # reads gates[tok, slot] with a token index as the slot, which fails in the model's own forward too
    **{f"dispatch_mask_{f.__name__}": (lambda f=f: _variant(f)) for f in variants.AS_WRITTEN
       if f not in (variants.chained, variants.swapped_axes)},
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
    assert (structure.execution, structure.expert_kind) == ("replay", "row_local"), structure
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)) if world_size > 1 else None
    model = nn.ModuleDict({"mlp": _make(name)})
    plan = [{"match": "mlp", "local_compute_fn": compute_fn_config(structure),
             "decision": {"source": "auto", "structure": structure.as_dict(), "modules": ["mlp"]}}]
    apply_plan(model, {"plan": plan}, mesh)
    block = model["mlp"]
    assert list(block.state_dict()) == list(ref.state_dict())  # the model's own names, in its order
    assert [n for n, _ in block.named_parameters()] == [n for n, _ in ref.named_parameters()]
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


# ---------------------------------------------------------------- one process


def _ep_copy(block: nn.Module) -> nn.Module:
    structure = detect_moe_structure(block)
    cfg = dict(compute_fn_config(structure))
    module, _, attr = cfg.pop("_factory_").rpartition(".")
    ep = copy.deepcopy(block)
    getattr(importlib.import_module(module), attr)(ep, ep_mesh=None, **cfg)
    return ep


def test_expert_inputs_computed_from_expert_outputs_are_exact():
    """Each expert reads the earlier experts' sum: chained calls, one exchange per link, output and every gradient
    the model's (the two-pass execution raised here)."""
    ref = _variant(variants.chained).train()
    ep = _ep_copy(ref)
    x_ref = torch.randn(2, SEQ, D, requires_grad=True)
    x_ep = x_ref.detach().clone().requires_grad_()
    want, got = ref(x_ref), ep(x_ep)
    torch.testing.assert_close(got, want)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(x_ep.grad, x_ref.grad)
    for (n, p), (_, q) in zip(ref.named_parameters(), ep.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"{n}: {m}")


def test_switch_router_jitter_edits_the_input_once():
    """Switch's router multiplies the block's input by uniform noise in place while training
    (``router_jitter_noise``, 0.01 by default): pass 1 runs on a copy of the input, pass 2 makes the edit once, on
    the input itself, as the model does (``switch_jitter`` above: exact on 1, 2 and 4 ranks). On a leaf input
    that requires grad the model's own forward refuses the edit, and so does the EP block's."""
    ref = _switch(jitter=0.1).train()
    ep = _ep_copy(ref)
    x = torch.randn(2, SEQ, D)
    given = {name: x * 1.0 for name in ("ref", "ep")}
    torch.manual_seed(3)
    want = ref(given["ref"])
    torch.manual_seed(3)
    got = ep(given["ep"])
    torch.testing.assert_close(got, want)
    assert not torch.equal(given["ref"], x), "the jitter edited nothing: it is not exercised"
    torch.testing.assert_close(given["ep"], given["ref"])  # the input edited once, with the same noise
    leaf = torch.randn(2, SEQ, D, requires_grad=True)
    for block in (ref, ep):
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
            block(leaf)


def test_a_constant_of_the_container_changed_after_apply_runs_as_written():
    """NLLB's ``moe_token_dropout`` (and its ``token_dropout`` entry's p) is read by the container's forward, which
    runs as written: changed after apply (0 -> 0.2, on the model and on its EP copy alike), the EP block draws the
    same token dropout."""
    ref = _make("nllb_p0")
    ep = _ep_copy(ref)
    x = torch.randn(1, SEQ, D)
    before = ref(x)
    torch.testing.assert_close(ep(x), before)
    for block in (ref, ep):
        block.experts.moe_token_dropout = block.experts.token_dropout.p = 0.2
    torch.manual_seed(5)
    want = ref(x)
    torch.manual_seed(5)
    got = ep(x)
    assert not torch.equal(want, before), "the token dropout changed nothing: it is not exercised"
    torch.testing.assert_close(got, want)


def test_a_loop_that_fails_in_the_model_fails_under_ep():
    """``swapped_axes`` indexes the (T, 2) gates with token ids as slots: the model raises, and so does EP."""
    ref = _variant(variants.swapped_axes).train()
    ep = _ep_copy(ref)
    x = torch.randn(2, SEQ, D)
    with pytest.raises(IndexError):
        ref(x)
    with pytest.raises(IndexError):
        ep(x)


def test_expert_load_counts_the_rows_each_expert_got():
    """``ExpertLoad`` (train/load.py) hears the rows replay's exchange brings to the local experts: every routed
    (token, slot) of the dispatch mask once, over-capacity slots nowhere (before replay reported them: zeros)."""
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
