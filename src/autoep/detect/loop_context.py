"""What surrounds a spliced expert loop: the block's own statements before it, and whether the loop (or
the experts call) runs on every path.

``prelude`` follows the model's own code before the loop without proving it (it runs as written) and
tracks only what the loop reads; ``always_reached`` refuses a loop or experts call that a rank could
skip, since its peers would wait in the exchange.
"""
from __future__ import annotations

import ast
import functools
import inspect

import torch
import torch.nn as nn

from autoep.detect.expert_loop import Attr, Hit, LoopFacts, Mask, Obj, Opaque, Prover, ShapeItem
from autoep.detect.source import Refusal, function_tree

# ---------------------------------------------------------------------------------------------
# Whole-function helpers: where the region sits, and whether it always runs
# ---------------------------------------------------------------------------------------------

_BRANCHING = (ast.IfExp, ast.BoolOp, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def always_reached(tree: ast.FunctionDef, node: ast.AST, what: str, guards: list[str] | None = None) -> None:
    """``node`` sits in a top-level statement of ``tree`` with no ``return`` before it and no branch
    around it: a rank that skipped it would leave its peers waiting in the exchange. With ``guards`` (a list
    to fill), it may also sit in the body of ``if self.<attr>:`` statements (the same rules inside them):
    their attribute names are appended, for the caller to fold on the instance (a constant ``True`` runs
    the body on every rank and every call)."""
    body = tree.body
    while True:
        stmt = _holding(body, node, tree.name, what)
        test = stmt.test if isinstance(stmt, ast.If) else None
        if guards is not None and test is not None and _self_attr(test, tree) \
                and any(id(node) in {id(n) for n in ast.walk(s)} for s in stmt.body):
            guards.append(test.attr)
            body = stmt.body
            continue
        if isinstance(stmt, (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.Match)) and stmt is not node:
            raise Refusal(f"{tree.name} line {stmt.lineno}: {what} runs inside a `{type(stmt).__name__.lower()}`, "
                          "so a rank may skip it and hang its peers")
        if any(isinstance(n, _BRANCHING) and id(node) in {id(m) for m in ast.walk(n)} for n in ast.walk(stmt)):
            raise Refusal(f"{tree.name} line {stmt.lineno}: {what} sits in a conditional expression")
        return


def _holding(body: list[ast.stmt], node: ast.AST, name: str, what: str) -> ast.stmt:
    """The statement of ``body`` that holds ``node``, refusing a ``return`` in any statement before it."""
    for stmt in body:
        if id(node) in {id(n) for n in ast.walk(stmt)}:
            return stmt
        if any(isinstance(n, ast.Return) for n in ast.walk(stmt)):
            raise Refusal(f"{name} line {stmt.lineno} may return before {what}")
    raise Refusal(f"{name}: {what} not found")


def _self_attr(test: ast.AST, tree: ast.FunctionDef) -> bool:
    me = tree.args.args[0].arg if tree.args.args else "self"
    return isinstance(test, ast.Attribute) and isinstance(test.value, ast.Name) and test.value.id == me


@functools.lru_cache(maxsize=None)
def self_reads(tree: ast.AST, attr: str) -> list[ast.Attribute]:
    """Every ``self.<attr>`` read in ``tree`` (cached per parsed tree)."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == attr
            and isinstance(n.value, ast.Name) and n.value.id == "self"]


def plain_method(cls: type, name: str, owner: nn.Module):
    """The class's own function ``name`` (refusing instance overrides and decorator wrappers)."""
    if name in vars(owner):
        raise Refusal(f"{cls.__name__}.{name} is overridden on the instance")
    fn = getattr(cls, name, None)
    if not inspect.isfunction(fn):
        raise Refusal(f"{cls.__name__}.{name} is not a plain function")
    if hasattr(fn, "__wrapped__"):
        raise Refusal(f"{cls.__name__}.{name} is wrapped by a decorator")
    if function_tree(fn).decorator_list:
        raise Refusal(f"{cls.__name__}.{name} is decorated; autoep does not know what the decorator does")
    return fn


# ---------------------------------------------------------------------------------------------
# The model's own statements before a spliced loop
# ---------------------------------------------------------------------------------------------

_TRACKED = (Mask, Hit, Opaque, Obj, Attr, ShapeItem)


def prelude(p: Prover, stmts: list[ast.stmt]) -> None:
    """Follow the block's own statements before its expert loop. They run as written, so they are not
    proven; the proof only tracks what the loop reads: which tensors are which (by identity), and the
    one-hot mask and hit list built from the expert ids. Anything not understood binds its names to
    fresh opaque tensors, and every tensor it reads is *tainted* (it may have been changed in place):
    masks and hits built from a tainted tensor are forgotten, so a loop using them is refused."""
    for arg in p.tree.args.args[1:] + p.tree.args.kwonlyargs:
        p.env.setdefault(arg.arg, Opaque(arg.arg))
    for stmt in stmts:
        if isinstance(stmt, ast.With) and _is_no_grad(p, stmt):
            prelude(p, stmt.body)
        elif isinstance(stmt, ast.Assign) and _tracked_assign(p, stmt):
            continue
        else:
            _opaque_statement(p, stmt)


def _is_no_grad(p: Prover, stmt: ast.With) -> bool:
    ctx = stmt.items[0].context_expr if len(stmt.items) == 1 and stmt.items[0].optional_vars is None else None
    if not (isinstance(ctx, ast.Call) and not ctx.args and not ctx.keywords):
        return False
    try:
        return p.eval(ctx.func) == Obj(torch.no_grad)
    except Refusal:
        return False


def _tracked_assign(p: Prover, stmt: ast.Assign) -> bool:
    saved, p.facts = p.facts, LoopFacts()
    try:
        value = p.eval(stmt.value)
    except Refusal:
        return False
    finally:
        p.facts = saved
    if isinstance(value, tuple) and value and value[0] == "zeros_like":
        value = None  # a fresh tensor: tracked as a new opaque value below
    elif not isinstance(value, _TRACKED):
        return False
    if len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Name):
        return False
    name = stmt.targets[0].id
    p.env[name] = Opaque(name) if value is None else value
    return True


def _opaque_statement(p: Prover, stmt: ast.stmt) -> None:
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            value = p.env.get(node.id)
            if isinstance(value, Opaque):
                _taint(p, value)
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            if isinstance(stmt, ast.AugAssign) and isinstance(p.env.get(node.id), Opaque):
                continue  # an in-place update: same tensor, already tainted above
            p.env[node.id] = Opaque(node.id)


def _taint(p: Prover, value: Opaque) -> None:
    for name, held in list(p.env.items()):
        source = held.idx if isinstance(held, Mask) else held.mask.idx if isinstance(held, Hit) else None
        if source is value:
            p.env[name] = Opaque(name)
