"""``parallel.ep_size=auto`` on 2 gloo ranks: through ``autoep-train`` it becomes 2 (the default model's 8 experts,
world 2), resolved.yaml holds the number, and the run equals one process on the same global batch; through the
handle (``ExpertParallel``: rank 0 decides, the others replay its number) the mesh gets 2 ep ranks."""
from distributed import spawn
from omegaconf import OmegaConf
from test_train_worlds import GLOBAL_ROWS, assert_same_training, run


def auto_worker(rank: int, world_size: int, tmp: str) -> dict:
    from hydra.utils import instantiate
    from test_resolve import model_cfg

    from autoep import ExpertParallel

    out = run("parallel.ep_size=auto", f"data.batch_size={GLOBAL_ROWS // world_size}", f"run_dir={tmp}/auto")
    ep = ExpertParallel(instantiate(model_cfg("olmoe")), {"ep_size": "auto", "plan": [{"match": "model.layers.*.mlp"}]})
    out["handle"] = (ep.resolved.ep_size, ep.mesh["ep"].size())
    return out


def test_two_ranks_auto_becomes_two_and_trains_as_one_process(tmp_path):
    ranks = spawn(2, "test_ep_size_auto:auto_worker", str(tmp_path))
    assert OmegaConf.load(tmp_path / "auto" / "resolved.yaml").parallel.ep_size == 2
    single = run(f"data.batch_size={GLOBAL_ROWS}", f"run_dir={tmp_path}/ep1")
    for r in ranks:
        assert r.pop("handle") == (2, 2)
        assert_same_training(r, single)
