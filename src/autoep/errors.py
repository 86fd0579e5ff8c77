"""Errors autoep raises to its users. Each names the key, the value and the fix."""

# How a plan entry names its own compute-fn factory, spelled so that a host app's recursive
# ``hydra.utils.instantiate`` over its whole config never calls it (autoep.targets says why).
OPT_OUT_SPELLING = ("{_factory_: my_pkg.ep.my_factory, ...kwargs} "
                    "(or {_target_: my_pkg.ep.my_factory, _partial_: true, ...})")
OPT_OUT_HINT = (f"Declare an explicit local_compute_fn to opt out of structure detection: {OPT_OUT_SPELLING}; "
                f"a bare _target_ is called by a host app's recursive hydra.utils.instantiate.")
# The plan entry's opt-in to random draws inside experts (``PlanEntry.expert_draws``), as a refusal names it
# (``resolve_plan`` prefixes the entry's key: ``parallel.plan.0.expert_draws=on_owner``).
DRAWS_OPT_IN = "expert_draws=on_owner"


class UnsupportedModuleStructure(ValueError):
    """A matched module's structure could not be proven; the message ends with the opt-out hint."""

    def __init__(self, cls_name: str, reason: str):
        self.cls_name = cls_name
        self.reason = reason
        super().__init__(f"{cls_name}: {reason}. {OPT_OUT_HINT}")


class PlanError(ValueError):
    """A parallel plan (YAML, command line or resolved.yaml) is invalid; the message says how to fix it."""


class DriftError(PlanError):
    """A replayed decision no longer matches the model's code."""


class UnsupportedPlanEntry(PlanError, UnsupportedModuleStructure):
    """``auto`` met a module whose structure could not be proven: both a plan error (it names the entry
    and module) and an ``UnsupportedModuleStructure`` (it names the class, the proof and the opt-out)."""

    def __init__(self, message: str, cls_name: str, reason: str):
        self.cls_name = cls_name
        self.reason = reason
        ValueError.__init__(self, message)


class LiveStateError(RuntimeError):
    """At forward time, process-wide state (a patch, an active torch-function or dispatch mode, global module
    hooks) that autoep's expert fast path would not honour; the message names it and how to remove it."""


class FactChanged(RuntimeError):
    """At a call of an expert-parallel block, a value its proofs folded when the plan was applied (an attribute,
    a module global, a class attribute, a dropout probability) is not that value any more; raised before the
    block's expert work, naming the value, what it was, what it is and the fix."""


class ConfigError(ValueError):
    """A config value (YAML, command line or Python) is wrong, or the run directory cannot take this run;
    found before any work and before anything is written. The message names the key, the value and the fix."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or from another model; the message says what to do."""


class LaunchError(RuntimeError):
    """The ranks of a multi-process launch did not all join (a missing peer, no rendezvous address)."""


class PeerFailure(RuntimeError):
    """A multi-rank step failed in a collective (a peer died or hung); the message says how to resume."""


class NonFiniteLoss(RuntimeError):
    """A step's loss or gradient norm was not finite; the step was not applied and nothing of it saved."""


class GradientsNotFinished(RuntimeError):
    """An optimizer step or a gradient clip came after a backward whose gradients were not finished for EP
    (expert grads not reduced over ``edp`` nor scaled to the loss's convention): it would apply wrong gradients."""


class AfterApplyError(RuntimeError):
    """A torch call after ``apply_plan`` that would silently mishandle the expert-parallel model (an optimizer
    holding parameters apply replaced, torch's ``clip_grad_norm_`` over expert shards): refused before it changes
    anything; the message names the parameters and the autoep call to use instead."""
