"""Checkpoint directories: a save that dies midway never looks complete; load round-trips the state."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from autoep.train import checkpoint


def model_and_optim(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    return model, optim


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_crash_mid_save_leaves_no_complete_checkpoint(tmp_path, monkeypatch):
    model, optim = model_and_optim(0)

    def dies(*args, **kwargs):  # after DCP wrote its shards, before the trainer state and the rename
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "model_signature", dies)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, 3, model, optim, {"step": 3})
    assert checkpoint.latest(tmp_path) is None
    leftover = tmp_path / ".tmp-step_00000003"
    assert [p.name for p in tmp_path.iterdir()] == [leftover.name] and (leftover / ".metadata").is_file()
    with pytest.raises(checkpoint.CheckpointError, match="incomplete"):
        checkpoint.load(leftover, model, optim)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_save_load_round_trip(tmp_path):
    model, optim = model_and_optim(0)
    path = checkpoint.save(tmp_path, 7, model, optim, {"step": 7, "data": {"position": 7}})
    assert checkpoint.latest(tmp_path) == path and not list(tmp_path.glob(".tmp-*"))
    other, other_optim = model_and_optim(1)
    state = checkpoint.load(path, other, other_optim)
    assert state["step"] == 7 and state["data"] == {"position": 7}
    for a, b in zip(model.parameters(), other.parameters()):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(optim.state_dict()["state"][0]["exp_avg"], other_optim.state_dict()["state"][0]["exp_avg"])
