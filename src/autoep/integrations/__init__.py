"""Adapters that put autoep inside other trainers' loops: ``handle.ExpertParallel`` (any loop: a plain torchrun
loop, DDP), and the PyTorch Lightning and HF ``Trainer``/accelerate adapters built on it.

May import detect, plan and runtime; never ``autoep.train`` (autoep's own trainer) nor ``autoep.tools``.
"""
