"""Time BoB alone under each schedule of the BoB kernels, autotuning only the kernels named (GPU).

    PYTHONPATH=. python benchmarks/compare_schedules.py --schedules three_pass four_pass \
        --tune bob_rows_q_bar bob_rows_do_bar --out schedules.csv

For each causal flag and each ``--schedules`` entry (``FLASHBOB_BOB_SCHEDULE``) it times the second
backward alone through the Triton kernels (``bench_attention.py``'s ``bob`` workload: a retained
first-backward graph; median of ``--reps`` CUDA-event timings after two warm-up runs) at one shape. Every kernel runs its default
config except those in ``--tune``, which autotune over their own space (``kernels/configs.py``), so
a new schedule's kernels can be tuned in a minute instead of tuning all of them. It then checks that
the schedules agree: BoB's outputs in float32 at ``--check-n`` (odd, causal) relative to the first
schedule's. Prints a Markdown table and the configs autotuning picked; writes one CSV row per case.
``--device cpu`` is a smoke test in Triton's interpreter (wall-clock times, no tuning).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

import flashbob
from benchmarks.results import write_rows
from benchmarks.timing import attention_tflops, median_ms, wall_median_ms
from flashbob.kernels import configs


def restrict_tuning(tuned: list[str]) -> None:
    """Every kernel but those in ``tuned`` keeps only its default config (a one-config autotune does not benchmark)."""
    for kernel in configs.KERNELS:
        if kernel not in tuned:
            configs.SPACES[kernel] = configs.SPACES[kernel][:1]
    configs.candidates.cache_clear()


def bob_workload(q, k, v, causal: bool):
    """The second backward alone through the Triton kernels, on a first-backward graph built once."""
    inputs = (q, k, v)
    do, *bars = (torch.randn_like(x) for x in (q, q, k, v))
    out = flashbob.attention(q, k, v, causal=causal, backend="triton")
    grads = torch.autograd.grad(out, inputs, do, create_graph=True)
    return lambda: torch.autograd.grad(grads, inputs, bars, retain_graph=True)


def bob_outputs(schedule: str, q, k, v, causal: bool) -> tuple[torch.Tensor, ...]:
    os.environ["FLASHBOB_BOB_SCHEDULE"] = schedule
    torch.manual_seed(0)  # the same dO and cotangents for every schedule
    return bob_workload(q, k, v, causal)()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", choices=configs.BOB_SCHEDULES, default=["three_pass", "four_pass"])
    parser.add_argument("--tune", nargs="*", choices=configs.KERNELS, default=["bob_rows_q_bar", "bob_rows_do_bar"],
                        help="kernels that autotune (the others run their default config)")
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", nargs="+", type=int, default=[0, 1], help="1 causal, 0 not")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--check-n", type=int, default=1000, help="length of the float32 agreement check")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None, help="CSV, one row per (causal, schedule)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    os.environ.setdefault("FLASHBOB_AUTOTUNE", "1")
    restrict_tuning(args.tune)
    dtype = torch.bfloat16 if cuda else torch.float32

    rows = []
    for causal in map(bool, args.causal):
        generator = torch.Generator(device=args.device).manual_seed(0)
        q, k, v = (torch.randn(1, args.heads, args.n, args.head_dim, device=args.device, dtype=dtype,
                               generator=generator, requires_grad=True) for _ in range(3))
        for schedule in args.schedules:
            os.environ["FLASHBOB_BOB_SCHEDULE"] = schedule
            fn = bob_workload(q, k, v, causal)
            for _ in range(2):  # compiles and autotunes outside the measurement
                fn()
            ms = median_ms(fn, args.reps) if cuda else wall_median_ms(fn, args.reps)
            tflops = attention_tflops("bob", ms, batch=1, heads=args.heads, n=args.n, m=args.n,
                                      head_dim=args.head_dim, causal=causal)
            rows.append(dict(schedule=schedule, n=args.n, heads=args.heads, head_dim=args.head_dim, causal=causal,
                             dtype=str(dtype).removeprefix("torch."), ms=ms, tflops=tflops))
            print(f"causal={causal:d} {schedule:10s} BoB {ms:9.2f} ms {tflops:6.1f} TFLOP/s", flush=True)

    generator = torch.Generator(device=args.device).manual_seed(1)
    q, k, v = (torch.randn(1, 4, args.check_n, 64, device=args.device, generator=generator, requires_grad=True)
               for _ in range(3))
    reference = bob_outputs(args.schedules[0], q, k, v, True)
    for schedule in args.schedules[1:]:
        diffs = [((a - b).norm() / b.norm()).item() for a, b in zip(bob_outputs(schedule, q, k, v, True), reference)]
        print(f"float32, N = {args.check_n}, causal: {schedule} vs {args.schedules[0]}, relative difference of the "
              "second derivatives w.r.t. (q, k, v): " + ", ".join(f"{d:.1e}" for d in diffs))

    print("\n| causal | schedule | BoB ms | TFLOP/s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {'yes' if r['causal'] else 'no'} | {r['schedule']} | {r['ms']:.2f} | {r['tflops']:.0f} |")
    for r in configs.tuned_configs():
        if r["kernel"] in args.tune:
            print(f"autotuned {r['kernel']} (causal={r['flags'].get('CAUSAL')}): {r['config']}")
    if args.out:
        write_rows(args.out, rows)
        print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
