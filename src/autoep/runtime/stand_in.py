"""The ``meta`` stand-in of a tensor of a module expert another ep rank owns
(``autoep.runtime.recipes.local_experts``): shapes and dtypes as the expert's own, no values.

User code runs on every rank, so an expression naming an expert runs where its values are not. A stand-in
keeps that meaningful instead of failing inside torch ("Cannot copy out of meta tensor"):
- a write into a stand-in (``experts[2].w.copy_(...)``, ``nn.init.normal_(experts[2].w)``) does nothing here:
  the rank owning the expert runs the same line on the real tensor;
- reading a stand-in into a tensor with values (``experts[1].w.copy_(experts[2].w)`` where this rank owns
  expert 1 but not expert 2, ``local + remote``) raises ``RemoteExpertRead``, naming the expert and the rank
  that owns it, before anything is changed;
- ops among stand-ins (shapes, dtypes, meta arithmetic) run as on any meta tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

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
        with torch._C.DisableTorchFunctionSubclass():  # plain attribute reads below, no recursion
            tensors = _operands(args, kwargs)
            valued = any(not t.is_meta for t in tensors)
            dest = args[0] if args and _in_place(func) and isinstance(args[0], Tensor) else None
        if valued and isinstance(dest, RemoteExpertTensor):
            return dest  # the owner writes the real tensor; nothing to do here
        if valued:
            read = next((t for t in tensors if isinstance(t, RemoteExpertTensor) and t is not dest), None)
            if read is not None:
                raise RemoteExpertRead(_message(read.remote, getattr(func, "__name__", str(func))))
        return super().__torch_function__(func, types, args, kwargs)


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


def stand_in(like: Tensor, dtype: torch.dtype, remote: RemoteExpert | None, *, parameter: bool) -> Tensor:
    """A stand-in of ``like``'s shape in ``dtype`` (a frozen ``nn.Parameter`` where ``parameter``)."""
    t = torch.empty(like.shape, dtype=dtype, device="meta").as_subclass(RemoteExpertTensor)
    if parameter:
        t = torch.nn.Parameter(t, requires_grad=False)
    t.remote = remote
    return t
