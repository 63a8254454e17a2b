"""Data-parallel throughput of the LM recipe: 1 vs 2 GPUs of one host, AdamW and SophiaH, at 8K context (GPU).

Run on a machine with (at least) two CUDA GPUs, from the checkout::

    python benchmarks/bench_ddp.py --out docs/results/ddp_throughput.csv
    # or one optimizer per invocation, to fit a per-command time limit:
    python benchmarks/bench_ddp.py --out docs/results/ddp_throughput.csv --optimizers adamw
    python benchmarks/bench_ddp.py --out docs/results/ddp_throughput.csv --optimizers sophiah --append

For every optimizer and GPU count it launches ``torchrun --standalone --nproc_per_node=G -m
recipes.lm --config configs/lm/gpu_8k.yaml`` for a short run (``--steps``, logging every step,
no W&B, one validation batch and one checkpoint at the end) and reads the recipe's own
``metrics.jsonl``. Each process keeps the config's per-GPU batch (weak scaling: G GPUs train on
G times the tokens per step), so ideal scaling doubles tokens/s. Throughput is measured over the
steps after the first ``--skip`` (Triton autotuning, allocator warm-up): the tokens of those
steps over the sum of their step times, each step time being the recipe's ``tokens per step /
train/tokens_per_s``, which excludes logging, evaluation and checkpointing. SophiaH refreshes
its Hessian estimate every 10th step (steps 1, 11, 21, ...), so with the defaults (30 steps,
skip 10) the timed window holds two refresh steps in twenty, as training would.

NVLink multicast (NVLS) stays off: the environment of every run sets ``NCCL_NVLS_ENABLE=0`` and
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``. The CSV has one row per run; a Markdown table of the
same numbers is printed for docs/distributed.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.environment import child_environment
from recipes.lm.optimizers import OPTIMIZERS

ROOT = Path(__file__).resolve().parent.parent
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "OMP_NUM_THREADS": "4"}
FIELDS = ["optimizer", "gpus", "context_length", "batch_per_gpu", "tokens_per_step", "steps_timed", "tokens_per_s",
          "tokens_per_s_per_gpu", "step_time_s", "scaling_efficiency", "max_memory_gib", "final_loss",
          "wall_s", "status"]


def run(optimizer: str, gpus: int, args: argparse.Namespace, out_dir: Path) -> dict:
    """One short training run; returns its CSV row (``status`` says why it has no numbers, if it has none)."""
    name = f"{optimizer}_{gpus}gpu"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
        "-m", "recipes.lm", "--config", str(args.config), f"name={name}", f"out_dir={out_dir}",
        f"optimizer.name={optimizer}", f"train.steps={args.steps}", "train.log_interval=1",
        f"train.eval_interval={args.steps}", "train.eval_batches=1", "train.checkpoint_interval=0",
        "train.keep_checkpoints=1", "train.progress=false", "logger.kind=none", *args.overrides,
    ]
    env = child_environment(**ENV)
    start = time.perf_counter()
    print(" ".join(command), file=sys.stderr, flush=True)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    row = {"optimizer": optimizer, "gpus": gpus, "wall_s": round(wall, 1)}
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-3:]
        print(done.stderr[-3000:], file=sys.stderr)
        status = "oom" if "OutOfMemoryError" in done.stderr or "out of memory" in done.stderr else "failed"
        return {**row, "status": f"{status}: {' | '.join(tail)[:300]}"}
    metrics = [json.loads(line) for line in (out_dir / name / "metrics.jsonl").read_text().splitlines()]
    config = _config(out_dir / name)
    batch, length = config["data"]["batch_size"], config["data"]["context_length"]
    tokens_per_step = batch * length * gpus
    timed = [m for m in metrics if "train/tokens_per_s" in m and m["step"] > args.skip]
    seconds = sum(tokens_per_step / m["train/tokens_per_s"] for m in timed)
    rate = tokens_per_step * len(timed) / seconds
    memory = max((m.get("train/max_memory_gib", float("nan")) for m in metrics), default=float("nan"))
    return {**row, "context_length": length, "batch_per_gpu": batch, "tokens_per_step": tokens_per_step,
            "steps_timed": len(timed), "tokens_per_s": round(rate), "tokens_per_s_per_gpu": round(rate / gpus),
            "step_time_s": round(seconds / len(timed), 4), "max_memory_gib": round(memory, 2),
            "final_loss": round(metrics[-1].get("train/loss", float("nan")), 4), "status": "ok"}


def _config(run_dir: Path) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "ddp_throughput.csv")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "lm" / "gpu_8k.yaml")
    parser.add_argument("--optimizers", nargs="+", default=["adamw", "sophiah"], choices=sorted(OPTIMIZERS),
                        metavar="NAME", help=f"some of {' '.join(sorted(OPTIMIZERS))} (key=value overrides go before "
                                             "this option)")
    parser.add_argument("--gpus", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--skip", type=int, default=10, help="first steps left out of the timing")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--append", action="store_true", help="add the rows to an existing CSV (e.g. one "
                        "optimizer per invocation, to fit a time limit)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides for every run")
    args = parser.parse_args()
    if args.steps <= args.skip:
        parser.error("--steps must exceed --skip")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_ddp_") as tmp:
        for optimizer in args.optimizers:
            for gpus in args.gpus:
                rows.append(run(optimizer, gpus, args, Path(tmp)))
                print(rows[-1], file=sys.stderr, flush=True)
    for row in rows:
        base = next((r for r in rows if r["optimizer"] == row["optimizer"] and r["gpus"] == min(args.gpus)
                     and r["status"] == "ok"), None)
        if row["status"] == "ok" and base is not None:
            per_gpu_ratio = (row["tokens_per_s"] / row["gpus"]) / (base["tokens_per_s"] / base["gpus"])
            row["scaling_efficiency"] = round(per_gpu_ratio, 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    append = args.append and args.out.is_file()
    with open(args.out, "a" if append else "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS, restval="")
        if not append:
            writer.writeheader()
        writer.writerows(rows)
    print("| optimizer | GPUs | tokens/s | tokens/s per GPU | step time (s) | scaling efficiency | peak memory (GiB) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['optimizer']} | {r['gpus']} | {r['status']} | | | | |")
            continue
        print(f"| {r['optimizer']} | {r['gpus']} | {r['tokens_per_s']:,} | {r['tokens_per_s_per_gpu']:,} | "
              f"{r['step_time_s']} | {r.get('scaling_efficiency', '')} | {r['max_memory_gib']} |")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
