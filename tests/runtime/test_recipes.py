"""The helpers every recipe shares (``autoep.runtime.recipes``)."""
import blocks
import torch.nn as nn

from autoep import detect_moe_structure
from autoep.runtime.recipes import experts_of


def test_experts_of_follows_the_proven_path_not_the_name():
    block = blocks.MoE()
    structure = detect_moe_structure(block)
    assert experts_of(block, structure) is block.experts
    assert experts_of(block, structure.as_dict()) is block.experts  # as a resolved config gives it back
    holder = nn.Module()
    holder.ffn = nn.Module()
    holder.ffn.experts_list = block.experts
    moved = {**structure.as_dict(), "experts_path": "ffn.experts_list"}
    assert experts_of(holder, moved) is block.experts
