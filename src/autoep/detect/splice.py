"""Compile a block's own method with its expert loop spliced out.

The method is recompiled from its own source, with its own globals and closure (zero-arg ``super()``
included: ``__class__`` is passed as the closure cell it was), and only its proven expert
regions changed: each becomes one call into the EP exchange,

    __autoep_expert_loop__(self, acc, x, idx, w)     # a loop adding sum_k w[t, k] * expert_{idx[t, k]}(x[t])
    out = __autoep_expert_loop__(self, rows, counts)  # an argsort/split loop and its concatenation
    __autoep_expert_loop__(self, y, x, ids)           # a loop setting y[ids == e] = expert_e(x[ids == e])

(``module_list_proof.SplicePlan`` says which statements and names). Every
other statement (routing, jitter, scaling, shared branch, aux losses, the return) is the model's own.
"""
from __future__ import annotations

import ast
import copy
import linecache

from autoep.detect import regions
from autoep.detect.names import closure_vars
from autoep.detect.source import function_tree

LOOP_NAME = "__autoep_expert_loop__"
_FACTORY = "__autoep_factory__"


def loop_name(k: int) -> str:
    """The name the ``k``-th region's call takes in the spliced method."""
    return LOOP_NAME if k == 0 else f"__autoep_expert_loop_{k}__"


def spliced_source(plans) -> ast.FunctionDef:
    """The method's AST with each region's statements replaced by its call into the exchange (all
    ``plans`` are regions of one method)."""
    fn = plans[0].fn
    tree = copy.deepcopy(function_tree(fn))
    self_name = tree.args.args[0].arg
    # Find every region's statement list first: replacing one region never moves another's list.
    lists = [regions.statements(tree, plan.path) for plan in plans]
    order = sorted(range(len(plans)), key=lambda k: plans[k].first, reverse=True)
    for k in order:
        plan, stmts = plans[k], lists[k]
        args = [ast.Name(id=n, ctx=ast.Load()) for n in (self_name, *plan.args)]
        call = ast.Call(func=ast.Name(id=loop_name(k), ctx=ast.Load()), args=args, keywords=[])
        stmt = ast.Expr(value=call) if plan.out is None else ast.Assign(
            targets=[ast.Name(id=plan.out, ctx=ast.Store())], value=call)
        stmts[plan.first:plan.last + 1] = [ast.copy_location(stmt, stmts[plan.first])]
    tree.decorator_list = []
    return tree


def compile_spliced(plans, expert_loops):
    """A plain function (bind it to the block) equal to the plans' method with the ``k``-th region replaced
    by ``expert_loops[k](self, *plans[k].args)``."""
    fn = plans[0].fn
    tree = spliced_source(plans)
    free = list(fn.__code__.co_freevars)
    cells = closure_vars(fn)
    missing = [n for n in free if n not in cells]
    if missing:
        raise RuntimeError(f"{fn.__qualname__}: closure cells {missing} are empty; cannot recompile it")
    params = [ast.arg(arg=n) for n in [*map(loop_name, range(len(plans))), *free]]
    factory = ast.FunctionDef(
        name=_FACTORY,
        args=ast.arguments(posonlyargs=[], args=params, kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=[tree, ast.Return(value=ast.Name(id=tree.name, ctx=ast.Load()))],
        decorator_list=[],
        returns=None,
        **({"type_params": []} if "type_params" in ast.FunctionDef._fields else {}),
    )
    module = ast.fix_missing_locations(ast.Module(body=[factory], type_ignores=[]))
    filename = f"<autoep: {fn.__qualname__} with its expert loop spliced>"
    source = ast.unparse(module)
    # Register the source so tracebacks through the spliced method show its lines.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    code = compile(ast.parse(source), filename, "exec")
    namespace: dict = {}
    exec(code, fn.__globals__, namespace)  # noqa: S102 - the model's own source, one region changed
    new = namespace[_FACTORY](*expert_loops, *[cells[n] for n in free])
    new.__qualname__ = fn.__qualname__
    new.__doc__ = fn.__doc__
    new.__autoep_spliced__ = fn
    return new
