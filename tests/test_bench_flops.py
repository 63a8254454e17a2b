"""The benchmarks' FLOP conventions (docs/algorithm.md): per (batch, query head) in units of N·M·d, halved for
a causal mask at N = M and the kept area of a top-left aligned one otherwise; and the committed result CSVs'
TFLOP/s agree with them."""

import csv
from pathlib import Path

import pytest

from benchmarks import bench_jvp_kernels, timing

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
ALL_NMD = {**timing.FLOPS_PER_NMD, **bench_jvp_kernels.FLOPS_PER_NMD}


def test_attention_tflops_conventions():
    n, d, heads, batch = 16384, 128, 16, 2
    nmd = n * n * d * heads * batch
    assert timing.attention_tflops("bob", 1.0, batch=batch, heads=heads, n=n, m=n, head_dim=d,
                                   causal=False) == pytest.approx(38 * nmd / 1e-3 / 1e12)
    for workload, per_nmd in timing.FLOPS_PER_NMD.items():
        full = timing.attention_tflops(workload, 2.0, batch=batch, heads=heads, n=n, m=n, head_dim=d, causal=False)
        half = timing.attention_tflops(workload, 2.0, batch=batch, heads=heads, n=n, m=n, head_dim=d, causal=True)
        assert full == pytest.approx(per_nmd * nmd / 2e-3 / 1e12)
        assert half == pytest.approx(full / 2)  # N = M: exactly halved, as every committed figure


@pytest.mark.parametrize(("n", "m", "kept"), [(1024, 4096, 1024 * 1024 / 2), (4096, 1024, 4096 * 1024 - 1024 * 1024 / 2),
                                              (777, 777, 777 * 777 / 2)])
def test_causal_with_n_not_m_counts_the_kept_area(n, m, kept):
    """Top-left aligned (query i sees keys j <= i): N < M keeps N²/2 of N·M, not N·M/2 (a 4x overcount at M = 4N)."""
    got = timing.attention_tflops("fwd", 1.0, batch=1, heads=1, n=n, m=m, head_dim=64, causal=True)
    assert got == pytest.approx(4 * kept * 64 / 1e-3 / 1e12)


def test_bench_jvp_kernels_counts_batch_and_m():
    kwargs = {"heads": 4, "n": 2048, "head_dim": 128, "causal": True}
    assert bench_jvp_kernels.tflops("backward_jvp", 3.0, **kwargs) == pytest.approx(
        timing.tflops(24, 3.0, batch=1, m=2048, **kwargs))
    assert bench_jvp_kernels.tflops("forward_jvp", 3.0, batch=3, **kwargs) == pytest.approx(
        3 * bench_jvp_kernels.tflops("forward_jvp", 3.0, **kwargs))


def test_committed_csv_tflops_follow_the_conventions():
    checked = 0
    for path in sorted(RESULTS.glob("*.csv")):
        with path.open() as f:
            rows = list(csv.DictReader(f))
        if not rows or not {"tflops", "ms", "workload", "n", "heads", "head_dim", "causal"} <= set(rows[0]):
            continue
        for row in rows:
            if not row["tflops"] or not row["ms"] or row["workload"] not in ALL_NMD:
                continue
            n = int(row["n"])
            want = timing.tflops(ALL_NMD[row["workload"]], float(row["ms"]), batch=int(row.get("batch") or 1),
                                 heads=int(row["heads"]), n=n, m=int(row.get("m") or n), head_dim=int(row["head_dim"]),
                                 causal=row["causal"] in ("True", "1"))
            assert float(row["tflops"]) == pytest.approx(want, rel=1e-3), (path.name, row)
            checked += 1
    assert checked > 300
