"""Longest context at which one second-order MAML step runs, through flashbob vs eager attention.

One MAML step on a causal byte-level transformer (:class:`recipes.common.transformer.Transformer`):
``--inner-steps`` differentiable SGD steps (torchopt ``MetaSGD``) on a support sequence's
next-token loss, then the gradient of a query sequence's loss under the adapted weights with
respect to the initial weights; second order by default (the Hessian factors pass through the
attention's backward: flashbob's closed-form backward-over-backward, or PyTorch autograd through the
materialised scores for ``eager`` = :func:`flashbob.reference.attention`). The context doubles from
``--min-context`` until a step runs out of memory or ``--max-context`` is passed; each
implementation stops at its first failure. Per context: the median (and min) time of
``--repeats`` timed steps after ``--warmup`` untimed ones (CUDA events on GPU), and
``torch.cuda.max_memory_allocated`` over them. Rows are appended to the CSV ``--out`` as they are
measured, so a crash loses nothing already measured; a table is printed at the end.

    python benchmarks/bench_maml.py --out docs/results/maml_scale.csv                   # a GPU, from 1K up
    python benchmarks/bench_maml.py --device cpu --max-context 256 --out /tmp/maml.csv  # smoke test
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
import torchopt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from recipes.common.transformer import Transformer  # noqa: E402
from recipes.meta.maml import inner_optimizer  # noqa: E402

FIELDS = ["impl", "context", "status", "ms_median", "ms_min", "peak_mem_gib", "peak_mem_bytes", "query_loss",
          "meta_grad_norm", "batch", "d_model", "n_layers", "n_heads", "inner_steps", "order", "dtype", "device"]


def is_oom(error: BaseException) -> bool:
    """CUDA allocator failures, whatever exception type the failing library wrapped them in."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "alloc_failed" in text)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), tokens[:, 1:].flatten())


def maml_step(model, inner, support, query, inner_steps: int, autocast) -> float:
    """One MAML step: adapt on ``support``, back-propagate ``query``'s loss to the initial weights."""
    net_state = torchopt.extract_state_dict(model, by="reference")
    inner_state = torchopt.extract_state_dict(inner)
    try:
        for _ in range(inner_steps):
            with autocast():
                logits = model(support)
            inner.step(lm_loss(logits, support))
        with autocast():
            logits = model(query)
        loss = lm_loss(logits, query)
        loss.backward()
        return loss.item()
    finally:
        torchopt.recover_state_dict(model, net_state)
        torchopt.recover_state_dict(inner, inner_state)


def measure(impl: str, context: int, args, device: torch.device) -> dict:
    """Build the model and data at ``context`` tokens and time ``args.repeats`` MAML steps."""
    torch.manual_seed(args.seed)
    model = Transformer(vocab_size=256, n_outputs=256, d_model=args.d_model, n_layers=args.n_layers,
                        n_heads=args.n_heads, mlp_ratio=args.mlp_ratio, causal=True, readout="tokens",
                        attention={"flashbob": "auto", "eager": "eager"}[impl]).to(device)
    inner = inner_optimizer(model, "sgd", args.inner_lr, first_order=args.first_order)
    support, query = torch.randint(0, 256, (2, args.batch, context + 1), device=device)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype)

    def autocast():
        return torch.autocast(device.type, dtype=dtype) if dtype else nullcontext()

    cuda = device.type == "cuda"
    times, loss = [], float("nan")
    for i in range(args.warmup + args.repeats):
        if i == args.warmup and cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        model.zero_grad(set_to_none=True)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = maml_step(model, inner, support, query, args.inner_steps, autocast)
            end.record()
            torch.cuda.synchronize(device)
            elapsed = start.elapsed_time(end)
        else:
            begin = time.perf_counter()
            loss = maml_step(model, inner, support, query, args.inner_steps, autocast)
            elapsed = 1e3 * (time.perf_counter() - begin)
        if i >= args.warmup:
            times.append(elapsed)
    grad_norm = math.sqrt(sum(p.grad.float().square().sum().item() for p in model.parameters() if p.grad is not None))
    peak = torch.cuda.max_memory_allocated(device) if cuda else float("nan")
    return {"status": "ok", "ms_median": statistics.median(times), "ms_min": min(times), "peak_mem_bytes": peak,
            "peak_mem_gib": peak / 2**30, "query_loss": loss, "meta_grad_norm": grad_norm}


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--impls", default="flashbob,eager", help="comma-separated: flashbob, eager")
    parser.add_argument("--min-context", type=int, default=1024)
    parser.add_argument("--max-context", type=int, default=131072, help="cap on the doubling context")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--mlp-ratio", type=float, default=4.0)
    parser.add_argument("--inner-steps", type=int, default=1)
    parser.add_argument("--inner-lr", type=float, default=1e-2)
    parser.add_argument("--first-order", action="store_true", help="FOMAML instead of second-order MAML")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                        help="autocast dtype (default: bfloat16 on cuda, float32 elsewhere)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="maml_scale.csv", help="CSV file (appended to, header written if new)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    impls = [name.strip() for name in args.impls.split(",") if name.strip()]
    unknown = set(impls) - {"flashbob", "eager"}
    if unknown:
        parser.error(f"--impls: unknown {', '.join(sorted(unknown))}; choose from flashbob, eager")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    fixed = {"batch": args.batch, "d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads,
             "inner_steps": args.inner_steps, "order": "first" if args.first_order else "second",
             "dtype": args.dtype, "device": device_name}

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = not out.exists() or out.stat().st_size == 0
    rows = []
    with open(out, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, restval="")
        if new:
            writer.writeheader()
        for impl in impls:
            context = args.min_context
            while context <= args.max_context:
                row = {"impl": impl, "context": context, **fixed}
                try:
                    row.update(measure(impl, context, args, device))
                except Exception as error:  # noqa: BLE001 - any failure ends this implementation's sweep
                    row["status"] = "oom" if is_oom(error) else f"error: {type(error).__name__}: {error}"[:300]
                release(device)  # after the except clause: the traceback no longer pins the tensors
                rows.append(row)
                writer.writerow(row)
                f.flush()
                print(f"{impl:>8} {context:>7}: {row['status']}"
                      + (f" {row['ms_median']:.1f} ms, {row['peak_mem_gib']:.2f} GiB" if row["status"] == "ok" else ""),
                      file=sys.stderr, flush=True)
                if row["status"] != "ok":
                    break
                context *= 2

    print(f"\nsecond-order MAML step ({fixed['order']} order, {args.inner_steps} inner step(s), {args.dtype}, "
          f"d_model {args.d_model}, {args.n_layers} layers, {args.n_heads} heads, batch {args.batch}) on {device_name}")
    print(f"{'impl':>8} {'context':>8} {'status':>8} {'ms':>10} {'peak GiB':>9}")
    for row in rows:
        ok = row["status"] == "ok"
        print(f"{row['impl']:>8} {row['context']:>8} {row['status'][:8]:>8} "
              f"{row['ms_median'] if ok else float('nan'):>10.1f} {row['peak_mem_gib'] if ok else float('nan'):>9.2f}")
    for impl in impls:
        done = [row["context"] for row in rows if row["impl"] == impl and row["status"] == "ok"]
        print(f"longest context, {impl}: {max(done) if done else 'none'}")
    return rows


if __name__ == "__main__":
    main()
