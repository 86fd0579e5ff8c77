"""Run-time-state operators of the soundness fuzzer (no source change), and the roles they touch.

``op(block, role) -> mutate(block) | None`` (None where the operator does not apply to that role):
an instance ``forward``, forward and pre hooks, a ``__call__`` override, a ``functools.wraps``ed
forward set at run time, tied / frozen / differently sized experts, another or a non-element-wise
``act_fn``, an instance ``_apply_gate``, a doubled or learnable constant of the experts' gate; a class
``forward`` whose ``__code__`` was edited after import (its file shows the original), a plain number of
the block made a property that changes in eval (issue 17); the block's or one expert's mode flipped after apply
(issue 31). Roles:
``block``, ``router`` (the gate or router module), ``experts`` (batched experts: the container is
called), ``expert`` (ModuleList experts), ``act`` (the experts' ``act_fn`` where the model defines its
class, e.g. a soft-capped SwiGLU); source sites also use ``act:<Class>`` (the model-defined modules
inside it, every instance of that class: a class edit is global).
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Callable

import torch
from mutation_source import SCALE, exec_subclass
from torch import nn

# ---------------------------------------------------------------------------------------------
# Roles: the block, its router, its experts container, one expert
# ---------------------------------------------------------------------------------------------


def router_of(block: nn.Module) -> nn.Module | None:
    gate = getattr(block, "gate", None)
    return gate if isinstance(gate, nn.Module) else getattr(block, "router", None)


def experts_attr(block: nn.Module) -> str:
    """The block's experts attribute as the detector finds it (by data flow; a dotted path where only the
    record/exchange/replay fallback finds them, ``moe.experts``); ``experts`` where it finds none."""
    from autoep.detect import replay_proof
    from autoep.detect.structure import find_experts

    try:
        found = find_experts(block)
    except Exception:  # noqa: BLE001 - the fast paths' reading refuses (several containers): the fallback's
        found = None
    if found:
        return found
    try:
        return replay_proof.find_container(block)
    except Exception:  # noqa: BLE001 - no container either
        return "experts"


def experts_of(block: nn.Module) -> nn.Module | None:
    """The experts container (experts held in a plain dict/list attribute: a ModuleDict view of them, by the names
    the block registers them under; experts found by role that are not one container's entries, numbered attributes
    or lists the forward builds: a ModuleDict view of each expert's first module, by its id)."""
    from autoep.detect import plain_experts, replay_proof

    try:
        members = replay_proof.find_experts(block).members
    except Exception:  # noqa: BLE001 - none found by role: the container the detector finds, if any
        members = ()
    found = plain_experts.resolve(block, experts_attr(block))
    container = found is not None and isinstance(found[0], (nn.ModuleList, nn.ModuleDict))
    if members and (not container or [m[0] for m in members] != [f"{found[1]}.{k}" for k in (
            found[0].keys() if isinstance(found[0], nn.ModuleDict) else range(len(found[0])))]):
        return nn.ModuleDict({str(e): block.get_submodule(m[0]) for e, m in enumerate(members)})
    return found[0] if found is not None else getattr(block, "experts", None)


def expert_list(block: nn.Module) -> list[nn.Module]:
    """The experts of a ModuleList/ModuleDict container, expert e at position e; of a ModuleList of containers
    (two-level routing, ``experts[g][j]``), its leaves in order, as autoep places them."""
    experts = experts_of(block)
    entries = list(experts.values()) if isinstance(experts, nn.ModuleDict) else list(experts)
    if entries and all(isinstance(e, (nn.ModuleList, nn.ModuleDict)) for e in entries):
        return [m for e in entries for m in (e.values() if isinstance(e, nn.ModuleDict) else e)]
    return entries


def is_module_list(block: nn.Module) -> bool:
    return type(experts_of(block)) in (nn.ModuleList, nn.ModuleDict)


def model_defined(obj) -> bool:
    """A module whose class the model's own code defines (not torch's, not transformers' activations)."""
    return isinstance(obj, nn.Module) and not type(obj).__module__.startswith(("torch.", "transformers.activations"))


def act_modules(block: nn.Module) -> list[nn.Module]:
    """The experts' ``act_fn`` modules whose class the model defines (every expert's, for a ModuleList)."""
    holders = expert_list(block) if is_module_list(block) else [experts_of(block)]
    return [h.act_fn for h in holders if model_defined(getattr(h, "act_fn", None))]


def act_roles(block: nn.Module) -> list[str]:
    """``act``, then ``act:<Class>`` for each model-defined class inside it, in module order ([] without one)."""
    acts = act_modules(block)
    if not acts:
        return []
    inner = [type(m).__name__ for m in acts[0].modules() if m is not acts[0] and model_defined(m)]
    return ["act", *(f"act:{name}" for name in dict.fromkeys(inner))]


def experts_sub_roles(block: nn.Module) -> list[str]:
    """``experts:<Class>`` for each model-defined class of module inside batched/grouped experts (Aria's
    grouped-GEMM modules), not activations (``act`` roles), in module order."""
    experts = experts_of(block)
    if not isinstance(experts, nn.Module):
        return []
    tops = {id(e) for e in expert_list(block)} if is_module_list(block) else set()
    acts = {id(m) for a in act_modules(block) for m in a.modules()}
    inner = [type(m).__name__ for m in experts.modules()
             if m is not experts and id(m) not in acts | tops and model_defined(m)]
    return [f"experts:{name}" for name in dict.fromkeys(inner)]


def role_objects(block: nn.Module, role: str) -> list[nn.Module]:
    """The modules a mutation of ``role`` re-classes: ``expert`` = every expert, ``act:<Class>`` = every
    instance of that class (a class edit is global)."""
    if role == "block":
        return [block]
    if role == "router":
        return [router_of(block)]
    experts = experts_of(block)
    if role == "experts":
        return [experts]
    if role == "act":
        return act_modules(block)
    if role.startswith("experts:"):
        return [m for m in experts.modules() if m is not experts and type(m).__name__ == role[len("experts:"):]]
    if role.startswith("act:"):
        return [m for a in act_modules(block) for m in a.modules() if type(m).__name__ == role[len("act:"):]]
    return expert_list(block)


def roles_of(block: nn.Module) -> list[str]:
    """Roles a run-time mutation can target: the router where the block has one, the experts container only where
    it is called (batched), the experts' model-defined activation module where there is one."""
    router = ["router"] if router_of(block) is not None else []  # VitPose-style blocks take their ids as input
    experts = experts_of(block)
    if experts is None or (not is_module_list(block) and type(experts).forward is nn.Module.forward):
        return ["block", *router]  # 3-D weights on the block or on a child it never calls (issue 31 item 3)
    return ["block", *router, "expert" if is_module_list(block) else "experts", *act_roles(block)[:1]]


# ---------------------------------------------------------------------------------------------
# Operators
# ---------------------------------------------------------------------------------------------


def scaled(out):
    """The output scaled by SCALE (a tuple's first element)."""
    return (out[0] * SCALE, *out[1:]) if isinstance(out, tuple) else out * SCALE


def _one(block: nn.Module, role: str) -> nn.Module:
    """The single object a run-time mutation of ``role`` touches (``expert``: expert 1)."""
    return expert_list(block)[1] if role == "expert" else role_objects(block, role)[0]


def rt_instance_forward(block, role):
    """An instance-level ``forward`` that scales what the class forward returns."""
    def apply(b):
        obj = _one(b, role)
        obj.forward = types.MethodType(lambda self, *a, **k: scaled(type(self).forward(self, *a, **k)), obj)

    return apply


def rt_forward_hook(block, role):
    """A forward hook that scales the output."""
    return lambda b: _one(b, role).register_forward_hook(lambda mod, args, out: scaled(out))


def rt_forward_pre_hook(block, role):
    """A forward pre-hook that scales the first input."""
    return lambda b: _one(b, role).register_forward_pre_hook(lambda mod, args: (args[0] * SCALE, *args[1:]))


CALL_OVERRIDE = f"""    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        return (out[0] * {SCALE}, *out[1:]) if isinstance(out, tuple) else out * {SCALE}
"""


def rt_call_override(block, role):
    """A subclass (with source) whose ``__call__`` scales what ``nn.Module.__call__`` returns."""
    cache = {}

    def apply(b):
        obj = _one(b, role)
        if "cls" not in cache:
            cache["cls"] = exec_subclass(type(obj), CALL_OVERRIDE, check="__call__")
        obj.__class__ = cache["cls"]

    return apply


def rt_wrapped_forward(block, role):
    """A subclass whose ``forward`` is set at run time to a ``functools.wraps`` wrapper of the original."""
    cache = {}

    def apply(b):
        obj = _one(b, role)
        if "cls" not in cache:
            orig = type(obj).forward

            @functools.wraps(orig)
            def forward(self, *args, **kwargs):
                return scaled(orig(self, *args, **kwargs))

            cache["cls"] = type(type(obj).__name__, (type(obj),), {"forward": forward})
        obj.__class__ = cache["cls"]

    return apply


def _projections(expert: nn.Module) -> list[str]:
    return [n for n, m in expert.named_children() if isinstance(m, nn.Linear)]


def rt_tied_experts(block, role):
    """Expert 1's projections are expert 0's Parameters."""
    if role != "expert":
        return None

    def apply(b):
        experts = expert_list(b)
        for n in _projections(experts[0]):
            getattr(experts[1], n).weight = getattr(experts[0], n).weight

    return apply


def rt_frozen_expert(block, role):
    """Expert 1 (batched: the ``down_proj`` of all) with ``requires_grad=False``."""
    if role == "expert":
        return lambda b: expert_list(b)[1].requires_grad_(False)
    if role == "experts":  # grouped experts may hold no ``down_proj`` (w2, fc2.weight): their last weight
        return lambda b: getattr(experts_of(b), "down_proj", [*experts_of(b).parameters()][-1]).requires_grad_(False)
    return None


def _set_act(role: str, make: Callable[[], nn.Module], every: bool) -> Callable:
    def apply(b):
        objs = [experts_of(b)] if role == "experts" else expert_list(b) if every else [expert_list(b)[1]]
        for obj in objs:
            obj.act_fn = make()

    return apply


def rt_expert_activation(block, role):
    """One expert (or the batched experts) with GELU instead of the configured activation."""
    if role not in ("expert", "experts") or not hasattr(_one(block, role), "act_fn"):
        return None
    return _set_act(role, nn.GELU, every=False)


def rt_act_not_elementwise(block, role):
    """Every expert's ``act_fn`` a softmax over the last dim."""
    if role not in ("expert", "experts") or not hasattr(_one(block, role), "act_fn"):
        return None
    return _set_act(role, lambda: nn.Softmax(dim=-1), every=True)


def rt_expert_sizes(block, role):
    """Expert 1 with half the intermediate size of the others."""
    if role != "expert":
        return None

    def apply(b):
        expert, hidden = expert_list(b)[1], router_of(b).weight.shape[-1]
        torch.manual_seed(5)
        for n in _projections(expert):
            lin = getattr(expert, n)
            shrink_out, shrink_in = lin.out_features != hidden, lin.in_features != hidden
            setattr(expert, n, nn.Linear(lin.in_features // (1 + shrink_in), lin.out_features // (1 + shrink_out),
                                         bias=lin.bias is not None))

    return apply


def rt_instance_apply_gate(block, role):
    """An instance-level ``_apply_gate`` on batched experts that scales the class's."""
    if role != "experts" or not hasattr(experts_of(block), "_apply_gate"):
        return None

    def apply(b):
        experts = experts_of(b)
        experts._apply_gate = types.MethodType(lambda self, gu: type(self)._apply_gate(self, gu) * SCALE, experts)

    return apply


def _float_constants(block: nn.Module, role: str) -> list[tuple[nn.Module, str]]:
    """``(module, attribute)`` of each plain float the experts' gate reads: on the batched experts
    container itself (``experts``: gpt-oss's ``alpha``, ``limit``) or anywhere inside the model-defined
    activation module (``act``: Inkling2's soft caps)."""
    if role == "experts":
        owners = [experts_of(block)]
    elif role == "act":
        owners = [m for a in act_modules(block)[:1] for m in a.modules()]
    else:
        return []
    return [(m, k) for m in owners for k, v in vars(m).items() if type(v) is float]


def _located(b: nn.Module, block: nn.Module, found: list[tuple[nn.Module, str]]) -> list[tuple[nn.Module, str]]:
    """``found`` (modules of ``block``) as the same modules of the fresh build ``b``."""
    names = {id(m): n for n, m in block.named_modules()}
    return [(b.get_submodule(names[id(m)]), k) for m, k in found]


def rt_gate_constant(block, role):
    """Every float constant of the experts' gate doubled (a soft cap, a clamp limit, a sigmoid's alpha)."""
    found = _float_constants(block, role)
    if not found:
        return None

    def apply(b):
        for m, k in _located(b, block, found):
            setattr(m, k, getattr(m, k) * 2)

    return apply


def rt_gate_learnable(block, role):
    """The first float constant of the experts' gate made a learnable 0-dim Parameter (state the gate reads)."""
    found = _float_constants(block, role)[:1]
    if not found:
        return None

    def apply(b):
        for m, k in _located(b, block, found):
            value = getattr(m, k)
            delattr(m, k)
            m.register_parameter(k, nn.Parameter(torch.tensor(value)))

    return apply


# ---------------------------------------------------------------------------------------------
# Issue 17: state on the expert parameters, sharing, reads of the experts from hooks, process-wide patches
# ---------------------------------------------------------------------------------------------


def _expert_param(b: nn.Module, role: str) -> tuple[nn.Module, str]:
    """``(owner module, attribute)`` of the expert parameter a parameter-state mutation touches: expert 1's
    first projection weight (ModuleList), or the batched/grouped experts' first parameter."""
    if role == "expert":
        lin = next(m for m in expert_list(b)[1].modules() if isinstance(m, nn.Linear))
        return lin, "weight"
    name = next(n for n, _ in experts_of(b).named_parameters())
    owner, _, attr = name.rpartition(".")
    return experts_of(b).get_submodule(owner), attr


def _on_every_copy(b: nn.Module, attach: Callable[[nn.Module], None]) -> None:
    """Run ``attach(block)`` now and on every deep copy of the block (``copy.deepcopy`` drops tensor hooks, and
    the fuzzer compares deep copies): the block is re-classed to a subclass whose ``__setstate__`` re-attaches."""
    base = type(b)
    cls = base.__dict__.get("_fuzz_reattaching_subclass_of") and base
    if cls is None:
        def __setstate__(self, state):
            base.__setstate__(self, state)
            for fn in self.__dict__.get("_fuzz_attach", ()):
                fn(self)

        cls = type(base.__name__, (base,), {"__setstate__": __setstate__, "__module__": base.__module__,
                                            "__qualname__": base.__qualname__, "_fuzz_reattaching_subclass_of": base})
    b.__class__ = cls
    b.__dict__.setdefault("_fuzz_attach", []).append(attach)
    attach(b)


def rt_param_grad_hook(block, role):
    """A gradient hook (``p.register_hook``) scaling one expert parameter's gradient."""
    if role not in ("expert", "experts"):
        return None

    def attach(b):
        owner, attr = _expert_param(b, role)
        getattr(owner, attr).register_hook(lambda g: g * SCALE)

    return lambda b: _on_every_copy(b, attach)


def rt_param_post_accumulate(block, role):
    """A post-accumulate-grad hook (optimizer-in-backward style) scaling one expert parameter's ``.grad``."""
    if role not in ("expert", "experts"):
        return None

    def step(p):
        p.grad.mul_(SCALE)

    def attach(b):
        owner, attr = _expert_param(b, role)
        getattr(owner, attr).register_post_accumulate_grad_hook(step)

    return lambda b: _on_every_copy(b, attach)


class FakeQuant(torch.Tensor):
    """QAT weight (torchao style): ``F.linear`` sees it rounded to a 1/4 grid, straight-through gradient."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, w, *rest = args
            w = w.as_subclass(torch.Tensor)
            w = w + (torch.round(w * 4) / 4 - w).detach()
            x = x.as_subclass(torch.Tensor) if isinstance(x, cls) else x
            return torch.nn.functional.linear(x, w, *rest, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)

    def __deepcopy__(self, memo):
        with torch._C.DisableTorchFunctionSubclass():
            data = self.detach().clone()
        return nn.Parameter(data.as_subclass(FakeQuant), requires_grad=self.requires_grad)


def rt_param_fake_quant(block, role):
    """One expert parameter a fake-quant tensor subclass."""
    if role not in ("expert", "experts"):
        return None

    def apply(b):
        owner, attr = _expert_param(b, role)
        p = getattr(owner, attr)
        setattr(owner, attr, nn.Parameter(p.detach().clone().as_subclass(FakeQuant), requires_grad=p.requires_grad))

    return apply


def _dense_same_shape(b: nn.Module, shape) -> str | None:
    """The name of a parameter of the block outside its experts with ``shape`` (a shared expert's weight)."""
    return next((n for n, p in b.named_parameters() if not n.startswith("experts.") and p.shape == shape), None)


def rt_tie_dense(block, role):
    """An expert weight tied to a same-shaped parameter elsewhere in the block (the shared expert's)."""
    if role not in ("expert", "experts"):
        return None
    owner, attr = _expert_param(block, role)
    if _dense_same_shape(block, getattr(owner, attr).shape) is None:
        return None

    def apply(b):
        o, a = _expert_param(b, role)
        setattr(o, a, b.get_parameter(_dense_same_shape(b, getattr(o, a).shape)))

    return apply


def rt_alias_experts(block, role):
    """The experts (ModuleList: expert 1) registered a second time on the block: one module, two names."""
    if role not in ("expert", "experts"):
        return None

    def apply(b):
        b.experts_alias = expert_list(b)[1] if role == "expert" else experts_of(b)

    return apply


def rt_cached_experts(block, role):
    """The router caches a plain list of the experts (ModuleList: every expert; else the container)."""
    if role != "router" or router_of(block) is None:
        return None

    def apply(b):
        object.__setattr__(router_of(b), "cached_experts", expert_list(b) if is_module_list(b) else [experts_of(b)])

    return apply


def _expert_norm(module: nn.Module) -> torch.Tensor:
    return _expert_norm_inner(module.experts)


def _expert_norm_inner(experts: nn.Module) -> torch.Tensor:
    return sum((p.float() ** 2).sum() for p in experts.parameters())


def _deep_read_hook(module, args):
    """A pre-hook that reads every expert weight two calls deep (scaling by ``1 + 0 * norm``: exact as values,
    but the weights it reads are the ones autoep replaces)."""
    return (args[0] * (1.0 + 0.0 * _expert_norm(module)).to(args[0].dtype), *args[1:])


def rt_hook_reads_experts(block, role):
    """A forward pre-hook on the block reading every expert parameter through two module-level functions."""
    if role != "block":
        return None
    return lambda b: b.register_forward_pre_hook(_deep_read_hook)


def _property_read_hook(module, args):
    return (args[0] * module.expert_scale, *args[1:])


def rt_property_reads_experts(block, role):
    """A block subclass with a property reading the experts (``SCALE`` times their count of parameters over
    itself), read by a pre-hook: a read through a property."""
    if role != "block":
        return None
    cache = {}

    def apply(b):
        if "cls" not in cache:
            base = type(b)

            def expert_scale(self):
                n = len(list(self.experts.parameters()))
                return SCALE * n / n

            cache["cls"] = type(base.__name__, (base,), {"expert_scale": property(expert_scale),
                                                         "__module__": base.__module__})
        b.__class__ = cache["cls"]
        b.register_forward_pre_hook(_property_read_hook)

    return apply


class _ScaleLinearMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * SCALE if func is torch.nn.functional.linear else out


@contextlib.contextmanager
def _patched(owner, attr: str, make: Callable):
    real = getattr(owner, attr)
    setattr(owner, attr, make(real))
    try:
        yield
    finally:
        setattr(owner, attr, real)


@contextlib.contextmanager
def _global_hook():
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, a, out: out * SCALE if type(m) is nn.Linear and isinstance(out, torch.Tensor) else out)
    try:
        yield
    finally:
        handle.remove()


_AROUND = {
    "patch_f_linear": lambda: _patched(torch.nn.functional, "linear",
                                       lambda real: lambda x, w, b=None: real(x, w, b) * SCALE),
    "patch_linear_forward": lambda: _patched(nn.Linear, "forward", lambda real: lambda self, x: real(self, x) * SCALE),
    "patch_silu": lambda: _patched(torch.nn.functional, "silu",
                                   lambda real: lambda x, inplace=False: real(x) * SCALE),
    "function_mode": _ScaleLinearMode,
    "global_forward_hook": _global_hook,
}


def _around(name: str):
    def op(block, role):
        if role != "block":
            return None

        def mutate(b):
            return None

        mutate.around = _AROUND[name]  # process-wide: active around each forward/backward, not at detection
        return mutate

    op.__doc__ = f"Process-wide state active at forward time: {name.replace('_', ' ')}."
    return op


# --- breaking the expert property at run time (issue 16) ----------------------------------------------


def _linears(expert: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Every ``nn.Linear`` inside an expert, as (parent, attribute, linear), in module order."""
    return [(parent, name, child) for parent in expert.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear]


def _wrap_first_linear(make: Callable[[nn.Linear], nn.Module]) -> Callable:
    def op(block, role):
        if role != "expert" or not _linears(_one(block, role)):
            return None

        def apply(b):
            parent, name, lin = _linears(expert_list(b)[1])[0]
            setattr(parent, name, make(lin))

        return apply

    return op


# Expert 1's first projection followed by batch statistics / by dropout while training.
rt_batchnorm_expert = _wrap_first_linear(lambda lin: nn.Sequential(lin, nn.BatchNorm1d(lin.out_features)))
rt_dropout_expert = _wrap_first_linear(lambda lin: nn.Sequential(lin, nn.Dropout(0.1)))


def rt_shared_param(block, role):
    """Expert 1's first projection weight is expert 0's Parameter (any expert kind, not only SwiGLU names)."""
    if role != "expert" or not _linears(_one(block, role)):
        return None

    def apply(b):
        experts = expert_list(b)
        _, _, lin0 = _linears(experts[0])[0]
        _, _, lin1 = _linears(experts[1])[0]
        lin1.weight = lin0.weight

    return apply


_ACTIVATIONS = (nn.SiLU, nn.GELU, nn.ReLU, nn.Tanh, nn.Sigmoid)


def rt_other_activation(block, role):
    """Expert 1's activation another one (Tanh for a module, ``torch.tanh`` for a function kept on the
    instance): experts that no longer compute the same function."""
    if role != "expert":
        return None
    expert = _one(block, role)
    modules = [(p, n) for p in expert.modules() for n, c in p.named_children() if type(c) in _ACTIVATIONS]
    functions = [n for n, v in vars(expert).items() if v in (torch.nn.functional.gelu, torch.nn.functional.relu,
                                                              torch.nn.functional.silu)]
    if not modules and not functions:
        return None

    def apply(b):
        target = expert_list(b)[1]
        if functions:
            setattr(target, functions[0], torch.tanh)
            return
        path = [(p, n) for p in target.modules() for n, c in p.named_children() if type(c) in _ACTIVATIONS][0]
        setattr(path[0], path[1], nn.Tanh())

    return apply


_SWAPPED_NAMES = {"softmax": "log_softmax", "silu": "gelu", "sigmoid": "tanh", "gelu": "silu"}


def _edited_code(code: types.CodeType) -> types.CodeType | None:
    """``code`` with its float constants doubled, or where it has none, a function it calls by name swapped
    for a like one (``softmax`` -> ``log_softmax``, ``silu`` -> ``gelu``): what runs is not what its file
    says (None where it has neither)."""
    consts = tuple(c * 2 if type(c) is float else c for c in code.co_consts)
    if consts != code.co_consts:
        return code.replace(co_consts=consts)
    names = tuple(_SWAPPED_NAMES.get(n, n) for n in code.co_names)
    return code.replace(co_names=names) if names != code.co_names else None


def rt_code_edited(block, role):
    """The object's class ``forward`` replaced by a copy whose ``__code__`` has its constants edited
    (``code.replace``, as a patching tool would): its source file still shows the original."""
    forward = type(_one(block, role)).forward
    if type(_one(block, role)).__module__.startswith("torch.") or not isinstance(forward, types.FunctionType) or hasattr(forward, "__wrapped__") \
            or _edited_code(forward.__code__) is None:
        return None
    cache = {}

    def apply(b):
        obj = _one(b, role)
        if "cls" not in cache:
            f = type(obj).forward
            g = types.FunctionType(_edited_code(f.__code__), f.__globals__, f.__name__, f.__defaults__,
                                   f.__closure__)
            g.__qualname__, g.__kwdefaults__ = f.__qualname__, f.__kwdefaults__
            cache["cls"] = type(type(obj).__name__, (type(obj),), {"forward": g, "__module__": type(obj).__module__})
        obj.__class__ = cache["cls"]

    return apply


def rt_attr_property(block, role):
    """The block's first plain number attribute (``top_k``, ``num_experts``, ...) made a property of a
    subclass: the value as stored while training, one less in eval (a fact that changes later)."""
    if role != "block":
        return None
    names = [k for k, v in vars(block).items() if type(v) is int and not k.startswith("_") and v > 1]
    if not names:
        return None
    name, cache = names[0], {}

    def apply(b):
        if "cls" not in cache:
            prop = property(lambda self: self.__dict__["_autoep_" + name] - (0 if self.training else 1))
            cache["cls"] = type(type(b).__name__, (type(b),), {name: prop, "__module__": type(b).__module__})
        b.__dict__["_autoep_" + name] = b.__dict__.pop(name)
        b.__class__ = cache["cls"]

    return apply


def rt_dropout_raised(block, role):
    """Dropout at p=0 inside the experts (where they hold none, expert 1's first projection is followed by one)
    raised to p=0.1 after apply (issue 20): the probability is a fact, p=0 included."""
    if role not in ("expert", "experts"):
        return None
    prefix = experts_attr(block) + "."
    idle = [n for n, m in block.named_modules() if n.startswith(prefix) and type(m) is nn.Dropout and m.p == 0]
    if not idle and (role != "expert" or not _linears(_one(block, role))):
        return None

    def apply(b):
        if not idle:
            parent, name, lin = _linears(expert_list(b)[1])[0]
            setattr(parent, name, nn.Sequential(lin, nn.Dropout(0.0)))

    def raise_p(b):
        for n, m in b.named_modules():
            if n.startswith(prefix) and type(m) is nn.Dropout and m.p == 0:
                m.p = 0.1

    apply.after_apply = raise_p
    return apply


_MODE_SENSITIVE = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)


def rt_mode_changed(block, role):
    """A module's mode flipped after apply (issue 31 item 4): the whole block (``block.train()`` / ``.eval()``:
    routing jitter, an eval-only inference path, every expert's dropout and norms), or one expert, or the batched
    experts container, with the mode-dependent modules inside it (BatchNorm, dropout) where it holds any. Exact, or
    raised before the expert work (a mode the proofs folded: ``FactChanged``)."""
    if role not in ("block", "expert", "experts"):
        return None
    if role != "block" and not any(isinstance(m, _MODE_SENSITIVE) or "training" in getattr(
            type(m).forward, "__code__", types.SimpleNamespace(co_names=())).co_names
            for m in _one(block, role).modules()):
        return None  # flipping an expert that reads no mode changes nothing: no mutant

    # By its path, found on the block as built: an applied block's experts are no longer found by detection.
    path = "" if role == "block" else next(n for n, m in block.named_modules() if m is _one(block, role))

    def flip(b):
        target = b.get_submodule(path)
        target.train(not target.training)

    def apply(b):
        pass

    apply.after_apply = flip
    return apply


RUNTIME_OPERATORS: dict[str, Callable] = {
    "instance_forward": rt_instance_forward,
    "forward_hook": rt_forward_hook,
    "forward_pre_hook": rt_forward_pre_hook,
    "call_override": rt_call_override,
    "wrapped_forward": rt_wrapped_forward,
    "tied_experts": rt_tied_experts,
    "frozen_expert": rt_frozen_expert,
    "expert_activation": rt_expert_activation,
    "act_not_elementwise": rt_act_not_elementwise,
    "expert_sizes": rt_expert_sizes,
    "instance_apply_gate": rt_instance_apply_gate,
    "gate_constant": rt_gate_constant,
    "gate_learnable": rt_gate_learnable,
    "param_grad_hook": rt_param_grad_hook,
    "param_post_accumulate": rt_param_post_accumulate,
    "param_fake_quant": rt_param_fake_quant,
    "tie_dense": rt_tie_dense,
    "alias_experts": rt_alias_experts,
    "hook_reads_experts": rt_hook_reads_experts,
    "cached_experts": rt_cached_experts,
    "property_reads_experts": rt_property_reads_experts,
    **{name: _around(name) for name in _AROUND},
    "batchnorm_expert": rt_batchnorm_expert,
    "dropout_expert": rt_dropout_expert,
    "shared_param": rt_shared_param,
    "other_activation": rt_other_activation,
    "code_edited": rt_code_edited,  # issue 17: the source read is not the code that runs
    "attr_property": rt_attr_property,  # issue 17: a fact computed on each read
    "dropout_raised": rt_dropout_raised,  # issue 20: a dropout probability raised after apply
    "mode_changed": rt_mode_changed,  # issue 31: train()/eval() after apply, on the block or one expert
}
