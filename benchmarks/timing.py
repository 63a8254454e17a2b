"""CUDA-event timing shared by the GPU benchmarks, and the FLOP counts that turn times into TFLOP/s."""

from __future__ import annotations

import statistics
import time

import torch


def median_ms(fn, reps: int) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn()``, in milliseconds (each run synchronised)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_median_ms(fn, reps: int) -> float:
    """Median wall-clock time of ``fn()`` in milliseconds (the benchmarks' CPU smoke tests)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def timed_with_peak(fn, warmup: int, reps: int, device: str) -> tuple[float, float | None]:
    """Median time (ms) of ``fn()`` after ``warmup`` untimed calls, and its peak memory (GiB): CUDA events and
    ``torch.cuda.max_memory_allocated`` on a GPU; wall-clock time and no memory figure (None) elsewhere."""
    for _ in range(warmup):
        fn()
    if device != "cuda":
        return wall_median_ms(fn, reps), None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return median_ms(fn, reps), torch.cuda.max_memory_allocated() / 2**30


# Matrix-product FLOPs per (batch, head) in units of N*M*d, the fixed conventions of docs/algorithm.md
# (forward 4, backward 10, BoB 38), whatever the implementation does; halved for causal masks.
FLOPS_PER_NMD = {"fwd": 4, "fwd_bwd": 14, "fwd_bwd_bob": 52, "bob": 38}


def causal_fraction(n: int, m: int) -> float:
    """The share of the ``n x m`` score matrix a top-left aligned causal mask keeps (key ``j`` visible to
    query ``i`` iff ``j <= i``), as an area: exactly 1/2 for ``n == m`` (the conventions' "halved for
    causal"), ``n / (2 m)`` for ``n <= m`` and ``1 - m / (2 n)`` for ``n > m``."""
    return n / (2 * m) if n <= m else 1 - m / (2 * n)


def tflops(flops_per_nmd: float, ms: float, *, batch: int, heads: int, n: int, m: int, head_dim: int,
           causal: bool) -> float:
    """TFLOP/s of ``flops_per_nmd * N * M * d`` per (batch, query head), causal-masked as
    :func:`causal_fraction`, done in ``ms`` milliseconds. ``heads`` are the query heads (with GQA too)."""
    flops = flops_per_nmd * n * m * head_dim * batch * heads * (causal_fraction(n, m) if causal else 1.0)
    return flops / (ms * 1e-3) / 1e12


def attention_tflops(workload: str, ms: float, *, batch: int, heads: int, n: int, m: int, head_dim: int,
                     causal: bool) -> float:
    """TFLOP/s of ``workload`` on ``(batch, heads, n, m, head_dim)`` that took ``ms`` milliseconds."""
    return tflops(FLOPS_PER_NMD[workload], ms, batch=batch, heads=heads, n=n, m=m, head_dim=head_dim, causal=causal)
