"""Batched experts whose forward holds two computations behind a training test (transformers 4.57's
Qwen3-VL-MoE and GPT-OSS experts):

    hidden_states = hidden_states.reshape(-1, self.hidden_size)
    if self.training:                      # GPT-OSS: if hidden_states.device.type == "cpu" or self.training:
        <the per-expert loop over the experts hit, dense routing weights W (T, E) read as W[tok, e, None]>
    else:
        <every expert on every token (bmm), weighted by W, summed over experts>
    return next_states

Only the loop branch is proven (``BranchProver`` on the shared expert-loop domain); the replacement runs it
as the exchange and raises, naming the line, wherever the model would take the other branch
(``check_branch``). The dense branch is not run under EP: it adds ``expert_e(x) * 0`` for every expert a token
is not routed to, which is NaN where that expert overflows, and sums the experts in another order; the
sparse exchange is not that computation.

The extra values on top of ``autoep.detect.flat_experts.FlatProver`` (rows, accumulator view):
  ("param_lead", p)  ``self.p[e_row]`` indexed by a (1,) row of ``nonzero()``: expert e's weight with a
                     leading 1-dim; rows times it carry the lead, ``out[0]`` takes it off again
  ("lead", expr)     a per-row expression computed with that leading 1-dim (same values)
  dense weights      ``W[tok, e, None]``: expert e's weight of each of its tokens read from a (T, E) tensor
  ``W.shape[1]``     the expert count E, re-checked against the weights at run time (``weights_cols``)
The per-row expression vocabulary for a gate written inline (GPT-OSS's clamped GLU): ``("strided", e, s)``
``e[..., s::2]``, ``("clamp", e, lo, hi)``, ``("scal", op, e, c, side)`` ``e <op> c`` (side "right") or
``c <op> e``, ``("add", a, b)``; ``inline_gate`` reads it back as a function of the first projection and
``eval_gate`` computes it, operation by operation as written.
"""
from __future__ import annotations

import ast

import torch
import torch.nn as nn

from autoep.detect.expert_loop import ExpertId, Hit, Index, Obj, Opaque, Row, Weight
from autoep.detect.flat_experts import FlatProver
from autoep.detect.loop_values import Attr, Chunks, Param, ShapeItem
from autoep.detect.source import Refusal
from autoep.errors import FactChanged

BRANCHES = ("training", "cpu_or_training")


def split_branch(tree: ast.FunctionDef, body: list[ast.stmt], hidden: str):
    """``(statements run when the branch test holds, branch kind, the if statement)`` where ``body`` is
    ``<assignments>; if <test>: <loop branch> else: <dense branch>; return <name>``, else ``None``. The test is
    ``self.training`` ("training") or ``<hidden>.device.type == "cpu" or self.training`` ("cpu_or_training")."""
    ifs = [s for s in body if isinstance(s, ast.If)]
    if len(ifs) != 1 or body[-1] is ifs[0] or not isinstance(body[-1], ast.Return):
        return None
    stmt = ifs[0]
    kind = _test_kind(stmt.test, hidden, tree.args.args[0].arg)
    if kind is None or not stmt.orelse:
        return None
    if any(isinstance(n, ast.Return) for s in stmt.body for n in ast.walk(s)):
        raise Refusal(f"{tree.name} line {stmt.lineno}: the loop branch returns early")
    i = body.index(stmt)
    return body[:i] + stmt.body + body[i + 1:], kind, stmt


def _test_kind(test: ast.AST, hidden: str, self_name: str) -> str | None:
    def is_training(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "training" and isinstance(node.value, ast.Name)
                and node.value.id == self_name)

    def is_cpu(node) -> bool:
        if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq)):
            return False
        left, right = node.left, node.comparators[0]
        return (isinstance(right, ast.Constant) and right.value == "cpu" and isinstance(left, ast.Attribute)
                and left.attr == "type" and isinstance(left.value, ast.Attribute) and left.value.attr == "device"
                and isinstance(left.value.value, ast.Name) and left.value.value.id == hidden)

    if is_training(test):
        return "training"
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or) and len(test.values) == 2:
        a, b = test.values
        if (is_cpu(a) and is_training(b)) or (is_training(a) and is_cpu(b)):
            return "cpu_or_training"
    return None


def check_branch(module: nn.Module, kind: str, hidden: torch.Tensor, line: int) -> None:
    """Raise where the experts' own forward would take its dense branch (module docstring)."""
    takes_loop = module.training if kind == "training" else (hidden.device.type == "cpu" or module.training)
    if not takes_loop:
        cond = "not training" if kind == "training" else "not training and not on CPU"
        raise FactChanged(  # the mode the proof read at apply (training), changed after it
            f"{type(module).__name__}.forward line {line}: {cond}, the experts' own forward computes every expert "
            "on every token (its dense branch), which autoep's expert-parallel exchange does not reproduce (it "
            "computes only the routed experts: no NaN from 0 * an overflowed expert, another summation order). "
            "Put the block in training mode (module.train()) for EP, or run it without EP")


def _has_lead(expr) -> bool:
    return isinstance(expr, tuple) and bool(expr) and (expr[0] == "lead" or any(_has_lead(e) for e in expr[1:]))


def _strip_lead(expr):
    if not isinstance(expr, tuple) or not expr:
        return expr
    if expr[0] == "lead":
        return _strip_lead(expr[1])
    return tuple(_strip_lead(e) for e in expr)


def _number(v) -> bool:
    return isinstance(v, Obj) and type(v.value) in (int, float)


_SCALAR_OPS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div"}


class BranchProver(FlatProver):
    """The expert-loop prover for the loop branch (module docstring)."""

    def __init__(self, fn, tree, owner: nn.Module, num_experts: int):
        super().__init__(fn, tree, owner, num_experts)
        self.weights_mode: str | None = None  # "dense": W[tok, e]; "slots": w[tok, slot]
        self.count_from: list[Opaque] = []  # tensors whose .shape[1] the proof took as E

    # -- subscripts -------------------------------------------------------------------------------

    def _e_Subscript(self, node):
        sl = node.slice
        if isinstance(sl, ast.Slice) and sl.lower is None and sl.upper is None and sl.step is None:
            base = self.eval(node.value)
            if isinstance(base, Hit):
                return base  # ``expert_hit[:]``: the same experts, in the same order
            self.refuse(node, "slices something other than the experts hit")
        base = self.eval(node.value)
        if isinstance(base, Attr) and base.name == "shape" and isinstance(sl, ast.Constant) and sl.value == 1 \
                and base.of.label in self.arguments():
            self.count_from.append(base.of)  # W.shape[1]: E, checked to be the weights' at run time
            return Obj(self.E)
        if isinstance(base, Param):
            e = self.eval(sl)
            if isinstance(e, ExpertId) and e.row:
                return ("param_lead", base.name)
        if isinstance(base, Row):
            if isinstance(sl, ast.Constant) and sl.value == 0 and not isinstance(sl.value, bool):
                if not _has_lead(base.expr):
                    self.refuse(node, "takes the first row of the expert's rows")
                return Row(_strip_lead(base.expr))
            return self._strided(node, base)
        return super()._e_Subscript(node)

    def arguments(self) -> set[str]:
        return {a.arg for a in self.tree.args.args[1:]}

    def _strided(self, node, base: Row) -> Row:
        """``rows[..., s::2]`` (s 0 or 1): every other feature, from feature s."""
        sl = node.slice
        items = sl.elts if isinstance(sl, ast.Tuple) else [sl]
        if len(items) == 2 and isinstance(items[0], ast.Constant) and items[0].value is Ellipsis \
                and isinstance(items[1], ast.Slice) and items[1].upper is None:
            lower, step = items[1].lower, items[1].step
            start = 0 if lower is None else lower.value if isinstance(lower, ast.Constant) else None
            if start in (0, 1) and type(start) is int and isinstance(step, ast.Constant) and step.value == 2 \
                    and type(step.value) is int:
                return Row(("strided", base.expr, start))
        self.refuse(node, "is not rows[..., ::2] or rows[..., 1::2]")

    def _index_tensor(self, node, base: Opaque, sl: ast.AST):
        items = sl.elts if isinstance(sl, ast.Tuple) else [sl]
        vals = [None if isinstance(i, ast.Constant) and i.value is None else self.eval(i) for i in items]
        if len(vals) == 3 and vals[0] == Index("tok") and isinstance(vals[1], ExpertId) and vals[2] is None:
            self._weights_mode("dense", node)
            self._bind_role("w", base, node)
            return Weight(col=True)
        if vals[:2] == [Index("tok"), Index("slot")]:
            self._weights_mode("slots", node)
        return super()._index_tensor(node, base, sl)

    def _weights_mode(self, mode: str, node) -> None:
        if self.weights_mode not in (None, mode):
            self.refuse(node, "reads the routing weights both per expert and per slot")
        self.weights_mode = mode

    # -- operators --------------------------------------------------------------------------------

    def _matmul(self, node, rows: Row, w):
        if isinstance(w, tuple) and len(w) == 2 and w[0] == "param_lead":
            return Row(("lead", ("lin", rows.expr, w[1], True)))
        return super()._matmul(node, rows, w)

    def _e_BinOp(self, node):
        if isinstance(node.op, ast.MatMult):
            return super()._e_BinOp(node)
        left, right = self.eval(node.left), self.eval(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, Row) and isinstance(right, tuple) \
                and right[:1] == ("param_lead",) and len(right) == 2:
            return Row(("lead", ("bias", left.expr, right[1])))
        op = _SCALAR_OPS.get(type(node.op))
        if op and isinstance(left, Row) and _number(right):
            self._fixed_number(node.right)
            return Row(("scal", op, left.expr, right.value, "right"))
        if op and _number(left) and isinstance(right, Row):
            self._fixed_number(node.left)
            return Row(("scal", op, right.expr, left.value, "left"))
        if isinstance(node.op, ast.Add) and isinstance(left, Row) and isinstance(right, Row):
            return Row(("add", left.expr, right.expr))
        if isinstance(node.op, ast.Mult) and isinstance(left, Row) and isinstance(right, Weight) \
                and _has_lead(left.expr):
            self.refuse(node, "weights rows that still carry the expert weight's leading dim")
        return super()._e_BinOp(node)

    def _row_method(self, node, base: Row, name: str):
        if name == "clamp":
            args = self._args(node, ("min", "max"), 0)
            bounds = []
            for key in ("min", "max"):
                if key in args:
                    self._fixed_number(args[key])
                v = self.eval(args[key]) if key in args else Obj(None)
                if not (isinstance(v, Obj) and (v.value is None or type(v.value) in (int, float))):
                    self.refuse(node, "clamps to something that is not a number")
                bounds.append(v.value)
            return Row(("clamp", base.expr, *bounds))
        return super()._row_method(node, base, name)

    def _fixed_number(self, node: ast.AST) -> None:
        """A number the gate computes with is a literal or an instance attribute (``self.limit``: folded and
        re-checked before each call, ``watching_facts``); a global or closure variable could be rebound after
        apply, and the computed gate would keep the old value."""
        inner = node.operand if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) else node
        if isinstance(inner, ast.Constant) or (inner is None and isinstance(node, ast.Constant)):
            return
        if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) \
                and inner.value.id == self.tree.args.args[0].arg:
            return
        self.refuse(node, "is a number read from a global or closure variable, which may change after apply")

    # -- statements -------------------------------------------------------------------------------

    def assign(self, stmt: ast.Assign) -> None:
        """Also ``a, b = <row expr>, <row expr>`` (both sides evaluated before either name is bound)."""
        target = stmt.targets[0] if len(stmt.targets) == 1 else None
        if isinstance(target, ast.Tuple) and isinstance(stmt.value, ast.Tuple) \
                and len(target.elts) == len(stmt.value.elts) and all(isinstance(t, ast.Name) for t in target.elts):
            values = [self.eval(v) for v in stmt.value.elts]
            if not all(isinstance(v, Row) for v in values):
                self.refuse(stmt, "unpacks something the proof cannot split")
            for t, v in zip(target.elts, values):
                self.env[t.id] = v
            return
        super().assign(stmt)


def check_count_sources(p: BranchProver) -> bool:
    """``W.shape[1]`` was read as E only from the dense routing weights (True: re-check at run time)."""
    if any(t is not p.facts.w for t in p.count_from):
        raise Refusal(f"{p.where} takes the expert count from the shape of a tensor other than its routing weights")
    if p.count_from and p.weights_mode != "dense":
        raise Refusal(f"{p.where} takes the expert count from its routing weights but reads them per slot")
    return bool(p.count_from)


# ---------------------------------------------------------------------------------------------
# A gate written inline: read back, and computed
# ---------------------------------------------------------------------------------------------

_UNARY = ("strided", "chunk", "clamp", "fn", "act", "scal")


def inline_gate(gated: tuple, transposed: bool) -> tuple[tuple, bool] | None:
    """``(gate expression over ("h",), bias)`` where ``gated`` is built from the first projection
    ``h = x @ gate_up_proj[e] (+ gate_up_proj_bias[e])`` by element-wise operations and last-dim splits alone;
    ``None`` where it is not."""
    lin = ("lin", ("x",), "gate_up_proj", transposed)
    for proj, bias in ((("bias", lin, "gate_up_proj_bias"), True), (lin, False)):
        try:
            expr = _over(gated, proj)
        except Refusal:
            continue
        if _mentions_h(expr):
            return expr, bias
    return None


def _over(expr, proj):
    if expr == proj:
        return ("h",)
    if not isinstance(expr, tuple) or not expr:
        raise Refusal("not a row expression")
    op = expr[0]
    if op in _UNARY:
        inner = expr[2] if op == "scal" else expr[1]
        if op == "scal":
            return (op, expr[1], _over(inner, proj)) + expr[3:]
        if op == "fn" and not callable(expr[2]):
            raise Refusal("not a function")
        return (op, _over(inner, proj)) + expr[2:]
    if op in ("mul", "add"):
        return (op, _over(expr[1], proj), _over(expr[2], proj))
    raise Refusal(f"{op} is not element-wise")


def _mentions_h(expr) -> bool:
    return expr == ("h",) or (isinstance(expr, tuple) and any(_mentions_h(e) for e in expr[1:]))


def eval_gate(expr: tuple, h: torch.Tensor, act=None) -> torch.Tensor:
    """Compute a gate expression (``inline_gate``) on ``h``, each operation as the model writes it."""
    op = expr[0]
    if op == "h":
        return h
    if op == "scal":
        _, name, inner, c, side = expr
        v = eval_gate(inner, h, act)
        a, b = (v, c) if side == "right" else (c, v)
        return {"add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b, "div": lambda: a / b}[name]()
    if op in ("mul", "add"):
        a, b = eval_gate(expr[1], h, act), eval_gate(expr[2], h, act)
        return a * b if op == "mul" else a + b
    v = eval_gate(expr[1], h, act)
    if op == "strided":
        return v[..., expr[2]::2]
    if op == "chunk":
        return v.chunk(2, dim=-1)[expr[2]]
    if op == "clamp":
        return v.clamp(min=expr[2], max=expr[3])
    if op == "fn":
        return expr[2](v)
    if op == "act":
        return act(v)
    raise ValueError(f"unknown gate operation {op}")


__all__ = ["BRANCHES", "BranchProver", "Chunks", "ShapeItem", "check_branch", "check_count_sources", "eval_gate",
           "inline_gate", "split_branch"]
