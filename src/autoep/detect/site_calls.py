"""A block's forward with its expert expressions on 3-D weights made expert calls, and what each computes on the
owner (``autoep.detect.block_weights`` proves the sites; ``autoep.runtime.recipes.block_weights`` runs them).

The forward's own source (proven to be its code), with site ``k`` replaced by ``__autoep_block_expert_k__(self,
<id>, <rows>)``: the rows expression as written, evaluated once where the token is, the weights read nowhere. Compiled
by ``autoep.detect.splice.compile_changed`` (its class's scope, globals, defaults and cells). What site ``k``
computes for one expert on its rows (``expert_function``): an inline site's own expression, the rows expression
replaced by the rows, compiled in the forward's scope; a method site's method itself.
"""
from __future__ import annotations

import ast
import copy
import types

from autoep.detect.block_weights import BlockWeightsProof, Site, position
from autoep.detect.source import Refusal, compile_in_scope, function_tree

ROWS_NAME = "__autoep_rows__"


def call_name(k: int) -> str:
    """The name site ``k``'s call takes in the changed forward."""
    return f"__autoep_block_expert_{k}__"


def changed_forward(cls: type, proof: BlockWeightsProof) -> ast.FunctionDef:
    """The forward's AST with site ``k`` replaced by ``__autoep_block_expert_k__(self, <id>, <rows>)``: the rows
    evaluated as the model evaluates them (once: where they occur more than once they are plain reads), the
    expert's weights read nowhere."""
    tree = copy.deepcopy(function_tree(cls.forward))
    nodes = _site_nodes(tree, proof)

    class _Replace(ast.NodeTransformer):
        def visit(self, node):
            k = nodes.get(id(node))
            if k is None:
                return self.generic_visit(node)
            site = proof.sites[k]
            rows = node.args[1] if site.kind == "method" else _rows_node(node, site)
            call = ast.Call(func=ast.Name(id=call_name(k), ctx=ast.Load()),
                            args=[ast.Name(id="self", ctx=ast.Load()), ast.Name(id=site.id_name, ctx=ast.Load()), rows],
                            keywords=[])
            return ast.copy_location(call, node)

    tree = _Replace().visit(tree)
    return ast.fix_missing_locations(tree)


def expert_function(cls: type, proof: BlockWeightsProof, k: int):
    """``f(self, expert_id, rows)``: what site ``k`` computes for one expert on its rows (the owner calls it with a
    view of the block whose weights are its local slices). A method site: the class's own method. An inline
    site: its expression, the rows expression replaced by the rows, compiled in the forward's scope (its
    globals, its class's name mangling)."""
    site = proof.sites[k]
    if site.kind == "method":
        return getattr(cls, site.method)
    forward = cls.forward
    tree = function_tree(forward)
    nodes = _site_nodes(tree, proof)
    node = next(n for n in ast.walk(tree) if nodes.get(id(n)) == k)
    expr = _with_rows(copy.deepcopy(node), _rows_node(node, site))
    fn = ast.FunctionDef(
        name="__autoep_expert__",
        args=ast.arguments(posonlyargs=[], args=[ast.arg(arg=a) for a in ("self", site.id_name, ROWS_NAME)],
                           kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=[ast.Return(value=expr)], decorator_list=[], returns=None,
        **({"type_params": []} if "type_params" in ast.FunctionDef._fields else {}))
    ast.copy_location(fn, node)
    ast.fix_missing_locations(fn)
    code = compile_in_scope(fn, forward.__code__)
    if code.co_freevars:
        raise Refusal(f"{cls.__name__}.forward: the expert expression at line {site.position[0]} reads "
                      f"{code.co_freevars}, variables of an enclosing function")
    return types.FunctionType(code, forward.__globals__, f"{cls.__name__}.forward expert {k}")


def _site_nodes(tree: ast.FunctionDef, proof: BlockWeightsProof) -> dict[int, int]:
    """``{id(node): k}`` of each site's expression in ``tree`` (the outermost node at its position)."""
    found: dict[int, int] = {}
    for k, site in enumerate(proof.sites):
        node = next((n for n in ast.walk(tree) if isinstance(n, ast.expr) and hasattr(n, "end_col_offset")
                     and position(n) == site.position), None)
        if node is None:
            raise Refusal(f"the expert expression {k} at line {site.position[0]} is not in the forward's source")
        found[id(node)] = k
    return found


def _rows_node(node: ast.AST, site: Site) -> ast.AST:
    """The first occurrence of the site's rows expression inside its expression."""
    return next(n for n in ast.walk(node) if isinstance(n, ast.expr) and ast.unparse(n) == site.rows)


def _with_rows(expr: ast.AST, rows: ast.AST) -> ast.AST:
    """``expr`` with every occurrence of ``rows`` (by its text) replaced by the rows parameter."""
    text = ast.unparse(rows)

    class _Rows(ast.NodeTransformer):
        def visit(self, node):
            if isinstance(node, ast.expr) and ast.unparse(node) == text:
                return ast.copy_location(ast.Name(id=ROWS_NAME, ctx=ast.Load()), node)
            return self.generic_visit(node)

    return _Rows().visit(expr)
