"""Adapters that put autoep inside other trainers' loops (PyTorch Lightning, HF ``Trainer``/accelerate).

May import detect, plan and runtime; never ``autoep.train`` (autoep's own trainer) nor ``autoep.tools``.
"""
