"""Whitelist proof of an expert loop: the region autoep replaces.

The region is the per-expert loop that computes, for every (token t, slot k) whose expert
``e = idx[t, k]`` is one of the model's experts,

    acc[t] += w[t, k] * expert_e(x[t])

In transformers v5 batched experts it is the whole ``experts.forward`` (autoep replaces it); in a
v4-style block it is one ``for`` statement of the block's forward (autoep splices it out and runs the
rest of the forward as written). Either way every statement, ``if``, ``with``, loop, keyword and call
in the region is interpreted over abstract values below, and call targets are resolved to the objects
they denote (``names.Scope``). Whatever is not understood is refused, naming the construct: a proof
is a whitelist, not a landmark search.

Abstract values (what a name holds in the proof):
  Opaque      a tensor computed by the model's own code (or an argument), compared by identity
  Obj         a resolved Python object: a module, a function, an int, a dtype
  Mask/Hit    one_hot(idx).permute(...), and the experts it hits
  ExpertId    the loop's expert id (``row``: a 1-element tensor from ``nonzero()``)
  Index       token or slot positions of the current expert's (token, slot) pairs
  Row         a per-row expression over the current expert's input rows ``x[tok]``
"""
from __future__ import annotations

import ast
import functools
import operator

import torch
import torch.nn as nn

from autoep.detect import elementwise
from autoep.detect.loop_values import (
    Act,
    Attr,
    Chunks,
    Cond,
    Count,
    ExpertId,
    ExpertKey,
    ExpertMod,
    Hit,
    IdxEq,
    Index,
    LoopFacts,
    Mask,
    MaskRow,
    MaskSum,
    Method,
    Obj,
    Opaque,
    Pairs,
    Param,
    Row,
    RowModule,
    SelfRef,
    ShapeItem,
    Weight,
)
from autoep.detect.names import Scope, attribute, instance_attr, mangled
from autoep.detect.source import Refusal

# The torch functions a region may call, by identity with the genuine builtins (not a snapshot of
# ``F.linear`` taken at import, which a patch made before that import would be: ``autoep.detect.genuine``).
_ZEROS_LIKE, _WHERE, _GREATER = (torch._C._VariableFunctions.zeros_like, torch._C._VariableFunctions.where,
                                 torch._C._VariableFunctions.greater)
_ONE_HOT, _LINEAR = torch._C._nn.one_hot, torch._C._nn.linear



@functools.lru_cache(maxsize=None)
def local_names(tree: ast.FunctionDef) -> frozenset[str]:
    """Every name the function binds (parameters, assignment and loop targets, with-as names); cached
    per parsed tree (trees are cached per function object)."""
    names = {a.arg for a in tree.args.args + tree.args.kwonlyargs}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def stored_names(node: ast.AST) -> frozenset[str]:
    """Names assigned anywhere inside ``node`` (cached per node)."""
    return frozenset(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))


class Prover:
    """Abstract interpreter over one function's statements (see the module docstring)."""

    def __init__(self, fn, tree: ast.FunctionDef, owner: nn.Module, num_experts: int, batched: bool,
                 experts: nn.Module | None = None):
        self.fn, self.tree, self.owner, self.E, self.batched = fn, tree, owner, num_experts, batched
        # v4-style loops: the ModuleList/ModuleDict of experts (found by data flow), whatever its attribute name
        self.experts = experts if experts is not None else getattr(owner, "experts", None)
        self.scope = Scope(fn)
        self.locals = local_names(tree)
        self.env: dict[str, object] = {}
        self.facts = LoopFacts()
        self.where = fn.__qualname__
        # batched experts: the accumulator made by zeros_like(hidden) and its dtype (None: the hidden's)
        self.zeros_of_x: Opaque | None = None
        self.acc_dtype = None

    # -- errors -----------------------------------------------------------------------------------

    def refuse(self, node: ast.AST, why: str = "is not understood"):
        text = ast.unparse(node).splitlines()[0][:90]
        raise Refusal(f"{self.where} line {getattr(node, 'lineno', '?')}: `{text}` {why}")

    # -- expressions ------------------------------------------------------------------------------

    def eval(self, node: ast.AST):
        method = getattr(self, f"_e_{type(node).__name__}", None)
        if method is None:
            self.refuse(node)
        return method(node)

    def _e_Constant(self, node):
        return Obj(node.value)

    def _e_Tuple(self, node):
        items = [self.eval(e) for e in node.elts]
        if all(isinstance(i, Obj) for i in items):
            return Obj(tuple(i.value for i in items))
        self.refuse(node)

    def _e_JoinedStr(self, node):
        """``f"expert_{e}"``: a ModuleDict key made from the expert id."""
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant) and isinstance(v.value, str):
                parts.append(v.value)
            elif isinstance(v, ast.FormattedValue) and v.conversion == -1 and v.format_spec is None \
                    and isinstance(self.eval(v.value), ExpertId) and not self.eval(v.value).row:
                parts.append(None)
            else:
                self.refuse(node, "is not a key made from the expert id alone")
        if parts.count(None) != 1:
            self.refuse(node, "is not a key made from the expert id alone")
        i = parts.index(None)
        return ExpertKey("".join(parts[:i]), "".join(parts[i + 1:]))

    def _keys_follow_ids(self, key: "ExpertKey") -> bool:
        """The ModuleDict's first E entries in order are ``f"{prefix}{e}{suffix}"`` for e = 0, 1, ...: expert e
        is the e-th entry (as the runtime numbers them); no later entry has such a key (an experts container
        may hold other modules after its experts, e.g. NLLB's ``token_dropout``)."""
        keys = list(self.experts.keys())
        return keys[:self.E] == [f"{key.prefix}{e}{key.suffix}" for e in range(self.E)] and \
            not any(expert_key_id(k, key) is not None for k in keys[self.E:])

    def _e_UnaryOp(self, node):
        v = self.eval(node.operand)
        if isinstance(node.op, ast.USub) and isinstance(v, Obj) and isinstance(v.value, (int, float)):
            return Obj(-v.value)
        self.refuse(node)

    def _e_Name(self, node):
        if node.id in self.env:
            return self.env[node.id]
        if node.id == "self" and self.tree.args.args and self.tree.args.args[0].arg == "self":
            return SelfRef()
        if node.id in self.locals:
            self.refuse(node, "is not bound on every path here")
        return Obj(self.scope.lookup(node.id))

    def _e_Attribute(self, node):
        base = self.eval(node.value)
        if isinstance(base, SelfRef):
            return self._self_attr(node)
        if isinstance(base, Obj):
            if not hasattr(base.value, node.attr):
                self.refuse(node, "does not exist")
            return Obj(attribute(base.value, node.attr))
        if isinstance(base, Opaque) and node.attr in ("dtype", "device", "shape"):
            return Attr(base, node.attr)
        if base == Index("tok") and node.attr == "shape":
            return ("tok_shape",)
        self.refuse(node)

    def _self_attr(self, node: ast.Attribute):
        name = mangled(self.scope.fn, node.attr)  # ``self.__x`` in a class body reads ``_Class__x``
        if name == "training":  # changes by design (train/eval): never a constant to fold
            self.refuse(node, "reads the train/eval mode; the expert region must compute the same in both")
        value = instance_attr(self.owner, name, f"{self.where} line {node.lineno}")
        if self.batched and isinstance(value, nn.Parameter) and name in self.owner._parameters:
            return Param(name)
        if not self.batched and value is self.experts and type(value) in (nn.ModuleList, nn.ModuleDict):
            return Obj(value)
        if name == "act_fn":
            elementwise.check_activation_module(value, f"{type(self.owner).__name__}.act_fn")
            return Act()
        if self.batched and name in self.owner._modules and name not in vars(self.owner) \
                and isinstance(value, nn.Module) and not isinstance(value, nn.ModuleList):
            return RowModule(name)  # proven row-local with the layout (``experts_proof``), once D is known
        if name == "_apply_gate" and self.batched:
            if "_apply_gate" in vars(self.owner):
                self.refuse(node, "is an instance-level override")
            return Method(name)
        if isinstance(value, (bool, int, float)) and not isinstance(value, torch.Tensor):
            return Obj(value)
        if name == "config" and value is not None:
            return Obj(value)
        self.refuse(node, f"reads {type(value).__name__}, which the proof does not follow")

    def _e_Compare(self, node):
        if len(node.ops) != 1:
            self.refuse(node)
        left, right, op = self.eval(node.left), self.eval(node.comparators[0]), node.ops[0]
        return self._compare(node, left, op, right)

    def _compare(self, node, left, op, right):
        if _number(left) and _number(right) and type(op) in _FOLDED_COMPARE:
            return Obj(_FOLDED_COMPARE[type(op)](left.value, right.value))  # constants known at detection
        zero = isinstance(right, Obj) and right.value == 0 and not isinstance(right.value, bool)
        if isinstance(left, Count) and zero and isinstance(op, ast.Eq):
            return Cond("empty")
        if isinstance(left, Count) and zero and isinstance(op, (ast.Gt, ast.NotEq)):
            return Cond("nonempty")
        if isinstance(left, ExpertId) and not left.row and isinstance(op, ast.Eq) and isinstance(right, Obj):
            if right.value == self.E and type(right.value) is int:
                return Cond("padding")
            self.refuse(node, f"compares the expert id with {right.value!r}, not the padding id {self.E}")
        if isinstance(left, Opaque) and isinstance(op, ast.Eq) and isinstance(right, ExpertId) and not right.row:
            self._bind_ids(Mask(left, "TKE"), node)
            return IdxEq()
        self.refuse(node)

    def _e_BinOp(self, node):
        left, right = self.eval(node.left), self.eval(node.right)
        if isinstance(left, Obj) and isinstance(right, Obj) and type(left.value) is int and type(right.value) is int:
            if isinstance(node.op, ast.Add):
                return Obj(left.value + right.value)
            if isinstance(node.op, ast.Sub):
                return Obj(left.value - right.value)
        if isinstance(node.op, ast.Mult):
            return self._mult(node, left, right)
        if isinstance(node.op, ast.MatMult) and isinstance(left, Row) and isinstance(right, tuple) and right[0] == "param":
            return Row(("lin", left.expr, right[1], True) + right[2:])
        if isinstance(node.op, ast.Add) and isinstance(left, Row) and isinstance(right, tuple) and right[0] == "param":
            return Row(("bias", left.expr, right[1]) + right[2:])
        self.refuse(node)

    def _mult(self, node, left, right):
        if isinstance(left, Row) and isinstance(right, Row):
            return Row(("mul", left.expr, right.expr))
        if isinstance(left, Weight) and isinstance(right, Row):
            left, right = right, left
        if isinstance(left, Row) and isinstance(right, Weight) and right.col:
            return Row(("weighted", left.expr))
        self.refuse(node, "is not expert output × routing weight")

    def _e_Subscript(self, node):
        base = self.eval(node.value)
        sl = node.slice
        if isinstance(base, SelfRef) and not self.batched and self.owner is self.experts:
            base = Obj(self.experts)  # an experts container's own forward indexes ``self[...]``
        if isinstance(base, Param):
            e = self.eval(sl)
            if isinstance(e, ExpertId) and not e.row:
                self.facts.expert_ran = True
                return ("param", base.name)
            self.refuse(node, "does not index the expert weights by the loop's expert id")
        if isinstance(base, Obj) and isinstance(base.value, (nn.ModuleList, nn.ModuleDict)):
            e = self.eval(sl)
            if base.value is self.experts and isinstance(e, ExpertId) and isinstance(base.value, nn.ModuleList):
                return ExpertMod()
            if base.value is self.experts and isinstance(e, ExpertKey) and self._keys_follow_ids(e):
                return ExpertMod()
            self.refuse(node, "does not index the experts by the loop's expert id")
        if isinstance(base, ExpertId) and base.row and isinstance(sl, ast.Constant) and sl.value == 0:
            return ExpertId(row=False)
        if isinstance(base, Mask):
            e = self.eval(sl)
            if isinstance(e, ExpertId) and base.layout in ("EKT", "ETK"):
                return MaskRow(base, lead=e.row)
            self.refuse(node, "does not take the current expert's slice of the mask")
        if isinstance(base, (Pairs, Chunks)):
            if not (isinstance(sl, ast.Constant) and sl.value in (0, 1)):
                self.refuse(node)
            return self._unpack_item(base, sl.value)
        if base == ("tok_shape",) and isinstance(sl, ast.Constant) and sl.value == 0:
            return Count()
        if isinstance(base, Attr) and base.name == "shape" and isinstance(sl, (ast.Constant, ast.UnaryOp)):
            axis = self.eval(sl)
            if type(axis.value) is int:
                return ShapeItem(base.of, axis.value)
        if isinstance(base, Opaque):
            return self._index_tensor(node, base, sl)
        self.refuse(node)

    def _index_tensor(self, node, base: Opaque, sl: ast.AST):
        """``x[tok]`` (the expert's rows) or ``w[tok, slot(, None)]`` (their routing weights)."""
        items = sl.elts if isinstance(sl, ast.Tuple) else [sl]
        vals = [None if isinstance(i, ast.Constant) and i.value is None else self.eval(i) for i in items]
        if vals == [Index("tok")]:
            self._bind_role("x", base, node)
            return Row(("x",))
        if vals == [None, Index("tok")]:
            self._bind_role("x", base, node)
            return Row(("x_lead",))
        if vals[:2] == [Index("tok"), Index("slot")] and vals[2:] in ([], [None]):
            self._bind_role("w", base, node)
            return Weight(col=len(vals) == 3)
        if vals == [IdxEq()]:
            return ("pair_weights", base)  # w[idx == e]: the expert's pairs, token by token (minimind)
        self.refuse(node, "is not x[tok] or w[tok, slot]")

    def _unpack_item(self, value, i: int):
        if isinstance(value, Pairs):
            return Index(value.roles[i])
        return Row(("chunk", value.expr, i))

    def _bind_ids(self, mask: Mask, node) -> None:
        """The loop reads its expert ids from ``mask.idx``."""
        self._bind_role("idx", mask.idx, node)

    def _bind_role(self, role: str, value: Opaque, node) -> None:
        current = getattr(self.facts, role)
        if current is None:
            setattr(self.facts, role, value)
        elif current is not value:
            self.refuse(node, f"reads a second tensor as the experts' {role}")

    # -- calls ------------------------------------------------------------------------------------

    def _e_Call(self, node):
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            self.refuse(node, "unpacks arguments")
        func = node.func
        if isinstance(func, ast.Attribute):
            base = self.eval(func.value)
            if not isinstance(base, (Obj, SelfRef)):
                return self._method(node, base, func.attr)
        target = self.eval(func)
        return self._function(node, target)

    def _args(self, node, names: tuple[str, ...], required: int):
        """Bind a call's arguments to ``names`` (positional or keyword); refuse unknown keywords."""
        if len(node.args) > len(names):
            self.refuse(node, "has more arguments than the proof knows")
        bound = dict(zip(names, node.args))
        for kw in node.keywords:
            if kw.arg not in names or kw.arg in bound:
                self.refuse(node, f"has keyword `{kw.arg}`, which the proof does not know")
            bound[kw.arg] = kw.value
        if any(n not in bound for n in names[:required]):
            self.refuse(node, "misses an argument")
        return bound

    def _function(self, node, target):
        if isinstance(target, Act):
            (arg,) = self._args(node, ("input",), 1).values()
            return self._row_unary(node, arg, "act")
        if isinstance(target, Method):
            (arg,) = self._args(node, ("x",), 1).values()
            v = self.eval(arg)
            if not isinstance(v, Row):
                self.refuse(node)
            self.facts.uses_apply_gate = True
            return Row(("gate", v.expr))
        if isinstance(target, RowModule):
            v = self.eval(node.args[0]) if len(node.args) == 1 and not node.keywords else None
            if not isinstance(v, Row):
                self.refuse(node, "does not apply the module to the expert's rows alone")
            return Row(("norm", v.expr, target.name))
        if isinstance(target, ExpertMod):
            (arg,) = self._args(node, ("input",), 1).values()
            v = self.eval(arg)
            if not (isinstance(v, Row) and v.expr == ("x",)):
                self.refuse(node, "does not call the expert on its own rows x[tok]")
            self.facts.expert_ran = True
            return Row(("expert", v.expr))
        if not isinstance(target, Obj):
            self.refuse(node)
        fn = target.value
        if fn is _ZEROS_LIKE:
            args = self._args(node, ("input", "dtype", "device"), 1)
            src = self.eval(args["input"])
            if not isinstance(src, Opaque):
                self.refuse(node, "is not zeros_like(hidden_states)")
            return ("zeros_like", src, self._zeros_dtype(node, args, src))
        if fn is _ONE_HOT:
            args = self._args(node, ("tensor", "num_classes"), 1)
            idx = self.eval(args["tensor"])
            if not isinstance(idx, Opaque):
                self.refuse(node, "is not one_hot of the routed expert ids")
            if "num_classes" in args and not isinstance(self.eval(args["num_classes"]), Obj):
                self.refuse(node)
            return Mask(idx, "TKE")
        if fn is _WHERE:
            (arg,) = self._args(node, ("condition",), 1).values()
            return self._where(node, self.eval(arg))
        if fn is _GREATER:
            args = self._args(node, ("input", "other"), 2)
            return self._greater(node, self.eval(args["input"]), self.eval(args["other"]))
        if fn is _LINEAR:
            args = self._args(node, ("input", "weight"), 2)
            x, w = self.eval(args["input"]), self.eval(args["weight"])
            if isinstance(x, Row) and isinstance(w, tuple) and w[0] == "param":
                return Row(("lin", x.expr, w[1], False) + w[2:])
            self.refuse(node, "is not linear(rows, expert weight[e])")
        if fn is range:
            (arg,) = self._args(node, ("stop",), 1).values()
            if self.eval(arg) == Obj(self.E):
                return ("range",)
            self.refuse(node, f"does not range over all {self.E} experts")
        if fn is enumerate and not self.batched:
            (arg,) = self._args(node, ("iterable",), 1).values()
            v = self.eval(arg)
            if isinstance(v, Obj) and v.value is self.experts and isinstance(v.value, nn.ModuleList):
                return ("enumerate",)
            self.refuse(node)
        if fn is str and not self.batched:
            (arg,) = self._args(node, ("object",), 1).values()
            v = self.eval(arg)
            if isinstance(v, ExpertId) and not v.row:
                return ExpertKey("", "")
            self.refuse(node)
        if fn is len:
            (arg,) = self._args(node, ("obj",), 1).values()
            v = self.eval(arg)
            if isinstance(v, SelfRef) and not self.batched and self.owner is self.experts:
                v = Obj(self.experts)  # ``len(self)`` in an experts container's own forward
            if isinstance(v, Obj) and v.value is self.experts and self.experts is not None:
                return Obj(len(v.value))
            if isinstance(v, Index) and v.role == "tok":
                return Count()
            self.refuse(node)
        if elementwise.known_function(fn):
            args = self._args(node, ("input",), 1)
            return self._row_unary(node, args["input"], ("fn", fn))
        self.refuse(node, f"calls {getattr(fn, '__qualname__', type(fn).__name__)}, which the proof does not know")

    def _zeros_dtype(self, node, args, src: Opaque):
        """The accumulator's dtype: its input's (``None``), ``torch.float32``, or another tensor's (that
        tensor); on the input's device."""
        if "device" in args:
            v = self.eval(args["device"])
            if not (isinstance(v, Attr) and v.of is src and v.name == "device"):
                self.refuse(node, "puts the accumulator on another device")
        if "dtype" not in args:
            return None
        v = self.eval(args["dtype"])
        if v == Obj(torch.float32):
            return torch.float32
        if isinstance(v, Attr) and v.name == "dtype":
            return None if v.of is src else v.of
        self.refuse(node, "accumulates in a dtype the proof does not know")

    def _row_unary(self, node, arg: ast.AST, op):
        v = self.eval(arg)
        if not isinstance(v, Row):
            self.refuse(node)
        return Row(("act" if op == "act" else "fn", v.expr) + (() if op == "act" else (op[1],)))

    def _where(self, node, cond):
        if isinstance(cond, MaskRow) and not cond.lead:
            self._bind_ids(cond.mask, node)
            return Pairs(("slot", "tok") if cond.mask.layout == "EKT" else ("tok", "slot"))
        if isinstance(cond, IdxEq):
            return Pairs(("tok", "slot"))
        self.refuse(node, "is not where(mask[e]) or where(idx == e)")

    def _greater(self, node, left, right):
        if isinstance(left, MaskSum) and isinstance(right, Obj) and right.value == 0:
            return ("hit_bool", left.mask)
        self.refuse(node, "is not (mask summed over tokens and slots) > 0")

    def _method(self, node, base, name: str):
        if isinstance(base, (IdxEq, tuple)) and (base == IdxEq() or base[:1] in (("tok_any",), ("tok_nonzero",),
                                                                                 ("pair_weights",))):
            return self._pair_method(node, base, name)
        if isinstance(base, Mask) and name == "permute":
            dims = tuple(self.eval(a).value for a in node.args) if not node.keywords else None
            layouts = {(2, 1, 0): "EKT", (2, 0, 1): "ETK"}
            if base.layout == "TKE" and dims in layouts:
                return Mask(base.idx, layouts[dims])
            self.refuse(node, "is not permute(2, 1, 0) or permute(2, 0, 1) of the one-hot mask")
        if isinstance(base, Mask) and name == "sum":
            args = self._args(node, ("dim",), 1)
            dims = self.eval(args["dim"])
            if isinstance(dims, Obj) and base.layout in ("EKT", "ETK") and set(dims.value or ()) in ({-1, -2}, {1, 2}):
                return MaskSum(base)
            self.refuse(node, "does not sum the mask over tokens and slots")
        if isinstance(base, tuple) and base[0] == "hit_bool" and name == "nonzero" and not node.args:
            if node.keywords and [(k.arg, ast.unparse(k.value)) for k in node.keywords] != [("as_tuple", "False")]:
                self.refuse(node, "is not nonzero()")
            return Hit(base[1])
        if isinstance(base, Hit) and not base.scalar and name == "squeeze":
            (arg,) = self._args(node, ("dim",), 1).values()
            if self.eval(arg) in (Obj(-1), Obj(1)):
                return Hit(base.mask, scalar=True)
        if isinstance(base, ExpertId) and name == "item" and not node.args and not node.keywords:
            if not base.row:
                return base
        if isinstance(base, MaskRow) and base.lead and name == "squeeze":
            (arg,) = self._args(node, ("dim",), 1).values()
            if self.eval(arg) == Obj(0):
                return MaskRow(base.mask, lead=False)
        if isinstance(base, Index) and base.role == "tok" and name == "numel" and not node.args and not node.keywords:
            return Count()
        if isinstance(base, Row):
            return self._row_method(node, base, name)
        if isinstance(base, Weight) and name == "unsqueeze" and not base.col:
            (arg,) = self._args(node, ("dim",), 1).values()
            if self.eval(arg) in (Obj(-1), Obj(1)):
                return Weight(col=True)
        if isinstance(base, tuple) and base[:1] == ("param",) and len(base) == 2 and name == "float" and not node.args:
            return base + ("f32",)  # this expert's weight, upcast to float32
        if isinstance(base, Weight) and name == "float" and not node.args and not node.keywords:
            return base  # the product is formed in float32 either way (the exchange combines in fp32)
        if isinstance(base, Weight) and name == "to":
            return Weight(base.col) if self._is_dtype_cast(node) else self.refuse(node, "is a cast the proof does not know")
        self.refuse(node)

    def _pair_method(self, node, base, name: str):
        """minimind's spelling of the expert's pairs: ``mask = idx == e``; ``if mask.any():``; tokens
        ``mask.any(dim=-1).nonzero().flatten()``; weights ``w[mask].view(-1, 1)``. The weights line up with
        the tokens while no token meets the expert twice (else the shapes differ and the model's own line
        fails)."""
        kwargs = {k.arg: self.eval(k.value) for k in node.keywords}
        args = [self.eval(a) for a in node.args]
        if base == IdxEq() and name == "any" and not args and not kwargs:
            return Cond("nonempty")
        if base == IdxEq() and name == "any" and (args or list(kwargs.values())) in ([Obj(-1)], [Obj(1)]) \
                and set(kwargs) <= {"dim"}:
            return ("tok_any",)
        if base == ("tok_any",) and name == "nonzero" and not args and not kwargs:
            return ("tok_nonzero",)
        if base == ("tok_nonzero",) and not kwargs and (name, args) in (("flatten", []), ("squeeze", [Obj(-1)]),
                                                                          ("squeeze", [Obj(1)])):
            return Index("tok")
        if base[:1] == ("pair_weights",) and name == "view" and args == [Obj(-1), Obj(1)] and not kwargs:
            self._bind_role("w", base[1], node)
            return Weight(col=True)
        self.refuse(node, "is not minimind's mask.any() / mask.any(dim=-1).nonzero().flatten() / w[mask].view(-1, 1)")

    def _is_dtype_cast(self, node) -> bool:
        """``.to(t.dtype)`` where ``t`` is the experts' input or accumulator (no other dtype, no kwargs)."""
        if len(node.args) != 1 or node.keywords:
            return False
        v = self.eval(node.args[0])
        return isinstance(v, Attr) and v.name == "dtype" and v.of in (self.facts.x, self.facts.acc) and v.of is not None

    def _row_method(self, node, base: Row, name: str):
        if name == "chunk":
            args = self._args(node, ("chunks", "dim"), 2)
            if self.eval(args["chunks"]) == Obj(2) and self.eval(args["dim"]) == Obj(-1):
                return Chunks(base.expr)
            self.refuse(node, "is not chunk(2, dim=-1)")
        if name == "reshape" and base.expr == ("x_lead",):
            if len(node.args) == 2 and not node.keywords and self.eval(node.args[0]) == Obj(-1):
                self.eval(node.args[1])  # any size: another one changes the rows and fails on shapes
                return Row(("x",))
            self.refuse(node, "is not reshape(-1, hidden_dim)")
        if name == "to":
            if self._is_dtype_cast(node):
                return Row(("cast", base.expr))
            self.refuse(node, "is a cast the proof does not know")
        if name == "float" and not node.args and not node.keywords:
            return Row(("f32", base.expr))
        self.refuse(node)

    # -- statements -------------------------------------------------------------------------------

    def assign(self, stmt: ast.Assign) -> None:
        if len(stmt.targets) != 1:
            self.refuse(stmt, "assigns several targets")
        target, value = stmt.targets[0], self.eval(stmt.value)
        if isinstance(target, ast.Name):
            self.env[target.id] = value
        elif isinstance(target, ast.Tuple) and len(target.elts) == 2 and all(isinstance(t, ast.Name) for t in target.elts):
            if not isinstance(value, (Pairs, Chunks)):
                self.refuse(stmt, "unpacks something the proof cannot split")
            for i, t in enumerate(target.elts):
                self.env[t.id] = self._unpack_item(value, i)
        else:
            self.refuse(stmt, "assigns to something other than names")

    # -- the loop ---------------------------------------------------------------------------------

    def loop(self, loop: ast.For) -> None:
        """Prove ``loop`` adds ``w[t, k] * expert_e(x[t])`` into one accumulator for every routed pair."""
        if loop.orelse or not isinstance(loop, ast.For):
            self.refuse(loop, "is not a plain for loop")
        it, target = self.eval(loop.iter), loop.target
        if isinstance(it, Hit) and isinstance(target, ast.Name):
            self._bind_ids(it.mask, loop)
            self.env[target.id] = ExpertId(row=not it.scalar)
            self.facts.idle = "skip"  # only the experts hit are visited
        elif it == ("range",) and isinstance(target, ast.Name):
            self.env[target.id] = ExpertId(row=False)
        elif it == ("enumerate",) and isinstance(target, ast.Tuple) and len(target.elts) == 2 \
                and all(isinstance(t, ast.Name) for t in target.elts):
            self.env[target.elts[0].id] = ExpertId(row=False)
            self.env[target.elts[1].id] = ExpertMod()
        else:
            self.refuse(loop, "does not iterate over the experts (hit experts, range(E) or enumerate(experts))")
        self.loop_target = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        before = set(self.env) - self.loop_target
        stored = set().union(*(stored_names(s) for s in loop.body))
        if stored & before:
            self.refuse(loop, f"rebinds {sorted(stored & before)}, which hold values from before the loop")
        self.body(loop.body)
        if self.facts.adds != 1:
            self.refuse(loop, f"adds expert outputs {self.facts.adds} times per expert, not once")

    def body(self, stmts: list[ast.stmt]) -> None:
        for stmt in stmts:
            if isinstance(stmt, ast.Assign):
                self.assign(stmt)
            elif isinstance(stmt, ast.If):
                self._guard(stmt)
            elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
                self._accumulate(stmt.value)
            elif isinstance(stmt, ast.AugAssign) and not self.batched:
                self._add_at_rows(stmt)
            else:
                self.refuse(stmt)

    def _guard(self, stmt: ast.If) -> None:
        """``if <no rows or padding id>: continue`` and ``if <rows>: <rest>`` only skip nothing-to-add."""
        if _reads_training(stmt.test):
            self.refuse(stmt, self._training_why(stmt))
        cond = self.eval(stmt.test)
        if isinstance(cond, Obj) and type(cond.value) is bool:
            self._fold_branch(stmt, cond.value)
            return
        if not isinstance(cond, Cond) or (stmt.orelse and cond.kind != "nonempty"):
            self.refuse(stmt, "is a condition the proof does not know")
        if cond.kind in ("empty", "padding") and len(stmt.body) == 1 and isinstance(stmt.body[0], ast.Continue):
            if cond.kind == "empty" and not self.facts.expert_ran:
                self.facts.idle = "skip"  # an expert without rows is never called
            return
        if cond.kind == "nonempty":
            ran = self.facts.expert_ran
            self.body(stmt.body)
            touch = self._touch(stmt.orelse) if stmt.orelse else None
            if stmt.orelse and not touch:
                self.refuse(stmt.orelse[0], "runs for an expert without tokens, which the proof does not know")
            if not ran:
                self.facts.idle = touch or "skip"
            return
        self.refuse(stmt, "skips an expert that has tokens")

    def _training_why(self, stmt: ast.If) -> str:
        """Why a branch on ``self.training`` is refused, naming the random module it runs while training."""
        for node in ast.walk(ast.Module(body=stmt.body, type_ignores=[])):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
                module = getattr(self.owner, node.func.attr, None)
                if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
                    return (f"runs self.{node.func.attr} ({type(module).__name__} with p={module.p}) while training: "
                            "it draws random numbers per expert call (not deterministic), which EP cannot "
                            "reproduce; exact only at p=0 (or opt out)")
        return "branches on the train/eval mode; the expert region must compute the same in both"

    def _fold_branch(self, stmt: ast.If, taken: bool) -> None:
        """``if <constant instance attributes compared>:``: only the branch the values select runs, so only it
        is proven; the values are recorded (``LoopFacts.folded``; ``names.instance_attr`` has them re-checked
        before each call), and a change after detection is drift."""
        names = {n.id for n in ast.walk(stmt.test) if isinstance(n, ast.Name)}
        if names - {self.tree.args.args[0].arg}:  # a global's value is not watched after detection
            self.refuse(stmt, f"branches on {sorted(names - {'self'})}, not on the module's own constant attributes")
        for node in ast.walk(stmt.test):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                name = mangled(self.scope.fn, node.attr)
                value = getattr(self.owner, name)
                if type(value) not in (bool, int, float):  # only plain numbers are re-checked before each call
                    self.refuse(stmt, f"branches on self.{node.attr}, a {type(value).__name__}, not a plain number")
                self.facts.folded[name] = value
        self.body(stmt.body if taken else stmt.orelse)

    def _touch(self, stmts: list[ast.stmt]) -> str:
        """minimind's ``elif self.training: acc[0, 0] += 0 * sum(p.sum() for p in expert.parameters())`` for
        an expert without tokens: it adds zero (finite weights) and gives that expert zero gradients without
        calling it, as the exchange does (``idle`` "touch"); so it is left out. Returns "touch", "touch_training"
        (under ``if self.training:``) or "" where ``stmts`` is not that."""
        kind = "touch"
        if len(stmts) == 1 and isinstance(stmts[0], ast.If) and not stmts[0].orelse:
            test = stmts[0].test
            if isinstance(test, ast.Attribute) and test.attr == "training" and isinstance(self.eval(test.value), SelfRef):
                stmts, kind = stmts[0].body, "touch_training"
        if len(stmts) != 1 or not isinstance(stmts[0], ast.AugAssign) or not isinstance(stmts[0].op, ast.Add):
            return ""
        target, value = stmts[0].target, stmts[0].value
        if not (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                and all(isinstance(i, ast.Constant) and i.value == 0 for i in getattr(target.slice, "elts", [target.slice]))):
            return ""
        acc = self.eval(target.value)
        if acc is not self.facts.acc or not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult)
                                             and isinstance(value.left, ast.Constant) and value.left.value == 0
                                             and not isinstance(value.left.value, bool)):
            return ""
        return kind if self._sum_of_expert_params(value.right) else ""

    def _sum_of_expert_params(self, node: ast.AST) -> bool:
        """``sum(p.sum() for p in <the loop's expert>.parameters())``."""
        if not (isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords
                and isinstance(node.args[0], ast.GeneratorExp) and self.eval(node.func) == Obj(sum)):
            return False
        gen = node.args[0]
        (comp,) = gen.generators if len(gen.generators) == 1 else (None,)
        ok = comp is not None and not comp.ifs and isinstance(comp.target, ast.Name)
        ok = ok and isinstance(gen.elt, ast.Call) and isinstance(gen.elt.func, ast.Attribute) and gen.elt.func.attr == "sum"
        ok = ok and not gen.elt.args and not gen.elt.keywords and isinstance(gen.elt.func.value, ast.Name)
        ok = ok and gen.elt.func.value.id == comp.target.id
        it = comp.iter if ok else None
        ok = ok and isinstance(it, ast.Call) and not it.args and not it.keywords and isinstance(it.func, ast.Attribute)
        return ok and it.func.attr == "parameters" and isinstance(self.eval(it.func.value), ExpertMod)

    def _add_at_rows(self, stmt: ast.AugAssign) -> None:
        """``acc[tok] += rows`` (mistral-inference): the same as ``index_add_`` while a token meets an
        expert at most once, which the exchange checks at run time (``LoopFacts.add_at_rows``)."""
        target = stmt.target
        if not (isinstance(stmt.op, ast.Add) and isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)):
            self.refuse(stmt, "is an in-place update the proof does not know")
        acc = self.eval(target.value)
        if not isinstance(acc, Opaque) or any(acc is getattr(self.facts, r) for r in ("x", "idx", "w")):
            self.refuse(stmt, "does not add into an accumulator of its own")
        if self.eval(target.slice) != Index("tok"):
            self.refuse(stmt, "does not add at the expert's token rows")
        self._bind_role("acc", acc, stmt)
        self._contribution(stmt, self.eval(stmt.value))
        self.facts.add_at_rows = True

    def _contribution(self, node, rows) -> None:
        if not isinstance(rows, Row):
            self.refuse(node, "does not add expert output × routing weight")
        expr = strip_casts(rows.expr)
        if expr[0] != "weighted":
            self.refuse(node, "does not add expert output × routing weight")
        self.facts.expert = expr[1]
        self.facts.adds += 1

    def _accumulate(self, call: ast.Call) -> None:
        """``acc.index_add_(0, tok, rows)``: the one side effect of the loop."""
        func = call.func
        if not (isinstance(func, ast.Attribute) and func.attr == "index_add_" and isinstance(func.value, ast.Name)):
            self.refuse(call, "is a call whose effect the proof does not know")
        acc = self.eval(func.value)
        if not isinstance(acc, Opaque) or (self.batched and acc is not self.zeros_of_x):
            self.refuse(call, "does not add into a zero-initialised accumulator")
        if any(acc is getattr(self.facts, role) for role in ("x", "idx", "w")):
            self.refuse(call, "adds into the tensor the loop reads its tokens, ids or weights from")
        self._bind_role("acc", acc, call)
        if len(call.args) != 3 or call.keywords:
            self.refuse(call, "is not index_add_(0, tok, rows) (no alpha, no other arguments)")
        dim, tok, rows = (self.eval(a) for a in call.args)
        if dim != Obj(0) or tok != Index("tok"):
            self.refuse(call, "does not add rows at the expert's token positions")
        self._contribution(call, rows)


_FOLDED_COMPARE = {ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Lt: operator.lt, ast.LtE: operator.le,
                   ast.Eq: operator.eq, ast.NotEq: operator.ne}


def _reads_training(test: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "training" and isinstance(n.value, ast.Name)
               and n.value.id == "self" for n in ast.walk(test))


def _number(v) -> bool:
    return isinstance(v, Obj) and type(v.value) in (int, float)


def expert_key_id(key: str, pattern: ExpertKey) -> int | None:
    """The expert id ``e`` with ``f"{prefix}{e}{suffix}" == key`` (an id a loop's key can name), else None."""
    p, s = pattern.prefix, pattern.suffix
    if not (key.startswith(p) and key.endswith(s) and len(key) > len(p) + len(s)):
        return None
    digits = key[len(p):len(key) - len(s)]
    return int(digits) if digits.isdigit() and str(int(digits)) == digits else None


def strip_casts(expr: tuple) -> tuple:
    """A per-row computation without its ``.to(<x or acc>.dtype)`` casts."""
    while expr[0] == "cast":
        expr = expr[1]
    return expr


def no_grad_block(p: Prover, stmt: ast.With, indices: tuple = (Mask, Hit)) -> None:
    """``with torch.no_grad():`` around index computations only (by default the mask and the experts hit;
    ``indices`` the abstract values allowed): integer tensors, so there is no gradient to lose."""
    if len(stmt.items) != 1 or stmt.items[0].optional_vars is not None:
        p.refuse(stmt)
    ctx = stmt.items[0].context_expr
    if not (isinstance(ctx, ast.Call) and not ctx.args and not ctx.keywords and p.eval(ctx.func) == Obj(torch.no_grad)):
        p.refuse(stmt, "is a context the proof does not know")
    for inner in stmt.body:
        if not isinstance(inner, ast.Assign):
            p.refuse(inner, "inside no_grad is not an assignment")
        value = p.eval(inner.value)
        if not isinstance(value, indices):
            p.refuse(inner, "computes something with gradients switched off")
        p.assign(inner)
