"""autoep.ExpertParallel: the handle for other people's training loops, on 2 gloo ranks and on one process.

Training parity uses SGD (a wrong gradient scale moves SGD's weights; Adam would hide it) and a clip that bites
(a wrong global norm moves the weights too): the EP run on 2 ranks, each with its half of the batch, must end
with the same losses and every weight equal to one process training the same model on both halves, whose
gradients are those of the mean of the two halves' losses (each half run separately, so the dense layers see
the same shapes).
"""
from __future__ import annotations

import copy
import importlib.util
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from distributed import guarded, run_cases
from omegaconf import OmegaConf

import autoep
from autoep import ExpertParallel, load_plan
from autoep.errors import GradientsNotFinished, PlanError, UnsupportedModuleStructure
from autoep.plan.artifact import write_resolved
from autoep.plan.schema import ParallelConfig, PlanEntry

PLAN = [{"match": "model.layers.*.mlp", "local_compute_fn": "auto"}]
EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "research_moe"
LR, CLIP, STEPS, BATCH, SEQ = 0.5, 0.3, 5, 4, 8


def tiny_moe(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2, norm_topk_prob=True)
    return transformers.Qwen3MoeForCausalLM(cfg)


def batch(step: int, world: int) -> list[torch.Tensor]:
    """The global batch of ``step``, one chunk per rank."""
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))
    return list(ids.chunk(world))


def lm_loss(model, ids):
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def reference_run(model, world: int, clip: float = CLIP) -> tuple[list[float], list[float]]:
    """One process, SGD on the mean of the ranks' losses (each rank's slice run separately), clipped."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for ids in batch(step, world):
            loss = lm_loss(model, ids) / world
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms


def full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def ep_run(rank, world, mode: str, ep_size: int | None = None):
    """Train with the handle in ``mode``: "ddp" (DDP averages dense grads, grad_convention "mean"), "sum" (no DDP,
    each rank back-propagates loss / W and sums) or "mean" (no DDP, plain loss, averaged). ``ep_size`` below the
    world size gives ``edp`` replicas of every expert (their grads summed over ``edp``)."""
    from torch.nn.parallel import DistributedDataParallel

    model = tiny_moe()
    ref = copy.deepcopy(model)
    ep = ExpertParallel(model, {"ep_size": ep_size or world, "plan": PLAN},
                        grad_convention="sum" if mode == "sum" else "mean")
    assert ep.mesh.mesh_dim_names == ("edp", "ep") and ep.mesh["ep"].size() == (ep_size or world)
    net = DistributedDataParallel(model) if mode == "ddp" else model
    opt = torch.optim.SGD(ep.param_groups(lr=LR))
    ep.attach(opt)
    losses, norms = [], []
    for step in range(STEPS):
        loss = lm_loss(net, batch(step, world)[rank])
        (loss / world if mode == "sum" else loss).backward()
        ep.finish_gradients(dense_synced=mode == "ddp")
        norms.append(float(ep.clip_grad_norm_(CLIP)))
        opt.step()
        opt.zero_grad()
        reported = loss.detach() / world
        dist.all_reduce(reported)  # NOTE: collective; the global mean loss
        losses.append(reported.item())
    ref_losses, ref_norms = reference_run(ref, world)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms))
    assert norms[0] > CLIP  # the clip bites, so a wrong global norm would show in the weights
    mine = dict(model.named_parameters())
    assert sorted(mine) == sorted(n for n, _ in ref.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full(mine[name]).detach(), p.detach(), msg=lambda m: f"{name}: {m}")
    assert ep.expert_parameters() and all(hasattr(p, "full_tensor") for p in ep.expert_parameters())
    return ep, opt


def expert_hooks_case(rank, world):
    """Expert gradients arrive through ordinary autograd on the expert parameters (batched experts, DTensor
    Shard(0)): a tensor hook and a post-accumulate-grad hook fire once per backward, and ``.grad`` is the
    DTensor autograd accumulated, equal to the gradient the hook saw."""
    model = tiny_moe()
    ExpertParallel(model, {"ep_size": world, "plan": PLAN})
    p = model.model.layers[0].mlp.experts.gate_up_proj
    seen, accumulated = [], []
    p.register_hook(lambda g: seen.append(g.to_local().clone()))
    p.register_post_accumulate_grad_hook(lambda q: accumulated.append(q.grad.to_local().clone()))
    lm_loss(model, batch(0, world)[rank]).backward()
    assert len(seen) == 1 and len(accumulated) == 1
    assert type(p.grad).__name__ == "DTensor" and p.grad.to_local().abs().sum() > 0
    torch.testing.assert_close(p.grad.to_local(), seen[0])
    torch.testing.assert_close(p.grad.to_local(), accumulated[0])
    # A hook registered BEFORE the handle sits on the parameter that sharding replaces: refused by name, never
    # silently dropped (autoep.runtime.live_state); registered after, as above, it runs.
    early = tiny_moe()
    early.model.layers[1].mlp.experts.down_proj.register_hook(lambda g: None)
    with pytest.raises(UnsupportedModuleStructure, match=r"down_proj carries 1 gradient hook.*Register them after"):
        ExpertParallel(early, {"ep_size": world, "plan": PLAN})


def module_list_hooks_case(rank, world, own_names: bool):
    """ModuleList experts (research_moe's torchtitan-style model): hooks on every expert parameter the handle
    reports fire once per backward and see the gradient autograd accumulates into ``.grad``; with ``own_names``,
    those parameters are the model's own expert modules' (``layers.0.moe.experts.3.w1.weight``)."""
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location("research_moe_model", EXAMPLE_DIR / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.TinyMoELM(vocab_size=64, dim=32, hidden_dim=64, num_layers=2, num_experts=4, top_k=2)
    ep = ExpertParallel(model, {"ep_size": world, "plan": [{"match": "layers.*.moe", "local_compute_fn": "auto"}]})
    params = ep.expert_parameters()
    seen: dict[int, list] = {id(p): [] for p in params}
    for p in params:
        p.register_hook(lambda g, i=id(p): seen[i].append(g.detach().clone()))
        p.register_post_accumulate_grad_hook(lambda q: seen[id(q)].append("accumulated"))
    ids = batch(0, world)[rank]
    logits = model(ids)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    assert params
    for p in params:
        assert len(seen[id(p)]) == 2 and seen[id(p)][1] == "accumulated"
        torch.testing.assert_close(p.grad, seen[id(p)][0])
    if own_names:
        names = sorted(n for n, p in model.named_parameters() if id(p) in seen)
        assert names and all(re.fullmatch(r"layers\.\d\.moe\.experts\.\d\.w[123]\.weight", n) for n in names), names


def guard_case(rank, world):
    """A step or a clip on unfinished gradients raises; finishing twice raises; finished, the step runs."""
    model = tiny_moe()
    ep = ExpertParallel(model, {"ep_size": world, "plan": PLAN})
    opt = torch.optim.SGD(ep.param_groups(lr=LR))
    ep.attach(opt)
    lm_loss(model, batch(0, world)[rank]).backward()
    with pytest.raises(GradientsNotFinished, match=r"optimizer.step\(\) after a backward.*ep.finish_gradients\(\)"):
        opt.step()
    with pytest.raises(GradientsNotFinished, match=r"clip_grad_norm_\(\)"):
        ep.clip_grad_norm_(1.0)
    unattached = torch.optim.SGD(model.parameters(), lr=LR)  # never attached: guarded all the same
    with pytest.raises(GradientsNotFinished, match=r"optimizer.step\(\) after a backward"):
        unattached.step()
    opt.step(lambda: None)  # step(closure) runs its backward after the pre-hooks: left to the trainer (Lightning)
    other = torch.nn.Linear(2, 2)
    other(torch.ones(1, 2)).sum().backward()
    torch.optim.SGD(other.parameters(), lr=LR).step()  # an optimizer over other parameters is left alone
    before = model.lm_head.weight.detach().clone()
    with pytest.raises(GradientsNotFinished, match=r"dense gradients differ across ranks.*dense_synced=False"):
        ep.finish_gradients()  # no DDP synced the dense grads: a silent divergence of the replicas otherwise
    ep.finish_gradients(dense_synced=False)
    with pytest.raises(GradientsNotFinished, match="no backward since the last call"):
        ep.finish_gradients(dense_synced=False)
    opt.step()
    assert not torch.equal(before, model.lm_head.weight)


def refusals_case(rank, world, tmp: str):
    """A world ep_size does not divide, an empty plan with ep_size > 1, a mesh of the wrong size."""
    with pytest.raises(PlanError, match=rf"parallel.ep_size=3 does not divide the world size {world}"):
        ExpertParallel(tiny_moe(), {"ep_size": 3, "plan": PLAN})
    with pytest.raises(PlanError, match=r"parallel.ep_size=2 but parallel.plan is empty.*parallel.ep_size=1"):
        ExpertParallel(tiny_moe(), {"ep_size": 2, "plan": []})
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("edp", "ep"))
    with pytest.raises(PlanError, match=r"parallel.ep_size=2 but the mesh's 'ep' dim has 1 ranks"):
        ExpertParallel(tiny_moe(), {"ep_size": 2, "plan": PLAN}, mesh=mesh)
    # Rank 0 decides; a rank whose model differs refuses its decision, and every rank stops (none hangs).
    model = tiny_moe() if rank == 0 else _with_experts(8)
    with pytest.raises(PlanError, match=r"rank 1 could not replay rank 0's plan: DriftError: .*num_experts 4 -> \[8\]"
                       if rank == 0 else r"num_experts 4 -> \[8\]"):
        ExpertParallel(model, {"ep_size": 2, "plan": PLAN})
    # Rank 0 refuses: the others say so, in words (was: "rank 0 could not resolve's plan").
    with pytest.raises(PlanError, match=r"matches no module" if rank == 0 else
                       r"^rank 0 could not resolve the plan: PlanError: parallel.plan.0.match='nothing.\*' matches no"):
        ExpertParallel(tiny_moe(), {"ep_size": 2, "plan": [{"match": "nothing.*"}]})


def _with_experts(num_experts: int):
    import transformers

    cfg = tiny_moe().config
    cfg.num_experts = num_experts
    return transformers.Qwen3MoeForCausalLM(cfg)


def artifact_case(rank, world, tmp: str):
    """run_dir: rank 0 alone writes resolved.yaml (each rank names its own dir here, so a write by rank 1 would
    show); the table is logged on rank 0; the record replays through load_plan on every rank."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("autoep").addHandler(handler)
    logging.getLogger("autoep").setLevel(logging.INFO)
    try:
        ep = ExpertParallel(tiny_moe(), {"ep_size": world, "plan": PLAN}, run_dir=Path(tmp) / f"rank{rank}")
    finally:
        logging.getLogger("autoep").removeHandler(handler)
    table = [r.getMessage() for r in records if "experts/rank" in r.getMessage()]
    if rank == 0:
        assert len(table) == 1 and "model.layers.1.mlp" in table[0] and "total per rank" in table[0], table
    else:
        assert not table
    # autoep's own writer too, called on every rank: rank 0 alone writes, and no key the config lacks is added.
    write_resolved(OmegaConf.create({"steps": 3, "parallel": ep.resolved}), Path(tmp) / f"full{rank}")
    dist.barrier()
    assert (Path(tmp) / "rank0" / "resolved.yaml").is_file() and (Path(tmp) / "full0" / "resolved.yaml").is_file()
    assert not (Path(tmp) / f"rank{world - 1}").exists() and not (Path(tmp) / f"full{world - 1}").exists()
    assert "run_dir" not in yaml.safe_load((Path(tmp) / "full0" / "resolved.yaml").read_text())
    replayed = ExpertParallel(tiny_moe(), Path(tmp) / "rank0" / "resolved.yaml")
    assert OmegaConf.to_container(replayed.resolved) == OmegaConf.to_container(ep.resolved)
    # The host's replay key: every rank reads the file, rank 0 alone logs the line (was: once per rank).
    records.clear()
    logging.getLogger("autoep").addHandler(handler)
    try:
        replayed = ExpertParallel(tiny_moe(), {"replay": str(Path(tmp) / "rank0" / "resolved.yaml")})
    finally:
        logging.getLogger("autoep").removeHandler(handler)
    assert OmegaConf.to_container(replayed.resolved) == OmegaConf.to_container(ep.resolved)
    lines = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert sum("replaying its frozen plan" in line for line in lines) == (rank == 0), lines
    if rank != 0:
        assert lines == [], lines


def checkpoint_case(rank, world, tmp: str):
    """save/load (DCP) and state_dict/load_state_dict (full) keep every expert of every rank and the optimizer's
    momentum, after training; damaged weights are restored exactly."""
    model = tiny_moe()
    ep = ExpertParallel(model, {"ep_size": world, "plan": PLAN})
    opt = torch.optim.SGD(ep.param_groups(lr=LR, momentum=0.9))
    ep.attach(opt)
    for step in range(2):
        lm_loss(model, batch(step, world)[rank]).backward()
        ep.finish_gradients(dense_synced=False)
        opt.step()
        opt.zero_grad()
    saved = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    local = {n: p.to_local().detach().clone() for n, p in model.named_parameters() if hasattr(p, "to_local")}
    momentum = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}
    assert local and all(t.shape[0] == saved[n].shape[0] // world for n, t in local.items())
    ep.save(Path(tmp) / "ckpt", opt)
    # Like nn.Module.state_dict(), replicated tensors alias the live ones: copied, as a trainer writing them does.
    full_state, full_optim = copy.deepcopy(ep.state_dict()), copy.deepcopy(ep.optimizer_state_dict(opt))
    assert sorted(full_state) == sorted(saved)
    for name, value in saved.items():
        torch.testing.assert_close(full_state[name], value)  # every expert, not only this rank's

    def damage():
        with torch.no_grad():
            for p in model.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).add_(1.0)
            for s in opt.state.values():
                s["momentum_buffer"].zero_()

    def check():
        for name, p in model.named_parameters():
            torch.testing.assert_close(full(p).detach(), saved[name])
            if name in local:
                torch.testing.assert_close(p.to_local(), local[name])
            buf = opt.state[p]["momentum_buffer"]
            torch.testing.assert_close(full(buf), full(momentum[name]))

    damage()
    ep.load(Path(tmp) / "ckpt", opt)
    check()
    damage()
    ep.load_state_dict(full_state)
    ep.load_optimizer_state_dict(opt, full_optim)
    check()
    assert sorted(p.name for p in Path(tmp).iterdir()) == ["ckpt"]  # no temporary directory left
    # The HF export holds every expert: from_pretrained gives a model equal to the trained one.
    ep.export_hf(Path(tmp) / "hf")
    dist.barrier()
    loaded = type(model).from_pretrained(Path(tmp) / "hf")
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p, saved[name], msg=lambda m: f"{name}: {m}")


def handle_cases(rank, world, tmp):
    results = {}
    for mode in ("ddp", "sum", "mean"):
        guarded(results, f"sgd_{mode}", ep_run, rank, world, mode)
    guarded(results, "expert_hooks", expert_hooks_case, rank, world)
    guarded(results, "module_list_hooks", module_list_hooks_case, rank, world, False)
    guarded(results, "module_list_hooks_own_params", module_list_hooks_case, rank, world, True)
    guarded(results, "guard", guard_case, rank, world)
    guarded(results, "refusals", refusals_case, rank, world, tmp)
    guarded(results, "artifact", artifact_case, rank, world, f"{tmp}/artifact")
    guarded(results, "checkpoint", checkpoint_case, rank, world, f"{tmp}/checkpoint")
    return results


def four_rank_cases(rank, world, tmp):
    """(edp, ep) = (2, 2): expert grads summed over edp too; and ep over all 4 ranks."""
    results = {}
    for mode in ("ddp", "sum"):
        guarded(results, f"edp2_sgd_{mode}", ep_run, rank, world, mode, 2)
    guarded(results, "ep4_sgd_mean", ep_run, rank, world, "mean", 4)
    return results


_RESULTS: dict = {}
_RESULTS4: dict = {}


@pytest.mark.parametrize("case", ["edp2_sgd_ddp", "edp2_sgd_sum", "ep4_sgd_mean"])
def test_four_ranks(case, tmp_path_factory):
    if not _RESULTS4:
        _RESULTS4.update(run_cases(4, "test_handle:four_rank_cases", str(tmp_path_factory.mktemp("handle4"))))
    errors = _RESULTS4[case]
    assert not errors, "\n".join(errors)


OWN_EXPERTS = importlib.util.find_spec("autoep.runtime.recipes.local_experts") is not None


@pytest.mark.parametrize("case", ["sgd_ddp", "sgd_sum", "sgd_mean", "expert_hooks", "module_list_hooks",
                                  pytest.param("module_list_hooks_own_params", marks=pytest.mark.xfail(
                                      not OWN_EXPERTS, strict=True, reason="ModuleList experts are restacked into new "
                                      "parameters until they keep their own modules (issue 16, ep-own-forward)")),
                                  "guard", "refusals", "artifact", "checkpoint"])
def test_two_ranks(case, tmp_path_factory):
    if not _RESULTS:
        _RESULTS.update(run_cases(2, "test_handle:handle_cases", str(tmp_path_factory.mktemp("handle"))))
    errors = _RESULTS[case]
    assert not errors, "\n".join(errors)


# -- one process ------------------------------------------------------------------------------------------------
def test_public_names():
    assert {"ExpertParallel", "load_plan"} <= set(autoep.__all__)
    assert autoep.ExpertParallel is ExpertParallel and autoep.load_plan is load_plan


def test_a_parallel_config_dataclass_is_taken():
    ep = ExpertParallel(tiny_moe(), ParallelConfig(ep_size=1, plan=[PlanEntry(match="model.layers.*.mlp")]))
    assert list(ep.resolved.plan[0].decision.modules) == ["model.layers.0.mlp", "model.layers.1.mlp"]


def test_ep_size_above_one_on_one_process_is_refused():
    with pytest.raises(PlanError, match=r"parallel.ep_size=2 but torch.distributed is not initialised.*"
                                        r"torchrun --nproc-per-node 2.*or set parallel.ep_size=1"):
        ExpertParallel(tiny_moe(), {"ep_size": 2, "plan": PLAN})


def test_one_process_logs_the_plan_and_records_it(tmp_path, caplog):
    model = tiny_moe()
    with caplog.at_level(logging.INFO, logger="autoep"):
        ep = ExpertParallel(model, {"ep_size": 1, "plan": PLAN}, run_dir=tmp_path)
    assert "model.layers.0.mlp" in caplog.text and "experts/rank" in caplog.text
    # One process: nothing sharded, but the experts are still the expert group (param groups of one layout at
    # every ep size, so a multi-rank checkpoint's optimizer state loads here).
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    assert ep.mesh is None and experts and [id(p) for p in ep.expert_parameters()] == [id(p) for p in experts]
    assert not any(hasattr(p, "to_local") for p in experts)
    plan = load_plan(tmp_path / "resolved.yaml")
    assert OmegaConf.to_container(plan) == OmegaConf.to_container(ep.resolved)
    raw = (tmp_path / "resolved.yaml").read_text()
    assert list(yaml.safe_load(raw)) == ["parallel", "artifact"]  # no key the host did not have (no run_dir)
    header = [line for line in raw.splitlines() if line.startswith("#")]
    assert any(f"autoep.load_plan('{tmp_path / 'resolved.yaml'}')" in line for line in header)  # the replay line


@pytest.mark.parametrize("text,message", [
    ("", r"is empty, so it holds no resolved plan"),
    ("parallel:\n  ep_size: 1\n", r"ends before its `artifact:` end marker"),
    ("steps: 3\n", r"holds no `parallel:` section \(keys \['steps'\]\)"),
    ("parallel: [\n", r"not valid YAML"),
])
def test_broken_resolved_yaml_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    with pytest.raises(PlanError, match=message):
        ExpertParallel(tiny_moe(), path)


def test_missing_or_edited_record_is_refused(tmp_path):
    with pytest.raises(PlanError, match=r"no such resolved.yaml"):
        load_plan(tmp_path / "nowhere" / "resolved.yaml")
    ExpertParallel(tiny_moe(), {"ep_size": 1, "plan": PLAN}, run_dir=tmp_path)
    path = tmp_path / "resolved.yaml"
    path.write_text(path.read_text().replace("ep_size: 1", "ep_size: 2"))
    with pytest.raises(PlanError, match=r"artifact.plan_hash=.*does not match its parallel section"):
        load_plan(path)


def test_expert_sharding_is_refused_naming_the_trainer_key():
    """Expert FSDP2 lives in autoep-train (``trainer.expert_sharding``); the handle has no FSDP2 path: refused."""
    with pytest.raises(PlanError, match=r"parallel.expert_sharding=fsdp2: .*drop parallel.expert_sharding, or train "
                                        r"with autoep-train trainer.expert_sharding=fsdp2"):
        ExpertParallel(tiny_moe(), OmegaConf.create({"ep_size": 1, "plan": PLAN, "expert_sharding": "fsdp2"}))
