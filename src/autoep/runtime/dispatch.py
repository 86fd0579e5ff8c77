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

ExpertFn = Callable[..., Tensor]

from autoep.runtime.idle import CALL, IDLE_MODES, SKIP, TOUCH, Idle  # noqa: F401  (re-exported: recipes read them here)


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
    idle: Idle | None = None,
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
    size 1: no exchange. ``idle`` (default: every expert called, even on zero rows) says which experts the
    model's loop calls, touches or skips, and so which ``expert_fn`` calls and which gradients (``Idle``).
    Autograd flows through both exchanges; a rank with zero rows, or whose experts all stay idle, still joins
    every exchange and its backward.
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
    idle = idle or Idle()

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
    status_E = _status(tokens_per_expert_E, idle)

    if W == 1:
        # NOTE: .tolist() syncs the host once per layer for the number of non-padding pairs and the statuses.
        routed, *status_L = torch.cat([tokens_per_expert_E.sum().view(1), status_E]).tolist()
        x_sorted_SD = hidden_TD.index_select(0, perm_S[:routed] // K)
        runs = CALL in status_L
        y_sorted_SD = _local(x_sorted_SD, tokens_per_expert_E, status_L, runs, idle, expert_fn)
        if y_sorted_SD is None:
            y_sorted_SD = _touched(_idle_rows(x_sorted_SD, D, hidden_TD.dtype, idle, L), status_L, idle)
    else:
        y_sorted_SD, routed = _exchange_and_compute(hidden_TD, perm_S, K, tokens_per_expert_E, status_E, W, L,
                                                    ep_group, expert_fn, idle)

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
    # The first floating tensor: the block's hidden states (a layer may drop the rest, e.g. router logits).
    tensors = [(i, t) for i, t in enumerate(output if isinstance(output, (tuple, list)) else [output])
               if isinstance(t, Tensor) and t.is_floating_point()][:1]
    if not outs or not tensors:
        return output
    i, head = tensors[0]
    dropped = [o for o in outs if o.grad_fn is not None and not (head.grad_fn is not None and
                                                                _reaches(head.grad_fn, o.grad_fn))]
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
        # Saved, and read in backward, so that under a non-reentrant activation checkpoint the block's
        # recomputation (its forward exchanges) runs here, before the dropped exchange's backward, on a rank
        # whose block output reaches nothing else that was saved (a rank without tokens), as on its peers.
        ctx.save_for_backward(out)
        return out.clone()  # not a view: the model may edit its block's output in place

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.saved_tensors  # noqa: B018 - the unpack that triggers a checkpoint's recomputation (forward)
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


def _status(tokens_per_expert_E: Tensor, idle: Idle) -> Tensor:
    """Per expert, what this rank's loop does with it: ``CALL`` where it has rows, else the loop's idle mode where
    the loop visits it, ``SKIP`` where it does not."""
    status_E = torch.full_like(tokens_per_expert_E, IDLE_MODES[idle.mode])
    if idle.visited_E is not None:
        status_E = torch.where(idle.visited_E.to(status_E.device), status_E, torch.full_like(status_E, SKIP))
    return torch.where(tokens_per_expert_E > 0, torch.full_like(status_E, CALL), status_E)


def _local(x_SD: Tensor, tokens_per_local_expert: Tensor, status_L: list[int], runs: bool, idle: Idle,
           expert_fn: ExpertFn) -> Tensor | None:
    """This rank's experts on the rows they received, or None where none of them runs (``Idle``), touched where
    the loop touches an idle one."""
    if not runs:
        return None
    if not idle.per_expert:
        return expert_fn(x_SD, tokens_per_local_expert)
    return _touched(expert_fn(x_SD, tokens_per_local_expert, status_L), status_L, idle)


def _idle_rows(x_SD: Tensor, width: int, dtype: torch.dtype, idle: Idle, num_local: int) -> Tensor:
    """The output of the ``num_local`` experts that did not run on the (zero) rows ``x_SD``: empty, ``width``
    wide, a differentiable function of ``x_SD`` (so the backward of the exchange that brought them runs here),
    and requiring a gradient wherever the experts' own output would (a trainable local expert): the backward of
    the exchange that takes it home runs here too, as on the ranks whose experts ran (their output needs a
    gradient for their weights, even where the rows they got need none)."""
    if x_SD.shape[-1] == 0:
        rows = x_SD.new_zeros((x_SD.shape[0], width), dtype=dtype)
    else:
        rows = x_SD[:, :1].to(dtype).expand(x_SD.shape[0], width)
    if rows.requires_grad or not torch.is_grad_enabled() or idle.params is None:
        return rows
    trainable = any(p.requires_grad for e in range(num_local) for p in idle.params(e))
    return rows.detach().requires_grad_() if trainable else rows


def _touched(y_SD: Tensor, status_L: list[int], idle: Idle) -> Tensor:
    """``y_SD`` unchanged, with zero gradients for the parameters of the local experts the loop touches without
    calling them (each joined as an empty slice: no value changes, not even of a nan weight)."""
    if idle.params is None or TOUCH not in status_L:
        return y_SD
    params = [p for e, s in enumerate(status_L) if s == TOUCH for p in idle.params(e) if p.requires_grad]
    empty = [p.reshape(-1)[:0].to(y_SD.dtype).reshape(0, 1).expand(0, y_SD.shape[1]) for p in params]
    return torch.cat([y_SD, *empty]) if empty else y_SD


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _exchange_and_compute(
    hidden_TD: Tensor, perm_S: Tensor, K: int, tokens_per_expert_E: Tensor, status_E: Tensor, W: int, L: int, ep_group,
    expert_fn: ExpertFn, idle: Idle
) -> tuple[Tensor, int]:
    """Send sorted pairs to their owners, run ``expert_fn`` grouped by local expert, send results back;
    return the results in sorted order and how many pairs were routed (padding pairs excluded)."""
    E, rank = W * L, dist.get_rank(ep_group)
    # NOTE: collective. Every rank learns every rank's rows and status per expert (W x 2E integers): its own
    # experts' rows and statuses, and which ranks run no expert at all (their share needs the output width).
    mine_2E = torch.cat([tokens_per_expert_E, status_E])
    gathered = [torch.empty_like(mine_2E) for _ in range(W)]
    dist.all_gather(gathered, mine_2E.contiguous(), group=ep_group)
    counts_WE, status_WE = torch.stack(gathered).split(E, dim=1)
    recv_counts_WL = counts_WE[:, rank * L:(rank + 1) * L]
    status_L = status_WE[:, rank * L:(rank + 1) * L].amax(dim=0)
    if idle.per_expert:
        runs_W = status_WE.view(W, W, L).amax(dim=(0, 2)) == CALL  # rank q runs an expert of its own
    else:
        runs_W = (status_WE == CALL).any().expand(W)  # 3-D experts: all ranks run theirs, or none does
    # A rank running nothing that gets results back must build its (empty) share in the others' width and dtype.
    needs_width = (~runs_W & (counts_WE.sum(dim=1) > 0)).any()
    # NOTE: .tolist() syncs the host once per layer for the split sizes of both exchanges and the statuses.
    host = torch.cat([counts_WE[rank].view(W, L).sum(dim=1), recv_counts_WL.sum(dim=1), status_L, runs_W.long(),
                      needs_width.view(1).long()]).tolist()
    send_splits, recv_splits, status_L = host[:W], host[W:2 * W], host[2 * W:2 * W + L]
    runs, needs_width = bool(host[2 * W + L + rank]), bool(host[-1])
    routed = sum(send_splits)
    x_sorted_SD = hidden_TD.index_select(0, perm_S[:routed] // K)

    x_recv_SD = all_to_all(x_sorted_SD, recv_splits, send_splits, ep_group)

    # Received rows come grouped by source rank, then by local expert; regroup by local expert
    # (stable, so within one expert the source-rank order is kept). Layout change on device.
    local_ids_S = torch.arange(L, device=x_recv_SD.device).repeat(W)
    row_expert_S = torch.repeat_interleave(local_ids_S, recv_counts_WL.reshape(-1).to(x_recv_SD.device))
    regroup_S = torch.sort(row_expert_S, stable=True).indices
    x_grouped_SD = x_recv_SD.index_select(0, regroup_S)
    y_grouped_SD = _local(x_grouped_SD, recv_counts_WL.sum(dim=0), status_L, runs, idle, expert_fn)
    width, dtype = hidden_TD.shape[-1], hidden_TD.dtype
    if needs_width:
        # NOTE: collective, only in a step where some rank runs no expert but gets results back: the width and
        # dtype of the experts' outputs, from the ranks that ran them (one host sync).
        mine = [y_grouped_SD.shape[-1], _DTYPES.index(y_grouped_SD.dtype) + 1] if y_grouped_SD is not None else [0, 0]
        shape = torch.tensor(mine, dtype=torch.long, device=x_recv_SD.device)
        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=ep_group)
        width, code = shape.tolist()
        dtype = _DTYPES[code - 1]
    if y_grouped_SD is None:
        y_grouped_SD = _touched(_idle_rows(x_grouped_SD, width, dtype, idle, L), status_L, idle)
    y_recv_SD = torch.empty_like(y_grouped_SD).index_copy(0, regroup_S, y_grouped_SD)

    # Reverse exchange: results go home in the order they were sent.
    return all_to_all(y_recv_SD, send_splits, recv_splits, ep_group), routed


def ep_grouped_forward(
    rows_SD: Tensor, counts_E: Tensor, *, num_experts: int, ep_group, expert_fn: ExpertFn, idle: Idle | None = None
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
                              ep_group=ep_group, expert_fn=expert_fn, out_dtype="experts", idle=idle)
