"""Someone else's training loop with expert parallelism from autoep's public handle, ``autoep.ExpertParallel``.

    python examples/research_moe/train.py                                   # 1 process, auto detection
    torchrun --nproc-per-node 2 examples/research_moe/train.py parallel.ep_size=2
    python examples/research_moe/train.py \
        'parallel.plan.0.local_compute_fn={_target_:my_ep.replicated_experts,count_tokens:true}'
    torchrun --nproc-per-node 2 examples/research_moe/train.py parallel.ep_size=2 \
        run_dir=outputs/research_moe_more resume=outputs/research_moe/checkpoint
"""
import os

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from autoep import ExpertParallel


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
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model)
    # autoep: the (edp, ep) mesh, the plan resolved once (rank 0 detects) and applied, the table logged,
    # <run_dir>/resolved.yaml written by rank 0
    ep = ExpertParallel(model, cfg.parallel, run_dir=cfg.run_dir)
    opt = torch.optim.SGD(ep.param_groups(lr=cfg.lr))
    ep.attach(opt)  # autoep: a step on gradients finish_gradients did not finish raises
    if cfg.resume:
        ep.load(cfg.resume, opt)  # autoep: every expert back on the rank that owns it (any ep_size)
    for step in range(cfg.steps):
        ids = batches(step, world, rank, cfg)
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()  # this rank's mean loss; the global loss is the mean over ranks
        ep.finish_gradients(dense_synced=False)  # autoep: no DDP here, so dense grads are averaged too
        opt.step()
        opt.zero_grad()
        reported = loss.detach() / world
        if world > 1:
            dist.all_reduce(reported)  # NOTE: collective, for the printout only: the global mean loss
        if rank == 0:
            print(f"step {step} loss {reported.item():.8f}", flush=True)
    ep.save(f"{cfg.run_dir}/checkpoint", opt)  # autoep: model and optimizer, each rank its own experts
    if rank == 0:
        seen = [getattr(m, "tokens_seen", None) for m in model.modules() if hasattr(m, "tokens_seen")]
        decision = ep.resolved.plan[0].decision
        print("decision:", decision.source, OmegaConf.to_container(decision.structure) if decision.structure else "")
        print("tokens seen by the user's compute fn:", seen)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
