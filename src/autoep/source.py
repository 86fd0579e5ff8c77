"""Reading a class's own source as an AST, for proofs that never run it.

Parsed trees are cached per function object (per class that defines it). ``inline`` turns a
straight-line body into one expression per name, so a proof can match what a function computes
whatever its local variable names are.
"""
from __future__ import annotations

import ast
import copy
import functools
import inspect
import textwrap


class Refusal(Exception):
    """A proof failed; carries the reason. Turned into UnsupportedModuleStructure at the API edge."""


# ---------------------------------------------------------------------------------------------
# Source access (cached per function object, i.e. per class that defines it)
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def function_tree(fn) -> ast.FunctionDef:
    """The AST of ``fn``'s own source (decorator wrappers such as transformers' experts interface are unwrapped)."""
    fn = inspect.unwrap(fn)
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise Refusal(f"the source of {getattr(fn, '__qualname__', fn)} is not available ({exc})") from None
    tree = ast.parse(src).body[0]
    if not isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise Refusal(f"{getattr(fn, '__qualname__', fn)} is not a plain function")
    return tree


def forward_tree(cls: type) -> ast.FunctionDef:
    return function_tree(cls.forward)


def last_name(node: ast.AST) -> str:
    """``torch.nn.functional.linear`` -> ``linear``; ``self.act_fn`` -> ``act_fn``; else ''."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def self_attr(node: ast.AST) -> str | None:
    """``self.x`` -> ``x``; anything else -> None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def self_attrs_read(tree: ast.AST) -> set[str]:
    return {a for n in ast.walk(tree) if (a := self_attr(n))}


def all_calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def call_names(tree: ast.AST) -> set[str]:
    return {last_name(c.func) for c in all_calls(tree)}


def arg_names(tree: ast.FunctionDef) -> list[str]:
    return [a.arg for a in tree.args.args]


# ---------------------------------------------------------------------------------------------
# Symbolic inlining: a straight-line body becomes one expression per name
# ---------------------------------------------------------------------------------------------


class Inliner(ast.NodeTransformer):
    def __init__(self, env: dict[str, ast.AST]):
        self.env = env

    def visit_Name(self, node):
        return self.env.get(node.id, node)


def inline(expr: ast.AST, env: dict[str, ast.AST]) -> ast.AST:
    return Inliner(env).visit(copy.deepcopy(expr))


def bind(stmt: ast.Assign | ast.AugAssign, env: dict[str, ast.AST]) -> None:
    """Record what each assigned name holds, as an expression over the function's inputs."""
    if isinstance(stmt, ast.AugAssign):
        if not isinstance(stmt.target, ast.Name):
            raise Refusal(f"line {stmt.lineno}: in-place update of a non-name")
        value = ast.BinOp(left=ast.Name(id=stmt.target.id, ctx=ast.Load()), op=stmt.op, right=stmt.value)
        env[stmt.target.id] = inline(value, env)
        return
    value = inline(stmt.value, env)
    for target in stmt.targets:
        if isinstance(target, ast.Name):
            env[target.id] = value
        elif isinstance(target, ast.Tuple) and all(isinstance(e, ast.Name) for e in target.elts):
            literal = isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts)
            for i, elt in enumerate(target.elts):
                env[elt.id] = value.elts[i] if literal else ast.Subscript(value=value, slice=ast.Constant(i), ctx=ast.Load())
        else:
            raise Refusal(f"line {stmt.lineno}: assignment to {ast.unparse(target)} cannot be followed")


def is_call_to(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and last_name(node.func) == name


def is_self_call(node: ast.AST, attr: str) -> bool:
    return isinstance(node, ast.Call) and self_attr(node.func) == attr



def flatten_body(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements in order, ``with`` blocks (e.g. ``torch.no_grad()``) opened in place."""
    out = []
    for stmt in body:
        if isinstance(stmt, ast.With):
            out.extend(flatten_body(stmt.body))
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # docstring
        else:
            out.append(stmt)
    return out


def is_continue_guard(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.If) and not stmt.orelse and all(isinstance(s, ast.Continue) for s in stmt.body)


def strip_casts(expr: ast.AST) -> ast.AST:
    while isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "to":
        expr = expr.func.value
    return expr



CASTS = {"float", "to", "type", "half", "bfloat16", "double"}


def assignments(trees: list[ast.FunctionDef]) -> dict[str, list[ast.AST]]:
    """Every value each local name is given anywhere in ``trees`` (tuple targets element by element;
    an in-place update records the update itself, which matches no pattern a proof looks for)."""
    out: dict[str, list[ast.AST]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                out.setdefault(node.target.id, []).append(node)
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out.setdefault(target.id, []).append(node.value)
                elif isinstance(target, ast.Tuple):
                    literal = isinstance(node.value, ast.Tuple) and len(node.value.elts) == len(target.elts)
                    for i, elt in enumerate(target.elts):
                        if isinstance(elt, ast.Name):
                            value = node.value.elts[i] if literal else ast.Subscript(
                                value=node.value, slice=ast.Constant(i), ctx=ast.Load())
                            out.setdefault(elt.id, []).append(value)
    return out


def straight_line_result(tree: ast.FunctionDef, what: str) -> ast.AST:
    """The returned expression of a body of assignments ending in ``return``, inlined over the inputs."""
    body = flatten_body(tree.body)
    env: dict[str, ast.AST] = {}
    for stmt in body[:-1]:
        if not isinstance(stmt, (ast.Assign, ast.AugAssign)):
            raise Refusal(f"{what} line {stmt.lineno} cannot be followed (not an assignment)")
        bind(stmt, env)
    if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        raise Refusal(f"{what} does not end in a return")
    return inline(body[-1].value, env)
