"""Batched experts with flattened ``(E*F, D)`` weights on a submodule (DBRX, ``autoep.detect.flat_experts``), in
the installed transformers (5.x: ``experts(hidden, top_k_index, top_k_weights)``, views per hit expert;
4.57: ``experts(x, weights, top_weights, top_experts)``, per-expert chunks over ``range(E)``): what is
proven, what is refused, and that an accepted edit is exact.

Edits are made to the real ``DbrxExperts.forward`` / ``DbrxExpertGLU.forward`` source (a subclass whose
source is on disk, so the detector reads it) and the block re-classed in place.
"""
import copy
import importlib.util
import inspect
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
V5 = int(transformers.__version__.split(".")[0]) >= 5
only_v5 = pytest.mark.skipif(not V5, reason="transformers 5.x DBRX source")
only_v4 = pytest.mark.skipif(V5, reason="transformers 4.x DBRX source")

from transformers.models.dbrx import modeling_dbrx  # noqa: E402

from autoep.detect.structure import count_experts, detect_moe_structure  # noqa: E402
from autoep.errors import PlanError, UnsupportedModuleStructure  # noqa: E402
from autoep.plan.archetypes import compute_fn_config  # noqa: E402
from autoep.targets import import_object  # noqa: E402

D, F, E = 32, 16, 4  # F != D: a transposed weight or a swapped view cannot pass on shapes alone


def dbrx_block() -> torch.nn.Module:
    config = modeling_dbrx.DbrxConfig(d_model=D, n_heads=4, ffn_config={"ffn_hidden_size": F, "moe_num_experts": E,
                                                                        "moe_top_k": 2})
    torch.manual_seed(0)
    block = modeling_dbrx.DbrxFFN(config)  # 5.x and 4.x alike read their sizes from config.ffn_config
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return block.train()


@pytest.fixture
def edited(tmp_path):
    """``edited(cls, old, new)``: a subclass of ``cls`` whose forward differs by one edit, source on disk."""

    def make(cls, old, new):
        src = textwrap.indent(textwrap.dedent(inspect.getsource(cls.forward)), "    ")
        assert old in src, old
        path = tmp_path / f"edited_{abs(hash((cls, old, new)))}.py"
        path.write_text("from transformers.models.dbrx import modeling_dbrx as _m\nglobals().update(vars(_m))\n\n\n"
                        f"class {cls.__name__}(_m.{cls.__name__}):\n{src.replace(old, new)}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return getattr(mod, cls.__name__)

    return make


def with_edit(edited, where: str, old: str, new: str) -> torch.nn.Module:
    block = dbrx_block()
    obj = block.experts if where == "experts" else block.experts.mlp
    obj.__class__ = edited(type(obj), old, new)
    return block


def assert_exact(block: torch.nn.Module) -> None:
    """The recipe the table names (no exchange) equals the block's own forward, outputs and every grad."""
    structure = detect_moe_structure(block)
    cfg = dict(compute_fn_config(structure))
    ep = copy.deepcopy(block)
    import_object(cfg.pop("_factory_"))(ep, ep_mesh=None, **cfg)
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1))
    runs = []
    for m in (block, ep):
        xi = x.clone().requires_grad_()
        outs = m(xi)
        outs = outs if isinstance(outs, tuple) else (outs,)  # 4.x: (output, router softmax)
        sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in outs).backward()
        runs.append(([o.detach() for o in outs], xi.grad, {n: p.grad for n, p in m.named_parameters()}))
    (ref_out, ref_gx, ref_g), (out, gx, g) = runs
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(gx, ref_gx)
    for name in ref_g:
        torch.testing.assert_close(g[name], ref_g[name], msg=lambda m, n=name: f"{n}: {m}")


def refusal(block) -> str:
    with pytest.raises(UnsupportedModuleStructure) as info:
        detect_moe_structure(block)
    return info.value.reason


def test_dbrx_is_proven_with_its_flattened_layout():
    block = dbrx_block()
    s = detect_moe_structure(block)
    assert (s.expert_storage, s.gate_up_layout, s.expert_transposed, s.expert_bias) == (
        "batched_parameters", "separate", False, False)
    assert (s.expert_projs, s.expert_act) == (("mlp.w1", "mlp.v1", "mlp.w2"), "mlp.activation_fn")
    assert count_experts(block) == E
    assert_exact(block)


def test_the_flattened_hidden_states_and_the_output_view_are_the_forwards_own():
    from autoep.detect.experts_proof import batched_proof

    roles = batched_proof(dbrx_block().experts)[1]
    # 5.x: reshape(-1, self.hidden_size), next_states.view(batch_size, -1, self.hidden_size);
    # 4.x: b, s, h = x.shape, x.view(-1, h), out.reshape(b, s, h)
    assert (roles.rows, roles.unpacked, roles.view_out) == ((D, 0, "lead") if V5 else (-1, 3, "shape"))
    assert (roles.flat.rows_per_expert, roles.flat.hidden, roles.flat.num_experts) == (F, D, E)


EXPERTS_CALL = "self.mlp(hidden_states[token_idx], w1, v1, w2)"
GLU_GATE = "gate_proj = self.activation_fn(gate_proj)"

# Edits the recipe follows as proven (the roles come from the proof, not from the names): exact.
EXACT = [
    ("experts", EXPERTS_CALL, "self.mlp(hidden_states[token_idx], v1, w1, w2)"),  # gate and up swapped
    ("glu", "intermediate_states = gate_proj * up_proj", "intermediate_states = up_proj * gate_proj"),
    # Half-size experts: the view makes 2E experts of F/2 rows; ids below E pick the same rows either way.
    ("experts", "split_expert_shape = (-1, self.ffn_hidden_size, self.hidden_size)",
     "split_expert_shape = (-1, 8, self.hidden_size)"),
    ("experts", "next_states = next_states.view(batch_size, -1, self.hidden_size)\n", "\n"),  # returns rows
]

# Edits the recipe would get wrong: refused, naming the construct.
W1_VIEW = "self.mlp.w1.view(split_expert_shape)[expert_idx]"
OUT_VIEW = "next_states.view(batch_size, -1, self.hidden_size)"
REFUSED = [
    ("experts", W1_VIEW, W1_VIEW.replace("[expert_idx]", "[expert_idx + 1]"), "is not understood"),
    ("experts", W1_VIEW, W1_VIEW.replace("[expert_idx]", "[0]"), "does not index the viewed weight by the loop's"),
    ("experts", "self.mlp.w2.view(split_expert_shape)[expert_idx]",
     "self.mlp.w2.view(-1, self.hidden_size, self.ffn_hidden_size)[expert_idx]", "not all viewed (-1, F, D) alike"),
    ("experts", "self.mlp.v1.view(split_expert_shape)[expert_idx]", "self.mlp.v1[expert_idx]",
     "indexes a flat weight without viewing it per expert"),
    ("experts", "hidden_states = hidden_states.reshape(-1, self.hidden_size)", "hidden_states = hidden_states",
     "rows it did not flatten"),
    ("experts", "hidden_states.reshape(-1, self.hidden_size)", "hidden_states.reshape(-1, self.ffn_hidden_size)",
     "views its output by another tensor's leading size"),
    ("experts", OUT_VIEW, OUT_VIEW.replace("self.hidden_size", "self.ffn_hidden_size"),
     "views its output by another tensor's leading size"),
    ("experts", "* top_k_weights[token_idx", "* 2.0 * top_k_weights[token_idx", "is not expert output × routing"),
    ("experts", OUT_VIEW, OUT_VIEW.replace("batch_size, -1", "-1, batch_size"),
     "is not acc.view(hidden_states.shape[0], -1, hidden size)"),
    ("glu", "intermediate_states.matmul(expert_w2)", "intermediate_states.matmul(expert_w2.T)",
     "reshapes rows that are not an expert's output"),
    ("glu", "x.matmul(expert_w1.T)", "x.matmul(expert_w1.T) * 2.0", "is not expert output × routing weight"),
    ("glu", "intermediate_states.matmul(expert_w2)", "intermediate_states.matmul(expert_w2) * 0.5", "is not expert"),
    ("glu", GLU_GATE, "gate_proj = torch.softmax(gate_proj, dim=-1)", "which the proof does not know"),
    ("glu", "x.matmul(expert_v1.T)", "x.matmul(self.v1.view(-1, 16, 32)[0].T)", "reads a weight of the submodule"),
]


@only_v5
@pytest.mark.parametrize("where, old, new", EXACT)
def test_an_edit_the_proof_follows_is_exact(edited, where, old, new):
    assert_exact(with_edit(edited, where, old, new))


@only_v5
@pytest.mark.parametrize("where, old, new, message", REFUSED)
def test_an_edit_the_recipe_would_get_wrong_is_refused(edited, where, old, new, message):
    block = with_edit(edited, where, old, new)
    assert message in refusal(block)


V4_CALL = "self.mlp(expert_tokens, w1_chunked[expert_idx], v1_chunked[expert_idx], w2_chunked[expert_idx])"
V4_RANGE = "range(0, self.moe_num_experts)"
V4_CHUNK_W1 = "w1_chunked = [w1.squeeze(dim=0) for w1 in w1_chunked]"

V4_EXACT = [
    ("experts", V4_CALL, V4_CALL.replace("w1_chunked[expert_idx], v1_chunked", "v1_chunked[expert_idx], w1_chunked")),
    ("experts", V4_RANGE, "range(self.moe_num_experts)"),
    ("experts", "out = out.reshape(bsz, q_len, hidden_size)\n", "\n"),  # returns rows
]

V4_REFUSED = [
    ("experts", V4_RANGE, "range(1, self.moe_num_experts)", "does not range over all the experts"),
    ("experts", V4_RANGE, "range(0, self.moe_num_experts - 1)", "does not range over all the experts"),
    ("experts", V4_CALL, V4_CALL.replace("w2_chunked[expert_idx]", "w2_chunked[0]"), "by the loop's expert id"),
    ("experts", V4_CHUNK_W1, "w1_chunked = [w1.squeeze(dim=0) * 2.0 for w1 in w1_chunked]", "is not expert output"),
    ("experts", V4_CHUNK_W1, "w1_chunked = [w1.squeeze(dim=0) for w1 in w1_chunked if True]", "is not understood"),
    ("experts", V4_CHUNK_W1, V4_CHUNK_W1.replace("in w1_chunked", "in w1_chunked[::-1]"), "without viewing it"),
    ("experts", "out = out.reshape(bsz, q_len, hidden_size)", "out = out.reshape(q_len, bsz, hidden_size)",
     "is not acc.view(hidden_states.shape[0], -1, hidden size) or acc.reshape(b, s, h)"),
    ("experts", "x = x.view(-1, hidden_size)", "x = x.view(-1, q_len)", "is not a reshape of the hidden states"),
    ("glu", "x.matmul(expert_w1.t())", "x.matmul(expert_w1.t()) * 2.0", "is not expert output × routing weight"),
    ("glu", "matmul(expert_w2)", "matmul(expert_w2.t())", "not h @ down[e] last"),
]


@only_v4
@pytest.mark.parametrize("where, old, new", V4_EXACT)
def test_a_v4_edit_the_proof_follows_is_exact(edited, where, old, new):
    assert_exact(with_edit(edited, where, old, new))


@only_v4
@pytest.mark.parametrize("where, old, new, message", V4_REFUSED)
def test_a_v4_edit_the_recipe_would_get_wrong_is_refused(edited, where, old, new, message):
    assert message in refusal(with_edit(edited, where, old, new))


@only_v4
def test_a_v4_transposed_gate_is_refused_where_the_shapes_would_let_it_run(edited):
    """F == D: ``x @ w1[e]`` runs, and computes something else than ``x @ w1[e].T``."""
    config = modeling_dbrx.DbrxConfig(d_model=16, n_heads=4, ffn_config={"ffn_hidden_size": 16, "moe_num_experts": E,
                                                                         "moe_top_k": 2})
    block = modeling_dbrx.DbrxFFN(config)
    block.experts.mlp.__class__ = edited(modeling_dbrx.DbrxExpertGLU, "x.matmul(expert_w1.t())", "x.matmul(expert_w1)")
    block(torch.randn(1, 3, 16))  # its own forward runs
    assert "the gate is not act(gate) * up" in refusal(block) or "not x @ w[e].T" in refusal(block)


def test_runtime_state_of_the_submodule_is_part_of_the_proof():
    block = dbrx_block()
    block.experts.mlp.register_forward_hook(lambda m, a, out: out * 2)
    assert "forward_hooks" in refusal(block)
    block = dbrx_block()
    block.experts.mlp.w2.requires_grad_(False)
    assert "frozen" in refusal(block)
    block = dbrx_block()
    block.experts.mlp.activation_fn = torch.nn.Softmax(dim=-1)
    why = refusal(block)  # a module that is no known activation is read as a submodule on the rows: refused
    assert any(s in why for s in ("not a known element-wise activation", "the proof does not follow",
                                  "apply a submodule to their rows are not followed")), why


def test_ep_size_must_divide_the_experts_not_only_the_rows():
    from autoep.runtime.recipes.batched import ep_batched_experts

    class Mesh:  # only the size is read before the check
        def size(self):
            return 3

    block = dbrx_block()
    with pytest.raises(PlanError, match="ep_size=3 does not divide num_experts=4"):
        ep_batched_experts(block, ep_mesh=Mesh(), structure=detect_moe_structure(block))


# ---------------------------------------------------------------- checkpoints in the model's own layout

DBRX_CONFIG = dict(d_model=D, n_heads=4, n_layers=2, vocab_size=128,
                   attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},  # autoep.tools.tiny: DBRX needs both
                   ffn_config={"ffn_hidden_size": F, "moe_num_experts": E, "moe_top_k": 2})
IDS = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(3))


def pretrained_worker(rank: int, world_size: int, path: str) -> dict:
    from hydra import compose, initialize_config_dir
    from torch.distributed.device_mesh import init_device_mesh

    from autoep.train.config import CONF_DIR
    from autoep.train.trainer import build_model

    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["model=hf_pretrained", f"model.pretrained_path={path}", "parallel.ep_size=2",
                                          "parallel.plan.0.match=transformer.blocks.*.ffn"])
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("edp", "ep"))
    model, _ = build_model(cfg, mesh, torch.device("cpu"))
    w1 = model.transformer.blocks[1].ffn.experts.mlp.w1
    with torch.no_grad():
        return {"logits": model.eval()(input_ids=IDS).logits, "w1": w1.to_local().clone(), "shape": tuple(w1.shape)}


@only_v5
def test_a_dbrx_checkpoint_loads_each_rank_its_whole_experts_and_computes_what_from_pretrained_does(tmp_path):
    from distributed import spawn
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    modeling_dbrx.DbrxForCausalLM(modeling_dbrx.DbrxConfig(**DBRX_CONFIG)).save_pretrained(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = ref(input_ids=IDS).logits
    full_w1 = ref.transformer.blocks[1].ffn.experts.mlp.w1.detach()
    for rank, out in enumerate(spawn(2, "test_flat_experts:pretrained_worker", str(tmp_path))):
        torch.testing.assert_close(out["logits"], expected)
        assert out["shape"] == (E * F, D)  # the model's own (E*F, D) layout, sharded on its flat dim
        rows = slice(rank * E * F // 2, (rank + 1) * E * F // 2)  # experts [rank*E/2, (rank+1)*E/2), F rows each
        torch.testing.assert_close(out["w1"], full_w1[rows])
