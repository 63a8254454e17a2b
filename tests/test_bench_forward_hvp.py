"""CPU smoke test of benchmarks/bench_forward_hvp.py: every row runs and the products of each group agree."""

import csv
import subprocess
import sys
from pathlib import Path

from benchmarks.environment import child_environment

ROOT = Path(__file__).resolve().parent.parent


def test_bench_forward_hvp_smoke(tmp_path):
    out = tmp_path / "forward_hvp.csv"
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_forward_hvp.py", "--smoke", "--out", str(out)],
        cwd=ROOT, env=child_environment(), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["workload"], r["attention"]) for r in rows] == [
        ("grad", "flashbob"), ("hvp_reverse", "flashbob"), ("hvp_forward", "flashbob"),
        ("hvp_forward_checkpointed", "flashbob"), ("hvp_forward_checkpointed_recompute_attention", "flashbob"),
        ("hvp_reverse_checkpointed", "flashbob"), ("ggn_curvlinops", "flashbob"), ("ggn_curvlinops", "sdpa_math"),
    ]
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 for r in rows)
    differences = {r["workload"]: float(r["rel_diff"]) for r in rows if r["rel_diff"]}
    assert set(differences) == {"hvp_forward", "hvp_forward_checkpointed", "hvp_reverse_checkpointed",
                                "hvp_forward_checkpointed_recompute_attention", "ggn_curvlinops"}
    assert all(d < 1e-5 for d in differences.values()), differences  # float32 on the CPU
    # other algorithms: some rounding differs (an exact 0 would mean the reference was compared with itself)
    assert differences["hvp_forward"] > 0 and differences["ggn_curvlinops"] > 0
    assert result.stdout.strip().splitlines()[-1].startswith("| ggn_curvlinops | sdpa_math | 24 |")
