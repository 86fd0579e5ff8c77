"""Compute-fn factories named by the archetype table (``autoep.plan.archetypes.TABLE``).

Every factory follows one contract (see ``autoep.plan.archetypes``)::

    factory(module: nn.Module, *, ep_mesh: DeviceMesh | None, **kwargs) -> None

It is called once per matched block by ``autoep.runtime.apply.apply_plan`` after the block's expert
parameters have become ``Shard(0)`` DTensors over ``ep_mesh`` (the 1-D ``ep`` mesh; ``None`` runs
without exchange). It makes the block EP-ready in place and returns nothing. ``kwargs`` are the keys
written next to ``_target_`` in the resolved config (for auto decisions ``structure``, the
``MoeStructure`` as a dict).

- ``batched.ep_batched_experts``: v5-style blocks; keeps the block forward, replaces the experts'.
- ``module_list.ep_module_list_block``: v4-style blocks; runs the block's own forward with only its
  proven expert loop spliced out and replaced by the exchange.
- ``grouped.ep_grouped_experts``: blocks calling ``experts(x_sorted, num_tokens_per_expert)``; keeps the
  block forward, replaces the experts' (each group's rows go to the rank owning that expert).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import marshal
from dataclasses import dataclass
from typing import Callable, TypeVar

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from autoep.detect.names import AttrFact, facts_under, holds, instance_attr, recording
from autoep.detect.row_local import folded_drift
from autoep.detect.source import Refusal
from autoep.detect.structure import MoeStructure
from autoep.errors import FactChanged, UnsupportedModuleStructure
from autoep.runtime import adapters
from autoep.runtime.apply import mark_unsharded, shard_expert_tensor, slice_full_on_load
from autoep.runtime.dispatch import join_exchanges, open_exchanges
from autoep.runtime.reinit import install_sharded_apply
from autoep.runtime.shared import InstanceMethod

Proof = TypeVar("Proof")


def local_tensor(t: Tensor) -> Tensor:
    """This rank's shard of an expert parameter (a ``Shard(0)`` DTensor), differentiably; plain tensors pass."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def ep_group_of(ep_mesh):
    """The process group of the 1-D ``ep`` mesh, or ``None`` (no exchange) for no mesh."""
    return None if ep_mesh is None else ep_mesh.get_group()


def as_structure(structure: dict | MoeStructure) -> MoeStructure:
    """The ``structure`` kwarg of a factory (a dict when it comes from YAML) as a ``MoeStructure``."""
    return structure if isinstance(structure, MoeStructure) else MoeStructure(**structure)


def experts_of(block: nn.Module, structure: dict | MoeStructure) -> nn.Module:
    """The block's experts (container or batched-experts module) at the path the detector proved
    (``MoeStructure.experts_path``); runtime code never reads ``block.experts`` by name."""
    return block.get_submodule(as_structure(structure).experts_path)


def proven_experts(module: nn.Module, structure: dict | MoeStructure, prove: Callable[[nn.Module], Proof], *,
                   recipe: str, needs: str, facts_of: Callable[[Proof], dict] = lambda proof: proof.facts) -> Proof:
    """What every experts-module recipe's ``validate`` checks (an explicit ``_target_`` included): ``module``
    has an experts module with a forward of its own, ``prove`` proves that forward (any failure inside the
    proof is a refusal, as in the detector), and the layout facts it proves are the ones ``structure`` gives.
    Returns the proof; raises ``UnsupportedModuleStructure`` naming the class and what failed."""
    facts, name = as_structure(structure), type(module).__name__
    experts = getattr(module, "experts", None)
    if not isinstance(experts, nn.Module) or isinstance(experts, nn.ModuleList):
        raise UnsupportedModuleStructure(name, f"the {recipe} recipe needs {needs}")
    if type(experts).forward is nn.Module.forward:  # e.g. a ModuleDict
        raise UnsupportedModuleStructure(name, f"experts is a {type(experts).__name__} with no forward of its own")
    try:
        proof = prove(experts)
    except Refusal as exc:
        raise UnsupportedModuleStructure(name, str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - any failure inside a proof is a refusal, as in the detector
        raise UnsupportedModuleStructure(name, f"the proof could not follow the source ({type(exc).__name__}: "
                                               f"{str(exc)[:120]})") from None
    proven = facts_of(proof)
    given = {k: getattr(facts, k) for k in proven}
    if given != proven:
        raise UnsupportedModuleStructure(name, f"structure says {given} but the experts compute {proven}")
    _block_flags(module, facts)
    return proof


def _block_flags(block: nn.Module, facts: MoeStructure) -> None:
    """The block's flags its experts call runs under, folded ``True`` by the detector (``MoeStructure.folded``
    entries ``<flag>=True``): still ``True``, and read as facts (``watching_facts`` checks them per call)."""
    for entry in facts.folded:
        flag, _, value = entry.partition("=")
        if "." in flag or value != "True":
            continue  # an expert's constant (``<experts_path>.<e>.<attr>``): its recipe checks those
        try:
            value = instance_attr(block, flag, type(block).__name__)
        except Refusal as exc:  # e.g. the flag became a property
            raise UnsupportedModuleStructure(type(block).__name__, str(exc)) from None
        if value is not True:
            raise UnsupportedModuleStructure(type(block).__name__, f"self.{flag} was True when the plan was made "
                                             f"(its experts call runs under `if self.{flag}:`) and is "
                                             f"{getattr(block, flag, None)!r} now; set it back or plan again")


@contextlib.contextmanager
def watching_facts(block: nn.Module):
    """Around a recipe's ``validate``: every value its proofs fold (``names.recording``: a plain number of
    ``block`` or its submodules, a global, a module's or a class's attribute, a dropout probability) is checked
    again before each call of ``block`` (``check_proven``: a forward pre-hook, and again where the recipe's
    replaced code runs, after every user hook: ``checking_proven``, ``watching_under``); a value changed since
    apply raises ``FactChanged``, naming it, instead of running a plan proven for the old one."""
    with recording() as reads:
        yield
    block._autoep_facts = facts_under(block, reads)
    if block._autoep_facts and not getattr(block, "_autoep_watching", False):
        block._autoep_watching = True
        block.register_forward_pre_hook(_check_proven_hook)


def watching_folded(block: nn.Module, folded) -> None:
    """Before each call of ``block``: every constant the expert proofs folded (``MoeStructure.folded``, e.g. an
    expert's ``dropout.training=False`` proven in eval, its ``dropout.p=0.0``, NLLB's ``moe_token_dropout=0.0``)
    still holds. A change raises ``FactChanged``, naming it, instead of running a plan proven for the old value
    (``model.train()`` after a plan made in eval would turn on a dropout the proof found idle, drawing other
    numbers than the model's own loop)."""
    block._autoep_folded = tuple(folded)
    if block._autoep_folded and not getattr(block, "_autoep_watching", False):
        block._autoep_watching = True
        block.register_forward_pre_hook(_check_proven_hook)


def watching_under(block: nn.Module, path: str) -> None:
    """At each call of the experts at ``path`` whose forward a recipe replaced (``bind_experts_forward``), after
    every user hook: what ``watching_facts`` and ``watching_folded`` watch on ``block`` that lies under them, and
    the globals and class attributes. (A user's pre-hook registered after apply runs after the block's check.)"""
    experts, prefix = block.get_submodule(path), path + "."
    facts = []
    for fact in getattr(block, "_autoep_facts", ()):
        if not isinstance(fact, AttrFact):
            facts.append(fact)
        elif fact.path == path or fact.path.startswith(prefix):
            facts.append(AttrFact(fact.path[len(prefix):], fact.name, fact.value))
    experts._autoep_facts = tuple(facts)
    experts._autoep_folded = tuple(e[len(prefix):] for e in getattr(block, "_autoep_folded", ()) if e.startswith(prefix))
    adapters.follow(block, path)  # a PEFT chain put around these experts later (``autoep.runtime.adapters``)


@dataclass(frozen=True)
class ProvenExperts:
    """The expert modules a block's proofs saw at apply (``watching_experts``): plain values, so a deep copy or a
    pickle of the block checks its own experts."""

    path: str  # the experts container, under the block
    keys: tuple[str, ...]  # each expert's key in the container (``2``, ``expert_0``)
    names: tuple[str, ...]  # how the model names each expert (``experts[2]``)
    kinds: tuple[tuple, ...]  # per expert, ``module_kinds``


def module_kinds(expert: nn.Module) -> tuple:
    """An expert's modules as a proof sees them: each one's path, class and whether a ``forward`` is set on the
    instance (which ``nn.Module.__call__`` would run instead of the class's)."""
    return tuple((name, type(m), "forward" in m.__dict__) for name, m in expert.named_modules())


def watching_experts(block: nn.Module, path: str, keys: tuple[str, ...], names: tuple[str, ...]) -> None:
    """At each call of ``block`` (``check_proven``, once per call, where the recipe's code reaches its experts):
    the experts at ``path`` under the container ``keys`` are still the modules its proofs saw at apply, of the
    same classes, none with a ``forward`` set on the instance. A module replaced by one of another class (an
    expert, or a submodule of one) or such a ``forward`` raises ``FactChanged`` naming the expert, instead of
    running a plan proven for other code (a recipe that calls the experts' class forward would drop the
    instance's silently)."""
    container = block.get_submodule(path)
    kinds = tuple(module_kinds(_entry(container, k)) for k in keys)
    block._autoep_proven_experts = ProvenExperts(path, tuple(keys), tuple(names), kinds)


def _check_experts(block: nn.Module, proven: ProvenExperts) -> None:
    container = block.get_submodule(proven.path)
    for key, name, kinds in zip(proven.keys, proven.names, proven.kinds):
        expert = _entry(container, key)
        now = module_kinds(expert) if expert is not None else ()
        if now != kinds:
            raise FactChanged(f"{type(block).__name__}: {_kinds_change(name, kinds, now)} after apply_plan; the "
                              "expert-parallel plan was proven for the expert's modules as they were (their classes' "
                              "code, each run by its class forward): set it back, or apply the plan again to a fresh "
                              "model built with the new modules")


def _entry(container: nn.Module, key: str) -> nn.Module | None:
    """The container's entry ``key``, or the module at a dotted path under it (``lora_A.0``); None where gone."""
    module = container
    for part in key.split("."):
        module = module._modules.get(part) if isinstance(module, nn.Module) else None
    return module


def _kinds_change(name: str, then: tuple, now: tuple) -> str:
    """The first difference between an expert's ``module_kinds`` at apply and now, in words."""
    if not now:
        return f"{name} was removed"
    before = {path: (cls, own) for path, cls, own in then}
    for path, cls, own in now:
        where = f"{name}.{path}" if path else name
        if path not in before:
            return f"{where} ({cls.__name__}) was added"
        if before[path][0] is not cls:
            return f"{where} was replaced by a {cls.__name__} (proven: a {before[path][0].__name__})"
        if own and not before[path][1]:
            return f"{where} got a forward set on its instance"
        if before[path][1] and not own:
            return f"{where} lost the forward set on its instance"
    gone = next((path for path, _, _ in then if path not in {p for p, _, _ in now}), None)
    return f"{name}.{gone} was removed" if gone is not None else f"{name}'s modules were reordered"


def check_proven(module: nn.Module) -> None:
    """Raise ``FactChanged`` where a value the proofs of ``module`` (a block, or experts whose forward a recipe
    replaced) folded at apply has changed: ``watching_facts``' facts, ``watching_folded``'s constants and
    ``watching_experts``' modules."""
    check_facts(module)
    proven = getattr(module, "_autoep_proven_experts", None)
    if proven is not None:
        _check_experts(module, proven)


def check_facts(module: nn.Module) -> None:
    """``check_proven``'s folded values alone (not the experts' modules)."""
    for fact in getattr(module, "_autoep_facts", ()):
        if not holds(fact, module):
            raise FactChanged(f"{fact.label(module)} is {fact.now(module)!r}, but the expert-parallel plan was proven "
                              f"with {fact.spelled()}={fact.value!r} when it was applied; set it back, or apply the plan "
                              "to a model built with the new value")
    drift = folded_drift(module, getattr(module, "_autoep_folded", ()))
    if drift:
        raise FactChanged(f"{type(module).__name__}: {drift[0]}; the expert-parallel plan was proven for the old "
                          "value (e.g. an expert's dropout at p=0 or in eval is the identity, otherwise it draws random "
                          "numbers the exchange cannot reproduce, unless the plan entry sets expert_draws=on_owner; a "
                          "BatchNorm in eval maps each row by its running statistics, in training by its batch's, "
                          "which mix rows across ranks): set it back, or apply the plan to the model in its new state")


def _check_proven_hook(module: nn.Module, args) -> None:
    check_facts(module)  # the experts' modules: once per call, where the recipe's code reaches them


def checking_proven(region: Callable) -> Callable:
    """``region(block, *args)`` (a spliced expert region's exchange) after ``check_proven(block)``: the check
    where the block's own code reaches its expert work, after every forward pre-hook (a user's registered after
    apply may have changed a value the block pre-hook saw unchanged). A partial of module-level functions: it
    pickles and copies as the region does."""
    return functools.partial(_checked_region, region)


def _checked_region(region: Callable, block: nn.Module, *args):
    check_proven(block)
    return region(block, *args)


def join_backward_exchanges(block: nn.Module, ep_mesh) -> None:
    """Every rank joins the backward of the exchanges ``block`` runs, even where the block's own code drops
    an exchange's output from its graph (torchtune's ``if routed_output.numel() > 0:`` on a rank without
    tokens would leave the peers waiting in that backward): hooks around the block's call join a dropped
    output to the block's output (``dispatch.join_exchanges``). Nothing to do without an exchange."""
    if ep_mesh is None or ep_mesh.size() == 1 or getattr(block, "_autoep_joins", False):
        return
    block._autoep_joins = True
    block.register_forward_pre_hook(_open_exchanges_hook)
    block.register_forward_hook(_join_exchanges_hook)


def _open_exchanges_hook(module: nn.Module, args) -> None:
    open_exchanges()


def _join_exchanges_hook(module: nn.Module, args, output):
    return join_exchanges(output)


def bind_experts_forward(experts: nn.Module, spec, forward: Callable) -> None:
    """Replace ``experts.forward`` (on the instance) by ``forward``, which reads what it needs from
    ``experts._autoep_ep = spec`` (fixed at apply time). Each call first checks that the experts' class
    still runs the forward code that was proven: one swapped or replaced after apply raises. ``forward`` is a
    module-level function: a deep copy or a pickle of the experts binds it to the copy
    (``autoep.runtime.shared``)."""
    experts._autoep_ep = spec
    experts._autoep_proven_code = ProvenCode(_forward_code(type(experts)))
    experts._autoep_forward = forward
    experts.forward = InstanceMethod(experts, _checked_forward)
    install_sharded_apply(experts)  # ``model.apply(fn)`` draws for the full expert tensors, as on the model


def _forward_code(cls: type):
    return getattr(inspect.unwrap(cls.forward), "__code__", None)


class ProvenCode:
    """The code of a forward proven at apply. A pickle holds it marshalled (a code object does not pickle), so
    a loaded model checks its class's code against the same instructions, names and constants."""

    def __init__(self, code):
        self.code = code

    def matches(self, code) -> bool:
        return code is self.code or code == self.code

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return _unmarshalled, (marshal.dumps(self.code) if self.code is not None else None,)


def _unmarshalled(data) -> ProvenCode:
    return ProvenCode(marshal.loads(data) if data is not None else None)


def _checked_forward(self: nn.Module, *args, **kwargs):
    if not self._autoep_proven_code.matches(_forward_code(type(self))):
        raise RuntimeError(f"{type(self).__name__}.forward was replaced, or its __code__ swapped, after "
                           f"apply_plan; the expert-parallel experts compute the forward proven at apply "
                           f"time. Apply the plan again to a fresh model built with the new code")
    check_proven(self)  # the values the experts' proof folded, after every hook of the block and the experts
    return self._autoep_forward(self, *args, **kwargs)


def shard_weights_at(experts: nn.Module, paths, ep_mesh, *, name: str) -> None:
    """Make each expert weight named by a path under ``experts`` (``fc1.weight``, ``mlp.w1``) a ``Shard(0)``
    DTensor over ``ep_mesh`` where it lives (local slice, no communication); those already sharded (registered
    directly on the experts: ``apply_plan`` did them) are left as they are."""
    for path in dict.fromkeys(paths):
        owner_path, _, attr = path.rpartition(".")
        owner = experts.get_submodule(owner_path)
        if ep_mesh is None:
            mark_unsharded(owner, [attr])
            continue
        param = owner._parameters[attr]
        if not isinstance(param, DTensor):
            setattr(owner, attr, shard_expert_tensor(param, ep_mesh, name=f"{name}.experts.{path}"))
            slice_full_on_load(owner)
