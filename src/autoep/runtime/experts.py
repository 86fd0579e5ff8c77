"""Local expert compute in grouped form: rows sorted by local expert, one grouped GEMM per projection.

Shape legend: S rows (token, expert) pairs sorted by local expert, D hidden, F expert intermediate
size, L local experts.

Weight layouts (``transposed=False`` is the transformers/torch ``nn.Linear`` convention):
  gate_up_w (L, 2F, D), down_w (L, D, F)   applied as x @ w[e].T
  gate_up_w (L, D, 2F), down_w (L, F, D)   transposed: applied as x @ w[e]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

_grouped_mm_op = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands the grouped-mm backward a row-major gradient.

    The grouped-mm backward rejects expanded gradients (e.g. the stride-0 grad of ``y.sum()``) and
    a size-1 dim with an odd stride (see ``_row_major``).
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return _row_major(grad)


def _row_major(t: Tensor) -> Tensor:
    """``t`` with exactly row-major strides and a 16-byte aligned base, copied only when it lacks them.

    ``Tensor.contiguous()`` is not enough: it ignores the stride of a size-1 dim (a single row, or an
    expert with one token), but the grouped-mm kernels read that stride to tell a transposed operand
    from a plain one, and refuse it ("strides should be multiple of 16 bytes") when it is odd.
    """
    strides, step = [], 1
    for n in reversed(t.shape):
        strides.insert(0, step)
        step *= n
    # An empty tensor is copied too: an expanded one counts as contiguous but keeps its 0 strides.
    if t.numel() and tuple(strides) == t.stride() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)  # NOTE: a copy (differentiable), canonical and aligned


def _aligned(t: Tensor) -> bool:
    # The grouped-mm kernels need every stride but the unit one and the base pointer 16-byte aligned.
    item = t.element_size()
    strides_ok = all((s * item) % 16 == 0 for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1)
    return strides_ok and t.data_ptr() % 16 == 0


def can_use_grouped_mm(x_SD: Tensor, w_LIO: Tensor) -> bool:
    """Whether ``grouped_mm(x, w)`` (w viewed as (L, in, out)) runs on this device, dtype and layout."""
    if _grouped_mm_op is None or x_SD.dtype != w_LIO.dtype:
        return False
    if 0 in w_LIO.shape[1:]:
        # A zero-width expert (in or out size 0; a tiny config can give one): the kernels read the strides of
        # an empty operand and refuse them ("strides should be multiple of 16 bytes"). The loop is exact.
        return False
    if x_SD.device.type == "cuda":
        # CUDA kernels: bf16 only in every torch that has them; sm80+.
        if w_LIO.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x_SD.device) < (8, 0):
            return False
    elif x_SD.device.type != "cpu" or w_LIO.dtype not in (torch.float32, torch.bfloat16):
        return False
    # The output and the backward's transposed operands need the in/out row sizes aligned as well.
    item = x_SD.element_size()
    rows_ok = (w_LIO.shape[-1] * item) % 16 == 0 and (w_LIO.shape[-2] * item) % 16 == 0
    return rows_ok and _aligned(x_SD) and _aligned(w_LIO)


def grouped_linear(x_SD: Tensor, tokens_per_expert: Tensor, w_LIO: Tensor, bias_LO: Tensor | None = None) -> Tensor:
    """``y[s] = x[s] @ w[e(s)] (+ bias[e(s)])`` for rows grouped by expert (``w`` as (L, in, out)). Under autocast
    the product runs in the autocast dtype, as ``x @ w`` and ``F.linear`` do in the experts' own forward
    (``torch._grouped_mm`` has no autocast rule of its own); the bias is added as given (``x @ w + b``)."""
    x_SD, w_LIO = autocast_operands(x_SD, w_LIO)
    x_SD = _row_major(x_SD)
    if can_use_grouped_mm(x_SD, w_LIO):
        offs = torch.cumsum(tokens_per_expert, dim=0).to(torch.int32)
        y = _ContiguousGrad.apply(_grouped_mm_op(x_SD, w_LIO, offs=offs))
    else:
        y = _loop_linear(x_SD, tokens_per_expert, w_LIO)
    if bias_LO is not None:
        expert_of_row = torch.repeat_interleave(
            torch.arange(w_LIO.shape[0], device=x_SD.device), tokens_per_expert.to(x_SD.device), output_size=x_SD.shape[0]
        )
        y = y + bias_LO.index_select(0, expert_of_row)
    return y


def autocast_operands(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The operands a matmul (``@``, ``F.linear``) computes on: under autocast for their device type, every
    floating tensor but float64 cast to the autocast dtype (autocast's own rule for the ops it runs in lower
    precision; the casts are differentiable, so fp32 weights get fp32 gradients); as given otherwise."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors)


def _loop_linear(x_SD: Tensor, tokens_per_expert: Tensor, w_LIO: Tensor) -> Tensor:
    # NOTE: .tolist() syncs the host once for the group sizes (exact fallback path only).
    chunks = torch.split(x_SD, tokens_per_expert.tolist())
    outs = [chunk @ w_LIO[e] for e, chunk in enumerate(chunks)]
    # An expert with no rows still contributes an (empty) product, so its weight gets a zero gradient (3-D
    # weights: the model's gradient of the whole tensor is zero there too, where any expert ran).
    return torch.cat(outs) if outs else x_SD.new_empty((0, w_LIO.shape[-1]))


def grouped_swiglu(
    x_SD: Tensor,
    tokens_per_expert: Tensor,
    gate_up_w: Tensor,
    down_w: Tensor,
    *,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    transposed: bool = False,
    apply_gate: Callable[[Tensor], Tensor],
) -> Tensor:
    """Gated expert MLP on rows grouped by local expert: ``down(apply_gate(gate_up(x)))``.

    ``gate_up_w`` is (L, 2F, D) or, ``transposed``, (L, D, 2F); ``down_w`` (L, D, F) or (L, F, D).
    ``apply_gate(h_S2F) -> h_SF`` is the model's own gate (e.g. the experts' ``_apply_gate``).
    Uses ``torch._grouped_mm``/``F.grouped_mm`` when shapes and 16-byte alignment allow, an exact loop
    otherwise; returns (S, D).
    """
    gate_up_LIO = gate_up_w if transposed else gate_up_w.transpose(-2, -1)
    down_LIO = down_w if transposed else down_w.transpose(-2, -1)
    h_S2F = grouped_linear(x_SD, tokens_per_expert, gate_up_LIO, gate_up_bias)
    h_SF = apply_gate(h_S2F)
    return grouped_linear(h_SF, tokens_per_expert, down_LIO, down_bias)


def grouped_split_glu(
    x_SD: Tensor,
    tokens_per_expert: Tensor,
    gate_LDF: Tensor,
    up_LDF: Tensor,
    down_LFD: Tensor,
    *,
    act_fn: Callable[[Tensor], Tensor],
) -> Tensor:
    """Gated expert MLP with separate gate and up weights, every weight as (L, in, out):
    ``(act_fn(x @ gate[e]) * (x @ up[e])) @ down[e]`` on rows grouped by local expert; returns (S, D)."""
    h_SF = act_fn(grouped_linear(x_SD, tokens_per_expert, gate_LDF)) * grouped_linear(x_SD, tokens_per_expert, up_LDF)
    return grouped_linear(h_SF, tokens_per_expert, down_LFD)


class _StackedParameters(torch.autograd.Function):
    """``stacked`` (a tensor whose slices ARE the given parameters' memory) as one differentiable tensor, no copy.

    Forward returns an alias of ``stacked``; backward hands each parameter ``grad[index]`` (a view of the one
    stacked gradient), so every parameter gets an ordinary gradient of its own through its own ``AccumulateGrad``:
    tensor hooks, post-accumulate-grad hooks and ``.grad`` behave as with the parameters used one by one. The
    parameters are saved for backward where the backward reads their values, so an in-place edit of one between
    forward and backward raises torch's own error there (as the experts' own forward would; a ``torch.stack`` of
    them would silently use the values of the forward).
    """

    @staticmethod
    def forward(ctx, stacked: Tensor, indices: tuple, read_in_backward: bool, *params: Tensor) -> Tensor:
        ctx.indices = indices
        if read_in_backward:
            ctx.save_for_backward(*params)
        return stacked.view_as(stacked)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.saved_tensors  # torch's version check: raises if a parameter was edited in place since the forward
        needs = ctx.needs_input_grad[3:]
        return (None, None, None, *(grad[i] if need else None for i, need in zip(ctx.indices, needs)))


def stacked_parameters(stacked: Tensor, indices: tuple, params: list[Tensor], *, read_in_backward: bool = True,
                       idle: tuple[bool, ...] = ()) -> Tensor:
    """``stacked`` as a differentiable function of ``params``, where ``params[j]`` is (shares memory with)
    ``stacked[indices[j]]``: the zero-copy ``torch.stack`` of parameters that already live stacked. The caller
    guarantees the aliasing; gradients are ``grad[indices[j]]`` (views of one buffer), none at all for ``params[j]``
    where ``idle[j]`` (an expert the model's loop skips): those are not inputs of the graph at all, so their
    ``.grad`` stays as the model leaves it and none of their hooks fires, as where the loop never touched them.
    ``read_in_backward``: the backward reads the weights' values (the gradient of what they multiply is needed), so
    an in-place edit of one since the forward raises, as where the parameters themselves were saved (``F.linear``)."""
    used = [(i, p) for j, (i, p) in enumerate(zip(indices, params)) if not (idle and idle[j])]
    return _StackedParameters.apply(stacked, tuple(i for i, _ in used), read_in_backward, *(p for _, p in used))


def glu_gate(act_fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """The concatenated-layout SwiGLU gate: ``act_fn(gate) * up`` with ``gate, up = h.chunk(2, -1)``."""

    def apply_gate(h_S2F: Tensor) -> Tensor:
        gate, up = h_S2F.chunk(2, dim=-1)
        return act_fn(gate) * up

    return apply_gate
