"""autoep's own trainer (``autoep-train``, ``autoep-plan``): the config schemas, the command line, models,
data, the loop, checkpoints, pretrained load and export, run directories, launch.

May import every layer below it (detect, plan, runtime). Run it with ``python -m autoep.train`` or
``torchrun --nproc-per-node N -m autoep.train``.
"""
