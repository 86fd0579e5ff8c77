"""What an EP-ready module holds besides its tensors, kept meaningful through ``copy.deepcopy`` (EMA,
``torch.optim.swa_utils.AveragedModel``) and pickling (``torch.save(model)`` / ``torch.load``).

- The ep process group. A deep copy shares it: the copy runs on the same rank, in the same group, and
  computes what the original computes. A pickle holds the group's name, its global ranks and the saving
  rank (as ``DeviceMesh`` pickles its groups by name); ``torch.load`` finds the group of that name in the
  loading process and checks it is the same group seen from the same rank (each rank's pickle holds that
  rank's experts only), else raises ``CheckpointError`` naming the fix.
- Values fixed at apply (``AppliedSpec``: the frozen records the recipes' forwards read): shared by a deep
  copy, pickled with their group as above.
- ``InstanceMethod``: a function bound to one module as an instance attribute (a recipe's replaced
  ``forward``, a block method recompiled with its expert loop spliced out, a remote expert's ``_apply``).
  ``types.MethodType`` pickles as ``getattr(module, name)``, which at load time finds the class's own
  method and silently undoes the binding; this one pickles its function by reference, or rebuilds a
  function compiled at apply from what compiled it.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import torch.distributed as dist

from autoep.errors import CheckpointError

_FIX = ("torch.load an EP model in the rank that saved it, in a run that created the same process groups; to move "
        "weights between runs or ep sizes use model.state_dict() / ExpertParallel.save and load them into a model "
        "made expert-parallel in this run")


class GroupRef:
    """The pickled form of a process group (see module docstring)."""

    def __init__(self, name: str, ranks: tuple[int, ...], rank: int):
        self.name, self.ranks, self.rank = name, ranks, rank

    @classmethod
    def of(cls, group) -> GroupRef:
        return cls(group.group_name, tuple(dist.get_process_group_ranks(group)), dist.get_rank())

    def resolve(self):
        """The live group this names, seen from the rank that saved it; ``CheckpointError`` otherwise."""
        where = f"ep process group {self.name!r} over global ranks {list(self.ranks)}, saved by global rank {self.rank}"
        if not (dist.is_available() and dist.is_initialized()):
            raise CheckpointError(f"this expert-parallel model holds the {where}, but torch.distributed is not "
                                  f"initialized here; {_FIX}")
        try:
            from torch._C._distributed_c10d import _resolve_process_group

            group = _resolve_process_group(self.name)
        except Exception:  # noqa: BLE001 - no group of that name in this process
            group = None
        if group is None or tuple(dist.get_process_group_ranks(group)) != self.ranks or dist.get_rank() != self.rank:
            raise CheckpointError(f"this expert-parallel model holds the {where}; this process is global rank "
                                  f"{dist.get_rank()} and holds no such group as that rank; {_FIX}")
        return group


def _portable(value):
    return GroupRef.of(value) if isinstance(value, dist.ProcessGroup) else value


def _live(value):
    return value.resolve() if isinstance(value, GroupRef) else value


class Shared:
    """A value that copies of a module share (a deep copy gets this very object); pickled with its process
    group by reference (module docstring)."""

    def __init__(self, value):
        self.value = value

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return _shared, (_portable(self.value),)


def _shared(value) -> Shared:
    return Shared(_live(value))


class AppliedSpec:
    """Base of the frozen dataclasses a recipe fixes at apply: a deep copy of the module shares the record, a
    pickle holds its fields with the process group by reference. Fields hold plain values, never the module's
    own submodules or bound methods (a copy must compute with its own)."""

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        values = {f.name: _portable(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return _applied_spec, (type(self), values)


def _applied_spec(cls, values: dict):
    return cls(**{k: _live(v) for k, v in values.items()})


class InstanceMethod:
    """``fn`` bound to ``module`` as an instance attribute: ``m.attr(*a)`` is ``fn(m, *a)``. A deep copy binds
    the same ``fn`` to the copy; a pickle refers to ``fn`` by its qualified name, or, where ``fn`` was compiled
    at apply, holds ``rebuild = (callable, args)`` and calls it at load time to compile it again."""

    def __init__(self, module, fn: Callable, rebuild: tuple | None = None):
        self.module, self.fn, self.rebuild = module, fn, rebuild

    def __call__(self, *args, **kwargs):
        return self.fn(self.module, *args, **kwargs)

    def __deepcopy__(self, memo):
        return type(self)(copy.deepcopy(self.module, memo), self.fn, self.rebuild)

    def __reduce__(self):
        if self.rebuild is None:
            return type(self), (self.module, self.fn)
        make, args = self.rebuild
        return _rebuilt, (type(self), self.module, make, tuple(_portable(a) for a in args))


def _rebuilt(cls, module, make: Callable, args: tuple) -> InstanceMethod:
    live = tuple(_live(a) for a in args)
    return cls(module, make(*live), (make, live))
