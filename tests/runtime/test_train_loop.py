"""The train-mode harness (``tests/train_loop.py``) on a fixed sample of fuzz targets, one per accepted family and
idle-expert idiom: the same loop (SGD with momentum, AdamW with weight decay) on the model and on its EP copy, 5
steps, routing forced so that an expert gets no token from any rank and another gets tokens from one rank only;
loss, every gradient (``None`` where the model's is ``None``) and every weight compared after every step, on 2
and 4 gloo ranks. Every target runs with ``python tests/train_loop.py --ranks 2 4``.

Also here: what the detector records about experts without rows (``MoeStructure.idle_experts``) for each idiom,
and the exchange's own semantics for them in one process (``dispatch.Idle``).
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_cases
from train_loop import target_named

from autoep.detect.structure import detect_moe_structure
from autoep.runtime.dispatch import Idle, ep_experts_forward

# (target, optimizer, hooks): every family the detector accepts, each idle idiom (skip, call, touch, split with
# `if n == 0: continue`, and replay's: the model's own calls), both optimizers, and the experts' own forwards under a
# user's hooks.
CASES_2 = [
    ("hf/qwen3_moe", "sgd", False),  # transformers 5.x batched experts, a loop over the experts hit
    ("hf/mixtral", "adamw", False),
    ("v4/mixtral", "adamw", False),  # v4-style ModuleList SwiGLU: the grouped fast path, idle experts skipped
    ("v4/mixtral", "sgd", True),  # the same, the experts' own forwards (hooked): only the called ones run
    ("v4/fairseq_local_experts", "sgd", True),  # row-local (non-SwiGLU) experts, `range` loop: called on no rows
    ("v4/minimind", "adamw", False),  # an idle expert touched by `0 * sum(p.sum())` while training
    ("v4/sorted_split", "sgd", False),  # argsort/split loop with `if n == 0: continue`
    ("hf/switch_transformers", "sgd", False),  # an experts container whose own forward is the loop (replay)
    ("v4/selected_rows", "adamw", False),  # the loop calls the experts an id list names (replay)
    ("v4/titan_grouped", "adamw", False),  # grouped experts(x_sorted, counts)
    ("hf/llama4", "sgd", False),  # Llama-4 equal groups
]
# 4 ranks, 4 experts: rank 3 owns only the idle expert, so it runs no expert yet gets results back (its empty
# share takes the others' output width and dtype), and one rank has no tokens at all.
CASES_4 = [
    ("hf/qwen3_moe", "adamw", False),
    ("v4/mixtral", "sgd", True),
    ("hf/switch_transformers", "adamw", False),
]


@pytest.mark.parametrize("world_size,cases", [(2, CASES_2), (4, CASES_4)], ids=["2ranks", "4ranks"])
def test_training_on_ep_equals_training_on_the_model(world_size, cases):
    merged = run_cases(world_size, "train_loop:worker", cases)
    failed = {k: v for k, v in merged.items() if v}
    assert not failed, "\n".join(f"{k}: {v[0][:600]}" for k, v in failed.items())
    assert len(merged) == 2 * len(cases)


@pytest.mark.parametrize("name,idle", [
    ("hf/qwen3_moe", ("skip",)),  # `for expert_idx in expert_hit:`
    ("v4/mixtral", ("skip",)),
    ("v4/fairseq_local_experts", ("call",)),  # `for i, expert in enumerate(...)` without a guard
    ("v4/mistral_inference", ("call",)),
    ("v4/minimind", ("touch_training",)),  # `if mask.any(): ... elif self.training: y[0, 0] += 0 * sum(...)`
    ("v4/sorted_split", ("skip",)),  # `if n == 0: continue` before the expert runs
    ("v4/deepseek_remote", ("call", "skip")),  # masked loop while training, split loop in its no_grad helper
    # record/exchange/replay records none: an expert runs exactly where the model's forward calls it
    ("v4/selected_rows", ()),
    ("hf/switch_transformers", ()),
    ("v4/titan_grouped", ("call",)),
    ("hf/llama4", ("call",)),
])
def test_detector_records_what_the_loop_does_with_an_idle_expert(name, idle):
    assert detect_moe_structure(target_named(name).build()).idle_experts == idle


def _experts(E=3, D=4):
    torch.manual_seed(0)
    return [torch.nn.Linear(D, D, bias=False) for _ in range(E)]


@pytest.mark.parametrize("mode,grads", [("skip", [True, False, True]), ("call", [True, True, True]),
                                        ("touch", [True, True, True])])
def test_exchange_calls_and_grads_idle_experts_as_the_loop_does(mode, grads):
    """One process: expert 1 gets no row; ``skip`` leaves its grad None and does not call it, ``call`` runs it on
    zero rows (zero grad), ``touch`` gives a zero grad without calling it. Values equal the loop's either way."""
    experts, called = _experts(), []
    x = torch.randn(5, 4, requires_grad=True)
    idx = torch.tensor([[0], [2], [0], [2], [2]])
    w = torch.rand(5, 1)

    def expert_fn(x_SD, counts, status):
        chunks = torch.split(x_SD, counts.tolist())
        called.extend(e for e, s in enumerate(status) if s == 2)
        return torch.cat([experts[e](c) for e, (c, s) in enumerate(zip(chunks, status)) if s == 2])

    idle = Idle(mode, per_expert=True, params=lambda e: list(experts[e].parameters()))
    out = ep_experts_forward(x, idx, w, num_experts=3, ep_group=None, expert_fn=expert_fn, idle=idle)
    out.sum().backward()
    want = sum((idx == e).float() * w * experts[e](x) for e in range(3)).detach()
    torch.testing.assert_close(out.detach(), want)
    assert [e.weight.grad is not None for e in experts] == grads
    assert called == ([0, 1, 2] if mode == "call" else [0, 2])
    if mode != "skip":
        assert not experts[1].weight.grad.any()


def test_batched_experts_keep_none_only_where_no_expert_ran():
    """3-D experts (``per_expert=False``): with every pair padding, a skipping loop never reads the weights (None);
    with one routed pair, every expert's slice of the gradient exists (zeros where idle)."""
    weight = torch.randn(3, 4, 4, requires_grad=True)

    def expert_fn(x_SD, counts):
        chunks = torch.split(x_SD, counts.tolist())
        return torch.cat([c @ weight[e] for e, c in enumerate(chunks)])

    x = torch.randn(2, 4, requires_grad=True)
    for ids, has_grad in ((torch.tensor([[3], [3]]), False), (torch.tensor([[3], [1]]), True)):
        weight.grad = None
        out = ep_experts_forward(x, ids, torch.ones(2, 1), num_experts=3, ep_group=None, expert_fn=expert_fn,
                                 idle=Idle("skip"))
        out.sum().backward()
        assert (weight.grad is not None) == has_grad
        if has_grad:
            assert weight.grad[1].any() and not weight.grad[0].any() and not weight.grad[2].any()
