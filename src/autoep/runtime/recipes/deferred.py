"""Deferred expert outputs: the block's forward runs once; what depends on an expert's output waits for the exchange.

``Deferring`` (a ``TorchFunctionMode``, above autograd) is active while a block's class forward runs. Each expert
call answers a ``Pending`` tensor: shape, dtype and strides from a meta *shadow*, no storage. A torch call that
reads a pending value, or a tensor whose storage a deferred call writes (``out.index_add_(0, idx, pending)``,
``out[idx] += w * pending``), is not run: it goes on the tape with its arguments and its grad/autocast context,
and answers pending results computed on meta. Everything else (routing, masks, Python side effects, hooks) runs
once, now, as in the model.

Stages. A value is available after exchange ``s`` (its *stage*): real tensors at 0, an expert call's output one
stage after its input. A taped call runs at the stage of its latest input (and, where it writes a tensor, no
earlier than any taped call already reading or writing that storage: the model's order of reads and writes on
one storage is kept). ``Tape.run(stage)`` runs that stage's calls in the order the forward made them; autograd
records them then. Chained experts (an expert on another's output) are calls of a later stage.

What needs a pending value now raises ``ReplayError`` naming the block's line: a host read (``item``,
``bool``, ``tolist``, numpy, printing, a data pointer), a call without a meta kernel (data-dependent shapes:
``nonzero``, ``unique``), an in-place change of a tensor's shape. The error is kept on the tape too
(``Tape.failure``), so a block that catches it still fails. An immediate in-place write into a tensor a taped
call reads (the version counter moved between the record and the run) raises in ``Tape.check_unchanged``.

At the end ``Tape.settle`` swaps every pending object with its real tensor (``torch.utils.swap_tensors``), so
what the block kept (its return value, attributes, lists, hook stores) holds real values.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import os
import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

_AUTOEP_RUNTIME = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_STDLIB = os.path.dirname(os.path.abspath(contextlib.__file__))  # logging's own frames are not the caller's line


_FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"]  # the classmethod itself, put back after each forward


class ReplayError(RuntimeError):
    """A block's call cannot run under EP as its own forward would (raised on every rank, naming the line)."""


class Pending(Tensor):
    """An expert output (or a value computed from one) before the exchange: metadata only. Torch calls on it
    inside ``Deferring`` are taped; anything reaching the dispatcher (outside the mode) raises."""

    shadow: Tensor  # shape, strides and dtype, on meta; never requires grad (no autograd on meta: a user's
    #                  saved-tensors hooks, ``save_on_cpu``, would see meta tensors)
    stage: int
    needs_grad: bool  # whether the real tensor will require grad (answered for ``requires_grad``, ``is_leaf``)

    @staticmethod
    def __new__(cls, shadow: Tensor, device: torch.device, stage: int, grad: bool):
        # No grad flag on the wrapper itself: a leaf that requires grad would be looked up by ``swap_tensors``'
        # autograd checks.
        pending = Tensor._make_wrapper_subclass(cls, shadow.shape, strides=shadow.stride(), dtype=shadow.dtype,
                                                device=device)
        pending.shadow, pending.stage, pending.needs_grad = shadow, stage, grad
        return pending

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise ReplayError(f"a pending expert output reached {func} outside the block's forward; autoep swaps it for "
                            "its value when the block returns (was it kept past a failed call?)")


# Calls that read a tensor's values into Python (or hand its memory out): never taped.
_HOST = {Tensor.item, Tensor.tolist, Tensor.__bool__, Tensor.__int__, Tensor.__float__, Tensor.__index__,
         Tensor.__complex__, Tensor.numpy, Tensor.__array__, Tensor.data_ptr, Tensor.__repr__, Tensor.__str__,
         Tensor.__format__, Tensor.untyped_storage, Tensor.storage, Tensor._typed_storage, Tensor.__reduce_ex__,
         Tensor.__dlpack__, Tensor.__deepcopy__, torch.equal, torch.is_nonzero, Tensor.is_nonzero}
_HOST_NAMES = {"item", "tolist", "numpy", "data_ptr", "untyped_storage", "storage", "__array__", "__repr__",
               "__format__", "__deepcopy__", "__reduce_ex__"}
# Calls kept on the tape whatever they return: hooks on a pending value go on its real tensor.
_TAPED = {"register_hook", "retain_grad", "register_post_accumulate_grad_hook"}
_HANDLES = {"register_hook", "register_post_accumulate_grad_hook"}
# In-place dunders (their names do not end in ``_``) and setters: they write their first argument.
_WRITES = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
           "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "data:set", "grad:set"}
# In-place calls that change their tensor's metadata (shape, strides, grad flag): run on its meta shadow, kept.
_RESHAPES_IN_PLACE = {"resize_", "resize_as_", "unsqueeze_", "squeeze_", "t_", "transpose_", "as_strided_", "set_",
                      "swapdims_", "swapaxes_", "data:set"}
# Calls that hand a tensor's memory out where no version counter sees a write through it.
_EXPOSES = {"numpy", "__array__", "__dlpack__", "data_ptr", "untyped_storage", "storage", "_typed_storage", "data:get"}
# Calls that draw from a random generator (matched in their names): kept in the forward's order of draws.
_RANDOM = ("rand", "bernoulli", "dropout", "normal", "uniform", "exponential", "multinomial", "poisson", "cauchy",
           "geometric", "log_normal", "random_", "rrelu")
_GRAD_GETTERS = {"requires_grad:get", "is_leaf:get", "grad_fn:get"}
# Calls whose results never require grad, whatever their arguments.
_NO_GRAD = {"detach", "detach_", "data:get", "data:set", "requires_grad_"}
_DEVICE_GETTERS = {"device:get", "is_cpu:get", "is_cuda:get", "is_meta:get", "get_device"}


def _ctx() -> tuple:
    """What a call computes under besides its arguments: grad mode, inference mode, autocast (CPU and CUDA)."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"), torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))


@contextlib.contextmanager
def entered(ctx: tuple):
    """Run under ``ctx`` (``_ctx()``'s tuple), whatever the current state."""
    grad, inference, cpu, cpu_dtype, cuda, cuda_dtype = ctx
    with contextlib.ExitStack() as stack:
        if torch.is_inference_mode_enabled() != inference:
            stack.enter_context(torch.inference_mode(inference))
        stack.enter_context(torch.set_grad_enabled(grad))
        if (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) != (cpu, cpu_dtype):
            stack.enter_context(torch.autocast("cpu", dtype=cpu_dtype, enabled=cpu))
        if (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")) != (cuda, cuda_dtype):
            stack.enter_context(torch.autocast("cuda", dtype=cuda_dtype, enabled=cuda))
        yield


def user_line(block_name: str) -> str:
    """The innermost frame of the caller's code (not torch's, not autoep's runtime): ``file:line: `code```."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith((_TORCH, _AUTOEP_RUNTIME, "<")) or os.path.dirname(path) == _STDLIB
                or path.startswith(os.path.join(_STDLIB, "logging"))):
            code = linecache.getline(path, frame.f_lineno).strip()
            return f"{frame.f_code.co_name} ({os.path.basename(path)} line {frame.f_lineno}: `{code}`)"
        frame = frame.f_back
    return f"{block_name}.forward"


def _key(t: Tensor) -> int:
    """The storage a tensor reads and writes (a pending one: its shadow's), shared with its views."""
    try:
        return (t.shadow if type(t) is Pending else t).untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no storage (a sparse or nested tensor): itself
        return id(t)


@dataclass
class Entry:
    """A taped torch call (``func``; ``call`` for an expert call, recorded by ``Tape.expert_call``)."""

    func: object
    args: tuple
    kwargs: dict
    out: object  # the pending results (a structure), or the written tensor for an in-place call
    stage: int
    ctx: tuple
    writes: bool  # in place (or ``out=``): ``out`` already stands for its real tensor


@dataclass
class Call:
    """One expert call: the expert id, its input (real or pending; ``(..., D)``), the pending output and context."""

    expert: int
    x: Tensor
    out: Pending
    stage: int  # the stage of the input: the call travels in exchange ``stage + 1``
    ctx: tuple
    # the widths of the per-row tensors passed after the rows (``expert(x[tok], pos[tok])``), packed after them in
    # ``x``'s features (``replay._packed``); () for a call on the rows alone
    extras: tuple[int, ...] = ()

    def edited(self, tape: Tape) -> bool:
        """Whether a taped call writes the output in place (or a view of it)."""
        return _key(self.out) in tape.written


@dataclass
class Tape:
    """The calls a block's forward deferred, and how to run them (module docstring)."""

    block_name: str = field(repr=True)
    entries: list[Entry] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    pendings: list = field(default_factory=list)  # weak references to every pending object made
    written: dict = field(default_factory=dict)  # storage key -> the stage its last taped in-place write is available at
    touched: dict = field(default_factory=dict)  # storage key -> the latest stage a taped call reads or writes it
    versions: list = field(default_factory=list)  # (real tensor, its version counter when a taped call read it)
    read: set = field(default_factory=set)  # storage keys of the real tensors taped calls read
    keep: list = field(default_factory=list)  # the storages keyed above, alive until the tape goes (keys stay unique)
    shadows: dict = field(default_factory=dict)  # id(real tensor a taped call reshapes in place) -> its metadata
    grads: dict = field(default_factory=dict)  # id(real tensor a taped call writes) -> whether it will require grad
    real: dict = field(default_factory=dict)  # id(pending) -> its real tensor, as stages run
    failure: Exception | None = None
    meta_running: bool = False  # inside ``meta_run``: a Function applied there runs on the shadows as it is

    @property
    def stages(self) -> int:
        return max([e.stage for e in self.entries] + [c.stage + 1 for c in self.calls], default=0)

    # -- recording ------------------------------------------------------------------------------------------

    def deferred(self, t) -> bool:
        return isinstance(t, Tensor) and (type(t) is Pending or (bool(self.written) and _key(t) in self.written))

    def stage_of(self, t: Tensor) -> int:
        return self.written.get(_key(t), 0) if type(t) is not Pending else max(t.stage, self.written.get(_key(t), 0))

    def fail(self, message: str) -> ReplayError:
        error = ReplayError(f"{self.block_name}: {message} at {user_line(self.block_name)}")
        self.failure = self.failure or error
        return error

    def record(self, func, args: tuple, kwargs: dict, name: str = ""):
        """Tape ``func(*args, **kwargs)`` (some argument deferred) and answer its pending results."""
        name = name or _name(func)
        if func in _HOST or name in _HOST_NAMES:
            raise self.fail(f"{name} reads a pending expert output on the host before the exchange (its value "
                            "exists only after the block's forward returns); compute it from the block's output, or "
                            "opt out (an explicit local_compute_fn._target_)")
        tensors = _tensors((args, kwargs), [])
        device = next((t.device for t in tensors if t.device.type != "meta"), torch.device("cpu"))
        if name in _GRAD_GETTERS:
            return self.grad_query(name, args[0])
        if name in _DEVICE_GETTERS:  # the real device, not the shadow's
            with torch._C.DisableTorchFunction():
                return func(*[torch.empty(0, device=device) if isinstance(a, Tensor) else a for a in args], **kwargs)
        written = _written(name, args, kwargs)
        stage = max(self.stage_of(t) for t in tensors)
        for t in written:
            stage = max(stage, self.touched.get(_key(t), 0))
        # Autograd's rule: a floating result requires grad where grad mode is on and a floating argument does.
        grad = name not in _NO_GRAD and torch.is_grad_enabled() and any(
            (t.dtype.is_floating_point or t.dtype.is_complex) and self.needs_grad(t) for t in tensors)
        if name in _TAPED:  # a hook on the real tensor, registered when it exists
            if not self.needs_grad(args[0]):
                raise RuntimeError(f"cannot {name.replace('_', ' ')} on a tensor that doesn't require gradient")
            shadow = None
        elif written and name not in _RESHAPES_IN_PLACE:
            shadow = None  # in place, metadata kept: no meta run (the real call checks the arguments, as the model's)
        else:
            for t in written:  # a real tensor's metadata as the call leaves it (its shape) is kept
                if type(t) is not Pending:
                    self.shadows.setdefault(id(t), _shadow(t))
            shadow = self.meta_run(func, name, args, kwargs)
            if written and isinstance(shadow, Tensor) and type(written[0]) is Pending:
                written[0].shadow = shadow  # ``unsqueeze_`` and friends: the new shape
        if name == "requires_grad_":
            grad = bool(args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
        for t in written:
            self.set_grad(t, grad or (name != "requires_grad_" and self.needs_grad(t)))
        if not written and name not in _TAPED and not _tensors(shadow, []):
            return _pendings(shadow, device, stage, self, grad)  # metadata (shape, dtype): nothing to run
        if any(k in name for k in _RANDOM):  # draws in the forward's order (``Deferring`` refuses a later one)
            drawn = ("rng", _generator(kwargs, device))
            stage = max(stage, self.touched.get(drawn, 0))
            self.touched[drawn] = stage
        for t in tensors:
            key = _key(t)
            self.touched[key] = max(self.touched.get(key, 0), stage)
            if type(t) is not Pending and key not in self.written and not any(t is w for w in written):
                self.read_later(t)
        self.keep.extend(tensors)
        for t in written:
            self.written[_key(t)] = stage
        out = written[0] if written else _pendings(shadow, device, stage, self, grad)
        if name in _TAPED:
            out = _LateHandle() if name in _HANDLES else None
        self.entries.append(Entry(func, args, kwargs, out, stage, _ctx(), bool(written)))
        return None if name in ("__setitem__", "data:set", "grad:set") else out

    def draw_now(self, func, args: tuple, kwargs: dict) -> None:
        """A random draw the forward makes now: none of the taped calls may draw from its generator (they draw after
        the forward, so the model's order of draws would not be kept)."""
        device = next((t.device for t in _tensors((args, kwargs), [])), None) or torch.device(
            kwargs.get("device") or "cpu")
        if ("rng", _generator(kwargs, device)) in self.touched:
            raise self.fail(f"{_name(func)} draws from a random generator after a draw on an expert's output, which "
                            "autoep makes once the experts ran (after the forward): the draws would come in another "
                            "order than the model's; draw both before the expert calls, or opt out")

    def read_later(self, t: Tensor) -> None:
        """A taped call reads the real ``t`` when it runs (after the forward): it must then hold what it holds now
        (the model's call read it now, and autograd saves the tensor itself). A write into its storage before that
        raises: a torch call at once (``Deferring``), any other seen by its version counter (``check_unchanged``)."""
        self.read.add(_key(t))
        if not t.is_inference():  # an inference tensor has no version counter (its writes are torch calls)
            self.versions.append((t, t._version))

    def write_now(self, func, args: tuple, kwargs: dict) -> None:
        """A torch call the forward makes now: raises where it writes a storage a taped call reads later, or hands
        it out where no version counter sees writes (a numpy view, a data pointer)."""
        name = _name(func)
        targets = _written(name, args, kwargs)
        if name in _EXPOSES:
            targets = [a for a in args if isinstance(a, Tensor)]
        hit = next((t for t in targets if _key(t) in self.read), None)
        if hit is not None:
            raise self.fail(f"{name} writes (or exposes, to numpy or .data) a tensor of shape {tuple(hit.shape)} that an "
                            "expert or a computation on an expert's output reads; autoep runs those once the experts "
                            "ran (after the forward), so they would read the new values: write into a copy, or opt out")

    def shadow_of(self, t: Tensor) -> Tensor:
        """The metadata of ``t`` as the forward has made it so far (a real tensor a taped call reshapes in place
        keeps its own)."""
        if type(t) is Pending:
            return t.shadow
        return self.shadows.get(id(t)) if id(t) in self.shadows else _shadow(t)

    def needs_grad(self, t: Tensor) -> bool:
        """Whether ``t`` requires grad as the forward has made it so far (a real tensor a taped call writes from a
        tensor that requires grad will)."""
        return t.needs_grad if type(t) is Pending else self.grads.get(id(t), False) or t.requires_grad

    def set_grad(self, t: Tensor, grad: bool) -> None:
        if type(t) is Pending:
            t.needs_grad = grad
        else:
            self.grads[id(t)] = grad

    def grad_query(self, name: str, t: Tensor):
        """``requires_grad``, ``is_leaf``, ``grad_fn`` of a pending value (or a tensor a taped call writes), as
        autograd will answer them for the real one; its ``grad_fn`` exists only then."""
        grad = self.needs_grad(t)
        if name == "requires_grad:get":
            return grad
        changed = type(t) is Pending or grad != t.requires_grad
        if name == "is_leaf:get":
            return not grad if changed else t.is_leaf
        if grad and changed:
            raise self.fail(f"{name.partition(':')[0]} of a pending expert output is read before the exchange (its "
                            "autograd node exists only once the expert ran on its owner)")
        return None if changed else t.grad_fn

    def meta_run(self, func, name: str, args: tuple, kwargs: dict):
        """``func`` on the arguments' metadata: its results' shapes, dtypes and grad flags, nothing computed."""
        self.meta_running = True
        try:
            with torch._C.DisableTorchFunction():
                return func(*self._shadows(_masks_as_indices(name, args)), **self._shadows(kwargs))
        except Exception as exc:  # noqa: BLE001 - no meta kernel: its result depends on the values
            why = str(exc).split("\n")[0][:160]
            raise self.fail(f"{name} of a pending expert output cannot run before the exchange: its result depends "
                            f"on the values (a data-dependent shape such as nonzero/where on a mask, or a host read; "
                            f"meta: {why})") from None
        finally:
            self.meta_running = False

    def _shadows(self, value):
        if isinstance(value, Tensor):
            return self.shadow_of(value)
        if isinstance(value, torch.device):
            return torch.device("meta")
        if isinstance(value, (list, tuple)):
            items = [self._shadows(v) for v in value]
            return items if isinstance(value, list) else (type(value)(*items) if hasattr(value, "_fields")
                                                          else type(value)(items))
        if isinstance(value, dict):
            return {k: ("meta" if k == "device" and isinstance(v, str) else self._shadows(v)) for k, v in value.items()}
        if isinstance(value, str) and value.split(":")[0] in ("cpu", "cuda", "xpu", "mps", "hpu"):
            return "meta"
        return value

    def expert_call(self, e: int, x: Tensor, shadow: Tensor, device: torch.device, grad: bool,
                    extras: tuple[int, ...] = ()) -> Pending:
        """Tape a call of expert ``e`` on ``x`` (its output's metadata: ``shadow``; ``grad``: whether it requires
        grad; ``extras``: ``Call.extras``) and answer its pending output."""
        with torch._C.DisableTorchFunction():  # called inside ``Deferring``: these reads are the tape's own
            return self._expert_call(e, x, shadow, device, grad, extras)

    def _expert_call(self, e: int, x: Tensor, shadow: Tensor, device: torch.device, grad: bool,
                     extras: tuple[int, ...] = ()) -> Pending:
        stage = self.stage_of(x)
        key = _key(x)
        self.touched[key] = max(self.touched.get(key, 0), stage + 1)  # read at the exchange after ``stage``
        if type(x) is not Pending and key not in self.written:
            self.read_later(x)
        self.keep.append(x)
        out = Pending(shadow, device, stage + 1, grad)
        self.pendings.append(weakref.ref(out))
        self.calls.append(Call(e, x, out, stage, _ctx(), extras))
        return out

    # -- running --------------------------------------------------------------------------------------------

    def check_unchanged(self) -> None:
        """Every real tensor a taped call reads is as it was when the call was taped (no immediate write since)."""
        for t, version in self.versions:
            if t._version != version:
                raise ReplayError(f"{self.block_name}.forward wrote in place into a tensor (shape "
                                    f"{tuple(t.shape)}) after passing it to an expert or to a computation on an "
                                    "expert's output; autoep computes those after the forward returns, so they would "
                                    "read the new values: write into a copy (x = x.clone()) or opt out")

    def value(self, t):
        if type(t) is Pending:
            return self.real[id(t)]
        return t

    def answer(self, call: Call, out: Tensor) -> None:
        self.real[id(call.out)] = out

    def run(self, stage: int) -> None:
        """Run the taped calls of ``stage`` in the forward's order, each under its context."""
        for entry in self.entries:
            if entry.stage != stage:
                continue
            args, kwargs = _substituted(entry.args, self), _substituted(entry.kwargs, self)
            with entered(entry.ctx) if entry.ctx != _ctx() else contextlib.nullcontext():
                result = entry.func(*args, **kwargs)
            if isinstance(entry.out, _LateHandle):
                entry.out.bind(result)
            elif not entry.writes and (type(entry.out) is Pending or isinstance(entry.out, (list, tuple))):
                _bind(entry.out, result, self)

    def settle(self) -> None:
        """Every pending object still held (the block's output, what it kept in attributes, lists, hook stores)
        becomes its real tensor (``swap_tensors`` with an alias of it). The tape's own references go first, so only
        those objects are left. (While the tape held every pending object, no two had one id: ``real``'s keys are
        theirs.)"""
        self.entries.clear(), self.calls.clear(), self.keep.clear(), self.versions.clear(), self.shadows.clear()
        self.grads.clear(), self.read.clear()
        held = [(pending, self.real.get(id(pending))) for pending in (ref() for ref in self.pendings)
                if pending is not None]
        self.pendings.clear()  # the weak references go: swap_tensors refuses a tensor that has one
        self.real.clear()
        for pending, real in held:
            if real is not None:
                # An alias, never the tensor itself: its Python object may be held elsewhere (the block's own
                # tensor returned as it is by ``x.to(x.dtype)``, a saved-tensors hook's holder), and would become
                # the pending one.
                torch.utils.swap_tensors(pending, real.view_as(real))

class _LateHandle:
    """The handle a tensor hook registered on a pending value answers; ``remove()`` works before or after it ran."""

    def __init__(self):
        self.handle, self.removed = None, False

    def bind(self, handle) -> None:
        self.handle = handle
        if self.removed:
            handle.remove()

    def remove(self) -> None:
        self.removed = True
        if self.handle is not None:
            self.handle.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


class Deferring(TorchFunctionMode):
    """Within: torch calls on pending values (or on storages a taped call writes) go on ``tape``, and so does a
    custom ``torch.autograd.Function``'s ``apply`` on them (no torch-function mode sees it: its forward's ops would
    be taped one by one and its own backward lost), as one call run later with the real values."""

    def __init__(self, tape: Tape):
        super().__init__()
        self.tape = tape

    def __enter__(self):
        tape, apply = self.tape, _FUNCTION_APPLY.__func__

        def deferring_apply(cls, *args, **kwargs):
            # Not inside a meta run (its arguments are shadows), nor outside the forward's own calls.
            if not tape.meta_running and any(tape.deferred(t) for t in _tensors((args, kwargs), [])):
                return tape.record(functools.partial(apply, cls), args, kwargs, name=f"{cls.__name__}.apply")
            return apply(cls, *args, **kwargs)

        torch.autograd.Function.apply = classmethod(deferring_apply)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.autograd.Function.apply = _FUNCTION_APPLY
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        deferred = self.tape.deferred
        if any(deferred(a) for a in args) or any(deferred(a) for a in kwargs.values()) or _nested(args, deferred):
            return self.tape.record(func, args, kwargs)
        if self.tape.touched:  # once a call is taped: what the forward does now may not reach what it reads
            self.tape.write_now(func, args, kwargs)
            if any(k in _name(func) for k in _RANDOM):
                self.tape.draw_now(func, args, kwargs)
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------


def _nested(args: tuple, deferred) -> bool:
    """A deferred tensor inside a list or tuple argument (``torch.cat([...])``, ``torch.stack``)."""
    for a in args:
        if isinstance(a, (list, tuple)) and any(deferred(t) for t in _tensors(a, [])):
            return True
    return False


def _tensors(value, out: list) -> list:
    if isinstance(value, Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, out)
    return out


def _generator(kwargs: dict, device: torch.device):
    """The generator a random call draws from: its ``generator=``, or the device's default one."""
    return kwargs.get("generator") or ("default", device.type, device.index)


def _name(func) -> str:
    """``add_``, ``__setitem__``; a property's getter or setter as ``data:get`` / ``data:set``."""
    name = getattr(func, "__name__", "") or repr(func)
    if name in ("__get__", "__set__"):
        return f"{getattr(getattr(func, '__self__', None), '__name__', '?')}:{name[2:5]}"
    return name


def _written(name: str, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors a call writes: an in-place method's self, an ``out=`` tensor, a setter's object."""
    written = []
    if (name.endswith("_") and not name.startswith("__")) or name in _WRITES:
        if args and isinstance(args[0], Tensor):
            written.append(args[0])
    out = kwargs.get("out")
    written += _tensors(out, []) if out is not None else []
    return written


def _masks_as_indices(name: str, args: tuple) -> tuple:
    """For the meta run of an indexing call: a real boolean mask in the index as the index tensors it selects
    (``mask.nonzero(as_tuple=True)``), whose lengths meta cannot know. The real call later takes the mask itself."""
    if name not in ("__getitem__", "__setitem__", "index_put_", "index_put") or len(args) < 2:
        return args
    index = args[1]
    items = list(index) if isinstance(index, (tuple, list)) else [index]
    if not any(isinstance(i, Tensor) and type(i) is not Pending and i.dtype == torch.bool for i in items):
        return args
    expanded = []
    for i in items:
        if isinstance(i, Tensor) and type(i) is not Pending and i.dtype == torch.bool:
            with torch._C.DisableTorchFunction():
                # NOTE: syncs the host once, as the model's own indexing with this mask does.
                expanded += list(i.nonzero(as_tuple=True))
        else:
            expanded.append(i)
    index = expanded if isinstance(index, list) else tuple(expanded)
    return (args[0], index, *args[2:])


def _shadow(t: Tensor) -> Tensor:
    """A real tensor's metadata, without its grad flag (no autograd runs on meta)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _pendings(shadow, device: torch.device, stage: int, tape: Tape, grad: bool):
    if isinstance(shadow, Tensor):
        pending = Pending(shadow, device, stage, grad and (shadow.dtype.is_floating_point or shadow.dtype.is_complex))
        tape.pendings.append(weakref.ref(pending))
        return pending
    if isinstance(shadow, (list, tuple)):
        items = [_pendings(s, device, stage, tape, grad) for s in shadow]
        return items if isinstance(shadow, list) else (type(shadow)(*items) if hasattr(shadow, "_fields")
                                                       else type(shadow)(items))
    if isinstance(shadow, torch.device) and shadow.type == "meta":
        return device
    return shadow


def _substituted(value, tape: Tape):
    if type(value) is Pending:
        return tape.real[id(value)]
    if isinstance(value, (list, tuple)):
        items = [_substituted(v, tape) for v in value]
        return items if isinstance(value, list) else (type(value)(*items) if hasattr(value, "_fields")
                                                      else type(value)(items))
    if isinstance(value, dict):
        return {k: _substituted(v, tape) for k, v in value.items()}
    return value


def _bind(pending, real, tape: Tape) -> None:
    if type(pending) is Pending:
        tape.real[id(pending)] = real
    elif isinstance(pending, (list, tuple)) and isinstance(real, (list, tuple)):
        for p, r in zip(pending, real):
            _bind(p, r, tape)
