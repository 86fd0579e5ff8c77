"""Batched experts whose weights are stored flattened on a submodule (DBRX): the proof's extra values,
and the layout a proven forward computes.

DBRX keeps each expert weight as one ``(E*F, D)`` parameter of ``experts.mlp`` and its experts' loop
reads expert ``e`` as ``self.mlp.w1.view((-1, F, D))[e]`` (transformers 5.x) or as item ``e`` of
``[c.squeeze(dim=0) for c in self.mlp.w1.view(E, F, D).chunk(E, dim=0)]`` over ``range(0, E)`` (4.57),
then calls ``self.mlp(rows, w1, v1, w2)``, whose forward is ``act(x @ w1.T) * (x @ v1.T) @ w2``. Its
hidden states come in as ``(B, S, D)``: the forward flattens them to rows (``reshape(-1, D)``, or
``view(-1, h)`` after ``b, s, h = x.shape``) and gives the result their shape back. ``FlatProver``
follows exactly that on top of the expert-loop whitelist (``autoep.detect.expert_loop.Prover``):

  Sub        ``self.<name>``: a registered submodule of the experts (its 2-D parameters and ints, or a
             call of it)
  FlatWeight ``self.<sub>.<param>``: a 2-D parameter, usable only through ``.view((-1 | E, F, D))``
  FlatView   that view: indexed by the loop's expert id it is expert ``e``'s ``(F, D)`` weight, the
             ``("param", path)`` value of the loop proof; ``.T`` / ``.t()`` of it is ``("param_t", path)``
  FlatChunks, ChunkItem, FlatList   ``view.chunk(E, dim=0)``, one chunk, and the list of squeezed
             chunks, which indexed by the expert id is the same ``("param", path)``
  rows       ``x.matmul(w)`` / ``x @ w`` of rows and an expert weight: ``("lin", rows, path, w is not .T)``
  RowsOf, AccView   the hidden argument flattened to rows, and the accumulator given its shape back
  a call of ``self.<sub>(...)`` interprets the submodule's own forward over the abstract arguments
  (weights passed as arguments), refusing anything but assignments and one returned row value;
  ``range(E)`` / ``range(0, E)`` is the loop over every expert where E is what the views prove.

``flat_layout`` reads the proven computation back and checks it against the real parameters: each
viewed weight is ``(E*F, D)`` with the view's F and D (so the view splits dim 0 into whole experts),
every ``D`` the forward writes (its reshapes and views) is the weights' D, and the expert is
``down(act(gate(x)) * up(x))`` with gate and up applied as ``x @ w[e].T`` and down as ``h @ w[e]``.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

import torch.nn as nn

from autoep.detect import elementwise
from autoep.detect.expert_loop import Act, Attr, ExpertId, Obj, Opaque, Prover, Row, ShapeItem
from autoep.detect.loop_context import plain_method
from autoep.detect.loop_values import Sub
from autoep.detect.source import Refusal, function_tree


@dataclass(frozen=True)
class FlatWeight:
    path: str  # dotted path of a 2-D parameter under the experts


@dataclass(frozen=True)
class FlatView:
    path: str
    rows: int  # F: rows per expert the view makes
    cols: int  # D


@dataclass(frozen=True)
class FlatChunks:
    """``view.chunk(E, dim=0)``: E pieces of one expert each, ``(1, F, D)``."""

    view: FlatView


@dataclass(frozen=True)
class ChunkItem:
    view: FlatView  # one piece of FlatChunks, inside a comprehension over them
    squeezed: bool = False  # ``.squeeze(dim=0)``: expert e's (F, D) weight


@dataclass(frozen=True)
class FlatList:
    """``[c.squeeze(dim=0) for c in view.chunk(E, dim=0)]``: indexed by the expert id, its (F, D) weight."""

    view: FlatView


@dataclass(frozen=True)
class RowsOf:
    """``rows = hidden.reshape(-1, D)``: the experts' hidden argument flattened to rows."""

    rows: Opaque
    of: Opaque
    cols: int  # D, or -1: the hidden states' own last dim (``x.shape[-1]`` or unpacked from ``x.shape``)
    node: ast.AST  # the reshape


@dataclass(frozen=True)
class AccView:
    """The accumulator given the hidden argument's shape again: ``acc.view(hidden.shape[0], -1, D)``
    (``mode`` "lead") or ``acc.reshape(b, s, h)`` of ``b, s, h = hidden.shape`` ("shape")."""

    acc: Opaque
    lead: Opaque
    cols: int
    mode: str


@dataclass(frozen=True)
class FlatLayout:
    """What the recipe computes for flattened experts, proven: paths (under the experts) of the gate,
    up and down weights, each ``(E*F, D)`` = E whole experts of F rows; the activation module's path."""

    gate: str
    up: str
    down: str
    act: str
    rows_per_expert: int  # F
    hidden: int  # D
    num_experts: int  # E = rows // F


class FlatProver(Prover):
    """The expert-loop prover plus the flattened-weight values above (module docstring). ``prefix``: the
    path of ``owner`` under the experts (a submodule whose forward is being followed), "" at the top."""

    def __init__(self, fn, tree, owner: nn.Module, num_experts: int, *, prefix: str = "", root=None):
        super().__init__(fn, tree, owner, num_experts, batched=True)
        self.prefix, self.root = prefix, root or self
        self.views: dict[str, FlatView] = {}  # path -> the one view of it the forward takes
        self.cols: list[tuple[ast.AST, int]] = []  # every D the forward writes, with where
        self.rows_of: RowsOf | None = None
        self.act: tuple[str, nn.Module] | None = None
        self.zeros_src: Opaque | None = None
        self.unpacked: tuple[Opaque, int] | None = None  # ``b, s, h = hidden.shape``: (hidden, 3)

    # -- self.<attr> ------------------------------------------------------------------------------

    def _self_attr(self, node: ast.Attribute):
        name, owner = node.attr, self.owner
        value = owner._modules.get(name)
        if isinstance(value, nn.Module) and name not in vars(owner):
            if not isinstance(value, nn.ModuleList) and _is_activation(value):
                return self._activation(node, f"{self.prefix}{name}", value)
            if not self.prefix:  # only the experts' own submodules; a followed forward reads numbers and acts
                return Sub(name)
        if name in owner._parameters and self.prefix:
            self.refuse(node, "reads a weight of the submodule instead of the one passed in")
        return super()._self_attr(node)

    def _activation(self, node, path: str, module: nn.Module):
        elementwise.check_activation_module(module, path)
        root = self.root
        if root.act is not None and root.act[1] is not module:
            self.refuse(node, f"is a second activation module (also {root.act[0]})")
        root.act = (path, module)
        return Act()

    def _e_Attribute(self, node):
        if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            base = self.eval(node.value)
            if isinstance(base, Sub):
                return self._sub_attr(node, base)
            if isinstance(base, tuple) and base[:1] == ("param",) and len(base) == 2 and node.attr == "T":
                return ("param_t", base[1])
        return super()._e_Attribute(node)

    def _sub_attr(self, node, sub: Sub):
        module = self.owner.get_submodule(sub.path)
        param = module._parameters.get(node.attr)
        if isinstance(param, nn.Parameter) and param.dim() == 2 and node.attr not in vars(module):
            return FlatWeight(f"{sub.path}.{node.attr}")
        value = vars(module).get(node.attr)
        if type(value) is int:
            return Obj(value)
        self.refuse(node, "is not a 2-D weight or an int of the submodule")

    # -- subscripts, methods, operators -----------------------------------------------------------

    def _e_Subscript(self, node):
        base = self.eval(node.value)
        if isinstance(base, FlatView):
            e = self.eval(node.slice)
            if isinstance(e, ExpertId) and not e.row:
                return ("param", base.path)
            self.refuse(node, "does not index the viewed weight by the loop's expert id")
        if isinstance(base, FlatList):
            e = self.eval(node.slice)
            if isinstance(e, ExpertId) and not e.row:
                return ("param", base.view.path)
            self.refuse(node, "does not index the per-expert weights by the loop's expert id")
        if isinstance(base, (FlatWeight, Sub, FlatChunks, ChunkItem)):
            self.refuse(node, "indexes a flat weight without viewing it per expert")
        return super()._e_Subscript(node)

    def _e_ListComp(self, node):
        """``[c.squeeze(dim=0) for c in view.chunk(E, dim=0)]`` and nothing else."""
        (gen,) = node.generators if len(node.generators) == 1 else self.refuse(node, "has several loops")
        if gen.ifs or gen.is_async or not isinstance(gen.target, ast.Name):
            self.refuse(node)
        chunks = self.eval(gen.iter)
        if not isinstance(chunks, FlatChunks):
            self.refuse(node, "does not go over a weight's per-expert chunks")
        name, saved = gen.target.id, self.env.get(gen.target.id, _UNBOUND)
        self.env[name] = ChunkItem(chunks.view)
        try:
            item = self.eval(node.elt)
        finally:
            if saved is _UNBOUND:
                self.env.pop(name)
            else:
                self.env[name] = saved
        if item != ChunkItem(chunks.view, squeezed=True):
            self.refuse(node, "does not squeeze each chunk to one expert's weight")
        return FlatList(chunks.view)

    def _method(self, node, base, name: str):
        if isinstance(base, FlatWeight) and name == "view":
            return self._view_weight(node, base)
        if isinstance(base, FlatView) and name == "chunk":
            args = self._args(node, ("chunks", "dim"), 2)
            if self.eval(args["chunks"]) != Obj(self._experts_viewed(node)) or self.eval(args["dim"]) != Obj(0):
                self.refuse(node, "is not chunk(number of experts, dim=0)")
            return FlatChunks(base)
        if isinstance(base, ChunkItem) and not base.squeezed and name == "squeeze":
            (arg,) = self._args(node, ("dim",), 1).values()
            if self.eval(arg) != Obj(0):
                self.refuse(node, "is not squeeze(dim=0)")
            return ChunkItem(base.view, squeezed=True)
        if isinstance(base, tuple) and base[:1] == ("param",) and len(base) == 2 and name == "t":
            if node.args or node.keywords:
                self.refuse(node)
            return ("param_t", base[1])
        if isinstance(base, Row) and name == "matmul":
            (arg,) = self._args(node, ("other",), 1).values()
            return self._matmul(node, base, self.eval(arg))
        if isinstance(base, Row) and name in ("view", "reshape") and base.expr != ("x_lead",):
            # Only an expert's output (h @ w[e]: D columns, D checked against the weights) may be
            # viewed (-1, D): there it changes nothing; elsewhere it could regroup rows.
            expr = base.expr
            if not (expr[0] == "lin" and len(expr) == 4 and expr[3] is True):
                self.refuse(node, "reshapes rows that are not an expert's output")
            self._minus_one_cols(node, "rows")
            return base
        if isinstance(base, Opaque) and name in ("view", "reshape"):
            return self._reshape_tensor(node, base)
        return super()._method(node, base, name)

    def _e_BinOp(self, node):
        if isinstance(node.op, ast.MatMult):
            left = self.eval(node.left)
            if isinstance(left, Row):
                return self._matmul(node, left, self.eval(node.right))
        return super()._e_BinOp(node)

    def _matmul(self, node, rows: Row, w):
        if isinstance(w, tuple) and len(w) == 2 and w[0] in ("param", "param_t"):
            return Row(("lin", rows.expr, w[1], w[0] == "param"))  # transposed flag: applied as x @ w
        self.refuse(node, "is not rows @ an expert's weight")

    def _view_weight(self, node, w: FlatWeight) -> FlatView:
        """``w.view((-1 | E, F, D))`` (one tuple argument or three ints)."""
        args = [self.eval(a) for a in node.args]
        shape = args[0].value if len(args) == 1 and isinstance(args[0], Obj) else tuple(
            a.value if isinstance(a, Obj) else None for a in args)
        if node.keywords or not (isinstance(shape, tuple) and len(shape) == 3
                                 and all(type(s) is int for s in shape) and shape[1] > 0 and shape[2] > 0):
            self.refuse(node, "is not view((-1, F, D)) with sizes the proof can read")
        lead, rows, cols = shape
        total = self.owner.get_parameter(w.path).shape[0]
        if total % rows or lead not in (-1, total // rows):
            self.refuse(node, f"does not split the {total} rows of {w.path} into whole experts of {rows} rows")
        view = FlatView(w.path, rows, cols)
        if self.views.setdefault(w.path, view) != view:
            self.refuse(node, f"views {w.path} a second way")
        self.cols.append((node, cols))
        return view

    def _minus_one_cols(self, node, what: str, of: Opaque | None = None) -> int:
        """The D of ``t.view(-1, D)`` / ``t.reshape(-1, D)`` (recorded; checked against the weights), or -1
        where D is ``of``'s own last dim (``of.shape[-1]``, or the last name of ``b, s, h = of.shape``)."""
        args = [self.eval(a) for a in node.args]
        own_last = of is not None and len(args) == 2 and self._last_dim(args[1], of)
        if not node.keywords and own_last and args[0] == Obj(-1):
            return -1
        if node.keywords or len(args) != 2 or args[0] != Obj(-1) or not isinstance(args[1], Obj) \
                or type(args[1].value) is not int:
            self.refuse(node, f"is not a reshape of the {what} to (-1, hidden size)")
        self.cols.append((node, args[1].value))
        return args[1].value

    def _last_dim(self, v, of: Opaque) -> bool:
        if not (isinstance(v, ShapeItem) and v.of is of):
            return False
        return v.axis == -1 or (self.unpacked is not None and self.unpacked[0] is of and v.axis == self.unpacked[1] - 1)

    def _experts_viewed(self, node) -> int:
        """E as the views prove it (rows // F of the weights viewed so far, all alike)."""
        counts = {self.owner.get_parameter(v.path).shape[0] // v.rows for v in self.views.values()}
        if len(counts) != 1:
            self.refuse(node, "uses the number of experts before (or without) viewing the weights alike")
        return counts.pop()

    def _reshape_tensor(self, node, t: Opaque):
        """``hidden.reshape(-1, D)`` (once, before anything else reads it) or ``acc.view(hidden.shape[0], -1, D)``."""
        if self.prefix:
            self.refuse(node)
        acc = self.facts.acc
        if acc is not None and t is acc and len(node.args) == 3 and not node.keywords:
            return self._acc_view(node, acc, [self.eval(a) for a in node.args])
        if self.rows_of is not None and self.rows_of.node is node:  # the same statement evaluated again
            return self.rows_of.rows
        if self.rows_of is not None or acc is not None or self.facts.x is not None:
            self.refuse(node, "reshapes a tensor the proof does not follow")
        cols = self._minus_one_cols(node, "hidden states", of=t)
        self.rows_of = RowsOf(Opaque(f"{t.label} rows"), t, cols, node)
        return self.rows_of.rows

    def _acc_view(self, node, acc: Opaque, args: list) -> AccView:
        rows = self.rows_of
        if rows is None:
            self.refuse(node, "reshapes an accumulator of rows it did not flatten")
        lead, minus, cols = args
        if isinstance(lead, ShapeItem) and lead.axis == 0 and lead.of is rows.of and minus == Obj(-1) \
                and isinstance(cols, Obj) and type(cols.value) is int:
            self.cols.append((node, cols.value))
            return AccView(acc, lead.of, cols.value, "lead")
        if self.unpacked == (rows.of, 3) and args == [ShapeItem(rows.of, i) for i in range(3)]:
            return AccView(acc, rows.of, -1, "shape")
        self.refuse(node, "is not acc.view(hidden_states.shape[0], -1, hidden size) or acc.reshape(b, s, h)")

    # -- calls ------------------------------------------------------------------------------------

    def _function(self, node, target):
        if isinstance(target, Sub):
            return self._call_sub(node, target)
        if target == Obj(range) and not self.prefix:
            args = [self.eval(a) for a in node.args]
            every = Obj(self._experts_viewed(node))
            if not node.keywords and args in ([every], [Obj(0), every]):
                return ("range",)
            self.refuse(node, "does not range over all the experts the weights are viewed as")
        return super()._function(node, target)

    def _call_sub(self, node, sub: Sub) -> Row:
        """``self.<sub>(rows, w_a, w_b, ...)``: the submodule's own forward over these values."""
        module = self.owner.get_submodule(sub.path)
        elementwise.runtime_clean(module, f"{type(self.owner).__name__}.{sub.path}")
        fn = plain_method(type(module), "forward", module)
        tree = function_tree(fn)
        a = tree.args
        if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults:
            self.refuse(node, f"calls {type(module).__name__}.forward, whose signature the proof does not follow")
        names = tuple(x.arg for x in a.args[1:])
        bound = self._args(node, names, len(names))
        child = FlatProver(fn, tree, module, self.E, prefix=f"{self.prefix}{sub.path}.", root=self.root)
        child.env.update({n: self.eval(v) for n, v in bound.items()})
        if not all(isinstance(v, Row) or (isinstance(v, tuple) and len(v) == 2 and v[0] == "param")
                   for v in child.env.values()):
            self.refuse(node, "passes the submodule something other than rows and expert weights")
        body = [s for s in tree.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        for stmt in body[:-1]:
            if not isinstance(stmt, ast.Assign):
                child.refuse(stmt, "is not an assignment")
            child.assign(stmt)
        last = body[-1]
        out = child.eval(last.value) if isinstance(last, ast.Return) and last.value is not None else None
        if not isinstance(out, Row):
            child.refuse(last, "does not return the expert's rows")
        self.cols += child.cols
        return out

    # -- statements -------------------------------------------------------------------------------

    def assign(self, stmt: ast.Assign) -> None:
        """Also ``b, s, h = hidden.shape`` (the hidden states are then proven 3-D, or the forward raises)."""
        target = stmt.targets[0] if len(stmt.targets) == 1 else None
        if isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts) and not self.prefix:
            value = self.eval(stmt.value)
            if isinstance(value, Attr) and value.name == "shape" and self.unpacked is None:
                self.unpacked = (value.of, len(target.elts))
                for i, t in enumerate(target.elts):
                    self.env[t.id] = ShapeItem(value.of, i)
                return
        super().assign(stmt)

    def body(self, stmts: list[ast.stmt]) -> None:
        for stmt in stmts:
            if isinstance(stmt, ast.With):
                no_grad_indices(self, stmt)
            else:
                super().body([stmt])


_UNBOUND = object()


def _is_activation(module: nn.Module) -> bool:
    try:
        elementwise.check_activation_module(module, "")
        return True
    except Refusal:
        return False


def no_grad_indices(p: Prover, stmt: ast.With) -> None:
    """``with torch.no_grad():`` around index computations only (the mask, the experts hit, the (slot,
    token) positions of one expert): integer tensors, so there is no gradient to lose."""
    from autoep.detect.expert_loop import Hit, Index, Mask, Pairs, no_grad_block

    no_grad_block(p, stmt, indices=(Mask, Hit, Pairs, Index))


# ---------------------------------------------------------------------------------------------
# The proven layout
# ---------------------------------------------------------------------------------------------


def flat_layout(p: FlatProver, experts: nn.Module) -> FlatLayout:
    """Read ``down(act(gate(x)) * up(x))`` out of the proven per-expert computation and check it against
    the parameters the experts hold."""
    expr, what = p.facts.expert, f"{p.where}: the expert computes {p.facts.expert}"
    if not (isinstance(expr, tuple) and expr[0] == "lin" and len(expr) == 4 and expr[3] is True):
        raise Refusal(f"{what}, not h @ down[e] last")
    mid, down = expr[1], expr[2]
    if not (isinstance(mid, tuple) and mid[0] == "mul" and len(mid) == 3):
        raise Refusal(f"{what}; the gate is not act(gate) * up")
    acted = [m for m in mid[1:] if m[0] == "act"]
    plain = [m for m in mid[1:] if m[0] == "lin"]
    if len(acted) != 1 or len(plain) != 1:
        raise Refusal(f"{what}; the gate is not act(gate) * up")
    gate, up = acted[0][1], plain[0]
    for proj in (gate, up):
        if not (isinstance(proj, tuple) and len(proj) == 4 and proj[:2] == ("lin", ("x",)) and proj[3] is False):
            raise Refusal(f"{what}; gate and up are not x @ w[e].T of the routed rows")
    names = (gate[2], up[2], down)
    if len(set(names)) != 3 or p.root.act is None:
        raise Refusal(f"{what}; gate, up and down are not three weights with one activation")
    views = {p.views.get(n) for n in names}
    if None in views or len({(v.rows, v.cols) for v in views}) != 1:
        raise Refusal(f"{what}; the weights are not all viewed (-1, F, D) alike")
    view = next(iter(views))
    _check_flat_params(experts, names, view, p)
    return FlatLayout(gate=names[0], up=names[1], down=names[2], act=p.root.act[0], rows_per_expert=view.rows,
                      hidden=view.cols, num_experts=experts.get_parameter(names[0]).shape[0] // view.rows)


def _check_flat_params(experts: nn.Module, names: tuple[str, ...], view: FlatView, p: FlatProver) -> None:
    """The experts hold exactly these three weights, each ``(E*F, D)`` of one shape; every D the forward
    writes is that D; no buffers; all trainable or all frozen."""
    cls = type(experts).__name__
    held = {n for n, _ in experts.named_parameters()}
    if held != set(names):
        raise Refusal(f"experts {cls} hold parameters {sorted(held)}, not exactly the {sorted(names)} their "
                      "forward uses")
    if list(experts.buffers()):
        raise Refusal(f"experts {cls} hold buffers its forward does not use")
    shapes = {tuple(experts.get_parameter(n).shape) for n in names}
    (rows, cols), = shapes if len(shapes) == 1 else [(0, 0)]
    if len(shapes) != 1 or rows % view.rows or cols != view.cols:
        raise Refusal(f"experts {cls} weight shapes {sorted(shapes)} are not (E*{view.rows}, {view.cols}) alike")
    wrong = [(n, d) for n, d in p.cols if d != cols]
    if wrong:
        node, d = wrong[0]
        p.refuse(node, f"uses hidden size {d}, not the weights' {cols}")
    if len({experts.get_parameter(n).requires_grad for n in names}) > 1:
        raise Refusal(f"experts {cls}: some expert parameters are frozen and some are not")
