"""What pass 1 of record/exchange/replay may write, and its undo (``autoep.runtime.recipes.replay``).

Pass 1 runs the block's forward with placeholder expert outputs; pass 2 must start from the state the block was
called in, so that its writes happen once, as in the block's own call. ``Snapshot`` records, before pass 1:

- the attributes of the block and of every submodule, and of the plain Python objects, dicts, lists and sets
  they hold (a counter, ``self.aux_loss``, a cache dict, an ``OrderedDict``, a list inside a dict, a
  ``SimpleNamespace``'s field), followed ``DEPTH`` levels down; the module globals that the methods of the
  block's classes, and the module-level functions they call, read by name (``_CALLS[0] += 1``, ``global
  step``) and the closure variables of those functions, followed the same way;
- the plain attributes of the model's classes (a class-level cache or counter), followed the same way;
- the states of the random generators found there (a ``torch.Generator``, a ``random.Random``, numpy's) and of
  the global ones (torch CPU and CUDA, Python's, numpy's);
- the version counter of every tensor found there, of the block's inputs, parameters and buffers.

``undo`` puts back attributes, globals, container contents and generator states, and raises ``ReplayError``
naming what was written where a tensor was edited in place (no undo can restore its old values):
``BufferTwin.forward wrote self.tokens_per_expert in place during the record pass``.

The block's own inputs are the exception: pass 1 runs on copies of them (``record_inputs``), so an in-place edit
of its input (Switch's router jitter, ``hidden_states *= noise``) lands on a copy in pass 1 and is made once, on
the real input, in pass 2, as in the block's own call.
"""

from __future__ import annotations

import inspect
import random
import sys
import types

import torch
from torch import Tensor, nn

DEPTH = 3  # how far below an attribute (or global) the snapshot follows plain containers and objects
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, nn.Module)
_MISSING = object()


class ReplayError(RuntimeError):
    """A check of record/exchange/replay failed: the block's run is not the model's own computation."""


def rng_state() -> tuple:
    """The global generators' states: torch CPU, CUDA (where initialised), Python's, numpy's (where imported)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    np = sys.modules.get("numpy")
    return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state() if np is not None else None


def set_rng_state(state: tuple) -> None:
    cpu, cuda, py, np_state = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    if np_state is not None:
        sys.modules["numpy"].random.set_state(np_state)


def _generator_types() -> tuple[type, ...]:
    np = sys.modules.get("numpy")
    return (torch.Generator, random.Random) + ((np.random.Generator, np.random.RandomState) if np is not None else ())


def _generator_state(value):
    """``(get, set)`` of a random generator object, or None: torch's, Python's, numpy's."""
    if isinstance(value, torch.Generator):
        return value.get_state, value.set_state
    if isinstance(value, random.Random):
        return value.getstate, value.setstate
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.random.Generator):
        bits = value.bit_generator
        return (lambda: bits.state), (lambda s: setattr(bits, "state", s))
    if np is not None and isinstance(value, np.random.RandomState):
        return value.get_state, value.set_state
    return None


_GLOBALS_READ: dict = {}  # code objects of a class's functions -> ([(globals dict, names read)], closure cells)


def _names(code: types.CodeType) -> set[str]:
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names(const)
    return out


def _model_classes(cls: type) -> list[type]:
    """``cls``'s MRO below ``nn.Module``, torch's own classes left out: the model's classes."""
    return [k for k in cls.__mro__ if k not in (nn.Module, object) and not k.__module__.startswith("torch.")]


def _class_state(klass: type) -> dict:
    """A class's plain attributes (a class-level cache or counter), not its methods, properties or dunders."""
    return {k: v for k, v in vars(klass).items()
            if not k.startswith("__") and not isinstance(v, (*_OPAQUE, staticmethod, classmethod, property))}


def _functions(cls: type) -> list[types.FunctionType]:
    """The functions the model's classes define on ``cls``."""
    out = []
    for klass in _model_classes(cls):
        for value in vars(klass).values():
            fn = inspect.unwrap(getattr(value, "__func__", value))
            if isinstance(fn, types.FunctionType):
                out.append(fn)
    return out


def _globals_read(cls: type) -> tuple[list[tuple[dict, tuple[str, ...]]], tuple]:
    """The module globals ``cls``'s methods read by name, and those the module-level functions they call read
    (two calls deep): ``[(globals dict, names)]``; and the closure cells of those functions. Cached by the
    functions (their identity: a closure is its function's)."""
    fns = _functions(cls)
    key = tuple(fns)
    if key not in _GLOBALS_READ:
        read: dict[int, tuple[dict, set]] = {}
        todo, seen, cells = [(fn, 2) for fn in fns], set(), []
        while todo:
            fn, depth = todo.pop()
            if fn in seen:
                continue
            seen.add(fn)
            cells += fn.__closure__ or ()
            g, names = fn.__globals__, _names(fn.__code__)  # attribute names too: not globals, no matter
            read.setdefault(id(g), (g, set()))[1].update(names)
            todo += [(g[n], depth - 1) for n in names if depth and isinstance(g.get(n), types.FunctionType)]
        _GLOBALS_READ[key] = ([(g, tuple(sorted(names))) for g, names in read.values()], tuple(cells))
    return _GLOBALS_READ[key]


def record_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The block's arguments for pass 1: each plain tensor among them (positional, keyword, inside plain tuples,
    lists and dicts) a copy of the same shape, strides, dtype and values, differentiable to the original (pass
    1's rows send their gradient to the real input); one tensor given twice is copied once (the copies alias
    alike). Not copied, so that an in-place edit of them in pass 1 still raises as any tensor's does: tensor
    subclasses and parameters, tensors not strided or overlapping themselves (an ``expand``), and tensors
    sharing memory with another input (views of one another: separate copies would not see each other's
    edits). Cost: one copy of each copied input per block call, freed after pass 1 unless pass 1's graph (the
    rows sent to the experts) saved it for the backward."""
    found: dict[int, Tensor] = {}
    for t in _input_tensors((args, kwargs), []):
        found.setdefault(id(t), t)
    owners: dict[int, set[int]] = {}
    for t in found.values():
        if _holds_memory(t):
            owners.setdefault(t.untyped_storage().data_ptr(), set()).add(id(t))
    copies = {i: _copy(t) for i, t in found.items()
              if type(t) is Tensor and t.layout == torch.strided and torch._debug_has_internal_overlap(t) == 0
              and (not _holds_memory(t) or len(owners[t.untyped_storage().data_ptr()]) == 1)}
    return _replaced(args, copies), _replaced(kwargs, copies)


def _holds_memory(t: Tensor) -> bool:
    """Whether ``t`` has elements in memory another input could share (empty and ``meta`` tensors have none:
    copied whatever their address says)."""
    return t.layout == torch.strided and not t.is_meta and t.numel() > 0


def _input_tensors(value, out: list) -> list:
    if isinstance(value, Tensor):
        out.append(value)
    elif type(value) in (tuple, list):
        for v in value:
            _input_tensors(v, out)
    elif type(value) is dict:
        for v in value.values():
            _input_tensors(v, out)
    return out


def _copy(t: Tensor) -> Tensor:
    # A copy with the input's own strides (``clone`` makes a sliced input contiguous), through ``copy_``: its
    # backward sends the gradient to ``t``.
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _replaced(value, copies: dict[int, Tensor]):
    if isinstance(value, Tensor):
        return copies.get(id(value), value)
    if type(value) in (tuple, list):
        return type(value)(_replaced(v, copies) for v in value)
    if type(value) is dict:
        return {k: _replaced(v, copies) for k, v in value.items()}
    return value


def _named_inputs(block: nn.Module, args: tuple, kwargs: dict) -> list[tuple[str, object]]:
    """The block's arguments by the forward's parameter names (``its input hidden_states``)."""
    try:
        bound = inspect.signature(type(block).forward).bind(block, *args, **kwargs).arguments
        return [(f"its input {k}", v) for k, v in list(bound.items())[1:]]
    except (TypeError, ValueError):
        return [("its input", (args, kwargs))]


class Snapshot:
    """The state before pass 1 (module docstring); ``undo(name)`` after it."""

    def __init__(self, block: nn.Module, args: tuple, kwargs: dict):
        self.versions: list[tuple[str, Tensor, int]] = []
        self.attrs: list[tuple[object, dict]] = []  # (object, its attributes)
        self.items: list[tuple[object, tuple]] = []  # (dict/list/set, its contents)
        self.globals: list[tuple[dict, dict]] = []  # (globals dict, the names read: their values)
        self.classes: list[tuple[type, dict]] = []  # (a model class, its plain attributes)
        self.cells: list[tuple[types.CellType, object]] = []  # (a closure cell, its contents)
        self.rngs: list[tuple[object, object]] = []  # (setter, state)
        self._seen: set[int] = set()
        self._generators = _generator_types()
        for name, value in _named_inputs(block, args, kwargs):
            self._walk(name, value, DEPTH)
        classes = {}
        for prefix, m in block.named_modules():
            where = "self" + (f".{prefix}" if prefix else "")
            self._seen.add(id(m))
            self.attrs.append((m, dict(vars(m))))
            for k, v in vars(m).items():
                # parameters and buffers by their attribute names (``self.gate.weight``)
                holder = k in ("_parameters", "_buffers")
                self._walk(where if holder else f"{where}.{k}", v, DEPTH, attributes=holder)
            classes.setdefault(type(m), None)
        for klass in dict.fromkeys(k for cls in classes for k in _model_classes(cls)):
            self.classes.append((klass, _class_state(klass)))
            for k, v in self.classes[-1][1].items():
                self._walk(f"{klass.__name__}.{k}", v, DEPTH)
        for cls in classes:
            read_by_cls, cells = _globals_read(cls)
            for g, names in read_by_cls:
                read = {n: g.get(n, _MISSING) for n in names if not isinstance(g.get(n), _OPAQUE)}
                self.globals.append((g, read))
                for n, v in read.items():
                    self._walk(f"the global {n}", v, DEPTH)
            for cell in cells:
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                self.cells.append((cell, value))
                self._walk("a closure variable", value, DEPTH)

    def _walk(self, name: str, value, depth: int, attributes: bool = False) -> None:
        if id(value) in self._seen or value is None or value is _MISSING or isinstance(value, (str, bytes, int, float)):
            return
        self._seen.add(id(value))
        if isinstance(value, Tensor):
            self.versions.append((name, value, value._version))
            return
        if isinstance(value, self._generators):
            get, set_ = _generator_state(value)
            self.rngs.append((set_, get()))
            return
        if depth == 0 or isinstance(value, _OPAQUE):
            return
        if isinstance(value, dict):
            self.items.append((value, tuple(value.items())))
            for k, v in list(value.items()):
                self._walk(f"{name}.{k}" if attributes else f"{name}[{k!r}]", v, depth - 1)
        elif isinstance(value, (list, set, tuple)):
            if not isinstance(value, tuple):
                self.items.append((value, tuple(value)))
            for i, v in enumerate(value):
                self._walk(f"{name}[{i}]", v, depth - 1)
        elif hasattr(value, "__dict__") and type(value).__module__ != "builtins":
            self.attrs.append((value, dict(vars(value))))
            for k, v in list(vars(value).items()):
                self._walk(f"{name}.{k}", v, depth - 1)

    def undo(self, cls_name: str) -> None:
        """Put back what pass 1 wrote (attributes rebound, added or deleted; globals rebound; containers filled
        in place; generators' states); raise ``ReplayError`` naming a tensor it edited in place."""
        for obj, before in self.attrs:
            _rebind(vars(obj), before)
        for klass, before in self.classes:
            now = _class_state(klass)
            for k in [k for k in now if k not in before]:
                delattr(klass, k)
            for k, v in before.items():
                if now.get(k, _MISSING) is not v:
                    setattr(klass, k, v)
        for cell, before in self.cells:
            if cell.cell_contents is not before:
                cell.cell_contents = before
        for g, before in self.globals:
            for n, v in before.items():
                if v is _MISSING:
                    g.pop(n, None)
                elif g.get(n, _MISSING) is not v:
                    g[n] = v
        for value, before in self.items:
            now = tuple(value.items()) if isinstance(value, dict) else tuple(value)
            if not _same_items(now, before):
                value.clear()
                if isinstance(value, list):
                    value.extend(before)
                else:
                    value.update(before)
        for set_state, state in self.rngs:
            set_state(state)
        for name, t, version in self.versions:
            if t._version != version:
                raise ReplayError(
                    f"{cls_name}.forward wrote {name} in place during the record pass ({tuple(t.shape)} {t.dtype}); "
                    "record/exchange/replay runs the forward twice per call and cannot undo an in-place edit of a "
                    "tensor: write it out of place (a new tensor), move the write outside the block, or opt out "
                    "(an explicit local_compute_fn._target_)")


def _rebind(now: dict, before: dict) -> None:
    for k in [k for k in now if k not in before]:
        del now[k]
    for k, v in before.items():
        if now.get(k, _MISSING) is not v:
            now[k] = v


def _same_items(now: tuple, then: tuple) -> bool:
    """The same contents by identity (dict items pairwise; equal keys that are other objects count as a
    change, whose undo changes nothing)."""
    if len(now) != len(then):
        return False
    for a, b in zip(now, then):
        pair = isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b)
        if (pair and any(x is not y for x, y in zip(a, b))) or (not pair and a is not b):
            return False
    return True
