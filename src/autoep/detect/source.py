"""Reading a function's own source as an AST, for proofs that never run it.

Parsed trees are cached per function object, so a patched class (a new function) is parsed and proven
again. The proofs themselves interpret these trees (``autoep.detect.expert_loop``).
"""
from __future__ import annotations

import ast
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
