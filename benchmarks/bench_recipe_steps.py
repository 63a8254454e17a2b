"""The LM recipe's training step with ``train.compile`` off and on, per optimizer (GPU).

    PYTHONPATH=. FLASHBOB_AUTOTUNE=0 python benchmarks/bench_recipe_steps.py --out docs/results/recipe_steps.csv

The recipe (``recipes.lm.train.build``) is built from ``--config`` (default ``configs/lm/gpu_8k.yaml``: 8 layers,
d_model 512, context 8,192, 8 sequences a step, bf16 autocast) for each optimizer of ``--optimizers`` and each
setting of ``train.compile``. ``--warmup`` steps run first (compilation, kernel launches), then ``--steps`` steps
are timed one by one (CUDA-synchronised host clock: a step holds host synchronisations of its own). ``mean_ms``
is their mean: for SophiaH, with ``update_period`` k = 10, ``--steps`` 20 holds two Hessian refreshes, so the mean
is the cost per step amortised over its schedule; ``refresh_ms`` and ``plain_ms`` are the means of the steps that
refresh the Hessian estimate and of the rest. With ``train.compile=true`` the first-order passes run the compiled
model and the curvature passes the eager one (torch.compile cannot differentiate a graph twice).

Writes a CSV and prints a table last. CPU smoke test (tiny config, a few steps)::

    PYTHONPATH=. python benchmarks/bench_recipe_steps.py --device cpu --out /tmp/steps.csv
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.results import write_rows
from recipes.common import distributed
from recipes.lm import train

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("optimizer", "compile", "context", "tokens_per_step", "steps", "mean_ms", "refresh_ms", "plain_ms",
           "ratio", "status")


def timed_steps(optimizer: str, compiled: bool, args: argparse.Namespace, out_dir: str) -> dict:
    """Build the recipe and time its steps; one CSV row."""
    overrides = [f"optimizer.name={optimizer}", f"train.compile={str(compiled).lower()}", f"out_dir={out_dir}",
                 f"train.device={args.device}", *args.overrides]
    if args.device == "cpu" and optimizer == "sophiah":
        overrides.append("optimizer.kwargs={update_period: 2}")
    cfg = train.load_config(str(args.config), overrides)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else None

    def autocast():
        return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    torch.manual_seed(cfg.train.seed)
    torch._dynamo.reset()
    recipe = train.build(cfg, device, autocast, distributed.Context(device=device))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        recipe.step()
    times = []
    for _ in range(args.steps):
        sync()
        start = time.perf_counter()
        recipe.step()
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    period = int(cfg.optimizer.kwargs.get("update_period", 10)) if optimizer == "sophiah" else 0
    row = {"optimizer": optimizer, "compile": compiled, "context": cfg.data.context_length,
           "tokens_per_step": cfg.data.batch_size * cfg.data.context_length, "steps": args.steps,
           "mean_ms": round(statistics.mean(times), 2), "status": "ok"}
    if period:  # step counts start at 0: a step whose count is a multiple of the period refreshes
        refresh = [ms for i, ms in enumerate(times, start=args.warmup) if i % period == 0]
        plain = [ms for i, ms in enumerate(times, start=args.warmup) if i % period != 0]
        row.update(refresh_ms=round(statistics.mean(refresh), 2) if refresh else "",
                   plain_ms=round(statistics.mean(plain), 2) if plain else "")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "lm" / "gpu_8k.yaml")
    parser.add_argument("--optimizers", nargs="+", default=["adamw", "sophiah"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="docs/results/recipe_steps.csv")
    parser.add_argument("--device", default="cuda", help="cpu: smoke test (tiny config, a few steps)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides for every run")
    args = parser.parse_args()
    if args.device == "cpu":
        args.config, args.warmup, args.steps = ROOT / "configs" / "lm" / "tiny.yaml", 2, 2
        args.overrides = ["model.d_model=32", "model.n_layers=1", "data.context_length=32", "data.batch_size=2",
                          "data.max_bytes=200000", *args.overrides]
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        for optimizer in args.optimizers:
            for compiled in (False, True):
                try:
                    rows.append(timed_steps(optimizer, compiled, args, out_dir))
                except Exception as error:  # noqa: BLE001 (recorded, and the other rows still run)
                    rows.append({"optimizer": optimizer, "compile": compiled,
                                 "status": f"{type(error).__name__}: {str(error).strip()[:300]}"})
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    for row in rows:
        eager = next((r for r in rows if r["optimizer"] == row["optimizer"] and not r["compile"]
                      and "mean_ms" in r), None)
        if eager and "mean_ms" in row:
            row["ratio"] = round(row["mean_ms"] / eager["mean_ms"], 3)
    write_rows(args.out, rows, COLUMNS)
    print(f"{'optimizer':10} {'compile':8} {'mean ms':>9} {'refresh':>9} {'plain':>9} {'vs eager':>9}  status")
    for row in rows:
        print(f"{row['optimizer']:10} {str(row['compile']):8} {row.get('mean_ms', ''):>9} "
              f"{row.get('refresh_ms', ''):>9} {row.get('plain_ms', ''):>9} {row.get('ratio', ''):>9}  "
              f"{row['status']}")


if __name__ == "__main__":
    main()
