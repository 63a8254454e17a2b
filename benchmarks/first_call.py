"""Time of the first fwd+bwd+BoB at a new length, each case in a fresh process (GPU).

Run on the GPU from the checkout; one call runs every case and writes a CSV::

    PYTHONPATH=. python benchmarks/first_call.py            # N = 16K, head_dim 128, bf16, causal, 16 heads
    PYTHONPATH=. python benchmarks/first_call.py --quick    # only the first two cases

Each case starts a new Python process that imports torch and flashbob, makes inputs at ``(1, heads, N,
head_dim)`` and times, to a ``torch.cuda.synchronize()``, the first ``flashbob.attention`` forward, the
backward with ``create_graph=True`` and the second backward (BoB) with random cotangents of (dQ, dK, dV), as a
Hessian-vector product runs them; then the median of ``--reps`` more runs (the steady state). The cases, in
order, each with default settings (``FLASHBOB_AUTOTUNE`` unset) unless stated:

* ``fresh_machine``: an empty Triton compile cache (``TRITON_CACHE_DIR`` a new folder) and an empty flashbob
  tuning cache (``FLASHBOB_CACHE_DIR`` a new folder): what a new machine sees;
* ``warm_triton``: the Triton cache the first case filled, an empty tuning cache, the same N;
* ``warm_triton_new_length``: the same, at 2N (a length the first cases did not run);
* ``tune_all_fresh_machine`` (not with ``--quick``): both caches empty, ``FLASHBOB_AUTOTUNE=force``, which
  tunes every kernel as flashbob did before its tables (``triton.autotune`` at every first call);
* ``tune_all_warm_triton`` (not with ``--quick``): ``FLASHBOB_AUTOTUNE=force`` with the Triton cache warm;
* ``warm_tuning_cache`` (not with ``--quick``): default settings with the tuning cache the previous case
  wrote and the Triton cache warm;
* ``untuned_defaults`` (not with ``--quick``): ``FLASHBOB_AUTOTUNE=defaults`` (every kernel's default
  configuration, whatever table and cache hold), the Triton cache warm: its ``steady_ms`` against the others'
  shows what the table or the tuning gains.

Columns: the case, the shape, ``import_s`` (importing torch and flashbob), ``first_call_s``, ``steady_ms``,
``process_s`` (the whole child process), ``sources`` (how many kernels took their configuration from the
tuning cache, the shipped table, tuning or the default; ``flashbob/kernels/configs.py``) and ``status``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.environment import ROOT, child_environment
from benchmarks.results import write_rows


def child(length: int, head_dim: int, heads: int, causal: bool, dtype: str, reps: int) -> dict:
    """Run in the fresh process: the times of one case."""
    start = time.perf_counter()
    import torch

    import flashbob
    from benchmarks.timing import wall_median_ms
    from flashbob.kernels import configs

    import_s = time.perf_counter() - start
    generator = torch.Generator(device="cuda").manual_seed(0)
    tensor = lambda: torch.randn(1, heads, length, head_dim, device="cuda", dtype=getattr(torch, dtype),
                                 generator=generator)
    q, k, v = (tensor().requires_grad_() for _ in range(3))
    do, *bars = (tensor() for _ in range(4))

    def hvp_attention():
        grads = torch.autograd.grad(flashbob.attention(q, k, v, causal=causal), (q, k, v), do, create_graph=True)
        torch.autograd.grad(grads, (q, k, v), bars)
        torch.cuda.synchronize()

    torch.cuda.synchronize()
    first = time.perf_counter()
    hvp_attention()
    first_call_s = time.perf_counter() - first
    steady_ms = wall_median_ms(hvp_attention, reps) if reps else None  # hvp_attention synchronises
    sources = Counter(row["source"] for row in configs.tuned_configs())
    return {"import_s": round(import_s, 2), "first_call_s": round(first_call_s, 2),
            "steady_ms": round(steady_ms, 2) if steady_ms is not None else None,
            "sources": " ".join(f"{source}:{count}" for source, count in sorted(sources.items()))}


def cases(args, folder: Path) -> list[tuple[str, int, dict]]:
    """(case, length, environment) in run order; the Triton cache of the first case is shared by the others."""
    triton_cache = str(folder / "triton")
    fresh = lambda name: str(folder / name)
    listed = [
        ("fresh_machine", args.length, {"TRITON_CACHE_DIR": triton_cache, "FLASHBOB_CACHE_DIR": fresh("tuning_1")}),
        ("warm_triton", args.length, {"TRITON_CACHE_DIR": triton_cache, "FLASHBOB_CACHE_DIR": fresh("tuning_2")}),
        ("warm_triton_new_length", 2 * args.length,
         {"TRITON_CACHE_DIR": triton_cache, "FLASHBOB_CACHE_DIR": fresh("tuning_3")}),
        ("tune_all_fresh_machine", args.length, {"TRITON_CACHE_DIR": fresh("triton_2"),
                                                 "FLASHBOB_CACHE_DIR": fresh("tuning_4"), "FLASHBOB_AUTOTUNE": "force"}),
        ("tune_all_warm_triton", args.length, {"TRITON_CACHE_DIR": triton_cache, "FLASHBOB_CACHE_DIR": fresh("tuning_5"),
                                               "FLASHBOB_AUTOTUNE": "force"}),
        ("warm_tuning_cache", args.length, {"TRITON_CACHE_DIR": triton_cache, "FLASHBOB_CACHE_DIR": fresh("tuning_5")}),
        ("untuned_defaults", args.length, {"TRITON_CACHE_DIR": triton_cache, "FLASHBOB_CACHE_DIR": fresh("tuning_6"),
                                           "FLASHBOB_AUTOTUNE": "defaults"}),
    ]
    return listed[:2] if args.quick else listed


def run_case(name: str, length: int, environment: dict, args) -> dict:
    """Run one case in a fresh process; its row of the CSV."""
    row = {"case": name, "length": length, "head_dim": args.head_dim, "heads": args.heads, "causal": args.causal,
           "dtype": args.dtype, "import_s": None, "first_call_s": None, "steady_ms": None, "process_s": None,
           "sources": "", "status": "ok"}
    command = [sys.executable, __file__, "--child", json.dumps([length, args.head_dim, args.heads, bool(args.causal),
                                                               args.dtype, args.reps])]
    settings = child_environment(**environment)
    if "FLASHBOB_AUTOTUNE" not in environment:
        settings.pop("FLASHBOB_AUTOTUNE", None)  # default settings, whatever this shell says
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=settings, cwd=ROOT, capture_output=True, text=True, check=False,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        row["status"] = f"timeout after {args.timeout:.0f} s"
        return row
    row["process_s"] = round(time.perf_counter() - start, 2)
    if done.returncode != 0:
        row["status"] = "error: " + (done.stderr.strip().splitlines() or ["?"])[-1][:200]
        return row
    row.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the fresh_machine and warm_triton cases")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--causal", type=int, choices=(0, 1), default=1)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--reps", type=int, default=5, help="steady-state runs after the first")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one case may take")
    parser.add_argument("--out", default="docs/results/first_call.csv")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("first_call.py times the kernels on a CUDA GPU; none is available")
    rows = []
    with tempfile.TemporaryDirectory(prefix="flashbob-first-call-") as folder:
        for name, length, environment in cases(args, Path(folder)):
            rows.append(run_case(name, length, environment, args))
            print(" ".join(f"{key}={value}" for key, value in rows[-1].items()), flush=True)
    write_rows(args.out, rows)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
