"""After apply it is still the user's model (issue 20): re-initialisation, precision and expert modules changed
after ``apply_plan`` behave as on the model.

Every case runs the same user code on the single-process model and on its EP copy (2 gloo ranks, 4 for the
initialisation) and compares values: ``model.apply(init)`` seeded (every expert weight gathered from its owner,
every dense weight on every rank), autocast in bf16 and fp16 and casts after apply (outputs, input gradients and
gathered expert gradients against the model under the same autocast, each rank's slice run on its own), an
activation swapped on one expert, parametrizations added to expert Linears, experts holding a plain function as
activation. One spawn per world size runs every case (spawn cost dominates).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from distributed import guarded, run_cases
from test_parity_hf import _first, build_tiny_lm, ep_plan, gathered_grads
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import blocks
from autoep.errors import LiveStateError
from autoep.runtime.apply import apply_plan

D = 16
TOKENS = {2: [7, 3], 4: [5, 1, 3, 2]}  # this rank's tokens; uneven


class FnActMLP(nn.Module):
    """A SwiGLU expert holding its activation as a plain function attribute (``self.act_fn = F.silu``)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.act_fn = F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class FnActMoE(blocks.MoE):
    """torchtitan-style MoE whose experts are ``FnActMLP``s."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.experts = nn.ModuleList([FnActMLP(self.config.dim, self.config.hidden_dim)
                                      for _ in range(self.config.num_experts)])


def _module_list() -> nn.Module:
    torch.manual_seed(0)
    return blocks.MixtralStyleSparseMoeBlock(hidden=D, num_experts=4, top_k=2)


def _plain_dict() -> nn.Module:
    """Experts registered one by one and held in a plain dict attribute (record/exchange/replay)."""
    import replay_blocks

    torch.manual_seed(0)
    return replay_blocks.PlainDictMoE()


def _batched() -> nn.Module:
    return build_tiny_lm("qwen3_moe").model.layers[0].mlp


def _gpt_oss() -> nn.Module:
    """transformers' GPT-OSS block: batched experts with biases, ``x @ w + b`` (the bias promotes to fp32 under
    autocast), its own clamped gate."""
    return build_tiny_lm("gpt_oss").model.layers[0].mlp


def _fn_act() -> nn.Module:
    torch.manual_seed(0)
    return FnActMoE(hidden=D, num_experts=4, top_k=2)


def _grouped() -> nn.Module:
    torch.manual_seed(0)
    return blocks.TitanMoE(hidden=D, num_experts=4, top_k=2)


def _equal_groups() -> nn.Module:
    torch.manual_seed(0)
    return blocks.EqualGroupsMoE(hidden=D, num_experts=4, top_k=2)


def _split_loop() -> nn.Module:
    torch.manual_seed(0)
    return blocks.SortedSplitMoE(hidden=D, num_experts=4, top_k=2)


def _width(block: nn.Module) -> int:
    router = getattr(block, "gate", None) or block.router
    return router.weight.shape[-1]


def _apply(block: nn.Module, world_size: int) -> nn.Module:
    """An EP copy of ``block`` (the resolved plan the detector writes, applied on an ``ep`` mesh)."""
    holder = nn.Module()
    holder.mlp = copy.deepcopy(block)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    apply_plan(holder, ep_plan(holder, ["mlp"]), mesh)
    return holder.mlp


def _slices(world_size: int, hidden: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    counts = TOKENS[world_size]
    x = torch.randn(1, sum(counts), hidden, generator=g)
    grad_out = torch.randn(1, sum(counts), hidden, generator=g)
    bounds = [(sum(counts[:r]), sum(counts[: r + 1])) for r in range(world_size)]
    return x, grad_out, bounds


def _run(block: nn.Module, x: torch.Tensor, grad_out: torch.Tensor | None, context):
    """``block``'s output on ``x`` under ``context()`` (and, with ``grad_out``, the input's gradient)."""
    x = x.clone().requires_grad_(grad_out is not None)
    with context():
        out = _first(block(x)).reshape(x.shape)
    if grad_out is not None:
        (out.float() * grad_out).sum().backward()
    return out.detach(), x.grad


def _parity(rank, world_size, make_block, context, *, prepare=None, backward=True, overflow=False, dtype=None):
    """The same user code (``prepare(block)`` after apply, then a forward under ``context()``) on the model, each
    rank's slice on its own (gradients summed), and on the EP model: outputs, input gradients, expert gradients
    gathered from their owners and dense gradients summed over ranks: outputs at fp32 defaults, gradients at
    ``_grad_tol``; non-finite values must sit exactly where the model's are."""
    grad_tol = _grad_tol(context) if dtype is None else _grad_tol(_autocast(dtype))
    ref = make_block()
    ep = _apply(ref, world_size)
    for block in (ref, ep):
        if prepare is not None:
            prepare(block)
    hidden = _width(ref)
    x, grad_out, bounds = _slices(world_size, hidden)
    if dtype is not None:  # a model cast after apply takes inputs of its dtype
        x, grad_out = x.to(dtype), grad_out.to(dtype)
    refs = [_run(ref, x[:, a:b], grad_out[:, a:b] if backward else None, context) for a, b in bounds]
    if overflow:  # the case is about the model's own overflow: it must happen
        assert any(torch.isinf(out).any() for out, _ in refs), "the model's experts did not overflow"
    lo, hi = bounds[rank]
    out, x_grad = _run(ep, x[:, lo:hi], grad_out[:, lo:hi] if backward else None, context)
    _close(out, refs[rank][0], "output", None if dtype is None else grad_tol)
    if backward:
        _close(x_grad, refs[rank][1], "input grad", grad_tol)
        grads = gathered_grads(ep)  # NOTE: collective
        for name, p in ref.named_parameters():
            _close(grads[name], torch.zeros_like(p) if p.grad is None else p.grad, f"grad of {name}", grad_tol)
    _check_placed(ep)


def _check_placed(ep: nn.Module) -> None:
    """Every tensor of a module expert another rank owns is a ``meta`` stand-in here, those registered after apply
    included: a real one would be a copy this rank's optimizer, DDP and checkpoints take for its own."""
    from autoep.runtime.recipes.local_experts import expert_owners

    held = {**dict(ep.named_parameters(remove_duplicate=False)), **dict(ep.named_buffers(remove_duplicate=False))}
    real = [k for k, place in expert_owners(ep).items() if not place.local and not held[k].is_meta]
    assert not real, f"tensors of experts another rank owns are real here: {real}"


def _close(got: torch.Tensor, expected: torch.Tensor, what: str, tol: float | None) -> None:
    """fp32 ``assert_close`` defaults, or ``tol``: a relative error of ``tol`` of the tensor's largest magnitude
    (see ``_grad_tol``); inf and nan exactly where the model has them."""
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype}, the model's {expected.dtype}"
    for check in (torch.isnan, torch.isposinf, torch.isneginf):
        where, ref_where = check(got), check(expected)
        assert torch.equal(where, ref_where), f"{what}: {check.__name__} at {where.nonzero().tolist()[:6]}, the " \
                                              f"model's at {ref_where.nonzero().tolist()[:6]}"
    finite = torch.isfinite(expected)
    if tol is None:
        torch.testing.assert_close(got[finite], expected[finite], msg=lambda m: f"{what}: {m}")
        return
    scale = float(expected[finite].abs().max()) if finite.any() else 0.0
    torch.testing.assert_close(got[finite], expected[finite], rtol=tol, atol=tol * scale,
                               msg=lambda m: f"{what}: {m}")


def _grad_tol(context) -> float | None:
    """Gradients under autocast: each GEMM rounds its result to the autocast dtype, and the model's own
    gradients change by about one unit of that rounding when the same rows are computed in another grouping
    (its per-slice reference computes each expert's rows in two GEMMs, EP in one; CPU kernels block by the row
    count). The unit roundoff of the dtype, relative to the tensor's largest magnitude (cancellation makes
    small entries carry the absolute error of the large terms): 2**-8 for bf16, 2**-11 for fp16, times 4 for the
    roundings on the way (forward product, activation, backward product, cast back)."""
    dtype = getattr(context, "dtype", None)
    return None if dtype is None else 4 * torch.finfo(dtype).eps / 2


class _autocast:
    """``torch.autocast("cpu", dtype)`` made fresh for each forward."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self):
        return torch.autocast("cpu", dtype=self.dtype)


def _no_context():
    import contextlib

    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# Precision: autocast and casts after apply
# ---------------------------------------------------------------------------------------------


def _overflowing(make_block):
    """``make_block``'s block with its experts' down projections scaled so that some fp16 outputs overflow
    (the model's own experts give inf there; fp32 compute would not)."""

    def make():
        block = make_block()
        with torch.no_grad():
            for name, p in block.named_parameters():
                if "experts" in name and "down" in name:
                    p.mul_(2e5)  # fp16 holds the weights (0.1 * 2e5 < 65504); some outputs exceed it
        return block

    return make


def _cast(how: str):
    return lambda block: getattr(block, how)() if how != "to" else block.to(torch.bfloat16)


def _pure_bf16_exact(rank: int, world_size: int, *, fast_path: bool) -> None:
    """A Mixtral-style block entirely in bfloat16 (no autocast; the spliced loop, its experts' separate gate and up
    Linears): output and input gradient bit-identical to the model's on each rank's slice, over several routings;
    router and expert gradients within bf16 rounding of the per-rank sums. The grouped fast path computes gate and up
    as two grouped GEMMs, as the experts' own Linears do: one fused (2F)-wide GEMM rounded each input-gradient
    element once where the model rounds twice and adds, and 28-38% of them differed by one bf16 ulp (59-116 of
    208-304 elements per rank over 6 seeds, at most 0.0039 absolute, 2 ranks)."""
    for seed in range(3):
        torch.manual_seed(seed)
        ref = blocks.MixtralStyleSparseMoeBlock(hidden=D, num_experts=4, top_k=2).bfloat16()
        holder = nn.Module()
        holder.mlp = copy.deepcopy(ref)
        plan = ep_plan(holder, ["mlp"])
        plan["plan"][0]["local_compute_fn"]["fast_path"] = fast_path
        apply_plan(holder, plan, init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)))
        ep = holder.mlp
        assert plan["plan"][0]["decision"]["structure"]["execution"] == "spliced"
        x, grad_out, bounds = _slices(world_size, D, seed=7 + seed)
        x, grad_out = x.bfloat16(), grad_out.bfloat16()
        refs = [_run(ref, x[:, a:b], grad_out[:, a:b], _no_context) for a, b in bounds]
        lo, hi = bounds[rank]
        out, x_grad = _run(ep, x[:, lo:hi], grad_out[:, lo:hi], _no_context)
        torch.testing.assert_close(out, refs[rank][0], rtol=0, atol=0, msg=lambda m: f"seed {seed} output: {m}")
        torch.testing.assert_close(x_grad, refs[rank][1], rtol=0, atol=0, msg=lambda m: f"seed {seed} input grad: {m}")
        grads = gathered_grads(ep)  # NOTE: collective
        tol = _grad_tol(_autocast(torch.bfloat16))
        for name, p in ref.named_parameters():
            _close(grads[name].float(), p.grad.float(), f"seed {seed} grad of {name}", tol)


PRECISION_CASES = {
    **{f"{kind} experts cast by .{how}() after apply": (
        lambda r, w, make=make, how=how: _parity(r, w, make, _no_context, prepare=_cast(how),
                                                 dtype=torch.float16 if how == "half" else torch.bfloat16))
       for kind, make in (("ModuleList", _module_list), ("batched", _batched)) for how in ("to", "half", "bfloat16")},
    "pure bf16, ModuleList experts, grouped fast path: input gradients bit-identical": lambda r, w: _pure_bf16_exact(
        r, w, fast_path=True),
    "pure bf16, ModuleList experts, own forwards: input gradients bit-identical": lambda r, w: _pure_bf16_exact(
        r, w, fast_path=False),
    "autocast bf16, ModuleList experts": lambda r, w: _parity(r, w, _module_list, _autocast(torch.bfloat16)),
    "autocast fp16, ModuleList experts": lambda r, w: _parity(r, w, _module_list, _autocast(torch.float16)),
    "autocast bf16, batched experts": lambda r, w: _parity(r, w, _batched, _autocast(torch.bfloat16)),
    "autocast fp16, batched experts": lambda r, w: _parity(r, w, _batched, _autocast(torch.float16)),
    "autocast bf16, batched experts with biases (GPT-OSS)": lambda r, w: _parity(r, w, _gpt_oss,
                                                                                  _autocast(torch.bfloat16)),
    "autocast bf16, ModuleList split loop": lambda r, w: _parity(r, w, _split_loop, _autocast(torch.bfloat16)),
    "autocast bf16, grouped experts": lambda r, w: _parity(r, w, _grouped, _autocast(torch.bfloat16)),
    "autocast fp16, grouped experts": lambda r, w: _parity(r, w, _grouped, _autocast(torch.float16)),
    "autocast bf16, equal-groups experts": lambda r, w: _parity(r, w, _equal_groups, _autocast(torch.bfloat16)),
    "autocast fp16, equal-groups experts": lambda r, w: _parity(r, w, _equal_groups, _autocast(torch.float16)),
    "autocast fp16 overflow, ModuleList experts": lambda r, w: _parity(
        r, w, _overflowing(_module_list), _autocast(torch.float16), backward=False, overflow=True),
    "autocast fp16 overflow, batched experts": lambda r, w: _parity(
        r, w, _overflowing(_batched), _autocast(torch.float16), backward=False, overflow=True),
}


# ---------------------------------------------------------------------------------------------
# Expert modules changed after apply
# ---------------------------------------------------------------------------------------------


def _swap_act_on_one(block: nn.Module) -> None:
    block.experts[1].act_fn = nn.GELU()


def _prelu_on(*experts: int):
    """An activation with a parameter of its own (``nn.PReLU``, 0.25) set on some experts after apply: on a rank not
    owning one of them it must be the expert's (a stand-in), never a second, untrained copy."""

    def prepare(block: nn.Module) -> None:
        for e in experts:
            block.experts[e].act_fn = nn.PReLU()

    return prepare


def _prelu_on_batched(block: nn.Module) -> None:
    """transformers 5.x batched experts: one ``act_fn`` serves every expert, so its parameter is dense-like (every
    rank's rows reach it; its gradient is summed over the ranks)."""
    block.experts.act_fn = nn.PReLU()


def _buffer_on_plain(block: nn.Module) -> None:
    """A buffer and a parameter registered on a one-pass block's expert after apply (its forward reads neither)."""
    block.expert_3.register_buffer("seen", torch.ones(3))
    block.expert_3.scale = nn.Parameter(torch.ones(3))


def _replaced_batched_refused(rank: int, world_size: int) -> None:
    """A batched expert parameter replaced after apply by a full plain tensor (``experts.gate_up_proj =
    nn.Parameter(...)``, as on the model): every rank would read it as its own experts. Raised at the first forward,
    before any exchange, naming the parameter and the fixes."""
    ep = _apply(_batched(), world_size)
    ep.experts.gate_up_proj = nn.Parameter(torch.zeros(ep.experts.gate_up_proj.shape))
    x, _, bounds = _slices(world_size, _width(ep))
    with pytest.raises(LiveStateError, match=r"Qwen3MoeExperts\.gate_up_proj was replaced after apply_plan by a "
                                             r"plain tensor of shape \(8, 32, 32\).*load_state_dict"):
        ep(x[:, slice(*bounds[rank])])


def _shared_prelu_refused(rank: int, world_size: int) -> None:
    """One ``nn.PReLU`` set on every expert after apply (the model shares its parameter among the experts): under
    EP each expert lives on one rank, so the module cannot be both a local expert's and a remote one's. Raised at
    the first forward, before any exchange, naming the expert and the holder, on every rank alike."""
    ep = _apply(_module_list(), world_size)
    shared = nn.PReLU()
    for expert in ep.experts:
        expert.act_fn = shared
    x, _, bounds = _slices(world_size, D)
    with pytest.raises(LiveStateError, match=r"experts\.\d\.act_fn was set after apply_plan to a PReLU that "
                                             r"experts\.\d\.act_fn holds too.*copy\.deepcopy"):
        ep(x[:, slice(*bounds[rank])])
    assert shared.weight.device.type == "cpu"  # the local experts' module kept its values


class _Halve(nn.Module):
    """A user parametrization (``register_parametrization``): the weight used is half the stored one."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * 0.5


def _weight_norm(block: nn.Module) -> None:
    for expert in block.experts:
        torch.nn.utils.parametrizations.weight_norm(expert.gate_proj)
        torch.nn.utils.parametrizations.weight_norm(expert.up_proj)


def _halve_down(block: nn.Module) -> None:
    for expert in block.experts:
        torch.nn.utils.parametrize.register_parametrization(expert.down_proj, "weight", _Halve())


def _old_spectral_norm(expert: nn.Module) -> None:
    torch.nn.utils.spectral_norm(expert.up_proj)  # the hook-based spelling: buffers weight_u/weight_v


def _spectral_norm_refused(rank: int, world_size: int, register, needle: str) -> None:
    """``spectral_norm`` draws its ``_u``/``_v`` when registered: on an EP model the stand-ins of other ranks'
    experts draw nothing, so this rank's experts would get other draws than the model's. Refused at the first
    forward, before any exchange, on every rank alike, naming the expert and the parametrization."""
    ep = _apply(_module_list(), world_size)
    for expert in ep.experts:
        register(expert)
    x, _, bounds = _slices(world_size, D)
    with pytest.raises(LiveStateError, match=needle):
        ep(x[:, slice(*bounds[rank])])


def _reshaping_init_refused(rank: int, world_size: int) -> None:
    """``model.apply(fn)`` where ``fn`` replaces a batched expert parameter by one of another shape: each rank keeps
    its shard of the model's shape, so the call raises naming the parameter, and the shard stays in place."""
    from torch.distributed.tensor import DTensor

    ep = _apply(_batched(), world_size)
    before = ep.experts.gate_up_proj

    def reshape(m: nn.Module) -> None:
        if "gate_up_proj" in m._parameters:
            m.gate_up_proj = nn.Parameter(torch.zeros(2, 2))

    with pytest.raises(ValueError, match=r"replaced the expert parameter Qwen3MoeExperts\.gate_up_proj of shape "
                                         r"\(8, 32, 32\) by \(2, 2\)"):
        ep.apply(reshape)
    assert ep.experts.gate_up_proj is before and isinstance(before, DTensor)


MODULE_CASES = {
    "model.apply(fn) replacing an expert parameter's shape: refused": _reshaping_init_refused,
    "activation swapped on one expert": lambda r, w: _parity(r, w, _module_list, _no_context,
                                                             prepare=_swap_act_on_one),
    "nn.PReLU set on one expert after apply, ModuleList experts": lambda r, w: _parity(
        r, w, _module_list, _no_context, prepare=_prelu_on(3)),
    "nn.PReLU set on an expert of each rank after apply, ModuleList experts": lambda r, w: _parity(
        r, w, _module_list, _no_context, prepare=_prelu_on(0, 3)),
    "nn.PReLU as the batched experts' activation after apply": lambda r, w: _parity(
        r, w, _batched, _no_context, prepare=_prelu_on_batched),
    "buffer and parameter registered on a one-pass block's expert after apply": lambda r, w: _parity(
        r, w, _plain_dict, _no_context, prepare=_buffer_on_plain),
    "one nn.PReLU shared by every expert after apply: refused": _shared_prelu_refused,
    "a batched expert parameter replaced by a plain tensor after apply: refused": _replaced_batched_refused,
    "experts holding a function as activation": lambda r, w: _parity(r, w, _fn_act, _no_context),
    "weight_norm on expert Linears after apply": lambda r, w: _parity(r, w, _module_list, _no_context,
                                                                      prepare=_weight_norm),
    "register_parametrization on expert Linears after apply": lambda r, w: _parity(
        r, w, _module_list, _no_context, prepare=_halve_down),
    "spectral_norm on expert Linears after apply: refused": lambda r, w: _spectral_norm_refused(
        r, w, lambda expert: torch.nn.utils.parametrizations.spectral_norm(expert.gate_proj),
        r"experts\.0\.gate_proj carries the parametrization _SpectralNorm of weight \(buffers _u, _v\), state drawn"),
    "spectral_norm hook on expert Linears after apply: refused": lambda r, w: _spectral_norm_refused(
        r, w, _old_spectral_norm, r"experts\.0\.up_proj carries the forward pre hook SpectralNorm, state drawn"),
}


# ---------------------------------------------------------------------------------------------
# Re-initialisation after apply
# ---------------------------------------------------------------------------------------------


def _normal(m: nn.Module) -> None:
    for p in m.parameters(recurse=False):
        nn.init.normal_(p, std=0.02)


def _xavier(m: nn.Module) -> None:
    for p in m.parameters(recurse=False):
        nn.init.xavier_uniform_(p) if p.dim() >= 2 else nn.init.uniform_(p)


def _zeros(m: nn.Module) -> None:
    for p in m.parameters(recurse=False):
        nn.init.zeros_(p)


def _reset(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        m.reset_parameters()


def _with_dense_after(make_block):
    """A model holding the block, then a dense layer initialised after the experts (the stream must reach it as
    on the model)."""

    def make():
        block = make_block()
        model = nn.Module()
        model.mlp = block
        width = block.gate.weight.shape[-1]
        model.out = nn.Linear(width, width)
        return model

    return make


def _full_state(model: nn.Module) -> dict:
    """Every tensor of ``model`` as the single-process model holds it: ModuleList experts from their owners,
    DTensor experts gathered (collectives)."""
    from torch.distributed.tensor import DTensor

    from autoep.runtime.recipes.local_experts import full_state_dict_of_experts

    state = full_state_dict_of_experts(model)
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def _init_parity(rank: int, world_size: int, make_model, init, *, through_apply: bool = True, edp: int = 1) -> None:
    """Seeded ``model.apply(init)`` after apply: every weight, gathered, equals the model's under the same seed
    (and, the stream being the same, the dense layer initialised after the experts on every rank)."""
    ref = make_model()
    ep = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (edp, world_size // edp), mesh_dim_names=("edp", "ep")) if edp > 1 else \
        init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    apply_plan(ep, ep_plan(ep, ["mlp"]) | {"ep_size": world_size // edp}, mesh)
    for model in (ref, ep):
        torch.manual_seed(1234)
        model.apply(init) if through_apply else init(model)
    expected, got = ref.state_dict(), _full_state(ep)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
    if edp == 1:  # still a working EP model: one forward matches the re-initialised model's
        _parity_after_init(rank, world_size, ref.mlp, ep.mlp)


def _parity_after_init(rank, world_size, ref_block, ep_block) -> None:
    x, _, bounds = _slices(world_size, ref_block.gate.weight.shape[-1])
    lo, hi = bounds[rank]
    with torch.no_grad():
        torch.testing.assert_close(_first(ep_block(x[:, lo:hi])).reshape(1, hi - lo, -1),
                                   _first(ref_block(x[:, lo:hi])).reshape(1, hi - lo, -1))


def _reset_loop(model: nn.Module) -> None:
    """``reset_parameters()`` called on each module in turn (not through ``apply``)."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()


INIT_CASES = {
    f"model.apply({init.__name__[1:]}) after apply, {kind} experts": (
        lambda r, w, make=make, init=init: _init_parity(r, w, _with_dense_after(make), init))
    for kind, make in (("ModuleList", _module_list), ("batched", _batched), ("plain dict", _plain_dict))
    for init in (_normal, _xavier, _zeros, _reset)
    if not (kind == "batched" and init is _reset)  # batched experts have no reset_parameters
}
INIT_CASES["reset_parameters() on each module after apply, ModuleList experts"] = (
    lambda r, w: _init_parity(r, w, _with_dense_after(_module_list), _reset_loop, through_apply=False))


# Init loops that do not go through ``model.apply`` (issue 32): each draw on an expert another rank owns, or on a
# sharded expert parameter, draws what the model's tensor draws.
def _normal_loop(model: nn.Module) -> None:
    """``nn.init`` on every parameter, in ``model.parameters()`` order."""
    for p in model.parameters():
        nn.init.normal_(p, std=0.02)


def _uniform_named(model: nn.Module) -> None:
    """A tensor method on the parameters a name filter picks (the experts' and the dense layer after them)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "expert" in name or name.startswith("out."):
                p.uniform_(-0.1, 0.1)


def _trunc_normal_loop(model: nn.Module) -> None:
    """``trunc_normal_``: a draw (``uniform_``) then elementwise ops on the tensor."""
    for p in model.parameters():
        nn.init.trunc_normal_(p, std=0.02)


def _xavier_loop(model: nn.Module) -> None:
    """Fan-in/fan-out from the full shape, then a draw."""
    for p in model.parameters():
        nn.init.xavier_normal_(p) if p.dim() >= 2 else nn.init.zeros_(p)


def _randn_like_loop(model: nn.Module) -> None:
    """An out-of-place draw like the parameter, copied in."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.02)


INIT_LOOPS = {
    "for p in model.parameters(): nn.init.normal_(p)": _normal_loop,
    "p.uniform_() on parameters picked from named_parameters()": _uniform_named,
    "nn.init.trunc_normal_ on every parameter": _trunc_normal_loop,
    "nn.init.xavier_normal_ on every parameter": _xavier_loop,
    "p.copy_(torch.randn_like(p)) on every parameter": _randn_like_loop,
}


def _orthogonal_loop(model: nn.Module) -> None:
    """``orthogonal_`` (and ``sparse_``, ``trunc_normal_``) return at once on a meta tensor, before any draw."""
    for p in model.parameters():
        nn.init.orthogonal_(p) if p.dim() >= 2 else nn.init.zeros_(p)


def _sparse_loop(model: nn.Module) -> None:
    for p in model.parameters():
        nn.init.sparse_(p, 0.3) if p.dim() == 2 else nn.init.zeros_(p)


LOOPS_2D = {"nn.init.orthogonal_ on every parameter": _orthogonal_loop,
            "nn.init.sparse_ on every parameter": _sparse_loop}  # module experts: 2-D weights
for _kind, _make in (("ModuleList", _module_list), ("batched", _batched), ("plain dict", _plain_dict)):
    for _spelling, _init in {**INIT_LOOPS, **(LOOPS_2D if _kind != "batched" else {})}.items():
        INIT_CASES[f"{_spelling} after apply, {_kind} experts"] = (
            lambda r, w, make=_make, init=_init: _init_parity(r, w, _with_dense_after(make), init,
                                                              through_apply=False))


def _full_copy_refused(rank: int, world_size: int) -> None:
    """The harmful twin of the init loops on batched experts: a full tensor drawn by hand and copied into a sharded
    expert parameter (``p.copy_(torch.randn(p.shape))``) would put experts [0, L) on every rank; torch refuses
    mixing the plain tensor with the DTensor, before anything is written."""
    ep = _apply(_batched(), world_size)
    before = ep.experts.gate_up_proj.to_local().clone()
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"), torch.no_grad():
        ep.experts.gate_up_proj.copy_(torch.randn(ep.experts.gate_up_proj.shape))
    assert torch.equal(ep.experts.gate_up_proj.to_local(), before)


def _value_draw_refused(rank: int, world_size: int) -> None:
    """The harmful twin on ModuleList experts: a draw whose count depends on the values (``torch.poisson`` of the
    weight) cannot be drawn for an expert another rank owns; it raises naming the expert and its owner."""
    from autoep.runtime.stand_in import RemoteExpertRead

    from autoep.runtime.recipes.local_experts import spec_of

    ep = _apply(_module_list(), world_size)
    remote = ep.experts[next(e for e in range(4) if not spec_of(ep).is_local(e))].gate_proj.weight
    with pytest.raises(RemoteExpertRead, match=r"poisson reads expert \d of MixtralStyleSparseMoeBlock, which ep "
                                               r"rank \d owns"):
        torch.poisson(remote)


INIT_CASES["harmful twin: a full tensor copied into a sharded expert parameter, refused"] = _full_copy_refused
INIT_CASES["harmful twin: a value-dependent draw on another rank's expert, refused"] = _value_draw_refused


def _hf_init_parity(rank: int, world_size: int) -> None:
    """transformers' own init through ``apply`` on a whole tiny Qwen3-MoE LM (every MoE block under EP): the
    README's spelling, ``model.apply(model._init_weights)``, gives the model's weights on every rank."""
    from test_parity_hf import moe_block_names

    ref = build_tiny_lm("qwen3_moe")
    ep = copy.deepcopy(ref)
    apply_plan(ep, ep_plan(ep, moe_block_names(ep)), init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)))
    for model in (ref, ep):
        torch.manual_seed(1234)
        model.apply(model._init_weights)
    expected, got = ref.state_dict(), _full_state(ep)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")


INIT_CASES["model.apply(model._init_weights) after apply, transformers Qwen3-MoE LM"] = _hf_init_parity


def _hf_init_weights_parity(rank: int, world_size: int) -> None:
    """transformers' own ``model.init_weights()`` (``smart_apply`` calls ``_init_weights`` on each module
    directly, never ``model.apply``) on a whole tiny Qwen3-MoE LM under EP: the model's weights on every rank.
    Every module's ``_is_hf_initialized`` flag is cleared first, as on a model built without init (else
    transformers itself skips every module)."""
    from test_parity_hf import moe_block_names

    ref = build_tiny_lm("qwen3_moe")
    ep = copy.deepcopy(ref)
    apply_plan(ep, ep_plan(ep, moe_block_names(ep)), init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)))
    before = _full_state(ep)
    for model in (ref, ep):
        for m in model.modules():
            m._is_hf_initialized = False
        torch.manual_seed(1234)
        model.init_weights()
    changed = [k for k, v in _full_state(ep).items() if not torch.equal(v, before[k])]
    assert any("experts" in k for k in changed), "init_weights() drew nothing for the experts: the case tests nothing"
    expected, got = ref.state_dict(), _full_state(ep)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")


INIT_CASES["model.init_weights() after apply, transformers Qwen3-MoE LM"] = _hf_init_weights_parity

EDP_CASES = {  # 4 ranks: experts Shard(0) over ep, replicated over edp
    f"model.apply(normal) after apply, {kind} experts, (edp, ep) = (2, 2)": (
        lambda r, w, make=make: _init_parity(r, w, _with_dense_after(make), _normal, edp=2))
    for kind, make in (("ModuleList", _module_list), ("batched", _batched))
} | {
    f"for p in model.parameters(): nn.init.normal_(p), {kind} experts, (edp, ep) = (2, 2)": (
        lambda r, w, make=make: _init_parity(r, w, _with_dense_after(make), _normal_loop, through_apply=False, edp=2))
    for kind, make in (("ModuleList", _module_list), ("batched", _batched))
}


def cases(rank: int, world_size: int, only: tuple = ()) -> dict:
    """Every case at 2 ranks, the initialisation cases at 4 (``only``: these names alone, for a rerun by hand)."""
    results: dict = {}
    every = {**INIT_CASES, **EDP_CASES} if world_size == 4 else {**INIT_CASES, **PRECISION_CASES, **MODULE_CASES}
    for name, case in every.items():
        if not only or name in only:
            guarded(results, name, case, rank, world_size)
    return results


@pytest.fixture(scope="module")
def two_ranks():
    return run_cases(2, "test_init_precision:cases")


@pytest.fixture(scope="module")
def four_ranks():
    return run_cases(4, "test_init_precision:cases")


@pytest.mark.parametrize("name", [*INIT_CASES, *PRECISION_CASES, *MODULE_CASES])
def test_two_ranks(two_ranks, name):
    assert not two_ranks[name], "\n".join(two_ranks[name])


@pytest.mark.parametrize("name", [*INIT_CASES, *EDP_CASES])
def test_four_ranks(four_ranks, name):
    assert not four_ranks[name], "\n".join(four_ranks[name])
