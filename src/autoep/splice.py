"""Compile a block's own method with its expert loop spliced out.

The method is recompiled from its own source, with its own globals and closure (zero-arg ``super()``
included: ``__class__`` is passed as the closure cell it was), and exactly one region of top-level statements
changed: the proven expert region becomes one call into the EP exchange,

    __autoep_expert_loop__(self, acc, x, idx, w)     # a loop adding sum_k w[t, k] * expert_{idx[t, k]}(x[t])
    out = __autoep_expert_loop__(self, rows, counts)  # an argsort/split loop and its concatenation

(``module_list_proof.SplicePlan`` says which statements and names). Every
other statement (routing, jitter, scaling, shared branch, aux losses, the return) is the model's own.
"""
from __future__ import annotations

import ast
import copy
import linecache

from autoep.names import closure_vars
from autoep.source import function_tree

LOOP_NAME = "__autoep_expert_loop__"
_FACTORY = "__autoep_factory__"


def spliced_source(plan) -> ast.FunctionDef:
    """The method's AST with the region's statements replaced by the call into the exchange."""
    tree = copy.deepcopy(function_tree(plan.fn))
    region = tree.body[plan.first]
    self_name = tree.args.args[0].arg
    args = [ast.Name(id=n, ctx=ast.Load()) for n in (self_name, *plan.args)]
    call = ast.Call(func=ast.Name(id=LOOP_NAME, ctx=ast.Load()), args=args, keywords=[])
    stmt = ast.Expr(value=call) if plan.out is None else ast.Assign(
        targets=[ast.Name(id=plan.out, ctx=ast.Store())], value=call)
    tree.body[plan.first:plan.last + 1] = [ast.copy_location(stmt, region)]
    tree.decorator_list = []
    return tree


def compile_spliced(plan, expert_loop):
    """A plain function (bind it to the block) equal to ``plan.fn`` with its expert region replaced by
    ``expert_loop(self, *plan.args)``."""
    fn = plan.fn
    tree = spliced_source(plan)
    free = list(fn.__code__.co_freevars)
    cells = closure_vars(fn)
    missing = [n for n in free if n not in cells]
    if missing:
        raise RuntimeError(f"{fn.__qualname__}: closure cells {missing} are empty; cannot recompile it")
    params = [ast.arg(arg=n) for n in [LOOP_NAME, *free]]
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
    new = namespace[_FACTORY](expert_loop, *[cells[n] for n in free])
    new.__qualname__ = fn.__qualname__
    new.__doc__ = fn.__doc__
    new.__autoep_spliced__ = fn
    return new
