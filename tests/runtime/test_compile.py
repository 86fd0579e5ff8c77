"""``torch.compile`` of the dense layers around the EP blocks (autoep/runtime/compile.py), on 2 gloo ranks.

The reference is the same EP model left eager, on the same inputs: compiled vs eager must give the same loss and
the same gradients (dense and this rank's expert shards), and the same loss after one SGD step. The backend is
``aot_eager`` (this machine has g++, but inductor's cold C++ compile costs ~100 s on CPU): it runs the graph's
aten ops after decomposition, so differences are reassociation-level (measured here: <= 5e-8 absolute on grads
of magnitude 1e-1), and fp32 ``assert_close`` defaults hold. ``trainer.compile=true`` is run through the trainer
(replicated and FSDP2 dense params) and its losses compared with the eager trainer's.
"""
import copy

import pytest
import torch
from distributed import guarded, run_cases
from hydra.utils import instantiate
from test_resolve import model_cfg
from test_train_worlds import run
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from autoep.plan.resolve import resolve_plan
from autoep.runtime.apply import apply_plan
from autoep.runtime.compile import compile_dense

BACKEND = "aot_eager"
STEPS = 2


def ep_model(mesh):
    torch.manual_seed(0)  # the same full weights on every rank; apply_plan keeps this rank's experts
    model = instantiate(model_cfg("qwen3_moe"))
    parallel = resolve_plan({"ep_size": 2, "plan": [{"match": "model.layers.*.mlp"}]}, model)
    apply_plan(model, parallel, mesh)
    return model, list(parallel.plan[0].decision.modules)


def losses_and_grads(model, rank):
    """Per step: this rank's loss and every gradient (expert DTensors: the local shard), then an SGD step."""
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(10 + rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
                 for n, p in model.named_parameters() if p.grad is not None}
        out.append((loss.detach(), grads))
        optimizer.step()  # NOTE: the expert grads stay per rank; both models see the same (unreduced) update
    return out


def model_parity(rank, world_size):
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("edp", "ep"))
    eager, planned = ep_model(mesh)
    compiled, _ = ep_model(mesh)
    names = compile_dense(compiled, planned, backend=BACKEND)
    assert names == [f"model.layers.{i}.{c}" for i in (0, 1)
                     for c in ("self_attn", "input_layernorm", "post_attention_layernorm")], names
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # the model's own names
    for (loss_e, grads_e), (loss_c, grads_c) in zip(losses_and_grads(eager, rank), losses_and_grads(compiled, rank)):
        torch.testing.assert_close(loss_c, loss_e)
        assert grads_c.keys() == grads_e.keys()
        assert any(".mlp.experts." in n for n in grads_e)
        for n in grads_e:
            torch.testing.assert_close(grads_c[n], grads_e[n], msg=lambda m, n=n: f"{n}: {m}")


def trainer_parity(rank, world_size, tmp):
    """Eager replicated dense params vs compiled, replicated and FSDP2 (which equals replicated: test_train_worlds)."""
    common = ("parallel.ep_size=2", f"trainer.steps={STEPS}", "data.batch_size=2")
    eager = run(*common, f"run_dir={tmp}/eager")
    for sharding in ("replicate", "fsdp2"):
        compiled = run(*common, "trainer.compile=true", f"trainer.compile_backend={BACKEND}",
                       f"trainer.dense_sharding={sharding}", f"run_dir={tmp}/compiled_{sharding}")
        torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]))
        for n, w in eager["weights"].items():
            torch.testing.assert_close(compiled["weights"][n], w, msg=lambda m, n=n, s=sharding: f"{s} {n}: {m}")


def cases(rank, world_size, tmp):
    results = {}
    guarded(results, "model", model_parity, rank, world_size)
    guarded(results, "trainer", trainer_parity, rank, world_size, tmp)
    return results


def test_compiled_dense_layers_equal_eager_on_two_ranks(tmp_path):
    failed = {case: errors for case, errors in run_cases(2, "test_compile:cases", str(tmp_path)).items() if errors}
    assert not failed, "\n".join(f"{case}: {errors[0]}" for case, errors in failed.items())


def test_compile_dense_leaves_the_ep_block_and_the_model_names_alone():
    model, planned = ep_model(None)
    before = copy.copy(dict(model.named_modules()))
    compile_dense(model, planned, backend=BACKEND)
    assert dict(model.named_modules()) == before
    assert all(getattr(model.get_submodule(n), "_compiled_call_impl", None) is None for n in planned)
    assert model.get_submodule("model.layers.0.self_attn")._compiled_call_impl is not None


def test_compile_with_bf16_is_refused_before_torch():
    """bf16 weight copies swap the parameters a compiled module guards on; the pair never ran: refused, naming both."""
    from hydra import compose, initialize_config_dir

    from autoep.errors import ConfigError
    from autoep.train.config import CONF_DIR, check_config

    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["trainer.compile=true", "trainer.precision=bf16"])
    with pytest.raises(ConfigError, match=r"trainer.compile=true with trainer.precision=bf16 is not supported yet"):
        check_config(cfg)
