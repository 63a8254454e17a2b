"""Time and memory of attention passes: flashbob vs eager autograd vs SDPA's math backend (GPU).

Run on a CUDA machine from the checkout::

    PYTHONPATH=. python benchmarks/bench_attention.py --out docs/bench_attention.csv

Each case runs one of four workloads on ``(batch, heads, N, d)`` bf16 inputs (N = M):

* ``fwd``          ``O = attention(Q, K, V)``
* ``fwd_bwd``      forward, then ``(dQ, dK, dV)`` for a random ``dO``
* ``fwd_bwd_bob``  forward, backward with ``create_graph=True``, then the second backward
  (backward-over-backward) for random cotangents of ``(dQ, dK, dV)``: one Hessian-vector
  product's worth of attention work
* ``bob``          the second backward alone, on a retained first-backward graph

Times are medians of CUDA-event timings after warm-up. TFLOP/s use the fixed conventions of
``bob-math.md``: per (batch, head) forward ``4NMd``, backward ``10NMd``, BoB ``38NMd``, halved
for causal. Peak memory is ``torch.cuda.max_memory_allocated`` over the timed runs.
An implementation that runs out of memory is recorded as ``oom`` and not tried at larger N.
"""

from __future__ import annotations

import argparse
import csv
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashbob
from benchmarks.timing import median_ms
from flashbob import reference

FLOPS_PER_NMD = {"fwd": 4, "fwd_bwd": 14, "fwd_bwd_bob": 52, "bob": 38}


def sdpa_math(q, k, v, causal=False):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


IMPLEMENTATIONS = {
    "flashbob": lambda q, k, v, causal: flashbob.attention(q, k, v, causal=causal),
    "eager": lambda q, k, v, causal: reference.attention(q, k, v, causal=causal),
    "sdpa_math": sdpa_math,
}


@dataclass
class Row:
    impl: str
    workload: str
    n: int
    batch: int
    heads: int
    head_dim: int
    causal: bool
    dtype: str
    ms: float | None
    tflops: float | None
    peak_gib: float | None
    status: str


def make_workload(impl, workload, q, k, v, causal):
    """A zero-argument callable running ``workload`` (the first-backward graph is built once for ``bob``)."""
    attn = IMPLEMENTATIONS[impl]
    do = torch.randn_like(q)
    bars = [torch.randn_like(t) for t in (q, k, v)]
    inputs = (q, k, v)
    if workload == "fwd":
        return lambda: attn(q, k, v, causal)
    if workload == "fwd_bwd":
        return lambda: torch.autograd.grad(attn(q, k, v, causal), inputs, do)
    if workload == "fwd_bwd_bob":
        def run():
            grads = torch.autograd.grad(attn(q, k, v, causal), inputs, do, create_graph=True)
            return torch.autograd.grad(grads, inputs, bars)
        return run
    grads = torch.autograd.grad(attn(q, k, v, causal), inputs, do, create_graph=True)
    return lambda: torch.autograd.grad(grads, inputs, bars, retain_graph=True)


def measure(impl, workload, n, batch, heads, head_dim, causal, dtype, warmup, reps) -> Row:
    row = Row(impl, workload, n, batch, heads, head_dim, causal, str(dtype).removeprefix("torch."), None, None, None, "ok")
    try:
        torch.cuda.empty_cache()
        q, k, v = (torch.randn(batch, heads, n, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        fn = make_workload(impl, workload, q, k, v, causal)
        for _ in range(warmup):  # compiles and autotunes outside the measurement
            fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        row.ms = median_ms(fn, reps)
        row.peak_gib = torch.cuda.max_memory_allocated() / 2**30
        flops = FLOPS_PER_NMD[workload] * n * n * head_dim * batch * heads * (0.5 if causal else 1.0)
        row.tflops = flops / (row.ms * 1e-3) / 1e12
    except torch.cuda.OutOfMemoryError:
        row.status = "oom"
    finally:
        q = k = v = fn = None
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/bench_attention.csv")
    parser.add_argument("--impls", nargs="+", default=list(IMPLEMENTATIONS))
    parser.add_argument("--workloads", nargs="+", default=list(FLOPS_PER_NMD))
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--causal", nargs="+", type=int, default=[0, 1], help="1 causal, 0 not")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=0,
                        help="if set, heads = max(1, heads * tokens // N) to bound the work at long N")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (0: compile time is timed)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tuned-configs", default="", help="write the configs autotuning picked (JSON) here")
    args = parser.parse_args()

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    out = open(args.out, "w", newline="")
    writer = csv.DictWriter(out, fieldnames=[f.name for f in fields(Row)])
    writer.writeheader()
    rows, out_of_memory = [], set()
    for head_dim in args.head_dims:
        for causal in map(bool, args.causal):
            for n in args.lengths:
                heads = max(1, args.heads * args.tokens // n) if args.tokens and n > args.tokens else args.heads
                for workload in args.workloads:
                    for impl in args.impls:
                        key = (impl, workload, head_dim, causal)
                        if key in out_of_memory:
                            continue
                        row = measure(impl, workload, n, args.batch, heads, head_dim, causal,
                                      torch.bfloat16, args.warmup, args.reps)
                        if row.status == "oom":
                            out_of_memory.add(key)
                        rows.append(row)
                        writer.writerow(asdict(row))
                        out.flush()
                        print(f"{impl:9s} {workload:11s} N={n:7d} H={heads:2d} d={head_dim:3d} causal={causal:d} "
                              f"{row.status:3s} ms={row.ms or 0:9.2f} TFLOP/s={row.tflops or 0:6.1f} "
                              f"peak={row.peak_gib or 0:6.2f} GiB", flush=True)
    out.close()
    print(f"wrote {len(rows)} rows to {args.out}")
    if args.tuned_configs:
        from flashbob.kernels import configs

        Path(args.tuned_configs).write_text(json.dumps(configs.tuned_configs(), indent=1))
        print(f"wrote the autotuned configs to {args.tuned_configs}")


if __name__ == "__main__":
    main()
