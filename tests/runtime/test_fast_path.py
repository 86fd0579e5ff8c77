"""The module_list fast path reads the local experts' own parameters in place.

The grouped GEMM runs on one stacked buffer per projection that IS the experts' parameters' memory
(``p.data`` re-pointed, same ``nn.Parameter`` objects); each parameter gets its gradient as a view of one
stacked gradient through its own ``AccumulateGrad``. These tests hold it to the experts' own forward (the
reference: the same block unapplied, fp32, default tolerances) wherever the parameters' memory is changed
behind its back, and check the path that ran: in place (``stacked_parameters``), stacked per forward (a
copy, where moving the memory could be observed), or the experts' own forward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_module_list_recipe import SEQ, D, _ep_block, _make

from autoep.runtime.recipes import local_experts

NAME = "research_w1w2w3"  # torchtitan-style w1/w2/w3 SwiGLU experts in a ModuleList (4 experts, F=32)
PROJS = ("w1", "w3", "w2")  # gate, up, down


@pytest.fixture
def paths(monkeypatch):
    """Counts of the paths the local experts took: "in_place" (the stacked home), "grouped" (any grouped GEMM),
    "own" (each expert's own forward)."""
    calls = {"in_place": 0, "grouped": 0, "own": 0}

    def counting(key, fn):
        return lambda *a, **k: calls.__setitem__(key, calls[key] + 1) or fn(*a, **k)

    monkeypatch.setattr(local_experts, "stacked_parameters", counting("in_place", local_experts.stacked_parameters))
    monkeypatch.setattr(local_experts, "_grouped", counting("grouped", local_experts._grouped))
    monkeypatch.setattr(local_experts, "own_forward", counting("own", local_experts.own_forward))
    return calls


def _path(calls: dict, before: dict) -> str:
    done = {k: calls[k] - before[k] for k in calls}
    if done["own"]:
        return "own"
    return "in_place" if done["in_place"] else "copy" if done["grouped"] else "none"


def _pair():
    """(the block's own forward, the block applied at ep=1): the same weights."""
    return _make(NAME), _ep_block(NAME, None)


def _lives_home(block) -> bool:
    """Every expert parameter's memory is its slice of the block's stacked home."""
    home = getattr(block, local_experts.STACKED)
    if home.gate_up is None:
        return False
    F = home.gate_up.shape[1] // 2
    for e, expert in enumerate(block.experts):
        slots = (home.gate_up[e, :F], home.gate_up[e, F:], home.down[e])
        for name, slot in zip(PROJS, slots):
            w = getattr(expert, name).weight
            if w.data_ptr() != slot.data_ptr() or w.shape != slot.shape or w.stride() != slot.stride():
                return False
    return True


def _check(ref, block, calls, *, seed=0, dtype=torch.float32) -> str:
    """One forward/backward of both on the same tokens; outputs, input grads and every parameter's grad equal.
    Returns the path the local experts took."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, SEQ, D, generator=g, dtype=dtype)
    gy = torch.randn(x.shape, generator=g, dtype=dtype)
    before = dict(calls)
    results = []
    for model in (ref, block):
        model.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out = model(xi)
        (out * gy).sum().backward()
        results.append((out, xi.grad, {n: p.grad for n, p in model.named_parameters()}))
    path = _path(calls, before)
    (ref_out, ref_xg, ref_grads), (out, xg, grads) = results
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(xg, ref_xg)
    assert grads.keys() == ref_grads.keys()
    for n, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[n], msg=lambda m: f"{n}: {m}")
    return path


def _each(model, fn):
    for e, expert in enumerate(model.experts):
        for name in PROJS:
            fn(e, name, getattr(expert, name).weight)


def test_the_fast_path_reads_the_experts_own_parameters_in_place(paths):
    ref, block = _pair()
    objects = [id(p) for p in block.parameters()]
    assert _check(ref, block, paths) == "in_place"
    assert _lives_home(block)
    assert [id(p) for p in block.parameters()] == objects  # the same Parameter objects, re-homed
    home = getattr(block, local_experts.STACKED)
    buffers = (home.gate_up, home.down)
    assert _check(ref, block, paths, seed=1) == "in_place"
    assert (home.gate_up, home.down) == buffers  # a later forward reads the same home: no copy, no re-homing
    for n, p in block.named_parameters():
        assert p.grad.shape == p.shape and p.grad.is_contiguous(), n  # an ordinary gradient of its own
    assert set(block.state_dict()) == set(ref.state_dict())


def test_parameter_hooks_fire_per_parameter(paths):
    """Tensor hooks (rescaling the gradient) and post-accumulate-grad hooks run on each expert parameter, once
    per backward, with what the experts' own forward would hand them."""
    ref, block = _pair()
    seen = {id(ref): [], id(block): []}
    for model in (ref, block):
        def hook(e, name, w, model=model):
            w.register_hook(lambda grad, e=e: grad * (e + 2))
            w.register_post_accumulate_grad_hook(
                lambda p, e=e, name=name, model=model: seen[id(model)].append((e, name, p.grad.clone())))
        _each(model, hook)
    assert _check(ref, block, paths) == "in_place"
    assert len(seen[id(block)]) == 3 * len(block.experts)
    assert sorted(k[:2] for k in seen[id(block)]) == sorted(k[:2] for k in seen[id(ref)])
    want = {k[:2]: k[2] for k in seen[id(ref)]}
    for e, name, grad in seen[id(block)]:
        torch.testing.assert_close(grad, want[e, name])


def test_optimizer_in_backward_steps_each_parameter_in_place(paths):
    """A post-accumulate-grad hook stepping its parameter during backward (optimizer in backward) steps the
    parameter's own memory, the stacked home: the next forward reads the stepped weights in place."""
    ref, block = _pair()
    for model in (ref, block):
        def step(p):
            with torch.no_grad():
                p.sub_(0.1 * p.grad)
            p.grad = None
        _each(model, lambda e, name, w: w.register_post_accumulate_grad_hook(step))
    for seed in range(3):
        path = _check(ref, block, paths, seed=seed)
        assert path == "in_place"
    assert _lives_home(block)
    for (n, p), q in zip(block.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{n}: {m}")


def test_replaced_data_is_re_homed_and_stays_exact(paths):
    """``p.data = new`` (nothing else holds ``new``) moves a parameter out of its home: the next forward copies it
    back into a new home, the same object, and equals the own forward on the new values."""
    ref, block = _pair()
    assert _check(ref, block, paths) == "in_place"
    new = torch.randn(block.experts[2].w1.weight.shape)
    ref.experts[2].w1.weight.data = new.clone()
    block.experts[2].w1.weight.data = new.clone()
    del new
    param = block.experts[2].w1.weight
    assert not _lives_home(block)
    assert _check(ref, block, paths, seed=1) == "in_place"
    assert _lives_home(block) and block.experts[2].w1.weight is param


def test_memory_held_elsewhere_is_not_moved(paths):
    """A parameter whose memory another tensor also holds (``p.data = t`` with ``t`` kept) is not moved: its
    weights are stacked per forward (a copy), so an edit through ``t`` still reaches the parameter, and the
    result is exact; once nothing else holds it, it is re-homed."""
    ref, block = _pair()
    assert _check(ref, block, paths) == "in_place"
    held = torch.randn(block.experts[1].w2.weight.shape)
    block.experts[1].w2.weight.data = held
    ref.experts[1].w2.weight.data = held.clone()
    assert _check(ref, block, paths, seed=1) == "copy"
    with torch.no_grad():
        held.mul_(-2)
        ref.experts[1].w2.weight.mul_(-2)
    assert block.experts[1].w2.weight.data_ptr() == held.data_ptr()
    assert _check(ref, block, paths, seed=2) == "copy"
    del held
    assert _check(ref, block, paths, seed=3) == "in_place"
    assert _lives_home(block)


@pytest.mark.parametrize("when", ["before_first_forward", "after_first_forward"])
def test_weights_tied_through_data_stay_tied(paths, when):
    """Two experts' weights on the same memory (``b.data = a.data``): moving them into separate slots would untie
    them, so they are stacked per forward and an in-place update of one is seen by the other, as in the model."""
    ref, block = _pair()
    if when == "after_first_forward":
        assert _check(ref, block, paths) == "in_place"
    for model in (ref, block):
        model.experts[3].w2.weight.data = model.experts[0].w2.weight.data
    assert _check(ref, block, paths, seed=1) == "copy"
    for model in (ref, block):
        with torch.no_grad():
            model.experts[0].w2.weight.add_(1.0)
    assert block.experts[3].w2.weight.data_ptr() == block.experts[0].w2.weight.data_ptr()
    assert _check(ref, block, paths, seed=2) == "copy"


def test_load_state_dict_in_place_and_by_assignment(paths):
    """``load_state_dict`` copies into the parameters (they stay home); ``assign=True`` installs new parameter
    objects, which the next forward re-homes. Both equal the own forward on the loaded weights."""
    ref, block = _pair()
    assert _check(ref, block, paths) == "in_place"
    other = _make(NAME)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    ref.load_state_dict(other.state_dict())
    block.load_state_dict(other.state_dict())
    assert _lives_home(block)
    assert _check(ref, block, paths, seed=1) == "in_place"
    with torch.no_grad():
        for p in other.parameters():
            p.neg_()
    ref.load_state_dict(copy.deepcopy(other.state_dict()), assign=True)
    block.load_state_dict(copy.deepcopy(other.state_dict()), assign=True)
    assert not _lives_home(block)
    assert _check(ref, block, paths, seed=2) == "in_place"
    assert _lives_home(block)


def test_dtype_conversion_and_deep_copy_are_re_homed(paths):
    ref, block = _pair()
    assert _check(ref, block, paths) == "in_place"
    twin, twin_ref = copy.deepcopy(block), copy.deepcopy(ref)
    assert _check(twin_ref, twin, paths, seed=1) == "in_place"
    assert _lives_home(twin) and _lives_home(block)
    assert twin.experts[0].w1.weight.data_ptr() != block.experts[0].w1.weight.data_ptr()
    ref.double()
    block.double()
    assert _check(ref, block, paths, seed=2, dtype=torch.float64) == "in_place"
    assert _lives_home(block) and getattr(block, local_experts.STACKED).gate_up.dtype == torch.float64


@pytest.mark.parametrize("input_grad", [True, False])
def test_an_in_place_edit_between_forward_and_backward_raises_as_the_own_forward_does(paths, input_grad):
    """Editing an expert weight in place between forward and backward raises where the backward would read it
    (torch's version check, as on the parameters ``F.linear`` saved), and only there: with an input that needs
    no gradient, the gate/up weights are not read in backward, the down weight still is."""
    ref, block = _pair()
    assert _check(ref, block, paths) == "in_place"
    x = torch.randn(2, SEQ, D, requires_grad=input_grad)
    for name, raises in (("w1", input_grad), ("w2", True)):
        for model in (ref, block):
            model.zero_grad(set_to_none=True)
            out = model(x)
            with torch.no_grad():
                getattr(model.experts[0], name).weight.mul_(2)  # also expert 0's slot of the stacked home
            if raises:
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    out.sum().backward()
            else:
                out.sum().backward()
    assert ref(x).shape == x.shape  # the models still run


def test_inference_mode_moves_nothing(paths):
    ref, block = _pair()
    x = torch.randn(2, SEQ, D)
    with torch.inference_mode():
        torch.testing.assert_close(block(x), ref(x))
    assert not _lives_home(block)  # tensors made in inference mode could never be saved for backward
    assert _check(ref, block, paths) == "in_place"


def test_shared_memory_parameters_stay_shared(paths):
    """``share_memory()`` (Hogwild-style training) moves the parameters' storage to shared memory; moving them
    out again would silently stop sharing, so they are stacked per forward instead."""
    ref, block = _pair()
    assert _check(ref, block, paths) == "in_place"
    block.share_memory()
    assert _check(ref, block, paths, seed=1) == "copy"
    assert all(p.is_shared() for p in block.experts.parameters())


def test_experts_of_different_widths_run_their_own_forward(paths):
    """Widths changed behind the proof's back (``p.data`` of another shape) cannot be stacked: each expert's own
    forward runs (it applies its own shapes) instead of failing in the stack."""
    ref, block = _pair()
    assert _check(ref, block, paths) == "in_place"
    g = torch.Generator().manual_seed(3)
    narrow = {"w1": torch.randn(8, D, generator=g), "w3": torch.randn(8, D, generator=g),
              "w2": torch.randn(D, 8, generator=g)}
    for model in (ref, block):
        for name, w in narrow.items():
            getattr(model.experts[1], name).weight.data = w.clone()
    assert _check(ref, block, paths, seed=1) == "own"


def test_frozen_experts_get_no_gradient(paths):
    ref, block = _pair()
    for model in (ref, block):
        model.experts[1].requires_grad_(False)
    assert _check(ref, block, paths) == "in_place"
    assert all(p.grad is None for p in block.experts[1].parameters())
    assert all(p.grad is not None for p in block.experts[0].parameters())


def test_a_block_without_the_home_stacks_per_forward(paths):
    """An applied block pickled by an older autoep (no home attribute) still runs: stacked per forward."""
    ref, block = _pair()
    del block.__dict__[local_experts.STACKED]
    assert _check(ref, block, paths) == "copy"
    assert isinstance(getattr(copy.deepcopy(_ep_block(NAME, None)), local_experts.STACKED), local_experts._Stacked)


def test_the_home_is_not_state(paths):
    """The stacked buffers are no parameters, buffers or state-dict entries of the block; the state dict holds the
    experts' own values; a pickled home comes back empty (its parameters are re-homed at the first forward)."""
    import pickle

    ref, block = _pair()
    assert _check(ref, block, paths) == "in_place"
    assert [n for n, _ in block.named_buffers()] == [n for n, _ in ref.named_buffers()]
    state = block.state_dict()
    assert list(state) == list(ref.state_dict())
    for n, v in ref.state_dict().items():
        torch.testing.assert_close(state[n], v, msg=lambda m: f"{n}: {m}")
    home = getattr(block, local_experts.STACKED)
    assert home.gate_up is not None and pickle.loads(pickle.dumps(home)).gate_up is None


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_recomputes_in_place(paths, use_reentrant):
    """The block under torch's checkpoint: the recomputation in backward reads the home again; grads equal the
    own forward without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    ref, block = _pair()
    assert _check(ref, block, paths) == "in_place"
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, SEQ, D, generator=g)
    gy = torch.randn(x.shape, generator=g)
    xr, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref.zero_grad(set_to_none=True)
    block.zero_grad(set_to_none=True)
    (ref(xr) * gy).sum().backward()
    before = dict(paths)
    (checkpoint(block, xb, use_reentrant=use_reentrant) * gy).sum().backward()
    assert paths["in_place"] - before["in_place"] == 4  # two homes, forward and recomputation
    torch.testing.assert_close(xb.grad, xr.grad)
    for (n, p), q in zip(block.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{n}: {m}")


def test_without_storage_use_counts_nothing_is_moved(paths, monkeypatch):
    """A torch without ``torch._C._storage_Use_Count`` cannot tell who holds a parameter's memory: parameters
    outside their home are then stacked per forward, never moved."""
    ref, block = _pair()
    monkeypatch.setattr(local_experts, "_use_count", None)
    assert _check(ref, block, paths) == "copy"
    assert not _lives_home(block)
