"""DRAM traffic of every flashbob kernel, measured with Nsight Compute, against two models.

Run on a CUDA machine with ``ncu`` on the PATH (defaults: B=1, H=16, d=128, bf16, N = 16K and 64K,
causal and not)::

    FLASHBOB_AUTOTUNE=0 PYTHONPATH=. python benchmarks/io_profile.py --out docs/results/io_profile.csv

For each length and causal flag a child process runs, after two warm-up calls, one forward +
backward + backward-over-backward through ``flashbob.attention`` and one call of each forward-mode
kernel (``kernels.forward_jvp``, ``kernels.backward_jvp``) between ``cudaProfilerStart`` and
``cudaProfilerStop``; ``ncu --profile-from-start off --clock-control none`` reads each launch's
counters. Each launch is named by its config key in ``flashbob/kernels/configs.py`` (``forward``,
``dq``, ``bob_scalars``, ``jvp_cols``, ...), taken from ``configs.launch`` as it runs.

Columns, per kernel launch:

* ``dram_read_mb`` / ``dram_write_mb``: ``dram__bytes_read.sum`` / ``dram__bytes_write.sum``.
* ``argument_mb``: the bytes of the launch's distinct tensor arguments, each once. Every kernel must
  read its inputs and write its outputs at least once, so this is the compulsory traffic (an upper
  bound of it: a sweep that leaves an argument untouched still counts it).
* ``model_mb``: the tiled-streaming model, argument bytes plus the re-reads of the streamed side:
  each of the ``ceil(L_outer / block_outer)`` programs of a (batch, head) reads the other side's
  ``streamed`` d-wide tensors in full (half of them under causal masking), where ``streamed`` is the
  kernel's per-step tile count in ``configs._FOOTPRINT``. With ``block_outer`` ~ SRAM / d this is the
  FlashBoB paper's Theta(N^2 d^2 / M) I/O bound, instantiated with the block sizes that ran.
* ``dram_pct`` / ``sm_pct`` / ``tensor_pct``: DRAM throughput, SM throughput and tensor-pipe
  activity in % of peak. ``bound`` is ``memory`` where DRAM throughput is at least 50% of peak and
  above tensor-pipe activity, ``matrix units`` where tensor-pipe activity is at least 50%, else
  ``latency`` (neither resource is saturated: occupancy, dependencies, synchronisation).

Writes ``--out`` and prints a Markdown table last. ``--child`` is the internal profiled process.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.environment import child_environment
from benchmarks.results import write_rows

METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed", "sm__throughput.avg.pct_of_peak_sustained_elapsed")
#: Tensor-pipe activity metrics, newest first (Hopper's warpgroup MMA, then the older one).
TENSOR_METRICS = ("sm__pipe_tensor_op_gmma_cycles_active", "sm__pipe_tensor_op_hmma_cycles_active")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FIELDS = ("n", "causal", "heads", "head_dim", "dtype", "kernel", "triton_name", "block_m", "block_n", "time_us",
          "dram_read_mb", "dram_write_mb", "argument_mb", "model_mb", "dram_over_argument", "dram_over_model",
          "dram_pct", "sm_pct", "tensor_pct", "bound")


# ---------------------------------------------------------------------------------------------
# Child: run the kernels once inside the profiler range and describe each launch
# ---------------------------------------------------------------------------------------------

def record_launches(run) -> list[dict]:
    """Run ``run()`` with ``configs.launch`` wrapped: one dict per launch (config key, Triton name,
    argument bytes, block sizes, outer/inner lengths) in launch order."""
    from benchmarks.profile_kernels import LaunchRecorder, jit_name
    from flashbob.kernels import configs

    described, original = [], configs.launch

    def launch(kernel, jit_fn, grid, *args, head_dim, dtype, length, **constants):
        tensors = {a.data_ptr(): a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)}
        described.append({"kernel": kernel, "triton_name": jit_name(jit_fn), "argument_bytes": sum(tensors.values()),
                          "head_dim": head_dim, "itemsize": dtype.itemsize, "length": length})
        original(kernel, jit_fn, grid, *args, head_dim=head_dim, dtype=dtype, length=length, **constants)

    configs.launch = launch
    try:
        with LaunchRecorder() as recorder:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            run()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
    finally:
        configs.launch = original
    if len(recorder.launches) != len(described):
        raise RuntimeError(f"{len(described)} configs.launch calls but {len(recorder.launches)} Triton launches "
                           "(is autotuning on? run with FLASHBOB_AUTOTUNE=0)")
    for row, launched in zip(described, recorder.launches, strict=True):
        row["block_m"], row["block_n"] = launched.kwargs.get("BLOCK_M"), launched.kwargs.get("BLOCK_N")
    return described


def child(args) -> None:
    import flashbob
    from benchmarks.bench_jvp_kernels import kernel_workload, random_problem

    x = random_problem(args.n, args.heads, args.head_dim, DTYPES[args.dtype], "cuda")
    q, k, v, do = (x[name].requires_grad_(name != "do") for name in ("q", "k", "v", "do"))
    bars = [torch.randn_like(t) for t in (q, k, v)]
    scale = args.head_dim ** -0.5
    jvp = {name: kernel_workload(name, x, causal=args.causal, scale=scale) for name in ("forward_jvp", "backward_jvp")}

    def run():
        grads = torch.autograd.grad(flashbob.attention(q, k, v, causal=args.causal), (q, k, v), do, create_graph=True)
        torch.autograd.grad(grads, (q, k, v), bars)
        jvp["forward_jvp"]()
        jvp["backward_jvp"]()

    for _ in range(2):
        run()
    Path(args.child).write_text(json.dumps(record_launches(run)))


# ---------------------------------------------------------------------------------------------
# Parent: ncu around the child, then join the counters with the launch descriptions
# ---------------------------------------------------------------------------------------------

def tensor_metric() -> str | None:
    """The first of :data:`TENSOR_METRICS` this ncu knows (None if it lists none of them)."""
    listed = subprocess.run(["ncu", "--query-metrics"], capture_output=True, text=True, check=False).stdout
    return next((f"{m}.avg.pct_of_peak_sustained_active" for m in TENSOR_METRICS if m in listed), None)


def ncu_rows(args, n: int, causal: bool, metrics: tuple[str, ...], launches_file: str) -> list[dict]:
    """Run the child under ncu; one dict per profiled kernel (name and metric values) in launch order."""
    command = ["ncu", "--profile-from-start", "off", "--clock-control", "none", "--target-processes", "all",
               "--csv", "--page", "raw", "--metrics", ",".join(metrics),
               sys.executable, "-m", "benchmarks.io_profile", "--child", launches_file, "--n", str(n),
               "--causal", str(int(causal)), "--heads", str(args.heads), "--head-dim", str(args.head_dim),
               "--dtype", args.dtype]
    done = subprocess.run(command, capture_output=True, text=True, env=child_environment(), check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ncu failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    text = done.stdout[done.stdout.find('"ID"'):]
    rows = list(csv.DictReader(io.StringIO(text)))
    return [r for r in rows if r.get("ID", "").isdigit()]  # drops the units row


def number(value: str | None) -> float:
    return float(value.replace(",", "")) if value not in (None, "", "n/a") else math.nan


def model_bytes(launch: dict, n: int, heads: int, causal: bool) -> float:
    """Argument bytes plus the streamed side's re-reads (module docstring)."""
    from flashbob.kernels import configs

    streamed = configs._FOOTPRINT[launch["kernel"]][3]
    column = launch["kernel"] in configs.COLUMN_KERNELS
    outer_block = launch["block_n"] if column else launch["block_m"]
    if not outer_block:
        return float(launch["argument_bytes"])
    programs = math.ceil(n / outer_block)
    rereads = (programs - 1) * streamed * n * launch["head_dim"] * launch["itemsize"] * heads
    return launch["argument_bytes"] + rereads * (0.5 if causal else 1.0)


def bound(dram_pct: float, tensor_pct: float) -> str:
    if dram_pct >= 50 and not dram_pct < tensor_pct:
        return "memory"
    if tensor_pct >= 50:
        return "matrix units"
    return "latency"


def profile(args, n: int, causal: bool, tensor: str | None) -> list[dict]:
    metrics = METRICS + ((tensor,) if tensor else ())
    with tempfile.TemporaryDirectory() as folder:
        launches_file = str(Path(folder) / "launches.json")
        counters = ncu_rows(args, n, causal, metrics, launches_file)
        launches = json.loads(Path(launches_file).read_text())
    counters = [c for c in counters if any(launch["triton_name"] in c["Kernel Name"] for launch in launches)]
    if len(counters) != len(launches):
        raise RuntimeError(f"ncu profiled {len(counters)} flashbob kernels, the child launched {len(launches)}")
    rows = []
    for launch, counter in zip(launches, counters, strict=True):
        read, write = number(counter["dram__bytes_read.sum"]), number(counter["dram__bytes_write.sum"])
        model = model_bytes(launch, n, args.heads, causal)
        dram_pct = number(counter["dram__throughput.avg.pct_of_peak_sustained_elapsed"])
        tensor_pct = number(counter.get(tensor)) if tensor else math.nan
        rows.append({
            "n": n, "causal": int(causal), "heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype,
            "kernel": launch["kernel"], "triton_name": launch["triton_name"],
            "block_m": launch["block_m"], "block_n": launch["block_n"],
            "time_us": round(number(counter["gpu__time_duration.sum"]) / 1e3, 1),
            "dram_read_mb": round(read / 1e6, 1), "dram_write_mb": round(write / 1e6, 1),
            "argument_mb": round(launch["argument_bytes"] / 1e6, 1), "model_mb": round(model / 1e6, 1),
            "dram_over_argument": round((read + write) / launch["argument_bytes"], 2),
            "dram_over_model": round((read + write) / model, 3),
            "dram_pct": round(dram_pct, 1), "sm_pct": round(number(counter["sm__throughput.avg.pct_of_peak_sustained_elapsed"]), 1),
            "tensor_pct": round(tensor_pct, 1), "bound": bound(dram_pct, 0.0 if math.isnan(tensor_pct) else tensor_pct),
        })
    return rows


def markdown(rows: list[dict]) -> str:
    columns = ("n", "causal", "kernel", "time_us", "dram_read_mb", "dram_write_mb", "argument_mb", "model_mb",
               "dram_over_model", "dram_pct", "tensor_pct", "bound")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--causal", type=int, nargs="+", default=[0, 1], choices=[0, 1])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--out", default="docs/results/io_profile.csv")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        args.causal = bool(args.causal[0])
        child(args)
        return
    if os.environ.get("FLASHBOB_AUTOTUNE", "1") != "0":
        print("note: set FLASHBOB_AUTOTUNE=0 so that one configs.launch is one Triton launch", file=sys.stderr)
    tensor = tensor_metric()
    rows = [row for n in args.lengths for causal in args.causal for row in profile(args, n, bool(causal), tensor)]
    write_rows(args.out, rows, FIELDS)
    print(markdown(rows))


if __name__ == "__main__":
    main()
