"""The console scripts, and nothing else: ``autoep-train``, ``autoep-plan``, ``autoep-prepare-data`` and
``autoep-plot`` (``pyproject.toml``).

Each checks the command line before torch is even imported, so a typo fails in a second; then it runs
the trainer (``autoep.train.trainer``) or the dry run (``autoep.train.dry_run``). Exit codes and the
one-line errors: ``autoep.train.command``.

    autoep-train trainer.steps=5                   # python -m autoep.train trainer.steps=5
    torchrun --nproc-per-node 2 -m autoep.train parallel.ep_size=2
    autoep-plan parallel.ep_size=2                 # dry run: resolve on meta, print, write resolved.yaml
    autoep-prepare-data a.txt --tokenizer tok/ --out train.bin   # python -m autoep.train.prepare ...
    autoep-plot runs/a                             # the expert load heatmap, runs/a/load.png
"""
from __future__ import annotations

import sys


def train_main() -> None:
    """Console script ``autoep-train``; a config error is reported before torch is even imported."""
    from autoep.train.command import early_check

    early_check("autoep-train", sys.argv[1:])
    from autoep.train.trainer import main

    main()


def plan_main() -> None:
    """Console script ``autoep-plan``; a config error is reported before torch is even imported."""
    from autoep.train.command import early_check

    early_check("autoep-plan", sys.argv[1:])
    from autoep.train.dry_run import main

    main()


def prepare_data_main() -> None:
    """Console script ``autoep-prepare-data``: text files and a local tokenizer -> a packed token file."""
    from autoep.train.prepare import main

    main()


def plot_main() -> None:
    """Console script ``autoep-plot <run_dir>``: the expert load heatmap of a run (``autoep.train.plot``)."""
    from autoep.train.plot import main

    sys.exit(main())
