"""Tune every kernel's launch configuration on this GPU and write its shipped table (GPU).

Run on the GPU from the checkout; one call does everything and prints one line per kernel tuned::

    PYTHONPATH=. python benchmarks/tune_table.py            # head_dim 64, 128; bf16, fp16; N = 1K-64K; causal, not
    PYTHONPATH=. python benchmarks/tune_table.py --quick    # head_dim 128, bf16, N = 4K and 16K, causal and not

The table goes to ``flashbob/kernels/tuned/<GPU>.json`` (``--out``), named after the GPU as
``flashbob/kernels/tuning.py`` describes. Each shape (head_dim, dtype, causal, N; batch 1, ``--heads`` heads)
runs what one Hessian-vector product launches in each mode: the forward, the backward and BoB with all three
cotangents, and the forward-mode kernels with every tangent, all with ``FLASHBOB_AUTOTUNE=force`` and a
throwaway tuning cache, so that every kernel is tuned at that shape. The picks are merged into the table after
each shape: a run that stops (``--max-minutes``, a time limit, an error) keeps what it tuned, and the next run
skips the shapes the table already records (``--retune`` does them again).

First, ``--jobs`` worker processes compile every candidate into Triton's cache: each takes one flag set
(head_dim, dtype, causal) and one part of the kernels (the first-order ones, BoB's, the forward-mode ones), runs
it at the shortest length and tunes with a clock that only runs each candidate once. The tuning then (one
process, alone on the GPU) spends its time timing, not compiling.
"""

from __future__ import annotations

import argparse
import contextlib
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

from benchmarks.environment import ROOT, child_environment

LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
PARTS = ("first_order", "bob", "forward_mode")


def shapes(args) -> list[tuple[int, str, bool, int]]:
    """(head_dim, dtype, causal, N) to tune, in order."""
    return [(head_dim, dtype, bool(causal), n) for head_dim in args.head_dims for dtype in args.dtypes
            for causal in args.causal for n in args.lengths]


@contextlib.contextmanager
def tuned(tune: bool):
    """Launches inside tune every kernel (``FLASHBOB_AUTOTUNE=force``) or use the defaults."""
    previous = os.environ.get("FLASHBOB_AUTOTUNE")
    os.environ["FLASHBOB_AUTOTUNE"] = "force" if tune else "defaults"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["FLASHBOB_AUTOTUNE"]
        else:
            os.environ["FLASHBOB_AUTOTUNE"] = previous


def run_hvp_kernels(head_dim: int, dtype: str, causal: bool, n: int, heads: int, parts=PARTS) -> None:
    """Launch, once, every kernel that one Hessian-vector product runs at this shape in reverse mode (forward,
    backward, BoB with all cotangents) and in forward mode (forward_jvp, backward_jvp with all tangents); the
    kernels of ``parts`` are tuned, the others take their defaults."""
    from flashbob import kernels

    generator = torch.Generator(device="cuda").manual_seed(0)
    tensor = lambda: torch.randn(1, heads, n, head_dim, device="cuda", dtype=getattr(torch, dtype), generator=generator)
    q, k, v, do, q_bar, k_bar, v_bar, q_dot, k_dot, v_dot, do_dot = (tensor() for _ in range(11))
    options = {"causal": causal, "scale": head_dim**-0.5}
    with tuned("first_order" in parts):
        o, stats = kernels.forward(q, k, v, **options)
        _, _, _, delta = kernels.backward(q, k, v, o, stats, do, **options)
    with tuned("bob" in parts):
        kernels.bob(q, k, v, do, o, stats, delta, q_bar, k_bar, v_bar, **options)
    with tuned("forward_mode" in parts):
        kernels.forward_jvp(q, k, v, o, stats, q_dot, k_dot, v_dot, **options)
        kernels.backward_jvp(q, k, v, do, o, stats, delta, q_dot, k_dot, v_dot, do_dot, **options)
    torch.cuda.synchronize()


def compile_worker(head_dim: int, dtype: str, causal: bool, n: int, heads: int, part: str) -> None:
    """Compile every candidate of the kernels of ``part`` for one flag set into Triton's cache: tune them with a
    clock that runs each candidate once (compiling it) and times nothing."""
    from flashbob.kernels import tuning

    with tuning.timed_by(lambda run: (run(), 0.0)[1]):
        run_hvp_kernels(head_dim, dtype, causal, n, heads, parts=(part,))


def compile_all(todo, args) -> None:
    """:func:`compile_worker` for each flag set of ``todo`` and each part, ``args.jobs`` processes at a time (each
    with a throwaway tuning cache of its own: the picks of a clock that times nothing are worthless)."""
    flag_sets = sorted({(head_dim, dtype, causal) for head_dim, dtype, causal, _ in todo})
    n = min(n for *_, n in todo)

    def compile_one(task):
        (head_dim, dtype, causal), part = task
        worker = json.dumps([head_dim, dtype, causal, n, args.heads, part])
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
    from flashbob.kernels import configs, tuning

    return {tuning.Key.from_json(row): configs.config_tuple(configs.BlockConfig(**row["config"]))
            for row in configs.tuned_configs()
            if row["source"] == "tuned" and row["bucket"] == bucket}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="head_dim 128, bfloat16, N = 4K and 16K, causal and not")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", choices=("bfloat16", "float16"), default=["bfloat16", "float16"])
    parser.add_argument("--causal", nargs="+", type=int, default=[0, 1], help="1 causal, 0 not")
    parser.add_argument("--lengths", nargs="+", type=int, default=LENGTHS)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--out", default="", help="default: flashbob/kernels/tuned/<GPU>.json")
    parser.add_argument("--retune", action="store_true", help="tune the shapes the table already records again")
    parser.add_argument("--max-minutes", type=float, default=0,
                        help="start no shape this long after the start, compiling included (0: no limit)")
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

    from flashbob.kernels import tuning

    gpu = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else tuning.table_path(gpu)
    entries = dict(tuning.load_table(out))
    recorded = json.loads(out.read_text()).get("shapes", []) if out.exists() else []
    done = {tuple(shape) for shape in recorded} if not args.retune else set()
    todo = [shape for shape in shapes(args) if (*shape, args.heads) not in done]
    print(f"{gpu}: {len(todo)} shapes to tune into {out} ({len(entries)} entries there)", flush=True)
    if not todo:
        return

    os.environ["FLASHBOB_CACHE_DIR"] = tempfile.mkdtemp(prefix="flashbob-tune-table-")
    if args.jobs:
        compile_all(todo, args)
    for head_dim, dtype, causal, n in todo:
        if args.max_minutes and time.perf_counter() - start > 60 * args.max_minutes:
            print(f"stopped after {args.max_minutes} minutes; run again to go on", flush=True)
            break
        print(f"--- head_dim {head_dim}, {dtype}, causal={int(causal)}, N={n}, heads={args.heads}", flush=True)
        run_hvp_kernels(head_dim, dtype, causal, n, args.heads)
        entries.update(tuned_entries(tuning.bucket(n)))
        recorded.append([head_dim, dtype, causal, n, args.heads])
        tuning.write_table(out, gpu, entries, triton=triton.__version__, torch=torch.__version__,
                           date=datetime.date.today().isoformat(), written_by="benchmarks/tune_table.py",
                           shapes=recorded)
    print(f"wrote {len(entries)} entries for {len(recorded)} shapes to {out}", flush=True)


if __name__ == "__main__":
    main()
