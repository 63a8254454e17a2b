"""Smoke test of benchmarks/forward_hvp_memory_cpu.py at a toy context: every workload runs in its own process
and the table and CSV hold one row per context and checkpointing setting (none, optim's, torch's)."""

import csv
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from benchmarks.environment import child_environment

ROOT = Path(__file__).resolve().parent.parent


def forward_mode_through_checkpoint() -> bool:
    """Whether this torch's non-reentrant activation checkpointing supports forward mode (2.13 does, 2.11 not)."""
    x = torch.randn(3)
    try:
        torch.func.jvp(lambda x: checkpoint(torch.sin, x, use_reentrant=False), (x,), (torch.ones(3),))
    except NotImplementedError:
        return False
    return True


def test_forward_hvp_memory_cpu_smoke(tmp_path):
    out = tmp_path / "memory.csv"
    result = subprocess.run(
        [sys.executable, "benchmarks/forward_hvp_memory_cpu.py", "--contexts", "32", "--out", str(out)],
        cwd=ROOT, env=child_environment(), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["context"], r["checkpointing"]) for r in rows] == [("32", "off"), ("32", "optim"), ("32", "torch")]
    for r in rows:
        assert all(float(r[f"{w}_mib"]) >= 0 for w in ("grad", "ror"))
        if r["checkpointing"] == "torch" and not forward_mode_through_checkpoint():
            assert r["for_mib"] == "" and "left blank" in result.stderr  # torch 2.11
        else:
            assert float(r["for_mib"]) >= 0
    assert result.stdout.strip().splitlines()[-1].startswith("| 32 | torch |")
