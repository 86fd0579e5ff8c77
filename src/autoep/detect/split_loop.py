"""Whitelist proof of the argsort/split expert loop: DeepSeek's remote-code ``moe_infer`` and transformers
4.x ``DeepseekV2MoE.moe``. The block sorts its (token, slot) rows by expert and counts them itself; the
region autoep replaces is the loop over those counts and the concatenation after it,

    outputs, start = [], 0
    for i, n in enumerate(counts):           # counts[e]: rows of expert e, in expert order
        end = start + n
        if n == 0:
            continue
        outputs.append(self.experts[i](rows[start:end]))
        start = end
    outs = torch.cat(outputs, dim=0) if outputs else rows.new_empty(0)

which computes each expert's output on its own contiguous rows, concatenated in expert order
(``sum(counts)`` rows). ``split_region`` proves exactly that, statement by statement, and names the
statements to replace by ``outs = __autoep_expert_loop__(self, rows, counts)``; the block's own code
before (counting, sorting) and after (unsorting, weighting, summing) runs as written. Whatever is not
this shape is refused, naming the construct.

Abstract values: ``_START``/``_END`` the current expert's row offsets (``_END = _START + n``), ``_N`` its
row count, ``_E`` its id, ``_LIST`` the outputs list, ``_EXPERT`` ``self.experts[e]``, ``("seg", rows)``
its rows, ``_OUT`` the expert's output on them.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

import torch
import torch.nn as nn

from autoep.detect.names import Scope, instance_attr, mangled
from autoep.detect.source import Refusal

_START, _END, _N, _E, _LIST, _EXPERT, _OUT, _ZERO = (
    "start", "end", "n", "expert_id", "outputs", "expert", "expert_out", "n_is_zero")
# Host-side views of the counts the loop may iterate instead of the tensor itself.
_COUNT_VIEWS = ("tolist", "cpu", "numpy")


@dataclass(frozen=True)
class SplitRegion:
    """Top-level statements ``first..last`` of the method are the region; it reads ``rows`` and ``counts``
    and leaves its result in ``out``. ``empty_1d``: with no rows the block's own code gives
    ``rows.new_empty(0)`` (a 1-D tensor), which the replacement reproduces."""

    first: int
    last: int
    out: str
    rows: str
    counts: str
    empty_1d: bool
    idle: str = "call"  # an expert with a zero count: "call" it on no rows, or "skip" it (``if n == 0: continue``)


def is_split_loop(loop: ast.For, attr: str = "experts") -> bool:
    """A ``for i, n in enumerate(<not self.<attr>>)`` loop: the shape this module proves (``attr``: the
    experts container's attribute, found by data flow)."""
    it = loop.iter
    return (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate"
            and len(it.args) == 1 and not any(_is_self_attr(n, attr) for n in ast.walk(it.args[0])))


def split_region(fn, stmts: list[ast.stmt], block: nn.Module, loop_index: int, attr: str = "experts") -> SplitRegion:
    """Prove the statements around ``stmts[loop_index]`` are the argsort/split region (module docstring)."""
    proof = _SplitProof(fn, block, attr)
    first = proof.inits(stmts, loop_index)
    proof.loop(stmts[loop_index])
    if loop_index + 1 >= len(stmts):
        raise Refusal(f"{proof.where}: nothing concatenates the expert outputs after the loop")
    out, empty_1d = proof.concat(stmts[loop_index + 1])
    return SplitRegion(first, loop_index + 1, out, proof.rows, proof.counts, empty_1d, proof.idle)


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name)
            and node.value.id == "self")


class _SplitProof:
    def __init__(self, fn, block: nn.Module, attr: str = "experts"):
        self.block, self.scope, self.where, self.attr = block, Scope(fn), fn.__qualname__, attr
        self.list_name = self.start_name = self.rows = self.counts = None
        self.env: dict[str, object] = {}
        self.appends = 0
        self.idle, self.ran = "call", False  # ``_skip`` before the expert ran: a zero count skips it

    def refuse(self, node: ast.AST, why: str = "is not understood"):
        text = ast.unparse(node).splitlines()[0][:90]
        raise Refusal(f"{self.where} line {getattr(node, 'lineno', '?')}: `{text}` {why}")

    # -- before the loop: ``outputs = []`` and ``start = 0`` -------------------------------------

    def inits(self, body: list[ast.stmt], loop_index: int) -> int:
        """Index of the first init statement; the statements right before the loop bind a fresh list and
        a zero offset (in any order, or as one tuple assignment) and nothing else."""
        first = loop_index
        while first > 0 and self._init_pairs(body[first - 1]) is not None:
            first -= 1
        for stmt in body[first:loop_index]:
            for name, value in self._init_pairs(stmt):
                kind = "list_name" if isinstance(value, ast.List) else "start_name"
                if getattr(self, kind) is not None:
                    self.refuse(stmt, f"binds a second {kind.split('_')[0]} before the expert loop")
                setattr(self, kind, name)
        if self.list_name is None or self.start_name is None:
            raise Refusal(f"{self.where}: the expert loop is not preceded by `outputs = []` and `start = 0`")
        return first

    @staticmethod
    def _init_pairs(stmt: ast.stmt):
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
            return None
        target, value = stmt.targets[0], stmt.value
        names, values = ([target], [value]) if isinstance(target, ast.Name) else (
            (target.elts, value.elts) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
            and len(target.elts) == len(value.elts) else ([], []))
        pairs = []
        for n, v in zip(names, values):
            fresh_list = isinstance(v, ast.List) and not v.elts
            zero = isinstance(v, ast.Constant) and type(v.value) is int and v.value == 0
            if not (isinstance(n, ast.Name) and (fresh_list or zero)):
                return None
            pairs.append((n.id, v))
        return pairs or None

    # -- the loop -----------------------------------------------------------------------------------

    def loop(self, loop: ast.For) -> None:
        if loop.orelse:
            self.refuse(loop, "has an else branch")
        if self.scope.resolve(loop.iter.func) is not enumerate:
            self.refuse(loop.iter, "is not the builtin enumerate")
        self.counts = self._counts_name(loop.iter.args[0])
        target = loop.target
        if not (isinstance(target, ast.Tuple) and len(target.elts) == 2
                and all(isinstance(t, ast.Name) for t in target.elts)):
            self.refuse(loop, "does not unpack (expert id, row count)")
        i, n = (t.id for t in target.elts)
        if len({i, n, self.list_name, self.start_name, self.counts}) != 5:
            self.refuse(loop, "reuses a name the loop reads")
        self.env = {self.list_name: _LIST, self.start_name: _START, i: _E, n: _N}
        self.loop_names = {i, n}
        self._body(loop.body, top=True)
        if self.appends != 1:
            self.refuse(loop, f"appends {self.appends} expert outputs per expert, not one")
        if self.env.get(self.start_name) != _END:
            self.refuse(loop, f"does not advance `{self.start_name}` to the expert's end offset")

    def _counts_name(self, node: ast.AST) -> str:
        """``counts`` or ``counts.tolist()`` / ``.cpu().numpy()``: a name bound before the region."""
        while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args \
                and not node.keywords and node.func.attr in _COUNT_VIEWS:
            node = node.func.value
        if not isinstance(node, ast.Name):
            self.refuse(node, "is not the block's per-expert row counts held by a name")
        return node.id

    def _body(self, stmts: list[ast.stmt], top: bool) -> None:
        for stmt in stmts:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                self._assign(stmt, stmt.targets[0].id)
            elif isinstance(stmt, ast.If) and top:
                self._skip(stmt)
            elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
                self._append(stmt.value)
            else:
                self.refuse(stmt)

    def _assign(self, stmt: ast.Assign, name: str) -> None:
        value = self.eval(stmt.value)
        if name in (self.list_name, self.counts, self.rows) or name in self.loop_names:
            self.refuse(stmt, "rebinds a name the loop reads")
        if name == self.start_name and value != _END:
            self.refuse(stmt, f"sets `{name}` to something other than the expert's end offset")
        self.env[name] = value

    def _skip(self, stmt: ast.If) -> None:
        """``if n == 0: continue``: skipping an expert without rows adds nothing and moves no offset."""
        if stmt.orelse or self.eval(stmt.test) != _ZERO or [type(s) for s in stmt.body] != [ast.Continue]:
            self.refuse(stmt, "is a condition the proof does not know (only `if n == 0: continue`)")
        if self.appends or self.env.get(self.start_name) != _START:
            self.refuse(stmt, "skips after the expert's output was appended or its offset moved")
        if not self.ran:
            self.idle = "skip"

    def _append(self, call: ast.Call) -> None:
        f = call.func
        ok = isinstance(f, ast.Attribute) and f.attr == "append" and isinstance(f.value, ast.Name)
        if not (ok and self.env.get(f.value.id) == _LIST and len(call.args) == 1 and not call.keywords):
            self.refuse(call, "is a call whose effect the proof does not know")
        if self.eval(call.args[0]) != _OUT:
            self.refuse(call, "does not append the expert's output on its own rows")
        self.appends += 1

    # -- expressions --------------------------------------------------------------------------------

    def eval(self, node: ast.AST):
        if isinstance(node, ast.Name):
            return self.env[node.id] if node.id in self.env else ("outer", node.id)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return self._self_attr(node)
        if isinstance(node, ast.BinOp):
            return self._binop(node, self.eval(node.left), self.eval(node.right))
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
            if self.eval(node.left) == _N and self.eval(node.comparators[0]) == 0:
                return _ZERO
        if isinstance(node, ast.Subscript):
            return self._subscript(node, self.eval(node.value))
        if isinstance(node, ast.Call) and not node.keywords and len(node.args) == 1:
            if self.eval(node.func) == _EXPERT and self.eval(node.args[0]) == ("seg", self.rows):
                self.ran = True
                return _OUT
        self.refuse(node)

    def _self_attr(self, node: ast.Attribute):
        value = instance_attr(self.block, mangled(self.scope.fn, node.attr), f"{self.where} line {node.lineno}")
        if node.attr == self.attr and type(value) is nn.ModuleList:
            return ("experts",)
        if type(value) is int:
            return value
        self.refuse(node, f"reads {type(value).__name__}, which the proof does not follow")

    def _binop(self, node, left, right):
        both_int = type(left) is int and type(right) is int
        if both_int and isinstance(node.op, (ast.Add, ast.Mult)):
            return left + right if isinstance(node.op, ast.Add) else left * right
        if isinstance(node.op, ast.Add) and {left, right} == {_START, _N}:
            return _END
        if isinstance(node.op, ast.Add) and _E in (left, right) and 0 in (left, right):
            return _E  # e.g. ``i + self.ep_rank * self.experts_per_rank`` with both attributes 0 / E
        self.refuse(node)

    def _subscript(self, node: ast.Subscript, base):
        if base == ("experts",) and self.eval(node.slice) == _E:
            return _EXPERT
        sl = node.slice
        if isinstance(base, tuple) and base[0] == "outer" and isinstance(sl, ast.Slice) and sl.step is None \
                and sl.lower is not None and sl.upper is not None \
                and self.eval(sl.lower) == _START and self.eval(sl.upper) == _END:
            if self.rows not in (None, base[1]):
                self.refuse(node, "reads a second tensor as the experts' rows")
            self.rows = base[1]
            return ("seg", self.rows)
        self.refuse(node, "is not experts[i] or rows[start:end]")

    # -- after the loop: the concatenation ------------------------------------------------------------

    def concat(self, stmt: ast.stmt) -> tuple[str, bool]:
        """``out = torch.cat(outputs[, dim=0])``, optionally ``... if outputs else rows.new_empty(0)``."""
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            self.refuse(stmt, "is not `out = torch.cat(outputs, dim=0)` right after the expert loop")
        value, empty_1d = stmt.value, False
        if isinstance(value, ast.IfExp):
            if not (self._is_nonempty_test(value.test) and self._is_empty_rows(value.orelse)):
                self.refuse(stmt, "is not `torch.cat(outputs, dim=0) if outputs else rows.new_empty(0)`")
            value, empty_1d = value.body, True
        if not self._is_cat_of_outputs(value):
            self.refuse(stmt, "is not `torch.cat(outputs, dim=0)`")
        return stmt.targets[0].id, empty_1d

    def _is_cat_of_outputs(self, node: ast.AST) -> bool:
        if not (isinstance(node, ast.Call) and len(node.args) == 1 and self._is_list(node.args[0])):
            return False
        if self.scope.resolve(node.func) is not torch.cat:
            return False
        dims = [k.value for k in node.keywords if k.arg == "dim"]
        if len(node.keywords) != len(dims):
            return False
        return all(isinstance(d, ast.Constant) and d.value == 0 for d in dims)

    def _is_list(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id == self.list_name

    def _is_nonempty_test(self, node: ast.AST) -> bool:
        if self._is_list(node):
            return True
        is_len = (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 1
                  and self._is_list(node.args[0]) and self.scope.resolve(node.func) is len)
        if is_len:
            return True
        return (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Gt)
                and self._is_nonempty_test(node.left) and isinstance(node.comparators[0], ast.Constant)
                and node.comparators[0].value == 0)

    def _is_empty_rows(self, node: ast.AST) -> bool:
        f = node.func if isinstance(node, ast.Call) else None
        return (isinstance(f, ast.Attribute) and f.attr == "new_empty" and isinstance(f.value, ast.Name)
                and f.value.id == self.rows and len(node.args) == 1 and not node.keywords
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == 0)


# ---------------------------------------------------------------------------------------------
# DeepSeek's training loop: per-row outputs by masked assignment
# ---------------------------------------------------------------------------------------------


def is_masked_loop(loop: ast.For) -> bool:
    """One assignment into a subscript in the body: the shape ``masked_loop`` proves."""
    assigns = [s for s in loop.body if isinstance(s, ast.Assign)]
    return bool(assigns) and isinstance(assigns[-1].targets[0], ast.Subscript)


def masked_loop(fn, block: nn.Module, loop: ast.For, attr: str = "experts") -> tuple[str, str, str]:
    """Prove ``loop`` is

        for i, expert in enumerate(self.experts):        # or: for i in range(len(self.experts))
            y[ids == i] = expert(x[ids == i])             # or self.experts[i](...); the mask may be named

    which sets ``y[p] = expert_{ids[p]}(x[p])`` for every row whose id names an expert and leaves the
    others as they were (DeepSeek's remote-code training path, over rows repeated once per slot).
    Returns the names ``(y, x, ids)``."""
    proof = _MaskedProof(fn, block, attr)
    proof.header(loop)
    *masks, store = loop.body
    for stmt in masks:
        proof.mask_assign(stmt)
    names = proof.store(store)
    rebound = set(names) & {n.id for n in ast.walk(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    if rebound:  # the next expert would read what this one bound
        proof.refuse(loop, f"rebinds {sorted(rebound)} inside the loop")
    return names


class _MaskedProof(_SplitProof):
    def __init__(self, fn, block: nn.Module, attr: str = "experts"):
        super().__init__(fn, block, attr)
        self.ids = None

    def header(self, loop: ast.For) -> None:
        if loop.orelse:
            self.refuse(loop, "has an else branch")
        it, target = loop.iter, loop.target
        call = isinstance(it, ast.Call) and len(it.args) == 1 and not it.keywords
        fn = self.scope.resolve(it.func) if call and isinstance(it.func, (ast.Name, ast.Attribute)) else None
        if fn is enumerate and _is_self_attr(it.args[0], self.attr) and isinstance(target, ast.Tuple) \
                and len(target.elts) == 2 and all(isinstance(t, ast.Name) for t in target.elts):
            self.env = {target.elts[0].id: _E, target.elts[1].id: _EXPERT}
        elif fn is range and isinstance(target, ast.Name) and self._is_len_experts(it.args[0]):
            self.env = {target.id: _E}
        else:
            self.refuse(loop, f"does not iterate over the experts (enumerate(self.{self.attr}) or "
                              f"range(len(self.{self.attr})))")
        if type(getattr(self.block, self.attr, None)) is not nn.ModuleList:
            self.refuse(loop, "does not loop over a ModuleList of experts")
        self.loop_names = set(self.env)

    def _is_len_experts(self, node: ast.AST) -> bool:
        return (isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords
                and isinstance(node.func, ast.Name) and self.scope.resolve(node.func) is len
                and _is_self_attr(node.args[0], self.attr))

    def mask_assign(self, stmt: ast.stmt) -> None:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            self.refuse(stmt, "is not `mask = ids == i`")
        name = stmt.targets[0].id
        if name in self.env:
            self.refuse(stmt, "rebinds a name the loop reads")
        self.env[name] = self._mask(stmt.value)

    def _mask(self, node: ast.AST):
        if isinstance(node, ast.Name) and self.env.get(node.id, (None,))[0] == "mask":
            return self.env[node.id]
        if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq)):
            self.refuse(node, "is not `ids == i`")
        sides = [node.left, node.comparators[0]]
        values = [self.eval(n) for n in sides]
        if _E not in values:
            self.refuse(node, "does not compare the ids with the loop's expert id")
        ids = values[1 - values.index(_E)]
        if not (isinstance(ids, tuple) and ids[0] == "outer") or ids[1] in self.loop_names:
            self.refuse(node, "does not compare the block's ids with the loop's expert id")
        if self.ids not in (None, ids[1]):
            self.refuse(node, "compares a second tensor of ids")
        self.ids = ids[1]
        return ("mask", ids[1])

    def store(self, stmt: ast.stmt) -> tuple[str, str, str]:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
            self.refuse(stmt, "is not `y[ids == i] = expert(x[ids == i])`")
        target, value = stmt.targets[0], stmt.value
        if not (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)):
            self.refuse(stmt, "does not assign into the rows of a tensor held by a name")
        self._mask(target.slice)
        if not (isinstance(value, ast.Call) and len(value.args) == 1 and not value.keywords
                and self.eval(value.func) == _EXPERT):
            self.refuse(stmt, "does not assign the expert's output")
        arg = value.args[0]
        if not (isinstance(arg, ast.Subscript) and isinstance(arg.value, ast.Name)):
            self.refuse(stmt, "does not call the expert on rows of a tensor held by a name")
        self._mask(arg.slice)
        y, x = target.value.id, arg.value.id
        if len({y, x, self.ids}) != 3 or {y, x} & set(self.env):
            self.refuse(stmt, "reads and writes the same tensor, or a name the loop binds")
        return y, x, self.ids
