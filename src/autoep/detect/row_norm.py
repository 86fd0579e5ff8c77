"""Proof that a module the experts apply to their output rows is row-local (a post-expert norm).

EP runs such a module on whatever (token, expert) rows reached a rank, all local experts' rows at once,
instead of on one expert's rows at a time: that is exact only if each output row is computed from the
same input row alone. ``prove_row_local(module, D, what)`` proves it from the module's class ``forward``
(and the methods it calls on ``self``) by a whitelist over every statement, call and attribute:
element-wise arithmetic and functions, casts, ``(D,)`` parameters of the module broadcast along the last
dim, ``pow`` and reductions over the last dim kept as a column (``mean(-1, keepdim=True)``). Anything
else (another dim, an index, a buffer, a submodule, an attribute that is not a number, a branch, hooks
or an instance ``forward``) is a refusal naming it.

Values (shapes of the ``(n, D)`` rows the module gets):
  "row"   (n, D), row i computed from input row i alone
  "col"   (n, 1), a reduction of a row over the last dim
  "vec"   (D,), one of the module's parameters, or arithmetic of them with numbers (no rows)
  "dtype" a tensor's dtype
  Obj     a resolved Python object (a number, ``None``, ``torch``, a torch function, a dtype)
  Method  a plain method of the module's class, followed into when called
The module's parameters are dense: EP leaves them where they are and sums their grads over the world.
"""
from __future__ import annotations

import ast
import inspect
import types

import torch
import torch.nn as nn

from autoep.detect import elementwise
from autoep.detect.expert_loop import local_names
from autoep.detect.loop_context import plain_method
from autoep.detect.loop_values import Method, Obj
from autoep.detect.module_list_proof import global_hooks
from autoep.detect.names import Scope, attribute
from autoep.detect.source import Refusal, function_tree

TENSORS = ("row", "col", "vec")
# Element-wise torch functions a norm may call on a tensor (besides the activations ``elementwise`` knows).
_FUNCTIONS = {torch.rsqrt, torch.sqrt}
_CASTS = ("float", "double", "half", "bfloat16")
_ELEMENTWISE_METHODS = ("rsqrt", "sqrt", "abs", "neg", "exp")
_REDUCTIONS = ("mean", "sum")
_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div)
_MAX_DEPTH = 3
_MISSING = object()


def prove_row_local(module: nn.Module, hidden: int, what: str) -> None:
    """``module(rows)`` on ``(n, hidden)`` rows computes each output row from the same input row alone,
    proven from its class's forward; or ``Refusal``."""
    elementwise.runtime_clean(module, what)
    if global_hooks():  # the model calls the module once per expert, EP once per rank: hooks would see that
        raise Refusal(f"{what}: global module hooks are registered; they would run on other rows under EP")
    if module._modules:
        raise Refusal(f"{what} ({type(module).__name__}) holds submodules")
    if any(True for _ in module.buffers()):
        raise Refusal(f"{what} ({type(module).__name__}) holds buffers")
    for name, p in module.named_parameters():
        if tuple(p.shape) != (hidden,):
            raise Refusal(f"{what}.{name} has shape {tuple(p.shape)}, not ({hidden},) along the rows' last dim")
    if _call(module, "forward", ["row"], what, 0) != "row":
        raise Refusal(f"{what}: {type(module).__name__}.forward does not return (n, {hidden}) rows")


def _call(module: nn.Module, name: str, args: list, what: str, depth: int):
    """The value ``module.<name>(*args)`` returns, following the class's own function."""
    if depth > _MAX_DEPTH:
        raise Refusal(f"{what}: methods call each other too deep to follow")
    fn = plain_method(type(module), name, module)
    tree = function_tree(fn)
    a = tree.args
    if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults or len(a.args) != len(args) + 1:
        raise Refusal(f"{what}: {fn.__qualname__} does not take exactly {len(args)} plain argument(s)")
    return _Interpreter(fn, tree, module, what, depth).run(dict(zip((x.arg for x in a.args[1:]), args)))


class _Interpreter:
    def __init__(self, fn, tree: ast.FunctionDef, module: nn.Module, what: str, depth: int):
        self.fn, self.tree, self.module, self.what, self.depth = fn, tree, module, what, depth
        self.scope, self.locals = Scope(fn), local_names(tree)
        self.env: dict[str, object] = {}

    def refuse(self, node: ast.AST, why: str = "is not proven row-local"):
        raise Refusal(f"{self.fn.__qualname__} line {getattr(node, 'lineno', '?')}: `{ast.unparse(node)[:80]}` {why}")

    def run(self, args: dict):
        """Straight-line assignments to names, then one ``return``."""
        self.env.update(args)
        body = [s for s in self.tree.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
            raise Refusal(f"{self.fn.__qualname__} does not end by returning a value")
        for stmt in body[:-1]:
            if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
                self.refuse(stmt, "is not an assignment to one name")
            self.env[stmt.targets[0].id] = self.eval(stmt.value)
        return self.eval(body[-1].value)

    # -- expressions ------------------------------------------------------------------------------

    def eval(self, node: ast.AST):
        if isinstance(node, ast.Constant) and (node.value is None or type(node.value) in (int, float, bool)):
            return Obj(node.value)
        if isinstance(node, ast.Name):
            if node.id in self.env:
                return self.env[node.id]
            if node.id in self.locals or node.id == "self":
                self.refuse(node, "is not bound here")
            return Obj(self.scope.lookup(node.id))
        if isinstance(node, ast.Attribute):
            return self._attribute(node)
        if isinstance(node, ast.BinOp):
            return self._binop(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            v = self.eval(node.operand)
            return v if v in TENSORS else Obj(-v.value) if self._number(v) else self.refuse(node)
        if isinstance(node, ast.Call):
            return self._call(node)
        self.refuse(node, "is not understood")

    @staticmethod
    def _number(v) -> bool:
        return isinstance(v, Obj) and type(v.value) in (int, float)

    def _attribute(self, node: ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "self" and "self" not in self.env:
            return self._self_attr(node)
        base = self.eval(node.value)
        if base in TENSORS and node.attr == "dtype":
            return "dtype"
        if isinstance(base, Obj) and base.value is not None and not isinstance(base.value, (int, float, bool)):
            if not hasattr(base.value, node.attr):
                self.refuse(node, "does not exist")
            return Obj(attribute(base.value, node.attr))
        self.refuse(node, "is not understood")

    def _self_attr(self, node: ast.Attribute):
        name, m = node.attr, self.module
        if name in vars(m) or inspect.getattr_static(type(m), name, _MISSING) is not _MISSING:
            return self._plain_attr(node, name)
        if name in m._parameters:
            if m._parameters[name] is None:
                self.refuse(node, "is a parameter set to None")
            return "vec"  # its shape was checked: (D,)
        if name in m._buffers or name in m._modules:
            self.refuse(node, "reads a buffer or submodule, which the proof does not follow")
        self.refuse(node, "is not an attribute of the module")

    def _plain_attr(self, node: ast.Attribute, name: str):
        """A number set on the instance, or a plain function of the class (a method, followed when called);
        neither may shadow a parameter (``nn.Module`` looks those up only when plain lookup fails)."""
        m = self.module
        if name in m._parameters or name in m._buffers or name in m._modules:
            self.refuse(node, "is shadowed by a plain attribute")
        if name in vars(m):
            value = vars(m)[name]
            if type(value) in (int, float):
                return Obj(value)
            self.refuse(node, f"reads {type(value).__name__}, which the proof does not follow")
        if isinstance(inspect.getattr_static(type(m), name), types.FunctionType):
            return Method(name)
        self.refuse(node, "is a class attribute that is not a plain method")

    def _binop(self, node: ast.BinOp):
        left, right = self.eval(node.left), self.eval(node.right)
        if isinstance(node.op, ast.Pow) and left in TENSORS and self._number(right):
            return left
        if not isinstance(node.op, _OPS):
            self.refuse(node, "is an operator the proof does not know")
        if self._number(left) and self._number(right):
            self.refuse(node, "is arithmetic on numbers the proof does not evaluate")
        tensors = [v for v in (left, right) if not self._number(v)]
        if not all(v in TENSORS for v in tensors):
            self.refuse(node, "is arithmetic on something that is not a tensor or a number")
        return _broadcast(set(tensors))

    def _call(self, node: ast.Call):
        if node.keywords and any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
            self.refuse(node, "unpacks arguments")
        func = node.func
        if isinstance(func, ast.Attribute) and not (isinstance(func.value, ast.Name) and func.value.id == "self"):
            base = self.eval(func.value)
            if base in TENSORS:
                return self._tensor_method(node, base, func.attr)
        target = self.eval(func)
        if isinstance(target, Method):
            if node.keywords:
                self.refuse(node, "passes keywords to a method")
            args = [self.eval(a) for a in node.args]
            if not all(v in TENSORS or self._number(v) for v in args):
                self.refuse(node, "passes a method something that is not a tensor or a number")
            return _call(self.module, target.name, args, self.what, self.depth + 1)
        fn = target.value if isinstance(target, Obj) else None
        if fn is not None and (any(fn is f for f in _FUNCTIONS) or elementwise.known_function(fn)):
            if len(node.args) != 1 or node.keywords:
                self.refuse(node, "is not an element-wise function of one tensor")
            v = self.eval(node.args[0])
            return v if v in TENSORS else self.refuse(node, "is not applied to a tensor")
        self.refuse(node, f"calls {getattr(fn, '__qualname__', type(fn).__name__)}, which the proof does not know")

    def _tensor_method(self, node: ast.Call, base: str, name: str):
        args, kws = node.args, {k.arg: k.value for k in node.keywords}
        if name in _ELEMENTWISE_METHODS and not args and not kws:
            return base
        if name in _CASTS and not args and not kws:
            return self._cast(node, base, {"float": torch.float32, "double": torch.float64}.get(name))
        if name == "type_as" and len(args) == 1 and not kws and self.eval(args[0]) in TENSORS:
            return base
        if name == "to" and len(args) == 1 and not kws:
            target = self.eval(args[0])
            if target == "dtype":
                return base
            if isinstance(target, Obj) and isinstance(target.value, torch.dtype):
                return self._cast(node, base, target.value if target.value in (torch.float32, torch.float64) else None)
            self.refuse(node, "is a cast the proof does not know")
        if name == "pow" and len(args) == 1 and not kws and self._number(self.eval(args[0])):
            return base
        if name in _REDUCTIONS and base in ("row", "col"):
            return self._reduction(node, args, kws)
        self.refuse(node, "is a tensor method the proof does not know")

    def _cast(self, node: ast.Call, base: str, wide) -> str:
        """A cast to a fixed dtype. Rows and columns round element by element, the same under EP; a (D,)
        parameter may only widen: its gradient is summed over the rows of each call, and rounding those
        per-call sums to a narrower dtype rounds one sum per expert in the model but one per rank under EP."""
        if base == "vec" and wide is None:
            self.refuse(node, "rounds a parameter to a narrower dtype (its gradient is rounded per call)")
        return base

    def _reduction(self, node: ast.Call, args: list, kws: dict):
        """``mean(-1, keepdim=True)`` / ``sum(dim=-1, keepdim=True)``: one column per row."""
        if len(args) > 2 or set(kws) - {"dim", "keepdim"} or (len(args) == 2 and "keepdim" in kws) \
                or (args and "dim" in kws):
            self.refuse(node, "is not a reduction over dim -1 with keepdim=True")
        dim = self.eval(args[0]) if args else self.eval(kws["dim"]) if "dim" in kws else None
        keep = self.eval(args[1]) if len(args) == 2 else self.eval(kws["keepdim"]) if "keepdim" in kws else None
        if dim != Obj(-1) or keep != Obj(True) or type(dim.value) is not int or keep.value is not True:
            self.refuse(node, "is not a reduction over dim -1 with keepdim=True")
        return "col"


def _broadcast(kinds: set[str]) -> str:
    """The value of element-wise arithmetic on (n, D) rows, (n, 1) columns and (D,) vectors."""
    if kinds == {"vec"}:
        return "vec"
    if kinds == {"col"}:
        return "col"
    return "row"
