"""Host (Python) time per attention call, and the 4-layer GPT's gradient through flashbob vs torch SDPA (GPU).

    PYTHONPATH=. python benchmarks/bench_overhead.py --out docs/results/overhead.csv

Three parts:

1. ``call``: at a tiny shape (B=1, H=8, N=128, d=64, bf16), where the GPU work takes a few
   microseconds, the median wall time of one forward and of one forward + backward, synchronised:
   flashbob.attention against torch's ``scaled_dot_product_attention``. The difference is what the
   library adds on the host per call (checks, backend and config choice, autograd Functions,
   launches).
2. ``profile``: cProfile of ``--profile-calls`` flashbob forward + backward calls at that shape;
   the functions with the largest own time are printed (not written to the CSV).
3. ``gpt``: one gradient of the 4-layer GPT (d_model 512, 8 heads of 64, byte vocabulary, bf16
   autocast, batch 1) at each ``--contexts`` length, attention through flashbob or through SDPA
   (cuDNN / flash, as torch picks), CUDA-event median; ``ratio`` = flashbob / SDPA; and a Hessian-vector product
   through flashbob (``hvp_reverse``, ``hvp_forward``: :mod:`benchmarks.bench_forward_hvp`'s, from scratch), whose
   ``ratio`` is to the SDPA gradient (the HVP target of docs/performance.md).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import flashbob
from benchmarks.bench_forward_hvp import hvp_workloads
from benchmarks.results import write_rows
from benchmarks.timing import median_ms
from recipes.common.transformer import attention_function
from recipes.lm import model as lm_model

#: Implementation name: the recipes' ``model.attention`` setting that runs it.
IMPLS = {"flashbob": "auto", "sdpa": "sdpa"}


def wall_us(fn, reps: int) -> float:
    """Median synchronised wall time of ``fn()`` in microseconds."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def call_rows(reps: int) -> list[dict]:
    q, k, v = (torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    rows = []
    for impl, setting in IMPLS.items():
        attend = attention_function(setting)
        work = {"fwd": lambda attend=attend: attend(q, k, v, causal=True),
                "fwd_bwd": lambda attend=attend: torch.autograd.grad(attend(q, k, v, causal=True), (q, k, v), do)}
        for name, fn in work.items():
            for _ in range(20):
                fn()
            rows.append({"part": "call", "impl": impl, "workload": name, "context": 128, "us": round(wall_us(fn, reps), 1)})
    return rows


def print_profile(calls: int) -> None:
    q, k, v = (torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)

    def run():
        for _ in range(calls):
            torch.autograd.grad(flashbob.attention(q, k, v, causal=True), (q, k, v), do)
        torch.cuda.synchronize()

    run()
    profiler = cProfile.Profile()
    profiler.runcall(run)
    print(f"cProfile of {calls} flashbob forward + backward calls (B=1, H=8, N=128, d=64, bf16), by own time:")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def gpt_rows(contexts, warmup: int, reps: int) -> list[dict]:
    models = {}
    for impl, setting in IMPLS.items():  # the same weights: the same seed before each
        torch.manual_seed(0)
        models[impl] = lm_model.GPT(vocab_size=256, d_model=512, n_layers=4, n_heads=8, attention=setting).cuda()
    rows = []
    for context in contexts:
        tokens = torch.randint(0, 256, (1, context + 1), device="cuda")
        times = {}
        for impl, model in models.items():
            def grad(model=model, tokens=tokens):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(tokens[:, :-1])
                return torch.autograd.grad(lm_model.cross_entropy(logits, tokens[:, 1:]), list(model.parameters()))

            for _ in range(warmup):
                grad()
            times[impl] = median_ms(grad, reps)
        products = hvp_workloads(models["flashbob"], tokens[:, :-1], tokens[:, 1:], "cuda")
        for mode in ("hvp_reverse", "hvp_forward"):  # an HVP against the SDPA gradient
            for _ in range(warmup):
                products[mode]()
            times[mode] = median_ms(products[mode], reps)
        for name, ms in times.items():
            impl, workload = ("flashbob", name) if name.startswith("hvp") else (name, "grad")
            rows.append({"part": "gpt", "impl": impl, "workload": workload, "context": context, "ms": round(ms, 3),
                         "ratio": round(ms / times["sdpa"], 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results/overhead.csv")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--reps", type=int, default=200, help="repetitions of the per-call timings")
    parser.add_argument("--gpt-reps", type=int, default=10)
    parser.add_argument("--profile-calls", type=int, default=500)
    args = parser.parse_args()
    rows = call_rows(args.reps)
    print_profile(args.profile_calls)
    rows += gpt_rows(args.contexts, warmup=3, reps=args.gpt_reps)
    write_rows(args.out, rows, ("part", "impl", "workload", "context", "us", "ms", "ratio"))
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
