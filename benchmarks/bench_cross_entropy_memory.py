"""Extra memory and time of the cross-entropy's curvature at a real vocabulary: ``H_L u``, one GGN product
(reverse and forward mode) and one SophiaG refresh (GPU).

    PYTHONPATH=. python benchmarks/bench_cross_entropy_memory.py --out docs/results/cross_entropy_curvature_memory.csv

The model is the LM head alone, as in the recipe: a float32 ``nn.Linear(d, V)`` under bf16 autocast on fixed
hidden states ``(1, T, d)``, so the logits are bf16 (T = V = 32,768: 2 GiB). ``extra`` is
``max_memory_allocated`` during one call minus ``memory_allocated`` before it (logits, graph and operator
already held), reported as a multiple of the bf16 logits; ``ms`` is the mean of ``--reps`` further calls. Each
product runs with the default chunk (``optim.loss_hessians.DEFAULT_CHUNK_ELEMENTS`` logits) and with
``--small-chunk`` logits; forward mode with PyTorch's tangent rules and with ``lean_tangents=True``. The
target (docs/curvature.md): one GGN product within 2x the bf16 logits.

CPU smoke test (times only, no memory figures)::

    PYTHONPATH=. python benchmarks/bench_cross_entropy_memory.py --device cpu --tokens 64 --vocab 300 --width 16 \\
        --out /tmp/ce.csv
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.results import write_rows
from optim import CrossEntropyHessian, GGNOperator, SophiaG
from optim.loss_hessians import DEFAULT_CHUNK_ELEMENTS


def measure(fn, device: torch.device, reps: int) -> tuple[float, float]:
    """(peak extra bytes of one call, NaN off CUDA; mean ms of ``reps`` calls after it)."""
    cuda = device.type == "cuda"
    before = 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    fn()
    if cuda:
        torch.cuda.synchronize()  # else the first call's queued work would fall in the timed window
    extra = torch.cuda.max_memory_allocated() - before if cuda else float("nan")
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return extra, (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--small-chunk", type=int, default=2**22, help="a second, smaller chunk size (logits)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (no memory figures)")
    parser.add_argument("--out", default="docs/results/cross_entropy_curvature_memory.csv")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    head = nn.Linear(args.width, args.vocab, bias=False, device=device)
    hidden = torch.randn(1, args.tokens, args.width, device=device)
    targets = torch.randint(0, args.vocab, (1, args.tokens), device=device)
    targets[0, :7] = -100  # a few ignored rows, as padding gives
    params, vec = [head.weight], [torch.randn_like(head.weight)]

    def outputs(values):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return F.linear(hidden, values[0])

    logits = outputs(params)
    logits_bytes = logits.numel() * logits.element_size()
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    rows = []

    def row(call: str, chunk: int, fn) -> None:
        try:
            extra, ms = measure(fn, device, args.reps)
        except torch.OutOfMemoryError:
            extra, ms = float("inf"), float("nan")
        rows.append({"gpu": gpu, "tokens": args.tokens, "vocab": args.vocab, "call": call, "chunk_elements": chunk,
                     "extra_gib": round(extra / 2**30, 3), "x_bf16_logits": round(extra / logits_bytes, 3),
                     "ms": round(ms, 2)})
        print(f"{call:<28} chunk {chunk:>9} extra {extra / 2**30:7.2f} GiB = {extra / logits_bytes:5.2f}x logits "
              f"{ms:8.1f} ms", flush=True)

    for chunk in (DEFAULT_CHUNK_ELEMENTS, args.small_chunk):
        loss_hessian = CrossEntropyHessian(targets, chunk_elements=chunk)
        u = torch.randn_like(logits)
        row("H_L u", chunk, lambda lh=loss_hessian, u=u: lh(logits.detach(), u))
        del u
        for mode, lean in (("reverse", False), ("forward", False), ("forward", True)):
            op = GGNOperator(outputs if mode == "forward" else logits, params, loss_hessian, mode=mode,
                             lean_tangents=lean)  # fmt: skip
            row(f"GGN product ({mode}{', lean' if lean else ''})", chunk, lambda op=op: op.matvec(vec))
            del op
        opt = SophiaG(params, generator=torch.Generator(device).manual_seed(0), chunk_elements=chunk)
        row("SophiaG refresh", chunk, lambda opt=opt: opt.update_hessian(logits, targets))
    write_rows(args.out, rows)
    print(f"{gpu}: T = {args.tokens}, V = {args.vocab}, bf16 logits {logits_bytes / 2**30:.2f} GiB; wrote {args.out}")


if __name__ == "__main__":
    main()
