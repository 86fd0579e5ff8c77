"""The expressions and statements of the row-local expert proof (``autoep.detect.row_local``): the values
it interprets over, what each property's refusal says, and the interpreter of one function.

Each method of ``Interpreter`` handles one construct; whatever it does not handle is a refusal naming the
model's line and the property the construct would break. The proof's context (``row_local._Context``)
calls modules and functions and records the constants folded; the interpreter reaches it as ``self.ctx``.
"""
from __future__ import annotations

import ast
import inspect
import math
import operator
import types
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoep.detect import elementwise
from autoep.detect.loop_values import Obj, Row, Uniform
from autoep.detect.names import Scope, attribute
from autoep.detect.source import Refusal

INPUT, VIEW, ROWS, ROWS1 = Row(("x",)), Row(("view",)), Row(("rows",)), Row(("rows1",))
TWO_D = (INPUT, VIEW, ROWS)

# What each property's refusal says, after the model's line.
MIXES = "mixes rows (not row-local: output row i may read only input row i)"
COUNT = "reads the number of rows (not row-local: the rows an expert gets differ under EP)"
RANDOM = "draws random numbers (not deterministic)"
STATE = "writes module state (not stateless)"
INPLACE = "edits the expert's input in place (not stateless)"
BATCH_STATS = "uses batch statistics (not row-local, not stateless)"
BATCH_STATS_WHY = ("in training (or without running statistics) it normalises each row by the mean and variance of "
                   "the batch it is called on, and under EP an expert's owner calls it once on the rows every rank "
                   "sent it: batch statistics mix rows across ranks (and its running statistics would update on the "
                   "owner alone); in eval with running statistics it is a per-feature affine map of each row, which "
                   "EP runs exactly (model.eval() before the plan is resolved; train() after apply raises), or opt out")

MAX_DEPTH = 8
_MAX_UNROLL = 64

# Element-wise torch functions beyond the activations ``elementwise`` knows (first argument: the rows).
_ELEMENTWISE_FNS = {
    torch.rsqrt, torch.sqrt, torch.neg, torch.exp, torch.log, torch.log1p, torch.expm1, torch.sin, torch.cos,
    torch.erf, torch.clamp, torch.clip, torch.square, torch.abs, torch.sign, torch.reciprocal, torch.pow,
    torch.mul, torch.add, torch.sub, torch.div, torch.maximum, torch.minimum, torch.where, torch.nan_to_num,
    F.hardtanh, F.hardswish, F.hardsigmoid, F.selu, F.celu, F.softsign, F.tanhshrink, F.logsigmoid,
    F.silu, F.gelu, F.relu, F.elu, F.leaky_relu, F.mish, F.softplus, F.relu6,
}
# Tensor methods that are element-wise on the rows (arguments: numbers, rows, parameters, dtypes).
_ELEMENTWISE_METHODS = {
    "float", "double", "half", "bfloat16", "to", "type_as", "contiguous", "clone", "detach", "sigmoid", "tanh",
    "relu", "exp", "neg", "abs", "sqrt", "rsqrt", "pow", "square", "clamp", "clamp_min", "clamp_max", "clip",
    "mul", "add", "sub", "div", "sin", "cos", "erf", "log", "log1p", "reciprocal", "masked_fill", "where",
    "__mul__", "__add__", "sign", "nan_to_num", "maximum", "minimum",
}
_ALIASING_METHODS = {"float", "double", "half", "bfloat16", "to", "type_as", "contiguous", "detach"}
# Reductions and scans: row-local over dim -1 only.
_LAST_DIM_OPS = {"mean", "sum", "amax", "amin", "max", "min", "std", "var", "norm", "logsumexp", "prod",
                 "argmax", "argmin", "any", "all", "cumsum", "cumprod", "softmax", "log_softmax", "sort",
                 "argsort", "topk"}
_DEFAULT_ALL = {"mean", "sum", "amax", "amin", "max", "min", "std", "var", "norm", "logsumexp", "prod",
                "argmax", "argmin", "any", "all"}  # no dim: a reduction over every row
_RNG = {torch.rand, torch.randn, torch.rand_like, torch.randn_like, torch.randint, torch.randint_like,
        torch.bernoulli, torch.normal, torch.multinomial, torch.randperm, torch.poisson, F.dropout, F.alpha_dropout,
        F.feature_alpha_dropout, F.dropout1d, F.dropout2d, torch.dropout}
_RNG_METHODS = {"uniform_", "normal_", "bernoulli_", "bernoulli", "exponential_", "random_", "geometric_",
                "cauchy_", "log_normal_", "multinomial"}
BATCH_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LocalResponseNorm)
DROPOUTS = (nn.Dropout, nn.AlphaDropout, nn.FeatureAlphaDropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
# One independent draw per element, whatever the layout of the rows: equal in distribution wherever they run.
ELEMENTWISE_DROPOUTS = (nn.Dropout, nn.AlphaDropout)
_ELEMENTWISE_DROPOUT_FNS = {F.dropout, torch.dropout, F.alpha_dropout}
_BATCH_FNS = {F.batch_norm, F.instance_norm, F.group_norm}
# Pure functions a proof may evaluate on values known at detection (never a tensor).
_PURE = {len, abs, min, max, int, float, bool, round, str, range, math.sqrt, math.log, math.exp, math.ceil, math.floor,
         math.pow, math.prod}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
           ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_CONSTANTS = (bool, int, float, str, type(None), torch.dtype)


# Methods taking a part (or a reshaped view) of an expert's own parameter by constants: no row is read.
PARAM_PARTS = ("split", "chunk", "narrow", "unbind", "view", "reshape", "transpose", "permute", "squeeze", "unsqueeze",
               "flatten", "select")


@dataclass(frozen=True)
class ExpertTensor:
    """A parameter or buffer of the expert, by its path under the expert (read only)."""

    path: str
    tensor: torch.Tensor = field(compare=False, repr=False)


@dataclass(frozen=True)
class Bound:
    """A plain method of one of the expert's modules, followed when called."""

    module: nn.Module = field(compare=False)
    fn: object = field(compare=False)
    path: str = ""




def show(value) -> str:
    if isinstance(value, Obj):
        return f"a {type(value.value).__name__}"
    return type(value).__name__



class _Return(Exception):
    def __init__(self, value):
        self.value = value


class Interpreter:
    """One function's statements over the domain above (see the module docstring)."""

    def __init__(self, ctx, fn, tree: ast.FunctionDef, owner: nn.Module | None, path: str):
        self.ctx, self.fn, self.tree, self.owner, self.path = ctx, fn, tree, owner, path
        self.scope = Scope(fn)
        self.env: dict[str, object] = {}
        self.self_name = tree.args.args[0].arg if owner is not None and tree.args.args else None
        self.where = fn.__qualname__
        self.locals = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}

    def refuse(self, node: ast.AST, why: str):
        raise Refusal(self.at(node, why))

    def at(self, node: ast.AST, why: str) -> str:
        text = ast.unparse(node).splitlines()[0][:90] if node is not None else ""
        return f"{self.where} line {getattr(node, 'lineno', '?')}: `{text}` {why}"

    def pin(self, node: ast.AST, what: str) -> None:
        """Row-local on 2-D rows, but reads ``what`` (a positive dim, the rank): the leading dims of an N-D
        input may not be treated alike (``row_local.ExpertProof.leading_dims_free``)."""
        self.ctx.pin(self.at(node, f"reads {what}"))

    # -- arguments ------------------------------------------------------------------------------------

    def bind(self, args: list, kwargs: dict) -> None:
        a = self.tree.args
        params = a.posonlyargs + a.args
        if len(args) > len(params) and a.vararg is None:
            self.refuse(self.tree, f"takes {len(params)} arguments, the call passes {len(args)}")
        for p, v in zip(params, args):
            self.env[p.arg] = SelfModule(v, self.path) if p is params[0] and self.owner is not None else v
        defaults = self.defaults(params)
        extra = {}
        for name, v in kwargs.items():
            if name in {p.arg for p in params[len(args):]} or name in {k.arg for k in a.kwonlyargs}:
                self.env[name] = v
            elif a.kwarg is not None:
                extra[name] = v
            else:
                self.refuse(self.tree, f"has no parameter `{name}`")
        for p in params[len(args):] + a.kwonlyargs:
            if p.arg in self.env:
                continue
            if p.arg not in defaults:
                self.refuse(self.tree, f"needs `{p.arg}`, which the call does not pass")
            self.env[p.arg] = Obj(defaults[p.arg])
        if a.vararg is not None:
            self.env[a.vararg.arg] = Obj(tuple(args[len(params):])) if not args[len(params):] else \
                self.refuse(self.tree, "takes extra positional arguments")
        if a.kwarg is not None:
            if extra:
                self.refuse(self.tree, f"takes keyword arguments {sorted(extra)} through **{a.kwarg.arg}")
            self.env[a.kwarg.arg] = Obj({})

    def defaults(self, params: list[ast.arg]) -> dict[str, object]:
        """``{parameter: default}`` as the function object holds them (``__defaults__``, ``__kwdefaults__``:
        evaluated once, where the function was defined, and what its calls run with), not its source's default
        expressions evaluated again in today's globals (a global rebound since reads otherwise)."""
        positional = getattr(self.fn, "__defaults__", None) or ()
        if len(positional) != len(self.tree.args.defaults):
            self.refuse(self.tree, "has defaults that are not the ones its source writes")
        names = [p.arg for p in params][len(params) - len(positional):]
        return dict(zip(names, positional)) | dict(getattr(self.fn, "__kwdefaults__", None) or {})

    # -- statements -----------------------------------------------------------------------------------

    def run(self):
        try:
            self.block(self.tree.body)
        except _Return as ret:
            return ret.value
        return Obj(None)

    def block(self, stmts: list[ast.stmt]) -> None:
        for stmt in stmts:
            self.statement(stmt)

    def statement(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, ast.Expr):
            if not (isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)):
                self.eval(stmt.value)  # an in-place method call is checked where it is evaluated
        elif isinstance(stmt, ast.Pass):
            pass
        elif isinstance(stmt, ast.Assign):
            value = self.eval(stmt.value)
            for target in stmt.targets:
                self.store(target, value, stmt)
        elif isinstance(stmt, ast.AnnAssign):
            if stmt.value is not None:
                self.store(stmt.target, self.eval(stmt.value), stmt)
        elif isinstance(stmt, ast.AugAssign):
            self.aug_assign(stmt)
        elif isinstance(stmt, ast.Return):
            raise _Return(self.eval(stmt.value) if stmt.value is not None else Obj(None))
        elif isinstance(stmt, ast.If):
            self.branch(stmt)
        elif isinstance(stmt, ast.For):
            self.unroll(stmt)
        elif isinstance(stmt, ast.Assert):
            if isinstance(self.eval(stmt.test), Row):
                self.refuse(stmt, "asserts on row values, which differ under EP")
        elif isinstance(stmt, ast.Raise):
            self.refuse(stmt, "raises on this path")
        else:
            self.refuse(stmt, f"is a `{type(stmt).__name__.lower()}` statement the proof does not follow")

    def store(self, target: ast.AST, value, stmt) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            items = value.value if isinstance(value, Obj) and isinstance(value.value, tuple) else value
            if not isinstance(items, tuple) or len(items) != len(target.elts):
                self.refuse(stmt, "unpacks something the proof cannot split")
            for t, v in zip(target.elts, items):
                self.store(t, Obj(v) if isinstance(value, Obj) else v, stmt)
        elif isinstance(target, ast.Attribute):
            if not self.ctx.writes_attribute(self, target):
                self.refuse(stmt, f"assigns an attribute: it {STATE}")
        elif isinstance(target, ast.Subscript):
            base = self.eval(target.value)
            if aliases(base):
                self.refuse(stmt, INPLACE)
            self.refuse(stmt, "is an indexed write the proof does not follow")
        else:
            self.refuse(stmt, "assigns to something the proof does not follow")

    def aug_assign(self, stmt: ast.AugAssign) -> None:
        target = stmt.target
        if isinstance(target, ast.Attribute):
            if not self.ctx.writes_attribute(self, target):
                self.refuse(stmt, f"updates an attribute: it {STATE}")
            self.binop(stmt, self.eval(target), stmt.op, self.eval(stmt.value))  # the update itself interpreted
            return
        if not isinstance(target, ast.Name):
            self.refuse(stmt, "is an in-place update the proof does not follow")
        current = self.eval(target)
        value = self.binop(stmt, current, stmt.op, self.eval(stmt.value))
        if aliases(current):
            self.refuse(stmt, INPLACE)  # ``x += ...`` on a tensor writes into it
        if isinstance(current, ExpertTensor):
            self.refuse(stmt, f"updates a parameter or buffer in place: it {STATE}")
        self.env[target.id] = value

    def branch(self, stmt: ast.If) -> None:
        test = self.eval(stmt.test)
        if isinstance(test, Obj):
            self.block(stmt.body if _truth(test.value, stmt, self) else stmt.orelse)
            return
        if not isinstance(test, Uniform):
            self.refuse(stmt, f"branches on row values: {MIXES}")
        # A condition equal for every row but unknown at detection (e.g. a dtype): both paths are proven.
        saved, results = dict(self.env), []
        for body in (stmt.body, stmt.orelse):
            self.env = dict(saved)
            try:
                self.block(body)
                results.append(("falls", self.env))
            except _Return as ret:
                results.append(("returns", ret.value))
        kinds = {k for k, _ in results}
        if kinds == {"returns"}:
            raise _Return(self.join(stmt, results[0][1], results[1][1]))
        if kinds != {"falls"}:
            self.refuse(stmt, "returns on one path of a branch the proof cannot fold")
        a, b = results[0][1], results[1][1]
        self.env = {k: self.join(stmt, a[k], b[k]) for k in a.keys() & b.keys()}

    def join(self, stmt, a, b):
        if a == b:
            return a
        if a in TWO_D and b in TWO_D:
            return VIEW if aliases(a) or aliases(b) else ROWS
        self.refuse(stmt, "binds values of different kinds on its two paths")

    def unroll(self, stmt: ast.For) -> None:
        it = self.eval(stmt.iter)
        items = None
        if isinstance(it, Obj) and isinstance(it.value, (tuple, list, range)):
            items = [Obj(v) for v in it.value]
        elif isinstance(it, SubModule) and isinstance(it.module, (nn.ModuleList, nn.Sequential)):
            items = [SubModule(m, f"{it.path}.{i}") for i, m in enumerate(it.module)]
        if items is None or stmt.orelse or len(items) > _MAX_UNROLL:
            self.refuse(stmt, "is a loop the proof cannot unroll (only over a module list or a constant sequence)")
        for item in items:
            self.store(stmt.target, item, stmt)
            self.block(stmt.body)

    # -- expressions ----------------------------------------------------------------------------------

    def eval(self, node: ast.AST):
        method = getattr(self, f"_e_{type(node).__name__}", None)
        if method is None:
            self.refuse(node, "is an expression the proof does not follow")
        return method(node)

    def _e_Constant(self, node):
        return Obj(node.value)

    def _e_Name(self, node):
        if node.id in self.env:
            return self.env[node.id]
        if node.id in self.locals:
            self.refuse(node, "is not bound on every path here")
        return Obj(self.scope.lookup(node.id))

    def _e_Tuple(self, node):
        items = [self.eval(e) for e in node.elts]
        if all(isinstance(i, Obj) for i in items):
            return Obj(tuple(i.value for i in items))
        return tuple(items)

    _e_List = _e_Tuple

    def _e_JoinedStr(self, node):
        """An f-string: its text where every part is known at detection, else a uniform value (a message)."""
        parts = []
        for v in node.values:
            value = self.eval(v.value) if isinstance(v, ast.FormattedValue) else self.eval(v)
            if isinstance(value, Row):
                self.refuse(node, f"formats row values into text: {MIXES}")
            if not isinstance(value, Obj) or isinstance(v, ast.FormattedValue) and (v.conversion != -1 or v.format_spec):
                return Uniform("text")
            parts.append(str(value.value))
        return Obj("".join(parts))

    def _e_UnaryOp(self, node):
        v = self.eval(node.operand)
        if isinstance(v, Obj):
            ops = {ast.USub: operator.neg, ast.Not: operator.not_, ast.UAdd: operator.pos, ast.Invert: operator.inv}
            return Obj(ops[type(node.op)](v.value))
        if isinstance(v, Row) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return ROWS1 if v == ROWS1 else ROWS
        if isinstance(v, Uniform):
            return v
        self.refuse(node, "is an operator the proof does not follow")

    def _e_BoolOp(self, node):
        values = []
        for v in node.values:  # short-circuit as Python does: a folded operand decides
            value = self.eval(v)
            if isinstance(value, Obj):
                decided = _truth(value.value, node, self)
                if decided == isinstance(node.op, ast.Or):
                    return value
                values.append(value)
            elif isinstance(value, Uniform):
                values.append(value)
            else:
                self.refuse(node, f"combines row values in a condition: {MIXES}")
        return values[-1] if all(isinstance(v, Obj) for v in values) else Uniform("condition")

    def _e_IfExp(self, node):
        test = self.eval(node.test)
        if isinstance(test, Obj):
            return self.eval(node.body if _truth(test.value, node, self) else node.orelse)
        if isinstance(test, Uniform):
            return self.join(node, self.eval(node.body), self.eval(node.orelse))
        self.refuse(node, f"branches on row values: {MIXES}")

    def _e_Compare(self, node):
        left, result = self.eval(node.left), None
        for op, comp in zip(node.ops, node.comparators):
            right = self.eval(comp)
            if isinstance(left, Obj) and isinstance(right, Obj):
                value = Obj(_CMPOPS[type(op)](left.value, right.value))
            elif isinstance(op, (ast.Is, ast.IsNot)) and Obj(None) in (left, right) and \
                    (isinstance(left, ExpertTensor) or isinstance(right, ExpertTensor)):
                # ``self.weight is None``: a parameter or buffer the expert holds is not None, as a None one reads
                # Obj(None) (``module_attr``); a framework layer's unsupplied-weight check (``if weight is None: if
                # self.weight is None: raise ...``) folds, and the raise its configuration never reaches is not read
                value = Obj(isinstance(op, ast.IsNot))
            elif isinstance(left, Row) or isinstance(right, Row):
                if isinstance(op, (ast.Is, ast.IsNot)):
                    value = Obj(isinstance(op, ast.IsNot))  # a tensor is never None (or a constant)
                else:
                    value = self.combine(node, [left, right])  # element-wise: a boolean row tensor
            elif isinstance(left, (Uniform, ExpertTensor, Obj)) and isinstance(right, (Uniform, ExpertTensor, Obj)):
                value = Uniform("comparison")
            else:
                self.refuse(node, "compares values the proof does not follow")
            result = value if result is None else self._and(node, result, value)
            left = right
        return result

    def _and(self, node, a, b):
        if isinstance(a, Obj) and isinstance(b, Obj):
            return Obj(a.value and b.value)
        if isinstance(a, Row) or isinstance(b, Row):
            self.refuse(node, "chains comparisons of rows")
        return Uniform("comparison")

    def _e_BinOp(self, node):
        return self.binop(node, self.eval(node.left), node.op, self.eval(node.right))

    def binop(self, node, left, op, right):
        if isinstance(left, Obj) and isinstance(right, Obj):
            fn = _BINOPS.get(type(op))
            if fn is None or not all(isinstance(v.value, (int, float, bool)) for v in (left, right)):
                self.refuse(node, "is arithmetic the proof does not evaluate")
            return Obj(fn(left.value, right.value))
        if isinstance(op, ast.MatMult):
            if isinstance(left, Row) and isinstance(right, ExpertTensor) and right.tensor.dim() == 2:
                return ROWS  # rows @ (D, F) weight: row by row
            self.refuse(node, f"is a matrix product the proof cannot show row by row: {MIXES}")
        kinds = [left, right]
        if any(isinstance(v, Row) for v in kinds):
            return self.combine(node, kinds)
        if all(isinstance(v, (Obj, Uniform, ExpertTensor)) for v in kinds):
            return Uniform("arithmetic") if not any(isinstance(v, ExpertTensor) for v in kinds) else \
                ExpertTensor("<computed>", _broadcast_like(left, right))
        self.refuse(node, "is arithmetic on values the proof does not follow")

    def combine(self, node, values: list) -> Row:
        """Element-wise arithmetic with the rows reaches each row alone when every operand is rows of the same
        rank, a number, or an expert tensor of fewer dims (or a leading dim of 1), which broadcasts along the
        rows. One value per row (n,) meets (n, D) rows along the features, not the rows: refused."""
        rows = {v for v in values if isinstance(v, Row)}
        one = ROWS1 in rows
        if one and rows - {ROWS1}:
            self.refuse(node, f"broadcasts one value per row along the features: {MIXES}")
        for value in values:
            if isinstance(value, (Row, Uniform)) or isinstance(value, Obj) and not isinstance(value.value, torch.Tensor):
                continue
            if isinstance(value, tuple):
                self.refuse(node, "takes a sequence the proof does not follow")
            if isinstance(value, ExpertTensor):
                t = value.tensor
                if not one and (t.dim() < 2 or (t.dim() == 2 and t.shape[0] == 1)):
                    continue
                self.refuse(node, f"combines the rows with a {tuple(t.shape)} tensor along the rows: {MIXES}")
            self.refuse(node, f"combines the rows with {show(value)}, which the proof does not follow")
        return ROWS1 if one else ROWS

    def _e_Attribute(self, node):
        base = self.eval(node.value)
        if isinstance(base, (SelfModule, SubModule)):
            if self.ctx.opaque(base.module):
                self.refuse(node, f"reads self.{base.path}.{node.attr}: the module a wrapper wraps is only called")
            return self.module_attr(node, base.module, base.path)
        if isinstance(base, tuple) and len(base) == 2 and node.attr in ("values", "indices"):
            return base[0 if node.attr == "values" else 1]
        if isinstance(base, Config):
            return self.config_attr(node, base)
        if isinstance(base, Row):
            if node.attr == "ndim":
                self.pin(node, "the rows' rank")
            if node.attr in ("dtype", "device", "is_cuda", "requires_grad", "ndim"):
                return Uniform(node.attr)
            if node.attr == "shape":
                return Shape()
            if node.attr in ("T", "mT"):
                self.refuse(node, f"transposes the rows: {MIXES}")
            self.refuse(node, "is a tensor attribute the proof does not follow")
        if isinstance(base, ExpertTensor):
            if node.attr in ("dtype", "device", "requires_grad", "is_cuda"):
                return Uniform(node.attr)  # the same for every row; may change after detection (.to, loading)
            if node.attr in ("shape", "ndim"):
                value = getattr(base.tensor, node.attr)
                self.ctx.fold(f"{base.path}.{node.attr}", value)
                return Obj(tuple(value) if node.attr == "shape" else value)
            if node.attr in ("T", "mT") and base.tensor.dim() == 2:
                return ExpertTensor(base.path + ".T", base.tensor.T)
            self.refuse(node, "is a parameter attribute the proof does not follow")
        if isinstance(base, Obj) and isinstance(base.value, (types.ModuleType, type)):
            if not hasattr(base.value, node.attr):
                self.refuse(node, "does not exist")
            return Obj(attribute(base.value, node.attr))
        if isinstance(base, Obj) and isinstance(base.value, torch.dtype) and node.attr in ("is_floating_point", "itemsize"):
            return Obj(getattr(base.value, node.attr))
        if isinstance(base, Uniform):
            return Uniform(node.attr)
        self.refuse(node, "reads an attribute the proof does not follow")

    def module_attr(self, node, module: nn.Module, path: str):
        name = node.attr
        full = f"{path}.{name}" if path else name
        if name in module._parameters or name in module._buffers:
            if name in vars(module) or inspect.getattr_static(type(module), name, None) is not None:
                self.refuse(node, "is shadowed by a plain attribute")
            t = module._parameters.get(name, module._buffers.get(name))
            return Obj(None) if t is None else ExpertTensor(full, t)
        if name in module._modules:
            sub = module._modules[name]
            return Obj(None) if sub is None else SubModule(sub, full)
        if name in vars(module):
            value = vars(module)[name]
            if isinstance(value, _CONSTANTS) or (isinstance(value, tuple) and all(isinstance(v, _CONSTANTS) for v in value)):
                self.ctx.fold(full, value)
                return Obj(value)
            if _is_config(value):
                return Config(value, full)
            if not isinstance(value, nn.Module) and elementwise.known_function(value):
                self.ctx.fold(full, value)  # fairseq's self.activation_fn
                return Obj(value)
            if callable(value):
                self.refuse(node, "is a callable set on the instance, which the proof does not follow")
            self.refuse(node, f"reads a {type(value).__name__}, which the proof does not follow")
        static = inspect.getattr_static(type(module), name, MISSING)
        if isinstance(static, types.FunctionType):
            return Bound(module, static, path)
        if isinstance(static, _CONSTANTS):
            self.ctx.fold(full, static)
            return Obj(static)
        if static is MISSING:
            self.refuse(node, "is not an attribute of the module")
        self.refuse(node, f"is a class attribute ({type(static).__name__}) the proof does not follow")

    def config_attr(self, node, base: "Config"):
        if not hasattr(base.value, node.attr):
            self.refuse(node, "does not exist")
        value, full = getattr(base.value, node.attr), f"{base.path}.{node.attr}"
        if _is_config(value):
            return Config(value, full)
        if isinstance(value, _CONSTANTS) or isinstance(value, tuple) and all(isinstance(v, _CONSTANTS) for v in value):
            self.ctx.fold(full, value)
            return Obj(value)
        self.refuse(node, f"reads a {type(value).__name__} from a config, which the proof does not follow")

    def _e_Subscript(self, node):
        base = self.eval(node.value)
        if isinstance(base, Shape):
            index = self.eval(node.slice)
            if index == Obj(1):
                self.pin(node, "dim 1 by a positive index")
            if index in (Obj(-1), Obj(1)):
                return Uniform("size")
            self.refuse(node, COUNT)
        if isinstance(base, tuple):
            index = self.eval(node.slice)
            if isinstance(index, Obj) and isinstance(index.value, int):
                return base[index.value]
            self.refuse(node, "indexes a tuple by something the proof does not evaluate")
        if isinstance(base, Obj) and isinstance(base.value, (tuple, list, dict, str)):
            index = self.eval(node.slice)
            if isinstance(index, Obj):
                return Obj(base.value[index.value])
        if isinstance(base, SubModule) and isinstance(base.module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            index = self.eval(node.slice)
            if isinstance(index, Obj) and isinstance(index.value, (int, str)):
                return SubModule(base.module[index.value], f"{base.path}.{index.value}")
        if isinstance(base, Row):
            return self.row_index(node, base)
        if isinstance(base, ExpertTensor):
            return self.param_part(node, base, "[]", lambda t, index: t[index], [self.param_index(node.slice)], {})
        self.refuse(node, "is an index the proof does not follow")

    def param_index(self, node):
        """A constant index of a parameter (``[:, : self.hidden]``, ``[0]``, ``[..., 1:]``) as Python builds it:
        every part folded at detection; else a refusal."""
        if isinstance(node, ast.Tuple):
            return tuple(self.param_index(e) for e in node.elts)
        if isinstance(node, ast.Slice):
            return slice(*(None if part is None else self.param_index(part)
                           for part in (node.lower, node.upper, node.step)))
        value = self.eval(node)
        if not isinstance(value, Obj) or not (value.value is None or value.value is Ellipsis
                                              or type(value.value) is int):
            self.refuse(node, "indexes a parameter by a value not known at detection")
        return value.value

    def param_part(self, node, base: ExpertTensor, name: str, op, args: list, kwargs: dict):
        """A part of the expert's own parameter, by constants known at detection (``w1, w3 =
        self.w13.weight.split(F, dim=0)``, ``.chunk(2)``, ``[:, :F]``): no row is read, so every row sees the same
        tensor; computed on the parameter itself (on meta at detection) for its shape, as one tensor or a tuple."""
        try:
            part = op(base.tensor, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - torch's own shape error, named
            self.refuse(node, f"takes a part of a parameter that torch refuses ({type(exc).__name__}: {exc})")
        label = f"{base.path}.{name}"
        if isinstance(part, torch.Tensor):
            return ExpertTensor(label, part)
        return tuple(ExpertTensor(f"{label}[{i}]", t) for i, t in enumerate(part))

    def row_index(self, node, base: Row):
        """``rows[..., a:b]`` / ``rows[:, a:b]``: a slice of the feature dim, every row kept; ``v[:, None]``
        of one value per row: a column."""
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        whole = len(items) == 2 and (isinstance(items[0], ast.Constant) and items[0].value is Ellipsis or
                                     isinstance(items[0], ast.Slice) and items[0].lower is items[0].upper is
                                     items[0].step is None)
        if whole and isinstance(items[0], ast.Slice):  # ``[:, ...]`` is dim 1 only on 2-D rows; ``[..., ]`` is last
            self.pin(node, "dim 1 by position (`[:, ...]`, not `[..., ...]`)")
        if base == ROWS1:
            if whole and isinstance(items[1], ast.Constant) and items[1].value is None:
                return ROWS
            self.refuse(node, f"indexes the rows: {MIXES}")
        if whole and isinstance(items[1], ast.Slice):
            last = items[1]
            for part in (last.lower, last.upper, last.step):
                if part is not None and not isinstance(self.eval(part), (Obj, Uniform)):
                    self.refuse(node, f"slices the features by row values: {MIXES}")
            return VIEW if aliases(base) else ROWS
        self.refuse(node, f"indexes the rows: {MIXES}")

    def _e_Call(self, node):
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            self.refuse(node, "unpacks arguments")
        func = node.func
        if isinstance(func, ast.Attribute):
            base = self.eval(func.value)
            if isinstance(base, Row):
                return self.row_method(node, base, func.attr)
            if isinstance(base, ExpertTensor):
                return self.tensor_method(node, base, func.attr)
            if isinstance(base, Obj) and isinstance(base.value, dict) and func.attr == "get":
                args = [self.eval(a) for a in node.args]
                return Obj(base.value.get(*[a.value for a in args]))
        target = self.eval(func)
        args = [self.eval(a) for a in node.args]
        kwargs = {k.arg: self.eval(k.value) for k in node.keywords}
        if isinstance(target, SubModule):
            return self.ctx.call_module(target.module, args, kwargs, target.path, node)
        if isinstance(target, SelfModule):
            self.refuse(node, "calls the module itself (recursion)")
        if isinstance(target, Bound):
            self.ctx.depth += 1
            if self.ctx.depth > MAX_DEPTH:
                self.refuse(node, "nests calls too deep to follow")
            try:
                return self.ctx.call_function(target.fn, [target.module] + args, kwargs, target.module, target.path)
            finally:
                self.ctx.depth -= 1
        if not isinstance(target, Obj):
            self.refuse(node, "calls something the proof does not follow")
        return self.function(node, target.value, args, kwargs)

    def function(self, node, fn, args: list, kwargs: dict):
        if isinstance(fn, nn.Module):
            self.refuse(node, "calls a module that is not part of the expert (its parameters are not the expert's)")
        if fn in _RNG_SET:
            if fn in (F.dropout, torch.dropout, F.dropout1d, F.dropout2d, F.alpha_dropout, F.feature_alpha_dropout):
                return self.dropout_fn(node, fn, args, kwargs)
            self.refuse(node, RANDOM)
        if fn is F.batch_norm:
            return self.batch_norm_fn(node, args, kwargs)
        if fn in _BATCH_SET:
            self.refuse(node, BATCH_STATS)
        if fn is isinstance:
            return self.is_instance(node, args)
        if _in(fn, _PURE) and all(isinstance(a, Obj) for a in args + list(kwargs.values())):
            return Obj(fn(*[a.value for a in args], **{k: v.value for k, v in kwargs.items()}))
        if _in(fn, _PURE) and all(isinstance(a, (Obj, Uniform)) for a in args + list(kwargs.values())):
            return Uniform(getattr(fn, "__name__", "value"))
        if fn is F.linear:
            return self.linear(node, args, kwargs)
        if fn in (torch.matmul, torch.mm):
            return self.binop(node, args[0], ast.MatMult(), args[1]) if len(args) == 2 and not kwargs else \
                self.refuse(node, "is a matrix product the proof does not follow")
        if fn in (F.layer_norm, F.rms_norm):
            shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
            if not (args and isinstance(args[0], Row) and isinstance(shape, (Obj, tuple))
                    and len(shape.value if isinstance(shape, Obj) else shape) == 1):
                self.refuse(node, f"is not a norm over the last dim alone: {MIXES}")
            return ROWS
        if fn in (torch.cat, torch.concat, torch.stack):
            return self.concat(node, fn, args, kwargs)
        if fn is torch.where and len(args) + len(kwargs) != 3:
            self.refuse(node, f"is torch.where without values: it gives indices of rows: {MIXES}")
        if fn is F.normalize:
            dim = args[2] if len(args) > 2 else kwargs.get("dim", Obj(1))
            if not (args and args[0] in TWO_D and dim in (Obj(-1), Obj(1))):
                self.refuse(node, f"normalises along dim {_show_dim(dim)}: {MIXES}")
            if dim == Obj(1):  # F.normalize's default too
                self.pin(node, "dim 1 by a positive index")
            return ROWS
        if fn in _DIM_FNS:
            if not args or not isinstance(args[0], Row):
                self.refuse(node, "is not applied to the rows")
            return self.dim_op(node, _DIM_FNS[fn], args[1:], kwargs)
        if _in(fn, _ELEMENTWISE_FNS) or elementwise.known_function(fn):
            return self.elementwise(node, args, kwargs)
        if isinstance(fn, types.FunctionType) and not _is_library(fn):
            self.ctx.depth += 1
            if self.ctx.depth > MAX_DEPTH:
                self.refuse(node, "nests calls too deep to follow")
            try:
                return self.ctx.call_function(fn, args, kwargs, None, self.path)
            finally:
                self.ctx.depth -= 1
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        self.refuse(node, f"calls {getattr(fn, '__module__', '') or ''}{'.' if getattr(fn, '__module__', '') else ''}"
                          f"{name}, which the proof does not know row-local")

    def elementwise(self, node, args: list, kwargs: dict):
        if kwargs.get("inplace") == Obj(True) or kwargs.get("out") is not None:
            if args and aliases(args[0]) or "out" in kwargs:
                self.refuse(node, INPLACE if "out" not in kwargs else "writes into an out= tensor (not stateless)")
        values = args + list(kwargs.values())
        if not any(isinstance(v, Row) for v in values):
            if all(isinstance(v, (Obj, Uniform)) for v in values):
                return Uniform("value")
            self.refuse(node, "is not applied to the rows")
        return self.combine(node, values)

    def dropout_fn(self, node, fn, args: list, kwargs: dict):
        """``F.dropout(rows, p, training)`` and its kin: ``row_local._Context.dropout`` decides (identity, draw on
        the owner, refusal); a mode read from a module (``training=self.training``) was folded at the read and is
        released where it decides nothing."""
        names = ("input", "p", "train" if fn is torch.dropout else "training", "inplace")
        bound = dict(zip(names, args)) | kwargs
        p, training = bound.get("p", Obj(0.5)), bound.get(names[2], Obj(True))
        if not (isinstance(p, Obj) and isinstance(training, Obj)):
            self.refuse(node, "is dropout whose p or training flag the proof cannot fold")
        if bound.get("inplace", Obj(False)).value:
            self.refuse(node, INPLACE)
        if not isinstance(bound.get("input"), Row):
            self.refuse(node, "is not applied to the rows")
        name, mode = getattr(fn, "__name__", "dropout"), self.mode_read(node, names) or bool(training.value)
        at = f"{self.path + '.' if self.path else ''}{self.where} line {node.lineno}"
        return self.ctx.dropout(self.at(node, "")[:-1], None, p.value, mode, fn in _ELEMENTWISE_DROPOUT_FNS,
                                f"{name}(p={p.value})", at, bound["input"])

    def mode_read(self, node: ast.Call, names: tuple) -> str | None:
        """The folded path of the mode a dropout call passes where it is a module's ``training`` read
        (``self.training``, ``self.sub.training``), else None."""
        arg = node.args[2] if len(node.args) > 2 else next((k.value for k in node.keywords if k.arg == names[2]), None)
        if not (isinstance(arg, ast.Attribute) and arg.attr == "training"):
            return None
        base = self.eval(arg.value)
        if not isinstance(base, (SelfModule, SubModule)):
            return None
        path = f"{base.path}.training" if base.path else "training"
        return path if path in self.ctx.folded else None

    def batch_norm_fn(self, node, args: list, kwargs: dict):
        """``F.batch_norm`` with ``training=False`` and the expert's running statistics: a per-feature affine map
        of each row (its channels are dim 1 on an N-D input); otherwise batch statistics, refused saying why."""
        names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
        bound = dict(zip(names, args)) | kwargs
        stats = [bound.get("running_mean", Obj(None)), bound.get("running_var", Obj(None))]
        if bound.get("training", Obj(False)) != Obj(False) or not all(
                isinstance(t, ExpertTensor) and t.tensor.dim() == 1 for t in stats):
            self.refuse(node, f"{BATCH_STATS}: {BATCH_STATS_WHY}")
        if not isinstance(bound.get("input"), Row):
            self.refuse(node, "is not applied to the rows")
        for name in ("weight", "bias"):
            value = bound.get(name, Obj(None))
            if not (value == Obj(None) or isinstance(value, ExpertTensor) and value.tensor.dim() == 1):
                self.refuse(node, f"scales by a {name} that is not a 1-D tensor of the expert")
        self.pin(node, "dim 1 as its channels")
        return ROWS

    def linear(self, node, args: list, kwargs: dict):
        bound = dict(zip(("input", "weight", "bias"), args)) | kwargs
        x, w, b = bound.get("input"), bound.get("weight"), bound.get("bias", Obj(None))
        if not (isinstance(x, Row) and isinstance(w, ExpertTensor) and w.tensor.dim() == 2):
            self.refuse(node, "is not linear(rows, a 2-D weight of the expert)")
        if not (b == Obj(None) or isinstance(b, ExpertTensor) and b.tensor.dim() == 1):
            self.refuse(node, "adds a bias that is not a 1-D tensor of the expert")
        return ROWS

    def concat(self, node, fn, args: list, kwargs: dict):
        seq = args[0] if args else kwargs.get("tensors")
        dim = args[1] if len(args) > 1 else kwargs.get("dim", Obj(0))
        items = seq if isinstance(seq, tuple) else None
        if fn is torch.stack or items is None or not all(isinstance(i, Row) for i in items):
            self.refuse(node, "joins values the proof does not follow")
        if dim not in (Obj(-1), Obj(1)):
            self.refuse(node, f"concatenates along the rows: {MIXES}")
        if dim == Obj(1):
            self.pin(node, "dim 1 by a positive index")
        return ROWS

    def dim_op(self, node, name: str, args: list, kwargs: dict):
        """A reduction, scan, softmax or sort: row-local only along the last dim. A reduction without
        ``keepdim=True`` gives one value per row (n,). The dim is read wherever torch reads it: positional (second
        for ``topk`` and ``norm``), ``dim=`` or numpy's ``axis=``; a keyword the proof does not know is refused."""
        unknown = set(kwargs) - _DIM_OP_KEYWORDS
        if unknown:
            self.refuse(node, f"passes {sorted(unknown)}, which the proof does not know for {name}")
        at = 1 if name in ("topk", "norm") else 0
        given = [v for v in (args[at] if len(args) > at else None, kwargs.get("dim"), kwargs.get("axis")) if v is not None]
        if len(given) > 1:
            self.refuse(node, "gives its dim more than once")
        dim = given[0] if given else None
        if dim is None:
            if name in _DEFAULT_ALL:
                self.refuse(node, f"reduces over every row: {MIXES}")
            if name in ("softmax", "log_softmax"):  # torch's implicit dim: 1 on 2-D, 0 on 3-D
                self.pin(node, "the rows' rank (softmax without a dim)")
            dim = Obj(-1)  # sort, argsort, softmax, topk: the last dim by default
        dims = set(dim.value) if isinstance(dim, Obj) and isinstance(dim.value, (tuple, list)) else \
            {dim.value} if isinstance(dim, Obj) else None
        if dims is None or not all(type(d) is int for d in dims) or not dims <= {-1, 1}:  # ``std(True)``: no dim
            self.refuse(node, f"works along dim {_show_dim(dim)}: {MIXES}")
        if 1 in dims:
            self.pin(node, "dim 1 by a positive index")
        if name in ("sort", "topk"):
            return (ROWS, ROWS)
        if name not in _DEFAULT_ALL:
            return ROWS  # scans, softmax, argsort keep the shape
        keep = kwargs.get("keepdim", args[1] if len(args) > 1 and name in _KEEPDIM_SECOND else Obj(False))
        if not isinstance(keep, Obj):
            self.refuse(node, "reduces with a keepdim the proof cannot fold")
        out = ROWS if keep.value else ROWS1
        return (out, out) if name in ("max", "min") else out

    def is_instance(self, node, args: list):
        if len(args) != 2 or not isinstance(args[1], Obj):
            self.refuse(node, "is an isinstance test the proof does not follow")
        value, cls = args[0], args[1].value
        if isinstance(value, ExpertTensor):
            return Obj(isinstance(value.tensor, cls))  # a Parameter, before and after apply (DTensor or not)
        if isinstance(value, Row):
            return Obj(isinstance(torch.empty(0), cls)) if cls is torch.Tensor else Uniform("isinstance")
        if isinstance(value, Obj):
            return Obj(isinstance(value.value, cls))
        self.refuse(node, "is an isinstance test the proof does not follow")

    def tensor_method(self, node, base: ExpertTensor, name: str):
        if name.endswith("_") and not name.endswith("__"):
            self.refuse(node, f"updates a parameter or buffer in place: it {STATE}")
        if name in ("t",) and base.tensor.dim() == 2:
            return ExpertTensor(base.path + ".T", base.tensor.T)
        if name in ("float", "to", "type_as", "contiguous", "detach", "half", "bfloat16", "double"):
            return base
        if name in ("size", "dim"):
            return Obj(getattr(base.tensor, name)(*[self.eval(a).value for a in node.args]))
        if name in PARAM_PARTS:
            args = [self.eval(a) for a in node.args]
            kwargs = {k.arg: self.eval(k.value) for k in node.keywords}
            if not all(isinstance(v, Obj) for v in [*args, *kwargs.values()]):
                self.refuse(node, "takes a part of a parameter by values not known at detection")
            return self.param_part(node, base, name, lambda t, *a, **k: getattr(t, name)(*a, **k),
                                   [a.value for a in args], {k: v.value for k, v in kwargs.items()})
        self.refuse(node, "is a method of a parameter the proof does not follow")

    def row_method(self, node, base: Row, name: str):
        args = [self.eval(a) for a in node.args]
        kwargs = {k.arg: self.eval(k.value) for k in node.keywords}
        if name in _RNG_METHODS:
            self.refuse(node, RANDOM)
        if name.endswith("_") and not name.endswith("__"):
            if aliases(base):
                self.refuse(node, INPLACE)
            if name[:-1] in _ELEMENTWISE_METHODS:
                self.elementwise(node, [base] + args, kwargs)
                return base
            self.refuse(node, "is an in-place method the proof does not follow")
        if name in ("size",):
            if args in ([Obj(-1)], [Obj(1)]) or kwargs.get("dim") in (Obj(-1), Obj(1)):
                if Obj(1) in args or kwargs.get("dim") == Obj(1):
                    self.pin(node, "dim 1 by a positive index")
                return Uniform("size")
            self.refuse(node, COUNT)
        if name in ("numel", "nelement", "__len__"):
            self.refuse(node, COUNT)
        if name in ("dim", "ndimension"):
            self.pin(node, "the rows' rank")
            return Obj(1 if base == ROWS1 else 2)
        if name == "unsqueeze" and base == ROWS1 and (args or [kwargs.get("dim")]) in ([Obj(-1)], [Obj(1)]):
            if (args or [kwargs.get("dim")]) == [Obj(1)]:
                self.pin(node, "dim 1 by a positive index")
            return ROWS
        if base == ROWS1 and name in ("chunk", "split", "view_as", "reshape_as", "expand_as") | _LAST_DIM_OPS:
            self.refuse(node, f"works along the rows of one value per row: {MIXES}")
        if name in ("chunk", "split", "tensor_split", "unbind"):
            return self.split_features(node, base, name, args, kwargs)
        if name in _LAST_DIM_OPS:
            return self.dim_op(node, name, args, kwargs)
        if name in ("view_as", "reshape_as", "expand_as"):
            if args and args[0] in TWO_D and name != "expand_as":
                return VIEW if aliases(base) else ROWS
            self.refuse(node, "reshapes the rows, which the proof does not follow")
        if name in ("view", "reshape") and base in TWO_D and self.same_shape(args, kwargs):
            if not (len(args) == 1 and isinstance(args[0], Shape)):  # N-D input: (..., D) -> (n, D)
                self.pin(node, "the rows' rank (flattens to 2-D)")
            return VIEW if aliases(base) else ROWS  # (n, D) -> (n, D): fairseq's reshape(-1, x.size(-1))
        if name in ("view", "reshape", "transpose", "permute", "t", "flatten", "unsqueeze", "squeeze", "expand",
                    "repeat", "flip", "roll", "gather", "index_select", "masked_select", "nonzero", "item",
                    "tolist", "mm", "matmul", "bmm"):
            if name in ("mm", "matmul") and len(args) == 1:
                return self.binop(node, base, ast.MatMult(), args[0])
            self.refuse(node, f"changes the rows' layout ({name}), which the proof does not follow as row-local")
        if name in _ELEMENTWISE_METHODS:
            out = self.combine(node, [base] + args + list(kwargs.values()))
            if name in _ALIASING_METHODS and aliases(base):
                return VIEW  # may return the same tensor (already that dtype)
            return out
        self.refuse(node, f"is a tensor method ({name}) the proof does not know row-local")

    @staticmethod
    def same_shape(args: list, kwargs: dict) -> bool:
        """``view(-1, <feature size>)`` or ``view(<rows.shape>)`` of 2-D rows: every row stays itself."""
        if kwargs:
            return False
        if len(args) == 1 and isinstance(args[0], Shape):
            return True
        return len(args) == 2 and args[0] == Obj(-1) and args[1] == Uniform("size")

    def split_features(self, node, base: Row, name: str, args: list, kwargs: dict):
        if name == "unbind" or name == "tensor_split":
            self.refuse(node, "splits the rows in a way the proof does not follow")
        dim = args[1] if len(args) > 1 else kwargs.get("dim", Obj(0))
        if dim not in (Obj(-1), Obj(1)):
            self.refuse(node, f"splits along the rows: {MIXES}")
        if dim == Obj(1):
            self.pin(node, "dim 1 by a positive index")
        first = args[0] if args else kwargs.get("chunks", kwargs.get("split_size_or_sections"))
        if name == "chunk" and isinstance(first, Obj) and isinstance(first.value, int):
            count = first.value
        elif name == "split" and isinstance(first, Obj) and isinstance(first.value, (tuple, list)):
            count = len(first.value)
        else:
            self.refuse(node, "splits the features into a number of parts the proof cannot count")
        part = VIEW if aliases(base) else ROWS
        return tuple(part for _ in range(count))


@dataclass(frozen=True, eq=False)
class SelfModule:
    """``self`` inside a method of the expert's module."""

    module: nn.Module
    path: str = ""


@dataclass(frozen=True, eq=False)
class SubModule:
    """A submodule of the expert, by its path under the expert."""

    module: nn.Module
    path: str


@dataclass(frozen=True, eq=False)
class Config:
    """A config object an expert holds (a dataclass or transformers config): its fields read as constants."""

    value: object
    path: str


@dataclass(frozen=True)
class Shape:
    """``rows.shape``: only its last item (the feature size) is the same for every row batch."""


MISSING = object()
# Keywords of the reductions, scans and sorts ``dim_op`` reads (``out=`` and anything else: refused).
_DIM_OP_KEYWORDS = {"dim", "axis", "keepdim", "dtype", "descending", "stable", "largest", "sorted", "k", "p",
                    "unbiased", "correction"}
_KEEPDIM_SECOND = {"mean", "sum", "amax", "amin", "logsumexp", "max", "min", "argmax", "argmin", "any", "all", "prod"}
_DIM_FNS = {torch.mean: "mean", torch.sum: "sum", torch.cumsum: "cumsum", torch.cumprod: "cumprod",
            torch.softmax: "softmax", F.softmax: "softmax", F.log_softmax: "log_softmax", torch.sort: "sort",
            torch.argsort: "argsort", torch.topk: "topk", torch.amax: "amax", torch.amin: "amin",
            torch.logsumexp: "logsumexp", torch.std: "std", torch.var: "var", torch.norm: "norm", torch.prod: "prod"}


def _in(fn, functions) -> bool:
    try:
        return fn in functions
    except TypeError:
        return False


def aliases(value) -> bool:
    """The value may be the expert's input tensor itself (or a view of it)."""
    return value in (INPUT, VIEW)


def uses_batch_statistics(module: nn.Module) -> bool:
    """A BatchNorm normalises with the batch's statistics: in training, or in eval without running statistics
    (torch's own rule in ``_BatchNorm.forward``)."""
    return module.training or module.running_mean is None or module.running_var is None


def _is_library(fn) -> bool:
    module = getattr(fn, "__module__", "") or ""
    return module.split(".")[0] in ("torch", "builtins", "math", "numpy", "functools", "operator")


def _is_config(value) -> bool:
    """A config object (dataclass or transformers ``PretrainedConfig``): its attributes are read as constants."""
    cls = type(value)
    if hasattr(cls, "__dataclass_fields__"):
        return True
    return any(k.__name__ == "PretrainedConfig" and k.__module__.startswith("transformers.") for k in cls.__mro__)


def _truth(value, node, interp: Interpreter) -> bool:
    if isinstance(value, (torch.Tensor, nn.Module)):
        interp.refuse(node, "tests a tensor or module for truth, which the proof does not follow")
    return bool(value)


def _show_dim(dim) -> str:
    return repr(dim.value) if isinstance(dim, Obj) else "unknown at detection"


def _broadcast_like(left, right):
    for v in (left, right):
        if isinstance(v, ExpertTensor):
            return v.tensor
    return None


# Membership by identity for the sets of torch functions (some are unhashable builtins in old torch).
_RNG_SET = frozenset(_RNG)
_BATCH_SET = frozenset(_BATCH_FNS)
