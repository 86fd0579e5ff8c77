"""loop.py: the training loss, with and without the model's own load-balancing loss."""
import pytest
import torch
import torch.nn.functional as F

from autoep.train.loop import causal_lm_loss, warmup_cosine
from autoep.train.models import build_hf_causal_lm


def tiny_qwen3():
    torch.manual_seed(0)
    return build_hf_causal_lm(config_class="transformers.Qwen3MoeConfig", vocab_size=64, hidden_size=32,
                              intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2)


def test_aux_loss_is_added_when_asked_for():
    model = tiny_qwen3()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    plain = causal_lm_loss(model, ids)
    out = model(input_ids=ids, use_cache=False, output_router_logits=True)
    ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    torch.testing.assert_close(plain, ce)
    with_aux = causal_lm_loss(model, ids, aux_loss_coef=0.5)
    torch.testing.assert_close(with_aux, ce + 0.5 * out.aux_loss)
    assert out.aux_loss.item() > 0
    with_aux.backward()
    router = model.model.layers[0].mlp.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0


def test_aux_loss_on_a_model_without_one_is_an_error():
    class NoAux(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 8)

        def forward(self, input_ids, use_cache=False, **kwargs):
            return self.emb(input_ids)

    with pytest.raises(ValueError, match=r"optim.aux_loss_coef=0.1 but NoAux returns no aux_loss.*set optim.aux_loss_coef=0"):
        causal_lm_loss(NoAux(), torch.zeros(1, 4, dtype=torch.long), aux_loss_coef=0.1)


def test_warmup_then_cosine_to_the_floor():
    lr = [warmup_cosine(s, warmup_steps=4, total_steps=20, min_lr_ratio=0.1) for s in range(21)]
    assert lr[0] == pytest.approx(0.25) and lr[3] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lr[4:], lr[5:])) and lr[20] == pytest.approx(0.1)
