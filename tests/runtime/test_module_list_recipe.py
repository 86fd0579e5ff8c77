"""recipes.module_list: a v4-style block under EP computes exactly what its own forward computes.

Parity (DESIGN.md): each rank r feeds its own tokens x_r (uneven counts, one rank with none at W=4);
output_r, router logits and grad wrt x_r equal the block's own; router and shared grads summed over
ranks, and expert grads gathered over ep (summed over edp) and written back in the ModuleList layout,
equal the block's own forward/backward on the concatenated batch. fp32, default tolerances.

The decision comes from the real detector and archetype table, the block is made EP-ready by
``apply_plan``: the same path a training run takes. All blocks run in one spawned gloo group per
world size (spawn cost dominates).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from blocks import (
    CappedRouterMoE,
    DeepseekRemoteMoE,
    DeepseekV3StyleMoE,
    DropoutExpertsMoE,
    MiniMindStyleMoE,
    MistralInferenceMoeLayer,
    MixtralStyleSparseMoeBlock,
    MoE,
    Qwen2MoeStyleSparseMoeBlock,
    SortedSplitHostCountsMoE,
    SortedSplitMoE,
    ZeroExpertMoE,
    make_closure_moe_class,
)
from distributed import guarded, run_cases
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autoep.detect.structure import detect_moe_structure
from autoep.errors import UnsupportedModuleStructure
from autoep.plan.archetypes import compute_fn_config
from autoep.runtime.apply import apply_plan
from autoep.runtime.recipes.local_experts import (
    expert_owners,
    full_state_dict_of_experts,
    gather_experts,
    load_owned_state_dict,
)
from autoep.runtime.recipes.module_list import ep_module_list_block

D, SEQ = 16, 3
BATCH_PER_RANK = {1: [4], 2: [1, 3], 4: [2, 0, 3, 1]}  # sequences per rank; uneven, one rank empty
# Blocks whose own forward cannot run zero tokens (minimind writes ``y[0, 0]`` for an idle expert): no rank empty.
NO_EMPTY_RANK = {"minimind"}


def _idle_experts_moe():
    """Tokens only ever pick experts 0 and 1 (positive inputs, gate rows 2.. negative): the ranks owning
    the other experts receive nothing and must still produce zero expert gradients."""
    block = MoE(hidden=D, num_experts=4, top_k=2)
    with torch.no_grad():
        block.gate.weight.abs_()
        block.gate.weight[2:].neg_()
    return block


BLOCKS = {
    "mixtral_jitter": lambda: MixtralStyleSparseMoeBlock(hidden=D, num_experts=4, top_k=2, jitter_noise=0.2),
    "mixtral_top3": lambda: MixtralStyleSparseMoeBlock(hidden=D, num_experts=8, top_k=3),
    "qwen2_moe": lambda: Qwen2MoeStyleSparseMoeBlock(hidden=D, num_experts=4, top_k=2, norm_topk_prob=False),
    "qwen2_moe_norm": lambda: Qwen2MoeStyleSparseMoeBlock(hidden=D, num_experts=8, top_k=3, norm_topk_prob=True),
    "deepseek_v3": lambda: DeepseekV3StyleMoE(hidden=D, num_experts=8, top_k=3, n_group=4, topk_group=2),
    "deepseek_v3_no_norm": lambda: DeepseekV3StyleMoE(hidden=D, num_experts=8, top_k=2, norm_topk_prob=False),
    "research_w1w2w3": lambda: MoE(hidden=D, num_experts=4, top_k=2),
    "idle_experts": _idle_experts_moe,
    "capped_router_padding": lambda: CappedRouterMoE(hidden=D, num_experts=4, top_k=2),
    "closure_super": lambda: make_closure_moe_class(0.05)(hidden=D, num_experts=4, top_k=2),
    "block_hook": lambda: _hooked(MoE(hidden=D, num_experts=4, top_k=2)),
    "mistral_inference": lambda: MistralInferenceMoeLayer(hidden=D, num_experts=4, top_k=2),
    "sorted_split": lambda: SortedSplitMoE(hidden=D, num_experts=4, top_k=2),
    "sorted_split_host_counts": lambda: SortedSplitHostCountsMoE(hidden=D, num_experts=8, top_k=3),
    "zero_experts": lambda: ZeroExpertMoE(hidden=D, num_experts=4, zero_experts=3, top_k=3),
    "deepseek_remote": lambda: DeepseekRemoteMoE(hidden=D, num_experts=4, top_k=2),
    "minimind": lambda: MiniMindStyleMoE(hidden=D, num_experts=8, top_k=2),  # some experts idle: the touch runs
    "expert_dropout_p0": lambda: DropoutExpertsMoE(hidden=D, num_experts=4, top_k=2, dropout=0.0),
}


# The same blocks with the experts' own forward forced (``fast_path=False``): the path every non-SwiGLU expert takes.
OWN_FORWARD = ["mixtral_jitter", "qwen2_moe_norm", "idle_experts", "sorted_split", "zero_experts", "deepseek_remote"]
BLOCKS |= {f"{name}+own": BLOCKS[name] for name in OWN_FORWARD}


def _hooked(block):
    """A forward hook on the block itself: the block's __call__ still runs it around the spliced forward."""
    block.register_forward_hook(lambda module, args, out: out * 0.5)
    return block


def _make(name: str) -> nn.Module:
    torch.manual_seed(sum(map(ord, name.removesuffix("+own"))))
    block = BLOCKS[name.removesuffix("+own")]()
    if hasattr(block, "e_score_correction_bias"):
        block.e_score_correction_bias.normal_(0, 0.1)  # nonzero, so choice and weight scores differ
    return block.train()


def _data(name: str, world_size: int):
    """Per-rank inputs and output cotangents, identical on every rank (seeded)."""
    g = torch.Generator().manual_seed(7)
    batches = [max(b, 1) for b in BATCH_PER_RANK[world_size]] if name in NO_EMPTY_RANK else BATCH_PER_RANK[world_size]
    x = torch.randn(sum(batches), SEQ, D, generator=g)
    if name.startswith("idle_experts"):
        x = x.abs()
    grad_out = torch.randn(x.shape, generator=g)
    grad_logits = torch.randn(sum(batches) * SEQ, 8, generator=g)
    bounds = [sum(batches[:r]) for r in range(world_size + 1)]
    return [(x[lo:hi], grad_out[lo:hi], grad_logits[lo * SEQ : hi * SEQ]) for lo, hi in zip(bounds, bounds[1:])]


def _loss(out, grad_out, grad_logits):
    """A loss touching every output: the hidden states and, where returned, the router logits."""
    if isinstance(out, tuple):
        hidden, logits = out
        return (hidden * grad_out).sum() + (logits * grad_logits[:, : logits.shape[1]]).sum()
    return (out * grad_out).sum()


def _run(block, x, grad_out, grad_logits, seed):
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)  # jitter draws: the same seed per rank slice on both sides
    out = block(x)
    loss = _loss(out, grad_out, grad_logits)
    if loss.requires_grad:  # the research block's own forward on zero tokens returns a constant
        loss.backward()
    return out, x.grad if x.grad is not None else torch.zeros_like(x)


def _reference(name, slices):
    """The block's own forward/backward, slice by slice (same grads as the concatenated batch, and the
    same jitter draws as each rank's)."""
    block = _make(name)
    results = [_run(block, *s, seed=100 + r) for r, s in enumerate(slices)]
    return block, results


def _plan(model: nn.Module, **fn_kwargs) -> dict:
    """The frozen plan resolve_plan would write: one entry per block, decided by the real detector."""
    plan = []
    for name, block in model.items():
        structure = detect_moe_structure(block)
        decision = {"source": "auto", "structure": structure.as_dict(), "modules": [name]}
        fn = {**compute_fn_config(structure), **fn_kwargs}
        plan.append({"match": name, "local_compute_fn": fn, "decision": decision})
    return {"plan": plan}


def _ep_block(name, mesh):
    model = nn.ModuleDict({"mlp": _make(name)})
    apply_plan(model, _plan(model, **({"fast_path": False} if name.endswith("+own") else {})), mesh)
    return model["mlp"]


def _expert_grads(block, edp_group):
    # NOTE: collective (gathers expert shards over ep), then the edp replicas' grads are summed.
    grads = gather_experts(block, grad=True)
    if edp_group is not None:
        for g in grads.values():
            dist.all_reduce(g, group=edp_group)
    return grads


def _check_block(name, rank, world_size, mesh_shape):
    slices = _data(name, world_size)
    ref, ref_results = _reference(name, slices)
    mesh = None
    if world_size > 1:
        names = ("ep",) if len(mesh_shape) == 1 else ("edp", "ep")
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    block = _ep_block(name, mesh)
    out, x_grad = _run(block, *slices[rank], seed=100 + rank)

    # Collectives first, in the same order on every rank; compare after.
    dense = {n: p.grad.clone() for n, p in block.named_parameters() if not n.startswith("experts.")}
    if world_size > 1:
        for g in dense.values():
            dist.all_reduce(g)  # NOTE: collective; replicated router/shared grads sum over ranks
    edp_group = mesh.get_group("edp") if mesh is not None and mesh.ndim == 2 else None
    expert_grads = _expert_grads(block, edp_group)
    expert_weights = gather_experts(block)

    ref_out, ref_x_grad = ref_results[rank]
    torch.testing.assert_close(out, ref_out)  # the tuple (hidden, router_logits) where the block returns one
    torch.testing.assert_close(x_grad, ref_x_grad)
    ref_params = dict(ref.named_parameters())
    assert dense.keys() | expert_grads.keys() == ref_params.keys()
    for n, g in dense.items():
        torch.testing.assert_close(g, ref_params[n].grad, msg=lambda m: f"{n}: {m}")
    for n, g in expert_grads.items():
        want = ref_params[n].grad if ref_params[n].grad is not None else torch.zeros_like(g)
        torch.testing.assert_close(g, want, msg=lambda m: f"{n}: {m}")
        torch.testing.assert_close(expert_weights[n], ref_params[n].detach())


def _check_eval_mode(name, rank, world_size):
    """A block whose expert region differs by mode (DeepSeek's remote code: a masked-assignment loop while
    training, an argsort/split loop in a ``@torch.no_grad()`` helper in eval) equals its own eval forward,
    and, as its own, builds no graph there."""
    slices = _data(name, world_size)
    ref = _make(name).eval()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)) if world_size > 1 else None
    block = _ep_block(name, mesh).eval()
    x = slices[rank][0].clone().requires_grad_()
    out, ref_out = block(x), ref(x)
    torch.testing.assert_close(out, ref_out)
    assert not out.requires_grad and not ref_out.requires_grad


def _check_meta_checkpoint_roundtrip(rank, world_size):
    """The trainer's flow: build on meta, apply, allocate, load a checkpoint in the model's own layout,
    run; then write the checkpoint back in that layout."""
    names = ("deepseek_v3", "research_w1w2w3")
    ref = nn.ModuleDict({n: _make(n) for n in names})
    with torch.device("meta"):
        model = nn.ModuleDict({n: _make(n) for n in names})
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)) if world_size > 1 else None
    apply_plan(model, _plan(model), mesh)
    model.to_empty(device="cpu")  # allocates this rank's experts only: the others stay meta stand-ins
    assert all(p.is_meta != place.local for n, p in model.named_parameters() if (place := expert_owners(model).get(n)))
    load_owned_state_dict(model, ref.state_dict())

    x, _, _ = _data("deepseek_v3", world_size)[rank]
    outs = [model[n](x) for n in names]
    saved = full_state_dict_of_experts(model)  # NOTE: collective (each expert from its owner)
    for n, out in zip(names, outs):
        torch.testing.assert_close(out, ref[n](x))
    assert saved.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(saved[k], v, msg=lambda m: f"{k}: {m}")


def _check_live_state(rank, world_size):
    """State that lives on the experts, added after apply_plan, is honoured as the model's own forward honours
    it: a forward hook on an expert Linear (the fast path steps aside, the experts' own forward runs it), a
    tensor hook rescaling an expert weight's grad, a post-accumulate-grad hook, all on the model's own objects."""
    name = "research_w1w2w3"
    slices = _data(name, world_size)
    ref = _make(name)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)) if world_size > 1 else None
    block = _ep_block(name, mesh)
    accumulated = []
    for model in (ref, block):
        for e, expert in enumerate(model.experts):
            expert.w2.register_forward_hook(lambda mod, args, out: out * 0.5)
            if not expert.w1.weight.is_meta:  # this rank's own expert (all of them in the reference)
                expert.w1.weight.register_hook(lambda g: g * 3)
                if model is block:
                    expert.w3.weight.register_post_accumulate_grad_hook(lambda p, e=e: accumulated.append(e))
    ref_out, ref_x_grad = [_run(ref, *s, seed=100 + r) for r, s in enumerate(slices)][rank]
    out, x_grad = _run(block, *slices[rank], seed=100 + rank)
    grads = gather_experts(block, grad=True)  # NOTE: collective
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(x_grad, ref_x_grad)
    ref_params = dict(ref.named_parameters())
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_params[n].grad, msg=lambda m: f"{n}: {m}")
    per_rank = 4 // world_size
    assert sorted(accumulated) == list(range(rank * per_rank, (rank + 1) * per_rank))


def _check_fast_path_parameter_hooks(rank, world_size):
    """The fast path reading the experts' own parameters in place (their memory is one stacked buffer per
    projection): tensor hooks and post-accumulate-grad hooks on each local expert parameter fire once, with the
    gradient the experts' own forward gives, and the gathered gradients equal the block's own."""
    from autoep.runtime.recipes import local_experts

    name = "research_w1w2w3"
    slices = _data(name, world_size)
    ref = _make(name)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)) if world_size > 1 else None
    block = _ep_block(name, mesh)
    accumulated = []
    for model in (ref, block):
        for e, expert in enumerate(model.experts):
            for proj in (expert.w1, expert.w2, expert.w3):
                if not proj.weight.is_meta:  # this rank's own expert (all of them in the reference)
                    proj.weight.register_hook(lambda g, e=e: g * (e + 2))
                    if model is block:
                        proj.weight.register_post_accumulate_grad_hook(lambda p, e=e: accumulated.append(e))
    ref_out, ref_x_grad = [_run(ref, *s, seed=100 + r) for r, s in enumerate(slices)][rank]
    out, x_grad = _run(block, *slices[rank], seed=100 + rank)
    grads = gather_experts(block, grad=True)  # NOTE: collective
    home = getattr(block, local_experts.STACKED)
    spec = local_experts.spec_of(block)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(x_grad, ref_x_grad)
    ref_params = dict(ref.named_parameters())
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_params[n].grad, msg=lambda m: f"{n}: {m}")
    per_rank = 4 // world_size
    assert sorted(accumulated) == sorted(3 * list(range(rank * per_rank, (rank + 1) * per_rank)))
    assert home.gate_up is not None, "the fast path did not read the experts in place"
    for i, e in enumerate(range(spec.first, spec.first + spec.num_local)):
        assert block.experts[e].w2.weight.data_ptr() == home.down[i].data_ptr()


def module_list_cases(rank, world_size):
    results = {}
    mesh_shapes = [(world_size,)] + ([(2, world_size // 2)] if world_size == 4 else [])
    for mesh_shape in mesh_shapes:
        for name in BLOCKS:
            guarded(results, f"{name} mesh={mesh_shape}", _check_block, name, rank, world_size, mesh_shape)
    guarded(results, "meta_checkpoint_roundtrip", _check_meta_checkpoint_roundtrip, rank, world_size)
    guarded(results, "deepseek_remote eval", _check_eval_mode, "deepseek_remote", rank, world_size)
    guarded(results, "live_state", _check_live_state, rank, world_size)
    guarded(results, "fast_path_parameter_hooks", _check_fast_path_parameter_hooks, rank, world_size)
    return results


@pytest.mark.parametrize("name", list(BLOCKS))
def test_single_process_parity(name):
    _check_block(name, 0, 1, (1,))


@pytest.fixture(scope="module", params=[2, 4])
def multi_rank(request):
    return request.param, run_cases(request.param, "test_module_list_recipe:module_list_cases")


def test_multi_rank_parity(multi_rank):
    world_size, results = multi_rank
    assert len(results) >= len(BLOCKS) + 4, f"only {sorted(results)} ran"
    failed = {name: errs for name, errs in results.items() if errs}
    assert not failed, f"world_size={world_size}: " + "\n".join(f"{n}:\n{e[0]}" for n, e in failed.items())


def test_eval_mode_single_process():
    _check_eval_mode("deepseek_remote", 0, 1)


def test_meta_checkpoint_roundtrip_single_process():
    _check_meta_checkpoint_roundtrip(0, 1)


def test_live_state_single_process():
    _check_live_state(0, 1)


def test_fast_path_parameter_hooks_single_process():
    _check_fast_path_parameter_hooks(0, 1)


def test_fast_path_runs_where_proven_and_steps_aside_otherwise(monkeypatch):
    """The grouped GEMM runs for proven SwiGLU experts in plain state; a hook on an expert, a weight that is
    not a plain Parameter, or fast_path=False run the experts' own forwards instead."""
    from autoep.runtime.recipes import local_experts

    calls = {"grouped": 0, "own": 0}
    for fn, key in ((local_experts._grouped, "grouped"), (local_experts.own_forward, "own")):
        monkeypatch.setattr(local_experts, fn.__name__,
                            lambda *a, fn=fn, key=key: calls.__setitem__(key, calls[key] + 1) or fn(*a))
    x = torch.randn(2, SEQ, D)

    def ran(block) -> str:
        before = dict(calls)
        block(x)
        return "grouped" if calls["grouped"] > before["grouped"] else "own" if calls["own"] > before["own"] else ""

    assert ran(_ep_block("research_w1w2w3", None)) == "grouped"
    assert ran(_ep_block("research_w1w2w3+own", None)) == "own"
    hooked = _ep_block("research_w1w2w3", None)
    handle = hooked.experts[1].w1.register_forward_pre_hook(lambda mod, args: None)
    assert ran(hooked) == "own"
    handle.remove()
    assert ran(hooked) == "grouped"

    class Scaled(nn.Parameter):  # a tensor-subclass weight (QAT fake-quant style)
        pass

    hooked.experts[0].w3.weight = Scaled(hooked.experts[0].w3.weight.detach())
    assert ran(hooked) == "own"


def test_zero_width_experts_fall_back_to_their_own_forward():
    """Experts whose intermediate width is 0 (a tiny Ernie-4.5-VL config gives one): the grouped kernel's
    stride checks would fail; autoep runs the exact path and equals the block's own forward."""
    ref = MoE(hidden=D, ffn=0, num_experts=4, top_k=2)
    model = nn.ModuleDict({"mlp": copy.deepcopy(ref)})
    apply_plan(model, _plan(model), None)
    x = torch.randn(2, SEQ, D, requires_grad=True)
    out = model["mlp"](x)
    out.sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    ref_out = ref(x_ref)
    ref_out.sum().backward()
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_deepcopy_of_applied_block_is_independent():
    """The bound forward belongs to its block: a deep copy must not run the original's weights."""
    block = _ep_block("research_w1w2w3", None)
    twin = copy.deepcopy(block)
    with torch.no_grad():
        for expert in twin.experts:
            expert.w2.weight.zero_()
    x = torch.randn(2, SEQ, D)
    assert twin(x).abs().max() == 0
    assert block(x).abs().max() > 0


def test_refuses_what_it_cannot_reproduce():
    """Facts the recipe would silently get wrong are refused, naming the key."""
    block = _make("research_w1w2w3")
    structure = detect_moe_structure(block).as_dict()
    with pytest.raises(UnsupportedModuleStructure, match="expert_act"):
        ep_module_list_block(copy.deepcopy(block), ep_mesh=None, structure={**structure, "expert_act": "gelu"})
    with pytest.raises(UnsupportedModuleStructure, match="expert_projs"):
        ep_module_list_block(copy.deepcopy(block), ep_mesh=None, structure={**structure, "expert_projs": ""})
    dropping = DropoutExpertsMoE(hidden=D, num_experts=4, top_k=2, dropout=0.1)
    with pytest.raises(UnsupportedModuleStructure, match=r"dropout with p=0.1.*exact only at p=0"):
        detect_moe_structure(dropping)
    dropping.experts[2].dropout = nn.Dropout(0.0)  # one expert at p=0 is not enough: each is checked
    with pytest.raises(UnsupportedModuleStructure, match=r"experts\[0\].*dropout with p=0.1"):
        detect_moe_structure(dropping)
    biased = copy.deepcopy(block)
    biased.experts[1].w2 = nn.Linear(32, D, bias=True)
    with pytest.raises(UnsupportedModuleStructure, match=r"expert_kind='swiglu', but the experts are proven "
                                                          r"expert_kind='row_local'"):
        ep_module_list_block(biased, ep_mesh=None, structure=structure)


def test_an_expert_shared_outside_the_experts_is_refused():
    """Releasing another rank's expert would drop it where the block uses it again (here: as its shared expert)."""
    block = _make("research_w1w2w3")
    block.shared = block.experts[3]
    structure = detect_moe_structure(_make("research_w1w2w3"))
    with pytest.raises(UnsupportedModuleStructure, match=r"shared \(FeedForward\) shares an expert's module"):
        ep_module_list_block(block, ep_mesh=None, structure=structure)
    tied = _make("research_w1w2w3")
    tied.experts[1].w1.weight = tied.experts[0].w1.weight
    with pytest.raises(UnsupportedModuleStructure, match="tied|share"):
        ep_module_list_block(tied, ep_mesh=None, structure=structure)
