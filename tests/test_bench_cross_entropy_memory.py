"""benchmarks/bench_cross_entropy_memory.py runs end to end on the CPU (times only; memory needs CUDA)."""

import csv
import subprocess
import sys
from pathlib import Path

from benchmarks.environment import ROOT, child_environment


def test_smoke_writes_one_row_per_call_and_chunk(tmp_path: Path) -> None:
    out = tmp_path / "ce.csv"
    command = [sys.executable, "benchmarks/bench_cross_entropy_memory.py", "--device", "cpu", "--tokens", "40",
               "--vocab", "300", "--width", "8", "--small-chunk", "600", "--reps", "1", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=child_environment(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    calls = ["H_L u", "GGN product (reverse)", "GGN product (forward)", "GGN product (forward, lean)", "SophiaG refresh"]
    assert [(r["call"], r["chunk_elements"]) for r in rows] == [(c, k) for k in ("16777216", "600") for c in calls]
    assert all(float(r["ms"]) > 0 for r in rows)
