"""What the model's own expert loop does with an expert no row reaches (``MoeStructure.idle_experts``), as the
exchange (``autoep.runtime.dispatch``) and the module-experts recipes (``autoep.runtime.recipes.local_experts``)
both read it. A module of its own so that neither imports the other for it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

# What the model's loop does with an expert it has no row for (``MoeStructure.idle_experts``), as a status per
# expert and call: the loop skips it (its parameters keep ``grad is None``), touches it without calling it
# (minimind's ``0 * sum(p.sum() ...)``: zero gradients), or calls it, on zero rows (zero gradients).
SKIP, TOUCH, CALL = 0, 1, 2
IDLE_MODES = {"skip": SKIP, "touch": TOUCH, "call": CALL}


@dataclass(frozen=True)
class Idle:
    """How the model's own loop treats experts without rows, so the experts' gradients have its semantics: a
    parameter it leaves at ``None`` stays ``None``, one it zeroes gets zeros, an expert it does not call is not called.

    ``mode``: what the loop does with a visited expert that has no rows (``IDLE_MODES``). ``per_expert``: module
    experts, each with parameters of its own (an idle expert's are left alone), else 3-D parameters shared by
    every expert (their gradient is ``None`` only where no expert ran on any rank). ``visited_E``: the experts
    the loop visits at all (bool (E,); default all: a split loop visits the experts its counts list).
    ``params``: module experts: local expert index -> its parameters (a touch gives them zero gradients; where
    one is trainable, a rank whose experts all stay idle still gives the exchange's backward a path).

    With ``per_expert``, the exchange calls ``expert_fn(x_SD, tokens_per_local_expert, status_L)`` (``status_L``: a
    host list, per local expert the highest status any rank's loop gave it) only where some local expert is
    ``CALL``ed, and otherwise gives this rank's share of the exchange as an empty differentiable output."""

    mode: str = "call"
    per_expert: bool = False
    visited_E: Tensor | None = None
    params: Callable[[int], list[Tensor]] | None = None
