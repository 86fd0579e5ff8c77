"""The expert property (issue 16): experts are accepted when row-local, deterministic and stateless
(``autoep.detect.row_local``), found by data flow under any attribute name, and refused naming the property
that failed and the model's line. Detection only (meta-free tiny modules, no forward called); parity of the
accepted blocks is ``tests/runtime/test_row_local_parity.py``."""
import linecache

import blocks
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoep import UnsupportedModuleStructure, detect_moe_structure
from autoep.detect import replay_proof, row_local
from autoep.detect.source import Refusal
from autoep.detect.structure import count_experts, find_experts, has_experts

D, FF = 16, 32

ACCEPTED = {  # name: (build, experts_path, folded entries that must be recorded)
    "fairseq_gelu": (lambda: blocks.FairseqStyleMoE(activation_fn="gelu"), "local_experts",
                     {"local_experts.*.activation_fn=torch._C._nn.gelu"}),
    "fairseq_relu": (lambda: blocks.FairseqStyleMoE(activation_fn="relu"), "local_experts",
                     {"local_experts.*.activation_fn=torch.nn.functional.relu"}),
    "sequential": (lambda: blocks.SequentialExpertsMoE(), "ffn_experts", set()),
    "optional_args": (lambda: blocks.ExpertListMoE([blocks.OptionalArgsExpert(D, FF) for _ in range(4)]),
                      "experts_list", set()),
    "config_branch": (lambda: blocks.ExpertListMoE([blocks.ConfigBranchExpert(blocks.BranchExpertConfig())
                                                    for _ in range(4)]), "experts_list",
                      {"experts_list.*.glu=1", "experts_list.*.config.mlp_type='gelu'"}),
    "config_branch_glu": (lambda: blocks.ExpertListMoE(
        [blocks.ConfigBranchExpert(blocks.BranchExpertConfig(glu_multiplier=2)) for _ in range(4)]),
        "experts_list", {"experts_list.*.glu=2"}),
    "module_dict": (lambda: blocks.ModuleDictExpertsMoE(), "experts", set()),
    "lora": (lambda: blocks.LoRAExpertsMoE(), "experts", {"experts.*.w1.alpha=4.0", "experts.*.w2.disabled=False"}),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_third_party_idioms_are_row_local_experts_found_by_data_flow(name):
    build, path, folded = ACCEPTED[name]
    block = build()
    s = detect_moe_structure(block)
    assert (s.expert_storage, s.experts_path, s.expert_kind) == ("module_list", path, "row_local")
    assert (s.expert_projs, s.expert_act, s.identity_experts) == ((), "", 0)
    assert folded <= set(s.folded), s.folded
    assert count_experts(block, s) == count_experts(block) == 4 and has_experts(block)


def test_the_swiglu_shape_keeps_the_fast_path():
    s = detect_moe_structure(blocks.MoE())
    assert (s.expert_kind, s.expert_projs, s.folded) == ("swiglu", ("w1", "w3", "w2"), ())


def test_experts_are_the_container_the_loop_indexes_not_a_name():
    block = blocks.SequentialExpertsMoE()
    block.norms = nn.ModuleList([nn.LayerNorm(D)])  # a second container nobody indexes by expert id
    block.experts = nn.Linear(D, D)  # a decoy under the old name
    assert find_experts(block) == "ffn_experts"
    assert detect_moe_structure(block).experts_path == "ffn_experts"


class TwoListsMoE(blocks.SequentialExpertsMoE):
    def __init__(self):
        super().__init__()
        self.other = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])

    def forward(self, hidden_states):
        b, s, d = hidden_states.shape
        x = hidden_states.view(-1, d)
        top_w, top_i = torch.topk(F.softmax(self.gate(x), dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(len(self.ffn_experts)):
            tok, k = torch.where(top_i == e)
            out.index_add_(0, tok, self.ffn_experts[e](x[tok]) * top_w[tok, k, None])
        for e in range(len(self.other)):
            tok, k = torch.where(top_i == e)
            out.index_add_(0, tok, self.other[e](x[tok]) * top_w[tok, k, None])
        return out.view(b, s, d)


def test_two_containers_indexed_in_loops_are_ambiguous():
    with pytest.raises(UnsupportedModuleStructure, match=r"several module containers by index \(\['ffn_experts', "
                                                         r"'other'\]"):
        detect_moe_structure(TwoListsMoE())


def test_dense_modules_have_no_experts():
    mlp = blocks.FeedForward(D, FF)
    assert not has_experts(mlp) and find_experts(mlp) is None
    assert has_experts(blocks.FairseqStyleMoE())


# --- the property: each way of breaking it is refused naming it and the model's line -----------------------


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, FF)
        self.fc2 = nn.Linear(FF, D)
        self.register_buffer("calls", torch.zeros(()))


class MeanOverRows(Expert):
    def forward(self, x):
        h = F.gelu(self.fc1(x))
        return self.fc2(h - h.mean(0))


class CumsumOverRows(Expert):
    def forward(self, x):
        return self.fc2(torch.cumsum(self.fc1(x), dim=0))


class SortRows(Expert):
    def forward(self, x):
        return self.fc2(self.fc1(x).sort(dim=0).values)


class Noisy(Expert):
    def forward(self, x):
        return self.fc2(self.fc1(x) + 0.1 * torch.randn_like(x[..., :1]))


class Counting(Expert):
    def forward(self, x):
        self.calls += 1
        return self.fc2(self.fc1(x))


class BufferAdd(Expert):
    def forward(self, x):
        self.calls.add_(1)
        return self.fc2(self.fc1(x))


class EditsInput(Expert):
    def forward(self, x):
        x.mul_(2.0)
        return self.fc2(self.fc1(x))


class RowCount(Expert):
    def forward(self, x):
        return self.fc2(self.fc1(x)) / x.shape[0]


class RowBranch(Expert):
    def forward(self, x):
        if x.norm(dim=-1, keepdim=True) > 1:
            return self.fc2(self.fc1(x))
        return x


class BatchNormed(Expert):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(FF)

    def forward(self, x):
        return self.fc2(self.bn(self.fc1(x)))


class Dropping(Expert):
    def __init__(self, p=0.1):
        super().__init__()
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.fc1(x))))


class FunctionalDropout(Expert):
    def forward(self, x):
        return self.fc2(F.dropout(self.fc1(x), p=0.1, training=self.training))


class LastDimNorm(Expert):
    """Written-out RMS norm over the last dim, a softmax over the features, a branch on a constant."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(FF))
        self.eps, self.use_softmax = 1e-6, False

    def forward(self, x, mask=None):
        h = self.fc1(x).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        if self.use_softmax:
            h = h.softmax(dim=0)
        if mask is not None:
            h = h * mask
        return self.fc2(h.to(x.dtype))


REFUSED = {  # expert class: (text that must be in the refusal)
    MeanOverRows: "MeanOverRows.forward line 3: `h.mean(0)` works along dim 0: mixes rows (not row-local",
    CumsumOverRows: "CumsumOverRows.forward line 2: `torch.cumsum(self.fc1(x), dim=0)` works along dim 0: mixes rows",
    SortRows: "SortRows.forward line 2: `self.fc1(x).sort(dim=0)` works along dim 0: mixes rows",
    Noisy: "Noisy.forward line 2: `torch.randn_like(x[..., :1])` draws random numbers (not deterministic)",
    Counting: "Counting.forward line 2: `self.calls += 1` updates an attribute: it writes module state (not stateless)",
    BufferAdd: "BufferAdd.forward line 2: `self.calls.add_(1)` updates a parameter or buffer in place",
    EditsInput: "EditsInput.forward line 2: `x.mul_(2.0)` edits the expert's input in place (not stateless)",
    RowCount: "RowCount.forward line 2: `x.shape[0]` reads the number of rows (not row-local",
    RowBranch: "RowBranch.forward line 2: `if x.norm(dim=-1, keepdim=True) > 1:` branches on row values",
    BatchNormed: "experts_list[0].bn (BatchNorm1d): BatchNorm1d uses batch statistics",
    Dropping: "experts_list[0].drop (Dropout) is dropout with p=0.1 while training: it draws random numbers",
    FunctionalDropout: "is dropout with p=0.1 while training: it draws random numbers (not deterministic)",
}


@pytest.mark.parametrize("cls", list(REFUSED), ids=lambda c: c.__name__)
def test_breaking_the_property_is_refused_naming_it_and_the_line(cls):
    block = blocks.ExpertListMoE([cls() for _ in range(4)])
    with pytest.raises(UnsupportedModuleStructure) as info:
        detect_moe_structure(block)
    assert REFUSED[cls] in str(info.value)
    if cls is not Dropping:  # the same expert, not in a MoE: the proof alone says the same
        with pytest.raises(Refusal, match=None):
            row_local.prove_expert(cls(), "experts[0]")


def test_dropout_in_eval_or_at_zero_is_accepted_and_its_probability_and_mode_are_recorded():
    assert detect_moe_structure(blocks.ExpertListMoE([Dropping(0.0) for _ in range(4)])).folded == \
        ("experts_list.*.drop.p=0.0",)
    evaluating = blocks.ExpertListMoE([Dropping(0.1) for _ in range(4)]).eval()
    assert {"experts_list.*.drop.training=False", "experts_list.*.drop.p=0.1"} <= \
        set(detect_moe_structure(evaluating).folded)


def test_last_dim_norms_softmax_branches_and_unpassed_arguments_are_row_local():
    s = detect_moe_structure(blocks.ExpertListMoE([LastDimNorm() for _ in range(4)]))
    assert s.expert_kind == "row_local" and {"experts_list.*.use_softmax=False", "experts_list.*.eps=1e-06"} <= \
        set(s.folded)
    flipped = LastDimNorm()
    flipped.use_softmax = True  # now the folded branch runs a softmax over the rows
    with pytest.raises(Refusal, match=r"`h.softmax\(dim=0\)` works along dim 0: mixes rows"):
        row_local.prove_expert(flipped, "experts[0]")


def test_torch_norm_modules_over_more_than_the_last_dim_are_refused():
    assert row_local.prove_expert(nn.Sequential(nn.Linear(D, FF), nn.LayerNorm(FF), nn.SiLU()), "e").folded == ()
    with pytest.raises(Refusal, match=r"normalises over \(2, 8\), not the last dim alone: mixes rows"):
        row_local.prove_expert(nn.Sequential(nn.LayerNorm((2, 8))), "e")


def test_in_place_activation_on_the_input_is_refused_but_not_on_fresh_rows():
    row_local.prove_expert(nn.Sequential(nn.Linear(D, D), nn.ReLU(inplace=True)), "e")
    with pytest.raises(Refusal, match="runs in place on the expert's input"):
        row_local.prove_expert(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(D, D)), "e")


def test_a_parameter_shared_between_experts_is_refused():
    block = blocks.FairseqStyleMoE()
    block.local_experts[2].fc2.bias = block.local_experts[0].fc2.bias
    with pytest.raises(UnsupportedModuleStructure, match=r"local_experts\[2\].fc2.bias is the same parameter as one "
                                                         r"of local_experts\[0\]"):
        detect_moe_structure(block)


def test_a_module_outside_the_expert_is_refused():
    shared = nn.Linear(D, D)

    class UsesGlobal(nn.Module):
        def forward(self, x):
            return shared(x)

    with pytest.raises(Refusal, match="calls a module that is not part of the expert"):
        row_local.prove_expert(UsesGlobal(), "experts[0]")


def test_folded_constants_are_drift_when_they_change():
    block = blocks.ExpertListMoE([blocks.ConfigBranchExpert(blocks.BranchExpertConfig()) for _ in range(4)])
    folded = detect_moe_structure(block).folded
    assert row_local.folded_drift(block, folded) == []
    block.experts_list[3].glu = 2
    assert row_local.folded_drift(block, folded) == ["experts_list.*.glu was 1 when the experts were proven, now 1, 2"]


def test_heterogeneous_experts_are_each_proven():
    experts = [blocks.FairseqStyleFFN(D, FF, "gelu"), blocks.FairseqStyleFFN(D, FF, "relu"),
               nn.Sequential(nn.Linear(D, FF), nn.Tanh(), nn.Linear(FF, D)), nn.Identity()]
    s = detect_moe_structure(blocks.ExpertListMoE(experts))
    assert s.expert_kind == "row_local" and count_experts(blocks.ExpertListMoE(experts), s) == 4
    assert "experts_list.0.activation_fn=torch._C._nn.gelu" in s.folded
    experts[2] = nn.Sequential(nn.Linear(D, FF), nn.BatchNorm1d(FF), nn.Linear(FF, D))
    with pytest.raises(UnsupportedModuleStructure, match=r"experts_list\[2\].1 \(BatchNorm1d\)"):
        detect_moe_structure(blocks.ExpertListMoE(experts))


class Decoder(nn.Module):
    """A model, not an MoE block: it walks its layers (a ModuleList) but indexes none by an expert id."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([blocks.FeedForward(D, FF) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers[:2]:
            x = layer(x)
        return x


def test_a_module_list_walked_by_a_model_is_not_experts():
    """Not for the fast paths, and not for record/exchange/replay either (its loop chains the layers)."""
    assert not has_experts(Decoder())
    with pytest.raises(Refusal, match=r"chains the modules of self.layers \(`x = layer\(x\)`\)"):
        replay_proof.find_container(Decoder())
    with pytest.raises(UnsupportedModuleStructure):
        detect_moe_structure(Decoder())


# --- leading dims: an expert called on (..., D) -----------------------------------------------------------


class _Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(D, FF), nn.LayerNorm(FF), nn.Linear(FF, D)


def _expert_running(body: str) -> nn.Module:
    """An expert whose forward is ``h = gelu(fc1(x))``, then ``body`` (lines; the last binds ``h``), then
    ``return fc2(h)``."""
    lines = "".join(f"    {line}\n" for line in body.splitlines())
    source = f"def forward(self, x):\n    h = F.gelu(self.fc1(x))\n{lines}    return self.fc2(h)\n"
    filename = f"<autoep leading dims: {body}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # inspect reads it here
    namespace = {"F": F, "torch": torch, "FF": FF, "__name__": __name__}
    exec(compile(source, filename, "exec"), namespace)
    namespace["forward"].__qualname__ = "Leading.forward"
    torch.manual_seed(0)
    return type("Leading", (_Wide,), {"forward": namespace["forward"]})()


LEADING_FREE = [  # every dim before the last treated alike
    "h = h + 1", "h = h - h.sum(-1, keepdim=True)", "h = F.softmax(h, dim=-1)", "h = self.norm(h)",
    "h = torch.cat([h[..., FF // 2:], h[..., :FF // 2]], dim=-1)", "h = h.view(h.shape)",
    "h = h / h.shape[-1] + h.size(-1)", "a, b = h.chunk(2, dim=-1)\nh = torch.cat([b, a], dim=-1)",
    "h = h * h.amax(-1)[..., None]", "h = F.normalize(h, dim=-1)", "h = h.sort(dim=-1).values",
]
LEADING_PINNED = {  # row-local on 2-D rows, but dim 1 or the rank on (..., D): what pins it
    "h = h - h.sum(1, keepdim=True)": "`h.sum(1, keepdim=True)` reads dim 1 by a positive index",
    "h = F.softmax(h, dim=1)": "`F.softmax(h, dim=1)` reads dim 1 by a positive index",
    "h = F.softmax(h)": "`F.softmax(h)` reads the rows' rank (softmax without a dim)",
    "h = h.cumsum(axis=1)": "`h.cumsum(axis=1)` reads dim 1",
    "h = torch.cat([h[:, FF // 2:], h[..., :FF // 2]], dim=-1)": "`h[:, FF // 2:]` reads dim 1 by position",
    "h = torch.cat([h[..., FF // 2:], h[..., :FF // 2]], dim=1)": "torch.cat([h[..., FF // 2:], h[..., :FF // 2]], "
                                                                  "dim=1)` reads dim 1",
    "h = h / h.shape[1]": "`h.shape[1]` reads dim 1", "h = h / h.size(1)": "`h.size(1)` reads dim 1",
    "h = h * 2 if h.dim() == 2 else h": "`h.dim()` reads the rows' rank",
    "h = h * 2 if h.ndim == 2 else h": "`h.ndim` reads the rows' rank",
    "h = h.view(-1, h.size(-1))": "`h.view(-1, h.size(-1))` reads the rows' rank (flattens to 2-D)",
    "h = F.normalize(h)": "`F.normalize(h)` reads dim 1", "h = h * h.amax(-1).unsqueeze(1)": "`h.amax(-1).unsqueeze(1)`",
    "h = h * h.amax(-1)[:, None]": "`h.amax(-1)[:, None]` reads dim 1 by position",
    "a, b = h.chunk(2, dim=1)\nh = torch.cat([b, a], dim=-1)": "`h.chunk(2, dim=1)` reads dim 1",
}


def _flattened(expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = expert(x.reshape(-1, x.shape[-1]))
    return out.reshape(*x.shape[:-1], out.shape[-1])


@pytest.mark.parametrize("body", LEADING_FREE)
def test_an_expert_reading_the_last_dim_alone_treats_leading_dims_alike(body):
    expert = _expert_running(body)
    proof = row_local.prove_expert(expert, "experts[0]")
    assert proof.leading_dims_free and proof.pinned_by == ""
    for shape in [(3, 5, D), (2, 3, 4, D), (0, 2, D)]:  # what the fact promises replay, on the expert itself
        x = torch.randn(shape)
        torch.testing.assert_close(expert(x), _flattened(expert, x))


@pytest.mark.parametrize("body", list(LEADING_PINNED))
def test_an_expert_reading_dim_1_or_the_rank_is_row_local_but_pinned(body):
    expert = _expert_running(body)
    proof = row_local.prove_expert(expert, "experts[0]")  # row-local on 2-D rows: accepted
    assert not proof.leading_dims_free
    assert proof.pinned_by.startswith("Leading.forward line ") and LEADING_PINNED[body] in proof.pinned_by, \
        proof.pinned_by


def test_leading_dims_pinned_names_each_experts_construct():
    block = blocks.ExpertListMoE([_expert_running(LEADING_FREE[1]), _expert_running("h = F.softmax(h, dim=1)")] * 2)
    pinned = replay_proof.leading_dims_pinned(block, "experts_list")
    assert pinned[0] == pinned[2] == "" and "`F.softmax(h, dim=1)`" in pinned[1] and pinned[1] == pinned[3]


# --- mode-aware row-locality (issue 31 item 4): each mode-dependent module checked in the mode it runs in --------


class Normed(Expert):
    """fc2(norm(fc1(x))) for any norm module over FF features."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))


class DropsWith(Expert):
    """fc2(drop(relu(fc1(x)))) for any dropout module."""

    def __init__(self, drop: nn.Module):
        super().__init__()
        self.drop = drop

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.fc1(x))))


class FunctionalBatchNorm(Expert):
    """A BatchNorm written out: ``F.batch_norm`` with the module's own running statistics and mode."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(FF))
        self.register_buffer("running_var", torch.ones(FF))
        self.weight, self.bias = nn.Parameter(torch.ones(FF)), nn.Parameter(torch.zeros(FF))

    def forward(self, x):
        h = F.batch_norm(self.fc1(x), self.running_mean, self.running_var, self.weight, self.bias,
                         training=self.training)
        return self.fc2(h)


class CentresWhileTraining(Expert):
    """A custom module branching on ``self.training``: batch centring while training (mixes rows), none in eval."""

    def forward(self, x):
        h = self.fc1(x)
        if self.training:
            h = h - h.mean(0, keepdim=True)
        return self.fc2(h)


class FunctionalDropoutAtZero(Expert):
    def forward(self, x):
        return self.fc2(F.dropout(self.fc1(x), 0.0, self.training))


BATCH_WHY = "batch statistics mix rows across ranks"
MODES = {  # name: (expert builder, refusal in training (None: accepted), refusal in eval (None: accepted),
    #             folded entries recorded in eval)
    "batch_norm_1d": (lambda: Normed(nn.BatchNorm1d(FF)), BATCH_WHY, None, {"norm.training=False"}),
    "sync_batch_norm": (lambda: Normed(nn.SyncBatchNorm(FF)), BATCH_WHY, None, {"norm.training=False"}),
    "batch_norm_2d": (lambda: Normed(nn.BatchNorm2d(FF)), BATCH_WHY, "takes (N, C, ...) input of more dims", set()),
    "batch_norm_no_running_stats": (lambda: Normed(nn.BatchNorm1d(FF, track_running_stats=False)), BATCH_WHY,
                                    BATCH_WHY, set()),
    "instance_norm": (lambda: Normed(nn.InstanceNorm1d(FF, track_running_stats=True)), "channels are the rows",
                      "channels are the rows", set()),
    "group_norm": (lambda: Normed(nn.GroupNorm(4, FF)), None, None, set()),
    "functional_batch_norm": (FunctionalBatchNorm, BATCH_WHY, None, {"training=False"}),
    "training_branch": (CentresWhileTraining, "`h.mean(0, keepdim=True)` works along dim 0: mixes rows", None,
                        {"training=False"}),
    "alpha_dropout": (lambda: DropsWith(nn.AlphaDropout(0.1)), "is dropout with p=0.1 while training", None,
                      {"drop.training=False", "drop.p=0.1"}),
    "dropout_1d": (lambda: DropsWith(nn.Dropout1d(0.1)), "is dropout with p=0.1 while training", None,
                   {"drop.training=False", "drop.p=0.1"}),
    "feature_alpha_dropout": (lambda: DropsWith(nn.FeatureAlphaDropout(0.1)), "is dropout with p=0.1 while training",
                              None, {"drop.training=False", "drop.p=0.1"}),
}


@pytest.mark.parametrize("name", list(MODES))
def test_mode_dependent_modules_are_proven_for_the_mode_they_run_in(name):
    """Accepted in the mode where the module is a map of each row alone, its mode folded (a change after apply is
    drift); refused in the other, naming why. The two modes of one module are each other's one-edit twins."""
    build, in_training, in_eval, folded = MODES[name]
    for mode, refusal in (("train", in_training), ("eval", in_eval)):
        experts = [build() for _ in range(4)]
        for e in experts:
            e.train(mode == "train")
        if refusal is None:
            found = detect_moe_structure(blocks.ExpertListMoE(experts, hidden=D))
            want = {f"experts_list.*.{f}" for f in folded} if mode == "eval" else set()
            assert want <= set(found.folded), found.folded
            if mode == "train":  # nothing mode-dependent recorded where the mode decides nothing
                assert not any(f.endswith("training=True") for f in found.folded), found.folded
        else:
            with pytest.raises(UnsupportedModuleStructure) as info:
                detect_moe_structure(blocks.ExpertListMoE(experts, hidden=D))
            assert refusal in str(info.value), str(info.value)


def test_train_mode_batch_norm_refusal_says_why():
    with pytest.raises(Refusal) as info:
        row_local.prove_expert(Normed(nn.BatchNorm1d(FF)).train(), "experts[0]")
    text = str(info.value)
    assert "BatchNorm1d uses batch statistics" in text and BATCH_WHY in text and "in eval with running statistics" \
        in text, text


def test_a_norm_is_pinned_to_its_channel_dim_on_nd_calls():
    for norm in (nn.GroupNorm(4, FF), nn.BatchNorm1d(FF)):
        proof = row_local.prove_expert(Normed(norm).eval(), "experts[0]")
        assert not proof.leading_dims_free and "reads dim 1 as its channels" in proof.pinned_by, proof


def test_a_mode_read_that_decides_nothing_is_not_folded():
    """``F.dropout(h, 0.0, self.training)`` is the identity in either mode: switching modes after apply is no drift
    (its one-edit twin at p=0.1 in eval folds the mode)."""
    assert row_local.prove_expert(FunctionalDropoutAtZero().train(), "e").folded == ()
    assert row_local.prove_expert(FunctionalDropoutAtZero().eval(), "e").folded == ()
    assert ("training", "False") in row_local.prove_expert(FunctionalDropout().eval(), "e").folded
