"""The spectrum recipe's figures (matplotlib, no display): the densities per context length, the top eigenvalue
and the trace against context length and training step, and Adam's preconditioned sharpness against its
threshold."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def densities(rows: list[dict], kind: str, path: Path) -> None:
    """One panel per step, one curve per context length: the density of ``kind`` (rows of ``density.csv``) on a
    log scale, which shows the bulk and the outliers at once."""
    curves: dict[int, dict[int, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row["curvature"] == kind:
            curves[row["step"]][row["length"]].append((row["eigenvalue"], row["density"]))
    steps = sorted(curves)
    columns = min(len(steps), 3)
    fig, axes = plt.subplots(math.ceil(len(steps) / columns), columns, squeeze=False,
                             figsize=(5 * columns, 3.6 * math.ceil(len(steps) / columns)))
    for ax, step in zip(axes.flat, steps):
        for length, points in sorted(curves[step].items()):
            x, y = zip(*points)
            ax.semilogy(x, [max(v, 1e-12) for v in y], label=f"{length:,} tokens")
        ax.set(title=f"{_name(kind)}, step {step}", xlabel="eigenvalue", ylabel="density")
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(steps):]:
        ax.axis("off")
    _save(fig, path)


def summary(rows: list[dict], path: Path) -> None:
    """The top eigenvalue and the Hutch++ trace (rows of ``spectrum.csv``) against context length (a line per
    curvature and step) and against step (a line per curvature and length)."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for row_axes, key, label in ((axes[0], "eigenvalue_1", "top eigenvalue"), (axes[1], "trace_hutchpp", "trace")):
        for (kind, step), points in _series(rows, ("curvature", "step"), "length", key).items():
            row_axes[0].plot(*zip(*points), marker="o", label=f"{_name(kind)}, step {step}")
        for (kind, length), points in _series(rows, ("curvature", "length"), "step", key).items():
            row_axes[1].plot(*zip(*points), marker="o", label=f"{_name(kind)}, {length:,} tokens")
        lengths = sorted({row["length"] for row in rows})
        row_axes[0].set_xscale("log", base=2)
        row_axes[0].set_xticks(lengths, [f"{length:,}" for length in lengths])
        row_axes[0].set(xlabel="context length (tokens)", ylabel=label)
        row_axes[1].set(xlabel="training step", ylabel=label)
        for ax in row_axes:
            ax.legend(fontsize="small")
    _save(fig, path)


def sharpness(rows: list[dict], path: Path) -> None:
    """The top Hessian eigenvalue and Adam's preconditioned sharpness (rows of ``sharpness.csv``) against step, the
    latter with its threshold (2 + 2 beta1) / (1 - beta1)."""
    rows = sorted(rows, key=lambda row: row["step"])
    steps = [row["step"] for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, [row["top_eigenvalue"] for row in rows], marker="o")
    left.set(xlabel="training step", ylabel="top Hessian eigenvalue", title="sharpness")
    right.plot(steps, [row["preconditioned_sharpness"] for row in rows], marker="o", label="lambda_1(P^-1 H)")
    right.plot(steps, [row["threshold"] for row in rows], linestyle="--", color="gray",
               label="(2 + 2 beta1) / (1 - beta1)")
    right.set(xlabel="training step", ylabel="lr-scaled", title="Adam's preconditioned sharpness")
    right.legend(fontsize="small")
    _save(fig, path)


def _series(rows: list[dict], by: tuple[str, str], x: str, y: str) -> dict[tuple, list[tuple[float, float]]]:
    series: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for row in sorted(rows, key=lambda row: row[x]):
        series[tuple(row[key] for key in by)].append((row[x], row[y]))
    return dict(sorted(series.items()))


def _name(kind: str) -> str:
    return {"hessian": "Hessian", "ggn": "Gauss-Newton"}.get(kind, kind)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
