"""PEFT's LoRA on expert parameters (``LoraConfig(target_parameters=[...experts.gate_up_proj, ...])``), known by
the code it runs, and peeled off for the proofs.

``get_peft_model`` puts one ``peft.tuners.lora.layer.ParamWrapper`` per targeted parameter in place of the module
holding it (the batched experts), nested: each wraps the next (``base_layer``), the innermost the experts. PEFT
0.21's code was read (``ParamWrapper.forward``, ``_activate_lora``, ``_remove_parametrizations`` and the two
proxies): with its adapters active and unmerged, a wrapper registers a ``torch.nn.utils.parametrize``
parametrization of its parameter on the experts, calls the wrapped module once with the arguments it got, and
removes the parametrization; disabled or merged, it calls the wrapped module as it is. Its ``merge`` (``unmerge``)
adds (subtracts) ``get_delta_weight``, a tensor of the parameter's shape, to the parameter's data. The parametrization is
``W + delta``, per expert along dim 0:

- ``_LoraFactorsProxy(lhs, rhs, scaling)``: ``torch.baddbmm(W, lhs, rhs, alpha=scaling)`` (autocast off), with
  ``lhs`` (E, out, r) and ``rhs`` (E, r, in): expert e's weight reads ``W[e]``, ``lhs[e]`` and ``rhs[e]`` alone;
- ``_LoraParameterProxy(delta_weight)``: ``W + delta_weight`` (in low precision: upcast, add, clamp, cast back),
  ``delta_weight`` of W's shape: elementwise.

So the block computes, with the experts under the chain, what it computes with those experts alone, each expert
with its own effective weight: the proofs read the experts under the chain (``peeled``, ``submodule``), and
the runtime applies each expert's delta on the rank that owns it (``autoep.runtime.adapters``).

Recognised by the code objects of those functions, which must be the ones PEFT's module defines (a subclass
overriding one is refused) and whose source must be the text read here (AST digests): a PEFT version that
changes them is refused until it is read again. autoep never imports peft: where it is not in ``sys.modules``
there is no wrapper to know.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import sys
import types

from torch import nn

from autoep.detect.source import Refusal, code_tree
from autoep.errors import UnsupportedModuleStructure

PEFT_LORA = "peft.tuners.lora.layer"
# (class, function) -> sha256 (16 hex) of ``ast.dump`` of its source, as read in peft 0.21.2.
READ = {
    ("ParamWrapper", "forward"): "7b4dc3ff6e44c5d0",
    ("ParamWrapper", "_activate_lora"): "02e2146a049c975b",
    ("ParamWrapper", "_remove_parametrizations"): "29540ea0765601a7",
    ("ParamWrapper", "merge"): "1c2cde1c7c740a29",
    ("ParamWrapper", "unmerge"): "46787a4f6ecf2189",
    ("ParamWrapper", "get_delta_weight"): "2bd1cef32f9945f6",
    ("_LoraFactorsProxy", "__init__"): "e3a21d8156468fbe",
    ("_LoraFactorsProxy", "forward"): "4c8ea16ee1e00596",
    ("_LoraParameterProxy", "__init__"): "7b54323721d26335",
    ("_LoraParameterProxy", "forward"): "1d55aca60bc9fc45",
    ("_LoraParameterProxy", "_low_prec_add"): "bbae138dd94b7bdb",
}


def peft_classes() -> types.ModuleType | None:
    """PEFT's LoRA layer module where something imported it (``None``: no PEFT wrapper can exist)."""
    return sys.modules.get(PEFT_LORA)


def is_param_wrapper(module) -> bool:
    """Whether ``module`` is a PEFT ``ParamWrapper`` (of any subclass; ``check_wrapper`` says whether it is known)."""
    lora = peft_classes()
    return lora is not None and isinstance(module, getattr(lora, "ParamWrapper", ()))


def wrapper_chain(module: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    """The PEFT wrappers nested from ``module`` in (outermost first; none where ``module`` is no wrapper) and the
    module under them."""
    chain = []
    while is_param_wrapper(module):
        chain.append(module)
        module = module._modules.get("base_layer")
    return chain, module


def submodule(root: nn.Module, path: str) -> nn.Module:
    """``root.get_submodule(path)`` seeing through PEFT wrapper chains at every step (the module a proof read
    under the chain); raises ``AttributeError`` as ``get_submodule`` does."""
    module = wrapper_chain(root)[1]
    for name in path.split(".") if path else ():
        child = module._modules.get(name)
        if child is None:
            raise AttributeError(f"{type(module).__name__} has no submodule {name!r}")
        module = wrapper_chain(child)[1]
    return module


def check_wrapper(wrapper: nn.Module, where: str) -> None:
    """Refuse a wrapper whose class runs other code than PEFT's read here, or with a ``forward`` of its own."""
    lora = peft_classes()
    for name in ("forward", "merge", "unmerge"):
        own = vars(wrapper).get(name)
        if own is not None and not getattr(getattr(own, "fn", None), "_autoep_adapted", False):
            raise Refusal(f"{where}: the PEFT {type(wrapper).__name__} has a {name} set on its instance")
    for (cls_name, fn_name), digest in READ.items():
        cls = type(wrapper) if cls_name == "ParamWrapper" else getattr(lora, cls_name, None)
        home = getattr(lora, cls_name, None)
        read = _code(vars(home).get(fn_name)) if home is not None else None
        if read is None or _code(getattr(cls, fn_name, None)) is not read:
            raise Refusal(f"{where}: {cls_name}.{fn_name} of {type(wrapper).__name__} is not PEFT's own "
                          f"{PEFT_LORA}.{cls_name}.{fn_name}; autoep knows only that code")
        if _digest(read) != digest:
            raise Refusal(f"{where}: PEFT's {cls_name}.{fn_name} is not the code autoep read (peft 0.21); this "
                          f"peft version changed it, and autoep does not know what it does. Use peft 0.21, or "
                          f"leave the adapter off the experts' parameters")


def known_proxy(proxy) -> bool:
    """Whether ``proxy`` (a parametrization) is one of PEFT's two LoRA proxies, of PEFT's own class, whose code is
    the code read here."""
    lora = peft_classes()
    kind = type(proxy).__name__
    if lora is None or type(proxy) is not getattr(lora, kind, None) or kind not in ("_LoraFactorsProxy",
                                                                                   "_LoraParameterProxy"):
        return False
    return all(_digest(_code(vars(type(proxy))[fn])) == digest for (cls, fn), digest in READ.items() if cls == kind)


def _code(fn) -> types.CodeType | None:
    """The code object of a function (a staticmethod's too), ``None`` for anything else."""
    return getattr(getattr(fn, "__func__", fn), "__code__", None)


@functools.lru_cache(maxsize=None)
def _digest(code: types.CodeType) -> str:
    return hashlib.sha256(ast.dump(code_tree(code)).encode()).hexdigest()[:16]


def expert_chains(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, list[nn.Module]]]:
    """``(parent, name, base, wrappers)`` for every PEFT chain in ``model`` whose base holds a parameter of 3 or
    more dims directly (batched experts; chains on 2-D weights are left where they are), outermost chains only."""
    if peft_classes() is None:
        return []
    found = []
    for parent in model.modules():
        if is_param_wrapper(parent):
            continue
        for name, child in parent._modules.items():
            chain, base = wrapper_chain(child)
            if chain and base is not None and any(p is not None and p.dim() >= 3
                                                  for p in base._parameters.values()):
                found.append((parent, name, base, chain))
    return found


def tuner_layers_hint(block: nn.Module) -> str:
    """Where a refused block holds PEFT layers (``target_modules`` LoRA on its Linears: PEFT's own forward, which
    the proofs do not read), the fix in words: apply expert parallelism first, then PEFT; ``""`` where none."""
    found = [(name, type(m).__name__) for name, m in block.named_modules()
             if type(m).__module__.startswith("peft.tuners.") and hasattr(m, "base_layer")]
    if not found:
        return ""
    name, cls = found[0]
    after = ("LoRA on the experts' Linears then runs in each expert's own forward, on the rank that owns it"
             if not is_param_wrapper(block.get_submodule(name)) else
             "a ParamWrapper (LoraConfig(target_parameters=...)) inside expert-parallel experts is refused then, at "
             "their first forward (their replaced forward would not call it; merge_and_unload() is exact): "
             "target_parameters is supported on the experts module's own parameters, e.g. experts.gate_up_proj")
    return (f" (PEFT's {cls} wraps {name}: get_peft_model ran before autoep, and autoep does not read PEFT's layers' "
            f"code; apply expert parallelism first (ExpertParallel / apply_plan), then get_peft_model: {after})")


@contextlib.contextmanager
def peeled(model: nn.Module):
    """Within: every chain of ``expert_chains`` replaced, in its parent, by the experts under it (checked known
    first: ``UnsupportedModuleStructure`` otherwise); put back on leaving, whatever happened within. The proofs and ``apply_plan``
    see the experts the wrappers call."""
    chains = expert_chains(model)
    for parent, name, base, chain in chains:
        for wrapper in chain:
            try:
                check_wrapper(wrapper, f"{type(parent).__name__}.{name}")
            except Refusal as exc:
                raise UnsupportedModuleStructure(type(parent).__name__, str(exc)) from None
    try:
        for parent, name, base, _ in chains:
            parent._modules[name] = base
        yield
    finally:
        for parent, name, _, chain in chains:
            parent._modules[name] = chain[0]
