"""The wheel installs the packages users import, ``flashbob`` and ``optim``, with the kernels' JSON tables, and
nothing else at the top level of site-packages: ``recipes``, ``benchmarks`` and ``tests`` run from the checkout
(a top-level ``recipes`` would collide with the distribution of that name on PyPI)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"flashbob", "optim"}
# what a checkout may hold besides its sources: left out of the copy the wheel is built from
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv*", "runs", "wandb", "build", "dist", "*.egg-info", "__pycache__",
                                     ".pytest_cache", ".hypothesis", ".whl")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel setuptools builds from a copy of the checkout (so that no build folder lands in the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source, out = tmp / "source", tmp / "out"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCES)
    build = f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))"
    out.mkdir()
    done = subprocess.run([sys.executable, "-c", build], cwd=source, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    with zipfile.ZipFile(out / done.stdout.split()[-1]) as archive:
        yield archive


def test_the_wheel_holds_flashbob_and_optim_alone(wheel):
    top = {name.split("/")[0] for name in wheel.namelist()}
    dist_info = {name for name in top if name.endswith(".dist-info")}
    assert len(dist_info) == 1 and top - dist_info == PACKAGES
    top_level = wheel.read(f"{dist_info.pop()}/top_level.txt").decode().split()
    assert set(top_level) == PACKAGES


def test_the_wheel_holds_every_module_and_the_kernels_tables(wheel):
    names = set(wheel.namelist())
    sources = {p.relative_to(ROOT).as_posix() for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    tables = {p.relative_to(ROOT).as_posix() for p in (ROOT / "flashbob/kernels").rglob("*.json")}
    assert "flashbob/kernels/spaces.json" in tables and "flashbob/kernels/tuned/NVIDIA_H200.json" in tables
    assert sources - names == set() and tables - names == set()


def test_the_wheel_declares_what_flashbob_imports_on_a_cpu(wheel):
    """numpy: Triton's interpreter (``TRITON_INTERPRET=1``, the kernels on a CPU) imports it, and torch warns
    on import without it."""
    metadata = next(name for name in wheel.namelist() if name.endswith(".dist-info/METADATA"))
    lines = wheel.read(metadata).decode().splitlines()
    requires = {re.match(r"Requires-Dist: ([\w.-]+)", line)[1] for line in lines
                if line.startswith("Requires-Dist:") and "extra ==" not in line}
    assert requires == {"torch", "triton", "einops", "numpy"}
