"""``trainer.export_hf=true``: the check before any work (``autoep.runtime.export`` writes ``<run_dir>/hf/``)."""
from __future__ import annotations

from torch import nn

from autoep.errors import ConfigError


def check_exportable(model: nn.Module) -> None:
    """Before any work: the model must be a transformers ``PreTrainedModel`` (it has a config to write)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        PreTrainedModel = ()  # noqa: N806 - no transformers: nothing is exportable
    if not isinstance(model, PreTrainedModel):
        raise ConfigError(f"trainer.export_hf=true needs a transformers model (PreTrainedModel, with a config to "
                          f"write); {type(model).__name__} is not one; set trainer.export_hf=false")
