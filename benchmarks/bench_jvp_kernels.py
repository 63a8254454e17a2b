"""Forward-mode kernels (kernels.forward_jvp, kernels.backward_jvp): time, TFLOP/s, peak memory, accuracy (GPU).

Run on a CUDA machine from the checkout::

    PYTHONPATH=. python benchmarks/bench_jvp_kernels.py
    PYTHONPATH=. python benchmarks/bench_jvp_kernels.py --long --no-accuracy --out docs/results/forward_mode_long.csv

Timing: ``(1, H, N, d)`` bf16 inputs (N = M, H = 16, d = 128, N = 1K, 4K, 16K), causal and not, every
tangent present. ``kernels`` rows time one call of ``kernels.forward_jvp`` (given O and the statistics), of
``kernels.backward_jvp`` (given O, the statistics and Δ: three sweeps) and ``backward_jvp_for``, the same call
also given forward_jvp's tangents of O and the statistics, as in forward-over-reverse (two sweeps), and for
comparison the kernels' own forward and backward; ``eager`` rows time PyTorch's forward mode through naive attention in the same dtype
(``torch.func.jvp`` of ``flashbob.reference.attention``, and of its ``torch.func.vjp`` for the backward's
tangents), which includes the forward (and backward) it differentiates. Medians of ``--reps`` CUDA-event
timings after ``--warmup`` runs (compiling and autotuning happen there); peak memory is
``torch.cuda.max_memory_allocated`` over the timed runs, inputs and tangents included. TFLOP/s use fixed
matrix-product counts per head in units of N·M·d, halved for causal: forward 4, backward 10, forward_jvp 10,
backward_jvp 24 (both forms), whatever an implementation does. ``--long`` adds N = 64K, 128K, 256K for the kernels alone
with H scaled to keep H·N = 16·16K tokens, and the default configs (autotuning there takes minutes).
Out of memory is recorded as ``oom`` and that implementation's workload is not tried at larger N.

Accuracy (``--accuracy-out``): random inputs and tangents drawn in float64 and rounded to each dtype
(bf16, fp16, fp32 without tf32) go through the kernels and through eager forward mode in that dtype; both are
compared with eager forward mode in float64 on the same rounded inputs (run one head at a time, so that 16K
fits). Every tangent (o_dot, dq_dot, dk_dot, dv_dot) gets ``||x - ref|| / ||ref||``; bf16/fp16 PASS when the
kernels' error is at most 1.5x eager's, fp32 when it is below 1e-5.

CPU smoke test of the script (Triton's interpreter, float32 instead of bf16, wall-clock times, no memory)::

    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/bench_jvp_kernels.py --device cpu --lengths 32 \\
        --heads 1 --head-dim 16 --reps 1 --warmup 0 --dtypes fp16 fp32 --out /tmp/t.csv --accuracy-out /tmp/a.csv
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
from dataclasses import asdict, dataclass

import torch

from benchmarks import timing
from benchmarks.results import write_rows
from benchmarks.timing import median_ms, wall_median_ms
from flashbob import kernels, reference

# Matrix-product FLOPs per (batch, head) in units of N*M*d (docs/algorithm.md's conventions), halved for causal.
FLOPS_PER_NMD = {"forward": 4, "backward": 10, "forward_jvp": 10, "backward_jvp": 24, "backward_jvp_for": 24}
WORKLOADS = {"kernels": ("forward", "backward", "forward_jvp", "backward_jvp", "backward_jvp_for"),
             "eager": ("forward_jvp", "backward_jvp")}
OUTPUTS = {"forward_jvp": ("o_dot",), "backward_jvp": ("dq_dot", "dk_dot", "dv_dot"),
           "backward_jvp_for": ("dq_dot_for", "dk_dot_for", "dv_dot_for")}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HALF_BAR, FP32_BAR = 1.5, 1e-5
LONG_LENGTHS, LONG_TOKENS = (65536, 131072, 262144), 16 * 16384


@dataclass
class Case:
    """The problem a row of either table measures: ``(1, heads, n, head_dim)`` inputs in ``dtype``."""

    n: int
    heads: int
    head_dim: int
    causal: bool
    dtype: str


@dataclass
class TimeRow(Case):
    impl: str
    workload: str
    ms: float | None = None
    tflops: float | None = None
    peak_gib: float | None = None
    status: str = "ok"


@dataclass
class AccuracyRow(Case):
    output: str
    err_kernels: float | None = None
    err_eager: float | None = None
    verdict: str = ""


def random_problem(n, heads, head_dim, dtype, device, seed=0) -> dict[str, torch.Tensor]:
    """Primals ``q, k, v, do`` and their tangents, ``(1, heads, n, head_dim)``, drawn in float64, rounded to ``dtype``."""
    generator = torch.Generator(device=device).manual_seed(seed)
    names = ("q", "k", "v", "do", "q_dot", "k_dot", "v_dot", "do_dot")
    return {name: torch.randn(1, heads, n, head_dim, device=device, dtype=torch.float64, generator=generator).to(dtype)
            for name in names}


def kernel_workload(workload, x, *, causal, scale):
    """A zero-argument callable running ``workload`` through the kernels; O, the statistics and Δ it
    takes as given are computed here, once."""
    flags = {"causal": causal, "scale": scale}
    q, k, v, do = x["q"], x["k"], x["v"], x["do"]
    o, stats = kernels.forward(q, k, v, **flags)
    *_, delta = kernels.backward(q, k, v, o, stats, do, **flags)
    tangents = (x["q_dot"], x["k_dot"], x["v_dot"])
    if workload == "backward_jvp_for":
        o_dot, stats_dot = kernels.forward_jvp(q, k, v, o, stats, *tangents, **flags)
        return lambda: kernels.backward_jvp(q, k, v, do, o, stats, delta, *tangents, x["do_dot"], **flags,
                                            o_dot=o_dot, stats_dot=stats_dot)
    return {
        "forward": lambda: kernels.forward(q, k, v, **flags),
        "backward": lambda: kernels.backward(q, k, v, o, stats, do, **flags),
        "forward_jvp": lambda: kernels.forward_jvp(q, k, v, o, stats, *tangents, **flags)[:1],
        "backward_jvp": lambda: kernels.backward_jvp(q, k, v, do, o, stats, delta, *tangents, x["do_dot"], **flags),
    }[workload]


def eager_workload(workload, x, *, causal, scale):
    """A zero-argument callable running ``workload`` as PyTorch forward mode through naive attention."""
    attention = functools.partial(reference.attention, causal=causal, scale=scale)

    def backward(q, k, v, do):
        return torch.func.vjp(attention, q, k, v)[1](do)

    primals = tuple(x[name] for name in ("q", "k", "v", "do"))
    tangents = tuple(x[name] for name in ("q_dot", "k_dot", "v_dot", "do_dot"))
    if workload == "forward_jvp":
        return lambda: (torch.func.jvp(attention, primals[:3], tangents[:3])[1],)
    return lambda: torch.func.jvp(backward, primals, tangents)[1]  # backward_jvp and backward_jvp_for


def tflops(workload, ms, *, heads, n, head_dim, causal, batch=1, m=None) -> float:
    """TFLOP/s of ``workload`` on ``(batch, heads, n, m, head_dim)`` (the timing rows: batch 1, m = n)."""
    return timing.tflops(FLOPS_PER_NMD[workload], ms, batch=batch, heads=heads, n=n, m=n if m is None else m,
                         head_dim=head_dim, causal=causal)


def free_memory(cuda: bool) -> None:
    if cuda:
        with contextlib.suppress(Exception):  # a broken CUDA context: the next case reports it
            torch.cuda.empty_cache()


def measure(impl, workload, n, heads, causal, args) -> TimeRow:
    """One timing row; out of memory and other failures are recorded in ``status``."""
    dtype = DTYPES[args.timing_dtype]
    row = TimeRow(n, heads, args.head_dim, causal, args.timing_dtype, impl=impl, workload=workload)
    cuda = args.device == "cuda"
    x = fn = None
    try:
        free_memory(cuda)
        x = random_problem(n, heads, args.head_dim, dtype, args.device)
        make = kernel_workload if impl == "kernels" else eager_workload
        fn = make(workload, x, causal=causal, scale=args.head_dim ** -0.5)
        for _ in range(args.warmup):
            fn()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            row.ms = median_ms(fn, args.reps)
            row.peak_gib = torch.cuda.max_memory_allocated() / 2**30
        else:
            row.ms = wall_median_ms(fn, args.reps)
        row.tflops = tflops(workload, row.ms, heads=heads, n=n, head_dim=args.head_dim, causal=causal)
    except torch.cuda.OutOfMemoryError:
        row.status = "oom"
    except Exception as error:  # noqa: BLE001 (one failing case must not end the sweep)
        row.status = f"error:{type(error).__name__}"
        print(f"  {impl} {workload} N={n} causal={causal:d}: {type(error).__name__}: {str(error)[:200]}", flush=True)
    finally:
        x = fn = None
        free_memory(cuda)
    return row


def eager_per_head(workload, x, dtype, *, causal, scale) -> tuple[torch.Tensor, ...]:
    """``workload``'s tangents from eager forward mode in ``dtype``, one head at a time (N x N per head, not
    per batch), returned in float64."""
    outputs = None
    for head in range(x["q"].shape[1]):
        sub = {name: t[:, head:head + 1].to(dtype) for name, t in x.items()}
        values = eager_workload(workload, sub, causal=causal, scale=scale)()
        if outputs is None:
            outputs = tuple(torch.empty(v.shape[0], x["q"].shape[1], *v.shape[2:], dtype=torch.float64,
                                        device=v.device) for v in values)
        for out, value in zip(outputs, values):
            out[:, head:head + 1] = value.double()
        del values
    return outputs


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def accuracy_rows(n, causal, args) -> list[AccuracyRow]:
    """Every tangent's error for the kernels and eager in each of ``args.dtypes``, against float64 eager."""
    cuda = args.device == "cuda"
    scale = args.head_dim ** -0.5
    rows = []
    for dtype_name in args.dtypes:
        x = random_problem(n, args.heads, args.head_dim, DTYPES[dtype_name], args.device)
        for workload, names in OUTPUTS.items():
            base = {"n": n, "heads": args.heads, "head_dim": args.head_dim, "causal": causal, "dtype": dtype_name}
            try:
                exact = eager_per_head(workload, x, torch.float64, causal=causal, scale=scale)
                ours = kernel_workload(workload, x, causal=causal, scale=scale)()
                errors = [relative_error(a, r) for a, r in zip(ours, exact)]
                del ours
                eager = eager_per_head(workload, x, DTYPES[dtype_name], causal=causal, scale=scale)
                eager_errors = [relative_error(a, r) for a, r in zip(eager, exact)]
                del eager, exact
            except torch.cuda.OutOfMemoryError:
                rows += [AccuracyRow(**base, output=name, verdict="oom") for name in names]
                continue
            finally:
                free_memory(cuda)
            for name, err, eager_err in zip(names, errors, eager_errors):
                passed = err < FP32_BAR if dtype_name == "fp32" else err <= HALF_BAR * eager_err
                rows.append(AccuracyRow(**base, output=name, err_kernels=err, err_eager=eager_err,
                                        verdict="PASS" if passed else "FAIL"))
        del x
    return rows


def timing_cases(args):
    """(impl, workload, n, heads, causal, long) in sweep order; --long adds the kernels at long N last."""
    for causal in map(bool, args.causal):
        for n in args.lengths:
            for impl in args.impls:
                for workload in WORKLOADS[impl]:
                    yield impl, workload, n, args.heads, causal, False
    for causal in map(bool, args.causal) if args.long else ():
        for n in LONG_LENGTHS:
            for workload in ("forward_jvp", "backward_jvp", "backward_jvp_for"):
                yield "kernels", workload, n, max(1, LONG_TOKENS // n), causal, True


def timing_table(rows: list[TimeRow]) -> str:
    by_key = {(r.impl, r.workload, r.n, r.heads, r.causal): r for r in rows}
    lines = ["| workload | N | H | causal | kernels ms | TFLOP/s | peak GiB | eager ms | eager peak GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.impl != "kernels":
            continue
        eager = by_key.get(("eager", r.workload, r.n, r.heads, r.causal))

        def cell(row, field, fmt):
            if row is None:
                return ""
            value = getattr(row, field)
            return format(value, fmt) if value is not None else "" if row.status == "ok" else row.status

        lines.append(f"| {r.workload} | {r.n} | {r.heads} | {'yes' if r.causal else 'no'} | {cell(r, 'ms', '.2f')} | "
                     f"{cell(r, 'tflops', '.0f')} | {cell(r, 'peak_gib', '.2f')} | {cell(eager, 'ms', '.2f')} | "
                     f"{cell(eager, 'peak_gib', '.2f')} |")
    return "\n".join(lines)


def accuracy_table(rows: list[AccuracyRow]) -> str:
    """One line per (dtype, N, causal): each tangent's error, kernels (eager), and the verdicts."""
    names = [name for names in OUTPUTS.values() for name in names]
    cases = {}
    for r in rows:
        cases.setdefault((r.dtype, r.n, r.causal), {})[r.output] = r
    lines = ["| dtype | N | causal | " + " | ".join(f"{name} kernels (eager)" for name in names) + " | verdicts |",
             "|---|---|---|" + "---|" * (len(names) + 1)]
    for (dtype, n, causal), by_name in cases.items():
        cells = [f"{r.err_kernels:.1e} ({r.err_eager:.1e})" if r.err_kernels is not None else r.verdict
                 for r in (by_name[name] for name in names)]
        verdicts = "/".join(sorted({r.verdict for r in by_name.values()}))
        lines.append(f"| {dtype} | {n} | {'yes' if causal else 'no'} | " + " | ".join(cells) + f" | {verdicts} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--accuracy-lengths", nargs="+", type=int, default=None, help="default: --lengths")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", nargs="+", type=int, default=[0, 1], help="1 causal, 0 not")
    parser.add_argument("--impls", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--timing-dtype", choices=list(DTYPES), default=None, help="default bf16 (cpu: fp32)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES), help="of the accuracy")
    parser.add_argument("--long", action="store_true", help="also time the kernels at N = 64K, 128K, 256K")
    parser.add_argument("--no-accuracy", action="store_true")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cpu: smoke test in Triton's interpreter")
    parser.add_argument("--out", default="docs/results/forward_mode_kernels.csv")
    parser.add_argument("--accuracy-out", default="docs/results/forward_mode_accuracy.csv")
    args = parser.parse_args()
    args.timing_dtype = args.timing_dtype or ("bf16" if args.device == "cuda" else "fp32")  # bf16 tl.dot is wrong
    accuracy_lengths = args.accuracy_lengths or args.lengths                               # in the interpreter

    times = []
    for impl, workload, n, heads, causal, long in timing_cases(args):
        if any(r.status == "oom" and (r.impl, r.workload, r.causal) == (impl, workload, causal) for r in times):
            continue
        if long:  # the long cases come last: the default configs from here on
            os.environ["FLASHBOB_AUTOTUNE"] = "0"
        row = measure(impl, workload, n, heads, causal, args)
        times.append(row)
        write_rows(args.out, [asdict(r) for r in times])
        print(f"{impl:7s} {workload:12s} N={n:6d} H={heads:2d} causal={causal:d} {row.status:3s} ms={row.ms or 0:9.2f} "
              f"TFLOP/s={row.tflops or 0:6.1f} peak={row.peak_gib or 0:6.2f} GiB", flush=True)

    accuracy = []
    if not args.no_accuracy:
        for n in accuracy_lengths:
            for causal in map(bool, args.causal):
                case = accuracy_rows(n, causal, args)
                accuracy += case
                write_rows(args.accuracy_out, [asdict(r) for r in accuracy])
                print(f"accuracy N={n} causal={causal:d}: " + " ".join(f"{r.dtype}/{r.output} {r.verdict}" for r in case),
                      flush=True)

    print(f"\nwrote {args.out}" + ("" if args.no_accuracy else f" and {args.accuracy_out}"))
    if accuracy:
        print("\n" + accuracy_table(accuracy))
    print("\n" + timing_table(times))


if __name__ == "__main__":
    main()
