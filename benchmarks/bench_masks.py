"""Masks of long-context training on the GPU: sliding windows, packed documents and block masks against causal
attention and against FlexAttention, in one process so that ratios compare.

    PYTHONPATH=. FLASHBOB_AUTOTUNE=0 python benchmarks/bench_masks.py --out docs/results/masks.csv

Parts (bf16, batch 1, 16 heads, head_dim 128 unless said; CUDA-event medians; TFLOP/s under docs/algorithm.md's
conventions, counted on the visible area of the score matrix; peak memory of the call):

* ``window``: fwd+bwd+BoB with a causal sliding window of ``--window`` keys (``window=(W - 1, 0)``) and plain
  causal attention at each ``--lengths``; ``ratio`` = the window's TFLOP/s over causal's at the same N (target
  >= 0.9), time and memory per token (linear in N: flat).
* ``documents``: fwd+bwd+BoB over ``--documents`` documents of ``--document-length`` tokens packed into one
  sequence (``document_ids``, causal), against that many separate causal calls of one document (target <= 1.15).
* ``block_mask``: the sliding window given as a FlexAttention ``BlockMask`` against ``window=`` (target <= 1.3)
  at ``--block-mask-lengths``.
* ``flex``: forward + backward of the window and of the documents, flashbob against compiled ``flex_attention``
  with the same BlockMask, at ``--flex-lengths`` (target <= 1.2).
* ``accuracy``: each output (O, dQ, dK, dV, the four BoB outputs, the forward's tangent) in bf16 and fp16 against a
  float64 dense-mask oracle, as a multiple of eager PyTorch's error in the same dtype with the same dense mask
  (target <= 1), at ``--accuracy-lengths`` (4 heads).

Writes a CSV and prints a table last. CPU smoke test of the script (tiny sizes, blocked backend, wall-clock)::

    PYTHONPATH=. python benchmarks/bench_masks.py --device cpu --out /tmp/masks.csv
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import flashbob
from benchmarks.results import write_rows
from benchmarks.timing import FLOPS_PER_NMD, timed_with_peak
from flashbob import masks, reference

COLUMNS = ("part", "case", "dtype", "n", "ms", "tflops", "peak_gib", "ms_per_ktoken", "baseline_ms", "ratio",
           "output", "error", "eager_error", "status")


def visible_area(n: int, window: int | None = None, documents: int = 1) -> float:
    """Visible entries of an ``n x n`` causal score matrix with a sliding window of ``window`` keys (None: all),
    over ``documents`` equal documents."""
    length = n // documents
    if window is None or window >= length:
        per_document = length * (length + 1) / 2
    else:
        per_document = window * (window + 1) / 2 + (length - window) * window
    return per_document * documents


def inputs(n: int, heads: int, head_dim: int, dtype, device: str):
    return [torch.randn(1, heads, n, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]


def fwd_bwd_bob(attend: Callable, q, k, v) -> Callable[[], object]:
    do = torch.randn_like(q)
    bars = [torch.randn_like(t) for t in (q, k, v)]

    def run():
        grads = torch.autograd.grad(attend(q, k, v), (q, k, v), do, create_graph=True)
        return torch.autograd.grad(grads, (q, k, v), bars)

    return run


def fwd_bwd(attend: Callable, q, k, v) -> Callable[[], object]:
    do = torch.randn_like(q)
    return lambda: torch.autograd.grad(attend(q, k, v), (q, k, v), do)


def tflops(workload: str, ms: float, area: float, heads: int, head_dim: int) -> float:
    return FLOPS_PER_NMD[workload] * area * head_dim * heads / (ms * 1e-3) / 1e12


def window_rows(args) -> list[dict]:
    rows = []
    for n in args.lengths:
        row_of = {}
        for case, kwargs, area in (("causal", {}, visible_area(n)),
                                   ("window", {"window": (args.window - 1, 0)}, visible_area(n, args.window))):
            q, k, v = inputs(n, args.heads, args.head_dim, args.dtype, args.device)
            run = fwd_bwd_bob(lambda q, k, v, kwargs=kwargs: flashbob.attention(q, k, v, causal=True, **kwargs),
                              q, k, v)
            row = {"part": "window", "case": case, "dtype": str(args.dtype).removeprefix("torch."), "n": n}
            row.update(guarded(lambda: measured(run, "fwd_bwd_bob", area, n, args)))
            row_of[case] = row
            rows.append(row)
            del q, k, v, run
            empty_cache(args.device)
        if "tflops" in row_of["window"] and "tflops" in row_of["causal"]:
            row_of["window"]["ratio"] = round(row_of["window"]["tflops"] / row_of["causal"]["tflops"], 3)
    return rows


def measured(run, workload: str, area: float, n: int, args) -> dict:
    ms, peak = timed_with_peak(run, args.warmup, args.reps, args.device)
    return {"ms": round(ms, 3), "tflops": float(f"{tflops(workload, ms, area, args.heads, args.head_dim):.4g}"),
            "peak_gib": None if peak is None else round(peak, 3), "ms_per_ktoken": round(ms / n * 1024, 4),
            "status": "ok"}


def guarded(measure: Callable[[], dict]) -> dict:
    try:
        return measure()
    except torch.cuda.OutOfMemoryError:
        return {"status": "oom"}
    except Exception as error:  # noqa: BLE001 (one failing case must not end the sweep)
        return {"status": f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"}


def empty_cache(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def documents_rows(args) -> list[dict]:
    count, length = args.documents, args.document_length
    n = count * length
    ids = torch.arange(count, device=args.device).repeat_interleave(length)[None]
    q, k, v = inputs(n, args.heads, args.head_dim, args.dtype, args.device)
    packed = fwd_bwd_bob(lambda q, k, v: flashbob.attention(q, k, v, causal=True, document_ids=ids), q, k, v)
    parts = [fwd_bwd_bob(lambda q, k, v: flashbob.attention(q, k, v, causal=True),
                         *(x[:, :, :length].detach().clone().requires_grad_() for x in (q, k, v)))]
    dtype = str(args.dtype).removeprefix("torch.")
    row = {"part": "documents", "case": f"{count} x {length} packed", "dtype": dtype, "n": n}
    row.update(guarded(lambda: measured(packed, "fwd_bwd_bob", visible_area(n, documents=count), n, args)))
    single = {"part": "documents", "case": f"{count} x one {length} call", "dtype": dtype, "n": n}
    single.update(guarded(lambda: measured(lambda: [parts[0]() for _ in range(count)], "fwd_bwd_bob",
                                           visible_area(n, documents=count), n, args)))
    if "ms" in row and "ms" in single:
        row["baseline_ms"], row["ratio"] = single["ms"], round(row["ms"] / single["ms"], 3)
    return [row, single]


def paired_rows(part: str, cases: dict[str, Callable], subject: str, baseline: str, workload: str, area: float,
                n: int, args) -> list[dict]:
    """One row per case (name: attention function) of ``workload`` on fresh inputs of length ``n``; the
    ``subject``'s row gets the ``baseline``'s time and their ratio."""
    make = fwd_bwd_bob if workload == "fwd_bwd_bob" else fwd_bwd
    q, k, v = inputs(n, args.heads, args.head_dim, args.dtype, args.device)
    rows = {}
    for case, attend in cases.items():
        rows[case] = {"part": part, "case": case, "dtype": str(args.dtype).removeprefix("torch."), "n": n}
        rows[case].update(guarded(lambda attend=attend: measured(make(attend, q, k, v), workload, area, n, args)))
    if "ms" in rows[subject] and "ms" in rows[baseline]:
        rows[subject]["baseline_ms"] = rows[baseline]["ms"]
        rows[subject]["ratio"] = round(rows[subject]["ms"] / rows[baseline]["ms"], 3)
    empty_cache(args.device)
    return list(rows.values())


def block_mask_rows(args) -> list[dict]:
    from torch.nn.attention.flex_attention import create_block_mask

    rows = []
    window = args.window
    for n in args.block_mask_lengths:
        block_mask = create_block_mask(lambda b, h, i, j: (i >= j) & (i - j < window), None, None, n, n,
                                       device=args.device)
        cases = {"window=": lambda q, k, v: flashbob.attention(q, k, v, causal=True, window=(window - 1, 0)),
                 "block_mask=": lambda q, k, v: flashbob.attention(q, k, v, block_mask=block_mask)}
        rows += paired_rows("block_mask", cases, "block_mask=", "window=", "fwd_bwd_bob", visible_area(n, window), n,
                            args)
    return rows


def flex_rows(args) -> list[dict]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention) if args.device == "cuda" else flex_attention
    rows = []
    for n in args.flex_lengths:
        length = n // args.documents
        ids = torch.arange(args.documents, device=args.device).repeat_interleave(length)[None]
        window = args.window
        cases = {
            "window": ({"causal": True, "window": (window - 1, 0)},
                       lambda b, h, i, j: (i >= j) & (i - j < window), visible_area(n, window)),
            "documents": ({"causal": True, "document_ids": ids},
                          lambda b, h, i, j: (i >= j) & (ids[0, i] == ids[0, j]), visible_area(n, documents=args.documents)),
        }
        for case, (kwargs, mask_mod, area) in cases.items():
            block_mask = create_block_mask(mask_mod, None, None, n, n, device=args.device)
            impls = {f"{case}, flashbob": lambda q, k, v, kwargs=kwargs: flashbob.attention(q, k, v, **kwargs),
                     f"{case}, flex_attention": lambda q, k, v, bm=block_mask: compiled(q, k, v, block_mask=bm)}
            rows += paired_rows("flex", impls, f"{case}, flashbob", f"{case}, flex_attention", "fwd_bwd", area, n, args)
    return rows


def every_output(attend: Callable, q, k, v, do, bars, tangents) -> dict[str, torch.Tensor]:
    o = attend(q, k, v)
    grads = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    bob = torch.autograd.grad(grads, (q, k, v, do), bars)
    o_dot = torch.func.jvp(attend, (q.detach(), k.detach(), v.detach()), tangents)[1]
    return {"o": o, "dq": grads[0], "dk": grads[1], "dv": grads[2], "q_bar": bob[0], "k_bar": bob[1],
            "v_bar": bob[2], "do_bar": bob[3], "o_dot": o_dot}


def accuracy_rows(args) -> list[dict]:
    rows = []
    heads = 4
    for n in args.accuracy_lengths:
        ids = torch.arange(4, device=args.device).repeat_interleave(n // 4)[None]
        for case, kwargs in (("window", {"causal": True, "window": (args.window - 1, 0)}),
                             ("documents", {"causal": True, "document_ids": ids})):
            dense = masks.dense(n, n, device=args.device, **kwargs)
            base = [torch.randn(1, heads, n, args.head_dim, device=args.device, dtype=torch.float64) for _ in range(7)]
            # q, k, v, dO, the cotangents of dQ, dK, dV; the tangents are q, k, v themselves
            exact = every_output(lambda q, k, v: reference.attention(q, k, v, attn_mask=dense),
                                 *(x.clone().requires_grad_() for x in base[:3]), base[3].clone().requires_grad_(),
                                 base[4:7], tuple(base[:3]))
            for dtype in (torch.bfloat16, torch.float16):
                low = [x.to(dtype) for x in base]

                def run(attend, low=low):
                    return every_output(attend, *(x.clone().requires_grad_() for x in low[:3]),
                                        low[3].clone().requires_grad_(), low[4:7], tuple(low[:3]))

                ours = run(lambda q, k, v: flashbob.attention(q, k, v, **kwargs))
                eager = run(lambda q, k, v: reference.attention(q, k, v, attn_mask=dense))
                for name, want in exact.items():
                    error = ((ours[name].double() - want).norm() / want.norm()).item()
                    eager_error = ((eager[name].double() - want).norm() / want.norm()).item()
                    rows.append({"part": "accuracy", "case": case, "dtype": str(dtype).removeprefix("torch."),
                                 "n": n, "output": name, "error": f"{error:.3e}", "eager_error": f"{eager_error:.3e}",
                                 "ratio": round(error / eager_error, 3) if eager_error else None, "status": "ok"})
            empty_cache(args.device)
    return rows


PARTS = {"window": window_rows, "documents": documents_rows, "block_mask": block_mask_rows, "flex": flex_rows,
         "accuracy": accuracy_rows}


def print_table(rows: list[dict]) -> None:
    print(f"{'part':10} {'case':28} {'dtype':8} {'n':>7}  result")
    for row in rows:
        if row.get("status") != "ok":
            result = row.get("status")
        elif row["part"] == "accuracy":
            result = f"{row['output']}: {row['error']} (eager {row['eager_error']}, ratio {row['ratio']})"
        else:
            result = (f"{row['ms']} ms, {row['tflops']} TFLOP/s, {row['peak_gib']} GiB"
                      + (f", ratio {row['ratio']}" if row.get("ratio") is not None else ""))
        print(f"{row['part']:10} {row['case']:28} {row['dtype']:8} {row['n']:>7}  {result}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results/masks.csv")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072, 262144])
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--document-length", type=int, default=8192)
    parser.add_argument("--block-mask-lengths", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--flex-lengths", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--accuracy-lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cpu: smoke test of the script (tiny sizes)")
    args = parser.parse_args()
    args.dtype = torch.bfloat16
    if args.device == "cpu":
        args.lengths, args.window, args.documents, args.document_length = [64, 128], 16, 4, 32
        args.block_mask_lengths, args.flex_lengths, args.accuracy_lengths = [64], [], [64]
        args.heads, args.head_dim, args.warmup, args.reps, args.dtype = 2, 16, 1, 2, torch.float32
    rows = [row for part in args.parts for row in PARTS[part](args)]
    write_rows(args.out, rows, COLUMNS)
    print_table(rows)


if __name__ == "__main__":
    main()
