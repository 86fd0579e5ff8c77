"""Proof about experts called on E equal groups of rows: ``experts(rows) -> y``, never run.

Llama-4's ``Llama4TextExperts``: the block repeats its T tokens once per expert (row block e pre-scaled
by the token's score for expert e) and the experts' forward computes, for each e, expert e on the
``T = rows // E`` rows of block e::

    x = rows.view(E, -1, D)                  # E equal groups, in row order
    h = torch.bmm(x, gate_up_proj)           # (E, D, 2F); also matmul or @, weights optionally transposed
    gate, up = h.chunk(2, dim=-1)
    y = torch.bmm(up * act(gate), down_proj) # (E, F, D)
    return y.view(-1, D)                     # back to the rows, same order

That is the grouped boundary (``autoep.detect.grouped_proof``) with E groups of T rows each. ``equal_groups_proof
(experts)`` interprets the forward over a whitelist (straight-line assignments and one return; each call
resolved to the object it names) and refuses anything else, naming it. E and D may be spelled as an
expert weight's ``shape[i]``, an ``int`` on the instance or a literal; the proof records which, and the
recipe re-reads it at run time (a later change cannot slip past).

``zero_at_zero``: the proven expert is the bias-free ``down((x @ g) act. (x @ u))``. For a zero row both
products are exactly zero, so the output is zero and, with ``act(0) == 0`` (the activations in
``_ZERO_AT_ZERO``), so are the Jacobian with respect to the row (``act(0) * u @ down``) and every weight's
gradient (each is a product with the zero row or the zero hidden state). Skipping a zero row and giving it
zero output and zero gradients is then exact (weights finite), whatever made the row zero.
"""
from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoep.detect import elementwise
from autoep.detect.grouped_proof import GroupedProof, _check_params, _swiglu, swiglu_facts
from autoep.detect.loop_context import plain_method
from autoep.detect.loop_values import Obj as _Obj
from autoep.detect.loop_values import Sub as _Sub
from autoep.detect.names import Scope, attribute
from autoep.detect.source import Refusal, function_tree


@dataclass(frozen=True)
class EqualGroupsProof:
    """What the recipe needs: the SwiGLU (as a grouped proof: weights by path, layout, activation), how
    the forward spells E (``groups``) and D (``widths``, every spelling it uses), and whether a zero row
    may be skipped exactly."""

    grouped: GroupedProof
    groups: tuple  # ("weight", path, dim) | ("attr", name) | ("const", n)
    widths: tuple  # of the same forms, or ("rows",): the rows' own last dim
    zero_at_zero: bool


def takes_rows(experts: nn.Module) -> bool:
    """The experts hold a 3-D weight of their own and their forward takes one argument (the rows)."""
    if not any(p.dim() == 3 for p in experts._parameters.values() if p is not None):
        return False
    try:
        return len(function_tree(type(experts).forward).args.args) == 2
    except Refusal:
        return False


def equal_groups_facts(experts: nn.Module) -> dict:
    """Layout facts (MoeStructure fields) of proven equal-group experts, or ``Refusal``."""
    return equal_groups_proof(experts).grouped.facts


def equal_groups_proof(experts: nn.Module) -> EqualGroupsProof:
    """The proven facts (not cached: run-time state is re-checked each time), or ``Refusal``."""
    cls = type(experts)
    elementwise.runtime_clean(experts, f"experts {cls.__name__}")
    fn = plain_method(cls, "forward", experts)
    interp = _Interpreter(experts, fn)
    out = interp.run()
    if not isinstance(out, _Flat):
        raise Refusal(f"{fn.__qualname__} does not return its per-expert output viewed back to rows")
    gate, up, down, t, act = _swiglu(out.expr, fn.__qualname__)
    num_experts = _check_params(experts, (gate, up, down), t)
    for m in experts.modules():
        elementwise.runtime_clean(m, f"experts {cls.__name__} submodule {type(m).__name__}")
    weight = experts.get_parameter(down)
    hidden = int(weight.shape[2] if not t else weight.shape[1])
    if interp.groups.value != num_experts:
        raise Refusal(f"{fn.__qualname__} views its rows as {interp.groups.value} groups for {num_experts} experts")
    bad = [w.value for w in interp.widths if w.value != hidden]
    if bad:
        raise Refusal(f"{fn.__qualname__} views rows of width {bad[0]}; the experts' hidden size is {hidden}")
    facts = swiglu_facts(gate, up, down, t, act)
    grouped = GroupedProof(interp.arg, "", gate, up, down, not t, act, "exact", num_experts, facts=facts)
    zero = _zero_at_zero(experts.get_submodule(act) if isinstance(act, str) else act)
    return EqualGroupsProof(grouped, interp.groups.source, tuple(dict.fromkeys(w.source for w in interp.widths)), zero)


# Activations with act(0) == 0 exactly (and a finite derivative there), by identity or shipped class.
_ZERO_FUNCTIONS = {F.silu, F.gelu, F.relu, F.tanh, torch.tanh, torch.relu}
_ZERO_MODULES = (nn.SiLU, nn.GELU, nn.ReLU, nn.Tanh)
_ZERO_TRANSFORMERS = ("SiLUActivation", "GELUActivation", "NewGELUActivation", "FastGELUActivation",
                      "QuickGELUActivation", "PytorchGELUTanh", "GELUTanh", "AccurateGELUActivation")


def _zero_at_zero(act: object) -> bool:
    if not isinstance(act, nn.Module):
        return elementwise.known_function(act) and act in _ZERO_FUNCTIONS
    try:
        from transformers import activations
    except ImportError:
        activations = None
    shipped = tuple(c for c in (getattr(activations, n, None) for n in _ZERO_TRANSFORMERS) if isinstance(c, type))
    # exact class (a subclass may compute anything); check_activation_module already proved it unpatched
    return type(act) in _ZERO_MODULES + shipped


# ---------------------------------------------------------------------------------------------
# The interpreter: abstract values over the forward's straight-line code
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rows:  # the argument: (N, D) rows
    pass


@dataclass(frozen=True)
class _Groups:  # (E, T, .): group e is rows [e*T, (e+1)*T), each an expression of its own row
    expr: tuple


@dataclass(frozen=True)
class _Flat:  # (E*T, D) again, row order kept
    expr: tuple


@dataclass(frozen=True)
class _Weight:
    path: str
    t: bool = False  # applied transposed (x @ w[e].T)


@dataclass(frozen=True)
class _Shape:
    of: object  # a _Weight or _Rows


@dataclass(frozen=True)
class _Num:
    source: tuple
    value: int



class _Interpreter:
    def __init__(self, experts: nn.Module, fn):
        self.experts, self.fn, self.tree = experts, fn, function_tree(fn)
        self.scope, self.where = Scope(fn), fn.__qualname__
        self.env: dict[str, object] = {}
        self.groups: _Num | None = None
        self.widths: list[_Num] = []
        a = self.tree.args
        if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults or len(a.args) != 2:
            raise Refusal(f"{self.where} takes {[x.arg for x in a.args[1:]]}, not one plain argument (the rows)")
        self.arg = a.args[1].arg

    def refuse(self, node, why="is not a construct the equal-groups proof knows"):
        raise Refusal(f"{self.where} line {getattr(node, 'lineno', '?')}: `{ast.unparse(node)[:80]}` {why}")

    def run(self):
        self.env[self.arg] = _Rows()
        stmts = [s for s in self.tree.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        for i, stmt in enumerate(stmts):
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                self.assign(stmt.targets[0], self.eval(stmt.value), stmt)
            elif isinstance(stmt, ast.Return) and i == len(stmts) - 1 and stmt.value is not None:
                return self.eval(stmt.value)
            else:
                self.refuse(stmt)
        raise Refusal(f"{self.where} does not end with a return")

    def assign(self, target, value, stmt) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = value
        elif isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts) \
                and isinstance(value, tuple) and len(value) == len(target.elts):
            self.env.update({t.id: v for t, v in zip(target.elts, value)})
        else:
            self.refuse(stmt, "is an assignment the proof cannot follow")

    # -- expressions -----------------------------------------------------------------------------

    def eval(self, node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return _Num(("const", node.value), node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
                and type(node.operand.value) is int:
            return _Num(("const", -node.operand.value), -node.operand.value)
        if isinstance(node, ast.Name):
            return self.env[node.id] if node.id in self.env else _Obj(self.scope.lookup(node.id))
        if isinstance(node, ast.Tuple):
            return tuple(self.eval(e) for e in node.elts)
        if isinstance(node, ast.Attribute):
            return self.attribute(node)
        if isinstance(node, ast.Subscript):
            return self.subscript(node)
        if isinstance(node, ast.BinOp):
            return self.binop(node)
        if isinstance(node, ast.Call):
            return self.call(node)
        self.refuse(node)

    def attribute(self, node: ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "self" and "self" not in self.env:
            return self.self_attribute(node)
        base = self.eval(node.value)
        if isinstance(base, _Obj) and inspect.ismodule(base.value) and hasattr(base.value, node.attr):
            return _Obj(attribute(base.value, node.attr))  # torch.bmm, nn.functional
        if isinstance(base, (_Weight, _Rows)) and node.attr == "shape":
            return _Shape(base)
        self.refuse(node)

    def self_attribute(self, node: ast.Attribute):
        name, owner = node.attr, self.experts
        if name in owner._parameters:
            return _Weight(name)
        if name in owner._modules:
            return _Sub(name)
        value = vars(owner).get(name)
        if name in vars(owner) and type(value) is int:
            return _Num(("attr", name), value)  # re-read and checked by the recipe at run time
        if name in vars(owner) and elementwise.known_function(value):
            return _Obj(value)
        self.refuse(node, "reads an attribute that is not an expert weight, a submodule, an int or an activation")

    def subscript(self, node: ast.Subscript):
        base = self.eval(node.value)
        i = self.eval(node.slice)
        if isinstance(base, _Shape) and isinstance(i, _Num) and i.source[0] == "const":
            if isinstance(base.of, _Weight):
                w = self.experts.get_parameter(base.of.path)
                if -w.dim() <= i.value < w.dim():
                    dim = i.value % w.dim()
                    return _Num(("weight", base.of.path, dim), int(w.shape[dim]))
            elif i.value == -1:  # (shape[1] is the width only of 2-D rows)
                return _Num(("rows",), None)  # the rows' own width: equal to itself, checked where it is used
        if isinstance(base, tuple) and isinstance(i, _Num) and i.source[0] == "const" and 0 <= i.value < len(base):
            return base[i.value]
        self.refuse(node)

    def binop(self, node: ast.BinOp):
        left, right = self.eval(node.left), self.eval(node.right)
        if isinstance(node.op, ast.MatMult):
            return self.matmul(node, left, right)
        if isinstance(node.op, ast.Mult) and isinstance(left, _Groups) and isinstance(right, _Groups):
            return _Groups(("mul", left.expr, right.expr))
        self.refuse(node, "is arithmetic the proof does not accept (only the product of two per-expert values)")

    def matmul(self, node, groups, weight):
        if not (isinstance(groups, _Groups) and isinstance(weight, _Weight)):
            self.refuse(node, "is not the grouped rows times an expert weight")
        if self.experts.get_parameter(weight.path).dim() != 3:
            self.refuse(node, "multiplies by a weight that is not (E, in, out)")
        return _Groups(("lin", groups.expr, weight.path, weight.t))

    # -- calls -----------------------------------------------------------------------------------

    def call(self, node: ast.Call):
        if any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
            self.refuse(node, "unpacks arguments")
        func = node.func
        is_self = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self" \
            and "self" not in self.env
        if isinstance(func, ast.Attribute) and not is_self:
            base = self.eval(func.value)
            if not isinstance(base, _Obj):
                return self.method(node, base, func.attr)
        target = self.eval(func)
        if isinstance(target, _Sub):
            return self.submodule_call(node, target)
        if isinstance(target, _Obj):
            return self.function_call(node, target.value)
        self.refuse(node, "calls something the proof cannot resolve")

    def method(self, node: ast.Call, base, attr: str):
        args = [self.eval(a) for a in node.args]
        if len(args) == 1 and isinstance(args[0], tuple):
            args = list(args[0])  # view((E, -1, D))
        if attr in ("view", "reshape") and not node.keywords:
            if isinstance(base, _Rows) and len(args) == 3:
                return self.group_view(node, *args)
            if isinstance(base, _Groups) and len(args) == 2:
                return self.flat_view(node, *args, expr=base.expr)
        if attr == "chunk" and isinstance(base, _Groups) and len(args) <= 2 \
                and {k.arg for k in node.keywords} <= set(("chunks", "dim")[len(args):]):
            kw = {k.arg: self.eval(k.value) for k in node.keywords}
            return self.chunk(node, base, *args, **kw)
        if attr in ("transpose", "permute") and isinstance(base, _Weight) and not node.keywords \
                and self.swaps_last_two(args, attr):
            return _Weight(base.path, not base.t)
        self.refuse(node, "is a method call the proof does not know")

    def swaps_last_two(self, args, attr) -> bool:
        values = [a.value if isinstance(a, _Num) and a.source[0] == "const" else None for a in args]
        if attr == "permute":
            return values == [0, 2, 1]
        return len(values) == 2 and {v % 3 if v is not None else None for v in values} == {1, 2}

    def group_view(self, node, groups, rest, width):
        if not (isinstance(groups, _Num) and groups.source[0] != "rows" and rest == _Num(("const", -1), -1)
                and isinstance(width, _Num)):
            self.refuse(node, "is not rows.view(num_experts, -1, hidden)")
        if self.groups is not None:
            self.refuse(node, "views the rows as groups a second time")
        self.groups = groups
        if width.source != ("rows",):  # the rows' own width needs no check: it is what it is
            self.widths.append(width)
        return _Groups(("x",))

    def flat_view(self, node, rest, width, expr):
        if not (rest == _Num(("const", -1), -1) and isinstance(width, _Num)):
            self.refuse(node, "is not out.view(-1, hidden)")
        if width.source == ("rows",):
            self.refuse(node, "views the output by the input rows' width")
        self.widths.append(width)
        return _Flat(expr)

    def chunk(self, node, value, chunks=None, dim=None):
        if not (chunks == _Num(("const", 2), 2) and isinstance(dim, _Num) and dim.source[0] == "const"
                and dim.value in (-1, 2)):
            self.refuse(node, "is not chunk(2, dim=-1) of a per-expert value")
        return tuple(_Groups(("chunk", value.expr, i)) for i in (0, 1))

    def function_call(self, node: ast.Call, fn):
        if fn in (torch.bmm, torch.matmul) and len(node.args) == 2 and not node.keywords:
            return self.matmul(node, self.eval(node.args[0]), self.eval(node.args[1]))
        if fn is torch.chunk and len(node.args) >= 1:
            args = [self.eval(a) for a in node.args]
            kw = {k.arg: self.eval(k.value) for k in node.keywords}
            if isinstance(args[0], _Groups) and len(args) <= 3 and set(kw) <= set(("chunks", "dim")[len(args) - 1:]):
                return self.chunk(node, *args, **kw)
        if elementwise.known_function(fn):
            return self.activation(node, fn)
        self.refuse(node, f"calls {getattr(fn, '__qualname__', fn)!s:.60}, which the proof does not know")

    def submodule_call(self, node: ast.Call, sub: _Sub):
        elementwise.check_activation_module(self.experts.get_submodule(sub.path), f"experts.{sub.path}")
        return self.activation(node, sub.path)

    def activation(self, node: ast.Call, act):
        value = self.eval(node.args[0]) if len(node.args) == 1 and not node.keywords else None
        if not isinstance(value, _Groups):
            self.refuse(node, "is not an element-wise activation of one per-expert value")
        return _Groups(("act", value.expr, act))
