"""recipes.grouped: a block calling ``experts(x_sorted, num_tokens_per_expert)`` under EP computes exactly
what its own forward computes.

Parity (DESIGN.md): each rank r feeds its own tokens x_r (uneven counts, one rank with none); output_r and
grad wrt x_r equal the block's own; router and shared grads summed over ranks, and expert grads gathered
over ep (summed over edp) equal the block's own forward/backward run slice by slice. fp32, default
tolerances. The decision comes from the real detector and archetype table and the block is made EP-ready
by ``apply_plan``: the path a training run takes. Blocks: torchtitan and torchtune spellings and the
transformers 4.x Aria layer's (nested grouped-GEMM submodules, a module-level offset loop).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from blocks import AriaStyleMoELayer, TitanMoE, TitanPaddedMoE, TuneMoE
from distributed import guarded, run_cases, spawn
from function_blocks import FunctionMoE, FusedFunctionExperts, LayerScaleExperts, ParallelExpertsMLP
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from autoep.detect.structure import detect_moe_structure
from autoep.plan.archetypes import compute_fn_config
from autoep.runtime.apply import apply_plan
from autoep.runtime.recipes.grouped import ep_grouped_experts

D, SEQ = 16, 3
BATCH_PER_RANK = {1: [4], 2: [3, 0], 4: [2, 0, 3, 1]}  # sequences per rank; uneven, one rank empty


def _idle_experts_titan():
    return _idle_experts(TitanMoE(hidden=D, num_experts=4, top_k=2))


def _idle_experts(block):
    """Positive inputs and router rows 2.. negative: tokens only pick experts 0 and 1, so the ranks
    owning the others receive nothing and must still produce zero expert gradients."""
    with torch.no_grad():
        block.router.weight.abs_()
        block.router.weight[2:].neg_()
    return block


BLOCKS = {
    "torchtitan": lambda: TitanMoE(hidden=D, num_experts=4, top_k=2),
    "torchtitan_top3": lambda: TitanMoE(hidden=D, num_experts=8, top_k=3),
    "torchtitan_padded": lambda: TitanPaddedMoE(hidden=D, num_experts=4, top_k=2),  # rows past the groups
    "torchtune": lambda: TuneMoE(hidden=D, num_experts=4, top_k=2),
    "aria_style": lambda: AriaStyleMoELayer(hidden=D, num_experts=4, top_k=2),
    "aria_style_8": lambda: AriaStyleMoELayer(hidden=D, num_experts=8, top_k=3),
    "idle_experts": _idle_experts_titan,
    # the model's own autograd Function (ScatterMoE's ParallelLinear idiom), run on the owner's slice
    "own_function": lambda: FunctionMoE(hidden=D, num_experts=4, top_k=2),
    "own_function_8": lambda: FunctionMoE(hidden=D, num_experts=8, top_k=3),
    "own_function_fused": lambda: FunctionMoE(FusedFunctionExperts, hidden=D, num_experts=4, top_k=2),
    "own_function_idle": lambda: _idle_experts(FunctionMoE(hidden=D, num_experts=4, top_k=2)),
    "own_function_nested": lambda: FunctionMoE(ParallelExpertsMLP, hidden=D, num_experts=4, top_k=2),  # JetMoE's
    # a dense parameter of the experts container's own (a LayerScale on their output) beside the 3-D weights
    "layer_scale": lambda: FunctionMoE(LayerScaleExperts, hidden=D, num_experts=4, top_k=2),
    "layer_scale_idle": lambda: _idle_experts(FunctionMoE(LayerScaleExperts, hidden=D, num_experts=4, top_k=2)),
}


def _make(name: str) -> nn.Module:
    torch.manual_seed(sum(map(ord, name)))
    return BLOCKS[name]().train()


def _data(name: str, world_size: int):
    """Per-rank inputs and output cotangents, identical on every rank (seeded)."""
    g = torch.Generator().manual_seed(7)
    batches = BATCH_PER_RANK[world_size]
    x = torch.randn(sum(batches), SEQ, D, generator=g)
    if name.endswith(("idle_experts", "_idle")):
        x = x.abs()
    grad_out = torch.randn(x.shape, generator=g)
    bounds = [sum(batches[:r]) for r in range(world_size + 1)]
    return [(x[lo:hi], grad_out[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]


def _run(block, x, grad_out):
    x = x.clone().requires_grad_()
    out = block(x)
    (out * grad_out).sum().backward()
    return out.detach(), x.grad


def _plan(model: nn.Module) -> dict:
    """The frozen plan resolve_plan would write: one entry per block, decided by the real detector."""
    plan = []
    for name, block in model.items():
        structure = detect_moe_structure(block)
        decision = {"source": "auto", "structure": structure.as_dict(), "modules": [name]}
        plan.append({"match": name, "local_compute_fn": compute_fn_config(structure), "decision": decision})
    return {"plan": plan}


def _gathered(block: nn.Module, mesh) -> tuple[dict, dict]:
    """(grads, weights) by the model's own names: expert DTensors gathered over ep and their grads summed
    over edp; dense grads summed over the world. Collectives in the same order on every rank."""
    grads, weights = {}, {}
    edp = mesh.get_group("edp") if mesh is not None and mesh.ndim == 2 else None
    for n, p in block.named_parameters():
        g = p.grad
        if isinstance(p, DTensor):
            assert g is not None, f"{n}: expert weight has no grad (a rank without tokens must still get zeros)"
            g, weights[n] = g.full_tensor(), p.full_tensor()  # NOTE: collectives (all-gather over ep)
            if edp is not None:
                dist.all_reduce(g, group=edp)  # NOTE: collective; edp replicas' expert grads sum
        else:
            g = torch.zeros_like(p) if g is None else g.clone()
            if mesh is not None:
                dist.all_reduce(g)  # NOTE: collective; replicated router/shared grads sum over ranks
        grads[n] = g
    return grads, weights


def _check_block(name, rank, world_size, mesh_shape):
    slices = _data(name, world_size)
    ref = _make(name)
    ref_results = [_run(ref, *s) for s in slices]
    mesh = None
    if world_size > 1:
        names = ("ep",) if len(mesh_shape) == 1 else ("edp", "ep")
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = nn.ModuleDict({"mlp": _make(name)})
    apply_plan(model, _plan(model), mesh)
    block = model["mlp"]
    out, x_grad = _run(block, *slices[rank])
    # every rank's forward reaches every dense parameter (an empty slice too): none may keep grad None here
    no_grad = [n for n, p in block.named_parameters() if not isinstance(p, DTensor) and p.grad is None]
    grads, weights = _gathered(block, mesh)
    assert not no_grad, f"rank {rank}: dense {no_grad} kept grad None (the model's forward gives them one)"

    ref_out, ref_x_grad = ref_results[rank]
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(x_grad, ref_x_grad)
    ref_params = dict(ref.named_parameters())
    assert grads.keys() == ref_params.keys()  # names unchanged: checkpoints keep the model's layout
    assert (mesh is None) or weights, "no expert weight was sharded"
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_params[n].grad, msg=lambda m: f"grad of {n}: {m}")
    for n, w in weights.items():
        torch.testing.assert_close(w, ref_params[n].detach(), msg=lambda m: f"{n}: {m}")


def grouped_cases(rank, world_size):
    results = {}
    mesh_shapes = [(world_size,)] + ([(2, world_size // 2)] if world_size == 4 else [])
    for mesh_shape in mesh_shapes:
        for name in BLOCKS:
            guarded(results, f"{name} mesh={mesh_shape}", _check_block, name, rank, world_size, mesh_shape)
    return results


@pytest.mark.parametrize("name", list(BLOCKS))
def test_single_process_parity(name):
    _check_block(name, 0, 1, (1,))


@pytest.fixture(scope="module", params=[2, 4])
def multi_rank(request):
    return request.param, run_cases(request.param, "test_grouped_recipe:grouped_cases")


def test_multi_rank_parity(multi_rank):
    world_size, results = multi_rank
    assert len(results) == len(BLOCKS) * (2 if world_size == 4 else 1), f"only {sorted(results)} ran"
    failed = {name: errs for name, errs in results.items() if errs}
    assert not failed, f"world_size={world_size}: " + "\n".join(f"{n}:\n{e[0]}" for n, e in failed.items())


def _ep(name: str) -> nn.Module:
    block = _make(name)
    ep_grouped_experts(block, ep_mesh=None, structure=detect_moe_structure(block).as_dict())
    return block


def test_rows_past_the_counts_come_back_as_the_experts_own_forward_gives_them():
    """Aria's offset loop leaves rows past sum(counts) zero (and their grads zero); the EP path does too."""
    own, ep = _make("aria_style").experts, _ep("aria_style").experts
    x = torch.randn(7, D)
    counts = torch.tensor([2, 0, 3, 0])
    results = []
    for experts in (own, ep):
        xr = x.clone().requires_grad_()
        y = experts(xr, counts)
        (y * torch.arange(y.numel()).reshape(y.shape)).sum().backward()
        results.append((y.detach(), xr.grad))
    torch.testing.assert_close(results[1], results[0])
    assert results[1][0][5:].abs().max() == 0 and results[1][1][5:].abs().max() == 0


@pytest.mark.parametrize("name,counts,rows", [
    ("aria_style", [2, 0, 3, 0], 7),  # rows past the groups stay zero
    ("aria_style", [4, 0, 3, 1], 7),  # the offset loop's slices stop at the last row
    ("aria_style", [2, 1, 0, 3, 1], 7),  # more counts than experts: the offset loop reads the first four
    ("torchtune", [2, 5], 7),  # fewer groups than experts: the split loop leaves the last experts idle
    ("torchtitan", [0, 0, 0, 0], 0),
    ("torchtitan_padded", [2, 0, 3], 7),  # x[:sum(counts)] split, zero rows after
])
def test_counts_are_read_as_the_experts_own_loops_read_them(name, counts, rows):
    own, ep = _make(name).experts, _ep(name).experts
    x, counts = torch.randn(rows, D), torch.tensor(counts)
    results = []
    for experts in (own, ep):
        xr = x.clone().requires_grad_()
        y = experts(xr, counts)
        (y * torch.arange(y.numel()).reshape(y.shape)).sum().backward()
        results.append((y.detach(), xr.grad, [p.grad for p in experts.parameters()]))
    torch.testing.assert_close(results[1], results[0])


@pytest.mark.parametrize("name,counts,rows,match", [
    ("torchtitan", [2, 0, 3, 0], 7, "summing to 5"),  # torch.split raises on its own: so does EP
    ("torchtitan", [2, 0, 3, 0, 2], 7, "5 num_tokens_per_expert"),  # w1[4] raises there
    ("aria_style", [2, 3, 2], 7, "3 tokens_per_expert"),  # offsets[4] raises there
    ("aria_style", [2, -1, 3, 1], 7, "min -1"),  # slices with negative bounds: refused, not mimicked
    ("torchtitan_padded", [2, 4, 3, 0], 7, "summing to 9"),  # torch.split raises there
])
def test_counts_the_experts_would_treat_otherwise_fail_loudly(name, counts, rows, match):
    with pytest.raises(ValueError, match=match):
        _ep(name).experts(torch.randn(rows, D), torch.tensor(counts))


def test_rows_of_another_dtype_fail_loudly():
    with pytest.raises(ValueError, match="dtype"):
        _ep("torchtitan").experts(torch.randn(4, D, dtype=torch.float64), torch.tensor([1, 1, 1, 1]))


def test_deepcopy_of_applied_block_is_independent():
    """The bound forward belongs to its block: a deep copy runs its own weights."""
    block = _ep("aria_style")
    twin = copy.deepcopy(block)
    with torch.no_grad():
        twin.experts.fc2.weight.zero_()
        twin.shared_experts.down_proj.weight.zero_()
    x = torch.randn(2, SEQ, D)
    assert twin(x).abs().max() == 0
    assert block(x).abs().max() > 0


# ---------------------------------------------------------------------------------------------
# The trainer on a whole tiny LM of grouped blocks: 2 ranks at ep_size=2 equal one process, and a
# checkpoint of it resumes at ep_size=1 on the same curve
# ---------------------------------------------------------------------------------------------

LM_KINDS = ("titan_padded", "aria_style", "own_function", "layer_scale")


def lm_worker(rank: int, world_size: int, tmp: str) -> dict:
    from grouped_lm import model_config
    from test_train_worlds import GLOBAL_ROWS, run

    rows = f"data.batch_size={GLOBAL_ROWS // world_size}"
    out = {k: run("parallel.ep_size=2", rows, "trainer.ckpt_every=2", f"run_dir={tmp}/{k}_ep2", model=model_config(k))
           for k in LM_KINDS}
    # Resume the Aria-style run's step-2 checkpoint at ep_size=1 (edp=2): its nested expert shards reshard.
    resume = f"trainer.resume={tmp}/aria_style_ep2/checkpoints/step_00000002"
    out["resumed_ep1"] = run("parallel.ep_size=1", rows, resume, f"run_dir={tmp}/resumed_ep1",
                             model=model_config("aria_style"))
    return out


def test_grouped_lm_trained_at_ep2_equals_single_process(tmp_path):
    """Losses, final weights (expert shards gathered, in the model's own names) and expert load; the
    Aria-style run's step-2 checkpoint (nested expert shards) resumed at ep_size=1 continues the curve."""
    from grouped_lm import model_config
    from test_train_worlds import GLOBAL_ROWS, assert_same_training, run

    ep2 = spawn(2, "test_grouped_recipe:lm_worker", str(tmp_path))
    for kind in LM_KINDS:
        resolved = (tmp_path / f"{kind}_ep2" / "resolved.yaml").read_text()
        assert "expert_storage: grouped" in resolved and "recipes.grouped.ep_grouped_experts" in resolved
        single = run(f"data.batch_size={GLOBAL_ROWS}", f"run_dir={tmp_path}/{kind}_ep1", model=model_config(kind))
        assert single["losses"][-1] < single["losses"][0]
        pairs = GLOBAL_ROWS * 16 * 2 * 2  # every (token, top-k) pair of both layers, each step
        assert [sum(step) for step in single["expert_load"]] == [pairs] * 5
        for rank in (0, 1):
            assert_same_training(ep2[rank][kind], single)
            assert ep2[rank][kind]["expert_load"] == single["expert_load"]
        if kind == "aria_style":
            for rank in (0, 1):
                assert_same_training(ep2[rank]["resumed_ep1"], {"losses": single["losses"][2:],
                                                                 "weights": single["weights"]})
