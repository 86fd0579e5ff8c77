"""Expert FSDP (``trainer.expert_sharding=fsdp2``, ``autoep.runtime.expert_fsdp``) on 4 ranks, (edp, ep) = (2, 2)."""
from __future__ import annotations

import json
from pathlib import Path

from distributed import spawn
from module_list_lm import model_config
from test_train_worlds import GLOBAL_ROWS, assert_same_training, run

FSDP = "trainer.expert_sharding=fsdp2"


def grad_norms(result: dict) -> list[float]:
    rows = (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["grad_norm"] for line in rows]


def worker(rank: int, world_size: int, tmp: str) -> dict:
    rows = f"data.batch_size={GLOBAL_ROWS // world_size}"
    out = {"batched": run("parallel.ep_size=2", rows, FSDP, f"run_dir={tmp}/batched")}
    return out


def test_try(tmp_path):
    import time
    t = time.time()
    ranks = spawn(4, "test_expert_fsdp:worker", str(tmp_path))
    print("spawn", time.time() - t)
    single = run(f"data.batch_size={GLOBAL_ROWS}", f"run_dir={tmp_path}/single")
    print(single["losses"], ranks[0]["batched"]["losses"], grad_norms(single), grad_norms(ranks[0]["batched"]))
    for r in ranks:
        assert_same_training(r["batched"], single)
