"""``python -m autoep.train [overrides]`` and ``torchrun --nproc-per-node N -m autoep.train ...``: ``autoep-train``."""
from autoep.cli import train_main

if __name__ == "__main__":
    train_main()
