"""Source operators for expert weights on the block itself (issue 31 item 3, ``autoep.detect.block_weights``; see
``mutation_operators``).

The block-weights proof rewrites the forward: each *site* ``g(R, self.w1[i], self.w2[i])`` becomes one expert call
of expert ``i`` on the rows ``R``, and ``g`` runs on ``i``'s owner on every rank's rows concatenated, with the
owner's slices. That is exact only when ``g`` is row-local in ``R``, reads expert ``i``'s slices and nothing else of
the weights, and every other read of a weight is its metadata. Each operator breaks or stresses one of these, at
each read ``self.<w>[<id>]`` (``self.experts.<w>[<id>]``) of a function that slices a weight by a name (the block's
forward, a method taking the id) or at each expression around such a read:

- ``weight_index``: the read indexed by another expression: ``self.w1[(i + 1) % E]``, ``self.w1[i + 1]``,
  ``self.w1[0]``, ``self.w1[i][:, :k]`` tiled back to its width, ``self.w1[i - E]`` and ``self.w1[i, ...]`` (the
  same slice, spelled otherwise), ``self.w1[i][:, :]``, ``self.w1[i].flip(0)``, ``self.w1[i].detach()``;
- ``site_mix_rows``: an expression holding a read mixes its rows: ``.sum(0, keepdim=True)``, ``.cumsum(0)``,
  ``.flip(0)``, ``.softmax(0)`` (the routed rows of one expert on one rank are not those on the owner);
- ``weight_outside_site``: a weight read whole beside the forward's (or method's) returned value:
  ``+ self.w1.mean()``, ``+ self.w1[0].sum() * 0.01``, ``+ self.w1.pow(2).sum(0).mean()`` (every expert's slice,
  on a rank that owns some);
- ``id_scale``: a read or an expression holding one scaled by an expert-dependent constant, ``* (i + 1)``;
- ``swap_weights``: two reads of different weights swapped, as written or each transposed (``(D, F)`` and ``(F, D)``
  swapped keep their shapes);
- ``site_inplace``: an expression holding a read edited in place: ``.mul_(2.0)``, ``.add_(0.5)``, ``.cumsum_(0)``.

Each must be refused, or be exact (outputs, input grad and every weight's grad) in one process and on 2 ranks.
"""

from __future__ import annotations

import ast
import copy
import itertools
from typing import Callable

from mutation_source import Edit, expr, slots, swap


def _rooted_at_self(node: ast.AST) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "self"


def weight_reads(tree: ast.AST) -> list[ast.Subscript]:
    """``self.<w>[<name>]`` and ``self.<child>.<w>[<name>]``: a weight sliced by a name (the loop's or method's id),
    in source order."""
    reads = [n for n in ast.walk(tree) if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute)
             and _rooted_at_self(n.value) and isinstance(n.slice, ast.Name) and isinstance(n.ctx, ast.Load)]
    return sorted(reads, key=lambda n: (n.lineno, n.col_offset))


def _weight_names(tree: ast.AST) -> list[str]:
    """The dotted names (``self.w1``, ``self.experts.w2``) of the weights ``tree`` slices or reads the shape of."""
    names = [ast.unparse(r.value) for r in weight_reads(tree)]
    names += [ast.unparse(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "shape"
              and isinstance(n.value, ast.Attribute) and _rooted_at_self(n.value)]
    return list(dict.fromkeys(n for n in names if not n.endswith((".router", ".gate"))))


def _holding_reads(tree: ast.AST) -> list[ast.expr]:
    """Calls and binary operations that hold a weight read (not an in-place call, not the read itself), in source
    order: the expressions of a site and those around it."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call | ast.BinOp) and weight_reads(n):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr.endswith("_"):
                continue
            out.append(n)
    return sorted(out, key=lambda n: (n.lineno, n.col_offset, -(n.end_col_offset or 0)))


def _per_node(fn: ast.FunctionDef, locate: Callable, templates: list[str], subst: Callable | None = None) -> list[Edit]:
    """One edit per (located node, template): the node replaced by ``template`` with ``{x}`` the node and the
    names ``subst(node)`` gives."""
    edits = []
    for k, template in itertools.product(range(len(locate(fn))), templates):
        tree = copy.deepcopy(fn)
        node = locate(tree)[k]
        names = subst(node) if subst else {}
        swap(tree, node, expr(template.replace("{x}", "__x__").format(**names), __x__=node))
        edits.append(Edit(tree))
    return edits


def _read_names(node: ast.Subscript) -> dict:
    return {"w": ast.unparse(node.value), "i": node.slice.id}


INDEX_TEMPLATES = [
    "{w}[({i} + 1) % {w}.shape[0]]",  # another expert's weight
    "{w}[{i} + 1]",
    "{w}[0]",
    "{w}[{i}][:, :{w}.shape[-1] // 2].repeat(1, 2)",  # a part of the slice, tiled back to its width
    "{w}[{i} - {w}.shape[0]]",  # the same slice, spelled otherwise
    "{w}[{i}, ...]",
    "{x}[:, :]",
    "{x}.flip(0)",  # a function of the slice alone
    "{x}.detach()",  # no gradient to the weight
]


def op_weight_index(fn, site):
    """Each read ``self.w[i]`` indexed by another expression (``INDEX_TEMPLATES``)."""
    return _per_node(fn, weight_reads, INDEX_TEMPLATES, _read_names)


def op_site_mix_rows(fn, site):
    """Each expression holding a read mixes its rows: summed, cumulated, flipped or soft-maxed over dim 0."""
    return _per_node(fn, _holding_reads, ["{x}.sum(0, keepdim=True)", "{x}.cumsum(0)", "{x}.flip(0)",
                                          "{x}.softmax(0)"])


def op_weight_outside_site(fn, site):
    """Each weight read whole beside each returned value: ``+ self.w.mean()`` and two others."""
    names = _weight_names(fn)
    returns = [s for s in slots(fn) if isinstance(s.stmt, ast.Return) and s.stmt.value is not None]
    edits = []
    for k, w, template in itertools.product(range(len(returns)), names,
                                            ["{w}.mean()", "{w}[0].sum() * 0.01", "{w}.pow(2).sum(0).mean()"]):
        tree = copy.deepcopy(fn)
        ret = [s for s in slots(tree) if isinstance(s.stmt, ast.Return) and s.stmt.value is not None][k].stmt
        old = ret.value.elts[0] if isinstance(ret.value, ast.Tuple) else ret.value
        swap(tree, old, expr(f"__x__ + {template.format(w=w)}", __x__=old))
        edits.append(Edit(tree))
    return edits


def op_id_scale(fn, site):
    """Each read, then each expression holding one, times ``(i + 1)`` (the read's id)."""
    ids = {}

    def locate(tree):
        found = weight_reads(tree) + _holding_reads(tree)
        for n in found:  # an expression's id: its first read's
            ids[id(n)] = (n if isinstance(n, ast.Subscript) else weight_reads(n)[0]).slice.id
        return found

    return _per_node(fn, locate, ["({x}) * ({i} + 1)"], lambda n: {"i": ids[id(n)]})


def op_swap_weights(fn, site):
    """Two reads of different weights swapped: as written, and each transposed."""
    def pairs(tree):
        reads = weight_reads(tree)
        return [(a, b) for a, b in itertools.combinations(reads, 2) if ast.unparse(a.value) != ast.unparse(b.value)]

    edits = []
    for k, template in itertools.product(range(len(pairs(fn))), ["{x}", "{x}.transpose(-2, -1)"]):
        tree = copy.deepcopy(fn)
        a, b = pairs(tree)[k]
        new_a = expr(template.replace("{x}", "__x__"), __x__=b)
        new_b = expr(template.replace("{x}", "__x__"), __x__=a)
        swap(tree, a, new_a)
        swap(tree, b, new_b)
        edits.append(Edit(tree))
    return edits


def op_site_inplace(fn, site):
    """Each expression holding a read edited in place (``.mul_(2.0)``, ``.add_(0.5)``, ``.cumsum_(0)``)."""
    return _per_node(fn, _holding_reads, ["{x}.mul_(2.0)", "{x}.add_(0.5)", "{x}.cumsum_(0)"])


BLOCK_WEIGHT_OPERATORS: dict[str, Callable] = {
    "weight_index": op_weight_index,
    "site_mix_rows": op_site_mix_rows,
    "weight_outside_site": op_weight_outside_site,
    "id_scale": op_id_scale,
    "swap_weights": op_swap_weights,
    "site_inplace": op_site_inplace,
}
