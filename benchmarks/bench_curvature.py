"""Time and peak memory of one HVP and one GGN product vs one gradient, GPT-style model (GPU).

    PYTHONPATH=. python benchmarks/bench_curvature.py --out docs/results/bench_curvature.csv

Model: ``recipes.lm.model.GPT`` with 4 layers, d_model 512, 8 heads (head_dim 64), batch 1,
bf16 autocast, random byte tokens. Attention through flashbob (Triton kernels), or through eager
naive attention (``flashbob.reference.attention``) where it fits. Workloads, each from scratch
(forward included): ``grad`` (one gradient), ``hvp`` (``optim.hvp``, reverse-over-reverse),
``ggn`` (``optim.ggnvp`` with the cross-entropy loss Hessian). Median of CUDA-event timings
after warm-up; peak ``torch.cuda.max_memory_allocated`` over the timed runs.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from unittest import mock

import torch

import flashbob
import optim
from benchmarks.results import write_rows
from benchmarks.timing import median_ms
from flashbob import reference
from recipes.lm import model as lm_model


def eager_attention(q, k, v, *, causal=False, scale=None, backend="auto"):
    """Naive materialised attention with flashbob.attention's signature (``backend`` ignored)."""
    return reference.attention(q, k, v, causal=causal, scale=scale)


def workload(name, model, tokens, targets):
    params = [p for p in model.parameters() if p.requires_grad]
    vec = [torch.randn_like(p) for p in params]

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens)
        return logits, lm_model.cross_entropy(logits, targets)

    def grad():
        return torch.autograd.grad(forward()[1], params)

    def hvp():
        return optim.hvp(forward()[1], params, vec)

    def ggn():
        logits, _ = forward()
        loss_hessian = optim.CrossEntropyHessian(targets.reshape(logits.shape[:-1]))
        return optim.ggnvp(None, logits, params, vec, loss_hessian)

    return {"grad": grad, "hvp": hvp, "ggn": ggn}[name]


def measure(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return median_ms(fn, reps), torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results/bench_curvature.csv")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--impls", nargs="+", default=["flashbob", "eager"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = lm_model.GPT(vocab_size=256, d_model=512, n_layers=4, n_heads=8).cuda()
    rows, failed = [], set()
    for context in args.contexts:
        tokens = torch.randint(0, 256, (1, context + 1), device="cuda")
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        for impl in args.impls:
            for name in ("grad", "hvp", "ggn"):
                patch = mock.patch.object(flashbob, "attention", eager_attention) if impl == "eager" else nullcontext()
                row = {"impl": impl, "workload": name, "context": context, "ms": None, "peak_gib": None, "status": "ok"}
                if (impl, name) in failed:
                    continue
                try:
                    with patch:
                        row["ms"], row["peak_gib"] = measure(workload(name, model, inputs, targets), args.warmup, args.reps)
                except torch.cuda.OutOfMemoryError:
                    row["status"] = "oom"
                    failed.add((impl, name))
                torch.cuda.empty_cache()
                rows.append(row)
                print(f"{impl:8s} {name:4s} context={context:6d} {row['status']:3s} "
                      f"ms={row['ms'] or 0:9.2f} peak={row['peak_gib'] or 0:6.2f} GiB", flush=True)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
