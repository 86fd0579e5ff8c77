"""The value domain of an expert expression on 3-D expert weights (a *site*, ``autoep.detect.block_weights``): what
makes its value a function of one rows tensor ``R`` and one expert's weight slices alone, row by row.

Values: *rows* (row-local in ``R``: output row t reads input row t of ``R`` and the weights only), a *weight*
(``self.w[i]``, expert ``i``'s slice, no rows; its dims), *constants* (numbers, dtypes), and objects names denote
(resolved through the function's globals, never by spelling: ``F.silu`` *is* ``torch.nn.functional.silu``).
Accepted: ``rows @ w``, ``torch.matmul(rows, w)``, ``F.linear(rows, w[, b])`` and ``torch.einsum`` contracting the
rows' last dim with a 2-D weight, ``w`` 2-D; element-wise torch functions (``autoep.detect.elementwise``) of rows
with constant arguments, never in place; ``+ - * / **`` between rows, numbers and weights of at most one dim (a bias
broadcast over rows; a 2-D weight element by element would meet row t with weight row t); ``.to(dtype)``,
``.float()``, ``.half()``, ``.bfloat16()``, ``.double()``, ``.contiguous()``, ``.type_as(rows)``; weights transposed
(``.t()``, ``.T``, ``.transpose(0, 1)``), cast and combined with weights and numbers. Anything else refuses, naming
the line: a reduction, an index into rows, a module or method of the block, ``.softmax(0)``.

Inline sites (in the forward) find their rows here: a weight-free sub-expression that is not a constant is a rows
expression (``x[tok]``); a site has exactly one (the same text wherever it occurs, and then built of names,
subscripts and attributes only). Method sites (``self._expert(i, h)``) name theirs: the method's rows parameter.
"""
from __future__ import annotations

import ast
import builtins
import inspect
from dataclasses import dataclass

import torch

from autoep.detect import elementwise, genuine
from autoep.detect.source import Refusal

ROWS, CONST, SELF, ID = "rows", "const", "self", "id"


@dataclass(frozen=True)
class _Weight:
    dims: int  # of one expert's slice (2: a matrix, 1: a bias)


@dataclass(frozen=True)
class _Obj:
    value: object


_CASTS = {"float", "half", "bfloat16", "double", "contiguous"}


class SiteDomain:
    """Evaluates a site's expression (or an expert method's body) over the abstract values: rows (row-local in R),
    ``_Weight`` (expert ``id``'s slice, no rows), constants, objects the names denote. ``Refusal`` for anything
    else."""

    def __init__(self, scan, id_name: str, inline: bool, rows_name: str = "", fn=None):
        self.scan, self.id_name, self.inline, self.rows_name = scan, id_name, inline, rows_name
        self.fn = fn or scan.fn
        self.env: dict[str, object] = {}
        self.rows: list[ast.AST] = []  # inline: the rows expressions met

    def where(self, node: ast.AST) -> str:
        line = self.fn.__code__.co_firstlineno + getattr(node, "lineno", 1) - 1
        return f"{self.scan.cls.__name__}.{self.fn.__name__} line {line}"

    def fail(self, node: ast.AST, why: str) -> Refusal:
        return Refusal(f"{self.where(node)}: `{ast.unparse(node)[:80]}` {why}")

    # -- entry points --------------------------------------------------------------------------------------

    def site(self, node: ast.AST) -> ast.AST | None:
        """The rows expression of ``node`` where it is a site (one rows expression, its value rows), else None;
        ``Refusal`` where it cannot be part of one."""
        value = self.value(node)
        texts = {ast.dump(r) for r in self.rows}
        if len(texts) > 1:
            raise self.fail(node, "combines the expert's output with other tensors")
        if value != ROWS:
            return None
        if len(self.rows) > 1 and not all(_plain(r) for r in self.rows):
            raise self.fail(node, f"evaluates its rows `{ast.unparse(self.rows[0])}` more than once, and they are "
                                  "computed by calls (evaluated once under EP)")
        return self.rows[0]

    def body(self, tree: ast.FunctionDef) -> None:
        """An expert method: assignments to names, then ``return <rows>``."""
        stmts = list(tree.body)
        if stmts and isinstance(stmts[0], ast.Expr) and isinstance(stmts[0].value, ast.Constant):
            stmts = stmts[1:]
        self.env = {"self": SELF, self.id_name: ID, self.rows_name: ROWS}
        for i, stmt in enumerate(stmts):
            last = i == len(stmts) - 1
            if isinstance(stmt, ast.Return) and last and stmt.value is not None:
                if self.value(stmt.value) != ROWS:
                    raise self.fail(stmt, "does not return rows computed from the expert's weights")
                return
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
                    and stmt.targets[0].id not in ("self", self.id_name):
                self.env[stmt.targets[0].id] = self.value(stmt.value)
                continue
            raise self.fail(stmt, "is not an assignment to a name or a final return; autoep proves an expert method "
                                  "of assignments and one return")
        raise Refusal(f"{self.where(tree)}: {tree.name} returns nothing")

    # -- values -------------------------------------------------------------------------------------------------

    def value(self, node: ast.AST):
        if self.inline and not any(self.scan._weight_attr(n) for n in ast.walk(node)):
            try:
                return self._pure(node)
            except Refusal:
                self.rows.append(node)  # a rows expression, evaluated where the token is
                return ROWS
        return self._value(node)

    def _pure(self, node: ast.AST):
        """A weight-free node as a constant or an object (a function, a dtype); ``Refusal`` otherwise."""
        if isinstance(node, ast.Constant) and (node.value is None or type(node.value) in (int, float, bool, str)):
            return CONST
        if isinstance(node, ast.Name) and node.id in self.env:
            return self.env[node.id]
        if isinstance(node, ast.Name) and self.inline and node.id not in ("self", self.id_name) and \
                node.id not in self.fn.__code__.co_varnames:
            return self._global(node)
        if isinstance(node, ast.Name) and not self.inline and node.id not in self.env:
            return self._global(node)
        if isinstance(node, ast.Attribute):
            base = self._pure(node.value)
            if isinstance(base, _Obj) and inspect.ismodule(base.value) and hasattr(base.value, node.attr):
                return _obj(getattr(base.value, node.attr))
            if base == ROWS and node.attr == "dtype":
                return CONST
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and self._pure(node.operand) == CONST:
            return CONST
        raise self.fail(node, "is not a constant")

    def _global(self, node: ast.Name):
        space = self.fn.__globals__
        if node.id in space:
            return _obj(space[node.id])
        if hasattr(builtins, node.id):
            return _obj(getattr(builtins, node.id))
        raise self.fail(node, "is not defined")

    def _value(self, node: ast.AST):
        if isinstance(node, ast.Subscript):
            return self._subscript(node)
        if isinstance(node, ast.BinOp):
            return self._binop(node, self.value(node.left), self.value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return self.value(node.operand)
        if isinstance(node, ast.Call):
            return self._call(node)
        if isinstance(node, ast.Attribute):
            base = self.value(node.value)
            if isinstance(base, _Weight) and node.attr in ("T", "mT") and base.dims == 2:
                return base
            if (base == ROWS or isinstance(base, _Weight)) and node.attr == "dtype":
                return CONST
            raise self.fail(node, "reads an attribute autoep does not prove row-local" + (
                " (transposing rows mixes them)" if node.attr in ("T", "mT") else ""))
        if isinstance(node, (ast.Name, ast.Constant)):
            return self._pure(node)
        raise self.fail(node, f"({type(node).__name__}) is outside what autoep proves row-local")

    def _subscript(self, node: ast.Subscript):
        w = self.scan._weight_attr(node.value)
        if w is None:
            raise self.fail(node, "indexes a value inside an expert expression; autoep proves whole rows")
        if not isinstance(node.slice, ast.Name) or node.slice.id != self.id_name:
            raise self.fail(node, f"slices the expert weight by other than the expert id `{self.id_name}`")
        return _Weight(self.scan.weights[w])

    def _binop(self, node: ast.BinOp, left, right):
        if isinstance(node.op, ast.MatMult):
            if left == ROWS and isinstance(right, _Weight) and right.dims == 2:
                return ROWS
            raise self.fail(node, "is a matmul other than rows @ a 2-D weight (it would mix rows)")
        if not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow)):
            raise self.fail(node, f"uses {type(node.op).__name__}, outside what autoep proves row-local")
        kinds = {ROWS if v == ROWS else "w" if isinstance(v, _Weight) else CONST if v == CONST else "?"
                 for v in (left, right)}
        if "?" in kinds:
            raise self.fail(node, "combines something that is not rows, a weight or a number")
        if kinds == {CONST}:
            return CONST
        if ROWS in kinds:
            if any(isinstance(v, _Weight) and v.dims > 1 for v in (left, right)):
                raise self.fail(node, "broadcasts a 2-D weight against rows element by element (row t would meet "
                                      "weight row t)")
            if isinstance(node.op, ast.Pow) and right != CONST:
                raise self.fail(node, "raises to a power other than a number")
            return ROWS
        weights = [v for v in (left, right) if isinstance(v, _Weight)]
        if len(weights) == 2 and weights[0].dims != weights[1].dims:
            raise self.fail(node, "combines weights of different dims")
        return weights[0]

    def _call(self, node: ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute):
            owner = self.value(func.value)
            if owner == ROWS or isinstance(owner, _Weight):
                return self._method(node, owner, func.attr)
            if owner == SELF:
                raise self.fail(node, "calls a method or module of the block inside an expert expression; autoep "
                                      "proves torch's own functions there")
            target = _obj(getattr(owner.value, func.attr, None)) if isinstance(owner, _Obj) else None
        else:
            target = self._pure(func) if isinstance(func, ast.Name) else None
        if not isinstance(target, _Obj):
            raise self.fail(node, "calls something autoep does not resolve to a torch function")
        fn = target.value
        args = [self.value(a) for a in node.args]
        kwargs = {k.arg: self.value(k.value) for k in node.keywords if k.arg is not None}
        if len(kwargs) != len(node.keywords):
            raise self.fail(node, "unpacks keyword arguments")
        if fn is torch.nn.functional.linear or fn is genuine.genuine_linear():
            bias = kwargs.pop("bias", args[2] if len(args) > 2 else None)
            if len(args) in (2, 3) and not kwargs and args[0] == ROWS and isinstance(args[1], _Weight) and \
                    args[1].dims == 2 and (bias is None or isinstance(bias, _Weight) and bias.dims == 1 or bias == CONST):
                return ROWS
            raise self.fail(node, "is F.linear other than on rows with a 2-D weight and a 1-D bias")
        if fn is torch.einsum:
            equation = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
            if isinstance(equation, str) and len(args) == 3 and not kwargs and args[1] == ROWS and isinstance(
                    args[2], _Weight) and args[2].dims == 2 and _einsum_rows(equation):
                return ROWS
            raise self.fail(node, "is torch.einsum other than contracting rows' last dim with a 2-D weight")
        if fn is torch.matmul:
            if len(args) == 2 and not kwargs and args[0] == ROWS and isinstance(args[1], _Weight) and args[1].dims == 2:
                return ROWS
            raise self.fail(node, "is torch.matmul other than rows @ a 2-D weight")
        if elementwise.known_function(fn):
            if not args or args[0] != ROWS or any(a != CONST for a in args[1:]) or any(
                    v != CONST for v in kwargs.values()):
                raise self.fail(node, "applies an element-wise function to other than rows with constant arguments")
            if "inplace" in kwargs:
                inplace = next(k.value for k in node.keywords if k.arg == "inplace")
                if not (isinstance(inplace, ast.Constant) and inplace.value is False):
                    raise self.fail(node, "runs in place")
            return ROWS
        raise self.fail(node, f"calls {getattr(fn, '__qualname__', fn)!s}, which autoep does not prove row-local")

    def _method(self, node: ast.Call, owner, name: str):
        args = [self.value(a) for a in node.args]
        if node.keywords and not (name == "to" and all(k.arg in ("dtype", "copy", "non_blocking") for k in node.keywords)):
            raise self.fail(node, "passes keyword arguments autoep does not prove")
        for k in node.keywords:
            if self.value(k.value) != CONST:
                raise self.fail(node, "passes a keyword argument that is not a constant")
        if name in _CASTS and not args or name == "to" and all(a == CONST for a in args) and len(args) <= 1:
            return owner
        if name == "type_as" and len(args) == 1 and args[0] == ROWS:
            return owner
        if isinstance(owner, _Weight) and owner.dims == 2:
            if name == "t" and not args:
                return owner
            if name == "transpose" and len(node.args) == 2 and {_dim(a) for a in node.args} == {0, 1}:
                return owner
        raise self.fail(node, f"calls .{name}(...), outside what autoep proves row-local")


def _dim(node: ast.AST) -> int | None:
    """A literal dim of a 2-D value, counted from the front (``-1`` is 1), else None."""
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return None
    return value % 2 if type(value) is int and -2 <= value < 2 else None


def _einsum_rows(equation: str) -> bool:
    """``equation`` contracts a rows operand's last label with a 2-D weight's and keeps every other rows label in
    front, in order (``"td,df->tf"``, ``"...d,fd->...f"``): row t of the output reads row t of the rows alone."""
    eq = equation.replace(" ", "")
    if eq.count("->") != 1 or eq.count(",") != 1:
        return False
    lhs, out = eq.split("->")
    rows, weight = lhs.split(",")
    if len(rows) < 2 or len(weight) != 2 or "." in weight:
        return False
    lead, inner = rows[:-1], rows[-1]
    other = weight.replace(inner, "", 1)
    labels = lead.replace("...", "")
    return inner in weight and len(other) == 1 and other != inner and other not in rows and out == lead + other \
        and len(set(labels)) == len(labels) and inner not in labels


def _obj(value) -> object:
    if isinstance(value, torch.dtype) or type(value) in (int, float, bool):
        return CONST
    return _Obj(value)


def _plain(node: ast.AST) -> bool:
    """Built of names, attributes, subscripts and constants only: evaluating it twice gives one value."""
    return all(isinstance(n, (ast.Name, ast.Attribute, ast.Subscript, ast.Constant, ast.Tuple, ast.Slice, ast.Load,
                              ast.UnaryOp, ast.USub)) for n in ast.walk(node))
