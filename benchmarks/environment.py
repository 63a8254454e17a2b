"""The environment of the child processes that benchmarks launch from the checkout."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_environment(**extra: str) -> dict[str, str]:
    """This process's environment plus ``extra``, with the checkout first on ``PYTHONPATH`` and
    whatever ``PYTHONPATH`` already held after it (e.g. packages installed with ``pip --target``)."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(paths)}
