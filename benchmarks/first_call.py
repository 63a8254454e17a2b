"""Time of the first fwd+bwd+BoB at a new length, each case in a fresh process (GPU).

Run on the GPU from the checkout; one call runs the cases and writes a CSV::

    PYTHONPATH=. python benchmarks/first_call.py            # N = 16K, head_dim 128, bf16, causal, 16 heads
    PYTHONPATH=. python benchmarks/first_call.py --quick    # only the first two cases
    PYTHONPATH=. python benchmarks/first_call.py --length 8192 \\
        --cases fresh_machine warm_triton arch_fresh_machine arch_warm_triton --out docs/results/first_call_8k.csv

Each case starts a new Python process that imports torch and flashbob, makes inputs at ``(1, heads, N,
head_dim)`` and times, to a ``torch.cuda.synchronize()``, the first ``flashbob.attention`` forward, the
backward with ``create_graph=True`` and the second backward (BoB) with random cotangents of (dQ, dK, dV), as a
Hessian-vector product runs them; then the median of ``--reps`` more runs (the steady state). Every Triton
and tuning cache the cases use is a folder made for this run under ``--tmp`` (``/tmp``), removed at the end.
The cases, in order, each with default settings (``FLASHBOB_AUTOTUNE`` unset: nothing is tuned) unless stated:

* ``fresh_machine``: an empty Triton compile cache (``TRITON_CACHE_DIR`` a new folder) and an empty flashbob
  tuning cache (``FLASHBOB_CACHE_DIR`` a new folder): what a new machine sees;
* ``warm_triton``: the Triton cache the first case filled (the same folder, a second process), an empty
  tuning cache, the same N;
* ``warm_triton_new_length`` (not with ``--quick``): the same, at 2N (a length the first cases did not run);
* ``arch_fresh_machine``, ``arch_warm_triton`` (only if named in ``--cases``): as the first two (with a Triton
  cache of their own), with this GPU's own shipped table hidden, so that the configurations come from its
  architecture's table, as on a GPU that has none (``flashbob/kernels/tuning.py``);
* ``tune_all_fresh_machine`` (not with ``--quick``): both caches empty, ``FLASHBOB_AUTOTUNE=force``, which
  tunes every kernel as flashbob did before its tables (``triton.autotune`` at every first call);
* ``tune_all_warm_triton`` (not with ``--quick``): ``FLASHBOB_AUTOTUNE=force`` with the Triton cache warm;
* ``warm_tuning_cache`` (not with ``--quick``): default settings with the tuning cache the previous case
  wrote and the Triton cache warm;
* ``untuned_defaults`` (not with ``--quick``): ``FLASHBOB_AUTOTUNE=defaults`` (every kernel's default
  configuration, whatever table and cache hold), the Triton cache warm: its ``steady_ms`` against the others'
  shows what the table or the tuning gains.

Columns: the case, the GPU, the shape, ``import_s`` (importing torch and flashbob), ``first_call_s``,
``steady_ms``, ``process_s`` (the whole child process), ``sources`` (how many kernels took their configuration
from the tuning cache, this GPU's table, its architecture's table, tuning or the default;
``flashbob/kernels/configs.py``) and ``status``. At the end a short table, with the targets of the first call
(within 5 s with Triton's cache warm, 20 s fresh).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.environment import ROOT, child_environment
from benchmarks.results import write_rows

CASES = ("fresh_machine", "warm_triton", "warm_triton_new_length", "arch_fresh_machine", "arch_warm_triton",
         "tune_all_fresh_machine", "tune_all_warm_triton", "warm_tuning_cache", "untuned_defaults")
DEFAULT_CASES = tuple(case for case in CASES if not case.startswith("arch_"))
QUICK_CASES = CASES[:2]
#: The first call's targets in seconds: with Triton's compile cache warm, and on a fresh machine.
TARGETS = {"warm_triton": 5.0, "arch_warm_triton": 5.0, "warm_triton_new_length": 5.0, "fresh_machine": 20.0,
           "arch_fresh_machine": 20.0}


def child(length: int, head_dim: int, heads: int, causal: bool, dtype: str, reps: int, hide_own_table: bool) -> dict:
    """Run in the fresh process: the times of one case."""
    start = time.perf_counter()
    import torch

    import flashbob
    from benchmarks.timing import wall_median_ms
    from flashbob.kernels import configs, tuning

    import_s = time.perf_counter() - start
    if hide_own_table:  # as on a GPU without a table: its architecture's tables serve it
        tables_for = tuning.tables_for
        tuning.tables_for = lambda gpu, capability: [t for t in tables_for(gpu, capability) if t[0] != "table"]
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
    return {"gpu": torch.cuda.get_device_name(), "import_s": round(import_s, 2), "first_call_s": round(first_call_s, 2),
            "steady_ms": round(steady_ms, 2) if steady_ms is not None else None,
            "sources": " ".join(f"{source}:{count}" for source, count in sorted(sources.items()))}


def cases(args, folder: Path) -> list[tuple[str, int, dict]]:
    """(case, length, environment) of the cases asked for, in run order; the Triton cache of the first case is
    shared by the others but the ``arch_`` ones, which have their own."""
    triton_cache, arch_cache = str(folder / "triton"), str(folder / "triton_arch")
    fresh = lambda name: str(folder / name)
    listed = {
        "fresh_machine": (args.length, {"TRITON_CACHE_DIR": triton_cache, "FLASHBOB_CACHE_DIR": fresh("tuning_1")}),
        "warm_triton": (args.length, {"TRITON_CACHE_DIR": triton_cache, "FLASHBOB_CACHE_DIR": fresh("tuning_2")}),
        "warm_triton_new_length": (2 * args.length,
                                   {"TRITON_CACHE_DIR": triton_cache, "FLASHBOB_CACHE_DIR": fresh("tuning_3")}),
        "arch_fresh_machine": (args.length, {"TRITON_CACHE_DIR": arch_cache, "FLASHBOB_CACHE_DIR": fresh("tuning_7")}),
        "arch_warm_triton": (args.length, {"TRITON_CACHE_DIR": arch_cache, "FLASHBOB_CACHE_DIR": fresh("tuning_8")}),
        "tune_all_fresh_machine": (args.length, {"TRITON_CACHE_DIR": fresh("triton_2"),
                                                 "FLASHBOB_CACHE_DIR": fresh("tuning_4"), "FLASHBOB_AUTOTUNE": "force"}),
        "tune_all_warm_triton": (args.length, {"TRITON_CACHE_DIR": triton_cache, "FLASHBOB_CACHE_DIR": fresh("tuning_5"),
                                               "FLASHBOB_AUTOTUNE": "force"}),
        "warm_tuning_cache": (args.length, {"TRITON_CACHE_DIR": triton_cache, "FLASHBOB_CACHE_DIR": fresh("tuning_5")}),
        "untuned_defaults": (args.length, {"TRITON_CACHE_DIR": triton_cache, "FLASHBOB_CACHE_DIR": fresh("tuning_6"),
                                           "FLASHBOB_AUTOTUNE": "defaults"}),
    }
    names = args.cases or (QUICK_CASES if args.quick else DEFAULT_CASES)
    return [(name, *listed[name]) for name in CASES if name in names]


def run_case(name: str, length: int, environment: dict, args) -> dict:
    """Run one case in a fresh process; its row of the CSV."""
    row = {"case": name, "gpu": "", "length": length, "head_dim": args.head_dim, "heads": args.heads,
           "causal": args.causal, "dtype": args.dtype, "import_s": None, "first_call_s": None, "steady_ms": None,
           "process_s": None, "sources": "", "status": "ok"}
    command = [sys.executable, __file__, "--child", json.dumps([length, args.head_dim, args.heads, bool(args.causal),
                                                               args.dtype, args.reps, name.startswith("arch_")])]
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


def summary(rows: list[dict]) -> str:
    """The rows as a short Markdown table, with each first call against its target."""
    lines = ["| case | first call | target | steady state | configurations |", "|---|---|---|---|---|"]
    for row in rows:
        first, target = row["first_call_s"], TARGETS.get(row["case"])
        met = "met" if first is not None and target is not None and first <= target else "NOT met"
        verdict = "" if target is None or first is None else f"<= {target:.0f} s: {met}"
        shown = f"{first:.2f} s" if first is not None else row["status"]
        steady = f"{row['steady_ms']:.2f} ms" if row["steady_ms"] is not None else ""
        lines.append(f"| {row['case']} | {shown} | {verdict} | {steady} | {row['sources']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the fresh_machine and warm_triton cases")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=None, help="the cases to run (run in the order "
                        "of the module's docstring; default: all but the arch_ ones)")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--causal", type=int, choices=(0, 1), default=1)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--reps", type=int, default=5, help="steady-state runs after the first")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one case may take")
    parser.add_argument("--tmp", default="/tmp", help="where the run's Triton and tuning caches are made")
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
    folder = Path(tempfile.mkdtemp(prefix="flashbob-first-call-", dir=args.tmp))
    try:
        for name, length, environment in cases(args, folder):
            rows.append(run_case(name, length, environment, args))
            print(" ".join(f"{key}={value}" for key, value in rows[-1].items()), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    write_rows(args.out, rows)
    print(f"\n{rows[0]['gpu'] or 'GPU'}: N = {args.length}, head_dim {args.head_dim}, {args.heads} heads, "
          f"causal={args.causal}, {args.dtype}\n{summary(rows)}")
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
