"""Where the tests live: ``tests/`` (shared blocks and helpers) and one folder per package (``tests/detect`` ↔
``autoep/detect``, ...). Tests and benchmarks import helpers and each other by module name, so every folder
goes on ``sys.path`` (spawned ranks inherit it)."""
import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
PACKAGES = ("detect", "plan", "runtime", "train", "tools", "integrations")


def add() -> None:
    for path in [ROOT, *(os.path.join(ROOT, p) for p in PACKAGES)]:
        if path not in sys.path and os.path.isdir(path):
            sys.path.insert(0, path)
