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
Between loops only row-local element-wise code runs (``chunk(2, dim=-1)``, activations, products).

Abstract values: ``Rows`` (each row an expression of the same input row; ``group``: inside a loop, the
rows of expert e only), ``Counts``, ``Weight`` (an expert parameter, dim 0 = expert) and ``Slice`` (its
``[e]``, ``t``: transposed), ``Sub`` (a submodule), loop bookkeeping (``Tag``, ``OutList``, ``Acc``) and
``Obj`` (a resolved Python object). Expressions: ``("x",)``, ``("lin", e, path, t)`` (e @ w[e], ``t``:
@ w[e].T), ``("act", e, fn or module path)``, ``("mul", a, b)``, ``("chunk", e, i)``.

One interpreter class, longer than most files here: its statement and call halves share the loop state
(which loop runs, which names it leaves behind), and splitting them would hide what a spelling needs.
"""
from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn

from autoep.detect import elementwise
from autoep.detect.loop_context import plain_method
from autoep.detect.loop_values import Obj, Sub
from autoep.detect.names import Scope, attribute
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

    # -- entry -----------------------------------------------------------------------------------

    def refuse(self, f: _Frame, node, why="is not a construct the grouped-experts proof knows"):
        raise Refusal(f"{f.where} line {getattr(node, 'lineno', '?')}: `{ast.unparse(node)[:80]}` {why}")

    def call_function(self, fn, args: list, owner: nn.Module | None, path: str, depth: int):
        if depth > _MAX_DEPTH:
            raise Refusal(f"{fn.__qualname__}: calls nest too deep to follow")
        tree = function_tree(fn)
        a = tree.args
        if tree.decorator_list or hasattr(fn, "__wrapped__"):
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
        if not (isinstance(target, OutList) and target.item is None and isinstance(value, Rows) and value.group):
            self.refuse(f, stmt, "is not `out.append(<rows of this expert>)`, once, in the split loop")
        target.item, target.head = value.expr, self.split_head

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
        self.refuse(f, node, "is arithmetic the proof does not accept (only the product of two row values)")

    def matmul(self, f: _Frame, node, rows, weight):
        if not (isinstance(rows, Rows) and rows.group and isinstance(weight, Slice)):
            self.refuse(f, node, "is not the rows of an expert times that expert's weight")
        return Rows(("lin", rows.expr, weight.path, weight.t), group=True)

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
        if isinstance(base, Slice) and attr == "transpose" and not node.keywords and len(node.args) == 2:
            dims = {self.eval(f, a) for a in node.args}
            if dims in ({Obj(-2), Obj(-1)}, {Obj(0), Obj(1)}):
                return Slice(base.path, not base.t)
        self.refuse(f, node, "is a method call the proof does not know")

    def function_call(self, f: _Frame, node: ast.Call, fn):
        if fn is torch.matmul:
            args = self.bind(f, node, ["input", "other"], 2)
            return self.matmul(f, node, args["input"], args["other"])
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
        if isinstance(seq, OutList) and seq.item is not None and dim == Obj(0):
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


def interpret(experts: nn.Module, forward) -> tuple[object, frozenset]:
    """(the value ``forward(x, counts)`` returns, the kinds of per-expert loop that ran) for ``experts``."""
    interp = _Interpreter(experts)
    out = interp.call_function(forward, [Rows(("x",)), Counts("tensor")], experts, "", 0)
    return out, frozenset(interp.loops)
