"""benchmarks/bench_masks.py runs on the CPU (tiny sizes, the blocked backend) and writes every part's rows."""

import csv
import sys

from benchmarks import bench_masks


def test_the_masks_benchmark_writes_its_rows(tmp_path, monkeypatch):
    out = tmp_path / "masks.csv"
    monkeypatch.setattr(sys, "argv", ["bench_masks.py", "--device", "cpu", "--out", str(out),
                                      "--parts", "window", "documents", "block_mask", "accuracy"])
    bench_masks.main()
    rows = list(csv.DictReader(out.open()))
    assert {row["part"] for row in rows} == {"window", "documents", "block_mask", "accuracy"}
    assert all(row["status"] == "ok" for row in rows)
    assert all(float(row["ratio"]) > 0 for row in rows if row["part"] == "window" and row["case"] == "window")
    assert len([row for row in rows if row["part"] == "accuracy"]) == 2 * 2 * 9  # 2 masks, 2 dtypes, 9 outputs


def test_visible_area_counts_the_window_and_the_documents():
    assert bench_masks.visible_area(8) == 36
    assert bench_masks.visible_area(8, window=3) == 6 + 5 * 3
    assert bench_masks.visible_area(8, documents=2) == 2 * 10
