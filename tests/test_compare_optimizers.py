"""benchmarks/compare_optimizers.py end to end on the CPU: three optimizers with the script's own settings (NewtonCG:
curvature batch, forward mode), a few steps of a micro model whose attention is SDPA switched to flashbob for curvature."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.environment import child_environment

ROOT = Path(__file__).resolve().parent.parent
MICRO = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "data.max_bytes=200000", "data.val_fraction=0.1",
    "data.context_length=64", "data.batch_size=2", "train.eval_batches=1", "train.threads=1", "model.attention=sdpa",
]  # fmt: skip
OPTIMIZERS = ["adamw", "sophiah", "newtoncg"]


def test_compare_optimizers_writes_csv_plots_and_table(tmp_path: Path) -> None:
    steps, tokens_per_step = 4, 2 * 64
    command = [
        sys.executable, "benchmarks/compare_optimizers.py", "--config", "configs/lm/tiny.yaml",
        "--optimizers", *OPTIMIZERS, "--tokens", str(steps * tokens_per_step + 5),
        "--out-dir", str(tmp_path / "runs"), "--docs", str(tmp_path / "docs"), *MICRO,
    ]  # fmt: skip
    done = subprocess.run(command, check=False, cwd=ROOT, env=child_environment(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    with open(tmp_path / "docs" / "optimizer_comparison.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for optimizer in OPTIMIZERS:
        mine = [r for r in rows if r["optimizer"] == optimizer]
        assert [int(r["step"]) for r in mine] == list(range(1, steps + 1))
        assert int(mine[-1]["tokens"]) == steps * tokens_per_step  # the budget, rounded down to whole steps
        assert float(mine[-1]["val_loss"]) > 0 and float(mine[-1]["train_s"]) > 0
    sophia = [r for r in rows if r["optimizer"] == "sophiah"]
    assert sophia[-1]["optimizer/unclipped_fraction"]  # SophiaH's statistics are columns
    newton = [r for r in rows if r["optimizer"] == "newtoncg"]
    assert {r["optimizer/curvature_rows"] for r in newton} == {"1.0"}, "the products ran on 1 of the 2 windows"
    assert all(1 <= float(r["optimizer/cg_iters"]) <= 4 for r in newton)
    for plot in ("tokens", "time"):
        assert (tmp_path / "docs" / f"optimizer_comparison_{plot}.png").stat().st_size > 0
    summary, costs = (table.splitlines() for table in done.stdout.strip().split("\n\n"))
    assert summary[0].startswith("| optimizer | status |") and len(summary) == 5
    assert [line.split(" | ")[:3] for line in summary[2:]] == [[f"| {o}", "ok", "4"] for o in OPTIMIZERS]
    # each kind of step from its second: SophiaH refreshes at step 1 only (update_period 10), its plain steps 3-4
    assert [line.split(" | ")[0] for line in costs[2:]] == ["| adamw", "| sophiah", "| sophiah, 0 refresh steps",
                                                            "| sophiah, 2 plain steps", "| newtoncg"]
    assert costs[2].split(" | ")[2] == "1.00" and 1 <= float(costs[-1].split(" | ")[3].rstrip(" |")) <= 4
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(OPTIMIZERS)


def test_child_runs_keep_the_callers_python_path(monkeypatch):
    """Benchmarks' child runs see the checkout first and the caller's PYTHONPATH after it (packages
    installed with ``pip --target`` on the GPU machine; dropping them broke the first H200 run)."""
    from benchmarks.environment import ROOT, child_environment

    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    env = child_environment(FLASHBOB_AUTOTUNE="0")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/tmp/site"] and env["FLASHBOB_AUTOTUNE"] == "0"


def test_every_step_is_logged_whatever_the_overrides(tmp_path, monkeypatch):
    """Training time is the sum of the logged step times: a train.log_interval override would leave steps out."""
    import argparse
    import subprocess

    from benchmarks import compare_optimizers

    commands = []
    monkeypatch.setattr(compare_optimizers.subprocess, "run",
                        lambda command, **_: commands.append(command) or subprocess.CompletedProcess(command, 0))
    args = argparse.Namespace(config="configs/lm/tiny.yaml", overrides=["train.log_interval=10"], timeout=10)
    compare_optimizers.run("adamw", 20, 128, args, tmp_path)
    assert [a for a in commands[0] if a.startswith("train.log_interval=")][-1] == "train.log_interval=1"


@pytest.mark.parametrize("script", ["compare_optimizers", "profile_step", "equal_time", "bench_ddp"])
def test_an_override_after_the_optimizer_names_is_refused(script: str) -> None:
    """``--optimizers adamw data.max_bytes=...`` used to take the override for an optimizer name (profile_step ran
    the optimizers before it without the override, on the H200, 2026-12-02): now argparse refuses it by name."""
    done = subprocess.run([sys.executable, f"benchmarks/{script}.py", "--optimizers", "adamw", "data.max_bytes=1000"],
                          cwd=ROOT, env=child_environment(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "argument --optimizers: invalid choice: 'data.max_bytes=1000'" in done.stderr
