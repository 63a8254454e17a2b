"""benchmarks/bench_recipe_steps.py runs on the CPU (the tiny LM config) and times every optimizer with
train.compile off and on."""

import csv
import sys

from benchmarks import bench_recipe_steps


def test_the_recipe_step_benchmark_writes_its_rows(tmp_path, monkeypatch):
    out = tmp_path / "steps.csv"
    monkeypatch.setattr(sys, "argv", ["bench_recipe_steps.py", "--device", "cpu", "--out", str(out)])
    bench_recipe_steps.main()
    rows = list(csv.DictReader(out.open()))
    assert [(row["optimizer"], row["compile"]) for row in rows] == [
        ("adamw", "False"), ("adamw", "True"), ("sophiah", "False"), ("sophiah", "True")]
    assert all(row["status"] == "ok" and float(row["mean_ms"]) > 0 for row in rows)
    assert all(float(row["ratio"]) > 0 for row in rows)
    sophia = [row for row in rows if row["optimizer"] == "sophiah"]
    assert all(float(row["refresh_ms"]) > 0 and float(row["plain_ms"]) > 0 for row in sophia)
