"""AdamW, SophiaH, SophiaG and NewtonCG for equal wall-clock budgets, each tuned first (GPU).

Run from the checkout on one GPU; each command can be repeated until it has nothing left to do::

    PYTHONPATH=. python benchmarks/equal_time.py --plan                        # runs left, GPU minutes
    PYTHONPATH=. python benchmarks/equal_time.py --sweep-only --max-minutes 9   # the tuning sweep
    PYTHONPATH=. python benchmarks/equal_time.py --compare-only --max-minutes 9 # the comparison, then its summary
    PYTHONPATH=. python benchmarks/equal_time.py --config configs/lm/equal_time_32k.yaml --stem equal_time_32k \\
        --compare-only --top 2 --seeds 1 --max-minutes 9                        # the best two at 32K

On a machine whose command is stopped at a time limit, add ``--mirror DIR`` (a folder that comes back
even from a stopped command): each CSV and plot is copied there as soon as it is written.

Every run is ``python -m recipes.lm`` launched by :func:`benchmarks.compare_optimizers.run` (one
process per run, ``FLASHBOB_AUTOTUNE=0``, the optimizer's ``SETTINGS`` of that script) on
``--config`` (default configs/lm/equal_time_8k.yaml) and the command line's ``key=value``
overrides. Training time is what compare_optimizers counts: the sum of the logged step times
from step 2 on (step 1 compiles; start-up, evaluation and checkpointing are left out). A run's
budget is training time: ``train.max_seconds`` stops it after the step that reaches the budget,
and its ``train.steps`` are the steps its calibrated step time fits into
:data:`SCHEDULE_FILL` of the budget, so that its warm-up (:data:`WARMUP_FRACTION` of the steps)
and cosine decay end with the budget. Where the learning rate is constant (NewtonCG's settings:
no warm-up, no decay) the budget alone ends the run.

1. Calibration, once per optimizer and ``--stem``: :data:`CALIBRATION_STEPS` steps with the
   optimizer's base settings; its step time is the mean from step 3 on (two of those steps
   refresh Sophia's Hessian estimate, one in ten as in the runs).
2. Sweep (not with ``--compare-only``), ``--sweep-seconds`` (60) per run at the config's
   ``train.seed``: every point of the optimizer's :data:`GRIDS`, then, while the best lies at the edge of an
   axis, the next point beyond it (:func:`extension_points`, at most ``--edge-extensions`` (2) beyond each end);
   the best point is the one with the lowest validation loss at the end among the runs that ended normally.
   Writes one row per run to ``--sweep-csv`` (default ``<docs>/equal_time_sweep.csv``).
3. Comparison (not with ``--sweep-only``): each optimizer's best point of the sweep for
   ``--budget-seconds`` (240) per run and ``--seeds`` (1 2: not the seed it was tuned on; seed 1
   of every optimizer first), :data:`COMPARE_EVALUATIONS` validations, evenly spaced in steps, on
   the same held-out windows for every run and seed. Writes ``<docs>/<stem>.csv`` (one row per
   validation: tokens, training seconds, train loss averaged since the last validation,
   validation loss, learning rate, peak memory, and the run's columns), ``<stem>_tokens.png``
   and ``<stem>_time.png`` (validation loss against tokens and training seconds), and prints
   the Markdown summary last: the sweep, the runs (final validation loss, tokens/s, peak
   memory), the time and tokens to 2-3 target losses that every run reaches
   (:func:`choose_targets`; the curve is interpolated linearly between validations) and one
   sentence generated from those numbers (:func:`conclusion`).

Resumable: each finished run's rows are written at once (``<stem>_calibration.csv`` holds the
step times), and a run whose (optimizer, setting, seed) and budget already has rows is skipped;
the rows name the setup (a digest of the config and overrides), and a file of another setup is
refused. ``--max-minutes`` starts no run that its estimate (budget + the mean overhead of the
runs so far) would carry past the limit; ``--plan`` prints the runs left and their GPU minutes.
A run that failed (diverged, out of memory, stopped by the timeout) is kept with its status;
delete its rows to run it again. Run folders (metrics, config) go to ``--out-dir``; their
checkpoints are deleted after each run, and the BPE cache is ``<out-dir>/bpe_cache`` unless the
config names one.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from omegaconf import DictConfig, OmegaConf

from benchmarks import compare_optimizers
from benchmarks.results import write_rows
from recipes.common.distributed import Context
from recipes.lm.train import load_config, load_tokens

ROOT = Path(__file__).resolve().parent.parent
OPTIMIZERS = ["adamw", "sophiah", "sophiag", "newtoncg"]
# Each optimizer's sweep: every combination of these values on top of its SETTINGS in compare_optimizers.py, then
# points beyond an edge where the best lies (:func:`extension_points`). AdamW's step moves a coordinate by about
# lr; Sophia's clipped step by up to lr, mostly by lr exactly (a sign step: 85-90% of the coordinates clip at
# these rho), so its grid starts 4x lower; rho spans SophiaH's published 0.01 and SophiaG's 0.04. NewtonCG scales
# its CG step (found by backtracking and an Armijo search) by lr; damping is the initial Levenberg-Marquardt
# damping, adapted after. Every axis is geometric: an extension continues it by the ratio of its first two values.
GRIDS = {
    "adamw": {"lr": (1e-3, 2e-3, 4e-3)},
    "sophiah": {"lr": (2.5e-4, 5e-4, 1e-3), "rho": (0.01, 0.04)},
    "sophiag": {"lr": (2.5e-4, 5e-4, 1e-3), "rho": (0.01, 0.04)},
    "newtoncg": {"lr": (0.25, 0.5, 1.0), "damping": (0.1, 1.0)},
}
EDGE_EXTENSIONS = 2  # at most this many points beyond each end of each axis (--edge-extensions)
KEYS = {"lr": "optimizer.lr", "rho": "optimizer.kwargs.rho", "damping": "optimizer.kwargs.damping"}
CALIBRATION_STEPS = 22  # step time: the mean of steps 3-22
SCHEDULE_FILL = 0.97  # the scheduled steps fill this share of the budget at the calibrated step time
WARMUP_FRACTION = 0.05
CONSTANT_LR_STEPS = 10  # a constant-lr run plans 10x the steps its budget fits: the budget ends it
SWEEP_EVALUATIONS, COMPARE_EVALUATIONS = 4, 24
TARGET_OFFSETS = (0.0, 0.1, 0.3)  # nats above the hardest target every run reaches (rounded up to 0.001)
OVERHEAD_S = 45.0  # a run's seconds beyond its budget (start-up, compilation, validation) until runs tell
CALIBRATION_S = 30.0  # a calibration's seconds beyond that overhead (its steps), for the estimates
TIMEOUT_MARGIN_S = 300.0  # a run still going this long after its budget is stopped

RUN_FIELDS = ["setup", "optimizer", "setting", "seed", "budget_s", "planned_steps", "status", "end", "wall_s"]
SWEEP_FIELDS = [*RUN_FIELDS, "steps", "tokens", "train_s", "tokens_per_s", "train_loss", "val_loss",
                "max_memory_gib"]
CURVE_FIELDS = [*RUN_FIELDS, "step", "tokens", "train_s", "train_loss", "val_loss", "lr", "max_memory_gib"]
CALIBRATION_FIELDS = ["setup", "optimizer", "steps", "step_s", "tokens_per_s", "max_memory_gib", "wall_s"]
TEXT_FIELDS = {"setup", "optimizer", "setting", "status", "end"}
INTEGER_FIELDS = {"seed", "planned_steps", "steps", "tokens", "step"}


@dataclass(frozen=True)
class Run:
    """One training run: an optimizer, a point of its grid (``()``: its base settings) and a seed."""

    optimizer: str
    point: tuple[tuple[str, float], ...]
    seed: int

    @property
    def setting(self) -> str:
        return label(self.point)

    @property
    def overrides(self) -> list[str]:
        return [f"{KEYS[key]}={value!r}" for key, value in self.point]

    def folder(self, phase: str) -> str:
        return f"{phase}/{self.optimizer}-{self.setting.replace(' ', '_').replace('=', '')}-s{self.seed}"


def grid(optimizer: str) -> list[tuple[tuple[str, float], ...]]:
    """Every point of ``optimizer``'s grid (one empty point where it has none)."""
    axes = GRIDS.get(optimizer, {})
    return [tuple(zip(axes, values)) for values in product(*axes.values())]


def label(point: tuple[tuple[str, float], ...]) -> str:
    """A grid point as ``"lr=0.002 rho=0.04"`` (``"base"`` for none)."""
    return " ".join(f"{key}={value:g}" for key, value in point) or "base"


def parse_setting(setting: str) -> tuple[tuple[str, float], ...]:
    """The inverse of :func:`label`."""
    if setting == "base":
        return ()
    return tuple((key, float(value)) for key, value in (pair.split("=") for pair in setting.split()))


# --- CSV files: read with types, written whole under a temporary name ---


def read_csv(path: Path) -> list[dict]:
    """The rows of ``path`` (none if it does not exist), numbers as numbers, empty cells as ``None``."""
    if not path.is_file():
        return []

    def value(key: str, text: str):
        if text == "" or key in TEXT_FIELDS:
            return text or None
        return int(text) if key in INTEGER_FIELDS else float(text)

    with open(path, newline="") as f:
        return [{key: value(key, text) for key, text in row.items()} for row in csv.DictReader(f)]


def append_rows(path: Path, fields: list[str], rows: list[dict]) -> None:
    """Add ``rows`` to the CSV ``path``, replaced by rename: a stopped process leaves the old file or the new."""
    temporary = path.with_name(f".{path.name}.tmp")
    write_rows(temporary, read_csv(path) + rows, fields)
    os.replace(temporary, path)


def check_setup(path: Path, setup: str) -> None:
    """Refuse to add runs of ``setup`` to a file that holds runs of another."""
    others = {row["setup"] for row in read_csv(path)} - {setup}
    if others:
        sys.exit(f"{path} holds runs of another setup ({', '.join(sorted(others))}; this one is {setup}): the config "
                 "or its overrides changed. Pass the same ones, or move the file away (or choose --docs/--stem)")


def fingerprint(cfg: DictConfig) -> str:
    """12 hex digits of the resolved config but where files go (name, out_dir, data.cache_dir, logger)."""
    settings = OmegaConf.to_container(cfg, resolve=True)
    for key in ("name", "out_dir", "logger"):
        settings.pop(key)
    settings["data"].pop("cache_dir")
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


# --- the analysis: pure functions of the rows ---


def final_loss(row: dict) -> float | None:
    """The run's final validation loss if it ended normally (status ``ok``) with a finite one, else ``None``."""
    loss = row["val_loss"]
    return loss if row["status"] == "ok" and loss is not None and math.isfinite(loss) else None


def best_settings(sweep_rows: list[dict]) -> dict[str, dict]:
    """Per optimizer, the sweep row with the lowest final validation loss among the runs that ended normally."""
    best: dict[str, dict] = {}
    for row in sweep_rows:
        loss = final_loss(row)
        if loss is None:
            continue
        if row["optimizer"] not in best or loss < best[row["optimizer"]]["val_loss"]:
            best[row["optimizer"]] = row
    return best


def grid_edges(optimizer: str, setting: str, rows: list[dict] = ()) -> list[str]:
    """The axes (of more than one value in the grid) on which ``setting`` lies at the smallest or largest value of
    the grid and of the ``rows`` of ``optimizer`` swept so far."""
    axes = GRIDS.get(optimizer, {})
    tried = swept_values(optimizer, rows)
    return [key for key, value in parse_setting(setting) if len(axes.get(key, ())) > 1
            and value in (min(axes[key] + tried.get(key, ())), max(axes[key] + tried.get(key, ())))]


def swept_values(optimizer: str, rows: list[dict]) -> dict[str, tuple[float, ...]]:
    """Per axis, the values of the sweep ``rows`` of ``optimizer``."""
    tried: dict[str, set[float]] = {}
    for row in rows:
        if row["optimizer"] == optimizer:
            for key, value in parse_setting(row["setting"]):
                tried.setdefault(key, set()).add(value)
    return {key: tuple(sorted(values)) for key, values in tried.items()}


def extension_points(optimizer: str, rows: list[dict], limit: int) -> list[tuple[tuple[str, float], ...]]:
    r"""The points to sweep beyond the grid because the best so far lies at an edge.

    Once every grid point of ``optimizer`` is in ``rows`` (the sweep so far), take the best run
    (:func:`best_settings`). For each axis of more than one value on which its value :math:`v` is the smallest
    (largest) swept, the point :math:`v / r` (:math:`v r`) with the best's other values, :math:`r` the ratio of
    the axis's first two grid values, unless ``limit`` points already lie beyond that end of the grid. The sweep
    ends when the best is inside on every axis or the limit is reached (the summary then marks the edge).
    """
    axes = GRIDS.get(optimizer, {})
    mine = [row for row in rows if row["optimizer"] == optimizer]
    swept = {row["setting"] for row in mine}
    best = best_settings(mine).get(optimizer)
    if best is None or any(label(point) not in swept for point in grid(optimizer)):
        return []
    point, tried = dict(parse_setting(best["setting"])), swept_values(optimizer, mine)
    points = []
    for key, values in axes.items():
        if len(values) < 2:
            continue
        ratio = values[1] / values[0]
        for step, edge, beyond in ((1 / ratio, min(tried[key]), [v for v in tried[key] if v < min(values)]),
                                   (ratio, max(tried[key]), [v for v in tried[key] if v > max(values)])):
            if point[key] == edge and len(beyond) < limit:
                points.append(tuple((k, float(f"{v * step:.6g}") if k == key else v) for k, v in point.items()))
    return [p for p in points if label(p) not in swept]


def curves_of(rows: list[dict]) -> dict[tuple[str, str, int], list[dict]]:
    """The validation curve of each (optimizer, setting, seed), in step order: its rows of a finite validation
    loss (none for a run that failed before its first validation: it reaches no target)."""
    curves: dict[tuple[str, str, int], list[dict]] = {}
    for row in rows:
        curve = curves.setdefault((row["optimizer"], row["setting"], row["seed"]), [])
        if row["val_loss"] is not None and math.isfinite(row["val_loss"]):
            curve.append(row)
    return {key: sorted(curve, key=lambda r: r["step"]) for key, curve in curves.items()}


def ended_normally(curve: list[dict]) -> bool:
    """Whether the run of ``curve`` has validations and ended normally (status ``ok``)."""
    return bool(curve) and curve[-1].get("status", "ok") == "ok"


def run_names(keys) -> dict[tuple[str, str], str]:
    """The summary's name of each (optimizer, setting) of ``keys`` ((optimizer, setting, ...) tuples): the
    optimizer's, or ``"optimizer (setting)"`` where the optimizer ran more than one setting (say, the sweep's best
    changed after a comparison run): their runs are not averaged together."""
    settings: dict[str, list[str]] = {}
    for optimizer, setting, *_ in keys:
        if setting not in settings.setdefault(optimizer, []):
            settings[optimizer].append(setting)
    return {(optimizer, setting): optimizer if len(mine) == 1 else f"{optimizer} ({setting})"
            for optimizer, mine in settings.items() for setting in mine}


def time_to_target(points: list[tuple[float, float]], target: float) -> float | None:
    """The first ``x`` at which the curve through the points ``(x, loss)`` (in order, linear between them) reaches
    ``target``: interpolated between the last point above it and the first at or below it, or the first point's
    ``x`` if that one is already at or below; ``None`` if no point is."""
    previous = None
    for x, loss in points:
        if loss <= target:
            if previous is None:
                return x
            x0, loss0 = previous
            return x0 + (x - x0) * (loss0 - target) / (loss0 - loss)
        previous = (x, loss)
    return None


def choose_targets(curves: dict[tuple[str, str, int], list[dict]]) -> list[float]:
    """Target losses, easiest first: the hardest that every curve reaches (the largest of the curves' lowest
    validation losses, rounded up to 0.001) plus each of :data:`TARGET_OFFSETS`, keeping those below every
    curve's first validation (so each curve's time to it is measured, not before its first point). Only the runs
    that ended normally choose them: one that failed early would drag every target up to where it stopped."""
    curves = {key: curve for key, curve in curves.items() if ended_normally(curve)}
    if not curves:
        return []
    lowest = max(min(r["val_loss"] for r in curve) for curve in curves.values())
    hardest = math.ceil(round(lowest * 1000, 6)) / 1000  # 3.2 stays 3.2 (3.2 * 1000 is 3200.0000000000005)
    if hardest < lowest:  # round() took 3.2000000004 down to 3.2, a target that run never reaches
        hardest = round(hardest + 0.001, 3)
    start = min(curve[0]["val_loss"] for curve in curves.values())
    return [round(hardest + offset, 3) for offset in sorted(TARGET_OFFSETS, reverse=True) if hardest + offset < start]


def reach(curves: dict[tuple[str, str, int], list[dict]], targets: list[float]) -> dict[str, list[tuple]]:
    """Per optimizer (per :func:`run_names`) and target, the mean over its seeds of the training seconds and
    tokens to the target (``(None, None)`` if a seed never reaches it)."""
    names = run_names(curves)
    per_optimizer: dict[str, list[list[dict]]] = {}
    for (optimizer, setting, _), curve in curves.items():
        per_optimizer.setdefault(names[optimizer, setting], []).append(curve)
    result = {}
    for optimizer, runs in per_optimizer.items():
        result[optimizer] = []
        for target in targets:
            seconds = [time_to_target([(r["train_s"], r["val_loss"]) for r in run], target) for run in runs]
            tokens = [time_to_target([(r["tokens"], r["val_loss"]) for r in run], target) for run in runs]
            if None in seconds:
                result[optimizer].append((None, None))
            else:
                result[optimizer].append((sum(seconds) / len(runs), sum(tokens) / len(runs)))
    return result


def conclusion(times: dict[str, list[tuple]], targets: list[float], setup: str) -> str:
    """One sentence: for each target, which optimizer reaches it first and by what factor against AdamW (or,
    where AdamW is first, against the next)."""
    clauses = []
    for i, target in enumerate(targets):
        ranked = sorted((t[i][0], optimizer) for optimizer, t in times.items() if t[i][0] is not None)
        if not ranked:
            continue
        first_s, first = ranked[0]
        if first != "adamw" and "adamw" in times and times["adamw"][i][0] is not None:
            adamw_s = times["adamw"][i][0]
            clauses.append(f"{target:.3f} first by {first} in {_seconds(first_s)}, {adamw_s / first_s:.2f}x sooner "
                           f"than AdamW ({_seconds(adamw_s)})")
        elif len(ranked) > 1:
            next_s, following = ranked[1]
            clauses.append(f"{target:.3f} first by {first} in {_seconds(first_s)}, {next_s / first_s:.2f}x sooner "
                           f"than the next, {following} ({_seconds(next_s)})")
        else:
            clauses.append(f"{target:.3f} by {first} alone, in {_seconds(first_s)}")
    if not clauses:
        return f"{setup}: no target loss that every run reaches."
    return f"{setup}, validation loss " + "; ".join(clauses) + "."


# --- tables and plots ---


def _number(value, digits: int) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"


def sweep_table(rows: list[dict]) -> str:
    """The sweep, one row per run; each optimizer's best is marked, with the axes where it lies at the grid's edge."""
    best = {row["optimizer"]: row["setting"] for row in best_settings(rows).values()}
    lines = ["| optimizer | setting | status | end | steps | training time (s) | tokens/s | validation loss | |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = ""
        if best.get(r["optimizer"]) == r["setting"]:
            edges = grid_edges(r["optimizer"], r["setting"], rows)
            mark = "best" + (f" ({', '.join(edges)} at the grid's edge)" if edges else "")
        lines.append(f"| {r['optimizer']} | {r['setting']} | {r['status']} | {r['end'] or ''} | {r['steps']} | "
                     f"{_number(r['train_s'], 1)} | {_number(r['tokens_per_s'], 0)} | {_number(r['val_loss'], 3)} | "
                     f"{mark} |")
    return "\n".join(lines)


def run_table(rows: list[dict]) -> str:
    """The comparison's runs, one row per optimizer (per setting where it ran more than one): final validation loss
    per seed and their mean over the runs that ended normally (another's status and last validation loss are shown
    instead), and the means of steps, training time, tokens/s and peak memory."""
    ended = sorted(last_rows(rows), key=lambda r: r["seed"])
    names = run_names((r["optimizer"], r["setting"]) for r in ended)
    per_optimizer: dict[str, list[dict]] = {}
    for row in ended:
        per_optimizer.setdefault(names[row["optimizer"], row["setting"]], []).append(row)
    lines = [("| optimizer | setting | seeds | validation loss: mean (per seed) | steps | training time (s) | "
              "tokens/s | peak memory (GiB) | end |"), "|---|---|---|---|---|---|---|---|---|"]

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    def final(row: dict) -> str:
        if row["status"] == "ok":
            return _number(row["val_loss"], 3)
        return row["status"] + (f" at {row['val_loss']:.3f}" if row["val_loss"] is not None else "")

    for optimizer, runs in per_optimizer.items():
        losses = [final_loss(r) for r in runs]
        speeds = [r["tokens"] * (1 - 1 / r["step"]) / r["train_s"] if r["step"] and r["train_s"] else None
                  for r in runs]  # the tokens after step 1 over the training time
        lines.append(
            f"| {optimizer} | {runs[0]['setting']} | {', '.join(str(r['seed']) for r in runs)} | "
            f"{_number(mean(losses), 3)} ({', '.join(final(r) for r in runs)}) | "
            f"{_number(mean([r['step'] for r in runs]), 0)} | {_number(mean([r['train_s'] for r in runs]), 1)} | "
            f"{_number(mean(speeds), 0)} | {_number(mean([r['max_memory_gib'] for r in runs]), 2)} | "
            f"{', '.join(sorted({r['end'] or r['status'] for r in runs}))} |")
    return "\n".join(lines)


def target_table(times: dict[str, list[tuple]], targets: list[float]) -> str:
    """Training seconds (in AdamW's, where AdamW ran) and million tokens to each target, per optimizer."""
    header = " | ".join(f"to {t:.3f}: s (x AdamW's), M tokens" for t in targets)
    lines = [f"| optimizer | {header} |", "|---|" + "---|" * len(targets)]
    adamw = times.get("adamw")
    for optimizer, reached in times.items():
        cells = []
        for i, (seconds, tokens) in enumerate(reached):
            if seconds is None:
                cells.append("not reached")
                continue
            ratio = f" ({seconds / adamw[i][0]:.2f}x)" if adamw and adamw[i][0] else ""
            cells.append(f"{seconds:.1f}{ratio}, {tokens / 1e6:.3g}")
        lines.append(f"| {optimizer} | {' | '.join(cells)} |")
    return "\n".join(lines)


def plot(curves: dict[tuple[str, str, int], list[dict]], targets: list[float], x: str, xlabel: str,
         path: Path) -> None:
    """Validation loss against column ``x``: a colour per optimizer, a line style per seed, the targets dotted."""
    optimizers = list(dict.fromkeys(key[0] for key in curves))
    seeds = sorted({key[2] for key in curves})
    fig, ax = plt.subplots(figsize=(8, 5))
    for (optimizer, setting, seed), curve in curves.items():
        if not curve:
            continue
        ax.plot([r[x] for r in curve], [r["val_loss"] for r in curve], color=f"C{optimizers.index(optimizer)}",
                ls=("-", "--", ":", "-.")[seeds.index(seed) % 4], marker="o", ms=3,
                label=f"{optimizer} ({setting}), seed {seed}")
    for target in targets:
        ax.axhline(target, color="grey", lw=0.8, ls=":")
    if targets:  # the first validations (~10 nats) would squash the curves
        ax.set_ylim(top=targets[0] + 1.0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss (nats per token)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the session: runs, their order and their budget of GPU time ---


@dataclass
class Session:
    """What every run of this invocation shares."""

    args: argparse.Namespace
    overrides: list[str]  # the command line's, and the BPE cache where the config names none
    setup: str
    tokens_per_step: int
    sweep_seed: int
    optimizers: list[str]
    description: str  # "context 8,192, 32,768 tokens per step" for the summary
    started: float
    failed: set[str]  # optimizers whose calibration failed in this invocation: their runs are left out
    train_tokens: int | None = None  # the training split's tokens, once the data is loaded

    @property
    def sweep_csv(self) -> Path:
        return self.args.sweep_csv or self.args.docs / "equal_time_sweep.csv"

    @property
    def calibration_csv(self) -> Path:
        return self.args.docs / f"{self.args.stem}_calibration.csv"

    @property
    def comparison_csv(self) -> Path:
        return self.args.docs / f"{self.args.stem}.csv"

    def overheads(self) -> list[float]:
        """The seconds of each finished run of this setup beyond its training time."""
        finished = [r for r in read_csv(self.sweep_csv) if r["setup"] == self.setup]
        finished += last_rows(read_csv(self.comparison_csv))
        return [r["wall_s"] - r["train_s"] for r in finished if r["train_s"] is not None]

    def overhead(self) -> float:
        """The mean of :meth:`overheads` (:data:`OVERHEAD_S` before any run has finished)."""
        seconds = self.overheads()
        return sum(seconds) / len(seconds) if seconds else OVERHEAD_S

    def seconds_left(self) -> float:
        if self.args.max_minutes is None:
            return math.inf
        return 60 * self.args.max_minutes - (time.perf_counter() - self.started)

    def step_times(self) -> dict[str, float]:
        return {r["optimizer"]: r["step_s"] for r in read_csv(self.calibration_csv) if r["setup"] == self.setup}

    def add_rows(self, path: Path, fields: list[str], rows: list[dict]) -> None:
        """:func:`append_rows`, then the file's copy in ``--mirror``."""
        append_rows(path, fields, rows)
        self.mirror(path)

    def mirror(self, path: Path) -> None:
        if self.args.mirror is not None:
            self.args.mirror.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, self.args.mirror / path.name)


def last_rows(curve_rows: list[dict]) -> list[dict]:
    """The last row of each run of a comparison CSV."""
    last: dict[tuple, dict] = {}
    for row in curve_rows:
        last[(row["optimizer"], row["setting"], row["seed"], row["budget_s"])] = row
    return list(last.values())


def launch(session: Session, run: Run, steps: int, extra: list[str], phase: str,
           timeout: float) -> tuple[list[dict], dict]:
    """Train ``run`` for ``steps`` with the ``extra`` overrides; its per-step rows and summary (compare_optimizers')."""
    folder = session.args.out_dir / session.args.stem / run.folder(phase)
    shutil.rmtree(folder, ignore_errors=True)  # what a stopped invocation left
    overrides = [*session.overrides, *run.overrides, f"train.seed={run.seed}", *extra]
    settings = argparse.Namespace(config=session.args.config, overrides=overrides, timeout=timeout)
    rows, summary = compare_optimizers.run(run.optimizer, steps, session.tokens_per_step, settings, folder)
    shutil.rmtree(folder / run.optimizer / "checkpoints", ignore_errors=True)
    return rows, summary


def calibrate(session: Session, optimizer: str) -> float | None:
    """Time :data:`CALIBRATION_STEPS` steps of ``optimizer``'s base settings, record the step time and return it
    (``None``, with a message, if the run failed)."""
    run = Run(optimizer, (), session.sweep_seed)
    rows, summary = launch(session, run, CALIBRATION_STEPS, [f"train.eval_interval={CALIBRATION_STEPS}"],
                           "calibration", TIMEOUT_MARGIN_S)
    timed = [r["step_s"] for r in rows if r["step"] >= 3]
    if summary["status"] != "ok" or not timed:
        print(f"calibration of {optimizer} failed ({summary['status']}): its runs are left out", file=sys.stderr)
        session.failed.add(optimizer)
        return None
    step_s = sum(timed) / len(timed)
    session.add_rows(session.calibration_csv, CALIBRATION_FIELDS, [{
        "setup": session.setup, "optimizer": optimizer, "steps": len(rows), "step_s": step_s,
        "tokens_per_s": session.tokens_per_step / step_s, "max_memory_gib": summary["max_memory_gib"],
        "wall_s": summary["wall_s"]}])
    return step_s


def constant_lr(session: Session, run: Run) -> bool:
    """Whether ``run``'s learning rate is the same at every step (no warm-up, no decay)."""
    _, settings = compare_optimizers.settings_of(run.optimizer)
    o = load_config(str(session.args.config), [*settings, *session.overrides, *run.overrides]).optimizer
    return o.warmup_steps == 0 and o.min_lr_ratio == 1


def schedule(session: Session, run: Run, budget: float, step_s: float, evaluations: int) -> tuple[int, list[str]]:
    """``run``'s ``train.steps`` for ``budget`` training seconds at ``step_s`` per step, and its overrides: the
    budget, evenly spaced validations and (where the lr is scheduled) the warm-up."""
    fits = budget / step_s
    constant = constant_lr(session, run)
    steps = 1 + max(1, math.ceil(CONSTANT_LR_STEPS * fits) if constant else math.floor(SCHEDULE_FILL * fits))
    extra = [f"train.max_seconds={budget}", f"train.eval_interval={max(1, round(fits / evaluations))}"]
    if not constant:
        extra.append(f"optimizer.warmup_steps={round(WARMUP_FRACTION * steps)}")
    return steps, extra


def run_columns(session: Session, run: Run, budget: float, steps: int, summary: dict) -> dict:
    ended = "" if summary["status"] != "ok" else "budget" if summary["steps"] < steps else "schedule"
    return {"setup": session.setup, "optimizer": run.optimizer, "setting": run.setting, "seed": run.seed,
            "budget_s": budget, "planned_steps": steps, "status": summary["status"], "end": ended,
            "wall_s": summary["wall_s"]}


def sweep_run(session: Session, run: Run, step_s: float) -> None:
    budget = session.args.sweep_seconds
    steps, extra = schedule(session, run, budget, step_s, SWEEP_EVALUATIONS)
    _, summary = launch(session, run, steps, extra, "sweep", budget + TIMEOUT_MARGIN_S)
    numbers = {key: summary[key] for key in ("steps", "tokens", "train_s", "tokens_per_s", "train_loss", "val_loss",
                                             "max_memory_gib")}
    columns = run_columns(session, run, budget, steps, summary)
    session.add_rows(session.sweep_csv, SWEEP_FIELDS, [{**columns, **numbers}])


def compare_run(session: Session, run: Run, step_s: float) -> None:
    """Train ``run`` for the comparison's budget and add its validation curve (one row per validation) to the CSV."""
    budget = session.args.budget_seconds
    steps, extra = schedule(session, run, budget, step_s, COMPARE_EVALUATIONS)
    rows, summary = launch(session, run, steps, extra, "compare", budget + TIMEOUT_MARGIN_S)
    columns = run_columns(session, run, budget, steps, summary)
    curve, since = [], []
    for r in rows:
        since.append(r["train_loss"])
        if r["val_loss"] is not None:
            curve.append({**columns, "step": r["step"], "tokens": r["tokens"], "train_s": r["train_s"],
                          "train_loss": sum(since) / len(since), "val_loss": r["val_loss"], "lr": r["lr"],
                          "max_memory_gib": r["max_memory_gib"]})
            since = []
    session.add_rows(session.comparison_csv, CURVE_FIELDS, curve or [columns])


def pending_sweep(session: Session) -> list[Run]:
    """The sweep's runs left: the grid points not swept, then the :func:`extension_points` of the sweep so far."""
    rows = [r for r in read_csv(session.sweep_csv)
            if r["budget_s"] == session.args.sweep_seconds and r["seed"] == session.sweep_seed]
    swept = {(r["optimizer"], r["setting"]) for r in rows}
    points = [(optimizer, point) for optimizer in session.optimizers for point in grid(optimizer)]
    points += [(optimizer, point) for optimizer in session.optimizers
               for point in extension_points(optimizer, rows, session.args.edge_extensions)]
    return [Run(optimizer, point, session.sweep_seed) for optimizer, point in points
            if (optimizer, label(point)) not in swept]


def pending_comparison(session: Session) -> tuple[list[Run], list[str]]:
    """The comparison's runs left (seed by seed), and the optimizers left out because their sweep is not done."""
    sweep = [r for r in read_csv(session.sweep_csv) if r["budget_s"] == session.args.sweep_seconds]
    best = best_settings(sweep)
    unfinished = {run.optimizer for run in pending_sweep(session)}
    ready, waiting = [], []
    for optimizer in session.optimizers:
        (ready if optimizer not in unfinished and optimizer in best else waiting).append(optimizer)
    finished = {(r["optimizer"], r["setting"], r["seed"]) for r in last_rows(read_csv(session.comparison_csv))
                if r["budget_s"] == session.args.budget_seconds}
    runs = [Run(optimizer, parse_setting(best[optimizer]["setting"]), seed)
            for seed in session.args.seeds for optimizer in ready]
    return [run for run in runs if (run.optimizer, run.setting, run.seed) not in finished], waiting


def execute(session: Session, runs: list[Run], budget: float, train_one) -> list[Run]:
    """``train_one(session, run, step_s)`` for each of ``runs`` that fits in the time left (calibrating an
    optimizer first where needed); returns the runs not started."""
    for i, run in enumerate(runs):
        if run.optimizer in session.failed:
            continue
        step_s = session.step_times().get(run.optimizer)
        needed = budget + session.overhead() + (0 if step_s else session.overhead() + CALIBRATION_S)
        if needed > session.seconds_left():
            print(f"--max-minutes {session.args.max_minutes}: {len(runs) - i} runs left (about {needed:.0f} s each); "
                  "run the same command again", file=sys.stderr)
            return runs[i:]
        step_s = step_s or calibrate(session, run.optimizer)
        if step_s is not None:
            train_one(session, run, step_s)
    return []


# --- the command ---


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "lm" / "equal_time_8k.yaml")
    parser.add_argument("--optimizers", nargs="+", default=OPTIMIZERS, choices=OPTIMIZERS, metavar="NAME",
                        help=f"some of {' '.join(OPTIMIZERS)} (key=value overrides go before this option)")
    parser.add_argument("--top", type=int, help="compare the N optimizers of lowest mean final validation loss in "
                                                "--ranking instead of --optimizers")
    parser.add_argument("--ranking", type=Path, help="the comparison --top ranks (default <docs>/equal_time.csv)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="the comparison's seeds")
    parser.add_argument("--sweep-seconds", type=float, default=60.0, help="training seconds per sweep run")
    parser.add_argument("--budget-seconds", type=float, default=240.0, help="training seconds per comparison run")
    phase = parser.add_mutually_exclusive_group()
    phase.add_argument("--sweep-only", action="store_true")
    phase.add_argument("--compare-only", action="store_true")
    parser.add_argument("--plan", action="store_true", help="print the runs left and their GPU minutes; run none")
    parser.add_argument("--max-minutes", type=float, help="start no run that would end after this many minutes")
    parser.add_argument("--edge-extensions", type=int, default=EDGE_EXTENSIONS,
                        help="points the sweep may add beyond each end of each grid axis while the best lies there")
    parser.add_argument("--stem", default="equal_time", help="names the comparison's and calibration's files")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "results", help="where the CSVs and plots go")
    parser.add_argument("--sweep-csv", type=Path, help="the sweep's CSV (default <docs>/equal_time_sweep.csv)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "equal_time", help="the run folders")
    parser.add_argument("--mirror", type=Path, help="also copy each CSV and plot written here (on the GPU machine: "
                                                    "$OUT, so that what a stopped call wrote comes back)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides for every run")
    args = parser.parse_args(argv)
    for name in ("sweep_seconds", "budget_seconds", "max_minutes"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.edge_extensions < 0:
        parser.error(f"--edge-extensions must be >= 0, got {args.edge_extensions}")
    if args.top is not None and args.top < 1:
        parser.error(f"--top must be >= 1, got {args.top}")
    return args


def ranked_optimizers(path: Path, count: int) -> list[str]:
    """The ``count`` optimizers of lowest mean final validation loss (over seeds) in the comparison CSV ``path``."""
    finals: dict[str, list[float]] = {}
    for row in last_rows(read_csv(path)):
        if final_loss(row) is not None:
            finals.setdefault(row["optimizer"], []).append(row["val_loss"])
    if not finals:
        sys.exit(f"--top needs the finished comparison {path}: it holds no run")
    return sorted(finals, key=lambda optimizer: sum(finals[optimizer]) / len(finals[optimizer]))[:count]


def start(args: argparse.Namespace) -> Session:
    """The session of ``args``: the config checked, its setup digest, the optimizers, the BPE cache's place."""
    cfg = load_config(str(args.config), args.overrides)
    overrides = list(args.overrides)
    if cfg.data.cache_dir is None:
        overrides.append(f"data.cache_dir={args.out_dir / 'bpe_cache'}")
    optimizers = args.optimizers
    if args.top is not None:
        optimizers = ranked_optimizers(args.ranking or args.docs / "equal_time.csv", args.top)
    d = cfg.data
    tokens_per_step = d.batch_size * d.context_length * cfg.train.grad_accum_steps
    description = f"context {d.context_length:,}, {tokens_per_step:,} tokens per step"
    return Session(args, overrides, fingerprint(cfg), tokens_per_step, cfg.train.seed, optimizers, description,
                   time.perf_counter(), set())


def plan(session: Session) -> str:
    """The runs left, each with its estimated GPU minutes, the total, and how many calls of --max-minutes it takes."""
    a = session.args
    overhead = session.overhead()
    items = []  # (phase, optimizer, setting, seed, seconds)
    if not a.compare_only:
        items += [("sweep", r.optimizer, r.setting, r.seed, a.sweep_seconds + overhead) for r in pending_sweep(session)]
    if not a.sweep_only:
        ready, waiting = pending_comparison(session)
        items += [("compare", r.optimizer, r.setting, r.seed, a.budget_seconds + overhead) for r in ready]
        items += [("compare", optimizer, "best of the sweep", seed, a.budget_seconds + overhead)
                  for seed in a.seeds for optimizer in waiting]
    uncalibrated = dict.fromkeys(item[1] for item in items if item[1] not in session.step_times())
    items = [("calibration", optimizer, "base", session.sweep_seed, overhead + CALIBRATION_S)
             for optimizer in uncalibrated] + items
    limit = 60 * (a.max_minutes or 9.0)
    calls, used = 0, limit
    for *_, seconds in items:  # in order, as the runs go
        if used + seconds > limit:
            calls, used = calls + 1, 0.0
        used += seconds
    lines = [f"Runs left for {a.stem} (setup {session.setup}, {session.description}):", "",
             "| phase | optimizer | setting | seed | estimate (min) |", "|---|---|---|---|---|"]
    lines += [f"| {phase} | {optimizer} | {setting} | {seed} | {seconds / 60:.1f} |"
              for phase, optimizer, setting, seed, seconds in items]
    guess = "" if session.overheads() else ", a guess until runs finish"
    minutes = sum(item[-1] for item in items) / 60
    lines += ["", (f"{len(items)} runs, about {minutes:.1f} GPU minutes ({overhead:.0f} s per run beyond its budget"
                   f"{guess}): about {calls} calls of --max-minutes {limit / 60:g}. A fresh machine adds the BPE "
                   "tokenizer and token ids (a minute or two) and the first compilations. Where an optimizer's best "
                   f"lies at an edge of its grid, the sweep adds up to {a.edge_extensions} points beyond each end of "
                   "each axis, not counted here.")]
    return "\n".join(lines)


def summary(session: Session) -> str:
    """The Markdown summary of what the CSVs hold, the conclusion last; writes the plots."""
    a = session.args
    parts = []
    sweep = read_csv(session.sweep_csv)
    if sweep:
        parts.append(f"Sweep ({session.sweep_csv.name}: {a.sweep_seconds:g} s of training per run, seed "
                     f"{session.sweep_seed}):\n\n" + sweep_table(sweep))
    rows = [r for r in read_csv(session.comparison_csv) if r["budget_s"] == a.budget_seconds]
    curves = curves_of(rows)
    if curves:
        targets = choose_targets(curves)
        times = reach(curves, targets)
        a.docs.mkdir(parents=True, exist_ok=True)
        for x, xlabel, name in (("tokens", "training tokens", "tokens"),
                                ("train_s", "training time (s, from the end of step 1)", "time")):
            plot(curves, targets, x, xlabel, a.docs / f"{a.stem}_{name}.png")
            session.mirror(a.docs / f"{a.stem}_{name}.png")
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "the CPU"
        seeds = sorted({key[2] for key in curves})
        setup = (f"With equal {a.budget_seconds:g} s training budgets on {device} ({session.description}; "
                 f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))})")
        seen = max(r["tokens"] for r in rows if r["tokens"] is not None)
        repeats = f" ({seen / session.train_tokens:.2f} epochs)" if session.train_tokens else ""
        parts += [f"Comparison ({a.budget_seconds:g} s of training per run; the most tokens a run saw: "
                  f"{seen:,}{repeats}):\n\n" + run_table(rows),
                  "Time to target (validation loss; mean over seeds):\n\n" + target_table(times, targets),
                  conclusion(times, targets, setup)]
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    session = start(args)
    if args.plan:
        print(plan(session))
        return
    if not args.compare_only:
        check_setup(session.sweep_csv, session.setup)
    check_setup(session.calibration_csv, session.setup)
    check_setup(session.comparison_csv, session.setup)
    began = time.perf_counter()
    corpus, _ = load_tokens(load_config(str(args.config), session.overrides), Context())  # the BPE cache first
    session.train_tokens = len(corpus.train)
    print(f"data ready in {time.perf_counter() - began:.1f} s: {len(corpus.train):,} training and "
          f"{len(corpus.val):,} validation tokens", file=sys.stderr)
    left = []
    while not args.compare_only and not left and (
        runs := [run for run in pending_sweep(session) if run.optimizer not in session.failed]
    ):
        left += execute(session, runs, args.sweep_seconds, sweep_run)
    if not args.sweep_only and not left:
        runs, waiting = pending_comparison(session)
        if waiting:
            print(f"not compared, their sweep is not finished (or no run of it ended normally): {', '.join(waiting)}",
                  file=sys.stderr)
        left += execute(session, runs, args.budget_seconds, compare_run)
    print(summary(session))
    if left:
        print(f"\n{len(left)} runs left: run the same command again.")


if __name__ == "__main__":
    main()
