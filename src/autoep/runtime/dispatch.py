"""Token exchange for expert parallelism: send every (token, expert) pair to the rank that owns the
expert, run the local experts on what arrived, send the results back and combine them per token.

Shape legend: T tokens on this rank, K top-k, D hidden, S (token, expert) pairs (= T*K sent, or the
number received), E routed experts in the model, L experts local to this rank (E // ep_size),
W ep ranks.

Experts are split contiguously: rank r owns experts [r*L, (r+1)*L). Sorting pairs by expert id thus
also groups them by destination rank, so one stable sort serves both the exchange and the grouping.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from autoep.runtime import live_state

ExpertFn = Callable[[Tensor, Tensor], Tensor]


class _AllToAll(torch.autograd.Function):
    """Uneven ``all_to_all_single`` whose backward is the reverse exchange (splits swapped).

    Written here rather than taken from ``torch.distributed.nn.functional.all_to_all_single`` so the
    backward makes its incoming gradient contiguous (gloo and NCCL both need it) and so the same code
    runs with zero-row sends or receives on every backend.
    """

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        # NOTE: collective in backward. Every rank runs the same forward collectives in the same order, so
        # autograd replays their reverses in the same (reverse) order on every rank.
        grad_in = _all_to_all(grad_out, ctx.in_splits, ctx.out_splits, ctx.group)
        return grad_in, None, None, None


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    # NOTE: collective. Every rank calls it even when it sends and receives zero rows, or peers would hang.
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    """Differentiable uneven all-to-all of the rows of ``x``: ``in_splits[r]`` rows go to rank r,
    ``out_splits[r]`` rows arrive from rank r, concatenated in rank order."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _ep_size(ep_group) -> int:
    if ep_group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(ep_group)


def ep_experts_forward(
    hidden_TD: Tensor,
    top_k_index_TK: Tensor,
    top_k_weights_TK: Tensor,
    *,
    num_experts: int,
    ep_group,
    expert_fn: ExpertFn,
    out_dtype: torch.dtype | str | None = None,
    acc_dtype: torch.dtype | None = None,
) -> Tensor:
    """Compute ``sum_k top_k_weights[t, k] * expert_{top_k_index[t, k]}(hidden[t])`` with experts
    spread over ``ep_group``; pairs whose id is outside [0, num_experts) (padding) add nothing, as in
    the models' own loops, which skip them.

    Each rank's (token, expert) pairs go to the rank owning the expert (experts split contiguously,
    ``num_experts // ep_size`` per rank) by an uneven all-to-all (one host sync for split sizes);
    ``expert_fn(x_SD, tokens_per_local_expert)`` runs on the received rows sorted by local expert
    (``tokens_per_local_expert`` a LongTensor[L] on the rows' device) and returns ``y_SD``; results go
    back by the reverse all-to-all, are weighted by ``top_k_weights`` and summed per token in fp32 in
    top-k order; with a narrower ``acc_dtype`` (the model's loop accumulates in bf16, say) the weighted
    outputs are rounded and summed in it in expert order, as that loop does. Returns (T, D) in
    ``out_dtype`` (default ``hidden_TD``'s dtype; ``"experts"``: the experts' outputs' own). ``ep_group`` None or of
    size 1: no exchange. Autograd flows through both exchanges; a rank with zero rows still joins every
    exchange.
    """
    if hidden_TD.dim() != 2 or top_k_index_TK.dim() != 2 or top_k_weights_TK.shape != top_k_index_TK.shape:
        raise ValueError(
            f"expert exchange got hidden {tuple(hidden_TD.shape)}, expert ids {tuple(top_k_index_TK.shape)} and "
            f"weights {tuple(top_k_weights_TK.shape)}; it needs (T, D), (T, K) and (T, K)"
        )
    live_state.check_fast_path()  # a patch or mode the model's experts would honour and expert_fn would not
    T, K = top_k_index_TK.shape
    D = hidden_TD.shape[-1]
    W = _ep_size(ep_group)
    if num_experts % W:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={W}; pick an ep_size dividing it")
    L = num_experts // W

    expert_ids_S = top_k_index_TK.reshape(-1)
    # Padding ids sort after every expert (sentinel E) and are neither sent nor computed.
    valid_S = (expert_ids_S >= 0) & (expert_ids_S < num_experts)
    if expert_ids_S.is_floating_point():
        # The model's loop compares ids with ``== e``: a float id equal to an integer e is expert e, any
        # other value (2.5, nan) matches no expert and adds nothing.
        valid_S = valid_S & (expert_ids_S == expert_ids_S.round())
    expert_ids_S = torch.where(valid_S, expert_ids_S, torch.full_like(expert_ids_S, num_experts)).long()
    # Stable sort: pairs of one expert keep token order, so every rank sees a deterministic layout.
    sorted_ids_S, perm_S = torch.sort(expert_ids_S, stable=True)
    tokens_per_expert_E = torch.bincount(sorted_ids_S, minlength=num_experts + 1)[:num_experts]

    if W == 1:
        # NOTE: .item() syncs the host once per layer for the number of non-padding pairs.
        routed = int(tokens_per_expert_E.sum().item())
        x_sorted_SD = hidden_TD.index_select(0, perm_S[:routed] // K)
        y_sorted_SD = expert_fn(x_sorted_SD, tokens_per_expert_E)
    else:
        y_sorted_SD, routed = _exchange_and_compute(hidden_TD, perm_S, K, tokens_per_expert_E, W, L, ep_group, expert_fn)

    # Undo the sort: row s of y_SD is pair s = t*K + k again; padding pairs stay zero (layout change).
    # The experts' output width (D, or another where the experts project elsewhere: VitPose's part features).
    D = y_sorted_SD.shape[-1]
    y_SD = y_sorted_SD.new_zeros((T * K, D)).index_copy(0, perm_S[:routed], y_sorted_SD)
    # The weights are the model's tensor: the product below saves them for backward, so it gets a copy of
    # its own (the model's loop saved indexed copies; it may edit its weights in place after the loop).
    if acc_dtype is not None and acc_dtype != torch.float32:
        out_TD = _combine_like_the_loop(y_SD.view(T, K, D), top_k_weights_TK.clone(), top_k_index_TK, acc_dtype)
    else:
        # Each product in the dtype the loop's ``y * w`` promotes to (rounded there: bf16 outputs times bf16 weights
        # under autocast), then summed in fp32.
        product = torch.promote_types(y_SD.dtype, top_k_weights_TK.dtype)
        weighted_TKD = y_SD.view(T, K, D).to(product) * top_k_weights_TK.to(product, copy=True).unsqueeze(-1)
        out_TD = weighted_TKD.float().sum(dim=1)
    out_TD = out_TD.to(y_SD.dtype if out_dtype == "experts" else out_dtype or hidden_TD.dtype)
    if W > 1:
        _exchanged(out_TD)
    return out_TD


# ---------------------------------------------------------------------------------------------
# Every rank joins the backward exchange
# ---------------------------------------------------------------------------------------------

_open = threading.local()  # .outs: the outputs of the exchanges run since the current block began


def _exchanged(out: Tensor) -> None:
    outs = getattr(_open, "outs", None)
    if outs is not None and out.requires_grad:
        outs.append(out)


def open_exchanges() -> None:
    """A block begins: record the outputs of the exchanges it runs (``join_exchanges`` at its end)."""
    _open.outs = []


def join_exchanges(output):
    """A block ended with ``output``: every exchange it ran whose output the block dropped from its graph
    (torchtune's ``if routed_output.numel() > 0:`` on a rank without tokens) is joined to ``output``, so
    this rank still runs that exchange's backward, which its peers wait in. Values are unchanged: the
    join is an identity whose backward gives the dropped output a zero gradient. Returns ``output``
    (a copy of its first tensor joined where something was dropped)."""
    outs, _open.outs = getattr(_open, "outs", None) or [], None
    tensors = [(i, t) for i, t in enumerate(output if isinstance(output, (tuple, list)) else [output])
               if isinstance(t, Tensor) and t.requires_grad and t.grad_fn is not None]
    if not outs or not tensors:
        return output
    i, head = tensors[0]
    dropped = [o for o in outs if o.grad_fn is not None and not any(_reaches(t.grad_fn, o.grad_fn) for _, t in tensors)]
    if not dropped:
        return output
    joined = _Join.apply(head, *dropped)
    if isinstance(output, Tensor):
        return joined
    items = list(output)
    items[i] = joined
    return type(output)(items) if isinstance(output, list) or type(output) is tuple else type(output)(*items)


def _reaches(node, target) -> bool:
    """Whether the autograd graph from ``node`` reaches ``target``. Nodes made before ``target`` (a lower
    sequence number) cannot lead to it and are not walked: the walk stays inside the block's tail."""
    limit, stack, seen = target._sequence_nr(), [node], set()
    while stack:
        n = stack.pop()
        if n is target:
            return True
        if id(n) in seen:
            continue
        seen.add(id(n))
        stack += [m for m, _ in n.next_functions if m is not None and (m is target or m._sequence_nr() >= limit)]
    return False


class _Join(torch.autograd.Function):
    """``out`` (a copy), with a zero gradient for each of ``dropped`` in backward."""

    @staticmethod
    def forward(ctx, out: Tensor, *dropped: Tensor) -> Tensor:
        ctx.dropped = [(d.shape, d.dtype, d.device) for d in dropped]
        return out.clone()  # not a view: the model may edit its block's output in place

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.dropped))


def _combine_like_the_loop(y_TKD: Tensor, top_k_weights_TK: Tensor, top_k_index_TK: Tensor, acc_dtype) -> Tensor:
    """The experts' own loop in a narrow accumulator: each product ``y * w`` (in their promoted dtype)
    rounded to ``acc_dtype``, added per token in expert order (the loop visits experts in id order),
    rounding after each add. In fp32 the plain fp32 sum is used instead (same value to rounding)."""
    contrib_TKD = (y_TKD * top_k_weights_TK.unsqueeze(-1)).to(acc_dtype)
    order_TK = torch.argsort(top_k_index_TK, dim=1, stable=True)  # layout change: expert order per token
    contrib_TKD = contrib_TKD.gather(1, order_TK.unsqueeze(-1).expand_as(contrib_TKD))
    acc_TD = contrib_TKD.new_zeros(contrib_TKD[:, 0].shape)
    for k in range(contrib_TKD.shape[1]):
        acc_TD = acc_TD + contrib_TKD[:, k]
    return acc_TD


def _exchange_and_compute(
    hidden_TD: Tensor, perm_S: Tensor, K: int, tokens_per_expert_E: Tensor, W: int, L: int, ep_group, expert_fn: ExpertFn
) -> tuple[Tensor, int]:
    """Send sorted pairs to their owners, run ``expert_fn`` grouped by local expert, send results back;
    return the results in sorted order and how many pairs were routed (padding pairs excluded)."""
    # NOTE: collective. Each rank learns how many rows every peer sends to each of its local experts:
    # row r of recv_counts_WL is what rank r sends to this rank's experts.
    recv_counts_WL = torch.empty_like(tokens_per_expert_E)
    dist.all_to_all_single(recv_counts_WL, tokens_per_expert_E.contiguous(), group=ep_group)
    recv_counts_WL = recv_counts_WL.view(W, L)
    send_counts_W = tokens_per_expert_E.view(W, L).sum(dim=1)
    # NOTE: .tolist() syncs the host once per layer for the split sizes of both exchanges.
    counts = torch.cat([send_counts_W, recv_counts_WL.sum(dim=1)]).tolist()
    send_splits, recv_splits = counts[:W], counts[W:]
    routed = sum(send_splits)
    x_sorted_SD = hidden_TD.index_select(0, perm_S[:routed] // K)

    x_recv_SD = all_to_all(x_sorted_SD, recv_splits, send_splits, ep_group)

    # Received rows come grouped by source rank, then by local expert; regroup by local expert
    # (stable, so within one expert the source-rank order is kept). Layout change on device.
    local_ids_S = torch.arange(L, device=x_recv_SD.device).repeat(W)
    row_expert_S = torch.repeat_interleave(local_ids_S, recv_counts_WL.reshape(-1).to(x_recv_SD.device))
    regroup_S = torch.sort(row_expert_S, stable=True).indices
    y_grouped_SD = expert_fn(x_recv_SD.index_select(0, regroup_S), recv_counts_WL.sum(dim=0))
    y_recv_SD = torch.empty_like(y_grouped_SD).index_copy(0, regroup_S, y_grouped_SD)

    # Reverse exchange: results go home in the order they were sent.
    return all_to_all(y_recv_SD, send_splits, recv_splits, ep_group), routed


def ep_grouped_forward(
    rows_SD: Tensor, counts_E: Tensor, *, num_experts: int, ep_group, expert_fn: ExpertFn
) -> Tensor:
    """Rows already grouped by expert (``counts_E[e]`` contiguous rows for expert e, in expert order) ->
    each row through its own expert, same order: ``sum(counts_E)`` rows in the dtype the experts computed them in
    (``rows_SD``'s, or the autocast dtype, as the experts' own forward returns them).

    The exchange of ``ep_experts_forward`` with one slot per row and weight one (``y * 1.0`` in fp32 and
    back is exact, so values and gradients are the experts' own).
    """
    ids_S = torch.repeat_interleave(torch.arange(num_experts, device=rows_SD.device), counts_E.to(rows_SD.device))
    ones_S1 = torch.ones((ids_S.shape[0], 1), dtype=torch.float32, device=rows_SD.device)
    return ep_experts_forward(rows_SD[: ids_S.shape[0]], ids_S.unsqueeze(1), ones_S1, num_experts=num_experts,
                              ep_group=ep_group, expert_fn=expert_fn, out_dtype="experts")
