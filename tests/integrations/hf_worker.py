"""HF ``transformers.Trainer`` runs for tests/integrations/test_hf_trainer.py, launched as HF users launch them:

    torchrun --standalone --nproc-per-node 2 tests/integrations/hf_worker.py OUT_DIR [bf16]

Each run trains the same tiny Qwen3-MoE from the same weights on the same data (SGD with momentum, so the
optimizer has state to save; the default ``max_grad_norm=1.0``, which bites at this learning rate):

- ``plain``: ``transformers.Trainer`` without autoep (DDP over both ranks): the reference;
- ``ep``: ``ExpertParallelTrainer`` with ``parallel.ep_size=2``, checkpoints every 3 steps, through the ``train``
  function docs/integrations.md shows (the snippet is executed as written);
- ``resumed``: ``ExpertParallelTrainer`` resumed from ``ep``'s ``checkpoint-3`` to the same last step;
and checks what needs every rank (logits of the EP model against ``from_pretrained`` of its checkpoint,
every expert of a loaded checkpoint against the file). Rank 0 writes ``OUT_DIR/result.pt``; the test asserts.
With ``bf16`` only ``plain`` and ``ep`` run, both with ``bf16=True``.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from transformers import Trainer, TrainingArguments

from autoep.integrations.hf import ExpertParallelTrainer

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
PARALLEL = {"ep_size": 2, "plan": [{"match": "model.layers.*.mlp", "local_compute_fn": "auto"}]}
STEPS, SAVE_EVERY, ROWS, SEQ = 6, 3, 24, 12


def tiny_moe():
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2, norm_topk_prob=True)
    return transformers.Qwen3MoeForCausalLM(cfg)


def dataset() -> list[dict]:
    ids = torch.randint(0, 64, (ROWS, SEQ), generator=torch.Generator().manual_seed(7))
    return [{"input_ids": row, "labels": row} for row in ids]


TRAINING = dict(optim="sgd", optim_args="momentum=0.9", learning_rate=0.2, lr_scheduler_type="constant",
                max_steps=STEPS, per_device_train_batch_size=2, logging_steps=1, save_strategy="steps",
                save_steps=SAVE_EVERY, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)


def arguments(out: str, **kw) -> TrainingArguments:
    return TrainingArguments(output_dir=out, **{**TRAINING, **kw})


def history(trainer) -> dict:
    logs = [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
    return {"loss": [e["loss"] for e in logs], "grad_norm": [e["grad_norm"] for e in logs]}


def run_plain(out: str, **kw) -> dict:
    trainer = Trainer(model=tiny_moe(), args=arguments(out, **kw), train_dataset=dataset())
    trainer.train()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return {**history(trainer), "weights": weights, "eval_loss": evaluate(trainer)}


def evaluate(trainer) -> float:
    """``trainer.evaluate`` on 10 held-out rows (5 per rank; the last batch is short)."""
    ids = torch.randint(0, 64, (10, SEQ), generator=torch.Generator().manual_seed(13))
    return trainer.evaluate([{"input_ids": row, "labels": row} for row in ids])["eval_loss"]


def doc_train():
    """The ``train`` function of docs/integrations.md's HF section, as a user copies it."""
    text = DOC.read_text()
    section = re.search(r"^## HF transformers.Trainer\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S).group(1)
    (code,) = re.findall(r"^```python\n(.*?)^```", section, flags=re.M | re.S)
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)  # noqa: S102 - the documented snippet
    return scope["train"]


def run_ep(out: str, resume: str | None = None, **kw) -> tuple[dict, ExpertParallelTrainer]:
    trainer = doc_train()(tiny_moe(), dataset(), PARALLEL, out, resume=resume, **{**TRAINING, **kw})
    assert isinstance(trainer, ExpertParallelTrainer)
    assert trainer.ep.mesh["ep"].size() == 2
    weights = {k: v.detach().clone() for k, v in trainer.ep.state_dict().items()}  # every expert gathered
    return {**history(trainer), "weights": weights, "eval_loss": evaluate(trainer)}, trainer


def logits_check(trainer: ExpertParallelTrainer, checkpoint: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of the EP model, every rank running its forward; logits of ``from_pretrained`` of the checkpoint
    in one process), on the same tokens."""
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(11))
    model = trainer.model.eval()
    with torch.no_grad():
        ep_logits = model(input_ids=ids).logits
        ref = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
        ref_logits = ref(input_ids=ids).logits
    return ep_logits, ref_logits


def shard_check(out: str, checkpoint: str) -> float:
    """Load ``checkpoint`` into a fresh EP trainer (resume path, no step left); max difference between each
    rank's expert shards and the same rows of the file."""
    from torch.distributed.tensor import DTensor

    trainer = ExpertParallelTrainer(model=tiny_moe(), args=arguments(out), train_dataset=dataset(),
                                    parallel=PARALLEL)
    trainer._load_from_checkpoint(checkpoint)
    # what the file holds, read by transformers' own loader in one process (it maps the saved layout back)
    saved = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    worst, experts = 0.0, 0
    for name, p in trainer.model.named_parameters():
        if isinstance(p, DTensor):
            local = p.to_local()
            rows = local.shape[0]
            start = rows * trainer.ep.mesh["ep"].get_local_rank()
            worst = max(worst, (local - saved[name][start:start + rows]).abs().max().item())
            experts += 1
        else:
            worst = max(worst, (p.detach() - saved[name]).abs().max().item())
    assert experts > 0
    return worst


def count_detections() -> list:
    """Wrap the detector: each call is counted (detection must run once per run, on rank 0, not per rank)."""
    from autoep.detect import structure

    calls, detect = [], structure.detect_moe_structure

    def counted(module, **kwargs):
        calls.append(type(module).__name__)
        return detect(module, **kwargs)
    structure.detect_moe_structure = counted
    return calls


def main(out: str, bf16: bool) -> None:
    rank = int(os.environ["RANK"])
    result: dict = {"world": int(os.environ["WORLD_SIZE"])}
    detections = count_detections()
    if bf16:
        result["plain"] = run_plain(f"{out}/plain", bf16=True)
        result["ep"], _ = run_ep(f"{out}/ep", bf16=True)
    else:
        result["plain"] = run_plain(f"{out}/plain")
        result["ep"], trainer = run_ep(f"{out}/ep")
        last = f"{out}/ep/checkpoint-{STEPS}"
        result["logits"] = logits_check(trainer, last)
        result["resumed"], _ = run_ep(f"{out}/resumed", resume=f"{out}/ep/checkpoint-{SAVE_EVERY}")
        result["shard_diff"] = shard_check(f"{out}/shards", last)
        result["checkpoints"] = sorted(os.listdir(f"{out}/ep"))
        result["files"] = sorted(os.listdir(last))
        ga = dict(gradient_accumulation_steps=2, max_steps=3, save_strategy="no")  # 2 micro-batches a step
        result["plain_ga"] = run_plain(f"{out}/plain_ga", **ga)
        result["ep_ga"], _ = run_ep(f"{out}/ep_ga", **ga)
    per_rank: list = [None] * result["world"]
    dist.all_gather_object(per_rank, len(detections))
    result["detections"] = per_rank
    if rank == 0:
        torch.save(result, os.path.join(out, "result.pt"))
    dist.barrier()
    # No destroy_process_group: every rank has passed the barrier and leaves with os._exit below; a rank was seen
    # hung for good in the gloo group's destruction after the others had left (4 ranks, result already written).


if __name__ == "__main__":
    main(sys.argv[1], bf16="bf16" in sys.argv[2:])
    # Leave without interpreter teardown: seen once on 4 ranks, a rank hung there for good (the Trainer's DDP
    # Reducer, freed at module teardown, destroyed its gloo group and joined a gloo worker thread that waited
    # for the GIL the joining thread held), and torchrun waited for it. Everything is written and every rank
    # has passed the final barrier by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
