"""Experts containers with a forward of their own: a ``ModuleDict`` (or ``ModuleList``) subclass whose
``forward(hidden, routing, weights)`` is the expert loop over its own entries (transformers 5.x Switch
Transformers and NLLB-MoE)::

    final = torch.zeros_like(hidden)
    expert_mask = selected_experts.permute(2, 1, 0)          # a (T, K, E) dispatch mask it is given
    # or: one_hot(router_mask, num_classes=self.num_experts).permute(2, 1, 0)   (expert ids, as Mixtral)
    for expert_idx in torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero():
        idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
        rows = self[f"expert_{expert_idx[0]}"](hidden[None, top_x].reshape(-1, D)) * weights[top_x, idx, None]
        final.index_add_(0, top_x, rows.to(hidden.dtype))
    return final

The region autoep replaces is that forward (the block's one call of it stays the model's code); the proof is
the expert-loop interpreter (``autoep.detect.expert_loop.Prover``) run on it with ``self`` the container,
plus what the runtime needs to reproduce it exactly:

- expert e is the container's e-th entry, under the key ``f"{prefix}{e}{suffix}"`` of the loop's index; the
  experts are the leading entries with such keys, other entries (a ``token_dropout`` module) are no experts;
- the routing argument is expert ids (made one-hot by the loop) or a dispatch mask (permuted by it), whose
  nonzero entries of hit experts are exactly the routed (token, slot, expert) triples
  (``autoep.runtime.recipes.container_loop`` turns it into ids, for any mask);
- ``if`` statements on the container's constant attributes are folded (NLLB's ``moe_token_dropout > 0``),
  recorded in ``ContainerLoop.folded``; a branch on ``self.training`` is refused, naming the random module
  its training branch runs (NLLB's token dropout with p > 0).

The experts themselves are proven row-local, deterministic and stateless (``autoep.detect.row_local``); they
run as themselves on the rank that owns them.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

import torch.nn as nn

from autoep.detect import elementwise
from autoep.detect.expert_loop import Prover, expert_key_id, strip_casts
from autoep.detect.experts_proof import BatchedRoles, _prove_batched_forward, experts_forward
from autoep.detect.loop_values import ExpertKey
from autoep.detect.row_local import fold_repr
from autoep.detect.source import Refusal, function_tree


@dataclass(frozen=True)
class ContainerLoop:
    """A proven experts container forward: which argument is which (``roles``), whether its routing argument
    is a dispatch mask (``mask``) or expert ids, how many experts (its leading entries), and the constant
    attributes an ``if`` in the loop was folded on (``(attr, repr)``)."""

    roles: BatchedRoles
    mask: bool
    num_experts: int
    layout: str = ""  # the dispatch mask's axis order as the loop permutes it: "EKT" | "ETK"
    folded: tuple[tuple[str, str], ...] = ()


def has_own_loop(container) -> bool:
    """A ``ModuleList``/``ModuleDict`` subclass with a forward of its own (the experts' loop, if proven)."""
    return isinstance(container, (nn.ModuleList, nn.ModuleDict)) and \
        type(container) not in (nn.ModuleList, nn.ModuleDict) and type(container).forward is not nn.Module.forward


def container_loop(container: nn.Module) -> ContainerLoop:
    """Prove the container's own forward is the expert loop (module docstring), or ``Refusal``."""
    cls = type(container)
    elementwise.runtime_clean(container, f"experts {cls.__name__}")
    fn = experts_forward(cls)
    tree = function_tree(fn)
    num_experts = _num_experts(container, tree, cls.__name__)
    p = Prover(fn, tree, container, num_experts, batched=False, experts=container)
    p.dispatch_masks = True
    roles = _prove_batched_forward(p, tree)
    f = p.facts
    if f.acc is not p.zeros_of_x or p.zeros_src is not f.x:
        raise Refusal(f"{p.where} does not add into zeros shaped like its hidden states")
    if f.expert is None or strip_casts(f.expert) != ("expert", ("x",)):
        raise Refusal(f"{p.where}: the loop adds {f.expert}, not expert(x[tok]) × weight")
    if f.add_at_rows:
        raise Refusal(f"{p.where}: the loop writes `acc[tok] += ...`, which this recipe does not reproduce")
    folded = tuple(sorted((k, fold_repr(v)) for k, v in f.folded.items()))
    return ContainerLoop(roles, bool(f.idx_mask), num_experts, f.mask_layout, folded)


def _num_experts(container: nn.Module, tree: ast.FunctionDef, name: str) -> int:
    """The experts: every entry of a ``ModuleList``; a ``ModuleDict``'s leading entries whose keys are the
    loop's ``f"{prefix}{e}{suffix}"`` for e = 0, 1, ... (the one key spelling the forward indexes ``self`` by)."""
    if isinstance(container, nn.ModuleList):
        return len(container)
    keys = [_key_pattern(node) for node in ast.walk(tree)
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "self"]
    patterns = set(keys)
    if len(patterns) != 1 or None in patterns:
        raise Refusal(f"{name}.forward does not index self by one key f\"<prefix>{{e}}<suffix>\" of the expert id")
    (pattern,) = patterns
    n = 0
    for key in container.keys():
        if expert_key_id(key, pattern) != n:
            break
        n += 1
    if n == 0:
        raise Refusal(f"{name}'s first entry is not {pattern.prefix}0{pattern.suffix}: no experts under the key the "
                      "forward indexes")
    return n


def _key_pattern(node: ast.Subscript) -> ExpertKey | None:
    """``self[f"{prefix}{<name or name[0]>}{suffix}"]`` or ``self[str(<...>)]``: the key's constant parts."""
    sl = node.slice
    if isinstance(sl, ast.Call) and isinstance(sl.func, ast.Name) and sl.func.id == "str" and len(sl.args) == 1:
        return ExpertKey("", "")
    if not isinstance(sl, ast.JoinedStr):
        return None
    parts = [v.value if isinstance(v, ast.Constant) else None for v in sl.values]
    if parts.count(None) != 1 or not all(isinstance(x, str) for x in parts if x is not None):
        return None
    i = parts.index(None)
    return ExpertKey("".join(parts[:i]), "".join(parts[i + 1:]))
