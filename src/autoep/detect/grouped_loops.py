"""Interpreting a grouped experts' forward over abstract values, never running it (``autoep.detect.grouped_proof``
turns the result into a proof).

``interpret(experts, forward)`` follows the forward and the helper functions and submodules it calls
(resolved through their globals, never by name) over a whitelist: every statement and call must be one of
the forms below, or it refuses naming the construct. It returns what each row of the output is, as an
expression of the same input row (``lin`` nodes read the weight of that row's expert), and which
per-expert loops ran.

Accepted spellings of the per-group loop:
- split loop: ``for e, x_e in enumerate(torch.split(x, counts.tolist(), dim=0)): ... out.append(y_e)``
  then ``torch.cat(out, dim=0)`` (torchtitan, torchtune); needs ``sum(counts) == rows``, as torch.split does;
- offset loop: ``offs = torch.cat((zeros(1), torch.cumsum(counts, dim=0)))``, ``for e in range(E):
  acc[offs[e]:offs[e + 1]] = x[offs[e]:offs[e + 1]] @ w[e]`` into ``acc = torch.zeros(rows, out,
  dtype=x.dtype, ...)`` (transformers' Aria): rows past the groups stay zero.
- a model's own ``torch.autograd.Function`` applied as ``Fn.apply(rows, counts, weight)`` (ScatterMoE's
  ``ParallelLinear``; any argument order): its forward is read as a split loop of ``F.linear(x_e, w[e])`` (or
  ``x_e @ w[e]``) with ``ctx.save_for_backward(...)`` and plain values set on ``ctx``, and its backward as a loop
  over ``enumerate(zip(<splits by the same counts>))`` returning, per input, the rows' per-group gradient, None
  for the counts, and ``torch.stack`` of the per-expert ``g_e.t() @ x_e``: every value per group, so the Function
  computes on a rank's local experts what it computes on all of them (``autoep.detect.autograd_functions``).
  The weights it applies are returned by path; the recipe runs ``Fn.apply`` itself there.
Between loops only row-local element-wise code runs (``chunk(2, dim=-1)``, activations, products).

Abstract values: ``Rows`` (each row an expression of the same input row; ``group``: inside a loop, the
rows of expert e only), ``Counts``, ``Weight`` (an expert parameter, dim 0 = expert) and ``Slice`` (its
``[e]``, ``t``: transposed), ``Sub`` (a submodule), loop bookkeeping (``Tag``, ``OutList``, ``Acc``) and
``Obj`` (a resolved Python object); inside a Function, ``Ctx`` (its ``ctx``) and ``Outer`` (a per-expert weight
gradient). Expressions: ``("x",)``, ``("lin", e, path, t)`` (e @ w[e], ``t``:
@ w[e].T), ``("act", e, fn or module path)``, ``("mul", a, b)``, ``("chunk", e, i)``, and at the top only
``("scale", e, path)`` (the per-group loop's output times a parameter of the experts' own, ``out * self.scale``).

One interpreter class, longer than most files here: its statement and call halves share the loop state
(which loop runs, which names it leaves behind), and splitting them would hide what a spelling needs.
"""
from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from autoep.detect import autograd_functions, elementwise
from autoep.detect.loop_context import plain_method
from autoep.detect.loop_values import Obj, Sub
from autoep.detect.names import Scope, attribute, watch_methods
from autoep.detect.source import Refusal, function_tree


@dataclass(frozen=True)
class Rows:
    expr: tuple
    group: bool = False  # the rows of one expert's group (inside a per-expert loop)
    result: bool = False  # straight out of a per-group loop (cat of the split loop, the offset loop's acc)
    head: bool = False  # only the first sum(counts) rows (``x[:sum(counts)]``, torchtitan's padded spelling)


@dataclass(frozen=True)
class Counts:
    form: str  # "tensor" | "list"


@dataclass(frozen=True)
class Weight:
    path: str


@dataclass(frozen=True)
class Slice:
    path: str
    t: bool = False


@dataclass(frozen=True)
class Tag:
    """Bookkeeping: idx, idx+1 (the loop's expert), num_experts, num_rows, dtype, device, shape (of Rows),
    wshape and width (of a weight), split (of rows), cumsum, zero, offsets, start, end (the offset loop),
    routed, padding, cols, pad (the padded spelling), dead (a loop-local name after its loop)."""

    kind: str
    of: object = None


@dataclass(eq=False)
class OutList:
    item: tuple | None = None
    head: bool = False  # appended by a loop over the split of ``x[:sum(counts)]``


@dataclass(eq=False)
class Acc:
    width: tuple  # (weight path, t) whose output width it has
    item: tuple | None = None


@dataclass(frozen=True)
class FnApply:
    """``Fn.apply`` of a model's own ``torch.autograd.Function`` (``autoep.detect.autograd_functions``)."""

    cls: type


@dataclass(eq=False)
class Ctx:
    """A Function's ``ctx``: what its forward saved (``save_for_backward``, once) and set on it (plain values)."""

    saved: tuple | None = None
    attrs: dict = field(default_factory=dict)
    backward: bool = False  # read by the backward: no writes


@dataclass(frozen=True)
class Outer:
    """``g_e.t() @ x_e`` inside a backward's per-group loop: expert e's weight gradient, from group e alone
    (``t``: the group's rows transposed, before the product)."""

    expr: tuple


@dataclass(frozen=True)
class FunctionUse:
    """A weight applied through a proven per-group Function: ``cls.apply`` with the arguments in ``roles``
    order ("x", "counts", "weight")."""

    cls: type
    roles: tuple




_MAX_DEPTH = 6


class _Frame:
    def __init__(self, fn, tree: ast.FunctionDef, owner: nn.Module | None, path: str):
        self.scope, self.tree, self.owner, self.path = Scope(fn), tree, owner, path
        self.env: dict[str, object] = {}
        self.where = fn.__qualname__
        self.depth = 0


class _Interpreter:
    def __init__(self, experts: nn.Module):
        self.experts = experts
        self.loops: set[str] = set()  # the kinds of per-expert loop that ran
        self.in_loop = False  # helpers called inside a per-expert loop may not loop themselves
        self.split_head = False  # the split loop running splits x[:sum(counts)]
        self.functions: dict[str, FunctionUse] = {}  # weights applied through a proven autograd Function
        self.plain: set[str] = set()  # weights the experts' own code applies (outside any Function)
        self.in_function = False

    # -- entry -----------------------------------------------------------------------------------

    def refuse(self, f: _Frame, node, why="is not a construct the grouped-experts proof knows"):
        raise Refusal(f"{f.where} line {getattr(node, 'lineno', '?')}: `{ast.unparse(node)[:80]}` {why}")

    def call_function(self, fn, args: list, owner: nn.Module | None, path: str, depth: int, decorated=False):
        """``decorated``: a Function's static method (``autograd_functions.checked_function`` read its
        decorators)."""
        if depth > _MAX_DEPTH:
            raise Refusal(f"{fn.__qualname__}: calls nest too deep to follow")
        tree = function_tree(fn)
        a = tree.args
        if (tree.decorator_list and not decorated) or hasattr(fn, "__wrapped__"):
            raise Refusal(f"{fn.__qualname__} is decorated; autoep does not know what the decorator does")
        names = [x.arg for x in a.args][1 if owner is not None else 0:]
        if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults or len(names) != len(args):
            raise Refusal(f"{fn.__qualname__} takes {names}, not the {len(args)} plain arguments it is given")
        f = _Frame(fn, tree, owner, path)
        f.env.update(zip(names, args))
        f.depth = depth
        return self.body(f, tree.body, loop=None)

    # -- statements ------------------------------------------------------------------------------

    def body(self, f: _Frame, stmts: list, loop):
        stmts = [s for s in stmts if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        for i, stmt in enumerate(stmts):
            if isinstance(stmt, ast.Assign):
                self.assign(f, stmt, loop)
            elif isinstance(stmt, ast.Expr) and loop is not None:
                self.append(f, stmt, loop)
            elif isinstance(stmt, ast.Expr) and loop is None and self.in_function:
                self.save_for_backward(f, stmt)
            elif isinstance(stmt, ast.For) and loop is None:
                self.for_loop(f, stmt)
            elif isinstance(stmt, ast.Return) and loop is None and i == len(stmts) - 1 and stmt.value is not None:
                return self.returned(f, stmt)
            else:
                self.refuse(f, stmt)
        if loop is None:
            raise Refusal(f"{f.where} does not end with a return")

    def assign(self, f: _Frame, stmt: ast.Assign, loop) -> None:
        if len(stmt.targets) != 1:
            self.refuse(f, stmt, "assigns several targets")
        target = stmt.targets[0]
        if isinstance(target, ast.Subscript):
            return self.store(f, stmt, loop)
        value = self.eval(f, stmt.value)
        if isinstance(target, ast.Attribute) and loop is None:
            ctx = self.eval(f, target.value)
            if not (isinstance(ctx, Ctx) and not ctx.backward and isinstance(value, (Counts, Obj))):
                self.refuse(f, stmt, "sets an attribute other than a plain value or the counts on a Function's ctx")
            ctx.attrs[target.attr] = value
            return
        if isinstance(target, ast.Name):
            f.env[target.id] = value
        elif isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts) \
                and isinstance(value, tuple) and len(value) == len(target.elts):
            f.env.update({t.id: v for t, v in zip(target.elts, value)})
        else:
            self.refuse(f, stmt, "is an assignment the proof cannot follow")

    def store(self, f: _Frame, stmt: ast.Assign, loop) -> None:
        """``acc[start:end] = rows_of_group`` inside the offset loop, once."""
        target = stmt.targets[0]
        acc, value = self.eval(f, target.value), self.eval(f, stmt.value)
        bounds = self.bounds(f, target.slice)
        if not (loop == "offsets" and isinstance(acc, Acc) and acc.item is None and bounds
                and isinstance(value, Rows) and value.group):
            self.refuse(f, stmt, "is not `acc[start:end] = <rows of this expert>`, once, in the offset loop")
        if value.expr[0] != "lin" or (value.expr[2], value.expr[3]) != acc.width:
            self.refuse(f, stmt, "stores rows whose width is not the accumulator's")
        acc.item = value.expr

    def append(self, f: _Frame, stmt: ast.Expr, loop) -> None:
        """``out.append(rows_of_group)`` inside the split loop, once."""
        call = stmt.value
        ok = loop == "split" and isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) \
            and call.func.attr == "append" and len(call.args) == 1 and not call.keywords
        target = self.eval(f, call.func.value) if ok else None
        value = self.eval(f, call.args[0]) if ok else None
        if isinstance(value, Outer) and isinstance(target, OutList) and target.item is None:
            target.item = ("outer", value.expr)  # expert e's weight gradient (a Function's backward)
            return
        if not (isinstance(target, OutList) and target.item is None and isinstance(value, Rows) and value.group):
            self.refuse(f, stmt, "is not `out.append(<rows of this expert>)`, once, in the split loop")
        target.item, target.head = value.expr, self.split_head

    def save_for_backward(self, f: _Frame, stmt: ast.Expr) -> None:
        """``ctx.save_for_backward(<the Function's inputs>)``, once, in a Function's forward."""
        call = stmt.value
        ok = isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) \
            and call.func.attr == "save_for_backward" and not call.keywords
        ctx = self.eval(f, call.func.value) if ok else None
        if not (isinstance(ctx, Ctx) and not ctx.backward and ctx.saved is None):
            self.refuse(f, stmt, "is not `ctx.save_for_backward(...)`, once, in a Function's forward")
        ctx.saved = tuple(self.eval(f, a) for a in call.args)
        if not all(isinstance(v, (Rows, Weight)) and not getattr(v, "group", False) for v in ctx.saved):
            self.refuse(f, stmt, "saves something other than the Function's rows and weight")

    def for_loop(self, f: _Frame, stmt: ast.For) -> None:
        if stmt.orelse or self.in_loop:
            self.refuse(f, stmt, "is a loop inside a per-expert loop, or has an else branch")
        it, target = stmt.iter, stmt.target
        before = dict(f.env)
        if isinstance(it, ast.Call) and len(it.args) == 1 and not it.keywords \
                and self.eval(f, it.func) == Obj(enumerate) and isinstance(target, ast.Tuple) \
                and len(target.elts) == 2 and all(isinstance(t, ast.Name) for t in target.elts):
            split = self.eval(f, it.args[0])
            if not (isinstance(split, Tag) and split.kind == "split"):
                self.refuse(f, it, "enumerates something other than torch.split(x, counts.tolist(), dim=0)")
            f.env[target.elts[0].id] = Tag("idx")
            f.env[target.elts[1].id] = Rows(split.of[0], group=True)
            kind, self.split_head = "split", split.of[1]
        elif self.in_function and isinstance(it, ast.Call) and len(it.args) == 1 and not it.keywords \
                and self.eval(f, it.func) == Obj(enumerate) and isinstance(target, ast.Tuple) \
                and len(target.elts) == 2 and isinstance(target.elts[0], ast.Name) \
                and isinstance(target.elts[1], ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts[1].elts):
            splits = self.zipped_splits(f, it.args[0], len(target.elts[1].elts))
            f.env[target.elts[0].id] = Tag("idx")
            f.env.update({t.id: Rows(expr, group=True) for t, expr in zip(target.elts[1].elts, splits)})
            kind = "split"
        elif isinstance(it, ast.Call) and len(it.args) == 1 and not it.keywords \
                and self.eval(f, it.func) == Obj(range) and isinstance(target, ast.Name):
            if self.eval(f, it.args[0]) != Tag("num_experts"):
                self.refuse(f, it, "is not a loop over range(num_experts)")
            f.env[target.id] = Tag("idx")
            kind = "offsets"
            self.loops.add(kind)
        else:
            self.refuse(f, stmt, "is not a per-expert loop the proof knows")
        self.in_loop = True
        self.body(f, stmt.body, loop=kind)
        self.in_loop = False
        # Names bound inside the loop hold the last expert's rows afterwards: reading them is refused.
        for name in (set(f.env) - set(before)) | {n for n in before if f.env[n] is not before[n]}:
            f.env[name] = Tag("dead", name)

    def zipped_splits(self, f: _Frame, node, n: int) -> list:
        """``zip(torch.split(a, counts, dim=0), torch.split(b, counts, dim=0), ...)`` in a Function's backward:
        group e of each (the same counts split them all)."""
        if not (isinstance(node, ast.Call) and self.eval(f, node.func) == Obj(zip) and len(node.args) == n
                and not node.keywords):
            self.refuse(f, node, "is not zip(<splits of the rows by the counts>)")
        splits = [self.eval(f, a) for a in node.args]
        if not all(isinstance(s, Tag) and s.kind == "split" and not s.of[1] for s in splits):
            self.refuse(f, node, "zips something other than torch.split(<rows>, counts.tolist(), dim=0)")
        return [s.of[0] for s in splits]

    def bounds(self, f: _Frame, node) -> bool:
        return isinstance(node, ast.Slice) and node.step is None and node.lower is not None \
            and node.upper is not None and self.eval(f, node.lower) == Tag("start") \
            and self.eval(f, node.upper) == Tag("end")

    # -- expressions -----------------------------------------------------------------------------

    def eval(self, f: _Frame, node):
        if isinstance(node, ast.Constant):
            return Obj(node.value)
        if isinstance(node, ast.Name):
            value = f.env[node.id] if node.id in f.env else Obj(f.scope.lookup(node.id))
            if value == Tag("dead", node.id):
                self.refuse(f, node, "reads a name its per-expert loop left bound to the last expert's rows")
            return value
        if isinstance(node, (ast.Tuple, ast.List)):
            if isinstance(node, ast.List) and not node.elts and isinstance(node.ctx, ast.Load):
                return OutList()
            return tuple(self.eval(f, e) for e in node.elts)
        if isinstance(node, ast.Attribute):
            return self.attribute(f, node)
        if isinstance(node, ast.Subscript):
            return self.subscript(f, node)
        if isinstance(node, ast.BinOp):
            return self.binop(f, node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            value = self.eval(f, node.operand)
            if isinstance(value, Obj) and type(value.value) is int:
                return Obj(-value.value)
        if isinstance(node, ast.Call):
            return self.call(f, node)
        self.refuse(f, node)

    def attribute(self, f: _Frame, node: ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "self" and f.owner is not None \
                and "self" not in f.env:
            return self.self_attribute(f, node)
        base = self.eval(f, node.value)
        if isinstance(base, Obj) and inspect.ismodule(base.value) and hasattr(base.value, node.attr):
            return Obj(attribute(base.value, node.attr))  # a module-level name: torch.matmul, nn.functional
        if isinstance(base, Obj) and autograd_functions.is_function_class(base.value) and node.attr == "apply":
            return FnApply(base.value)
        if isinstance(base, Ctx) and base.backward and node.attr == "saved_tensors" and base.saved is not None:
            return base.saved
        if isinstance(base, Ctx) and base.backward and node.attr in base.attrs:
            return base.attrs[node.attr]
        if isinstance(base, Rows) and node.attr in ("dtype", "device"):
            return Tag(node.attr, base.group)
        if isinstance(base, Rows) and node.attr == "shape":
            return Tag("shape", base)
        if (isinstance(base, Counts) or base == Tag("cumsum")) and node.attr == "device":
            return Tag("device")
        if isinstance(base, Weight) and node.attr == "shape":
            return Tag("wshape", base.path)
        if isinstance(base, Slice) and node.attr == "T":
            return Slice(base.path, not base.t)
        self.refuse(f, node)

    def self_attribute(self, f: _Frame, node: ast.Attribute):
        owner, name = f.owner, node.attr
        path = f"{f.path}{name}"
        if name in owner._parameters:
            return Weight(path)
        if name in owner._modules:
            return Sub(path)
        value = vars(owner).get(name, None)
        if name in vars(owner) and elementwise.known_function(value):
            return Obj(value)
        # Numbers and other state on the instance are refused: the EP path would not see a later change.
        self.refuse(f, node, "reads an attribute that is not an expert weight, a submodule or an activation")

    def subscript(self, f: _Frame, node: ast.Subscript):
        base = self.eval(f, node.value)
        if isinstance(base, Weight) and self.eval(f, node.slice) == Tag("idx"):
            return Slice(base.path)
        if isinstance(base, Tag) and base.kind == "wshape":
            i = self.eval(f, node.slice)
            if i == Obj(0):
                return Tag("num_experts")
            if i in (Obj(-1), Obj(2)):
                return Tag("width", (base.of, False))
            if i in (Obj(1), Obj(-2)):
                return Tag("width", (base.of, True))
        if isinstance(base, Tag) and base.kind == "shape" and not base.of.group:
            i = self.eval(f, node.slice)
            if i == Obj(0) and not base.of.head:
                return Tag("num_rows")
            if i == Obj(-1):
                return Tag("cols", base.of.expr)
        if base == Tag("offsets"):
            i = self.eval(f, node.slice)
            if i in (Tag("idx"), Tag("idx+1")):
                return Tag("start" if i == Tag("idx") else "end")
        if isinstance(base, Rows) and not base.group and not base.head and self.bounds(f, node.slice):
            return Rows(base.expr, group=True)
        if isinstance(base, Rows) and not base.group and not base.head and isinstance(node.slice, ast.Slice) \
                and node.slice.lower is None and node.slice.step is None and node.slice.upper is not None \
                and self.eval(f, node.slice.upper) == Tag("routed"):
            return Rows(base.expr, head=True)  # x[:sum(counts)]
        if isinstance(base, tuple) and isinstance(node.slice, ast.Constant) and type(node.slice.value) is int \
                and 0 <= node.slice.value < len(base):
            return base[node.slice.value]
        self.refuse(f, node)

    def binop(self, f: _Frame, node: ast.BinOp):
        left, right = self.eval(f, node.left), self.eval(f, node.right)
        if isinstance(node.op, ast.Add) and left == Tag("idx") and right == Obj(1):
            return Tag("idx+1")
        if isinstance(node.op, ast.Sub) and left == Tag("num_rows") and right == Tag("routed"):
            return Tag("padding")  # rows past the groups
        if isinstance(node.op, ast.MatMult):
            return self.matmul(f, node, left, right)
        if isinstance(node.op, ast.Mult) and isinstance(left, Rows) and isinstance(right, Rows) \
                and (left.group, left.head) == (right.group, right.head):
            return Rows(("mul", left.expr, right.expr), left.group, head=left.head)
        if isinstance(node.op, ast.Mult) and {type(left), type(right)} == {Rows, Weight} and not self.in_function:
            rows, weight = (left, right) if isinstance(left, Rows) else (right, left)
            if rows.result and not rows.head and not rows.group:
                # the experts' output times a weight of their own: a dense per-feature scale (proven 1-D of the
                # output width by grouped_proof), the same for every row and every expert
                return Rows(("scale", rows.expr, weight.path), result=True)
        self.refuse(f, node, "is arithmetic the proof does not accept (only the product of two row values)")

    def matmul(self, f: _Frame, node, rows, weight):
        if isinstance(rows, tuple) and len(rows) == 2 and rows[0] == "rows.t" and isinstance(weight, Rows) \
                and weight.group:
            return Outer((rows[1], weight.expr))  # group e's rows, transposed, times group e's: expert e's grad
        if not (isinstance(rows, Rows) and rows.group and isinstance(weight, Slice)):
            self.refuse(f, node, "is not the rows of an expert times that expert's weight")
        return self.lin(rows, weight.path, weight.t)

    def lin(self, rows: Rows, path: str, t: bool) -> Rows:
        if not self.in_function:
            self.plain.add(path)
        return Rows(("lin", rows.expr, path, t), group=True)

    def returned(self, f: _Frame, stmt: ast.Return):
        value = self.eval(f, stmt.value)
        if isinstance(value, Acc):
            if value.item is None:
                self.refuse(f, stmt, "returns an accumulator no per-expert loop filled")
            return Rows(value.item, result=True)
        return value

    # -- calls -----------------------------------------------------------------------------------

    def call(self, f: _Frame, node: ast.Call):
        if any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
            self.refuse(f, node, "unpacks arguments")
        func = node.func
        is_self = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
            and func.value.id == "self" and f.owner is not None and "self" not in f.env
        if isinstance(func, ast.Attribute) and not is_self:
            base = self.eval(f, func.value)
            if not isinstance(base, Obj):
                return self.method(f, node, base, func.attr)
        target = self.eval(f, func)
        if isinstance(target, Sub):
            return self.submodule_call(f, node, target)
        if isinstance(target, FnApply):
            return self.function_apply(f, node, target.cls)
        if isinstance(target, Obj):
            return self.function_call(f, node, target.value)
        self.refuse(f, node, "calls something the proof cannot resolve")

    def bind(self, f: _Frame, node: ast.Call, names: list[str], required: int) -> dict:
        """The call's arguments by parameter name (values evaluated), refusing unknown or missing ones."""
        if len(node.args) > len(names) or {k.arg for k in node.keywords} - set(names[len(node.args):]):
            self.refuse(f, node, f"passes arguments other than {names}")
        args = dict(zip(names, (self.eval(f, a) for a in node.args)))
        args |= {k.arg: self.eval(f, k.value) for k in node.keywords}
        if any(n not in args for n in names[:required]):
            self.refuse(f, node, f"does not pass {names[:required]}")
        return args

    def method(self, f: _Frame, node: ast.Call, base, attr: str):
        no_args = not node.args and not node.keywords
        if isinstance(base, Counts) and base.form == "tensor" and attr in ("tolist", "cpu") and no_args:
            return Counts("list" if attr == "tolist" else "tensor")
        if isinstance(base, Counts) and base.form == "tensor" and attr == "cumsum":
            return self.cumsum(f, node, {"input": base} | self.bind(f, node, ["dim"], 1))
        if isinstance(base, Rows) and attr == "chunk":
            return self.chunk(f, node, {"input": base} | self.bind(f, node, ["chunks", "dim"], 1))
        if isinstance(base, Rows) and attr == "split":
            return self.split(f, node, {"tensor": base} | self.bind(f, node, ["split_size", "dim"], 1))
        if isinstance(base, Rows) and base.result and base.head and attr == "new_zeros" and len(node.args) == 1 \
                and not node.keywords and self.eval(f, node.args[0]) == (Tag("padding"), Tag("cols", base.expr)):
            return Tag("pad", base.expr)
        if isinstance(base, Slice) and attr == "t" and no_args:
            return Slice(base.path, not base.t)
        if isinstance(base, Rows) and base.group and self.in_function and attr == "t" and no_args:
            return ("rows.t", base.expr)  # only as the left factor of a weight gradient (matmul)
        if isinstance(base, Slice) and attr == "transpose" and not node.keywords and len(node.args) == 2:
            dims = {self.eval(f, a) for a in node.args}
            if dims in ({Obj(-2), Obj(-1)}, {Obj(0), Obj(1)}):
                return Slice(base.path, not base.t)
        self.refuse(f, node, "is a method call the proof does not know")

    def function_call(self, f: _Frame, node: ast.Call, fn):
        if fn is torch.matmul:
            args = self.bind(f, node, ["input", "other"], 2)
            return self.matmul(f, node, args["input"], args["other"])
        if fn is torch.nn.functional.linear:
            args = self.bind(f, node, ["input", "weight"], 2)  # no bias: F.linear(x_e, w[e]) is x_e @ w[e].T
            if not (isinstance(args["input"], Rows) and args["input"].group and isinstance(args["weight"], Slice)):
                self.refuse(f, node, "is not F.linear(<rows of an expert>, <that expert's weight>)")
            return self.lin(args["input"], args["weight"].path, not args["weight"].t)
        if fn is torch.stack and self.in_function:
            args = self.bind(f, node, ["tensors", "dim"], 1)
            seq = args["tensors"]
            if not (isinstance(seq, OutList) and seq.item is not None and seq.item[0] == "outer"
                    and args.get("dim", Obj(0)) == Obj(0)):
                self.refuse(f, node, "is not torch.stack(<per-expert weight gradients>, dim=0)")
            return Tag("wgrad")
        if fn is torch.split:
            return self.split(f, node, self.bind(f, node, ["tensor", "split_size_or_sections", "dim"], 2))
        if fn is torch.chunk:
            return self.chunk(f, node, self.bind(f, node, ["input", "chunks", "dim"], 2))
        if fn is torch.cumsum:
            return self.cumsum(f, node, self.bind(f, node, ["input", "dim"], 2))
        if fn is torch.cat:
            return self.cat(f, node, self.bind(f, node, ["tensors", "dim"], 1))
        if fn is torch.zeros:
            return self.zeros(f, node)
        if fn is torch.vstack:
            seq = self.bind(f, node, ["tensors"], 1)["tensors"]
            return self.pad(f, node, *seq) if isinstance(seq, tuple) and len(seq) == 2 else self.refuse(f, node)
        if fn is sum and len(node.args) == 1 and not node.keywords and self.eval(f, node.args[0]) == Counts("list"):
            return Tag("routed")
        if elementwise.known_function(fn):
            return self.activation(f, node, fn)
        if inspect.isfunction(fn) and not (fn.__module__ or "").startswith("torch"):
            args = [self.eval(f, a) for a in node.args]
            if node.keywords:
                self.refuse(f, node, "passes keywords to a helper function")
            return self.call_function(fn, args, None, f.path, f.depth + 1)
        self.refuse(f, node, f"calls {getattr(fn, '__qualname__', fn)!s:.60}, which the proof does not know")

    def function_apply(self, f: _Frame, node: ast.Call, cls: type):
        """``Fn.apply(rows, counts, weight)`` (any order) of a model's own autograd Function whose forward is a
        per-group linear map of the rows by the weight and whose backward is per-group too: the rows' ``lin``
        by that weight, recorded so the recipe runs ``Fn.apply`` itself on the local experts. Refusals name
        the Function."""
        if node.keywords or self.in_loop or self.in_function:
            self.refuse(f, node, "applies a Function with keywords, inside a per-expert loop or inside a Function")
        args = [self.eval(f, a) for a in node.args]
        roles = tuple("x" if isinstance(a, Rows) else "counts" if a == Counts("tensor") else
                      "weight" if isinstance(a, Weight) else repr(a) for a in args)
        rows = next((a for a in args if isinstance(a, Rows)), None)
        if sorted(roles) != ["counts", "weight", "x"] or rows.group or rows.head:
            self.refuse(f, node, f"passes {list(roles)}; autoep reads a Function applied to (the rows, the counts "
                        "tensor, one expert weight), in any order")
        weight = next(a for a in args if isinstance(a, Weight))
        try:
            autograd_functions.genuine_autograd()
            forward, backward = autograd_functions.checked_function(cls)
            watch_methods(cls, ("forward", "backward"))
            out = self.function_forward(forward, args, f)
            if not (isinstance(out, Rows) and out.result and not out.head and out.expr[:3] == ("lin", rows.expr,
                                                                                            weight.path)):
                raise Refusal(f"{forward.__qualname__} does not return its per-group loop's F.linear(x_e, w[e]) "
                              "(or x_e @ w[e]) of its rows")
            self.function_backward(backward, args, roles, f)
        except Refusal as exc:
            raise Refusal(f"custom autograd Function {cls.__qualname__} applied at {f.where} line {node.lineno} is "
                          f"not proven per-group: {exc}") from None
        use = FunctionUse(cls, roles)
        if self.functions.setdefault(weight.path, use) != use:
            self.refuse(f, node, f"applies {weight.path} through two different Functions")
        return Rows(out.expr, result=True)

    def function_forward(self, forward, args: list, f: _Frame):
        self.ctx, self.in_function = Ctx(), True
        loops = set(self.loops)
        try:
            out = self.call_function(forward, [self.ctx, *args], None, f.path, f.depth + 1, decorated=True)
        finally:
            self.in_function = False
        if self.loops - loops - {"split"}:
            raise Refusal(f"{forward.__qualname__} uses a per-group loop other than the split loop")
        return out

    def function_backward(self, backward, args: list, roles: tuple, f: _Frame):
        """The backward, over ``grad_output``'s rows and what the forward saved: the rows' gradient is per-group
        rows (or None), the counts' None, the weight's the stack of per-group ``g_e.t() @ x_e`` (or None)."""
        ctx = self.ctx
        if ctx.saved is None:
            raise Refusal(f"{backward.__qualname__}: its forward saves nothing with ctx.save_for_backward")
        ctx.backward = True
        inner = _Interpreter(self.experts)
        inner.in_function, inner.ctx = True, ctx
        grads = inner.call_function(backward, [ctx, Rows(("grad",))], None, f.path, f.depth + 1, decorated=True)
        grads = grads if isinstance(grads, tuple) else (grads,)
        want = {"x": lambda g: isinstance(g, Rows) and g.result and not g.head, "counts": lambda g: False,
                "weight": lambda g: g == Tag("wgrad")}
        if len(grads) != len(roles) or any(g != Obj(None) and not want[r](g) for g, r in zip(grads, roles)):
            raise Refusal(f"{backward.__qualname__} does not return, per input in order, its per-group loop's "
                          "rows gradient, None for the counts, and torch.stack of the per-expert g_e.t() @ x_e")

    def submodule_call(self, f: _Frame, node: ast.Call, sub: Sub):
        module = self.experts.get_submodule(sub.path)
        try:
            elementwise.check_activation_module(module, f"experts.{sub.path}")
            return self.activation(f, node, sub.path)
        except Refusal:
            pass
        if node.keywords:
            self.refuse(f, node, "passes keywords to a submodule")
        elementwise.runtime_clean(module, f"experts.{sub.path}")
        fn = plain_method(type(module), "forward", module)
        args = [self.eval(f, a) for a in node.args]
        return self.call_function(fn, args, module, f"{sub.path}.", f.depth + 1)

    def activation(self, f: _Frame, node: ast.Call, act):
        value = self.eval(f, node.args[0]) if len(node.args) == 1 and not node.keywords else None
        if not isinstance(value, Rows):
            self.refuse(f, node, "is not an element-wise activation of one row value")
        return Rows(("act", value.expr, act), value.group, head=value.head)

    def split(self, f: _Frame, node, args: dict):
        rows, sizes = args["tensor"], args.get("split_size_or_sections", args.get("split_size"))
        if not (isinstance(rows, Rows) and not rows.group and sizes == Counts("list")
                and args.get("dim", Obj(0)) == Obj(0)):
            self.refuse(f, node, "is not torch.split(rows, counts.tolist(), dim=0)")
        # torch.split raises unless the counts add up to the rows (all of them, or the first sum(counts))
        self.loops.add("split_head" if rows.head else "split")
        return Tag("split", (rows.expr, rows.head))

    def chunk(self, f: _Frame, node, args: dict):
        rows = args["input"]
        if not (isinstance(rows, Rows) and args["chunks"] == Obj(2) and args.get("dim") == Obj(-1)):
            self.refuse(f, node, "is not chunk(2, dim=-1) of row values")
        return tuple(Rows(("chunk", rows.expr, i), rows.group, head=rows.head) for i in (0, 1))

    def cumsum(self, f: _Frame, node, args: dict):
        if args["input"] != Counts("tensor") or args["dim"] != Obj(0):
            self.refuse(f, node, "is not cumsum(counts, dim=0)")
        return Tag("cumsum")

    def cat(self, f: _Frame, node, args: dict):
        seq, dim = args["tensors"], args.get("dim", Obj(0))
        if isinstance(seq, OutList) and seq.item is not None and seq.item[0] != "outer" and dim == Obj(0):
            return Rows(seq.item, result=True, head=seq.head)
        if seq == (Tag("zero"), Tag("cumsum")) and dim == Obj(0):
            return Tag("offsets")
        if isinstance(seq, tuple) and len(seq) == 2 and dim == Obj(0):
            return self.pad(f, node, *seq)
        self.refuse(f, node, "is not cat(<per-expert outputs>, dim=0) or cat((zeros(1), cumsum(counts)))")

    def pad(self, f: _Frame, node, rows, zeros):
        """``(out, out.new_zeros((rows - sum(counts), out.shape[-1])))`` stacked: the groups' output, then
        zero rows up to the rows given (torchtitan's padded spelling)."""
        if not (isinstance(rows, Rows) and rows.result and rows.head and zeros == Tag("pad", rows.expr)):
            self.refuse(f, node, "is not the groups' output stacked on zeros for the rows past them")
        return Rows(rows.expr, result=True)

    def zeros(self, f: _Frame, node: ast.Call):
        """``torch.zeros(1, dtype=<integer>)`` (the leading offset) or ``torch.zeros(rows, width,
        dtype=x.dtype)`` (the offset loop's accumulator); ``device=`` the rows' or the counts'."""
        size = [self.eval(f, a) for a in node.args]
        kw = {k.arg: self.eval(f, k.value) for k in node.keywords}
        device = kw.get("device", Tag("device"))
        if set(kw) - {"dtype", "device"} or not (isinstance(device, Tag) and device.kind == "device"):
            self.refuse(f, node, "passes zeros() keywords other than dtype and device=<rows or counts>.device")
        dtype = kw.get("dtype")
        if size == [Obj(1)] and isinstance(dtype, Obj) and dtype.value in (torch.long, torch.int32):
            return Tag("zero")
        if len(size) == 2 and size[0] == Tag("num_rows") and isinstance(size[1], Tag) and size[1].kind == "width" \
                and isinstance(dtype, Tag) and dtype.kind == "dtype":
            return Acc(width=size[1].of)
        self.refuse(f, node, "is not zeros(1, dtype=long) or zeros(rows, out_features, dtype=rows.dtype)")


def interpret(experts: nn.Module, forward) -> tuple[object, frozenset, dict]:
    """(the value ``forward(x, counts)`` returns, the kinds of per-expert loop that ran, the weights applied
    through a proven autograd Function by path) for ``experts``."""
    interp = _Interpreter(experts)
    out = interp.call_function(forward, [Rows(("x",)), Counts("tensor")], experts, "", 0)
    mixed = sorted(interp.plain & set(interp.functions))
    if mixed:
        raise Refusal(f"experts {type(experts).__name__} apply {mixed} both through a Function and by their own code")
    return out, frozenset(interp.loops), dict(interp.functions)
