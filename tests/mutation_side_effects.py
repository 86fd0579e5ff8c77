"""Another module of the user's project, as the one-pass doors' replay operators see it (issue 30 item 7).

The mutants of ``mutation_replay`` (``side_effects``, ``expert_hooks``, ``rng_held_elsewhere``) call these helpers
at an expert call of the block's forward: each writes state that lives outside the block (a list, a class-level
list, a ``__slots__`` object, an ``itertools.count``, a logging handler, generators: all in this module) or outside
autograd's view (a buffer edited through ``.data``, a CPU tensor written through a numpy view), or runs as a hook
at the caller, and scales the expert's output by what it counted or drew: a write made twice, missed, made on
other rows, or read later than the model reads it changes the output.

Every piece of state here is set back by ``reset()`` before each call of the block (a forward pre-hook the mutant
registers after apply, on the reference and the EP copy alike), so each call computes the same as the model's.
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import torch

ROWS: list = []  # the expert outputs a call site appended (a list in another module)
TICKETS = itertools.count()  # a ticket per expert call
TORCH_GEN = torch.Generator().manual_seed(0)  # generators held in another module
NP_GEN = np.random.default_rng(0)
HOOK_ROWS: list = []  # rows an expert's hook saw, per call
HOOK_CALLS: list = []  # calls an expert's hook saw
GATE_LOGITS: list = []  # what a forward hook on the gate collected


class Stats:
    """A helper object whose list lives on its class: every instance (and every deep copy) appends to one list."""

    calls: list = []


class Slots:
    """A ``__slots__`` counter (no ``__dict__``)."""

    __slots__ = ("calls", "rows")

    def __init__(self):
        self.calls, self.rows = 0, 0


class Collecting(logging.Handler):
    """A logging handler that keeps each record's message (formatted when emitted, as a file handler does)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def handleError(self, record) -> None:  # noqa: N802 - a quiet handler: logging's own handleError prints
        pass


LOG = logging.getLogger("mutation_side_effects")
HANDLER = Collecting()


def _install_handler() -> None:
    """The handler on ``LOG`` alone (``logging.config.dictConfig``, which Hydra runs, may reset existing loggers)."""
    if HANDLER not in LOG.handlers:
        LOG.addHandler(HANDLER)
    LOG.setLevel(logging.DEBUG)
    LOG.propagate, LOG.disabled = False, False


_install_handler()


def reset() -> None:
    """Every piece of this module's state as at import."""
    global TICKETS, NP_GEN
    for store in (ROWS, HOOK_ROWS, HOOK_CALLS, GATE_LOGITS, Stats.calls, HANDLER.messages):
        store.clear()
    TICKETS = itertools.count()
    TORCH_GEN.manual_seed(0)
    NP_GEN = np.random.default_rng(0)
    _install_handler()


# ---------------------------------------------------------------------------------------------
# Side effects at an expert call: each returns the call's output scaled by what it counted
# ---------------------------------------------------------------------------------------------


def _scaled(out, count):
    return out * (1.0 + 0.01 * count)


def kept_in_list(out):
    """The output appended to this module's list (kept pending until the block returns), scaled by the list's
    length."""
    ROWS.append(out)
    return _scaled(out, len(ROWS))


def counted(store: list, out):
    """One entry (the output's rows) appended to ``store`` (a mutable default, a class-level list)."""
    store.append(out.shape[0])
    return _scaled(out, len(store) + 0.1 * sum(store))


def nested(stats: dict, out):
    """Nested dicts of stats: ``stats['experts']['calls']['n'] += 1``, rows likewise."""
    experts = stats["experts"]
    experts["calls"]["n"] += 1
    experts["rows"]["n"] += out.shape[0]
    return _scaled(out, experts["calls"]["n"] + 0.1 * experts["rows"]["n"])


def hits(counter, out):
    """A ``collections.Counter`` of expert hits."""
    counter["calls"] += 1
    counter["rows"] += out.shape[0]
    return _scaled(out, counter["calls"] + 0.1 * counter["rows"])


def slot_counted(slots: Slots, out):
    slots.calls += 1
    slots.rows += out.shape[0]
    return _scaled(out, slots.calls + 0.1 * slots.rows)


def ticketed(out):
    return _scaled(out, next(TICKETS))


def logged(out):
    """A log record per call (its rows), the output scaled by the records the handler kept."""
    LOG.info("expert call on %d rows", out.shape[0])
    return _scaled(out, len(HANDLER.messages))


def logged_value(out):
    """A log record of the output's norm: formatted (a host read of the output) when the handler emits it."""
    LOG.info("expert output norm %.4f", out.detach().norm())
    return _scaled(out, len(HANDLER.messages))


def data_bumped(owner, out):
    """A buffer edited through ``.data`` after the call (autograd's version counter does not see it), the output
    scaled by the buffer itself: the model reads the value it has at this call."""
    owner.autoep_scale.data.add_(0.1)
    return out * owner.autoep_scale


def inplace_bumped(owner, out):
    """The same buffer edited in place under ``no_grad`` (its version counter moves), the output shifted by it (an
    add saves nothing for backward: the model's own backward runs)."""
    with torch.no_grad():
        owner.autoep_scale.add_(0.1)
    return out + owner.autoep_scale


def numpy_bumped(owner, out):
    """A CPU tensor written through a numpy view of it after the call, the output scaled by the tensor."""
    owner.autoep_host.numpy()[0] += 0.1
    return out * owner.autoep_host


# ---------------------------------------------------------------------------------------------
# Hooks: registered after apply, or at the call inside the forward
# ---------------------------------------------------------------------------------------------


def count_rows_pre_hook(module, args):
    HOOK_ROWS.append(args[0].shape[0])


def scale_input_pre_hook(module, args):
    HOOK_CALLS.append(1)
    return (args[0] * (1.0 + 0.1 * len(HOOK_CALLS)), *args[1:])


def scale_output_hook(module, args, output):
    HOOK_CALLS.append(1)
    return output * (1.0 + 0.1 * len(HOOK_CALLS))


def scale_grad_input_hook(module, grad_input, grad_output):
    return tuple(g * 1.5 if g is not None else None for g in grad_input)


def collect_logits_hook(module, args, output):
    GATE_LOGITS.append(output)


def by_hook_rows(out):
    return _scaled(out, sum(HOOK_ROWS))


def by_gate_logits(out):
    """Scaled by the gate's calls the hook collected, shifted by the last logits' mean (a gradient path to the
    router through the hook's store)."""
    shifted = _scaled(out, len(GATE_LOGITS))
    return shifted + 0.1 * GATE_LOGITS[-1].mean() if GATE_LOGITS else shifted


def removed(handle, out):
    """``handle`` (a hook registered just before the call) removed after it: a hook inside the forward."""
    handle.remove()
    return out


def grad_scaled(out):
    """A tensor hook on the expert's output scaling its gradient."""
    if out.requires_grad:
        out.register_hook(lambda g: g * 1.5)
    return out


# ---------------------------------------------------------------------------------------------
# Generators held here, drawing between expert calls
# ---------------------------------------------------------------------------------------------


def torch_drawn(out):
    return out * (1.0 + 0.01 * torch.rand((), generator=TORCH_GEN))


def numpy_drawn(out):
    return out * (1.0 + 0.01 * float(NP_GEN.random()))


def masked(out):
    """A dropout-like mask drawn by shape (no value of the output read), then a scalar draw."""
    keep = torch.rand(out.shape, generator=TORCH_GEN) > 0.25
    return out * keep.to(out.dtype) / 0.75 * (1.0 + 0.01 * torch.rand((), generator=TORCH_GEN))


def bernoulli_like(out):
    """A mask drawn on a tensor made from the output (``full_like``: a computation on the output), then a scalar
    draw from the same generator: the model draws the mask first."""
    keep = torch.bernoulli(torch.full_like(out, 0.75), generator=TORCH_GEN)
    return out * keep / 0.75 * (1.0 + 0.01 * torch.rand((), generator=TORCH_GEN))
