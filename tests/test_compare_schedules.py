"""CPU smoke test of benchmarks/compare_schedules.py: every schedule runs in Triton's interpreter and agrees."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_compare_schedules_runs_and_the_schedules_agree(tmp_path):
    out = tmp_path / "schedules.csv"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "benchmarks/compare_schedules.py", "--device", "cpu", "--n", "24", "--heads", "1",
         "--head-dim", "16", "--causal", "1", "--reps", "1", "--check-n", "21",
         "--schedules", "three_pass", "two_pass", "four_pass", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    differences = re.findall(r"w\.r\.t\. \(q, k, v\): (.*)", result.stdout)
    assert len(differences) == 2
    for line in differences:
        assert all(float(d) < 1e-5 for d in line.split(", ")), line
    assert len(out.read_text().splitlines()) == 1 + 3
