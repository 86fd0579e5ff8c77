"""After apply it is still the user's model (issue 20; ``autoep.runtime.after_apply``, ``autoep.ExpertParallel``):
the same user code run on the model and on the EP model, 2 gloo ranks, SGD with momentum (a wrong gradient scale
moves SGD's weights; Adam would hide it), every weight compared after every step, or a clear autoep error
asserted before any step changed a weight.

Two families: batched experts (transformers' Qwen3-MoE: sharding puts new ``nn.Parameter(DTensor)`` objects in
place) and ModuleList experts (examples/research_moe: the other ranks' experts become ``meta`` stand-ins).
The reference runs each rank's slice separately on one process and steps on the mean of their losses' gradients,
so the dense layers see the same shapes and only EP can differ.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import guarded, run_cases
from test_handle import EXAMPLE_DIR, batch, full, lm_loss, tiny_moe
from torch import nn
from torch.nn.utils import clip_grad_norm_, clip_grad_value_  # bound before any apply: still guarded

from autoep import ExpertParallel
from autoep.errors import AfterApplyError, GradientsNotFinished

LR, MOMENTUM, STEPS = 0.1, 0.9, 3
QWEN_PLAN = [{"match": "model.layers.*.mlp", "local_compute_fn": "auto"}]
RESEARCH_PLAN = [{"match": "layers.*.moe", "local_compute_fn": "auto"}]


@contextlib.contextmanager
def raises(exc, match: str):
    """``pytest.raises`` whose "did not raise" is an ``AssertionError``, so ``guarded`` records it and the other
    cases still run (pytest's own outcome is a BaseException, which would end the rank)."""
    try:
        with pytest.raises(exc, match=match):
            yield
    except pytest.fail.Exception as e:
        raise AssertionError(str(e)) from None


def research_moe():
    spec = importlib.util.spec_from_file_location("research_moe_model", EXAMPLE_DIR / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.TinyMoELM(vocab_size=64, dim=32, hidden_dim=64, num_layers=2, num_experts=4, top_k=2)


def research_loss(model, ids):
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


FAMILIES = {"batched": (tiny_moe, QWEN_PLAN, lm_loss), "module_list": (research_moe, RESEARCH_PLAN, research_loss)}


def pair(family: str, world: int):
    """(reference model, EP model, its handle, loss fn): the same weights before apply."""
    make, plan, loss_fn = FAMILIES[family]
    model = make()
    ref = copy.deepcopy(model)
    return ref, model, ExpertParallel(model, {"ep_size": world, "plan": plan}), loss_fn


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def weights(model) -> dict[str, torch.Tensor]:
    """Every trainable weight, full (experts gathered: a collective)."""
    from autoep.runtime.recipes.local_experts import full_state_dict_of_experts

    names = {n for n, _ in model.named_parameters()}
    state = full_state_dict_of_experts(model) if dist.is_initialized() else model.state_dict()
    return {n: full(v).detach().clone() for n, v in state.items() if n in names}


def reference_steps(ref, loss_fn, opt, world, before_step=lambda m: None) -> list[dict]:
    """One process: the mean of the ranks' slice losses, ``before_step`` (clipping), the step; weights per step."""
    history = []
    for step in range(STEPS):
        for ids in batch(step, world):
            (loss_fn(ref, ids) / world).backward()
        before_step(ref)
        opt.step()
        opt.zero_grad()
        history.append(weights(ref))
    return history


def ep_steps(model, ep, loss_fn, opt, rank, world, before_step=lambda m: None, net=None) -> list[dict]:
    """Each rank its slice, ``finish_gradients`` (dense grads averaged by DDP or by it), ``before_step``, the step;
    weights per step. ``net``: what the forward runs through (a DDP wrapper), default ``model``."""
    history = []
    for step in range(STEPS):
        loss_fn(net or model, batch(step, world)[rank]).backward()
        ep.finish_gradients(dense_synced=net is not None)
        before_step(model)
        opt.step()
        opt.zero_grad()
        history.append(weights(model))
    return history


def assert_same_steps(ep_history: list[dict], ref_history: list[dict]) -> None:
    for step, (mine, theirs) in enumerate(zip(ep_history, ref_history, strict=True)):
        assert mine.keys() == theirs.keys(), sorted(mine.keys() ^ theirs.keys())[:4]
        for name in theirs:
            torch.testing.assert_close(mine[name], theirs[name], msg=lambda m: f"step {step} {name}: {m}")


def moved(before: dict, after: dict) -> bool:
    return any(not torch.equal(before[n], after[n]) for n in before)


# -- 1. an optimizer built before apply --------------------------------------------------------------------------
def optimizer_before_apply_case(rank, world, family: str):
    """The experts of an optimizer built before apply would never train: its step is refused, naming the
    replaced parameters and the fix, before any weight moved; with the handle (batched) and with ``apply_plan``
    alone (module_list). Once nothing holds the replaced objects, the global hook's per-step cost is an
    emptiness test (the registry holds nothing)."""
    from autoep import apply_plan, resolve_plan
    from autoep.runtime.after_apply import replaced_parameters
    from autoep.runtime.mesh import make_mesh

    make, plan, loss_fn = FAMILIES[family]
    model = make()
    early = sgd(model.parameters())
    if family == "batched":
        ep = ExpertParallel(model, {"ep_size": world, "plan": plan})
    else:
        apply_plan(model, resolve_plan({"ep_size": world, "plan": plan}, model), make_mesh(world, world,
                                                                                         torch.device("cpu")))
    assert replaced_parameters(), "apply replaced no parameter object: the case tests nothing"
    loss_fn(model, batch(0, world)[rank]).backward()
    if family == "batched":
        ep.finish_gradients(dense_synced=False)
    before = weights(model)
    with raises(AfterApplyError, match=r"SGD.step\(\) over \d+ parameter\(s\) that apply_plan replaced "
                                              r"\(.*experts.*built before apply_plan.*ep.param_groups"):
        early.step()
    assert not moved(before, weights(model))
    sgd(model.parameters()).step()  # built after apply: steps
    del early
    gc.collect()
    assert not replaced_parameters(), "something in autoep still holds the replaced expert tensors"


# -- 2. requires_grad_ on the whole model ------------------------------------------------------------------------
def requires_grad_case(rank, world):
    """``model.requires_grad_(True)`` after apply reaches the other ranks' meta stand-ins: they stay out of the
    parameter groups, DDP and ``finish_gradients``, and training equals the model's, step by step."""
    from torch.nn.parallel import DistributedDataParallel

    ref, model, ep, loss_fn = pair("module_list", world)
    ref.requires_grad_(True)
    model.requires_grad_(True)
    stand_ins = [p for p in model.parameters() if p.is_meta]
    assert stand_ins and all(p.requires_grad for p in stand_ins)
    grouped = {id(p) for group in ep.param_groups() for p in group["params"]}
    assert grouped.isdisjoint(map(id, stand_ins))
    net = DistributedDataParallel(model)
    ep_history = ep_steps(model, ep, loss_fn, sgd(ep.param_groups()), rank, world, net=net)
    assert_same_steps(ep_history, reference_steps(ref, loss_fn, sgd(ref.parameters()), world))


# -- 3. parameters the model gains after apply -------------------------------------------------------------------
class LoRALinear(nn.Module):
    """A low-rank adapter around a Linear (PEFT's shape): base frozen, A and B trained."""

    def __init__(self, base: nn.Linear, rank: int, gen: torch.Generator):
        super().__init__()
        self.base = base
        device = base.weight.device  # meta on the stand-ins of the other ranks' experts, as PEFT places it
        self.lora_A = nn.Parameter(0.1 * torch.randn(rank, base.in_features, generator=gen).to(device))
        self.lora_B = nn.Parameter(0.1 * torch.randn(base.out_features, rank, generator=gen).to(device))

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B)


def add_lora(model) -> None:
    """Freeze everything, then put an adapter on every expert's w1 and w3 (the same values on every rank)."""
    gen = torch.Generator().manual_seed(7)
    model.requires_grad_(False)
    for layer in model.layers:
        for expert in layer.moe.experts:
            expert.w1, expert.w3 = LoRALinear(expert.w1, 2, gen), LoRALinear(expert.w3, 2, gen)


def lora_case(rank, world):
    """A LoRA adapter on the expert Linears added after apply (only the new parameters train): the handle sees
    the backward, groups the new parameters, guards a step on unfinished gradients, and training equals the
    model's, step by step."""
    ref, model, ep, loss_fn = pair("module_list", world)
    add_lora(ref)
    add_lora(model)
    groups = ep.param_groups()
    assert not groups[0]["params"] and groups[1]["params"]  # every trainable parameter is a local expert's adapter
    assert all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad and not p.is_meta)
    opt = sgd(groups)
    loss_fn(model, batch(0, world)[rank]).backward()
    with raises(GradientsNotFinished, match=r"optimizer.step\(\) after a backward"):
        opt.step()
    opt.zero_grad()
    ep_history = ep_steps(model, ep, loss_fn, opt, rank, world)
    assert_same_steps(ep_history, reference_steps(ref, loss_fn, sgd(p for p in ref.parameters() if p.requires_grad),
                                                  world))


def assign_case(rank, world):
    """``load_state_dict(..., assign=True)`` after apply replaces every parameter object (batched experts: new
    DTensors): training with an optimizer built after it equals the model's, step by step."""
    ref, model, ep, loss_fn = pair("batched", world)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.9)
    state = {n: v.detach() * 0.9 for n, v in model.state_dict().items()}
    old = list(model.parameters())
    model.load_state_dict(state, assign=True)
    assert not any(p is q for p, q in zip(old, model.parameters()))
    ep_history = ep_steps(model, ep, loss_fn, sgd(ep.param_groups()), rank, world)
    assert_same_steps(ep_history, reference_steps(ref, loss_fn, sgd(ref.parameters()), world))


# -- 4. hooks after the host moves the model ---------------------------------------------------------------------
def expert_param(model, family: str) -> nn.Parameter:
    if family == "batched":
        return model.model.layers[0].mlp.experts.gate_up_proj
    return next(p for p in model.layers[0].moe.experts[2 * dist.get_rank() + 1].parameters())  # a local expert


def hooks_after_to_case(rank, world, family: str):
    """Tensor hooks and post-accumulate-grad hooks on an expert parameter, registered before and after
    ``model.to("cpu")`` (which swaps a DTensor parameter's payload), fire once per backward as on the model,
    and training equals the model's, step by step."""
    ref, model, ep, loss_fn = pair(family, world)
    counts: dict[str, dict[str, int]] = {"ref": {}, "ep": {}}

    def hook(side: str, kind: str):
        def count(_):
            counts[side][kind] = counts[side].get(kind, 0) + 1
        return count

    for side, m in (("ref", ref), ("ep", model)):
        p = expert_param(m, family)
        p.register_hook(hook(side, "tensor_before"))
        p.register_post_accumulate_grad_hook(hook(side, "accumulated_before"))
        m.to("cpu")
        p = expert_param(m, family)
        p.register_hook(hook(side, "tensor_after"))
        p.register_post_accumulate_grad_hook(hook(side, "accumulated_after"))
    ep_history = ep_steps(model, ep, loss_fn, sgd(ep.param_groups()), rank, world)
    ref_history = reference_steps(ref, loss_fn, sgd(ref.parameters()), world)
    # the reference runs one backward per rank's slice, EP one per rank
    assert counts["ep"] == {k: v // world for k, v in counts["ref"].items()} and len(counts["ep"]) == 4, counts
    assert_same_steps(ep_history, ref_history)


def lightning_hooks_case(rank, world, tmp: str):
    """Through the real Lightning Trainer (which moves the model after the strategy built the handle): a
    post-accumulate-grad hook on an expert parameter, registered at fit start, fires once per step as it does
    under Lightning's ddp without EP."""
    import lightning_moe

    class HookedMoeLM(lightning_moe.MoeLM):
        def on_fit_start(self):
            self.fired = 0

            def count(_):
                self.fired += 1
            self.model.model.layers[0].mlp.experts.gate_up_proj.register_post_accumulate_grad_hook(count)

    runs = {}
    for name, strategy in (("ref", "ddp"), ("ep", lightning_moe.ep_strategy(tmp))):
        module = HookedMoeLM()
        trainer = lightning_moe.trainer(world, strategy, max_steps=2)
        trainer.fit(module, train_dataloaders=lightning_moe.loader(2 * lightning_moe.ROWS_PER_RANK * world))
        runs[name] = module.fired
    assert runs == {"ref": 2, "ep": 2}, runs


# -- 5. torch's own clipping -------------------------------------------------------------------------------------
def torch_clip_norm_case(rank, world, family: str):
    """``torch.nn.utils.clip_grad_norm_`` over an EP model (a local norm on each rank, or a crash on mixed
    DTensor/Tensor) is refused naming the expert gradients and ``ep.clip_grad_norm_``, before any gradient was
    scaled; over dense parameters only it runs as it does anywhere."""
    ref, model, ep, loss_fn = pair(family, world)
    loss_fn(model, batch(0, world)[rank]).backward()
    ep.finish_gradients(dense_synced=False)
    grads = {n: full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
    for clip in (clip_grad_norm_, torch.nn.utils.clip_grad_norm_):
        with raises(AfterApplyError, match=r"clip_grad_norm_ over \d+ expert-parallel gradient\(s\) "
                                                  r"\(.*experts.*ep.clip_grad_norm_"):
            clip(model.parameters(), 1e-3)
    assert all(torch.equal(full(p.grad), grads[n]) for n, p in model.named_parameters() if p.grad is not None)
    dense = ep.dense_parameters()
    norm = clip_grad_norm_(dense, 1e9)
    torch.testing.assert_close(norm, torch.stack([p.grad.norm() for p in dense]).norm())


def torch_clip_value_case(rank, world, family: str):
    """``torch.nn.utils.clip_grad_value_`` is elementwise, so exact on each rank's shards: training with it equals
    the model's, step by step (and it bites)."""
    ref, model, ep, loss_fn = pair(family, world)
    bitten = []

    def clip(m):
        before = [full(p.grad).clone() for p in m.parameters() if p.grad is not None]
        clip_grad_value_(m.parameters(), 2e-3)
        bitten.append(any(g.abs().max() > 2e-3 for g in before))

    ep_history = ep_steps(model, ep, loss_fn, sgd(ep.param_groups()), rank, world, clip)
    assert_same_steps(ep_history, reference_steps(ref, loss_fn, sgd(ref.parameters()), world, clip))
    assert all(bitten)


class _LowRankDelta(nn.Module):
    """A LoRA-style parametrization of a 3-D expert weight (what PEFT's ``target_parameters`` adds): W + B @ A."""

    def __init__(self, w: torch.Tensor, rank: int = 2):
        super().__init__()
        E, O, I = w.shape
        self.A = nn.Parameter(torch.randn(E, rank, I) * 0.01)
        self.B = nn.Parameter(torch.zeros(E, O, rank))

    def forward(self, w):
        return w + self.B @ self.A


def parametrized_batched_case(rank, world):
    """A parametrization on the batched experts' 3-D weights after apply: each rank holds a ``Shard(0)`` slice the
    parametrization's full-size tensors cannot mix with; the first forward raises ``LiveStateError`` naming it and
    the fix, before any exchange (every rank alike), instead of a torch-internal traceback."""
    from torch.nn.utils import parametrize

    from autoep.errors import LiveStateError

    ref, model, ep, loss_fn = pair("batched", world)
    experts = model.model.layers[0].mlp.experts
    full = dict(ref.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    parametrize.register_parametrization(experts, "gate_up_proj", _LowRankDelta(full), unsafe=True)
    with raises(LiveStateError, match=r"\['gate_up_proj'\] got a parametrization after apply_plan.*Shard\(0\)"):
        loss_fn(model, batch(0, world)[rank])


# -- 6. modules with parameters of their own set on experts after apply (issue 32) --------------------------------
def prelu_on_experts(model, family: str) -> None:
    """An activation with a learnable parameter (``nn.PReLU``) set after apply: on the batched experts' shared
    ``act_fn``, or after the down projection of one expert of each rank (ModuleList experts)."""
    if family == "batched":
        for layer in model.model.layers:
            layer.mlp.experts.act_fn = nn.PReLU()
        return
    for layer in model.layers:
        for e in (0, 3):  # 4 experts over 2 ranks: one each
            expert = layer.moe.experts[e]
            expert.w2 = nn.Sequential(expert.w2, nn.PReLU())


def new_parameters_case(rank, world, family: str):
    """A module with a parameter of its own set on the experts after apply, then an optimizer over the handle's
    groups: training equals the model's, step by step, and every real parameter this rank holds is the model's
    (a copy of another rank's expert's parameter, never computed nor trained here, would not be)."""
    ref, model, ep, loss_fn = pair(family, world)
    prelu_on_experts(ref, family)
    prelu_on_experts(model, family)
    ep_history = ep_steps(model, ep, loss_fn, sgd(ep.param_groups()), rank, world)
    ref_history = reference_steps(ref, loss_fn, sgd(ref.parameters()), world)
    assert_same_steps(ep_history, ref_history)
    assert any(".weight" in n and ("act_fn" in n or ".w2.1." in n) for n in ref_history[-1])
    for name, p in model.named_parameters():
        if not p.is_meta:
            torch.testing.assert_close(full(p).detach(), ref_history[-1][name], msg=lambda m, n=name: f"{n}: {m}")


def after_apply_cases(rank, world, tmp):
    results = {}
    for family in FAMILIES:
        guarded(results, f"optimizer_before_apply_{family}", optimizer_before_apply_case, rank, world, family)
        guarded(results, f"hooks_after_to_{family}", hooks_after_to_case, rank, world, family)
        guarded(results, f"torch_clip_norm_{family}", torch_clip_norm_case, rank, world, family)
        guarded(results, f"torch_clip_value_{family}", torch_clip_value_case, rank, world, family)
        guarded(results, f"new_parameters_{family}", new_parameters_case, rank, world, family)
    guarded(results, "requires_grad", requires_grad_case, rank, world)
    guarded(results, "lora", lora_case, rank, world)
    guarded(results, "assign", assign_case, rank, world)
    guarded(results, "parametrized_batched", parametrized_batched_case, rank, world)
    guarded(results, "lightning_hooks", lightning_hooks_case, rank, world, tmp)
    return results


_RESULTS: dict = {}
CASES = [f"{case}_{family}" for family in FAMILIES for case in
         ("optimizer_before_apply", "hooks_after_to", "torch_clip_norm", "torch_clip_value", "new_parameters")]


@pytest.mark.parametrize("case", CASES + ["requires_grad", "lora", "assign", "parametrized_batched",
                                           "lightning_hooks"])
def test_two_ranks(case, tmp_path_factory):
    if case == "lightning_hooks":
        pytest.importorskip("lightning", reason="the Lightning case needs lightning (pip install '.[test]')")
    if not _RESULTS:
        _RESULTS.update(run_cases(2, "test_after_apply:after_apply_cases", str(tmp_path_factory.mktemp("after"))))
    errors = _RESULTS[case]
    assert not errors, "\n".join(errors)
