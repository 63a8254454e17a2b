"""Smoke test of benchmarks/forward_hvp_memory_cpu.py at a toy context: every workload runs in its own process
and the table and CSV hold one row per context and checkpointing setting."""

import csv
import subprocess
import sys
from pathlib import Path

from benchmarks.environment import child_environment

ROOT = Path(__file__).resolve().parent.parent


def test_forward_hvp_memory_cpu_smoke(tmp_path):
    out = tmp_path / "memory.csv"
    result = subprocess.run(
        [sys.executable, "benchmarks/forward_hvp_memory_cpu.py", "--contexts", "32", "--out", str(out)],
        cwd=ROOT, env=child_environment(), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["context"], r["checkpoint_activations"]) for r in rows] == [("32", "False"), ("32", "True")]
    for r in rows:
        assert all(float(r[f"{w}_mib"]) >= 0 for w in ("grad", "ror", "for"))
    assert result.stdout.strip().splitlines()[-1].startswith("| 32 | on |")
