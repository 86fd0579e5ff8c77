"""Compile a block's own method with its expert loop spliced out.

The method is recompiled from its own source (proven to be its code), in its class's scope, with its own
globals, defaults and closure cells (zero-arg ``super()`` included: ``__class__`` is the cell it was),
and only its proven expert regions changed: each becomes one call into the EP exchange,

    __autoep_expert_loop__(self, acc, x, idx, w)     # a loop adding sum_k w[t, k] * expert_{idx[t, k]}(x[t])
    out = __autoep_expert_loop__(self, rows, counts)  # an argsort/split loop and its concatenation
    __autoep_expert_loop__(self, y, x, ids)           # a loop setting y[ids == e] = expert_e(x[ids == e])

(``module_list_proof.SplicePlan`` says which statements and names). Every
other statement (routing, jitter, scaling, shared branch, aux losses, the return) is the model's own.
"""
from __future__ import annotations

import ast
import copy
import inspect
import linecache
import types

from autoep.detect import regions
from autoep.detect.source import compile_in_scope, function_tree, scope_module

LOOP_NAME = "__autoep_expert_loop__"


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
    """The plans' method, live, with the ``k``-th region replaced by ``expert_loops[k](self, *plans[k].args)``:
    a function to bind to the block (``compile_changed``)."""
    names = tuple(map(loop_name, range(len(plans))))
    return compile_changed(plans[0].fn, plans[0].method, spliced_source(plans), dict(zip(names, expert_loops)),
                           "with its expert loop spliced")


def compile_changed(fn, method: str, tree: ast.FunctionDef, calls: dict, what: str):
    """``fn`` (the block's ``method``) compiled from ``tree``, its own source with some expressions changed into
    calls of ``calls`` (name -> function, bound as closure cells): a function to bind to the block.

    It is the model's function with those parts changed, not a copy of it: compiled in its class's scope
    (private ``self.__x`` names mangled as in the class), with its own ``__defaults__``, ``__kwdefaults__``
    (the same objects, never re-evaluated) and closure cells (shared: a rebinding of a closure variable is
    seen by both), from the source proven to be its code (``source.function_tree``). Each call first checks
    that the class still holds that function with that code; a method replaced or a ``__code__`` swapped
    after apply raises instead of running the old code."""
    code = fn.__code__
    tree = copy.deepcopy(tree)
    names = tuple(calls)
    _guard_first(tree, method)
    filename = f"<autoep: {fn.__qualname__} {what}>"
    source = ast.unparse(scope_module(tree, code, (*names, _LIVE)))
    # Register the source so tracebacks through the changed method show its lines.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    new_code = compile_in_scope(tree, code, filename=filename, module=ast.parse(source))
    cells = dict(zip(code.co_freevars, fn.__closure__ or ()))
    cells |= {n: types.CellType(f) for n, f in calls.items()}
    cells[_LIVE] = types.CellType(_live_check(fn, code, method))
    missing = [n for n in new_code.co_freevars if n not in cells]
    if missing:
        raise RuntimeError(f"{fn.__qualname__}: the changed method reads {missing}, which its own closure lacks")
    new = types.FunctionType(new_code.replace(co_qualname=code.co_qualname), fn.__globals__, fn.__name__,
                             fn.__defaults__, tuple(cells[n] for n in new_code.co_freevars))
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    new.__annotations__ = fn.__annotations__
    new.__autoep_spliced__ = fn
    return new


_LIVE = "__autoep_live__"


def _guard_first(tree: ast.FunctionDef, method: str) -> None:
    """``__autoep_live__(self)`` as the method's first statement (after its docstring)."""
    self_name = tree.args.args[0].arg
    call = ast.Expr(value=ast.Call(func=ast.Name(id=_LIVE, ctx=ast.Load()),
                                   args=[ast.Name(id=self_name, ctx=ast.Load())], keywords=[]))
    docstring = tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant) \
        and isinstance(tree.body[0].value.value, str)
    tree.body.insert(1 if docstring else 0, ast.copy_location(call, tree.body[0]))


def _live_check(fn, code, method: str):
    """A check, run on each call of the spliced method, that the block's class still holds ``fn`` as
    ``method`` and ``fn`` still runs ``code`` (what was proven and spliced)."""

    def check(self) -> None:
        now = inspect.unwrap(getattr(type(self), method, None))
        if now is not fn or fn.__code__ is not code:
            what = "was replaced" if now is not fn else "had its __code__ replaced"
            raise RuntimeError(f"{type(self).__name__}.{method} {what} after apply_plan; the expert-parallel "
                               f"block still holds the method proven at apply time. Apply the plan again to a "
                               f"fresh model built with the new code")

    return check
