"""optim stands alone: importing it, or any of its modules, loads no flashbob module (the recipes hand
``optim.checkpoint`` flashbob's kept attention outputs; optim never reaches for them)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import optim

ROOT = Path(__file__).resolve().parent.parent

NO_FLASHBOB = "assert not any(m == 'flashbob' or m.startswith('flashbob.') for m in sys.modules)"


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_import_optim_loads_no_flashbob():
    result = run(f"import optim, sys; {NO_FLASHBOB}")
    assert result.returncode == 0, result.stderr


def test_no_optim_module_loads_flashbob():
    """Every module of optim, imported one after another; the first after which flashbob is loaded is named."""
    modules = [f"optim.{info.name}" for info in pkgutil.iter_modules(optim.__path__)]
    code = "\n".join([
        "import importlib, sys",
        f"for module in {modules!r}:",
        "    importlib.import_module(module)",
        "    loaded = [m for m in sys.modules if m == 'flashbob' or m.startswith('flashbob.')]",
        "    assert not loaded, f'importing {module} loaded {loaded}'",
    ])
    result = run(code)
    assert result.returncode == 0, result.stderr
    assert len(modules) > 20, modules  # the listing found the package's modules
