"""Reading a function's own source as an AST, for proofs that never run it, and proving that source is
the code that runs.

The source of a function is read from its file (``inspect``), which is not necessarily what runs: the
file may have been edited after import, or ``fn.__code__`` replaced. ``function_tree`` therefore compiles
the source it read in the function's own scope (its class, so private ``self.__x`` names are mangled; its
enclosing function's free variables; its module's ``__future__`` flags) and refuses unless that gives the
code object that runs. Trees and proofs are cached per code object (``cached_by_code``), so a swapped
``__code__`` is read and proven again. The proofs themselves interpret these trees
(``autoep.detect.expert_loop``).
"""
from __future__ import annotations
import __future__

import ast
import copy
import functools
import inspect
import linecache
import symtable
import types


class Refusal(Exception):
    """A proof failed; carries the reason. Turned into UnsupportedModuleStructure at the API edge."""


# ---------------------------------------------------------------------------------------------
# Source access (cached per code object)
# ---------------------------------------------------------------------------------------------

_FUTURE_FLAGS = functools.reduce(
    lambda a, b: a | b, (getattr(__future__, f).compiler_flag for f in __future__.all_feature_names))
_SCOPE = "__autoep_scope__"


def function_tree(fn) -> ast.FunctionDef:
    """The AST of ``fn``'s own source (decorator wrappers such as transformers' experts interface are
    unwrapped), proven to compile to the code ``fn`` runs."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        raise Refusal(f"the source of {getattr(fn, '__qualname__', fn)} is not available (not a Python function)")
    return code_tree(code)


@functools.lru_cache(maxsize=None)
def code_tree(code: types.CodeType) -> ast.FunctionDef:
    """The AST of the function whose code object is ``code``, read from its file and checked against it."""
    try:
        lines, _ = inspect.getsourcelines(code)
    except (OSError, TypeError) as exc:
        raise Refusal(f"the source of {code.co_qualname} is not available ({exc})") from None
    tree = _parse_function("".join(lines), code.co_qualname)
    if not same_code(compile_in_scope(tree, code), code):
        raise Refusal(f"the source of {code.co_qualname} in {code.co_filename} line {code.co_firstlineno} is not "
                      "the code that runs (the file was edited after import, or the function's __code__ was "
                      "replaced); autoep proves only the code that runs")
    return tree


def _parse_function(src: str, qualname: str) -> ast.FunctionDef:
    """The one function ``src`` defines; an indented method is parsed in place (no dedent: dedenting would
    change its multi-line string constants), its line numbers counted from its first line."""
    indented = src[:1] in (" ", "\t")
    try:
        body = ast.parse("if 1:\n" + src if indented else src).body
    except SyntaxError as exc:
        raise Refusal(f"the source of {qualname} does not parse on its own ({exc.msg})") from None
    tree = body[0].body[0] if indented else body[0]
    if not isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise Refusal(f"{qualname} is not a plain function")
    if indented:
        ast.increment_lineno(tree, -1)
    return tree


def cached_by_code(proof):
    """``functools.lru_cache`` for a proof whose first argument is a function, keyed by that function and
    the code object it holds now: a ``__code__`` replaced after a proof is proven again."""

    @functools.lru_cache(maxsize=None)
    def keyed(fn, code, *args):
        return proof(fn, *args)

    @functools.wraps(proof)
    def cached(fn, *args):
        return keyed(fn, getattr(inspect.unwrap(fn), "__code__", None), *args)

    cached.cache_clear = keyed.cache_clear
    return cached


# ---------------------------------------------------------------------------------------------
# Compiling a function's tree as its own code was compiled
# ---------------------------------------------------------------------------------------------


def enclosing_class(code: types.CodeType) -> str | None:
    """The class whose body defined the function (its private names are mangled with it), from its
    qualified name: ``Block.forward`` -> ``Block``; ``make.<locals>.Block.forward`` -> ``Block``."""
    parts = code.co_qualname.split(".")
    return parts[-2] if len(parts) >= 2 and parts[-2] != "<locals>" else None


def scope_module(tree: ast.FunctionDef, code: types.CodeType, extra_free: tuple[str, ...] = ()) -> ast.Module:
    """A module defining ``tree`` as ``code`` was defined: inside a class of its class's name, inside a
    function binding its free variables (and ``extra_free``). Decorators, defaults and annotations are
    left out: they are not the function's code (the live function's own are used, never re-evaluated)."""
    fn = copy.deepcopy(tree)
    fn.decorator_list, fn.returns = [], None
    a = fn.args
    a.defaults, a.kw_defaults = [], [None] * len(a.kwonlyargs)
    for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
        if arg is not None:
            arg.annotation = None
    body: list[ast.stmt] = [fn]
    cls = enclosing_class(code)
    imports = _imported_bases(fn, code)
    if cls is not None:
        body = [ast.ClassDef(name=cls, bases=[], keywords=[], body=body, decorator_list=[],
                             **({"type_params": []} if "type_params" in ast.ClassDef._fields else {}))]
    free = [n for n in (*code.co_freevars, *extra_free) if not (cls is not None and n == "__class__")]
    binds = [ast.Assign(targets=[ast.Name(id=n, ctx=ast.Store())], value=ast.Constant(value=None)) for n in free]
    if cls is not None and cls not in free:  # the class's own name, read in its method, is a global there
        binds.insert(0, ast.Global(names=[cls]))
    scope = ast.FunctionDef(
        name=_SCOPE, args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=binds + body, decorator_list=[], returns=None,
        **({"type_params": []} if "type_params" in ast.FunctionDef._fields else {}))
    # Names the model's module binds by ``import`` and the function calls a method of (``F.linear(...)``):
    # CPython compiles such a call differently (LOAD_ATTR, not LOAD_METHOD), so the scope imports them too.
    # The module is compiled, never run.
    marks = [ast.Import(names=[ast.alias(name="__autoep_never_run__", asname=n)]) for n in imports]
    return ast.fix_missing_locations(ast.Module(body=[*marks, scope], type_ignores=[]))


def _imported_bases(fn: ast.FunctionDef, code: types.CodeType) -> list[str]:
    """The names ``X`` of calls ``X.attr(...)`` in ``fn`` that an ``import`` in ``code``'s file binds."""
    bases = {c.func.value.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
             and isinstance(c.func.value, ast.Name)}
    return sorted(bases & _module_imports(code.co_filename)) if bases else []


_IMPORTS_CACHE: dict[str, tuple[list, frozenset]] = {}


def _module_imports(filename: str) -> frozenset[str]:
    """Every name an ``import`` binds in the module scope of the file (its symbol table, cached per file)."""
    lines = linecache.getlines(filename)
    cached = _IMPORTS_CACHE.get(filename)
    if cached is not None and cached[0] is lines:
        return cached[1]
    try:
        table = symtable.symtable("".join(lines), filename, "exec")
        names = frozenset(sym.get_name() for sym in table.get_symbols() if sym.is_imported())
    except (SyntaxError, ValueError):
        names = frozenset()
    _IMPORTS_CACHE[filename] = (lines, names)
    return names


def compile_in_scope(tree: ast.FunctionDef, code: types.CodeType, *, extra_free: tuple[str, ...] = (),
                     filename: str | None = None, module: ast.Module | None = None) -> types.CodeType:
    """The code object ``tree`` compiles to in ``code``'s scope (``scope_module``), with ``code``'s
    ``__future__`` flags; ``module`` (that scope module, e.g. re-parsed from its unparsed text) if given."""
    module = module if module is not None else scope_module(tree, code, extra_free)
    compiled = compile(module, filename or code.co_filename, "exec", flags=code.co_flags & _FUTURE_FLAGS,
                       dont_inherit=True)
    holder = _const_code(compiled, _SCOPE)
    cls = enclosing_class(code)
    if cls is not None:
        holder = _const_code(holder, cls)
    found = _const_code(holder, tree.name)
    if found is None:
        raise Refusal(f"{code.co_qualname}: its source does not compile to a function named {tree.name}")
    return found


def _const_code(code: types.CodeType | None, name: str) -> types.CodeType | None:
    """The code object named ``name`` among ``code``'s constants (a function or class body it defines)."""
    if code is None:
        return None
    return next((c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == name), None)


_COMPARED = ("co_argcount", "co_posonlyargcount", "co_kwonlyargcount", "co_nlocals", "co_code", "co_names",
             "co_varnames", "co_freevars", "co_cellvars", "co_name", "co_exceptiontable")


def same_code(a: types.CodeType, b: types.CodeType) -> bool:
    """Whether two code objects run the same: bytecode, names, constants (nested code recursively) and
    flags; line numbers, file names and whether the function was nested in another are not compared."""
    if any(getattr(a, f) != getattr(b, f) for f in _COMPARED):
        return False
    if (a.co_flags ^ b.co_flags) & ~inspect.CO_NESTED:
        return False
    return len(a.co_consts) == len(b.co_consts) and all(_same_const(x, y) for x, y in zip(a.co_consts, b.co_consts))


def _same_const(x, y) -> bool:
    if isinstance(x, types.CodeType) and isinstance(y, types.CodeType):
        return same_code(x, y)
    if type(x) is not type(y):
        return False
    if isinstance(x, (tuple, frozenset)):
        xs, ys = (x, y) if isinstance(x, tuple) else (sorted(x, key=repr), sorted(y, key=repr))
        return len(xs) == len(ys) and all(_same_const(p, q) for p, q in zip(xs, ys))
    if isinstance(x, (float, complex)):
        return repr(x) == repr(y)  # -0.0 is not 0.0, nan is nan
    return x == y
