"""Defining a mutant from source text, and the AST toolkit the operators share.

``exec_subclass`` defines ``class Name(Name): <edited methods>`` in a copy of the original class's module,
as a module of its own whose file lives in ``linecache`` (``inspect.getsource`` reads the mutant, as the
detector does; a temp ``.py`` file is the fallback); a class a function builds is subclassed inside a
function of the same closure variables, and an edited method's zero-arg ``super()`` skips the original. The toolkit finds statements (``slots``), the
names they bind, loops that accumulate expert outputs, and call shapes by dotted name.
"""

from __future__ import annotations

import ast
import copy
import inspect
import itertools
import linecache
import os
import re
import sys
import tempfile
import textwrap
import types
from dataclasses import dataclass
from typing import Callable

from torch import nn

SCALE = 1.5  # what scaling operators multiply by: far above any rounding difference


# ---------------------------------------------------------------------------------------------
# Defining a subclass from source text, with retrievable source
# ---------------------------------------------------------------------------------------------

_MODULE_SEQ = itertools.count()
_DISK_DIR = None


def function_tree(fn) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


def exec_subclass(orig: type, class_body: str, *, prelude: str = "", decorator: str = "", check: str = "",
                  closure: dict | None = None) -> type:
    """A subclass of ``orig`` with the same name, defined by ``class_body`` (indented method sources)
    in a copy of ``orig``'s module globals, as a module of its own whose file is in ``linecache``
    (``inspect.getsource`` works on the class and its methods; checked on ``check``, else written to disk).
    ``closure``: the class is built inside a function whose parameters are these names, called with these
    values (a class a factory function builds: its methods read them as closure variables, as the
    original's do)."""
    name = orig.__name__
    lines = [decorator, f"class {name}({'_autoep_base' if closure else name}):", class_body]
    if closure:
        params = ", ".join([*closure, f"_autoep_base={name}"])
        lines = [f"def _autoep_closure({params}):", *(textwrap.indent(line, "    ") for line in lines),
                 f"    return {name}", f"{name} = _autoep_closure(**_autoep_closure_values)"]
    src = "\n".join(["from __future__ import annotations", prelude, *lines])
    extra = {"_autoep_closure_values": dict(closure)} if closure else {}
    cls = _define(orig, src, on_disk=False, extra=extra)
    if check and not _source_ok(getattr(cls, check), cls):
        cls = _define(orig, src, on_disk=True, extra=extra)
    return cls


def with_method(cls: type, method: str, tree: ast.FunctionDef, prelude: str = "", closure: dict | None = None) -> type:
    """``cls`` subclassed with ``method`` defined by ``tree``, as if the model file had been edited: the
    class decorator of transformers' experts interface is re-applied (with its own arguments) to a
    ``forward`` it wrapped; a method that read closure variables reads the same ones (and ``closure``'s)."""
    wrapped = method == "forward" and hasattr(cls.forward, "__wrapped__")
    decorator = _experts_decorator(cls) if wrapped else ""
    own = inspect.getclosurevars(inspect.unwrap(getattr(cls, method))).nonlocals
    closure = {k: v for k, v in own.items() if k != "__class__"} | (closure or {})  # zero-arg super(): below
    mutant = exec_subclass(cls, method_source(tree), prelude=prelude, decorator=decorator, check=method,
                           closure=closure or None)
    # Zero-arg super() in the edited method means what it meant in the edited file: the class after the
    # original in the MRO (PhiMoE's router calls nn.Linear.forward), not the original method it replaces.
    edited = inspect.unwrap(getattr(mutant, method))
    if "__class__" in edited.__code__.co_freevars:
        edited.__closure__[edited.__code__.co_freevars.index("__class__")].cell_contents = cls
    return mutant


def _experts_decorator(cls: type) -> str:
    """``@use_experts_implementation(...)`` as the class's own source spells it ('' when it has none)."""
    if "use_experts_implementation" not in vars(sys.modules[cls.__module__]):
        return ""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    spelled = [ast.unparse(d) for d in tree.decorator_list if "use_experts_implementation" in ast.unparse(d)]
    return f"@{spelled[0]}" if spelled else "@use_experts_implementation"


def _define(orig: type, src: str, *, on_disk: bool, extra: dict | None = None) -> type:
    global _DISK_DIR
    n = next(_MODULE_SEQ)
    name = f"autoep_mutant_{n}"
    if on_disk:
        _DISK_DIR = _DISK_DIR or tempfile.mkdtemp(prefix="autoep-mutants-")
        filename = os.path.join(_DISK_DIR, f"{name}.py")
        with open(filename, "w") as f:
            f.write(src)
    else:
        filename = f"/autoep-mutants/{name}.py"  # never on disk: linecache serves it (mtime None: kept)
        linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
    module = types.ModuleType(name)
    base = sys.modules[orig.__module__].__dict__
    module.__dict__.update({k: v for k, v in base.items() if not k.startswith("__") or k == "__builtins__"})
    module.__dict__.update({"__file__": filename, orig.__name__: orig, **(extra or {})})
    sys.modules[name] = module
    exec(compile(src, filename, "exec"), module.__dict__)
    return module.__dict__[orig.__name__]


def _source_ok(fn, cls: type) -> bool:
    try:
        return bool(inspect.getsource(fn)) and bool(inspect.getsource(cls))
    except (OSError, TypeError):
        return False


def method_source(tree: ast.FunctionDef) -> str:
    return textwrap.indent(ast.unparse(ast.fix_missing_locations(tree)), "    ")


# ---------------------------------------------------------------------------------------------
# AST toolkit: statement slots, bindings, call shapes
# ---------------------------------------------------------------------------------------------

# Names that hold indices, masks, shapes or modules, not float activations (value operators skip them).
INDEX_LIKE = re.compile(
    r"idx|index|indices|mask|hit|selected|top_x|pos|slot|shape|size|dim|layer|residual|^expert$|^_$|"
    r"batch|sequence|^bs$|slen|orig|dtype|device|nth|chosen|^tok$"
)
ROUTING_LIKE = re.compile(r"logit|score|prob|weight|top_value|routing")


@dataclass
class Slot:
    """A statement and where it sits: ``body[index]``; ``in_loop`` when inside a ``for``/``while``."""

    body: list
    index: int
    stmt: ast.stmt
    in_loop: bool


def slots(node: ast.AST, in_loop: bool = False) -> list[Slot]:
    """Every statement under ``node``, in source order."""
    out = []
    for _, value in ast.iter_fields(node):
        if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
            for i, stmt in enumerate(value):
                out.append(Slot(value, i, stmt, in_loop))
                out += slots(stmt, in_loop or isinstance(stmt, (ast.For, ast.While)))
    return out


def bound_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target = stmt.targets[0]
    elif isinstance(stmt, (ast.AugAssign, ast.AnnAssign)):
        target = stmt.target
    else:
        return []
    elts = target.elts if isinstance(target, ast.Tuple) else [target]
    return [e.id for e in elts if isinstance(e, ast.Name)]


def float_names(stmt: ast.stmt) -> list[str]:
    return [n for n in bound_names(stmt) if not INDEX_LIKE.search(n)]


def self_attr(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def dotted(node: ast.AST) -> str:
    """``torch.nn.functional.linear`` for that attribute chain; '' for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def calls(tree: ast.AST, pred: Callable[[ast.Call], bool]) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and pred(n)]


def named(*names: str) -> Callable[[ast.Call], bool]:
    """A call whose callee's last name is one of ``names`` (``torch.topk`` and ``x.topk`` alike)."""
    return lambda c: (c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "")) in names


def expr(text: str, **subst: ast.expr) -> ast.expr:
    """Parse ``text``, replacing each name in ``subst`` by (a copy of) its node."""
    tree = ast.parse(text, mode="eval").body

    class Sub(ast.NodeTransformer):
        def visit_Name(self, node):
            return copy.deepcopy(subst[node.id]) if node.id in subst else node

    return Sub().visit(tree)


def stmt(text: str) -> list[ast.stmt]:
    return ast.parse(textwrap.dedent(text)).body


def swap(tree: ast.AST, old: ast.AST, new: ast.AST) -> None:
    """Replace node ``old`` (by identity) with ``new`` inside ``tree``."""

    class Swap(ast.NodeTransformer):
        def visit(self, node):
            return new if node is old else super().visit(node)

    Swap().visit(tree)


def first_param(fn: ast.FunctionDef) -> str:
    return fn.args.args[1].arg


def loop_vars(fn: ast.FunctionDef) -> set[str]:
    out = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.For):
            target = node.target.elts[0] if isinstance(node.target, ast.Tuple) else node.target
            if isinstance(target, ast.Name):
                out.add(target.id)
    return out


EXPERT_COUNT = re.compile(r"^self(\.\w+)*\.(num_experts|num_local_experts|n_routed_experts)$")


def expert_counts(tree: ast.AST) -> list[ast.expr]:
    """Reads of the expert count: ``self.num_experts`` (``self.config.n_routed_experts``, ...),
    ``len(self.experts)``."""
    return [n for n in ast.walk(tree)
            if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and EXPERT_COUNT.match(dotted(n)))
            or (isinstance(n, ast.Call) and dotted(n.func) == "len" and len(n.args) == 1
                and dotted(n.args[0]) == "self.experts")]


def accumulations(tree: ast.AST) -> list[ast.AST]:
    """Where expert outputs are summed into an accumulator: ``acc.index_add_(dim, index, value)`` calls and
    ``acc[index] += value`` statements (mistral-inference's spelling), in source order."""
    adds = calls(tree, lambda c: isinstance(c.func, ast.Attribute) and c.func.attr == "index_add_"
                 and isinstance(c.func.value, ast.Name))
    augs = [n for n in ast.walk(tree) if isinstance(n, ast.AugAssign) and isinstance(n.op, ast.Add)
            and isinstance(n.target, ast.Subscript) and isinstance(n.target.value, ast.Name)]
    return sorted(adds + augs, key=lambda n: (n.lineno, n.col_offset))


def accumulator(node: ast.AST) -> str:
    return node.func.value.id if isinstance(node, ast.Call) else node.target.value.id


def accumulated_index(node: ast.AST) -> ast.expr | None:
    """The index expression of an accumulation (``index_add_``'s second argument, or the subscript)."""
    if isinstance(node, ast.Call):
        return node.args[1] if len(node.args) >= 3 else None
    return node.target.slice


def expert_loops(fn: ast.FunctionDef) -> list[tuple[Slot, str, str]]:
    """``(slot of the for, accumulator, loop variable)`` for every loop that accumulates expert outputs."""
    out = []
    for s in slots(fn):
        if isinstance(s.stmt, ast.For):
            adds = accumulations(s.stmt)
            target = s.stmt.target.elts[0] if isinstance(s.stmt.target, ast.Tuple) else s.stmt.target
            if adds and isinstance(target, ast.Name):
                out.append((s, accumulator(adds[0]), target.id))
    return out


def experts_call_slots(fn: ast.FunctionDef) -> list[Slot]:
    """Top-level statements of a block method that call ``self.experts(...)`` or run the expert loop."""
    loops = [loop.stmt for loop, _, _ in expert_loops(fn)]
    return [s for s in slots(fn) if s.body is fn.body
            and (calls(s.stmt, lambda c: self_attr(c.func) == "experts") or any(s.stmt is l for l in loops))]


# ---------------------------------------------------------------------------------------------
# Edits: what a source operator returns
# ---------------------------------------------------------------------------------------------


@dataclass
class Edit:
    """A mutated function, module-level source it needs, and a run-time tweak of each re-classed object."""

    tree: ast.FunctionDef
    prelude: str = ""
    tweak: Callable[[nn.Module], None] | None = None
    closure: dict | None = None  # closure variables the edited method reads, besides the original's
    # Process-wide state active around each forward/backward, not at detection or apply (``Mutant.around``):
    # given the edited module's globals (a flag its prelude defines, flipped after apply).
    around: Callable[[dict], object] | None = None
    # What the user does to the block after apply (``Mutant.after_apply``): run on the reference and the EP copy.
    after_apply: Callable[[nn.Module], None] | None = None


def each(fn: ast.FunctionDef, locate, mutate, prelude: str = "", tweak=None) -> list[Edit]:
    """One edit per location ``locate`` finds: ``mutate(tree_copy, location_in_copy)``."""
    edits = []
    for k in range(len(locate(fn))):
        tree = copy.deepcopy(fn)
        result = mutate(tree, locate(tree)[k])
        edits.append(Edit(tree, prelude, result if callable(result) else tweak))
    return edits
