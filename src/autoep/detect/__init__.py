"""Detection: read an MoE block's source and prove what it computes (``MoeStructure``), or refuse.

May import: torch (``nn``, tensors, functional), ``autoep.errors``. Never ``torch.distributed``, Hydra or
OmegaConf, nor any other autoep layer: it runs on a meta model before any process group exists.
"""
