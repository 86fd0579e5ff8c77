"""The abstract values the expert-loop proof (``autoep.detect.expert_loop``) interprets a region over, and
the facts a proven loop yields. See that module's docstring for what each value stands for.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------------------
# Abstract values
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Opaque:
    label: str  # for messages; identity is what counts


@dataclass(frozen=True)
class Obj:
    value: object


@dataclass(frozen=True)
class Sub:
    """A registered submodule of the experts, by its dotted path under them (grouped, flattened and equal-group
    experts' proofs)."""

    path: str


@dataclass(frozen=True)
class Uniform:
    """A value equal for every row but unknown at detection: a tensor's dtype or device, the feature size, a
    comparison of such values (``autoep.detect.row_local``)."""

    what: str


@dataclass(frozen=True)
class SelfRef:
    pass


@dataclass(frozen=True)
class Attr:
    """``<tensor>.dtype`` / ``.device`` / ``.shape`` of an opaque tensor."""

    of: Opaque
    name: str


@dataclass(frozen=True)
class ShapeItem:
    of: Opaque
    axis: int


@dataclass(frozen=True)
class Mask:
    idx: Opaque
    layout: str  # axis order of the one-hot tensor: "TKE" (as made), "EKT", "ETK"


@dataclass(frozen=True)
class MaskSum:
    mask: Mask


@dataclass(frozen=True)
class Hit:
    mask: Mask
    scalar: bool = False  # ``.squeeze(-1)``: each item is a 0-d expert id, not a (1,) row


@dataclass(frozen=True)
class ExpertId:
    row: bool  # a (1,) tensor row of nonzero(); ``[0]`` makes it a scalar id


@dataclass(frozen=True)
class MaskRow:
    mask: Mask
    lead: bool  # still carries the leading 1-dim of a row index (needs squeeze(0))


@dataclass(frozen=True)
class Pairs:
    roles: tuple[str, str]  # ("tok", "slot") or ("slot", "tok")


@dataclass(frozen=True)
class Index:
    role: str  # tok | slot


@dataclass(frozen=True)
class IdxEq:
    """``idx == e``: the (token, slot) pairs routed to the current expert."""


@dataclass(frozen=True)
class Count:
    """``tok.numel()`` / ``tok.shape[0]`` / ``len(tok)``: rows the current expert got."""


@dataclass(frozen=True)
class Cond:
    kind: str  # empty | nonempty | padding


@dataclass(frozen=True)
class ExpertKey:
    """``str(e)`` / ``f"{prefix}{e}{suffix}"``: the key of the current expert in a ModuleDict of experts."""

    prefix: str
    suffix: str


@dataclass(frozen=True)
class ExpertMod:
    """``self.experts[e]``: the current ModuleList expert."""


@dataclass(frozen=True)
class Param:
    name: str  # a 3-D expert parameter of the experts module, indexed by expert below


@dataclass(frozen=True)
class Method:
    name: str  # a bound method of the module (``_apply_gate``)


@dataclass(frozen=True)
class Act:
    pass


@dataclass(frozen=True)
class RowModule:
    """``self.<name>``: a submodule of batched experts proven row-local (``autoep.detect.row_norm``), e.g. a
    post-expert norm; calling it on rows is recorded as ("norm", rows, name)."""

    name: str


@dataclass(frozen=True)
class Row:
    """Per-row expression over the current expert's rows: a nested tuple, e.g.
    ("lin", ("x",), "gate_up_proj", False). ``autoep.detect.row_local`` uses four: ("x",) the input rows,
    ("view",) a view of them, ("rows",) fresh (n, D) rows, ("rows1",) one value per row (n,)."""

    expr: tuple


@dataclass(frozen=True)
class Chunks:
    expr: tuple


@dataclass(frozen=True)
class Weight:
    col: bool  # w[tok, slot] is (n,); col: (n, 1)


# ---------------------------------------------------------------------------------------------
# The proof's result
# ---------------------------------------------------------------------------------------------


@dataclass
class LoopFacts:
    """What a proven loop computes, in terms of the values it reads."""

    x: Opaque | None = None
    idx: Opaque | None = None
    w: Opaque | None = None
    acc: Opaque | None = None
    expert: tuple | None = None  # the per-expert computation over ("x",)
    uses_apply_gate: bool = False
    adds: int = 0
    add_at_rows: bool = False  # ``acc[tok] += ...`` rather than ``acc.index_add_(0, tok, ...)``
    # ``{attr: value}``: the owner's constant attributes an ``if`` of the region was folded on (its branch taken)
    folded: dict = field(default_factory=dict)
    # What the loop does with an expert that has no rows (``MoeStructure.idle_experts``): "call" it on zero rows
    # (``range(E)`` without a guard), "skip" it (iterates the experts hit, or ``if <no rows>: continue`` before
    # the expert runs), "touch" it without calling it (zero gradients), "touch_training" (only ``if self.training``)
    idle: str = "call"
    expert_ran: bool = False  # the loop body has run the expert (or read its weights) by the current statement
