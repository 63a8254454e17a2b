"""Every Triton kernel compiles for Hopper (sm_90) with the installed Triton, in both code paths, on any machine.

Triton's interpreter (how CPU-only CI runs the kernels) skips the compiler, so errors of its CUDA pipeline showed
only on a GPU: Triton 3.6 failed on the "tma" dK/dV kernel at N = 1 with GQA (``Fatal pipeliner error``).
``tests/compile_sm90.py`` compiles each entry point down to ptxas with a stand-in sm_90 driver, in a subprocess
(this process runs the interpreter).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENTRIES = ("forward", "backward", "bob", "forward_jvp", "backward_jvp")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None,
                                reason="Triton's CUDA backend is not installed")


N1 = ["--n", "1", "--m", "45", "--heads", "4", "--kv-heads", "1"]
CAUSAL_GQA = ["--n", "45", "--m", "17", "--heads", "4", "--kv-heads", "2", "--causal"]


@pytest.mark.parametrize(("variant", "sizes"), [("base", N1), ("tma", N1), ("base", CAUSAL_GQA),
                                                ("tma", [*CAUSAL_GQA, "--masks"])],
                         ids=["N1-M45-gqa4-base", "N1-M45-gqa4-tma", "N45-M17-gqa2-causal-base",
                              "N45-M17-gqa2-causal-every-mask-tma"])
def test_every_kernel_compiles_for_hopper(tmp_path, variant, sizes):
    """N = 1 (Triton specialises it and folds the query loops away) and ragged causal GQA, bf16, d = 64; the last
    case with a window, document ids, a key mask and a block mask's tiles at once, so that the masks' code compiles
    too."""
    env = {**os.environ, "FLASHBOB_KERNEL_VARIANT": variant, "TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "tests/compile_sm90.py", *ENTRIES, *sizes], check=False, cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    report = [line for line in done.stdout.splitlines() if ":" in line]
    assert done.returncode == 0, "\n".join(report) + done.stderr[-2000:]
    assert report == [f"{entry}: ok" for entry in ENTRIES]

