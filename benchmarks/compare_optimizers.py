"""AdamW vs SophiaH vs NewtonCG on the same model, data and seed at 8K context, for an equal token budget (GPU).

Run from the checkout (one GPU; pick it with CUDA_VISIBLE_DEVICES)::

    PYTHONPATH=. python benchmarks/compare_optimizers.py
    # CPU smoke test, a few seconds per optimizer:
    PYTHONPATH=. python benchmarks/compare_optimizers.py --config configs/lm/tiny.yaml --tokens 8192 \\
        --docs /tmp/compare --optimizers adamw sophiah

For every optimizer it launches ``python -m recipes.lm --config CONFIG`` (default
configs/lm/compare_8k.yaml, whose ``model.attention=sdpa`` runs AdamW on torch SDPA and the
second-order optimizers on flashbob only for their curvature passes) with ``train.steps`` =
``--tokens`` / tokens per step (the same steps, hence tokens, for all), validation every 1/8 of
the steps, one checkpoint at the end, ``logger.kind=none``, no progress bar and
``FLASHBOB_AUTOTUNE=0`` (autotuning every kernel would take longer than the runs). Each
optimizer's own settings (``SETTINGS`` below) come after the config and before the ``key=value``
overrides of the command line, which apply to every run. ``VARIANTS`` are other settings of an
optimizer under their own name (e.g. ``--optimizers adamw newtoncg newtoncg_full``).

Training time is the sum of the recipe's per-step times (tokens per step / ``train/tokens_per_s``,
logged at every step) from step 2 on: evaluation, checkpointing, start-up and step 1 (which
compiles the Triton kernels) are left out. A run still going after ``--timeout`` seconds is
stopped; the steps it logged are kept and its status says so.

Writes to ``--docs``: ``optimizer_comparison.csv`` (one row per optimizer and step: tokens,
training seconds, train loss, validation loss at the evaluation steps, learning rate, peak
memory, the optimizer's own statistics), ``optimizer_comparison_tokens.png`` (loss vs tokens)
and ``optimizer_comparison_time.png`` (loss vs training time, log scale), and prints two Markdown
tables last: the results, and the cost per step against the first run's (AdamW's), with
SophiaH's Hessian-refresh steps and plain steps apart, each kind of step from its second on.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks.environment import child_environment
from benchmarks.results import write_rows
from recipes.lm.optimizers import OPTIMIZERS
from recipes.lm.train import load_config

ROOT = Path(__file__).resolve().parent.parent
EVALUATIONS = 8  # validation losses per run, evenly spaced over the steps (and at the last one)
# Each optimizer's own settings. AdamW: the config's (lr 2e-3, betas 0.9/0.999, weight decay 0.1 on
# matrices, gradient clipping at norm 1, 10% warm-up then cosine to 0.1 lr). SophiaH: the same lr,
# weight decay and schedule; its own betas (0.965, 0.99), rho 0.01 and a Hutchinson estimate of the
# Hessian diagonal every 10 steps, as in Liu et al. (2023), on the first of the step's 2 windows
# (hessian_batch 1; the gradient is both windows'). SophiaG: the same, rho 0.04 (the released code's)
# and the Gauss-Newton-Bartlett estimate on every row. NewtonCG: Gauss-Newton (the closure returns the
# logits), lr 1 (the full CG step, found by backtracking and an Armijo line search) without warm-up or
# decay, initial damping 1 adapted by Levenberg-Marquardt, CG warm-started from the last step's, no
# weight decay (with lr 1 it would shrink the weights by 10% per step); the curvature products on the
# first of the step's 2 windows (curvature_batch 1, Martens' curvature mini-batch), the Gauss-Newton
# product by forward mode, at most 4 CG iterations, preconditioned by Martens' (d + damping)^0.75 with d
# an EMA of the Gauss-Newton-Bartlett diagonal (Sophia-G's estimate, from labels sampled on the curvature
# window: one backward and no product per step). Without a preconditioner, 4 iterations lose the per-token
# lead over AdamW (docs/optimizers.md).
NEWTON_CG = ["optimizer.lr=1.0", "optimizer.weight_decay=0", "optimizer.warmup_steps=0", "optimizer.min_lr_ratio=1",
             "optimizer.kwargs.damping=1.0"]
NEWTON_CG_CHEAP = [*NEWTON_CG, "optimizer.kwargs.max_cg_iters=4", "optimizer.kwargs.curvature_batch=1",
                   "optimizer.kwargs.mode=forward"]
SOPHIA_H = ["optimizer.kwargs.rho=0.01", "optimizer.kwargs.update_period=10"]
SETTINGS = {
    "adamw": [],
    "sophiah": [*SOPHIA_H, "optimizer.kwargs.hessian_batch=1"],
    "sophiag": ["optimizer.kwargs.update_period=10"],
    "newtoncg": [*NEWTON_CG_CHEAP, "optimizer.kwargs.preconditioner=bartlett"],
}
VARIANTS = {  # name: (optimizer, its settings)
    # the settings of the same-tokens comparison of docs/optimizers.md: products on every row, reverse mode,
    # 10 CG iterations
    "newtoncg_full": ("newtoncg", [*NEWTON_CG, "optimizer.kwargs.max_cg_iters=10"]),
    # no preconditioner (4 and 8 CG iterations), and the Hutchinson preconditioner
    "newtoncg_plain": ("newtoncg", NEWTON_CG_CHEAP),
    "newtoncg_cg8": ("newtoncg", [*NEWTON_CG_CHEAP, "optimizer.kwargs.max_cg_iters=8"]),
    "newtoncg_pcg": ("newtoncg", [*NEWTON_CG_CHEAP, "optimizer.kwargs.preconditioner=hutchinson"]),
    # the Gauss-Newton-Bartlett preconditioner with fewer CG iterations
    "newtoncg_cg3": ("newtoncg", [*SETTINGS["newtoncg"], "optimizer.kwargs.max_cg_iters=3"]),
    "newtoncg_cg2": ("newtoncg", [*SETTINGS["newtoncg"], "optimizer.kwargs.max_cg_iters=2"]),
    # 2 CG iterations, and: backtracking that stops at the last iterate when its decrease reaches the first's model
    # decrease (one trial forward on those steps instead of two); the products in reverse mode (J v by the double-vjp trick on one
    # create_graph backward per step, no forward with tangents); a cold start with 3 or 2 iterations (the warm
    # start's product spent on an iteration, or saved)
    "newtoncg_cg2_accept": ("newtoncg", [*SETTINGS["newtoncg"], "optimizer.kwargs.max_cg_iters=2",
                                         "optimizer.kwargs.backtrack_accept=true"]),
    "newtoncg_reverse_cg2": ("newtoncg", [*SETTINGS["newtoncg"], "optimizer.kwargs.max_cg_iters=2",
                                          "optimizer.kwargs.mode=reverse"]),
    "newtoncg_cold_cg3": ("newtoncg", [*SETTINGS["newtoncg"], "optimizer.kwargs.max_cg_iters=3",
                                       "optimizer.kwargs.warm_start_decay=0"]),
    "newtoncg_cold_cg2": ("newtoncg", [*SETTINGS["newtoncg"], "optimizer.kwargs.max_cg_iters=2",
                                       "optimizer.kwargs.warm_start_decay=0"]),
    "newtoncg_cold_cg2_accept": ("newtoncg", [*SETTINGS["newtoncg"], "optimizer.kwargs.max_cg_iters=2",
                                              "optimizer.kwargs.warm_start_decay=0",
                                              "optimizer.kwargs.backtrack_accept=true"]),
    # 2 CG iterations with the products on both windows, on the gradient's own graph: no closure(rows) forward (at 8K
    # the passes are bound by host time, so a product on 2 windows may cost about what one on 1 window does)
    "newtoncg_cg2_allrows": ("newtoncg", [*SETTINGS["newtoncg"], "optimizer.kwargs.max_cg_iters=2",
                                          "optimizer.kwargs.curvature_batch=null"]),
    # SophiaH's estimate on both windows
    "sophiah_full": ("sophiah", SOPHIA_H),
    # SophiaH's Hutchinson products by forward over reverse (the first window run again with the probe as tangent)
    "sophiah_forward": ("sophiah", [*SETTINGS["sophiah"], "optimizer.kwargs.mode=forward"]),
    # ... on both windows: the refresh is then the probe's forward-over-reverse pass alone (its values are the loss
    # and gradient), no first-order pass before it
    "sophiah_full_forward": ("sophiah", [*SOPHIA_H, "optimizer.kwargs.mode=forward"]),
}
FIELDS = ["optimizer", "step", "tokens", "step_s", "train_s", "train_loss", "val_loss", "lr", "max_memory_gib"]
LAST_STEPS = 10  # the summary's train loss is the mean over this many last steps


def read_metrics(path: Path) -> list[dict]:
    """The JSON lines of a run's ``metrics.jsonl`` (none if it has none; a line cut off by a stopped run is dropped)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]]


def optimizer_names() -> list[str]:
    """Every name :func:`settings_of` takes: the recipe's optimizers and :data:`VARIANTS`."""
    return sorted({*OPTIMIZERS, *VARIANTS})


def settings_of(optimizer: str) -> tuple[str, list[str]]:
    """The recipe's optimizer name and the settings of ``optimizer``, a name of the recipe or of :data:`VARIANTS`."""
    return VARIANTS.get(optimizer, (optimizer, SETTINGS.get(optimizer, [])))


def run(optimizer: str, steps: int, tokens_per_step: int, args: argparse.Namespace,
        out_dir: Path) -> tuple[list[dict], dict]:
    """Train with ``optimizer`` (the recipe's name or one of :data:`VARIANTS`); returns its CSV rows and summary."""
    name, settings = settings_of(optimizer)
    command = [
        sys.executable, "-m", "recipes.lm", "--config", str(args.config), f"name={optimizer}", f"out_dir={out_dir}",
        f"optimizer.name={name}", f"train.steps={steps}",
        f"train.eval_interval={max(1, steps // EVALUATIONS)}", "train.checkpoint_interval=0",
        "train.keep_checkpoints=1", "train.progress=false", "logger.kind=none", *settings, *args.overrides,
        "train.log_interval=1",  # last: training time sums every step's logged time (an override would skip steps)
    ]  # fmt: skip
    env = child_environment(FLASHBOB_AUTOTUNE="0")
    print(" ".join(command), file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        done = subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
    except subprocess.TimeoutExpired:
        status = f"stopped at {args.timeout:.0f} s"
    wall = time.perf_counter() - start

    rows, train_s = [], 0.0
    for m in read_metrics(out_dir / optimizer / "metrics.jsonl"):
        step_s = tokens_per_step / m["train/tokens_per_s"]
        train_s += step_s if m["step"] > 1 else 0.0
        diagnostics = {k: v for k, v in m.items() if k.startswith("optimizer/") and k != "optimizer/loss"}
        rows.append({"optimizer": optimizer, "step": m["step"], "tokens": m["step"] * tokens_per_step,
                     "step_s": step_s, "train_s": train_s, "train_loss": m["train/loss"],
                     "val_loss": m.get("val/loss"), "lr": m.get("train/lr"),
                     "max_memory_gib": m.get("train/max_memory_gib"), **diagnostics})
    vals = [r["val_loss"] for r in rows if r["val_loss"] is not None]
    memory = [r["max_memory_gib"] for r in rows if r["max_memory_gib"] is not None]
    summary = {
        "optimizer": optimizer, "status": status, "steps": rows[-1]["step"] if rows else 0,
        "tokens": rows[-1]["tokens"] if rows else 0,
        "train_loss": sum(r["train_loss"] for r in rows[-LAST_STEPS:]) / len(rows[-LAST_STEPS:]) if rows else None,
        "val_loss": vals[-1] if vals else None,
        "tokens_per_s": (rows[-1]["tokens"] - tokens_per_step) / train_s if train_s else None,
        "train_s": train_s, "wall_s": wall, "max_memory_gib": max(memory) if memory else None,
    }  # fmt: skip
    print(summary, file=sys.stderr, flush=True)
    return rows, summary


def plot(rows: list[dict], optimizers: list[str], x: str, xlabel: str, path: Path, log_x: bool = False) -> None:
    """Train loss (thin) and validation loss (dots) of every optimizer against column ``x``, one colour each."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, optimizer in enumerate(optimizers):
        mine = [r for r in rows if r["optimizer"] == optimizer and (r[x] > 0 or not log_x)]
        val = [r for r in mine if r["val_loss"] is not None]
        ax.plot([r[x] for r in mine], [r["train_loss"] for r in mine], color=f"C{i}", lw=1, alpha=0.45,
                label=f"{optimizer} train")
        ax.plot([r[x] for r in val], [r["val_loss"] for r in val], color=f"C{i}", lw=2, marker="o",
                label=f"{optimizer} validation")
    vals = [r["val_loss"] for r in rows if r["val_loss"] is not None]
    if vals:  # the first steps' losses (~5.5) would squash the curves
        ax.set_ylim(top=max(vals) + 0.5)
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss (nats per byte)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_csv(rows: list[dict], path: Path) -> None:
    """All rows; the optimizers' statistics (``optimizer/...``) follow the common columns."""
    extra = sorted({k for r in rows for k in r} - set(FIELDS))
    write_rows(path, rows, FIELDS + extra)


def markdown(summaries: list[dict]) -> str:
    """The summary table: one row per optimizer."""

    def number(value, digits: int) -> str:
        return "" if value is None else f"{value:,.{digits}f}"

    header = (f"| optimizer | status | steps | tokens | train loss (last {LAST_STEPS} steps) | validation loss | "
              "tokens/s | training time (s) | wall time (s) | peak memory (GiB) |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lines.append(f"| {s['optimizer']} | {s['status']} | {s['steps']} | {s['tokens']:,} | "
                     f"{number(s['train_loss'], 3)} | {number(s['val_loss'], 3)} | {number(s['tokens_per_s'], 0)} | "
                     f"{number(s['train_s'], 1)} | {number(s['wall_s'], 1)} | {number(s['max_memory_gib'], 2)} |")
    return "\n".join(lines)


def step_costs(rows: list[dict], optimizers: list[str]) -> str:
    """The cost table: mean milliseconds per step (range), and in steps of the first optimizer, leaving out the
    first step of each kind (compilation, a kernel's first use: torch SDPA first runs on Sophia's first plain
    step); an optimizer that logs ``optimizer/hessian_refreshed`` gets a row for its refresh steps and one for
    the others."""
    groups = []
    for optimizer in optimizers:
        mine = [r for r in rows if r["optimizer"] == optimizer]
        kinds: dict[object, list[dict]] = {}
        for r in mine:
            kinds.setdefault(r.get("optimizer/hessian_refreshed") == 1.0, []).append(r)
        measured = {kind: steps[1:] for kind, steps in kinds.items()}
        groups.append((optimizer, sorted((r for steps in measured.values() for r in steps), key=lambda r: r["step"])))
        if any("optimizer/hessian_refreshed" in r for r in mine):
            refreshed, plain = measured.get(True, []), measured.get(False, [])
            groups += [(f"{optimizer}, {len(refreshed)} refresh steps", refreshed),
                       (f"{optimizer}, {len(plain)} plain steps", plain)]
    lines = ["| optimizer | ms per step: mean (range) | in steps of the first | CG iterations (mean) |",
             "|---|---|---|---|"]
    baseline = None
    for label, mine in groups:
        times = [1000 * r["step_s"] for r in mine]
        if not times:
            lines.append(f"| {label} | | | |")
            continue
        mean = sum(times) / len(times)
        baseline = mean if baseline is None else baseline
        cg = [r["optimizer/cg_iters"] for r in mine if r.get("optimizer/cg_iters") is not None]
        cells = [f"{mean:.1f} ({min(times):.1f}-{max(times):.1f})", f"{mean / baseline:.2f}",
                 f"{sum(cg) / len(cg):.2f}" if cg else ""]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "lm" / "compare_8k.yaml")
    parser.add_argument("--optimizers", nargs="+", default=["adamw", "sophiah", "newtoncg"],
                        choices=optimizer_names(), metavar="NAME",
                        help="recipe optimizers or variants (key=value overrides go before this option)")
    parser.add_argument("--tokens", type=int, default=128 * 2 * 8192,
                        help="training tokens per optimizer (rounded down to whole steps)")
    parser.add_argument("--out-dir", type=Path, help="folder for the run folders (default: a temporary one)")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "results", help="where the CSV and plots go")
    parser.add_argument("--timeout", type=float, default=240,
                        help="seconds after which a run is stopped, keeping the steps it logged (default 240)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides for every run")
    args = parser.parse_args()
    cfg = load_config(str(args.config), args.overrides)
    tokens_per_step = cfg.data.batch_size * cfg.data.context_length * cfg.train.grad_accum_steps
    steps = args.tokens // tokens_per_step
    if steps < 1:
        parser.error(f"--tokens {args.tokens} is less than one step ({tokens_per_step} tokens)")
    taken = [o for o in args.optimizers if args.out_dir is not None and (args.out_dir / o).exists()]
    if taken:
        parser.error(f"{args.out_dir / taken[0]} exists (the recipe would append to its log); choose another --out-dir")
    print(f"{steps} steps of {tokens_per_step:,} tokens = {steps * tokens_per_step:,} tokens per optimizer",
          file=sys.stderr)

    rows, summaries = [], []
    with tempfile.TemporaryDirectory(prefix="compare_optimizers_") as tmp:
        for optimizer in args.optimizers:
            mine, summary = run(optimizer, steps, tokens_per_step, args, args.out_dir or Path(tmp))
            rows += mine
            summaries.append(summary)
    args.docs.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.docs / "optimizer_comparison.csv")
    plot(rows, args.optimizers, "tokens", "training tokens", args.docs / "optimizer_comparison_tokens.png")
    plot(rows, args.optimizers, "train_s", "training time (s, from the end of step 1)",
         args.docs / "optimizer_comparison_time.png", log_x=True)
    print(f"wrote {args.docs}/optimizer_comparison{{.csv,_tokens.png,_time.png}}", file=sys.stderr)
    print(markdown(summaries))
    print()
    print(step_costs(rows, args.optimizers))


if __name__ == "__main__":
    main()
