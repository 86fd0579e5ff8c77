"""Activation checkpointing around a block whose experts exchange tokens: exact with torch's own
``checkpoint``, refused at forward time with anything else.

transformers' layers (``GradientCheckpointingLayer``, read in ``autoep.detect.wrappers``) run their forward
through ``self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)`` when
``self.gradient_checkpointing and self.training and torch.is_grad_enabled()``. Under EP that forward runs
the token exchange (collectives), and the checkpoint runs it a second time in backward. With
``torch.utils.checkpoint.checkpoint`` (reentrant or not) this is exact:

- the recomputation runs the block's own forward on the same inputs with the RNG state restored, so every
  rank routes exactly as it did (the routing is the model's own deterministic code), sends the same rows,
  and gets back the same results; non-reentrant checkpointing checks the recomputed tensors' metadata;
- every rank recomputes the same block at the same point of its backward: a block's backward starts only
  once the gradient of its output is complete, which (residual stream) orders the blocks identically on
  every rank, and the recomputation, with its exchanges, runs before any of that block's backward
  exchanges; a non-reentrant recomputation stops early only after the last tensor the block saved, which
  comes after its last exchange (the combine saves its indices), so no rank leaves an exchange out.

A one-pass block (``autoep.runtime.recipes.replay``) is exact under it too: the recomputation runs the block's
forward and its exchanges again, the RNG restored by the checkpoint, so every rank makes the same expert calls.
Two things keep the ranks in step under non-reentrant checkpointing: its recomputation stops early at the
last tensor the forward saved, which is in the deferred calls (after the exchanges) on one rank and may be past
the block on another, so the one pass treats that stop as no failure and still joins its agreement all-reduce
before stopping; and a rank whose block output reaches nothing saved (no tokens: the returned rows are joined to
the output by ``dispatch._Join``) starts its recomputation in ``_Join``'s backward, which reads a saved
tensor, rather than entering the exchange's backward while its peers recompute. One-pass blocks are
checkpointed from around them (a decoder layer's checkpoint): a block that is itself a checkpointing layer is
refused at detection (its ``__call__`` wrapper), so this guard never sees one.

``tests/runtime/test_checkpointing.py`` shows it on 2 ranks against the block's own forward, for both
modes; ``tests/runtime/test_replay_execution.py`` for replay blocks (against the layer's own forward under
the same checkpointing). Any other ``_gradient_checkpointing_func`` (a partial with ``context_fn``, HF's
CPU-offload closure, a user function) is code autoep has not read: the block's call raises, naming
``gradient_checkpointing`` and the fix, before anything runs.
"""
from __future__ import annotations

import functools
import inspect
import sys

import torch
from torch import nn

from autoep.detect.wrappers import checkpointing_wrapped

# torch.utils.checkpoint.checkpoint's keywords that do not change what runs (which tensors are saved, how
# the recomputation is checked); ``context_fn`` (selective checkpointing policies, arbitrary code) and
# ``debug`` (a dispatch mode around the recomputation) are not among them.
EXACT_KEYWORDS = {"use_reentrant": (bool, type(None)), "preserve_rng_state": (bool,), "determinism_check": (str,)}
_FIX = ("enable it with model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
        "False}) (torch.utils.checkpoint.checkpoint), or turn it off (model.gradient_checkpointing_disable())")


def guard_checkpointing(block: nn.Module, ep_mesh) -> None:
    """Where ``block``'s forward runs through transformers' checkpointing wrapper and tokens are exchanged,
    check at each call (a forward pre-hook: checkpointing is usually switched on after ``apply_plan``) that
    the checkpoint function is one under which EP is exact (module docstring)."""
    if ep_mesh is None or ep_mesh.size() == 1 or getattr(block, "_autoep_checkpoint_guard", False):
        return
    if not checkpointing_wrapped(type(block)):
        return
    block._autoep_checkpoint_guard = True
    block.register_forward_pre_hook(_check_hook)


def _check_hook(block: nn.Module, args) -> None:
    # The wrapper's own condition (checked on the outermost wrapper; inner ones call through).
    if not (getattr(block, "gradient_checkpointing", False) and block.training and torch.is_grad_enabled()):
        return
    fn = getattr(block, "_gradient_checkpointing_func", None)
    why = unknown_checkpoint(fn)
    if why:
        raise RuntimeError(f"{type(block).__name__}.gradient_checkpointing is True and its _gradient_checkpointing_func "
                           f"is {fn!r}: {why}; its recomputation in backward runs the expert exchange again, which "
                           f"autoep shows exact only under torch.utils.checkpoint.checkpoint. Either {_FIX}")


def unknown_checkpoint(fn) -> str:
    """Why ``fn`` is not a checkpoint function under which EP is exact ("" when it is): torch's own
    ``checkpoint``, or a ``functools.partial`` of it with no positional arguments and only
    ``EXACT_KEYWORDS`` (with plain values)."""
    keywords = {}
    if isinstance(fn, functools.partial):
        if fn.args:
            return "a partial with positional arguments"
        fn, keywords = fn.func, dict(fn.keywords)
    if not _torch_checkpoint(fn):
        return "not torch.utils.checkpoint.checkpoint"
    for key, value in keywords.items():
        if key not in EXACT_KEYWORDS:
            return f"keyword {key}={value!r} is one autoep does not know to keep the recomputation exact"
        if not isinstance(value, EXACT_KEYWORDS[key]):
            return f"keyword {key}={value!r} is not a plain {EXACT_KEYWORDS[key][0].__name__}"
    return ""


def _torch_checkpoint(fn) -> bool:
    """``fn`` is ``torch.utils.checkpoint.checkpoint`` as torch ships it (its dynamo-disabling wrapper
    around the function defined in torch/utils/checkpoint.py), not a patch put in its place."""
    module = sys.modules.get("torch.utils.checkpoint")
    if module is None or fn is not getattr(module, "checkpoint", None):
        return False
    inner = inspect.unwrap(fn)
    code = getattr(inner, "__code__", None)
    if code is None or code.co_filename != module.__file__ or code.co_qualname != "checkpoint":
        return False
    wrapper = getattr(fn, "__code__", None)  # torch's own wrapper: defined in torch/_compile.py (or none)
    return fn is inner or (wrapper is not None and wrapper.co_filename == getattr(sys.modules.get("torch._compile"),
                                                                                  "__file__", None))
