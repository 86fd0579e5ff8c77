"""Record, exchange, replay (``autoep.runtime.recipes.replay``): blocks whose dispatch loop no fast-path spec
reads (``tests/replay_blocks.py``) run under EP exactly as their own forward, on 1, 2 and 4 gloo ranks, and their
harmful one-edit twins raise on every rank, naming the block and the call.

Parity (DESIGN.md): each rank feeds its own tokens (uneven, one rank empty at W=4); its output and input grad
equal the block's own on those tokens; router and other dense grads summed over ranks, and every expert
parameter's grad (from the rank owning it, by the model's own name) equal the block's own summed over every
rank's tokens, ``None`` exactly where the block's own leaves it ``None``. SGD-free: gradients are compared
directly. The plan is the real one: ``resolve_plan`` (detector, archetype table, fingerprint) then ``apply_plan``.
"""

from __future__ import annotations

import copy
import functools
import types

import pytest
import replay_blocks as rb
import torch
import torch.distributed as dist
from distributed import guarded, run_cases
from ep_parity import gathered_grads
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autoep.detect import plain_experts
from autoep.detect.structure import detect_moe_structure
from autoep.errors import FactChanged, UnsupportedModuleStructure
from autoep.plan.resolve import resolve_plan
from autoep.plan.table import plan_rows
from autoep.runtime.apply import apply_plan
from autoep.runtime.recipes.local_experts import expert_owners
from autoep.runtime.recipes.replay import ReplayError

SEQ = 3
BATCH_PER_RANK = {1: [4], 2: [1, 3], 4: [2, 0, 3, 1]}
# Experts under autocast inside the block: their owner runs one bf16 GEMM over every rank's rows, where the model
# summed one per rank in fp32 (.grad): the expert weights' gradients agree to bf16 rounding, not fp32's.
EXPERT_GRAD_TOLERANCE = {"autocast_around_experts": {"atol": 1e-2, "rtol": 1.6e-2}}
PEER_FAILED = ("another ep rank's replay check failed", "failed in the block's forward")


def _make(name: str, builders=rb.BLOCKS) -> nn.Module:
    torch.manual_seed(sum(map(ord, name)))
    builder = builders[name]
    return (builder[0] if isinstance(builder, tuple) else builder)().train()


def _data(world_size: int):
    g = torch.Generator().manual_seed(7)
    batches = BATCH_PER_RANK[world_size]
    x = torch.randn(sum(batches), SEQ, rb.D, generator=g)
    grad_out = torch.randn(x.shape, generator=g)
    bounds = [sum(batches[:r]) for r in range(world_size + 1)]
    return [(x[lo:hi], grad_out[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]


def _run(block, x, grad_out, seed: int):
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    out = block(x * 1)  # a non-leaf input, as a layer gets it (an in-place edit of it is the model's to make)
    loss = (out * grad_out).sum()
    if loss.requires_grad:
        loss.backward()
    return out.detach(), x.grad if x.grad is not None else torch.zeros_like(x), torch.get_rng_state()


@functools.lru_cache(maxsize=None)
def _mesh(world_size: int):
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)) if world_size > 1 else None


def _ep_block(name: str, world_size: int, builders=rb.BLOCKS) -> nn.Module:
    mesh = _mesh(world_size)
    model = nn.ModuleDict({"mlp": _make(name, builders)})
    resolved = resolve_plan({"ep_size": world_size, "plan": [{"match": "mlp", "record_replay": True}]}, model)
    assert resolved.plan[0].decision.structure.execution == "replay"
    apply_plan(model, resolved, mesh)
    return model["mlp"]


def _check_block(name: str, rank: int, world_size: int, builders=rb.BLOCKS) -> None:
    slices = _data(world_size)
    ref = _make(name, builders)
    ref_results = [_run(ref, *s, seed=100 + r) for r, s in enumerate(slices)]
    block = _ep_block(name, world_size, builders)
    assert block.state_dict().keys() == ref.state_dict().keys()  # the model's own names
    out, x_grad, rng_after = _run(block, *slices[rank], seed=100 + rank)

    path = detect_moe_structure(_make(name, builders), replay=True).experts_path
    # The experts as the runtime places them (an entry of the container that is no expert, ``named_entry``'s
    # norm, is dense: every rank holds it, its grads sum over ranks).
    # Experts in a plain dict/list attribute keep the names the block registers them under (``expert_0.fc1.weight``).
    view, prefix = plain_experts.resolve(ref, path)
    experts = set(expert_owners(block))
    assert experts and experts <= {".".join(p for p in (prefix, n) if p) for n in view.state_dict()}, sorted(experts)
    # Collectives first, in the same order on every rank; compare after.
    dense, gathered = gathered_grads(block, experts, world_size)

    ref_out, ref_x_grad, ref_rng = ref_results[rank]
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(x_grad, ref_x_grad)
    assert torch.equal(rng_after, ref_rng), "the RNG after the block differs from the block's own run"
    ref_params = dict(ref.named_parameters())
    for n, g in dense.items():
        want = ref_params[n].grad if ref_params[n].grad is not None else torch.zeros_like(g)
        torch.testing.assert_close(g, want, msg=lambda m: f"{n}: {m}")
    assert gathered.keys() == experts, sorted(experts - gathered.keys())
    for n, (value, grad) in gathered.items():
        torch.testing.assert_close(value, ref_params[n].detach(), msg=lambda m: f"{n}: {m}")
        want = ref_params[n].grad
        assert (grad is None) == (want is None), f"{n}: grad {'None' if grad is None else 'set'} under EP, " \
                                                 f"{'None' if want is None else 'set'} in the block's own run"
        if want is not None:
            torch.testing.assert_close(grad, want, msg=lambda m: f"{n}: {m}", **EXPERT_GRAD_TOLERANCE.get(name, {}))


def _check_twin(name: str, rank: int, world_size: int) -> None:
    expected = rb.TWINS[name][1]
    block = _ep_block(name, world_size, rb.TWINS)
    x, grad_out = _data(world_size)[rank]
    with pytest.raises(ReplayError) as info:
        _run(block, x, grad_out, seed=100 + rank)
    text = str(info.value)
    assert expected in text or any(p in text for p in PEER_FAILED), text
    own = [expected in text]
    if world_size > 1:
        own = [None] * world_size
        dist.all_gather_object(own, expected in text)  # NOTE: collective; some rank names the twin's fault
    assert any(own), f"no rank raised {expected!r}"


def replay_cases(rank: int, world_size: int, twins: bool) -> dict:
    results = {}
    for name in rb.BLOCKS:
        guarded(results, name, _check_block, name, rank, world_size)
    for name in rb.INPUT_EDITS:
        guarded(results, f"input_edit:{name}", _check_block, name, rank, world_size, rb.INPUT_EDITS)
    for name in rb.TWINS if twins else ():
        guarded(results, f"twin:{name}", _check_twin, name, rank, world_size)
    return results


@pytest.mark.parametrize("name", list(rb.BLOCKS))
def test_single_process_parity(name):
    _check_block(name, 0, 1)


@pytest.mark.parametrize("name", list(rb.INPUT_EDITS))
def test_single_process_parity_of_input_edits(name):
    """Pass 1 runs on a copy of the input; the edit is made once, on the input itself, in pass 2."""
    _check_block(name, 0, 1, rb.INPUT_EDITS)


@pytest.mark.parametrize("name", list(rb.TWINS))
def test_single_process_twin_raises(name):
    _check_twin(name, 0, 1)


def test_state_written_in_forward_is_written_once():
    """Pass 1's attribute writes are undone; pass 2 makes them, once, as the block's own call does."""
    counter, cached = _ep_block("counter_attribute", 1), _ep_block("cached_order", 1)
    x = _data(1)[0][0]
    counter(x)
    cached(x)
    assert counter.calls == 1
    assert list(cached._order_cache.items()) == [(x.shape[0] * x.shape[1], [3, 2, 1, 0])]


@pytest.mark.parametrize("world_size", [2, 4])
def test_multi_rank_parity_and_twins(world_size):
    """Every block on 2 and 4 ranks; the twins on 2 (each raises on every rank: one rank's failed check
    reaches its peers with the counts or the agreement after pass 2)."""
    cases = run_cases(world_size, "test_replay:replay_cases", world_size == 2)
    failed = {case: errs for case, errs in cases.items() if errs}
    assert not failed, "\n".join(f"{case}: {errs[0]}" for case, errs in failed.items())


# ---------------------------------------------------------------------------------------------
# Detection and the plan: the fallback, its facts, the table
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, path", [("comprehension", "experts"), ("config_flag", "local_experts"),
                                        ("nested_experts", "moe.experts"), ("cast_masked", "experts")])
def test_replay_structure_finds_the_experts_by_data_flow(name, path):
    found = detect_moe_structure(_make(name), replay=True)
    assert (found.execution, found.experts_path, found.expert_kind, found.expert_storage) == \
        ("replay", path, "row_local", "module_list")


def test_proven_loops_keep_their_fast_path():
    import blocks

    spliced = detect_moe_structure(blocks.FairseqStyleMoE(hidden=8, ffn=16, activation_fn="gelu"))
    assert spliced.execution == "spliced"


def test_an_expert_that_is_not_row_local_is_refused_naming_it():
    block = _make("comprehension")
    block.experts[2] = nn.Sequential(nn.Linear(rb.D, rb.D), nn.BatchNorm1d(rb.D))
    with pytest.raises(UnsupportedModuleStructure, match=r"experts\[2\].*BatchNorm1d"):
        detect_moe_structure(block, replay=True)


def test_an_expert_batch_norm_in_eval_is_row_local_and_watched():
    """In eval a BatchNorm1d uses its running statistics, a per-feature affine map of each row: accepted, exact (the
    owner's norm holds the expert's own statistics); ``train()`` after apply switches it to batch statistics, which
    raises before the call instead of running a plan proven for eval."""
    torch.manual_seed(0)
    own = _make("comprehension").eval()
    for e in own.experts:
        e.fc1 = nn.Sequential(nn.Linear(rb.D, rb.FF), nn.BatchNorm1d(rb.FF))
        e.fc1[1].running_mean.normal_()
        e.fc1[1].running_var.uniform_(0.5, 2.0)
    own.eval()
    found = detect_moe_structure(own, replay=True)
    assert found.execution == "replay" and "experts.*.fc1.1.training=False" in found.folded, found.folded
    model = nn.ModuleDict({"mlp": copy.deepcopy(own)})
    apply_plan(model, resolve_plan({"ep_size": 1, "plan": [{"match": "mlp", "record_replay": True}]}, model), None)
    block = model["mlp"]
    x_own, x_ep = _data(1)[0][0].requires_grad_(), _data(1)[0][0].requires_grad_()
    want, got = own(x_own * 1), block(x_ep * 1)
    torch.testing.assert_close(got, want)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(x_ep.grad, x_own.grad)
    for (n, p), (_, q) in zip(own.named_parameters(), block.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"{n}: {m}")
    with pytest.raises(UnsupportedModuleStructure, match=r"BatchNorm1d uses batch statistics"):
        detect_moe_structure(copy.deepcopy(own).train(), replay=True)
    block.train()
    with pytest.raises(FactChanged, match=r"training"):
        block(x_ep * 1)


class _TouchesEveryExpert(rb.ComprehensionMoE):
    """minimind's idle-expert touch, ``0 * sum(p.sum() for p in expert.parameters())``: under EP the other
    ranks' experts are stand-ins, so the read would raise on every rank that does not own the expert."""

    def forward(self, hidden_states):
        y = super().forward(hidden_states)
        for expert in self.experts:
            y = y + 0 * sum(p.sum() for p in expert.parameters())
        return y


def test_a_forward_reading_every_tensor_of_an_expert_is_refused():
    torch.manual_seed(0)
    with pytest.raises(UnsupportedModuleStructure, match=r"_TouchesEveryExpert.forward line \d+ reads .parameters"):
        detect_moe_structure(_TouchesEveryExpert(), replay=True)


# ---------------------------------------------------------------------------------------------
# Experts in a plain dict/list attribute (issue 21): parity is ``plain_dict``/``plain_list`` in the cases above
# ---------------------------------------------------------------------------------------------


def test_plain_dict_and_list_experts_are_found_by_data_flow_and_keep_their_names():
    """The attribute the forward reads is ``experts_path``; each expert is named by its entry
    (``expert_by_id[3]``) and keeps the block's own parameter names; the plan table counts their bytes; both the
    attribute and the registration reach the one placed module (a stand-in where another rank owns it)."""
    for name, attr, label in (("plain_dict", "expert_by_id", "expert_by_id[3]"),
                              ("plain_list", "expert_list", "expert_list[3]")):
        found = detect_moe_structure(_make(name), replay=True)
        assert (found.execution, found.experts_path, found.expert_kind) == ("replay", attr, "row_local")
        model = nn.ModuleDict({"mlp": _make(name)})
        resolved = resolve_plan({"ep_size": 2, "plan": [{"match": "mlp"}]}, model)
        expert_bytes = sum(p.numel() * p.element_size() for n, p in model["mlp"].named_parameters()
                           if not n.startswith(("gate.", "router.")))
        assert plan_rows(model, resolved)[0][5] == expert_bytes // 2
        block = _ep_block(name, 1)
        assert block._autoep_replay.keys[3] == label
        entries = block.expert_by_id if name == "plain_dict" else dict(enumerate(block.expert_list))
        prefix = "expert" if name == "plain_dict" else "ffn"
        assert all(entries[i] is block.get_submodule(f"{prefix}_{i}") for i in range(rb.E))


def _plain(edit=None, cls=rb.PlainDictMoE):
    torch.manual_seed(0)
    block = cls()
    if edit is not None:
        edit(block)
    return block


def _unregistered(b):
    b.expert_by_id[2] = rb.FeedForward()


def _held_twice(b):
    b.expert_by_id[2] = b.expert_1


class _GateInDict(rb.PlainDictMoE):
    """The gate held in the dict too, read there by its key."""

    def __init__(self):
        super().__init__()
        self.expert_by_id["gate"] = self.gate

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, selected = rb._top_k(self.expert_by_id["gate"], x, rb.K)
        out = torch.zeros_like(x)
        for i in range(rb.E):
            tok, slot = torch.where(selected == i)
            out.index_add_(0, tok, self.expert_by_id[i](x[tok]) * weights[tok, slot, None])
        return out.reshape(hidden_states.shape)


class _GateInListReadByName(rb.PlainListMoE):
    """The router held in the list too, called by its own name."""

    def __init__(self):
        super().__init__()
        self.expert_list.append(self.router)


class _GateInListCalledThroughIt(rb.PlainListMoE):
    """The router held last in the list and called through it, by position: not refusable from the names alone.
    Replay takes it for an expert and raises: its call's output is not rows of the experts' width (and were it,
    pass 1 answers it with a placeholder, so pass 2's routing on its true output would call other experts than
    pass 1 recorded)."""

    def __init__(self):
        super().__init__()
        del self.router
        self.gate_last = nn.Linear(rb.D, rb.E, bias=False)
        self.expert_list.append(self.gate_last)

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        *experts, gate = self.expert_list
        weights, selected = rb._top_k(gate, x, rb.K)
        out = torch.zeros_like(x)
        for i, expert in enumerate(experts):
            tok, slot = torch.where(selected == i)
            out.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return out.reshape(hidden_states.shape)


@pytest.mark.parametrize("block, match", [
    (lambda: _plain(_unregistered), r"PlainDictMoE.expert_by_id\[2\] holds a FeedForward that is not a registered "
                                    r"submodule of PlainDictMoE.*self.add_module"),
    (lambda: _plain(_held_twice), r"PlainDictMoE.expert_by_id holds the module PlainDictMoE.expert_1 at "
                             r"expert_by_id\[1\] and at expert_by_id\[2\]"),
    (lambda: _plain(cls=_GateInDict), r"_GateInDict.expert_by_id\['gate'\] \(self.gate\) is read by name"),
    (lambda: _plain(cls=_GateInListReadByName), r"expert_list\[4\] \(self.router\) is read by name"),
])
def test_plain_experts_one_edit_twins_are_refused_naming_the_attribute(block, match):
    with pytest.raises(UnsupportedModuleStructure, match=match):
        detect_moe_structure(block(), replay=True)


def test_a_gate_called_through_the_plain_list_raises():
    model = nn.ModuleDict({"mlp": _plain(cls=_GateInListCalledThroughIt)})
    apply_plan(model, resolve_plan({"ep_size": 1, "plan": [{"match": "mlp"}]}, model), None)
    # the gate is called as an expert: its output is pending, and the routing reads it on the host
    with pytest.raises(ReplayError, match=r"_GateInListCalledThroughIt: where of a pending expert output cannot run "
                                          r"before the exchange: its result depends on the values .* line \d+: "
                                          r"`tok, slot = torch.where\(selected == i\)`"):
        model["mlp"](_data(1)[0][0])


def _replace_entry(b):
    b.expert_by_id[1] = rb.FeedForward()


def _append_entry(b):
    b.expert_by_id[rb.E] = b.expert_0


def _replace_registered(b):
    b.expert_1 = rb.FeedForward()


def _replace_both(b):  # consistent again, but with a module autoep never placed
    b.expert_1 = b.expert_by_id[1] = rb.FeedForward()


def _list_appended(b):
    b.expert_list.append(rb.FeedForward())


def _list_replaced_attribute(b):
    b.expert_list = list(b.expert_list)


@pytest.mark.parametrize("name, edit, match", [
    ("plain_dict", _replace_entry, r"expert_by_id\[1\] is no longer the module registered as PlainDictMoE.expert_1"),
    ("plain_dict", _append_entry, r"expert_by_id now holds the entries \[0, 1, 2, 3, 4\], not the 4"),
    ("plain_dict", _replace_registered, r"expert_by_id\[1\] is no longer the module registered as"),
    ("plain_dict", lambda b: b.expert_by_id.pop(3), r"expert_by_id now holds the entries \[0, 1, 2\]"),
    ("plain_list", _list_appended, r"expert_list now holds the entries \[0, 1, 2, 3, 4\]"),
])
def test_plain_experts_changed_after_apply_raise(name, edit, match):
    block = _ep_block(name, 1)
    x = _data(1)[0][0]
    block(x)
    edit(block)
    with pytest.raises(ReplayError, match=r"\.(expert_by_id|expert_list) was changed after apply_plan: " + match):
        block(x)


def test_plain_experts_replaced_consistently_after_apply():
    """The attribute and the registration both replaced by one new module: nothing autoep placed is left to tell
    them apart by identity, so it is the new module's own stand-in-free run; as a ModuleList's ``experts[1] = m``,
    the expert is no longer the one autoep placed: checked by the placed modules' marks."""
    block = _ep_block("plain_dict", 1)
    x = _data(1)[0][0]
    _replace_both(block)
    with pytest.raises(ReplayError, match=r"expert_by_id\[1\] is no longer the module autoep placed"):
        block(x)


def test_plain_list_copied_into_a_new_list_keeps_working():
    """A new list holding the same modules, in the same order, is the same map (identity of entries is checked)."""
    block, ref = _ep_block("plain_list", 1), _make("plain_list")
    _list_replaced_attribute(block)
    x = _data(1)[0][0]
    torch.testing.assert_close(block(x), ref(x))


def test_plan_table_shows_the_execution():
    model = nn.ModuleDict({"mlp": _make("nested_experts")})
    resolved = resolve_plan({"ep_size": 2, "plan": [{"match": "mlp", "record_replay": True}]}, model)
    row = plan_rows(model, resolved)[0]
    assert row[2] == "replay" and row[3].endswith("replay.ep_replay_block"), row
    assert row[4] == 2  # experts per rank
    expert_bytes = sum(p.numel() * p.element_size() for p in model["mlp"].moe.experts.parameters())
    assert row[5] == expert_bytes // 2
    assert OmegaConf.to_container(resolved)["plan"][0]["decision"]["structure"]["execution"] == "replay"


# ---------------------------------------------------------------------------------------------
# The automatic fallback (issue 21): on by default, off per plan entry; which entries are experts
# ---------------------------------------------------------------------------------------------


def test_replay_is_the_default_and_record_replay_false_refuses():
    """No key: a block no fast path reads is decided replay (and the entry records ``record_replay: true``);
    ``record_replay: false`` refuses it as the fast paths do, naming the construct and the opt-out."""
    from autoep.errors import UnsupportedPlanEntry

    model = nn.ModuleDict({"mlp": _make("comprehension")})
    resolved = OmegaConf.to_container(resolve_plan({"ep_size": 2, "plan": [{"match": "mlp"}]}, model))["plan"][0]
    assert resolved["decision"]["structure"]["execution"] == "replay" and resolved["record_replay"] is True
    with pytest.raises(UnsupportedPlanEntry, match=r"parallel.plan.0.match='mlp' matched mlp \(ComprehensionMoE\).*"
                                                   r"local_compute_fn"):
        resolve_plan({"ep_size": 2, "plan": [{"match": "mlp", "record_replay": False}]}, model)
    off = resolve_plan({"ep_size": 2, "plan": [{"match": "mlp", "record_replay": False, "moe_only": False,
                                                "local_compute_fn": {"_factory_": "autoep.runtime.recipes.replay."
                                                                                  "ep_replay_block",
                                                                     "structure": resolved["decision"]["structure"]}}]},
                       model)
    assert OmegaConf.to_container(off)["plan"][0]["record_replay"] is False  # written: its default is true


def test_entries_read_by_name_are_not_experts():
    """NLLB-MoE's shape: the container's trailing entry its forward reads by name (``self.norm``) stays with the
    block (dense, every rank), so E counts the experts only; parity on 1, 2 and 4 ranks is ``named_entry`` in the
    block cases above. An entry read by name before an expert is refused: which ids are experts would be a guess."""
    from autoep.detect.structure import count_experts

    block = _make("named_entry")
    found = detect_moe_structure(block)
    assert (found.execution, found.experts_path, count_experts(block, found)) == ("replay", "experts", rb.E)
    assert not any(entry.startswith("experts.*.") for entry in found.folded), found.folded
    interleaved = _make("named_entry")
    norm = interleaved.experts.pop("norm")
    entries = dict(interleaved.experts.items())
    interleaved.experts.clear()
    interleaved.experts.update({"expert_0": entries["expert_0"], "norm": norm,
                                **{k: v for k, v in entries.items() if k != "expert_0"}})
    with pytest.raises(UnsupportedModuleStructure, match=r"holds 'norm', which the forward reads by name.*before "
                                                         r"'expert_1'"):
        detect_moe_structure(interleaved)


def test_a_parameter_on_the_experts_container_itself_is_refused():
    """``apply_plan`` splits ``block.experts``' own parameters over the ep ranks (batched experts' layout): a
    scalar the container's forward reads (the fuzzer's gate_learnable on NLLB) is refused, not sharded."""
    block = _make("optional_arg_container")
    block.experts.register_parameter("scale", nn.Parameter(torch.tensor(1.0)))
    with pytest.raises(UnsupportedModuleStructure, match=r"experts holds a parameter of its own \(scale\)"):
        detect_moe_structure(block)


def test_a_global_module_hook_at_forward_time_raises():
    """Registered after apply: it would run on the experts' modules on their owner, on other rows than the model's.
    A mode that registers them (FlopCounterMode's module tracker) is named as the cause."""
    from torch.utils.flop_counter import FlopCounterMode

    block = _ep_block("comprehension", 1)
    x = _data(1)[0][0]
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, out: out)
    try:
        with pytest.raises(ReplayError, match="ComprehensionMoE: global module hooks are registered"):
            block(x)
    finally:
        handle.remove()
    with pytest.raises(ReplayError, match=r"ComprehensionMoE: the active mode torch.utils.flop_counter._FlopCounterMode "
                                          r"registered global module hooks"):
        with FlopCounterMode(display=False):
            block(x)
    block(x)


# ---------------------------------------------------------------------------------------------
# Experts changed after apply (``recipes.watching_experts``, checked once per call): raised, naming the expert
# ---------------------------------------------------------------------------------------------


def _twice(self, x):
    return 2 * type(self).forward(self, x)


SWAPS = {  # name -> (the edit, on the EP block; what the error says)
    "expert_replaced": (lambda b: b.experts.__setitem__(2, nn.Sequential(nn.Linear(rb.D, rb.D))),
                        "ComprehensionMoE: experts[2] was replaced by a Sequential (proven: a FeedForward) after "
                        "apply_plan"),
    "submodule_replaced": (lambda b: setattr(b.experts[1], "fc1", nn.Sequential(nn.Linear(rb.D, rb.FF))),
                           "ComprehensionMoE: experts[1].fc1 was replaced by a Sequential (proven: a Linear)"),
    "submodule_added": (lambda b: b.experts[3].add_module("extra", nn.Linear(rb.D, rb.D)),
                        "ComprehensionMoE: experts[3].extra (Linear) was added"),
    "submodule_removed": (lambda b: delattr(b.experts[3], "fc2"), "ComprehensionMoE: experts[3].fc2 was removed"),
    # replay calls the class forward: the instance's would be dropped (and deleted by the answering)
    "instance_forward": (lambda b: setattr(b.experts[0], "forward", types.MethodType(_twice, b.experts[0])),
                         "ComprehensionMoE: experts[0] got a forward set on its instance"),
    "submodule_forward": (lambda b: setattr(b.experts[1].fc2, "forward", types.MethodType(_twice, b.experts[1].fc2)),
                          "ComprehensionMoE: experts[1].fc2 got a forward set on its instance"),
}


def _check_swap(name: str, rank: int, world_size: int, only_rank: int | None = None) -> None:
    edit, expected = SWAPS[name]
    block = _ep_block("comprehension", world_size)
    x, grad_out = _data(world_size)[rank]
    if only_rank is None or only_rank == rank:
        edit(block)
    with pytest.raises(RuntimeError) as info:
        _run(block, x, grad_out, seed=100 + rank)
    text = str(info.value)
    if only_rank is None or only_rank == rank:
        assert isinstance(info.value, FactChanged) and expected in text, text
    else:
        assert any(p in text for p in PEER_FAILED), text


def swap_cases(rank: int, world_size: int) -> dict:
    results = {}
    for name in SWAPS:
        guarded(results, name, _check_swap, name, rank, world_size)
    guarded(results, "instance_forward on rank 1 only", _check_swap, "instance_forward", rank, world_size, 1)
    return results


@pytest.mark.parametrize("name", list(SWAPS))
def test_an_expert_changed_after_apply_raises_naming_it(name):
    _check_swap(name, 0, 1)


def test_experts_changed_after_apply_raise_on_every_rank():
    cases = run_cases(2, "test_replay:swap_cases")
    failed = {case: errs for case, errs in cases.items() if errs}
    assert len(cases) == len(SWAPS) + 1 and not failed, "\n".join(f"{c}: {e[0]}" for c, e in failed.items())


def test_same_class_experts_deep_copies_and_set_back_edits_run():
    """The proofs are about the modules' classes: a same-class expert runs, as does a deep copy; an edit set back
    (the instance forward deleted) runs again."""
    block = _ep_block("comprehension", 1)
    x = _data(1)[0][0]
    torch.testing.assert_close(copy.deepcopy(block)(x), block(x))
    block.experts[2] = rb.FeedForward()
    block(x)
    SWAPS["instance_forward"][0](block)
    with pytest.raises(FactChanged):
        block(x)
    del block.experts[0].forward
    block(x)


def test_a_plain_dict_plan_replays_and_rechecks_its_experts():
    """``resolved.yaml`` of a plain-dict block replays as frozen (experts_path the attribute); an expert added to
    the model since (registered, and in the dict) is drift, naming the count."""
    from autoep.errors import DriftError

    model = nn.ModuleDict({"mlp": _make("plain_dict")})
    frozen = OmegaConf.to_container(resolve_plan({"ep_size": 2, "plan": [{"match": "mlp"}]}, model))
    assert frozen["plan"][0]["decision"]["structure"]["experts_path"] == "expert_by_id"
    assert OmegaConf.to_container(resolve_plan(frozen, model)) == frozen
    model["mlp"].add_module("expert_4", rb.FeedForward())
    model["mlp"].expert_by_id[4] = model["mlp"].expert_4
    with pytest.raises(DriftError, match=r"num_experts 4 -> \[5\]"):
        resolve_plan(frozen, model)


def test_placeholders_follow_casts_after_the_first_call():
    """Pass 1's placeholders take each expert's output width and dtype from its forward on meta, kept per expert
    by what they depend on (the rows' width and dtype, autocast and grad mode, the expert's tensors' dtypes,
    training flags): the block cast to float64, then bfloat16, then back after a float32 call gets the dtype its
    own forward gives each time, and exactly its own output."""
    ref = _make("comprehension")
    block = _ep_block("comprehension", 1)
    x = _data(1)[0][0]
    torch.testing.assert_close(block(x), ref(x))
    for dtype in (torch.float64, torch.bfloat16, torch.float32):
        ref.to(dtype), block.to(dtype)
        out, want = block(x.to(dtype)), ref(x.to(dtype))
        assert out.dtype == want.dtype == dtype
        torch.testing.assert_close(out, want, rtol=0, atol=0)
