"""Time and memory of attention passes: flashbob vs eager autograd vs SDPA's backends (GPU).

Run on a CUDA machine from the checkout::

    PYTHONPATH=. python benchmarks/bench_attention.py --out docs/results/bench_attention.csv

One slice, e.g. flashbob vs SDPA's FlashAttention-2 kernels, forward and forward + backward at
N = 16K, d = 128, causal and not (about 30 s with autotuning, a few seconds with ``FLASHBOB_AUTOTUNE=0``)::

    PYTHONPATH=. python benchmarks/bench_attention.py --impls flashbob sdpa_flash sdpa_cudnn \
        --workloads fwd fwd_bwd --lengths 16384 --head-dims 128 --causal 0 1 --out docs/results/bench_sdpa_flash.csv

CPU smoke test of the script itself (flashbob takes its blocked PyTorch backend there; times are
wall-clock, memory is not measured)::

    PYTHONPATH=. python benchmarks/bench_attention.py --device cpu --lengths 64 --head-dims 16 --heads 2 \
        --reps 1 --warmup 1 --out /tmp/bench.csv

Each case runs one of four workloads on ``(batch, heads, N, d)`` bf16 inputs (N = M):

* ``fwd``          ``O = attention(Q, K, V)``
* ``fwd_bwd``      forward, then ``(dQ, dK, dV)`` for a random ``dO``
* ``fwd_bwd_bob``  forward, backward with ``create_graph=True``, then the second backward
  (backward-over-backward) for random cotangents of ``(dQ, dK, dV)``: one Hessian-vector
  product's worth of attention work
* ``bob``          the second backward alone, on a retained first-backward graph

Times are medians of CUDA-event timings after warm-up. TFLOP/s use the fixed conventions of
docs/algorithm.md: per (batch, head) forward ``4NMd``, backward ``10NMd``, BoB ``38NMd``, halved
for causal. Peak memory is ``torch.cuda.max_memory_allocated`` over the timed runs.

Implementations: ``flashbob``; ``eager`` (autograd through naive materialised attention,
``flashbob.reference``); ``sdpa_math``, ``sdpa_flash`` and ``sdpa_cudnn`` (``F.scaled_dot_product_attention``
restricted to one ``SDPBackend``: MATH, FLASH_ATTENTION, CUDNN_ATTENTION). The flash and cuDNN
backends have no double backward: their ``bob`` and ``fwd_bwd_bob`` rows are recorded as
``unsupported`` without running (``--try-unsupported`` runs them anyway and records the error).
Status per row: ``ok``; ``oom`` (out of memory; that implementation and workload is not tried at
larger N); ``unsupported``; ``error:<ExceptionClass>`` (any other failure, e.g. a backend that
refuses the inputs; the sweep goes on). Only ``ok`` rows have times.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashbob
from benchmarks.timing import FLOPS_PER_NMD, attention_tflops, median_ms, wall_median_ms
from flashbob import reference


def sdpa_math(q, k, v, causal=False):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def sdpa_on(backend_name: str):
    """SDPA restricted to ``SDPBackend.<backend_name>`` (the backward dispatches to the same
    backend's backward kernel; SDPA raises if that backend refuses the inputs)."""

    def attn(q, k, v, causal=False):
        backend = getattr(SDPBackend, backend_name, None)
        if backend is None:
            raise NotImplementedError(f"this torch has no SDPBackend.{backend_name}")
        gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)

    return attn


IMPLEMENTATIONS = {
    "flashbob": lambda q, k, v, causal: flashbob.attention(q, k, v, causal=causal),
    "eager": lambda q, k, v, causal: reference.attention(q, k, v, causal=causal),
    "sdpa_math": sdpa_math,
    "sdpa_flash": sdpa_on("FLASH_ATTENTION"),
    "sdpa_cudnn": sdpa_on("CUDNN_ATTENTION"),
}
#: Implementations without a double backward: their ``bob`` and ``fwd_bwd_bob`` rows are not run.
NO_DOUBLE_BACKWARD = {"sdpa_flash", "sdpa_cudnn"}


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


def measure(impl, workload, n, batch, heads, head_dim, causal, dtype, warmup, reps, device="cuda",
            try_unsupported=False) -> Row:
    row = Row(impl, workload, n, batch, heads, head_dim, causal, str(dtype).removeprefix("torch."), None, None, None, "ok")
    if impl in NO_DOUBLE_BACKWARD and workload in ("bob", "fwd_bwd_bob") and not try_unsupported:
        row.status = "unsupported"
        return row
    cuda = torch.device(device).type == "cuda"
    q = k = v = fn = None
    try:
        if cuda:
            torch.cuda.empty_cache()
        q, k, v = (torch.randn(batch, heads, n, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        fn = make_workload(impl, workload, q, k, v, causal)
        for _ in range(warmup):  # compiles and autotunes outside the measurement
            fn()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            row.ms = median_ms(fn, reps)
            row.peak_gib = torch.cuda.max_memory_allocated() / 2**30
        else:
            row.ms = wall_median_ms(fn, reps)
        row.tflops = attention_tflops(workload, row.ms, batch=batch, heads=heads, n=n, m=n, head_dim=head_dim,
                                      causal=causal)
    except torch.cuda.OutOfMemoryError:
        row.ms = row.tflops = row.peak_gib = None
        row.status = "oom"
    except Exception as error:  # noqa: BLE001 (one failing case must not end the sweep)
        row.ms = row.tflops = row.peak_gib = None
        row.status = f"error:{type(error).__name__}"
        print(f"  {impl} {workload} N={n} d={head_dim} causal={causal:d}: {type(error).__name__}: "
              f"{str(error).strip().splitlines()[0][:200] if str(error).strip() else ''}", flush=True)
    finally:
        q = k = v = fn = None
        if cuda:
            with contextlib.suppress(Exception):  # a broken CUDA context: the next case reports it
                torch.cuda.empty_cache()
    return row


def summary(rows: list[Row], baseline: str = "flashbob") -> str:
    """Markdown table: ms per implementation for every case, and each one's time over ``baseline``'s."""
    impls = list(dict.fromkeys(r.impl for r in rows))
    cases = list(dict.fromkeys((r.workload, r.n, r.heads, r.head_dim, r.causal) for r in rows))
    by_key = {(r.impl, r.workload, r.n, r.heads, r.head_dim, r.causal): r for r in rows}
    ratio = baseline in impls and len(impls) > 1
    head = ["workload", "N", "H", "d", "causal", *(f"{i} ms" for i in impls)]
    head += [f"{i} / {baseline} (time)" for i in impls if i != baseline] if ratio else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in cases:
        cells = [case[0], str(case[1]), str(case[2]), str(case[3]), "yes" if case[4] else "no"]
        found = [by_key.get((i, *case)) for i in impls]
        cells += [f"{r.ms:.3f}" if r is not None and r.ms is not None else (r.status if r is not None else "")
                  for r in found]
        if ratio:
            base = by_key.get((baseline, *case))
            for impl, r in zip(impls, found):
                if impl == baseline:
                    continue
                ok = r is not None and r.ms is not None and base is not None and base.ms
                cells.append(f"{r.ms / base.ms:.2f}x" if ok else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cases(args):
    """(head_dim, causal, n, heads, workload, impl) in sweep order."""
    for head_dim in args.head_dims:
        for causal in map(bool, args.causal):
            for n in args.lengths:
                heads = max(1, args.heads * args.tokens // n) if args.tokens and n > args.tokens else args.heads
                for workload in args.workloads:
                    for impl in args.impls:
                        yield head_dim, causal, n, heads, workload, impl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results/bench_attention.csv")
    parser.add_argument("--impls", nargs="+", choices=list(IMPLEMENTATIONS), default=list(IMPLEMENTATIONS))
    parser.add_argument("--workloads", nargs="+", choices=list(FLOPS_PER_NMD), default=list(FLOPS_PER_NMD))
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--causal", nargs="+", type=int, default=[0, 1], help="1 causal, 0 not")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=0,
                        help="if set, heads = max(1, heads * tokens // N) to bound the work at long N")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (0: compile time is timed)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--device", default="cuda", help="cpu: smoke test of the script (wall-clock times, no memory)")
    parser.add_argument("--try-unsupported", action="store_true",
                        help="run sdpa_flash/sdpa_cudnn on bob workloads too (records the error they raise)")
    parser.add_argument("--tuned-configs", default="", help="write the configs autotuning picked (JSON) here")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rows, out_of_memory = [], set()
    with open(args.out, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=[f.name for f in fields(Row)])
        writer.writeheader()
        for head_dim, causal, n, heads, workload, impl in cases(args):
            key = (impl, workload, head_dim, causal)
            if key in out_of_memory:
                continue
            row = measure(impl, workload, n, args.batch, heads, head_dim, causal,
                          dtype, args.warmup, args.reps, args.device, args.try_unsupported)
            if row.status == "oom":
                out_of_memory.add(key)
            rows.append(row)
            writer.writerow(asdict(row))
            out.flush()
            print(f"{impl:10s} {workload:11s} N={n:7d} H={heads:2d} d={head_dim:3d} causal={causal:d} "
                  f"{row.status:3s} ms={row.ms or 0:9.2f} TFLOP/s={row.tflops or 0:6.1f} "
                  f"peak={row.peak_gib or 0:6.2f} GiB", flush=True)
    print(f"wrote {len(rows)} rows to {args.out}")
    print()
    print(summary(rows))
    if args.tuned_configs:
        from flashbob.kernels import configs

        Path(args.tuned_configs).write_text(json.dumps(configs.tuned_configs(), indent=1))
        print(f"wrote the autotuned configs to {args.tuned_configs}")


if __name__ == "__main__":
    main()
