"""The ``meta`` stand-in of a tensor of a module expert another ep rank owns
(``autoep.runtime.recipes.local_experts``): shapes and dtypes as the expert's own, no values.

User code runs on every rank, so an expression naming an expert runs where its values are not. A stand-in
keeps that meaningful instead of failing inside torch ("Cannot copy out of meta tensor"):
- a write into a stand-in (``experts[2].w.copy_(...)``, ``nn.init.normal_(experts[2].w)``) does nothing here:
  the rank owning the expert runs the same line on the real tensor;
- reading a stand-in into a tensor with values (``experts[1].w.copy_(experts[2].w)`` where this rank owns
  expert 1 but not expert 2, ``local + remote``) raises ``RemoteExpertRead``, naming the expert and the rank
  that owns it, before anything is changed;
- ops among stand-ins (shapes, dtypes, meta arithmetic) run as on any meta tensor;
- a random draw on a stand-in (``nn.init.normal_(experts[2].w)``, ``w.uniform_()``, ``torch.randn_like(w)``, every
  ``nn.init`` function) draws what the model's tensor draws, on a temporary zero tensor of the stand-in's shape and
  dtype on its *home* (the device the model's tensor is on: where it was at apply, moved by ``.to``/``to_empty``),
  so the random stream, and every tensor drawn after it on this rank (the local experts', the dense layers'), is the
  model's. An init loop over ``model.parameters()`` is then exact on every layout without going through
  ``model.apply`` (``autoep.runtime.reinit``). A draw whose count depends on the values (``multinomial``,
  ``poisson``) reads the stand-in: it raises ``RemoteExpertRead``.
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

# Calls that draw from a random generator, matched in their names (``deferred._RANDOM``'s words, and ``nn.init``'s
# functions that dispatch on the tensor's type themselves); those whose draw count depends on the values apart.
_DRAWS = ("rand", "bernoulli", "dropout", "normal", "uniform", "exponential", "cauchy", "geometric", "log_normal",
          "random_", "rrelu", "kaiming", "xavier", "orthogonal")
_DRAWS_BY_VALUE = ("multinomial", "poisson", "gamma", "binomial", "dirichlet")


def _skipping_meta() -> dict:
    """``nn.init``'s functions that return at once on a meta tensor (``if tensor.is_meta: return tensor``, before
    any draw), by code object: a stand-in's ``is_meta`` read from one of them first draws what that function draws
    on the model's tensor (``trunc_normal_`` rejection-samples: its count of draws depends on the values drawn, which
    a temporary of the same shape reproduces)."""
    from torch.nn import init

    found = (getattr(init, n, None) for n in ("_no_grad_trunc_normal_", "orthogonal_", "sparse_"))
    return {f.__code__: f for f in found if callable(f)}


_SKIPPING_META = _skipping_meta()  # at import: torch's own functions (transformers swaps them only inside its init)
_IS_META = Tensor.is_meta.__get__
_IN_PLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                     "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__"}


class RemoteExpertRead(RuntimeError):
    """A tensor of an expert another ep rank owns was read into a tensor with values on this rank."""


@dataclass(frozen=True)
class RemoteExpert:
    """Which expert a stand-in stands for: its block's class, its id, the ep rank owning it, this ep rank."""

    block: str
    expert: int
    owner: int
    rank: int


class RemoteExpertTensor(Tensor):
    """A ``meta`` tensor standing in for a remote expert's tensor (module docstring); ``remote`` says whose."""

    remote: RemoteExpert | None = None
    home: torch.device | None = None  # the device the model's tensor is on (module docstring)

    def __deepcopy__(self, memo):
        if id(self) not in memo:  # no values to copy: a new stand-in of the same expert
            memo[id(self)] = stand_in(self, self.dtype, self.remote, parameter=isinstance(self, torch.nn.Parameter))
        return memo[id(self)]

    def __reduce_ex__(self, proto):
        # Pickled as what it is without values, a plain meta tensor (a frozen Parameter where it is one): a
        # state_dict holding stand-ins loads anywhere, weights_only=True included, without autoep's class.
        with torch._C.DisableTorchFunctionSubclass():
            plain = torch.empty(self.shape, dtype=self.dtype, device="meta")
        if isinstance(self, torch.nn.Parameter):
            plain = torch.nn.Parameter(plain, requires_grad=False)
        return plain.__reduce_ex__(proto)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _IS_META and sys._getframe(1).f_code in _SKIPPING_META:
            _draw_skipped(sys._getframe(1), args[0])
        with torch._C.DisableTorchFunctionSubclass():  # plain attribute reads below, no recursion
            tensors = _operands(args, kwargs)
            valued = any(not t.is_meta for t in tensors)
            dest = args[0] if args and _in_place(func) and isinstance(args[0], Tensor) else None
            source = next((t for t in tensors if isinstance(t, RemoteExpertTensor)), None)
            name = getattr(func, "__name__", "")
            name = "" if name.startswith("__") else name  # ``__rand__`` is no draw
            if source is not None and any(k in name for k in _DRAWS_BY_VALUE):
                raise RemoteExpertRead(_message(source.remote, name))
            if source is not None and any(k in name for k in _DRAWS):
                _draw_as_the_model(func, args, kwargs)
        if valued and isinstance(dest, RemoteExpertTensor):
            return dest  # the owner writes the real tensor; nothing to do here
        if valued:
            read = next((t for t in tensors if isinstance(t, RemoteExpertTensor) and t is not dest), None)
            if read is not None:
                raise RemoteExpertRead(_message(read.remote, getattr(func, "__name__", str(func))))
        return _inherit(super().__torch_function__(func, types, args, kwargs), source)


def _draw_as_the_model(func, args, kwargs) -> None:
    """``func`` on real zero tensors in place of the stand-ins among its arguments (their shape and dtype, on their
    home): it draws from the generator exactly what it draws on the model's tensors. The values are dropped."""
    def real(t):
        if isinstance(t, (list, tuple)):
            return type(t)(real(x) for x in t)
        if not isinstance(t, RemoteExpertTensor):
            return t
        if t.home is None:
            raise RemoteExpertRead(f"{getattr(func, '__name__', func)} draws random values for a tensor of an expert "
                                   f"another ep rank owns whose device is unknown here (a stand-in not made by "
                                   f"autoep's placement); initialise the model before apply_plan")
        return torch.zeros(t.shape, dtype=t.dtype, device=t.home)

    with torch._C.DisableTorchFunctionSubclass():
        func(*real(tuple(args)), **{k: real(v) for k, v in kwargs.items()})


def _draw_skipped(frame, t: "RemoteExpertTensor") -> None:
    """The ``nn.init`` function running in ``frame`` (``_SKIPPING_META``) on a real zero tensor in place of the
    stand-in ``t``, with the arguments it was called with: its draws, the model's."""
    fn = _SKIPPING_META[frame.f_code]
    params = list(inspect.signature(fn).parameters)
    given = {n: frame.f_locals[n] for n in params[1:] if n in frame.f_locals}
    with torch._C.DisableTorchFunctionSubclass():
        _draw_as_the_model(lambda temp: fn(temp, **given), (t,), {})


def _inherit(out, source):
    """A stand-in computed from another (``w.data``, ``w.view(...)``, ``w.new_empty(...)``) stands for the same
    expert on the same home: its reads name the expert, its draws draw on that device."""
    if source is not None:
        for t in (out if isinstance(out, (list, tuple)) else (out,)):
            if isinstance(t, RemoteExpertTensor) and t.home is None:
                t.remote, t.home = source.remote, source.home
    return out


def _operands(args, kwargs) -> list[Tensor]:
    """The tensors an op reads: its tensor arguments and those in list/tuple arguments (``torch.cat``, foreach
    ops), not the contents of other containers (``__deepcopy__``'s memo)."""
    found = []
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, Tensor):
                found.append(t)
    return found


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))


def _message(remote: RemoteExpert | None, op: str) -> str:
    if remote is None:
        return (f"{op} reads a tensor of an expert another ep rank owns (a meta stand-in here); run it on the rank "
                "owning that expert")
    return (f"{op} reads expert {remote.expert} of {remote.block}, which ep rank {remote.owner} owns; this rank (ep "
            f"rank {remote.rank}) holds only a meta stand-in of it, so its values cannot be read here. Copy between "
            f"experts on the rank owning both, or gather them first (autoep.runtime.state.full_model_state, "
            f"ExpertParallel.state_dict)")


def stand_in(like: Tensor, dtype: torch.dtype, remote: RemoteExpert | None, *, parameter: bool,
             home: torch.device | None = None, requires_grad: bool = False) -> Tensor:
    """A stand-in of ``like``'s shape in ``dtype`` (an ``nn.Parameter`` where ``parameter``, frozen unless
    ``requires_grad``), standing for a tensor on ``home`` (default: ``like``'s home, or its device)."""
    t = torch.empty(like.shape, dtype=dtype, device="meta").as_subclass(RemoteExpertTensor)
    if parameter:
        t = torch.nn.Parameter(t, requires_grad=requires_grad)
    t.remote = remote
    t.home = home if home is not None else home_of(like)
    return t


def home_of(t: Tensor) -> torch.device:
    """The device the model's tensor is on: a stand-in's home, any other tensor's device."""
    home = t.home if isinstance(t, RemoteExpertTensor) else None
    return home if home is not None else t.device
