"""``python -m autoep.tools.plot <run_dir>``: the expert load heatmap of a run, ``<run_dir>/load.png``
(the module form of ``autoep-plot``; the drawing lives in ``autoep.train.plot``, which the trainer calls at
the end of a run)."""
import sys

from autoep.train.plot import main

if __name__ == "__main__":
    sys.exit(main())
