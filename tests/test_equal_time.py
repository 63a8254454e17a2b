"""benchmarks/equal_time.py: the whole pipeline on the CPU (the tiny config, a micro model, budgets of a second),
its analysis on hand-made rows, and what it relies on in the LM recipe (train.max_seconds, validation windows that
do not depend on the seed, the installed packages' corpus)."""

from __future__ import annotations

import csv
import json
import math
from contextlib import nullcontext

import pytest
import torch

from benchmarks import equal_time as et
from recipes.common import data
from recipes.common.config import ConfigError
from recipes.common.distributed import Context
from recipes.lm import train as lm_train
from tests.runs import LM

MICRO = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "data.max_bytes=200000", "data.val_fraction=0.1",
    "data.context_length=64", "data.batch_size=2", "train.eval_batches=1", "train.threads=1", "model.attention=sdpa",
    "train.device=cpu",
]  # fmt: skip
SWEEP_S, BUDGET_S = 0.5, 1.0


def header(path) -> list[str]:
    with open(path, newline="") as f:
        return next(csv.reader(f))


def test_the_pipeline_sweeps_compares_summarises_and_resumes(tmp_path, monkeypatch, capsys):
    """Two optimizers (AdamW: warm-up and cosine; NewtonCG: a constant lr, ended by the budget) x two settings,
    then each one's best for one seed; a second invocation runs nothing and prints the same summary."""
    monkeypatch.setitem(et.GRIDS, "adamw", {"lr": (1e-3, 3e-3)})
    monkeypatch.setitem(et.GRIDS, "newtoncg", {"lr": (0.5, 1.0)})
    docs = tmp_path / "docs"
    argv = ["--config", "configs/lm/tiny.yaml", "--optimizers", "adamw", "newtoncg", "--sweep-seconds", str(SWEEP_S),
            "--budget-seconds", str(BUDGET_S), "--seeds", "1", "--docs", str(docs), "--out-dir", str(tmp_path / "runs"),
            "--edge-extensions", "1", *MICRO]  # fmt: skip
    et.main([*argv, "--plan"])
    plan = [line.split(" | ")[:3] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert plan == [["| calibration", "adamw", "base"], ["| calibration", "newtoncg", "base"],
                    ["| sweep", "adamw", "lr=0.001"], ["| sweep", "adamw", "lr=0.003"],
                    ["| sweep", "newtoncg", "lr=0.5"], ["| sweep", "newtoncg", "lr=1"],
                    ["| compare", "adamw", "best of the sweep"], ["| compare", "newtoncg", "best of the sweep"]]

    et.main(argv)
    out = capsys.readouterr().out
    assert header(docs / "equal_time_sweep.csv") == et.SWEEP_FIELDS
    assert header(docs / "equal_time.csv") == et.CURVE_FIELDS
    step_s = {r["optimizer"]: r["step_s"] for r in et.read_csv(docs / "equal_time_calibration.csv")}
    assert sorted(step_s) == ["adamw", "newtoncg"] and all(s > 0 for s in step_s.values())
    sweep = et.read_csv(docs / "equal_time_sweep.csv")
    on_grid, extended = sweep[:4], sweep[4:]
    assert [(r["optimizer"], r["setting"], r["seed"], r["status"]) for r in on_grid] == [
        ("adamw", "lr=0.001", 0, "ok"), ("adamw", "lr=0.003", 0, "ok"),
        ("newtoncg", "lr=0.5", 0, "ok"), ("newtoncg", "lr=1", 0, "ok")]
    # a run ends at the budget (train.max_seconds) or with its schedule's last step, whichever comes first
    assert all(r["val_loss"] > 0 and (r["end"] == "budget") == (r["steps"] < r["planned_steps"]) for r in on_grid)
    assert all(r["train_s"] >= SWEEP_S for r in on_grid if r["end"] == "budget")
    # two points per axis: the grid's best lies at an edge, so one point beyond it (--edge-extensions 1) each
    assert [r["optimizer"] for r in extended] == ["adamw", "newtoncg"]
    for row in extended:
        low, high = et.GRIDS[row["optimizer"]]["lr"]
        best_lr = et.parse_setting(et.best_settings(on_grid)[row["optimizer"]]["setting"])[0][1]
        beyond = low / (high / low) if best_lr == low else high * (high / low)
        assert et.parse_setting(row["setting"])[0][1] == pytest.approx(beyond, rel=1e-5)
    best = et.best_settings(sweep)

    rows = et.read_csv(docs / "equal_time.csv")
    curves = et.curves_of(rows)
    assert sorted(curves) == [("adamw", best["adamw"]["setting"], 1), ("newtoncg", best["newtoncg"]["setting"], 1)]
    for curve in curves.values():
        assert [r["train_s"] for r in curve] == sorted(r["train_s"] for r in curve) and curve[-1]["train_s"] > 0
        assert len({r["planned_steps"] for r in curve}) == 1
    adamw, newton = curves[("adamw", best["adamw"]["setting"], 1)], curves[("newtoncg", best["newtoncg"]["setting"], 1)]
    # AdamW's schedule fills 97% of the budget at its calibrated step time; NewtonCG's lr is constant and the
    # budget (train.max_seconds) ends it before the 10x its calibrated step time plans
    assert adamw[0]["planned_steps"] == 1 + math.floor(et.SCHEDULE_FILL * BUDGET_S / step_s["adamw"])
    assert newton[0]["planned_steps"] == 1 + math.ceil(et.CONSTANT_LR_STEPS * BUDGET_S / step_s["newtoncg"])
    assert newton[-1]["end"] == "budget" and newton[-1]["train_s"] >= BUDGET_S
    for plot in ("tokens", "time"):
        assert (docs / f"equal_time_{plot}.png").stat().st_size > 0

    targets = et.choose_targets(curves)
    assert 2 <= len(targets) <= 3 and targets == sorted(targets, reverse=True)
    assert all(et.time_to_target([(r["train_s"], r["val_loss"]) for r in c], targets[-1]) for c in curves.values())
    sections = out.strip().split("\n\n")
    assert sections[0].startswith("Sweep (equal_time_sweep.csv: 0.5 s of training per run, seed 0)")
    assert any(s.startswith("Time to target") for s in sections)
    seen = max(r["tokens"] for r in rows)
    assert f"the most tokens a run saw: {seen:,} ({seen / 180_000:.2f} epochs)" in out  # 90% of 200,000 bytes
    assert all(f"to {t:.3f}" in out for t in targets)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "the CPU"
    assert sections[-1].startswith(f"With equal 1 s training budgets on {device} (context 64, 128 tokens per step; "
                                   "seed 1), validation loss ")
    assert all(f"{t:.3f} first by " in sections[-1] for t in targets)

    before = {p.name: p.read_bytes() for p in docs.glob("*.csv")}
    et.main(argv)
    captured = capsys.readouterr()
    assert "-m recipes.lm" not in captured.err and captured.out == out
    assert {p.name: p.read_bytes() for p in docs.glob("*.csv")} == before
    et.main([*argv, "--plan"])
    assert "\n0 runs, about 0.0 GPU minutes" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="holds runs of another setup"):
        et.main([*argv, "optimizer.weight_decay=0.05"])


def test_time_to_target_interpolates_between_validations():
    points = [(10.0, 5.0), (20.0, 4.0), (30.0, 3.0)]
    assert et.time_to_target(points, 3.5) == pytest.approx(25.0)
    assert et.time_to_target(points, 4.0) == pytest.approx(20.0)
    assert et.time_to_target(points, 5.5) == 10.0  # reached at the first validation
    assert et.time_to_target(points, 2.9) is None


def curve(*losses: float, step_s: float = 10.0) -> list[dict]:
    return [{"step": i + 1, "train_s": step_s * (i + 1), "tokens": 1000 * (i + 1), "val_loss": loss}
            for i, loss in enumerate(losses)]


def test_targets_are_the_hardest_every_run_reaches_and_easier_ones():
    curves = {("adamw", "lr=0.001", 1): curve(6.0, 4.0, 3.0), ("sophiag", "lr=0.002", 1): curve(5.5, 3.6, 3.2, 3.25)}
    assert et.choose_targets(curves) == [3.5, 3.3, 3.2]  # 3.2: sophiag's lowest; adamw reaches it too
    curves[("newtoncg", "lr=1", 1)] = curve(3.4, 3.1)
    assert et.choose_targets(curves) == [3.3, 3.2]  # 3.5 is above newtoncg's first validation
    times = et.reach(curves, [3.3])
    assert times["adamw"][0] == (pytest.approx(27.0), pytest.approx(2700.0))  # 20 s + 10 s x (4.0 - 3.3) / 1.0
    assert times["newtoncg"][0] == (pytest.approx(40 / 3), pytest.approx(4000 / 3))
    two_seeds = {("adamw", "lr=0.001", 1): curve(4.0, 3.0), ("adamw", "lr=0.001", 2): curve(4.0, 3.0, step_s=20.0)}
    assert et.reach(two_seeds, [3.5])["adamw"][0][0] == pytest.approx(22.5)  # the mean of 15 and 30 s


def sweep_row(optimizer: str, setting: str, val_loss: float | None, status: str = "ok") -> dict:
    return {"optimizer": optimizer, "setting": setting, "val_loss": val_loss, "status": status}


def test_the_best_setting_is_the_lowest_final_loss_of_the_runs_that_ended_normally():
    rows = [sweep_row("adamw", "lr=0.001", 3.0), sweep_row("adamw", "lr=0.002", 2.5, "failed (exit 1)"),
            sweep_row("adamw", "lr=0.004", math.nan), sweep_row("adamw", "lr=0.003", 2.9),
            sweep_row("sophiag", "lr=0.001 rho=0.01", None, "stopped at 360 s"),
            sweep_row("newtoncg", "lr=0.5 damping=1", 3.4), sweep_row("newtoncg", "lr=1 damping=0.1", 3.3)]
    best = et.best_settings(rows)
    assert {optimizer: row["setting"] for optimizer, row in best.items()} == {"adamw": "lr=0.003",
                                                                              "newtoncg": "lr=1 damping=0.1"}
    assert et.grid_edges("newtoncg", "lr=1 damping=0.1") == ["lr", "damping"]
    assert et.grid_edges("sophiah", "lr=0.002 rho=0.04") == ["rho"] and et.grid_edges("adamw", "lr=0.002") == []
    assert et.parse_setting("lr=1 damping=0.1") == (("lr", 1.0), ("damping", 0.1)) and et.parse_setting("base") == ()
    assert et.label(et.parse_setting("lr=0.004 rho=0.01")) == "lr=0.004 rho=0.01"


def test_the_conclusion_names_who_reaches_each_target_first_and_by_what_factor():
    times = {"adamw": [(100.0, 1e6), (200.0, 2e6)], "sophiag": [(80.0, 7e5), (220.0, 2e6)],
             "newtoncg": [(300.0, 1e5), (None, None)]}
    assert et.conclusion(times, [3.5, 3.2], "With equal 240 s") == (
        "With equal 240 s, validation loss 3.500 first by sophiag in 80 s, 1.25x sooner than AdamW (100 s); "
        "3.200 first by adamw in 200 s, 1.10x sooner than the next, sophiag (220 s).")
    assert et.conclusion({}, [], "With equal 240 s") == "With equal 240 s: no target loss that every run reaches."



def comparison_row(optimizer: str, setting: str, seed: int, step: int, val_loss: float | None,
                   status: str = "ok") -> dict:
    return {"setup": "x", "optimizer": optimizer, "setting": setting, "seed": seed, "budget_s": 240.0,
            "planned_steps": 100, "status": status, "end": "schedule" if status == "ok" else None, "wall_s": 300.0,
            "step": step, "tokens": step and 1000 * step, "train_s": step and float(step), "train_loss": val_loss, "val_loss": val_loss,
            "lr": 1e-3, "max_memory_gib": 1.0}


def test_two_settings_of_one_optimizer_are_not_averaged_as_seeds():
    """After the sweep's best changes (a further edge extension), the CSV holds runs of the old and the new best."""
    rows = [comparison_row("adamw", "lr=0.0005", 1, 10, 6.0), comparison_row("adamw", "lr=0.0005", 1, 20, 3.0),
            comparison_row("sophiah", "rho=0.64", 1, 10, 6.0), comparison_row("sophiah", "rho=0.64", 1, 20, 5.5),
            comparison_row("sophiah", "rho=2.56", 1, 10, 6.0), comparison_row("sophiah", "rho=2.56", 1, 20, 3.5)]
    curves = et.curves_of(rows)
    times = et.reach(curves, [5.5])
    assert times["sophiah (rho=0.64)"] == [(20.0, 20000.0)] and times["sophiah (rho=2.56)"] == [(12.0, 12000.0)]
    table = et.run_table(rows)
    assert "| sophiah (rho=2.56) | rho=2.56 | 1 | 3.500 (3.500) |" in table and "1, 1" not in table


def test_a_run_that_failed_neither_chooses_the_targets_nor_counts_in_the_mean_final_loss():
    rows = [comparison_row("adamw", "a", 1, 10, 6.0), comparison_row("adamw", "a", 1, 20, 3.0),
            comparison_row("adamw", "a", 2, 10, 6.5, "failed (exit 1)"),
            comparison_row("adamw", "a", 3, None, None, "stopped at 540 s"),  # no validation before it stopped
            comparison_row("sophiah", "b", 1, 10, 6.0), comparison_row("sophiah", "b", 1, 20, 3.5)]
    curves = et.curves_of(rows)
    assert et.choose_targets(curves) == [3.8, 3.6, 3.5]  # not [] (the failed run's 6.5 is above every first point)
    assert et.reach(curves, [3.5])["adamw"] == [(None, None)]  # seeds 2 and 3 never reach it: not seed 1's alone
    table = et.run_table(rows)
    assert "| adamw | a | 1, 2, 3 | 3.000 (3.000, failed (exit 1) at 6.500, stopped at 540 s) |" in table


def test_the_hardest_target_is_never_rounded_below_a_runs_lowest_loss():
    curves = {("adamw", "a", 1): curve(7.0, 3.2000000004), ("sophiag", "b", 1): curve(7.0, 2.0)}
    targets = et.choose_targets(curves)
    assert targets[-1] == 3.201 and all(t is not None for t, _ in et.reach(curves, targets)["adamw"])
    assert et.choose_targets({("adamw", "a", 1): curve(7.0, 3.2)})[-1] == 3.2  # an exact one stays


# --- what the pipeline relies on in the LM recipe ---


def test_max_seconds_ends_the_run_after_the_step_that_reaches_it(tmp_path):
    cfg = LM.config(tmp_path, "train.steps=100000", "train.max_seconds=0.3", "train.eval_interval=100000")
    last = lm_train.train(cfg)
    metrics = [json.loads(line) for line in (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines()]
    tokens_per_step = cfg.data.batch_size * cfg.data.context_length
    seconds = [tokens_per_step / m["train/tokens_per_s"] for m in metrics if m["step"] > 1]  # step 1 not counted
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1)) and len(metrics) < 100000
    assert sum(seconds[:-1]) < 0.3 <= sum(seconds)
    assert "val/loss" in metrics[-1] and last["val/loss"] == metrics[-1]["val/loss"]  # the last step evaluates
    assert (tmp_path / "tiny" / "checkpoints" / f"step_{len(metrics):08d}.pt").is_file()
    with pytest.raises(ConfigError, match=r"^train.max_seconds must be >= 0, got -1.0$"):
        LM.config(tmp_path, "train.max_seconds=-1")


def test_the_validation_windows_are_the_same_for_every_seed(tmp_path, monkeypatch):
    built = []

    class Recorded(data.Batches):
        def __init__(self, tokens, context_length, batch_size, seed, split, **shard):
            built.append((split, seed))
            super().__init__(tokens, context_length, batch_size, seed, split, **shard)

    monkeypatch.setattr(data, "Batches", Recorded)
    for seed in (1, 2):
        lm_train.build(LM.config(tmp_path, f"train.seed={seed}"), torch.device("cpu"), nullcontext, Context())
    assert built == [("train", 1), ("validation", data.VALIDATION_SEED),
                     ("train", 2), ("validation", data.VALIDATION_SEED)]


def test_the_packages_corpus_is_the_installed_packages_source(tmp_path):
    sources = data.package_sources()
    assert sources and all(name.endswith(".py") and path.is_file() for name, path in sources[:50])
    first, second = (data.load_corpus("packages", None, 200_000, 0.1, "uint8") for _ in range(2))
    assert (len(first.train), len(first.val)) == (180_000, 20_000)
    assert first.train.tobytes() == second.train.tobytes() and first.val.tobytes() == second.val.tobytes()
    training_files = [path for name, path in sources[:200] if not data.is_validation(name, 0.1)]
    stream = b"".join(path.read_bytes() + data.SEPARATOR for path in training_files)
    assert len(stream) > 1000 and first.train.tobytes()[:1000] == stream[:1000]  # the files in order of their names
    assert LM.config(tmp_path, "data.source=packages").data.source == "packages"  # no data.path needed


def test_the_sweep_extends_an_axis_while_its_best_lies_at_the_edge(monkeypatch):
    """Beyond the grid only once every grid point has run, one point per edge axis (the best's other values kept,
    the axis continued by its ratio), at most the limit beyond each end; a best inside the grid adds nothing."""
    monkeypatch.setitem(et.GRIDS, "sophiah", {"lr": (2.5e-4, 5e-4, 1e-3), "rho": (0.01, 0.04)})
    losses = {"lr=0.00025 rho=0.01": 5.8, "lr=0.00025 rho=0.04": 5.7, "lr=0.0005 rho=0.01": 6.2,
              "lr=0.0005 rho=0.04": 6.1, "lr=0.001 rho=0.01": 6.3}
    rows = [sweep_row("sophiah", setting, loss) for setting, loss in losses.items()]
    assert et.extension_points("sophiah", rows, 2) == []  # the grid is not finished
    rows.append(sweep_row("sophiah", "lr=0.001 rho=0.04", 5.0, "failed (exit 1)"))
    assert [et.label(p) for p in et.extension_points("sophiah", rows, 2)] == ["lr=0.000125 rho=0.04",
                                                                              "lr=0.00025 rho=0.16"]
    assert et.grid_edges("sophiah", "lr=0.00025 rho=0.04", rows) == ["lr", "rho"]
    rows += [sweep_row("sophiah", "lr=0.000125 rho=0.04", 5.6), sweep_row("sophiah", "lr=0.00025 rho=0.16", 5.8)]
    assert [et.label(p) for p in et.extension_points("sophiah", rows, 2)] == ["lr=6.25e-05 rho=0.04"]
    assert et.extension_points("sophiah", rows, 1) == []  # one point beyond the low end of lr already
    rows.append(sweep_row("sophiah", "lr=6.25e-05 rho=0.04", 5.65))
    assert et.extension_points("sophiah", rows, 2) == []  # the best, lr=0.000125, lies inside
    assert et.grid_edges("sophiah", "lr=0.000125 rho=0.04", rows) == []
    adamw = [sweep_row("adamw", "lr=0.001", 4.8), sweep_row("adamw", "lr=0.002", 5.2), sweep_row("adamw", "lr=0.004", 5.7)]
    assert [et.label(p) for p in et.extension_points("adamw", adamw, 2)] == ["lr=0.0005"]
    assert et.extension_points("adamw", adamw[:1] + [sweep_row("adamw", "lr=0.002", 4.7)] + adamw[2:], 2) == []


def test_the_gpu_configs_and_the_full_plan(tmp_path, capsys):
    """Both configs validate; their GPT has 81,801,984 parameters at V = 32,768 (tied embeddings) and both take
    32,768 tokens per step; the plan for the H200 holds 4 calibrations, every grid point (at most 3 x 2) and
    4 optimizers x 2 seeds."""
    for name, context in (("equal_time_8k", 8192), ("equal_time_32k", 32768)):
        cfg = lm_train.load_config(f"configs/lm/{name}.yaml")
        assert cfg.data.context_length == context and cfg.data.batch_size * context == 32768
        model = lm_train.GPT(**{**dict(cfg.model), "vocab_size": cfg.data.vocab_size, "attention": "blocked"})
        assert sum(p.numel() for p in model.parameters()) == 81_801_984
    assert all(len(et.grid(optimizer)) <= 6 for optimizer in et.OPTIMIZERS)
    et.main(["--plan", "--docs", str(tmp_path)])
    phases = [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert phases == ["| calibration"] * 4 + ["| sweep"] * (3 + 6 + 6 + 6) + ["| compare"] * 8
