"""Detection semantics (issue 2): each rule of the contract, on meta modules, without calling a forward."""
import inspect
import re

import blocks
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoep import MoeStructure, UnsupportedModuleStructure, detect_moe_structure, detect_router_kind
from autoep.errors import OPT_OUT_HINT


class SwiGLU(nn.Module):
    def __init__(self, d=8, f=16):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(SwiGLU):
    def forward(self, x):  # not a gated unit: the recipe would compute something else
        return self.down_proj(self.act_fn(self.up_proj(x)))


class Block(nn.Module):
    """A v4-style block whose forward the routing proof accepts (softmax -> topk -> renormalise)."""

    def __init__(self, expert=SwiGLU, gate=None, n=4, **attrs):
        super().__init__()
        self.gate = gate if gate is not None else nn.Linear(8, n, bias=False)
        self.experts = nn.ModuleList([expert() for _ in range(n)])
        for k, v in attrs.items():
            setattr(self, k, v)

    def forward(self, x):
        logits = self.gate(x)
        w = F.softmax(logits, dim=-1, dtype=torch.float)
        w, idx = torch.topk(w, self.top_k, dim=-1)
        w /= w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            tok, k = torch.where(idx == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, k, None])
        return out


class ExplodingRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 8))

    def forward(self, x):
        raise AssertionError("the detector called a forward")


class GoodRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 8))
        self.top_k = 2

    def forward(self, x):
        logits = F.linear(x, self.weight)
        scores, indices = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, scores, indices


class ScoresLastRouter(GoodRouter):
    def forward(self, x):
        logits = F.linear(x, self.weight)
        scores, indices = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, indices, scores  # last item is not the index half of topk


def refusal(module) -> str:
    with pytest.raises(UnsupportedModuleStructure) as info:
        detect_moe_structure(module)
    msg = str(info.value)
    assert type(module).__name__ in msg and msg.endswith(OPT_OUT_HINT)
    return msg


def test_no_gate_or_router_is_router_kind_other():
    m = Block(top_k=2)
    del m.gate
    assert detect_router_kind(m) == "other"  # vocabulary only: routing runs as the block writes it


def test_router_attribute_is_used_when_there_is_no_gate():
    m = Block(top_k=2)
    m.router = GoodRouter()
    del m.gate
    assert detect_router_kind(m) == "topk_router_module"


def test_bare_linear_gate_kind_is_read_from_data_flow():
    """top-k of a softmax of the gate's output is softmax_topk, of a sigmoid sigmoid_group, whatever the
    block's attributes say (the routing itself always runs as the block writes it)."""
    assert detect_router_kind(Block(top_k=2)) == "softmax_topk"
    assert detect_router_kind(Block(top_k=2, routed_scaling_factor=2.5, n_group=1)) == "softmax_topk"
    assert detect_router_kind(blocks.DeepseekV3StyleMoE()) == "sigmoid_group"

    class NoScores(Block):
        def forward(self, x):
            w, idx = torch.topk(self.gate(x), self.top_k, dim=-1)
            return x

    assert detect_router_kind(NoScores(top_k=2)) == "other"


def test_linear_subclass_is_not_a_bare_gate():
    class MyLinear(nn.Linear):
        pass

    m = Block(top_k=2, gate=MyLinear(8, 4, bias=False))
    assert detect_router_kind(m) == "softmax_topk"  # read from the block's data flow, not the gate's type


def test_router_module_proven_from_source_without_calling_it():
    assert detect_router_kind(Block(gate=ExplodingRouter())) == "softmax_topk"  # the block's softmax -> topk
    assert detect_router_kind(Block(gate=GoodRouter())) == "topk_router_module"
    assert detect_router_kind(Block(gate=ScoresLastRouter())) == "topk_router_module"  # indices in any position

    class ScoresOnly(GoodRouter):
        def forward(self, x):
            scores, indices = torch.topk(F.linear(x, self.weight).softmax(-1), self.top_k, dim=-1)
            return scores, scores

    assert detect_router_kind(Block(gate=ScoresOnly())) == "softmax_topk"


def test_experts_must_be_a_module_list_or_batched():
    m = Block(top_k=2)
    m.experts = nn.Linear(8, 8)
    assert "no 3-D nn.Parameters" in refusal(m)


def test_experts_that_are_not_swiglu_are_row_local_off_the_fast_path():
    s = detect_moe_structure(Block(expert=GeluMLP, top_k=2))
    assert (s.expert_kind, s.expert_projs, s.expert_act) == ("row_local", (), "")
    assert detect_moe_structure(Block(top_k=2)).expert_kind == "swiglu"


@pytest.mark.parametrize(
    "attrs, expected",
    [
        ({}, "none"),
        ({"shared_expert": SwiGLU(), "shared_expert_gate": nn.Linear(8, 1)}, "gated"),
        ({"shared_experts": SwiGLU()}, "additive"),
    ],
)
def test_shared_branch(attrs, expected):
    if expected == "gated":  # the block must also gate it with a sigmoid: use the real v4-style block
        m = blocks.Qwen2MoeStyleSparseMoeBlock()
    else:
        m = Block(top_k=2, **attrs)
    assert detect_moe_structure(m).shared_experts == expected


@pytest.mark.parametrize("attrs", [{"shared_expert_gate": nn.Linear(8, 1)},
                                   {"shared_expert": SwiGLU(), "shared_experts": SwiGLU()}])
def test_ambiguous_shared_branch_names_what_it_found(attrs):
    msg = refusal(Block(top_k=2, **attrs))
    assert "ambiguous shared branch" in msg and all(a in msg for a in attrs)


def test_jitter_is_the_jitter_noise_attribute():
    assert detect_moe_structure(Block(top_k=2)).jitter is False
    assert detect_moe_structure(Block(top_k=2, jitter_noise=0.0)).jitter is True


def test_unregistered_subclass_is_recognised_by_inherited_source():
    class SomethingElseEntirely(blocks.Qwen2MoeStyleSparseMoeBlock):
        pass

    assert detect_moe_structure(SomethingElseEntirely()) == detect_moe_structure(blocks.Qwen2MoeStyleSparseMoeBlock())


def test_v4_and_research_style_blocks():
    mix = detect_moe_structure(blocks.MixtralStyleSparseMoeBlock(jitter_noise=0.1))
    assert (mix.router, mix.shared_experts, mix.expert_storage, mix.jitter) == (
        "softmax_topk", "none", "module_list", True)
    assert (mix.expert_projs, mix.expert_act) == (("gate_proj", "up_proj", "down_proj"), "act_fn")
    qwen = detect_moe_structure(blocks.Qwen2MoeStyleSparseMoeBlock())
    assert qwen.shared_experts == "gated"
    ds = detect_moe_structure(blocks.DeepseekV3StyleMoE())
    assert (ds.router, ds.shared_experts) == ("sigmoid_group", "additive")
    titan = detect_moe_structure(blocks.MoE())
    assert (titan.expert_projs, titan.expert_act) == (("w1", "w3", "w2"), "silu")


def test_meta_modules_allocate_nothing_and_call_nothing(monkeypatch):
    with torch.device("meta"):
        m = blocks.Qwen2MoeStyleSparseMoeBlock()
    monkeypatch.setattr(nn.Module, "__call__", lambda *a, **k: pytest.fail("a module was called"))
    s = detect_moe_structure(m)
    assert isinstance(s, MoeStructure) and s.shared_experts == "gated"
    assert all(p.device.type == "meta" for p in m.parameters())


def test_expert_bias_on_module_list_is_row_local():
    m = Block(top_k=2)
    for e in m.experts:
        e.up_proj = nn.Linear(8, 16, bias=True)
    assert detect_moe_structure(m).expert_kind == "row_local"  # the fast path's stacked weights have no bias


def test_structure_is_hashable_and_round_trips():
    s = detect_moe_structure(blocks.MoE())
    assert (s.experts_path, s.expert_kind) == ("experts", "swiglu")
    assert MoeStructure(**s.as_dict()) == s and hash(s) == hash(MoeStructure(**s.as_dict()))


# --- v5-style batched experts: the experts' own forward and gate are what is proven -------------------


class Experts(nn.Module):
    """The transformers v5 eager loop, written out (experts contract: (hidden, top_k_index, top_k_weights))."""

    def __init__(self, n=4, d=8, f=16):
        super().__init__()
        self.num_experts = n
        self.gate_up_proj = nn.Parameter(torch.randn(n, 2 * f, d))
        self.down_proj = nn.Parameter(torch.randn(n, d, f))
        self.act_fn = nn.SiLU()

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            current = self._apply_gate(F.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx]))
            current = F.linear(current, self.down_proj[expert_idx]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, current.to(final.dtype))
        return final


class V5Block(nn.Module):
    def __init__(self, experts=None):
        super().__init__()
        self.gate = GoodRouter()
        self.experts = experts if experts is not None else Experts()

    def forward(self, hidden_states):
        _, weights, index = self.gate(hidden_states)
        return self.experts(hidden_states, index, weights)


class ClampedExperts(Experts):
    def _apply_gate(self, gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        return F.silu(gate.clamp(max=7.0)) * (up.clamp(min=-7.0, max=7.0) + 1)


class CrossRowGateExperts(Experts):
    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate - gate.mean(0)) * up  # mixes rows: EP runs it on other row sets


class WeightsFirstExperts(Experts):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            x = hidden_states[token_idx] * top_k_weights[token_idx, top_k_pos, None]
            current = F.linear(self._apply_gate(F.linear(x, self.gate_up_proj[expert_idx])), self.down_proj[expert_idx])
            final.index_add_(0, token_idx, current)
        return final


class ScaledExperts(Experts):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


def test_batched_experts_layout_facts():
    s = detect_moe_structure(V5Block())
    assert (s.router, s.expert_storage, s.gate_up_layout, s.activation, s.expert_bias, s.expert_transposed) == (
        "topk_router_module", "batched_parameters", "concatenated", "own_gate", False, False)
    s = detect_moe_structure(V5Block(ClampedExperts()))
    assert (s.gate_up_layout, s.activation) == ("interleaved", "clamped_glu")


def test_batched_experts_that_a_recipe_would_get_wrong_are_refused():
    assert "not proven row-local" in refusal(V5Block(CrossRowGateExperts()))
    assert "does not add expert output × routing weight" in refusal(V5Block(WeightsFirstExperts()))
    assert "parameters ['scale'] its forward does not use" in refusal(V5Block(ScaledExperts()))


def test_block_that_reads_expert_weights_directly_is_refused():
    class Peeking(V5Block):
        def forward(self, hidden_states):
            _, weights, index = self.gate(hidden_states)
            return self.experts(hidden_states, index, weights) + self.experts.down_proj.sum()

    assert "the experts contract is one call" in refusal(Peeking())


@pytest.fixture
def variant(tmp_path):
    """``variant(base, method, old, new)``: a subclass of ``base`` whose ``method`` differs by one edit,
    with its source on disk (the detector reads source, so an exec'd class would not do)."""
    import importlib.util
    import inspect
    import textwrap

    def make(base, method, old, new):
        src = textwrap.indent(textwrap.dedent(inspect.getsource(getattr(base, method))), "    ")
        assert old in src
        path = tmp_path / f"variant_{abs(hash((base, method, old, new)))}.py"
        path.write_text(f"from blocks import *\nfrom blocks import {base.__name__}\n\n\n"
                        f"class Variant({base.__name__}):\n{src.replace(old, new)}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.Variant

    return make


def test_the_unchanged_source_is_accepted_through_a_variant(variant):
    same = variant(blocks.MixtralStyleSparseMoeBlock, "forward", "sum(dim=-1, keepdim=True)",
                   "sum(dim=-1, keepdim=True)")
    assert detect_moe_structure(same()) == detect_moe_structure(blocks.MixtralStyleSparseMoeBlock())


RESHAPE = "final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)"

# Edits outside the expert loop: the block's own code runs, so each is accepted and exact.
OWN_CODE_EDITS = [
    (blocks.DeepseekV3StyleMoE, "~score_mask.bool(), 0.0", '~score_mask.bool(), float("-inf")'),
    (blocks.DeepseekV3StyleMoE, "router_logits.gather(1, topk_indices)", "router_logits_for_choice.gather(1, topk_indices)"),
    (blocks.DeepseekV3StyleMoE, " + 1e-20", ""),
    (blocks.MixtralStyleSparseMoeBlock, "sum(dim=-1, keepdim=True)", "sum(dim=-1, keepdim=True) + 1e-6"),
    (blocks.MixtralStyleSparseMoeBlock, "self.gate(hidden_states)", "self.gate(hidden_states / 0.7)"),
    (blocks.MixtralStyleSparseMoeBlock, RESHAPE, RESHAPE.replace("= final_hidden_states.", "= (final_hidden_states * 0.5).")),
    (blocks.MixtralStyleSparseMoeBlock, RESHAPE, "final_hidden_states.mul_(2.0)\n        " + RESHAPE),
    (blocks.Qwen2MoeStyleSparseMoeBlock, "final_hidden_states + shared_expert_output",
     "final_hidden_states + shared_expert_output + hidden_states"),
    (blocks.DeepseekV3StyleMoE, "return final_hidden_states.type(hidden_states.dtype)",
     "return torch.tanh(final_hidden_states).type(hidden_states.dtype)"),
]

# Edits inside the expert loop: the region autoep replaces; each is refused, naming the construct.
LOOP_EDITS = [
    (blocks.MixtralStyleSparseMoeBlock, "routing_weights[top_x, idx, None]", "routing_weights[top_x, idx, None] * 2.0",
     "is not expert output × routing weight"),
    (blocks.MixtralStyleSparseMoeBlock, "index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))",
     "index_add_(0, top_x, current_hidden_states.to(torch.bfloat16))", "is a cast the proof does not know"),
    (blocks.MixtralStyleSparseMoeBlock, "for expert_idx in expert_hit:", "for expert_idx in expert_hit[1:]:",
     "`expert_hit[1:]` is not understood"),
    (blocks.MoE, "if token_idx.numel() == 0:", "if token_idx.numel() < 2:", "`token_idx.numel() < 2` is not understood"),
    (blocks.DeepseekV3StyleMoE, "final_hidden_states.index_add_(0, token_indices, weighted_output)",
     "final_hidden_states.index_add_(0, token_indices, weighted_output, alpha=0.5)", "no alpha"),
    (blocks.DeepseekV3StyleMoE, "range(len(self.experts))", "range(len(self.experts) - 1)", "does not range over all 8 experts"),
    (blocks.DeepseekV3StyleMoE, "range(len(self.experts))", "range(self.config.n_routed_experts - 1)",
     "does not range over all 8 experts"),
]


def _variant_of(variant, block, old, new):
    methods = ("forward", "route_tokens_to_experts", "moe")
    method = next(m for m in methods if callable(getattr(block, m, None)) and old in inspect.getsource(getattr(block, m)))
    return variant(block, method, old, new)


@pytest.mark.parametrize("block, old, new", OWN_CODE_EDITS)
def test_an_edit_outside_the_expert_loop_runs_as_written(variant, block, old, new):
    from autoep.runtime.recipes.module_list import ep_module_list_block

    cls = _variant_of(variant, block, old, new)
    torch.manual_seed(0)
    ref = cls().train()
    ep = __import__("copy").deepcopy(ref)
    ep_module_list_block(ep, ep_mesh=None, structure=detect_moe_structure(ref))
    x = torch.randn(2, 3, 16, requires_grad=True)
    outs = [m(x) for m in (ref, ep)]
    outs = [o[0] if isinstance(o, tuple) else o for o in outs]
    torch.testing.assert_close(outs[1], outs[0])
    gx = [torch.autograd.grad(o.square().sum(), x)[0] for o in outs]
    torch.testing.assert_close(gx[1], gx[0])


def _replay_parity(cls) -> None:
    """``cls`` is detected for record/exchange/replay and computes exactly its own forward that way (one
    process: the recipe's record, placement and replay without a peer); gradients compared directly."""
    from autoep.runtime.recipes.replay import ep_replay_block

    torch.manual_seed(0)
    ref = cls().train()
    found = detect_moe_structure(ref, replay=True)
    assert found.execution == "replay", found
    ep = __import__("copy").deepcopy(ref)
    ep_replay_block(ep, ep_mesh=None, structure=found)
    x = torch.randn(2, 3, 16)
    try:
        ref(x)
    except RuntimeError as exc:  # the edit breaks the model itself: it raises the same way under EP
        with pytest.raises(RuntimeError, match=re.escape(str(exc))):
            ep(x)
        return
    runs = []
    for m in (ref, ep):
        xi = x.clone().requires_grad_()
        out = m(xi)
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
        runs.append((out.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(runs[1][0], runs[0][0])
    torch.testing.assert_close(runs[1][1], runs[0][1])
    for n, g in runs[0][2].items():
        assert (g is None) == (runs[1][2][n] is None), n
        if g is not None:
            torch.testing.assert_close(runs[1][2][n], g, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("block, old, new, message", LOOP_EDITS)
def test_an_edit_inside_the_expert_loop_runs_by_replay(variant, block, old, new, message):
    """The loop's fast-path proof refuses the edit, naming the construct; the block then runs by record /
    exchange / replay (its own code, twice), exactly."""
    from autoep.detect import structure
    from autoep.detect.source import Refusal

    cls = _variant_of(variant, block, old, new)
    with pytest.raises(Refusal) as info:
        structure._structure(cls())
    assert message in str(info.value)
    _replay_parity(cls)


class Float32Experts(Experts):
    """Every operand of the expert upcast to float32 (OpenAI-privacy-filter style): accepted, computed in fp32."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states, dtype=torch.float32)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            current = self._apply_gate(F.linear(hidden_states[token_idx].float(), self.gate_up_proj[expert_idx].float()))
            current = F.linear(current, self.down_proj[expert_idx].float()) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, current.to(final.dtype))
        return final.to(hidden_states.dtype)


class HalfUpcastExperts(Float32Experts):
    """Only the weights upcast: in bf16 the original would fail; the recipe would compute another thing."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            current = self._apply_gate(F.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx].float()))
            current = F.linear(current, self.down_proj[expert_idx]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, current)
        return final


def test_float32_experts_are_all_or_nothing():
    assert detect_moe_structure(V5Block(Float32Experts())).expert_dtype == "float32"
    assert detect_moe_structure(V5Block()).expert_dtype == "param"
    assert "upcasts some operands to float32" in refusal(V5Block(HalfUpcastExperts()))


@pytest.mark.parametrize("block,facts", [
    (blocks.TitanMoE, dict(expert_transposed=False, gate_up_layout="separate", expert_projs=("w1", "w3", "w2"))),
    (blocks.TitanPaddedMoE, dict(expert_transposed=False, gate_up_layout="separate", expert_projs=("w1", "w3", "w2"))),
    (blocks.TuneMoE, dict(expert_transposed=True, gate_up_layout="separate",
                          expert_projs=("gate_proj", "up_proj", "down_proj"))),
    (blocks.AriaStyleMoELayer, dict(expert_transposed=True, gate_up_layout="concatenated",
                                    expert_projs=("fc1.weight", "fc2.weight"))),
])
def test_grouped_experts_are_proven_with_their_layout(block, facts):
    """experts(x_sorted, num_tokens_per_expert): torchtitan (split loop, (E, out, in) weights transposed in
    the loop; padded: a module-level helper splitting x[:sum(counts)], zeros stacked after), torchtune
    (x @ w[e], an activation function held on the module), Aria (nested grouped-GEMM modules over a
    module-level offset loop, one fused weight chunked [gate | up])."""
    s = detect_moe_structure(block())
    assert (s.expert_storage, s.activation, s.expert_act) == ("grouped", "glu", "silu")
    assert {k: getattr(s, k) for k in facts} == facts


def test_dense_scaled_experts_run_by_replay():
    """Llama-4's way (every expert on every token, inputs pre-scaled by dense router scores): no routed rows
    for a fast path to send, so record / exchange / replay sends every token to every expert, exactly (the
    scores get their gradient through the recorded rows)."""
    _replay_parity(blocks.DenseScaledMoE)


class _Halves(nn.Module):
    """Experts applied in two halves around the block's own work (JetMoE's mixture of attention): their forward
    raises, the block calls ``map`` and ``reduce``."""

    def __init__(self, e=4, d=8):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(e, d, d))
        self.w_out = nn.Parameter(torch.randn(e, d, d))

    def map(self, x, idx):
        return torch.einsum("td,tdf->tf", x, self.w_in[idx])

    def reduce(self, h, idx):
        return torch.einsum("td,tdf->tf", h, self.w_out[idx])

    def forward(self, x):
        raise NotImplementedError("call map and reduce")


class HalvesBlock(nn.Module):
    def __init__(self, e=4, d=8):
        super().__init__()
        self.gate = nn.Linear(d, e, bias=False)
        self.experts = _Halves(e, d)

    def forward(self, x):
        idx = self.gate(x).argmax(-1)
        h = torch.tanh(self.experts.map(x, idx))
        return self.experts.reduce(h, idx)


def test_experts_whose_forward_raises_are_refused_naming_the_methods_called_instead():
    with pytest.raises(UnsupportedModuleStructure, match=r"experts \(_Halves\) cannot be called: its forward raises.*"
                                                         r"self\.experts\.map, self\.experts\.reduce"):
        detect_moe_structure(HalvesBlock())


def test_jetmoe_attention_experts_are_refused_naming_map_and_reduce():
    transformers = pytest.importorskip("transformers")
    from transformers.models.jetmoe.modeling_jetmoe import JetMoeAttention

    cfg = transformers.JetMoeConfig(hidden_size=32, num_local_experts=4, num_experts_per_tok=2, kv_channels=8,
                                    num_key_value_heads=2, intermediate_size=16, num_hidden_layers=1)
    with torch.device("meta"):
        block = JetMoeAttention(cfg, 0)
    with pytest.raises(UnsupportedModuleStructure, match=r"JetMoeMoA\) cannot be called.*self\.experts\.map, "
                                                         r"self\.experts\.reduce"):
        detect_moe_structure(block)


def test_ergo_experts_refusal_names_the_inherited_loop_and_the_work_around_it():
    """Ergo's experts call their parent's loop (``super().forward``) and then a per-expert norm indexed by expert id:
    refused, the reason says what the forward holds instead of one loop."""
    transformers = pytest.importorskip("transformers")
    ergo = pytest.importorskip("transformers.models.ergo.modeling_ergo")
    from autoep.tools.tiny import build_block

    block, _ = build_block(ergo.ErgoMoE, [transformers.ErgoConfig])
    with pytest.raises(UnsupportedModuleStructure, match=r"ErgoExperts\.forward is not one loop over experts: no `for` "
                                                         r"statement; it calls `super\(\)\.forward\(\.\.\.\)`"):
        detect_moe_structure(block)
