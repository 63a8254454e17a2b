"""CUDA-event timing shared by the GPU benchmarks."""

from __future__ import annotations

import statistics

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
