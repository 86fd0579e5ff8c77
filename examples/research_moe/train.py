"""Someone else's training loop using autoep's Python API: resolve_plan + apply_plan.

    python examples/research_moe/train.py                                   # 1 process, auto detection
    torchrun --nproc-per-node 2 examples/research_moe/train.py parallel.ep_size=2
    python examples/research_moe/train.py \
        'parallel.plan.0.local_compute_fn={_target_:my_ep.replicated_experts,count_tokens:true}'
"""
import os

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from autoep import apply_plan, resolve_plan
from autoep.plan.artifact import write_resolved
from autoep.train.loop import reduce_grads, split_params


def batches(step: int, world: int, rank: int, cfg: DictConfig) -> torch.Tensor:
    """A learnable toy task: each sequence counts up by a fixed stride. Same global batch on every rank."""
    g = torch.Generator().manual_seed(cfg.seed * 1000 + step)
    start = torch.randint(0, 64, (cfg.batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (cfg.batch_size, 1), generator=g)
    ids = (start + stride * torch.arange(cfg.seq_len)) % cfg.model.vocab_size
    return ids.chunk(world)[rank]


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model)
    cfg.parallel = resolve_plan(cfg.parallel, model)  # detection happens here, once, before any process group
    if rank == 0:
        write_resolved(cfg, cfg.run_dir)
    mesh = None
    if world > 1:
        dist.init_process_group("gloo")
        mesh = dist.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    apply_plan(model, cfg.parallel, mesh)
    dense, expert = split_params(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    for step in range(cfg.steps):
        ids = batches(step, world, rank, cfg)
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        (loss / world).backward()  # the global loss is the mean over ranks
        if world > 1:
            reduce_grads(dense, expert, dist.group.WORLD, None)  # ep == world: no edp replicas of experts
        opt.step()
        opt.zero_grad()
        reported = loss.detach() / world
        if world > 1:
            dist.all_reduce(reported)  # NOTE: collective, for the printout only: the global mean loss
        if rank == 0:
            print(f"step {step} loss {reported.item():.6f}", flush=True)
    if rank == 0:
        seen = [getattr(m, "tokens_seen", None) for m in model.modules() if hasattr(m, "tokens_seen")]
        decision = cfg.parallel.plan[0].decision
        print("decision:", decision.source, OmegaConf.to_container(decision.structure) if decision.structure else "")
        print("tokens seen by the user's compute fn:", seen)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
