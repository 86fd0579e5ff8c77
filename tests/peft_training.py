"""Training with PEFT's LoRA on an expert-parallel model against the same PEFT model in one process: the harness
of ``tests/runtime/test_adapters.py`` (transformers 5.x) and ``tests/tools/test_transformers_v4.py`` (4.x).

``train_case(rank, world, family, order, trainable, level)``: the family's tiny model with LoRA (``FAMILIES``: its
builder, ``LoraConfig``'s targets, the plan's match), made expert-parallel with ``ExpertParallel`` before
("apply_first") or after ("peft_first") ``get_peft_model``; the LoRA parameters alone trainable or every parameter;
the whole model or its first MoE block. Each rank its slice; compared with the reference (each slice run
separately, gradients summed) as the comparisons come, raised at the end (the ranks' collectives stay in step):
every output (and the block's input gradient), every gradient at the first step (dense ones summed over ranks,
batched experts gathered, module experts on their owners), every weight after each SGD step (momentum), and the
batched experts as PEFT found them (their own class, no parametrization, the parameter objects the optimizer holds).
"""
from __future__ import annotations

import contextlib
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

LR, MOMENTUM, STEPS, VOCAB, SEQ, HIDDEN = 0.1, 0.9, 3, 64, 6, 32
# Per step, sequences per rank (whole models: transformers' attention cannot run on zero sequences) and tokens per
# rank (the first MoE block alone: a rank with no tokens at all at one step, still joining every exchange).
ROWS = {"model": {2: [(2, 1), (1, 3), (3, 1)], 4: [(1, 2, 1, 1), (2, 1, 1, 1), (1, 1, 2, 1)]},
        "block": {2: [(5, 2), (6, 0), (0, 4)], 4: [(3, 0, 2, 1), (2, 2, 0, 3), (0, 1, 4, 2)]}}
TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@contextlib.contextmanager
def raises(exc, match: str):
    """``pytest.raises`` whose "did not raise" is an ``AssertionError``, which ``guarded`` records (pytest's own
    outcome is a BaseException, which would end the rank)."""
    try:
        with pytest.raises(exc, match=match):
            yield
    except pytest.fail.Exception as e:
        raise AssertionError(str(e)) from None


def qwen3_moe():
    import transformers

    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True))


def mixtral():
    import transformers

    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))


def research_moe():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "research_moe" / "model.py"
    spec = importlib.util.spec_from_file_location("research_moe_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TinyMoELM(vocab_size=VOCAB, dim=HIDDEN, hidden_dim=64, num_layers=2, num_experts=4, top_k=2)


def titan_grouped():
    from grouped_lm import GroupedLM

    model = GroupedLM(kind="titan_padded", vocab_size=VOCAB, hidden=HIDDEN, ffn=16, num_experts=4, top_k=2)
    del model.config  # the trainer's namespace; PEFT reads a model's config as a mapping (none: a custom model)
    return model


# family: (builder, LoraConfig's targets, the plan's match). Batched experts take target_parameters on their 3-D
# weights; ModuleList experts (a research model's w1/w2/w3 Linears) take target_modules.
FAMILIES = {
    "qwen3_moe": (qwen3_moe, {"target_parameters": TARGETS}, "*model.layers.*.mlp"),
    "mixtral": (mixtral, {"target_parameters": TARGETS}, "*model.layers.*.mlp"),
    "research_moe": (research_moe, {"target_modules": ["w1", "w3"]}, "*layers.*.moe"),
    # torchtitan's grouped experts ``experts(x_sorted, num_tokens_per_expert)``, (E, ...) weights w1/w2/w3
    "titan_grouped": (titan_grouped, {"target_parameters": ["mlp.experts.w1", "mlp.experts.w2", "mlp.experts.w3"]},
                      "*model.layers.*.mlp"),
}


class DbrxHolder(torch.nn.Module):
    """transformers 5.x ``DbrxFFN`` alone (its experts: flattened (E*F, D) weights on ``experts.mlp``), F=16 != D=32."""

    def __init__(self):
        from transformers.models.dbrx import modeling_dbrx

        super().__init__()
        self.ffn = modeling_dbrx.DbrxFFN(modeling_dbrx.DbrxConfig(d_model=HIDDEN, n_heads=4, ffn_config={
            "ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2}))

    def forward(self, x):
        return self.ffn(x)


# Families not trained (``train_case``): what PEFT and autoep do with them is tested on its own.
OTHERS = {"dbrx": (DbrxHolder, {"target_parameters": ["ffn.experts.mlp.w1", "ffn.experts.mlp.v1",
                                                       "ffn.experts.mlp.w2"]}, "*ffn")}


def _spec(family: str) -> tuple:
    return FAMILIES[family] if family in FAMILIES else OTHERS[family]


def build(family: str):
    """The family's tiny model, random weights (HF inits some to zero), the experts' eager forward."""
    torch.manual_seed(0)
    model = _spec(family)[0]()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name else 0.1 * torch.randn(p.shape, generator=g))
    for m in model.modules():
        if hasattr(getattr(m, "config", None), "_experts_implementation"):
            m.config._experts_implementation = "eager"
    return model


def with_lora(model, family: str, trainable: str):
    """``get_peft_model`` with LoRA on the experts' weights; the adapters drawn by name (PEFT zeroes B: a delta
    of zero would test nothing), the same in every model; ``trainable="all"``: every parameter trains; ``"two"``:
    two adapters active at once (PEFT folds their summed delta, ``_LoraParameterProxy``), both trained."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, **_spec(family)[1]))
    if trainable == "two":
        peft_model.add_adapter("other", LoraConfig(r=3, lora_alpha=2, **_spec(family)[1]))
        peft_model.base_model.set_adapter(["default", "other"])
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    if trainable == "all":
        peft_model.requires_grad_(True)
    return peft_model


def inputs(level: str, step: int, world: int) -> list[torch.Tensor]:
    """The step's global batch, one slice per rank: token ids (whole model) or hidden states (one block)."""
    rows = ROWS[level][world][step]
    g = torch.Generator().manual_seed(100 + step)
    if level == "model":
        return list(torch.randint(0, VOCAB, (sum(rows), SEQ), generator=g).split(rows))
    return [x.unsqueeze(1).requires_grad_() for x in torch.randn((sum(rows), HIDDEN), generator=g).split(rows)]


def run(net, level: str, x):
    """The whole model's logits, or the first MoE block's output."""
    if level == "model":
        out = net(input_ids=x)
        return getattr(out, "logits", out)
    block = next(m for n, m in net.named_modules() if n.endswith(("layers.0.mlp", "layers.0.moe")))
    out = block(x)
    return out[0] if isinstance(out, tuple) else out


def loss_of(level: str, out, x, total: int):
    """Each rank's part of the global loss (they add up to it: "sum"): summed token losses (or squares of the
    block's output) over the step's count."""
    if level == "model":
        return F.cross_entropy(out[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="sum") / total
    return (out ** 2).sum() / total


def gathered(p) -> torch.Tensor:
    """A dense gradient summed over the ranks (each holds its own tokens' part), an expert shard's gathered (the
    whole expert's gradient, every rank's tokens in it). A collective."""
    if isinstance(p, DTensor):
        g = p.grad if p.grad is not None else DTensor.from_local(torch.zeros_like(p.to_local()), p.device_mesh,
                                                                 p.placements)
        return g.full_tensor()
    g = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
    dist.all_reduce(g)
    return g


def weights(model) -> dict[str, torch.Tensor]:
    """Every weight, full: batched experts gathered, module experts broadcast by their owners (a collective)."""
    from autoep.runtime.recipes.local_experts import full_state_dict_of_experts

    names = {n for n, _ in model.named_parameters()}
    state = full_state_dict_of_experts(model)
    return {n: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for n, v in state.items() if n in names}


def batched_experts(model) -> list:
    """The batched experts modules under the PEFT wrappers (none for ModuleList experts)."""
    from autoep.detect.adapters import wrapper_chain

    found = [wrapper_chain(m.experts)[1] for n, m in model.named_modules() if n.endswith(".mlp")]
    return [e for e in found if not isinstance(e, torch.nn.ModuleList)]


def ep_model(family: str, order: str, trainable: str, world: int):
    from autoep import ExpertParallel

    model, plan = build(family), [{"match": _spec(family)[2], "local_compute_fn": "auto"}]
    if order == "apply_first":
        ep = ExpertParallel(model, {"ep_size": world, "plan": plan}, grad_convention="sum")
        return with_lora(model, family, trainable), ep
    peft_model = with_lora(model, family, trainable)
    return peft_model, ExpertParallel(peft_model, {"ep_size": world, "plan": plan}, grad_convention="sum")


def train_case(rank, world, family: str, order: str, trainable: str, level: str):
    from autoep.runtime.recipes.local_experts import expert_owners

    ref = with_lora(build(family), family, trainable)
    model, ep = ep_model(family, order, trainable, world)
    owners = expert_owners(model)  # module experts' parameters (LoRA's too): each rank holds its own
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    assert any(".lora_" in n for n in names) and sorted(names) == sorted(
        n for n, p in model.named_parameters() if p.requires_grad)
    opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=LR, momentum=MOMENTUM)
    opt = torch.optim.SGD(ep.param_groups(lr=LR, momentum=MOMENTUM))
    classes = [type(e) for e in batched_experts(model)]
    held = [id(p) for e in batched_experts(model) for p in e.parameters()]
    failed: list[str] = []  # compared as they come, raised at the end: the ranks' collectives stay in step

    def same(mine, theirs, what: str) -> None:
        try:
            torch.testing.assert_close(mine, theirs)
        except AssertionError as e:
            failed.append(f"{what}: {e}")

    for step in range(STEPS):
        slices = inputs(level, step, world)
        total = max(1, sum(x.shape[0] * (x.shape[1] - 1 if level == "model" else 1) for x in slices))
        for r, x in enumerate(slices):
            out = run(ref, level, x)
            loss = loss_of(level, out, x, total)
            if loss.requires_grad:  # a block on no tokens: its loop computes nothing, nothing to differentiate
                loss.backward()
            if r == rank:
                want, want_grad = out.detach(), x.grad if x.grad is not None else torch.zeros_like(x)
        x = slices[rank].detach().requires_grad_(level == "block")
        out = run(model, level, x)
        same(out, want, f"step {step} output")
        loss_of(level, out, x, total).backward()
        if level == "block":
            same(x.grad, want_grad, f"step {step} input grad")
        if step == 0:
            mine = dict(model.named_parameters())
            for name, p in ref.named_parameters():
                want = p.grad if p.grad is not None else torch.zeros_like(p)
                if not p.requires_grad or name in owners and not owners[name].local:
                    continue  # frozen, or another rank's module expert (it compares its own)
                if name in owners:  # this rank's module expert: every rank's tokens for it came here
                    same(mine[name].grad if mine[name].grad is not None else torch.zeros_like(want), want,
                         f"grad of {name}")
                else:
                    same(gathered(mine[name]), want, f"grad of {name}")
        ep.finish_gradients(dense_synced=False)
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        mine = weights(model)
        for name, p in ref.named_parameters():
            same(mine[name], p.detach(), f"step {step} {name}")
        experts = batched_experts(model)
        assert [type(e) for e in experts] == classes and not any("parametrizations" in e._modules for e in experts)
        assert [id(p) for e in experts for p in e.parameters()] == held
    assert not failed, "\n".join(failed[:6])
