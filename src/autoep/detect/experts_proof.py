"""Proofs about the region autoep replaces, from source and run-time state, never by running it.

- ``batched_experts_facts(experts)``: a transformers-v5-style experts module whose ``forward(hidden,
  top_k_index, top_k_weights)`` is proven to be the expert loop of ``w * down(gate(gate_up(x)))``;
  autoep replaces that forward (and nothing else). Its weights are 3-D parameters of the experts, or
  (DBRX) flattened ``(E*F, D)`` parameters of a submodule (``autoep.detect.flat_experts``).
(ModuleList experts and the v4 block's loop: ``autoep.detect.module_list_proof``.)

Each returns facts or raises ``Refusal`` naming what could not be proven.
"""
from __future__ import annotations

import ast
import dataclasses
import operator
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

from autoep.detect import elementwise, row_norm, training_branch
from autoep.detect.expert_loop import Attr, Obj, Opaque, Prover, no_grad_block
from autoep.detect.flat_experts import AccView, FlatLayout, FlatProver, flat_layout
from autoep.detect.loop_context import plain_method
from autoep.detect.names import NOT_FACTS, Scope, attribute, fold_attr, instance_attr
from autoep.detect.source import Refusal, function_tree

# ---------------------------------------------------------------------------------------------
# transformers v5 batched experts
# ---------------------------------------------------------------------------------------------

# Decorators whose wrapper only dispatches to the experts' own forward or another implementation of
# the same function (transformers' experts interface); autoep replaces the call either way.
# Identified by where the wrapper's code was defined (``functools.wraps`` copies the wrapped name).
_KNOWN_WRAPPERS = {("transformers.integrations.moe", "use_experts_implementation.<locals>.wrapper.<locals>.forward")}


def _defined_as(fn) -> tuple[str, str]:
    code = fn.__code__
    return fn.__globals__.get("__name__", ""), getattr(code, "co_qualname", code.co_name)


def experts_forward(cls: type):
    """The experts class's own forward function, through known dispatch wrappers only."""
    return unwrap_known(cls.forward, f"{cls.__name__}.forward", _KNOWN_WRAPPERS)


def unwrap_known(fn, what: str, known: set[tuple[str, str]]):
    """``fn`` with the wrappers in ``known`` (module, qualified name where their code is defined) peeled
    off; any other wrapper is a refusal naming it."""
    while hasattr(fn, "__wrapped__"):
        where = _defined_as(fn)
        if where not in known and not (sys.version_info < (3, 11) and where[0] in {m for m, _ in known}):
            raise Refusal(f"{what} is wrapped by {'.'.join(where)}, which autoep does not know")
        fn = fn.__wrapped__
    return fn


@dataclass(frozen=True)
class BatchedRoles:
    """Parameter names of the experts forward by role (the replacement binds by this signature), and
    the dtype it returns: ``hidden`` (the hidden states'), ``float32``, or ``weights`` (the weights')."""

    hidden: str
    index: str
    weights: str
    out_dtype: str = "hidden"
    acc_dtype: str = "hidden"  # the accumulator's: hidden | float32 | weights
    rows: int = 0  # D where the forward flattens its hidden argument to rows ``reshape(-1, D)`` (0: it does not)
    # rows -1: the hidden states' own last dim (``reshape(-1, h)`` after ``b, s, h = hidden.shape``)
    unpacked: int = 0  # the forward unpacks ``hidden.shape`` into this many names (other ranks raise there)
    view_out: str = ""  # lead: it returns ``acc.view(hidden.shape[0], -1, D)`` | shape: ``acc.reshape(b, s, h)``
    flat: FlatLayout | None = None  # flattened (E*F, D) weights on a submodule (DBRX)
    # Two computations behind a training test (``autoep.detect.training_branch``): the proven loop branch's
    # test ("training" | "cpu_or_training"; "" none) and its line; the replacement raises where the test fails.
    branch: str = ""
    branch_line: int = 0
    dense_weights: bool = False  # the loop reads W[tok, e] of (T, E) weights, not w[tok, slot]
    weights_cols: bool = False  # it takes E from W.shape[1]: W must have E columns
    # a gate written inline: (its expression over ("h",), the path of the activation module it applies or "")
    # (training_branch.eval_gate)
    gate: tuple | None = None
    # what its loop does with an expert without rows (``LoopFacts.idle``): "skip" (it iterates the experts hit)
    # or "call" (on zero rows)
    idle: str = "call"


def batched_experts_facts(experts: nn.Module) -> dict:
    """Layout facts of proven batched experts (MoeStructure fields), or ``Refusal``."""
    return batched_proof(experts)[0]


def batched_proof(experts: nn.Module) -> tuple[dict, BatchedRoles]:
    cls = type(experts)
    elementwise.runtime_clean(experts, f"experts {cls.__name__}")
    first = experts._parameters.get("gate_up_proj", experts._parameters.get("up_proj"))
    down = experts._parameters.get("down_proj")
    if not (isinstance(first, nn.Parameter) and isinstance(down, nn.Parameter) and first.dim() == down.dim() == 3):
        if type(experts).forward is nn.Module.forward:  # e.g. a ModuleDict of expert modules
            raise Refusal(f"experts is a {cls.__name__} with no forward of its own, and no loop of the block indexes "
                          "it by expert id (the loops taken: `for` over range/enumerate of the experts, indexing "
                          "`self.<experts>[e]` or `[f\"...{e}\"]`)")
        if not experts._parameters and any(p.dim() == 2 for p in experts.parameters()):
            return _flat_proof(experts)
        raise Refusal(f"experts {cls.__name__} has no 3-D nn.Parameters gate_up_proj (or up_proj) and down_proj, "
                      "nor only flattened 2-D weights on a submodule")
    fn = experts_forward(cls)
    tree = function_tree(fn)
    body = _body(tree)
    hidden = tree.args.args[1].arg if len(tree.args.args) > 1 else ""
    branch = training_branch.split_branch(tree, body, hidden)
    if branch is None:
        prover = Prover(fn, tree, experts, int(first.shape[0]), batched=True)
        roles = _prove_batched_forward(prover, tree)
    else:
        prover = training_branch.BranchProver(fn, tree, experts, int(first.shape[0]))
        roles = _prove_batched_forward(prover, tree, body=branch[0])
        _check_branch_facts(prover, body, branch[2], hidden)
        roles = dataclasses.replace(roles, branch=branch[1], branch_line=branch[2].lineno,
                                    dense_weights=prover.weights_mode == "dense",
                                    weights_cols=training_branch.check_count_sources(prover))
    facts = _batched_layout(prover, experts)
    if facts.get("activation") == "inline_gate":
        act = prover.root.act[0] if prover.root.act is not None else ""
        roles = dataclasses.replace(roles, gate=(prover.inline_gate, act))
    _check_batched_params(experts, facts)
    if branch is not None:
        D = int(experts.gate_up_proj.shape[1] if facts["expert_transposed"] else experts.gate_up_proj.shape[2])
        wrong = [(n, d) for n, d in prover.cols if d != D]
        if wrong:
            prover.refuse(wrong[0][0], f"uses hidden size {wrong[0][1]}, not the weights' {D}")
    return facts, roles


def _body(tree: ast.FunctionDef) -> list[ast.stmt]:
    return [s for s in tree.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]


def _check_branch_facts(p, body: list[ast.stmt], stmt: ast.If, hidden: str) -> None:
    """The branch test's ``<hidden>.device`` is the hidden argument's: before the test, ``<hidden>`` is bound only
    to a reshape or view of itself (rows of the argument, proven by the loop proof)."""
    for s in body[:body.index(stmt)]:
        stores = {n.id for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        v = getattr(s, "value", None)
        ok = isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr in ("reshape", "view") \
            and isinstance(v.func.value, ast.Name) and v.func.value.id == hidden
        if hidden in stores and not ok:
            p.refuse(s, f"rebinds {hidden} before the branch test reads its device")


def _flat_proof(experts: nn.Module) -> tuple[dict, BatchedRoles]:
    """Experts whose weights are flattened ``(E*F, D)`` parameters of a submodule, viewed per expert."""
    fn = experts_forward(type(experts))
    tree = function_tree(fn)
    # The expert count is what the views prove (rows // F); nothing may compare with it before that,
    # so the loop proof gets none (-1 matches no padding id and no range).
    prover = FlatProver(fn, tree, experts, -1)
    roles = _prove_batched_forward(prover, tree, unused_ok=True)
    marks: list = []
    _strip_f32(prover.facts.expert, marks)
    if _applies_module(prover.facts.expert):
        raise Refusal(f"{prover.where}: flattened experts that apply a submodule to their rows are not followed")
    if marks:
        raise Refusal(f"{prover.where}: flattened experts that upcast to float32 are not followed")
    if prover.rows_of is None:  # the exchange takes (T, D) rows; a forward that does not make them is not followed
        raise Refusal(f"{prover.where} does not flatten its hidden states to rows reshape(-1, D)")
    if prover.zeros_src is not prover.facts.x:
        raise Refusal(f"{prover.where} accumulates into zeros shaped like another tensor than its rows")
    layout = flat_layout(prover, experts)
    facts = dict(expert_bias=False, expert_transposed=False, gate_up_layout="separate", activation="glu",
                 expert_projs=(layout.gate, layout.up, layout.down), expert_act=layout.act, post_expert_norm="")
    return facts, dataclasses.replace(roles, flat=layout)


def _prove_batched_forward(p: Prover, tree: ast.FunctionDef, unused_ok: bool = False,
                           body: list[ast.stmt] | None = None) -> BatchedRoles:
    """``unused_ok``: one more positional parameter is allowed where the source never reads it (transformers
    4.x DBRX passes the full router softmax along); the replacement binds it by the same signature."""
    a = tree.args
    params = [x.arg for x in a.args[1:]]
    if unused_ok and len(params) == 4:
        read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        params = [n for n in params if n in read]
    if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or len(params) != 3 or len(a.args) - 1 > 3 + unused_ok:
        raise Refusal(f"{p.where} takes {[x.arg for x in a.args[1:]]}, not (hidden_states, top_k_index, top_k_weights)")
    values = {name: Opaque(name) for name in params}
    p.env.update(values)
    body = _body(tree) if body is None else body
    loops = [s for s in body if isinstance(s, ast.For)]
    if len(loops) != 1:
        raise Refusal(f"{p.where} is not one loop over experts: {_loops_seen(body, loops)}")
    for stmt in body:
        if stmt is loops[0]:
            p.loop(stmt)
        elif isinstance(stmt, ast.Assign):
            _assign_acc_or(p, stmt)
        elif isinstance(stmt, ast.With) and stmt is not body[-1]:
            no_grad_block(p, stmt)
        elif isinstance(stmt, ast.Return) and stmt is body[-1] and stmt.value is not None:
            out_dtype = _returned_dtype(p, stmt)
        else:
            p.refuse(stmt)
    f = p.facts
    by_value = {id(v): k for k, v in values.items()}
    rows_of, view_out = getattr(p, "rows_of", None), getattr(p, "view_out", None)
    x = f.x
    if rows_of is not None:  # the forward flattened its hidden argument: the rows must be those
        if f.x is not rows_of.rows:
            raise Refusal(f"{p.where} flattens {rows_of.of.label} to rows but reads other rows")
        x = rows_of.of
    if view_out is not None and (rows_of is None or view_out.lead is not rows_of.of or view_out.cols != rows_of.cols):
        raise Refusal(f"{p.where} views its output by another tensor's leading size than its flattened hidden states")
    if x is None or f.idx is None or f.w is None or len({id(x), id(f.idx), id(f.w)}) != 3:
        raise Refusal(f"{p.where} does not read hidden states, expert ids and weights from its three arguments")
    if out_dtype == "weights" and p.acc_dtype is not f.w:
        raise Refusal(f"{p.where} accumulates in the dtype of a tensor other than its weights")
    acc_dtype = "hidden" if p.acc_dtype is None else "float32" if p.acc_dtype is torch.float32 else "weights"
    try:
        return BatchedRoles(by_value[id(x)], by_value[id(f.idx)], by_value[id(f.w)], out_dtype, acc_dtype,
                            rows=rows_of.cols if rows_of is not None else 0,
                            unpacked=p.unpacked[1] if getattr(p, "unpacked", None) else 0,
                            view_out=view_out.mode if view_out is not None else "", idle=f.idle)
    except KeyError:
        raise Refusal(f"{p.where} reads its tokens, ids or weights from something other than its arguments") from None


def _loops_seen(body: list[ast.stmt], loops: list[ast.For]) -> str:
    """What the forward holds instead of one expert loop: its loops' lines, and a call of ``super().<m>`` (an
    inherited experts forward with work of its own around it, Ergo's per-expert norm after the projections)."""
    supers = [node for stmt in body for node in ast.walk(stmt) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Call)
              and isinstance(node.func.value.func, ast.Name) and node.func.value.func.id == "super"]
    seen = f"{len(loops)} `for` statements (lines {', '.join(str(s.lineno) for s in loops)})" if loops else "no `for` statement"
    if supers:
        seen += (f"; it calls `super().{supers[0].func.attr}(...)` (line {supers[0].lineno}) and computes around it: "
                 f"the loop it inherits is proven only as the whole forward")
    return seen


def _assign_acc_or(p: Prover, stmt: ast.Assign) -> None:
    value = p.eval(stmt.value)
    if isinstance(value, tuple) and value[0] == "zeros_like":
        if len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Name) or p.zeros_of_x is not None:
            p.refuse(stmt, "is a second accumulator")
        acc = Opaque(stmt.targets[0].id)
        p.zeros_of_x, p.acc_dtype, p.zeros_src = acc, value[2], value[1]
        p.env[stmt.targets[0].id] = acc
        return
    p.assign(stmt)


def _returned_dtype(p: Prover, stmt: ast.Return) -> str:
    """``return acc`` (the accumulator's dtype) or ``return acc.to(hidden_states.dtype)``."""
    value, acc = stmt.value, p.facts.acc
    cast = isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "to"
    if cast and len(value.args) == 1 and not value.keywords and p.eval(value.func.value) is acc and acc is not None:
        target = p.eval(value.args[0])
        if isinstance(target, Attr) and target.name == "dtype" and target.of is p.facts.x:
            return "hidden"
        p.refuse(stmt, "casts the accumulator to a dtype the proof does not know")
    returned = p.eval(value) if acc is not None else None
    if isinstance(returned, AccView) and returned.acc is acc:
        p.view_out = returned  # the hidden argument's shape again: checked against the flattened rows
    elif returned is not acc or acc is None:
        p.refuse(stmt, "does not return the accumulator")
    if p.acc_dtype is None:
        return "hidden"
    return "float32" if p.acc_dtype is torch.float32 else "weights"


def _peel_bias(expr: tuple, bias: str) -> tuple[tuple, bool]:
    if expr[0] == "bias":
        if expr[2] != bias:
            raise Refusal(f"the expert projection adds {expr[2]}, not {bias}")
        return expr[1], True
    return expr, False


def _strip_f32(expr, marks: list) -> tuple:
    """``expr`` without its float32 upcasts; each upcast's site is appended to ``marks``."""
    if not isinstance(expr, tuple) or not expr:
        return expr
    if expr[0] == "f32":
        marks.append(("value", _strip_f32(expr[1], [])))
        return _strip_f32(expr[1], marks)
    if expr[0] in ("lin", "bias") and expr[-1] == "f32":
        marks.append(("weight", expr[2]))
        expr = expr[:-1]
    return tuple(_strip_f32(e, marks) for e in expr)


def _params_read(expr) -> list[str]:
    """Expert parameters a computation reads (its ``lin`` and ``bias`` nodes)."""
    if not isinstance(expr, tuple) or not expr:
        return []
    own = [expr[2]] if expr[0] in ("lin", "bias") else []
    return own + [n for e in expr[1:] for n in _params_read(e)]


def _compute_dtype(p: Prover, expr: tuple) -> tuple[tuple, str]:
    """(the computation without upcasts, "param" or "float32"): either nothing is upcast, or the routed rows
    and every expert weight and bias are, so the whole expert runs in float32 whatever the weights' dtype."""
    marks: list = []
    stripped = _strip_f32(expr, marks)
    if not marks:
        return stripped, "param"
    weights = {m[1] for m in marks if m[0] == "weight"}
    needed = set(_params_read(stripped))
    if ("value", ("x",)) not in marks or weights != needed:
        raise Refusal(f"{p.where}: the expert upcasts some operands to float32 ({sorted(weights)}) but not "
                      f"the routed rows and all of {sorted(needed)}")
    return stripped, "float32"


def _batched_layout(p: Prover, experts: nn.Module) -> dict:
    """Read the proven per-expert computation as ``(norm)(down(gate(gate_up(x) (+b)) (+b)))``."""
    expr, dtype = _compute_dtype(p, p.facts.expert)
    expr, norm = _peel_norm(p, expr)
    facts = _layout_of(p, experts, expr)
    if norm:
        down = experts.down_proj
        hidden = int(down.shape[2] if facts["expert_transposed"] else down.shape[1])
        row_norm.prove_row_local(experts._modules[norm], hidden, f"{type(experts).__name__}.{norm}")
    return facts | {"post_expert_norm": norm} | ({"expert_dtype": dtype} if dtype != "param" else {})


def _peel_norm(p: Prover, expr: tuple) -> tuple[tuple, str]:
    """(the expert's computation, the attribute name of the module applied last to its output or "")."""
    norm = ""
    if expr[0] == "norm":
        expr, norm = expr[1], expr[2]
    if _applies_module(expr):
        raise Refusal(f"{p.where}: the expert computes {expr}; a submodule of the experts is applied to other "
                      "rows than the down projection's output, or more than once")
    return expr, norm


def _applies_module(expr) -> bool:
    return isinstance(expr, tuple) and bool(expr) and (expr[0] == "norm" or any(_applies_module(e) for e in expr[1:]))


def _layout_of(p: Prover, experts: nn.Module, expr: tuple) -> dict:
    what = f"{p.where}: the expert computes {expr}"
    lin, down_bias = _peel_bias(expr, "down_proj_bias")
    if lin[0] != "lin" or lin[2] != "down_proj":
        raise Refusal(f"{what}, not down_proj(...) last")
    gated, transposed = lin[1], lin[3]
    if gated[0] == "act" and gated[1] == ("lin", ("x",), "up_proj", transposed):
        return dict(expert_bias=False, expert_transposed=transposed, gate_up_layout="none", activation="plain")
    if gated[0] == "gate":
        up = gated[1]
        layout, activation = apply_gate_facts(type(experts), experts)
    elif gated[0] == "mul" and gated[1][0] == "act" and gated[1][1][0] == "chunk" and gated[2][0] == "chunk" \
            and gated[1][1][2] == 0 and gated[2][2] == 1 and gated[1][1][1] == gated[2][1]:
        up, layout, activation = gated[2][1], "concatenated", "glu"
    else:
        inline = training_branch.inline_gate(gated, transposed) if isinstance(p, training_branch.BranchProver) \
            else None
        if inline is None:
            raise Refusal(f"{what}; the gate is not act_fn(gate) * up, the experts' own _apply_gate, or "
                          "element-wise operations on the first projection")
        p.inline_gate, up_bias = inline
        if up_bias != down_bias:
            raise Refusal(f"{what}; one projection adds a bias and the other does not")
        if _mentions_act(inline[0]) and p.root.act is None:
            raise Refusal(f"{what}; its activation is not the experts' own module")
        return dict(expert_bias=up_bias, expert_transposed=transposed, gate_up_layout="inline",
                    activation="inline_gate")
    up, up_bias = _peel_bias(up, "gate_up_proj_bias")
    if up != ("lin", ("x",), "gate_up_proj", transposed):
        raise Refusal(f"{what}; the first projection is not gate_up_proj[e] of the routed rows, in the same layout")
    if up_bias != down_bias:
        raise Refusal(f"{what}; one projection adds a bias and the other does not")
    return dict(expert_bias=up_bias, expert_transposed=transposed, gate_up_layout=layout, activation=activation)


def _mentions_act(expr) -> bool:
    return isinstance(expr, tuple) and bool(expr) and (expr[0] == "act" or any(_mentions_act(e) for e in expr[1:]))


def _check_batched_params(experts: nn.Module, facts: dict) -> None:
    """The experts hold exactly the parameters their proven forward uses, of shapes that agree."""
    name = type(experts).__name__
    plain = facts["activation"] == "plain"  # up -> act -> down, no gate half
    allowed = {"up_proj" if plain else "gate_up_proj", "down_proj"}
    allowed |= {"gate_up_proj_bias", "down_proj_bias"} if facts["expert_bias"] else set()
    norm = facts.get("post_expert_norm")
    allowed |= {f"{norm}.{n}" for n, _ in experts._modules[norm].named_parameters()} if norm else set()
    extra = sorted({n for n, _ in experts.named_parameters()} - allowed)
    if extra:
        raise Refusal(f"experts {name} hold parameters {extra} its forward does not use")
    if list(experts.buffers()):
        raise Refusal(f"experts {name} hold buffers its forward does not use")
    first, down = (experts.up_proj if plain else experts.gate_up_proj), experts.down_proj
    E, a, b = first.shape
    halve = 1 if plain else 2
    ok = tuple(down.shape) == ((E, b // halve, a) if facts["expert_transposed"] else (E, b, a // halve))
    if not ok or (b if facts["expert_transposed"] else a) % halve:
        raise Refusal(f"experts {name} weight shapes {tuple(first.shape)}, {tuple(down.shape)} do not agree")
    if facts["expert_bias"]:
        gb, db = experts.gate_up_proj_bias, experts.down_proj_bias
        two_f, d = (b, a) if facts["expert_transposed"] else (a, b)
        if tuple(gb.shape) != (E, two_f) or tuple(db.shape) != (E, d):
            raise Refusal(f"experts {name} bias shapes {tuple(gb.shape)}, {tuple(db.shape)} do not fit the weights")
    if len({p.requires_grad for p in experts.parameters(recurse=False)}) > 1:
        raise Refusal(f"experts {name}: some expert parameters are frozen and some are not")


# ---------------------------------------------------------------------------------------------
# _apply_gate: row-local (EP runs it on any subset of rows)
# ---------------------------------------------------------------------------------------------

_SLICES = {"(..., ::2)": "strided", "(..., 1::2)": "strided"}
_COMPARE = {ast.Is: operator.is_, ast.IsNot: operator.is_not, ast.Eq: operator.eq, ast.NotEq: operator.ne,
            ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge}


def apply_gate_facts(cls: type, experts: nn.Module) -> tuple[str, str]:
    """Prove the experts' ``_apply_gate(h)`` computes each output row from the same input row alone,
    with element-wise operations and last-dim splits; return (gate_up layout, activation)."""
    fn = plain_method(cls, "_apply_gate", experts)
    tree = function_tree(fn)
    if len(tree.args.args) != 2 or tree.args.vararg or tree.args.kwarg or tree.args.kwonlyargs:
        raise Refusal("_apply_gate is not `(self, gate_up) -> ...`")
    gate = _RowLocal(fn, tree, experts)
    gate.run()
    if len(gate.splits) != 1:
        raise Refusal(f"_apply_gate splits gate/up as {sorted(gate.splits) or 'nothing'}, not one layout")
    layout = "concatenated" if gate.splits == {"chunk"} else "interleaved"
    return layout, "clamped_glu" if gate.clamped else "own_gate"


class _RowLocal:
    """Values: "row" (row-local tensor), ("chunks",), ("module", m) or a scalar ``Obj``. ``entry="input"``
    (``_apply_gate``): the one argument is the gate_up rows, whose last-dim split is recorded; ``entry="row"``
    (a submodule's forward): every argument is row-local."""

    def __init__(self, fn, tree: ast.FunctionDef, experts: nn.Module, entry: str = "input"):
        self.scope, self.experts, self.tree, self.what = Scope(fn), experts, tree, fn.__qualname__
        self.env = {a.arg: entry for a in tree.args.args[1:]}
        self.splits: set[str] = set()
        self.clamped = False

    def refuse(self, node, why="is not proven row-local"):
        raise Refusal(f"{self.what} line {getattr(node, 'lineno', '?')}: `{ast.unparse(node)[:80]}` {why}")

    def run(self) -> None:
        """Prove the body returns a row-local value."""
        body = [s for s in self.tree.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        for stmt in body[:-1]:
            self.statement(stmt)
        if not isinstance(body[-1], ast.Return) or body[-1].value is None or self.eval(body[-1].value) != "row":
            raise Refusal(f"{self.what} line {body[-1].lineno} does not return a row-local value")

    def statement(self, stmt):
        if isinstance(stmt, ast.If):
            self.branch(stmt)
        else:
            self.assign(stmt)

    def branch(self, stmt: ast.If) -> None:
        """``if <test>:`` on constants alone (numbers, ``None``, the experts' own attributes holding them:
        Step3p7's ``if self.limit is not None:``) is folded: only the branch the values select runs, so only it is
        proven. The attributes the test reads are recorded as facts (``names.fold_attr``, ``None`` included; the
        operands a short-circuit skips are not read), so a change after apply raises instead of running the branch
        not proven. A test on the rows is refused: which
        branch runs would depend on the rows. Names bound afterwards are those of the branch taken."""
        for node in ast.walk(stmt.test):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and node.attr in NOT_FACTS:
                self.refuse(stmt.test, f"(the test of the `if` on line {stmt.lineno}) reads self.{node.attr}, which "
                                       "changes by design (train/eval); the gate must compute the same in both")
        taken = self.truth(stmt, stmt.test)  # the attributes it reads are recorded as they are read (eval)
        for inner in stmt.body if taken else stmt.orelse:
            self.statement(inner)

    def truth(self, stmt: ast.If, node) -> bool:
        """The truth of ``node``, a test built of constants alone (``is``, ``==``, ``<``, ..., ``and``, ``or``,
        ``not``); refused where a part is not a constant (a value of the rows)."""
        if isinstance(node, ast.BoolOp):  # short-circuit as Python does (`x is not None and x > 0`)
            decisive = isinstance(node.op, ast.Or)
            return decisive if any(self.truth(stmt, v) is decisive for v in node.values) else not decisive
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return not self.truth(stmt, node.operand)
        if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
            left, result = self.constant(stmt, node.left), True
            for op, right in zip(node.ops, node.comparators):
                right = self.constant(stmt, right)
                if isinstance(op, (ast.Is, ast.IsNot)) and not any(v is None or type(v) is bool for v in (left, right)):
                    # identity of numbers: an equal value set later (what the runtime re-checks) may not be the same
                    self.refuse(stmt.test, f"(the test of the `if` on line {stmt.lineno}) compares numbers by "
                                           "identity; compare them with == or test `is None`")
                result, left = result and _COMPARE[type(op)](left, right), right
            return result
        return bool(self.constant(stmt, node))

    def constant(self, stmt: ast.If, node):
        rows = sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in self.env})
        value = None if rows else self.eval(node)
        if not (isinstance(value, Obj) and (value.value is None or type(value.value) in (bool, int, float))):
            self.refuse(stmt.test, f"(the test of the `if` on line {stmt.lineno}) is not a constant: "
                                   f"`{ast.unparse(node)[:40]}` is computed from the rows ({', '.join(rows)}), so "
                                   "which branch runs would depend on the rows EP hands this function" if rows else
                                   f"(the test of the `if` on line {stmt.lineno}) is not a constant: "
                                   f"`{ast.unparse(node)[:40]}` is not a number or None")
        return value.value

    def assign(self, stmt):
        if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
            self.refuse(stmt, "is not an assignment")
        target, value = stmt.targets[0], stmt.value
        if isinstance(target, ast.Name):
            self.env[target.id] = self.eval(value)
        elif isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts):
            items = value.elts if isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts) else None
            if items is None and self.eval(value) == ("chunks",) and len(target.elts) == 2:
                items = [None, None]
            if items is None:
                self.refuse(stmt, "cannot be unpacked")
            for t, v in zip(target.elts, items):
                self.env[t.id] = "row" if v is None else self.eval(v)
        else:
            self.refuse(stmt)

    def scalar(self, v) -> bool:
        return isinstance(v, Obj) and (v.value is None or type(v.value) in (int, float))

    def eval(self, node):
        if isinstance(node, ast.Constant):
            return Obj(node.value)
        if isinstance(node, ast.Name):
            return self.env[node.id] if node.id in self.env else Obj(self.scope.lookup(node.id))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            what = f"{type(self.experts).__name__}.{node.attr}"
            value = instance_attr(self.experts, node.attr, what)
            if isinstance(value, nn.Module) and node.attr in self.experts._modules:
                try:
                    elementwise.check_activation_module(value, what)
                    return "act"
                except Refusal:
                    _submodule_row_local(value, what)  # its own forward, proven row-local
                    return ("module", value)
            if node.attr == "act_fn":
                elementwise.check_activation_module(value, what)
                return "act"
            if value is None or type(value) in (bool, int, float):
                fold_attr(self.experts, node.attr)  # None too: a number set later is checked, not assumed
                return Obj(value)
            self.refuse(node, "reads an attribute that is not a number")
        if isinstance(node, ast.Attribute):
            base = self.eval(node.value)
            if base in ("row", "input") and node.attr == "dtype":
                return "dtype"
            if isinstance(base, Obj) and base.value is not None and hasattr(base.value, node.attr):
                return Obj(attribute(base.value, node.attr))
            self.refuse(node)
        if isinstance(node, ast.Subscript):
            return self._subscript(node)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            left, right = self.eval(node.left), self.eval(node.right)
            if "row" in (left, right) and all(v == "row" or self.scalar(v) for v in (left, right)):
                return "row"
            self.refuse(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            v = self.eval(node.operand)
            return v if v == "row" else Obj(-v.value) if self.scalar(v) and v.value is not None else self.refuse(node)
        if isinstance(node, ast.Call):
            return self._call(node)
        self.refuse(node)

    def _subscript(self, node):
        base = self.eval(node.value)
        if base == "input" and ast.unparse(node.slice) in _SLICES:
            self.splits.add("strided")
            return "row"
        if base == ("chunks",) and isinstance(node.slice, ast.Constant) and node.slice.value in (0, 1):
            return "row"
        self.refuse(node)

    def _call(self, node):
        if any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
            self.refuse(node, "unpacks arguments")
        func = node.func
        if isinstance(func, ast.Attribute) and not (isinstance(func.value, ast.Name) and func.value.id == "self"):
            base = self.eval(func.value)
            if base == "input" and func.attr == "chunk":
                if [ast.unparse(a) for a in node.args] + [ast.unparse(k) for k in node.keywords] in (["2", "dim=-1"], ["2", "-1"]):
                    self.splits.add("chunk")
                    return ("chunks",)
                self.refuse(node, "is not chunk(2, dim=-1)")
            if base == "row" and func.attr in ("float", "double", "half", "bfloat16") and not node.args and not node.keywords:
                return "row"
            if base == "row" and func.attr == "to" and len(node.args) == 1 and not node.keywords \
                    and self.eval(node.args[0]) == "dtype":
                return "row"
            if base == "row" and func.attr == "clamp":
                if node.args or {k.arg for k in node.keywords} - {"min", "max"}:
                    self.refuse(node, "is not clamp(min=..., max=...)")
                if not all(self.scalar(self.eval(k.value)) for k in node.keywords):
                    self.refuse(node, "clamps to something that is not a number")
                self.clamped = True
                return "row"
            if not isinstance(base, Obj):
                self.refuse(node)
        target = self.eval(func)
        if isinstance(target, tuple) and target[0] == "module":
            if node.keywords or not node.args or any(self.eval(a) != "row" for a in node.args):
                self.refuse(node, "passes a submodule something that is not row-local")
            return "row"
        if target == "act" or (isinstance(target, Obj) and elementwise.known_function(target.value)):
            if len(node.args) != 1 or node.keywords or self.eval(node.args[0]) != "row":
                self.refuse(node, "is not an element-wise function of one row-local value")
            return "row"
        self.refuse(node, "calls something not known to be element-wise")



def _submodule_row_local(module: nn.Module, what: str, depth: int = 0) -> None:
    """A stateless submodule (no parameters or buffers) whose own forward is proven row-local in all its
    inputs, recursively (e.g. a soft-capped SwiGLU built from soft-cap modules)."""
    if depth > 4:
        raise Refusal(f"{what}: submodules nest too deep to follow")
    elementwise.runtime_clean(module, what)
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        raise Refusal(f"{what} ({type(module).__name__}) holds parameters or buffers")
    fn = plain_method(type(module), "forward", module)
    tree = function_tree(fn)
    if tree.args.vararg or tree.args.kwarg or tree.args.kwonlyargs or len(tree.args.args) < 2:
        raise Refusal(f"{what}: {type(module).__name__}.forward does not take plain tensor arguments")
    _RowLocal(fn, tree, module, entry="row").run()
