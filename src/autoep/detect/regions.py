"""Where a v4-style block's expert regions sit in its methods, and whether every path runs exactly one.

A block may hold its expert work in more than one place: DeepSeek's remote code runs a masked-assignment
loop in ``forward`` while training and an argsort/split loop in a ``@torch.no_grad()`` helper otherwise.
Each region is proven on its own (``module_list_proof``); this module finds the candidate loops (in a
method's statements or inside the branches of its ``if`` statements, nowhere else) and proves that every
path through ``forward`` reaches exactly one of them, directly or through a helper call: a rank that
skipped the exchange, or ran it twice, would leave its peers waiting in it.

A path is a tuple of ``(statement index, "body" | "orelse")`` steps from a method's body to the statement
list that holds a region.
"""
from __future__ import annotations

import ast

from autoep.detect.loop_context import self_reads
from autoep.detect.source import Refusal

_BRANCHING = (ast.IfExp, ast.BoolOp, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def expert_loops(tree: ast.FunctionDef, attr: str = "experts") -> list[tuple[tuple, int, ast.For]]:
    """Every ``for`` statement reading ``self.<attr>`` (the experts container) in ``tree``'s statements or its
    ``if`` branches, as ``(path, index, loop)``."""
    found = []

    def visit(stmts: list[ast.stmt], path: tuple) -> None:
        for i, stmt in enumerate(stmts):
            if isinstance(stmt, ast.For) and self_reads(stmt, attr):
                found.append((path, i, stmt))
            elif isinstance(stmt, ast.If):
                visit(stmt.body, path + ((i, "body"),))
                visit(stmt.orelse, path + ((i, "orelse"),))

    visit(tree.body, ())
    return found


def statements(tree: ast.FunctionDef, path: tuple) -> list[ast.stmt]:
    """The statement list ``path`` leads to."""
    stmts = tree.body
    for i, field in path:
        stmts = getattr(stmts[i], field)
    return stmts


def before(tree: ast.FunctionDef, path: tuple, index: int) -> list[ast.stmt]:
    """The statements that run before ``statements(tree, path)[index]`` on its path, outermost first."""
    out, stmts = [], tree.body
    for i, field in path:
        out += stmts[:i]
        stmts = getattr(stmts[i], field)
    return out + stmts[:index]


def exchanges_on_every_path(tree: ast.FunctionDef, regions: set[int], helpers: dict[str, int], where: str) -> int:
    """How many exchanges every path through ``tree`` runs: a region loop (by node id) counts one, a call
    ``self.<helper>(...)`` counts what that helper runs. Refused where paths differ, or where a region
    or call sits in a loop, ``with``, ``try`` or conditional expression."""
    counter = _Counter(regions, helpers, where)
    falls, returns = counter.paths(tree.body)
    counts = falls | returns
    if len(counts) != 1:
        raise Refusal(f"{where}: some paths run the expert exchange {sorted(counts)} times; every path must run "
                      "it the same number of times, or a rank that skips it leaves its peers waiting")
    return counts.pop()


class _Counter:
    def __init__(self, regions: set[int], helpers: dict[str, int], where: str):
        self.regions, self.helpers, self.where = regions, helpers, where

    def paths(self, stmts: list[ast.stmt]) -> tuple[set[int], set[int]]:
        """(counts on paths falling off the end of ``stmts``, counts on paths that returned inside)."""
        falls, returns = {0}, set()
        for stmt in stmts:
            if isinstance(stmt, ast.Return):
                c = self.simple(stmt)
                return set(), returns | {f + c for f in falls}
            if isinstance(stmt, ast.If) and self._involved(stmt):
                if self.simple(stmt.test):
                    raise Refusal(f"{self.where} line {stmt.lineno}: the expert exchange runs in an `if` test")
                body_falls, body_returns = self.paths(stmt.body)
                else_falls, else_returns = self.paths(stmt.orelse)
                returns |= {f + r for f in falls for r in body_returns | else_returns}
                falls = {f + c for f in falls for c in body_falls | else_falls}
            elif id(stmt) in self.regions:
                falls = {f + 1 for f in falls}
            elif isinstance(stmt, (ast.For, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.Match, ast.AsyncFor)) \
                    and self._involved(stmt):
                raise Refusal(f"{self.where} line {stmt.lineno}: the expert exchange (or a return) sits in a "
                              f"`{type(stmt).__name__.lower()}`, so a rank may skip it or run it again")
            else:
                falls = {f + self.simple(stmt) for f in falls}
        return falls, returns

    def _involved(self, stmt: ast.stmt) -> bool:
        return any(id(n) in self.regions or isinstance(n, ast.Return) or self._helper_call(n) for n in ast.walk(stmt))

    def _helper_call(self, node: ast.AST) -> str | None:
        ok = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        ok = ok and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
        return node.func.attr if ok and node.func.attr in self.helpers else None

    def simple(self, node: ast.AST) -> int:
        """Exchanges a statement or expression without control flow runs: the helper calls in it, none
        of them under a conditional expression, a boolean operator, a lambda or a comprehension."""
        count = 0
        for n in ast.walk(node):
            name = self._helper_call(n)
            if name is None:
                continue
            if any(isinstance(b, _BRANCHING) and any(m is n for m in ast.walk(b)) for b in ast.walk(node)):
                raise Refusal(f"{self.where} line {n.lineno}: the call of self.{name} sits in a conditional expression")
            count += self.helpers[name]
        return count
