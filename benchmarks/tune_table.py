"""Tune every kernel's launch configuration on this GPU and write its shipped table (GPU).

Run on the GPU from the checkout; one call does everything and prints one line per kernel tuned::

    PYTHONPATH=. python benchmarks/tune_table.py            # head_dim 64, 128; bf16, fp16; N = 1K-64K; causal, not
    PYTHONPATH=. python benchmarks/tune_table.py --quick    # head_dim 128, bf16, N = 4K and 16K, causal and not

The H100's table (bf16, head_dim 64 and 128, causal and not, N = 4K, 16K, 1K, 32K with 256K tokens per
shape, 16 heads at least, in about 7 minutes; longer lengths take the 32K entries, other dtypes and head_dims
the H200's table, ``flashbob/kernels/tuning.py``)::

    PYTHONPATH=. python benchmarks/tune_table.py --expect-gpu "NVIDIA H100 80GB HBM3" --dtypes bfloat16 \
        --lengths 4096 16384 1024 32768 --tokens 262144 --max-minutes 7

The table goes to ``flashbob/kernels/tuned/<GPU>.json`` (``--out``: a file, or a folder to write ``<GPU>.json``
in), named after the GPU as ``flashbob/kernels/tuning.py`` describes, with the GPU's compute capability in its
header (the GPU must be listed under it in ``tuning.ARCHITECTURE_TABLES`` for other GPUs of its architecture
to use the table); ``--expect-gpu`` refuses to run on another GPU than the one named. Each
shape (head_dim, dtype, causal, N; batch 1, ``--heads`` heads, or ``--tokens / N``: :func:`heads_at`) runs what one
Hessian-vector product launches in each mode: the forward, the backward and BoB with all three cotangents,
and the forward-mode kernels with every tangent (``tuning.run_hvp_kernels``), all tuned (mode ``force``)
into a throwaway tuning cache, so that every kernel is tuned at that shape. Shapes run length by length in
the order of ``--lengths``, every flag set at one length before the next length, so that a run that stops
early has the first lengths of every flag set. The picks are merged into the table after each shape: a run
that stops (``--max-minutes``, a time limit, an error) keeps what it tuned, and the next run skips the shapes
the table already records (``--retune`` does them again; to go on from a shipped table, copy it to
``--out`` first).

First, ``--jobs`` worker processes compile every candidate into Triton's cache: each takes one flag set
(head_dim, dtype, causal) and one part of the kernels (the first-order ones, BoB's, the forward-mode ones), runs
it at the shortest length and tunes with a clock that only runs each candidate once. The tuning then (one
process, alone on the GPU) spends its time timing, not compiling.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import triton
import triton.testing

from benchmarks.environment import ROOT, child_environment
from flashbob.kernels import tuning

LENGTHS = [4096, 16384, 1024, 65536, 8192, 2048, 32768]  # in the order they are tuned
PARTS = tuning.PARTS


def heads_at(n: int, args) -> int:
    """The number of heads of a shape of length ``n``: ``--tokens / n`` rounded down to a multiple of 16, at least
    16, if ``--tokens``; else ``--heads``. Triton specializes a kernel's integer arguments (the number of heads is
    one) on their divisibility by 16: so every length runs the kernels that the compile phase compiled at the
    shortest one."""
    return max(16, args.tokens // n // 16 * 16) if args.tokens else args.heads


def shapes(args) -> list[tuple[int, str, bool, int]]:
    """(head_dim, dtype, causal, N) to tune, in order: by length in the order of ``--lengths``, then dtype,
    head_dim and causal."""
    return [(head_dim, dtype, bool(causal), n) for n in args.lengths for dtype in args.dtypes
            for head_dim in args.head_dims for causal in args.causal]


def run_hvp_kernels(head_dim: int, dtype: str, causal: bool, n: int, heads: int, parts=PARTS) -> None:
    """``tuning.run_hvp_kernels`` on the GPU: the kernels of ``parts`` tuned (mode ``force``), the others with
    their defaults."""
    tuning.run_hvp_kernels(head_dim, dtype, causal, n, heads, parts=parts, mode="force")


def expected_seconds(n: int, finished: list[tuple[int, float]]) -> float:
    """How long a shape of length ``n`` should take, from the (length, seconds) of the shapes tuned so far: the
    longest at this length, else the longest of any length scaled by ``max(1, n / its length)``; 0 before any."""
    same = [seconds for length, seconds in finished if length == n]
    if same:
        return max(same)
    return max((seconds * max(1.0, n / length) for length, seconds in finished), default=0.0)


def compile_worker(head_dim: int, dtype: str, causal: bool, n: int, heads: int, part: str) -> None:
    """Compile every candidate of the kernels of ``part`` for one flag set into Triton's cache: tune them with a
    clock that runs each candidate once (compiling it) and times nothing."""
    with tuning.timed_by(lambda run: (run(), 0.0)[1]):
        run_hvp_kernels(head_dim, dtype, causal, n, heads, parts=(part,))


def compile_all(todo, args) -> None:
    """:func:`compile_worker` for each flag set of ``todo`` and each part, ``args.jobs`` processes at a time (each
    with a throwaway tuning cache of its own: the picks of a clock that times nothing are worthless)."""
    flag_sets = sorted({(head_dim, dtype, causal) for head_dim, dtype, causal, _ in todo})
    n = min(n for *_, n in todo)

    def compile_one(task):
        (head_dim, dtype, causal), part = task
        worker = json.dumps([head_dim, dtype, causal, n, heads_at(n, args), part])
        environment = child_environment(FLASHBOB_CACHE_DIR=tempfile.mkdtemp())
        done = subprocess.run([sys.executable, __file__, "--compile-worker", worker], env=environment, cwd=ROOT,
                              capture_output=True, text=True, check=False)
        status = "compiled" if done.returncode == 0 else f"failed:\n{done.stderr[-2000:]}"
        print(f"head_dim {head_dim} {dtype} causal={int(causal)} {part}: {status}", flush=True)

    start = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(compile_one, [(flag_set, part) for flag_set in flag_sets for part in PARTS]))
    print(f"compiled the candidates of {len(flag_sets)} flag sets in {time.perf_counter() - start:.0f} s", flush=True)


def tuned_entries(bucket: int) -> dict:
    """The picks tuned in this process for length ``bucket``, as table entries."""
    from flashbob.kernels import configs

    return {tuning.Key.from_json(row): configs.config_tuple(configs.BlockConfig(**row["config"]))
            for row in configs.tuned_configs()
            if row["source"] == "tuned" and row["bucket"] == bucket}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="head_dim 128, bfloat16, N = 4K and 16K, causal and not")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", choices=("bfloat16", "float16"), default=["bfloat16", "float16"])
    parser.add_argument("--causal", nargs="+", type=int, default=[0, 1], help="1 causal, 0 not")
    parser.add_argument("--lengths", nargs="+", type=int, default=LENGTHS, help="tuned in this order")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=0,
                        help="heads = tokens / N (a multiple of 16, at least 16) instead of --heads: about the same "
                             "tokens at every length")
    parser.add_argument("--out", default="", help="the table's file, or a folder to write <GPU>.json in "
                        "(default: flashbob/kernels/tuned/<GPU>.json)")
    parser.add_argument("--expect-gpu", default="", help="exit unless torch.cuda.get_device_name() is this")
    parser.add_argument("--retune", action="store_true", help="tune the shapes the table already records again")
    parser.add_argument("--max-minutes", type=float, default=0,
                        help="time budget from the start, compiling included: a shape starts only if the time it "
                             "is expected to take (from the shapes tuned so far) is left (0: no limit)")
    parser.add_argument("--warmup-ms", type=float, default=25, help="do_bench warm-up per candidate")
    parser.add_argument("--rep-ms", type=float, default=100, help="do_bench repetitions per candidate (the median)")
    parser.add_argument("--jobs", type=int, default=max(1, min(16, (os.cpu_count() or 4) - 2)),
                        help="processes compiling candidates before the tuning (0: no compile phase)")
    parser.add_argument("--compile-worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    start = time.perf_counter()
    if args.compile_worker:
        compile_worker(*json.loads(args.compile_worker))
        return
    if not torch.cuda.is_available():
        sys.exit("tune_table.py tunes on a CUDA GPU; none is available")
    if args.quick:
        args.head_dims, args.dtypes, args.lengths = [128], ["bfloat16"], [4096, 16384]

    gpu = torch.cuda.get_device_name()
    if args.expect_gpu and gpu != args.expect_gpu:
        sys.exit(f"this GPU is {gpu!r}, not {args.expect_gpu!r}: its table would be another GPU's")
    capability = tuning.capability_name(torch.cuda.get_device_capability())
    out = Path(args.out) if args.out else tuning.table_path(gpu)
    if out.is_dir():
        out = out / tuning.table_path(gpu).name
    entries = dict(tuning.load_table(out))
    recorded = json.loads(out.read_text()).get("shapes", []) if out.exists() else []
    done = {tuple(shape) for shape in recorded} if not args.retune else set()
    todo = [shape for shape in shapes(args) if (*shape, heads_at(shape[3], args)) not in done]
    print(f"{gpu} (compute capability {capability}): {len(todo)} shapes to tune into {out} ({len(entries)} entries "
          f"there)", flush=True)
    if gpu not in tuning.ARCHITECTURE_TABLES.get(capability, ()):
        print(f"note: {gpu!r} is not listed under {capability!r} in flashbob.kernels.tuning.ARCHITECTURE_TABLES, so "
              "other GPUs of this architecture will not use its table", flush=True)
    if not todo:
        return

    os.environ["FLASHBOB_CACHE_DIR"] = tempfile.mkdtemp(prefix="flashbob-tune-table-")
    if args.jobs:
        compile_all(todo, args)
    timer = lambda run: triton.testing.do_bench(run, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
    finished, skipped = [], []
    for head_dim, dtype, causal, n in todo:
        heads = heads_at(n, args)
        elapsed, expected = time.perf_counter() - start, expected_seconds(n, finished)
        if args.max_minutes and elapsed + expected > 60 * args.max_minutes:
            skipped.append((head_dim, dtype, causal, n))
            print(f"--- skipped head_dim {head_dim}, {dtype}, causal={int(causal)}, N={n}: expected to take "
                  f"{expected:.0f} s, {60 * args.max_minutes - elapsed:.0f} s left", flush=True)
            continue
        print(f"--- head_dim {head_dim}, {dtype}, causal={int(causal)}, N={n}, heads={heads} ({elapsed:.0f} s in)",
              flush=True)
        shape_start = time.perf_counter()
        with tuning.timed_by(timer):
            run_hvp_kernels(head_dim, dtype, causal, n, heads)
        finished.append((n, time.perf_counter() - shape_start))
        entries.update(tuned_entries(tuning.bucket(n)))
        recorded.append([head_dim, dtype, causal, n, heads])
        tuning.write_table(out, gpu, entries, capability=capability, triton=triton.__version__,
                           torch=torch.__version__, date=datetime.date.today().isoformat(),
                           written_by="benchmarks/tune_table.py", shapes=recorded)
        print(f"    {finished[-1][1]:.0f} s; {len(entries)} entries in {out}", flush=True)
    print(f"wrote {len(entries)} entries for {len(recorded)} shapes to {out} in {time.perf_counter() - start:.0f} s"
          + (f"; {len(skipped)} shapes skipped for time: run again to go on" if skipped else ""), flush=True)


if __name__ == "__main__":
    main()
