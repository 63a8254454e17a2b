"""Accuracy (and peak memory) of the Triton kernels on a GPU, against float64 and eager PyTorch.

Run on a CUDA machine from the checkout::

    PYTHONPATH=. python tests/gpu/accuracy.py --out docs/results/accuracy.csv
    PYTHONPATH=. python tests/gpu/accuracy.py --n 16384 --dtypes bf16      # one slice of the sweep
    PYTHONPATH=. python tests/gpu/accuracy.py --memory --out docs/results/memory.csv

Accuracy mode: for every N, head layout (H=16 with d=128 and d=64, and GQA H=16, Hkv=4 with
d=128), causal or not, and dtype, random inputs and cotangents are rounded to the dtype and
pushed through ``flashbob.kernels`` (forward, backward, BoB). The same rounded inputs go through
eager autograd on naive materialised attention (``flashbob.reference``) in the same dtype and in
float64. For every output (o, dq, dk, dv, q_bar, k_bar, v_bar, do_bar) the relative error
``||x - ref|| / ||ref||`` against float64 is recorded for both; bf16/fp16 PASS when flashbob's is
at most 1.5x eager's, fp32 (``allow_tf32=False``) when flashbob's is below 1e-5. The naive
computations run one query head at a time (dK, dV and their BoB cotangents summed over the group),
so the float64 reference at N=16K needs tens of GiB, not hundreds. Rows are appended to the CSV as
they finish; an out-of-memory case is recorded as OOM and the sweep goes on.

Memory mode: forward, backward and BoB through the kernels (no autograd) at N = 16K, 32K, 64K,
B=1, H=16, d=128, bf16, causal, recording ``torch.cuda.max_memory_allocated`` (inputs and
cotangents included); then eager autograd (forward, backward with ``create_graph``, second
backward, all heads at once) at the smallest N, expected to run out of memory.

CPU smoke test of this script (Triton interpreter, tiny shapes; bf16 is wrong in the interpreter)::

    PYTHONPATH=. python tests/gpu/accuracy.py --device cpu --interpret --n 40 --heads 4 \\
        --gqa-kv-heads 2 --head-dims 32 16 --dtypes fp16 fp32 --out /tmp/accuracy.csv
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import time
from pathlib import Path

import torch

from benchmarks.results import write_rows

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OUTPUTS = ("o", "dq", "dk", "dv", "q_bar", "k_bar", "v_bar", "do_bar")
HALF_BAR = 1.5  # bf16/fp16: flashbob's error at most this times eager's
FP32_BAR = 1e-5  # fp32 without tf32: flashbob's relative error below this
FIELDS = ("n", "heads", "kv_heads", "head_dim", "causal", "dtype", "output",
          "err_flashbob", "err_eager", "ratio", "verdict")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=None, help="sequence lengths (N = M)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--gqa-kv-heads", type=int, default=4, help="kv heads of the GQA case")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64], help="first one is also the GQA case's")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--memory", action="store_true", help="peak-memory mode instead of accuracy")
    parser.add_argument("--key-mask", action="store_true",
                        help="batch 2 with a key-padding mask: element 0 drops ~30%% of the keys, element 1 keeps "
                             "only key 0 (one-hot rows)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--interpret", action="store_true", help="run the kernels in Triton's interpreter (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None,
                        help="CSV (default docs/results/accuracy.csv or docs/results/memory.csv)")
    args = parser.parse_args()
    if args.n is None:
        args.n = [16384, 32768, 65536] if args.memory else [1024, 4096, 16384]
    if args.out is None:
        args.out = Path("docs/results/memory.csv" if args.memory else "docs/results/accuracy.csv")
    return args


def random_inputs(shape, dtype, device, generator):
    """q, k, v, do and the cotangents (dq_bar, dk_bar, dv_bar), drawn in float64 and rounded to ``dtype``."""
    batch, heads, kv_heads, n, head_dim = shape

    def randn(h):
        return torch.randn(batch, h, n, head_dim, generator=generator, dtype=torch.float64, device=device).to(dtype)

    return {"q": randn(heads), "k": randn(kv_heads), "v": randn(kv_heads), "do": randn(heads),
            "dq_bar": randn(heads), "dk_bar": randn(kv_heads), "dv_bar": randn(kv_heads), "key_mask": None}


def key_padding_mask(batch, n, device, generator):
    """``(batch, n)`` bool mask, True = keep: element 0 keeps ~70% of the keys, every other one only key 0."""
    keep = torch.rand(batch, n, generator=generator, device=device) > 0.3
    keep[1:] = False
    keep[:, 0] = True
    return keep


def flashbob_outputs(kernels, x, *, causal, scale):
    """The eight outputs through the Triton kernels, chained as the autograd wiring chains them."""
    mask = {"causal": causal, "scale": scale, "key_mask": x["key_mask"]}
    o, stats = kernels.forward(x["q"], x["k"], x["v"], **mask)
    dq, dk, dv, delta = kernels.backward(x["q"], x["k"], x["v"], o, stats, x["do"], **mask)
    bob = kernels.bob(x["q"], x["k"], x["v"], x["do"], o, stats, delta, x["dq_bar"], x["dk_bar"], x["dv_bar"], **mask)
    return dict(zip(OUTPUTS, (o, dq, dk, dv, *bob)))


def naive_outputs(x, dtype, *, causal, scale):
    """The eight outputs of eager autograd through naive attention in ``dtype``, one query head at a
    time; kv-side outputs are summed over the query heads of each group. Returned in float64."""
    from flashbob import reference

    heads, kv_heads = x["q"].shape[1], x["k"].shape[1]
    group = heads // kv_heads
    out = {name: torch.zeros_like(x[source], dtype=torch.float64) for name, source in
           zip(OUTPUTS, ("q", "q", "k", "v", "q", "k", "v", "do"))}
    for head in range(heads):
        kv = slice(head // group, head // group + 1)
        q, do, u = (x[name][:, head:head + 1].to(dtype) for name in ("q", "do", "dq_bar"))
        k, v, w, z = (x[name][:, kv].to(dtype) for name in ("k", "v", "dk_bar", "dv_bar"))
        mask = {"causal": causal, "scale": scale, "key_mask": x["key_mask"]}
        o = reference.attention(q, k, v, **mask)
        dq, dk, dv = reference.attention_backward(q, k, v, do, **mask)
        q_bar, k_bar, v_bar, do_bar = reference.backward_over_backward(q, k, v, do, u, w, z, **mask)
        for name, value in zip(OUTPUTS, (o, dq, dk, dv, q_bar, k_bar, v_bar, do_bar)):
            target = out[name][:, kv] if name in ("dk", "dv", "k_bar", "v_bar") else out[name][:, head:head + 1]
            target += value.double()
        del o, dq, dk, dv, q_bar, k_bar, v_bar, do_bar
    return out


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def accuracy_case(kernels, shape, dtype_name, causal, device, generator, key_mask=False):
    """CSV rows of one case: every output's error for flashbob and eager, and the verdict."""
    batch, heads, kv_heads, n, head_dim = shape
    dtype = DTYPES[dtype_name]
    scale = head_dim ** -0.5
    base = dict(n=n, heads=heads, kv_heads=kv_heads, head_dim=head_dim, causal=causal, dtype=dtype_name)
    try:
        x = random_inputs(shape, dtype, device, generator)
        if key_mask:
            x["key_mask"] = key_padding_mask(batch, n, device, generator)
        ours = flashbob_outputs(kernels, x, causal=causal, scale=scale)
        exact = naive_outputs(x, torch.float64, causal=causal, scale=scale)
        errors = {name: relative_error(ours[name], exact[name]) for name in OUTPUTS}
        del ours
        eager = naive_outputs(x, dtype, causal=causal, scale=scale)
        eager_errors = {name: relative_error(eager[name], exact[name]) for name in OUTPUTS}
    except torch.cuda.OutOfMemoryError:
        return [dict(base, output=name, verdict="OOM") for name in OUTPUTS]
    except Exception as error:  # keep the sweep going; the CSV says what broke
        return [dict(base, output=name, verdict=f"ERROR {type(error).__name__}: {error}"[:200]) for name in OUTPUTS]
    finally:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    rows = []
    for name in OUTPUTS:
        ours_err, eager_err = errors[name], eager_errors[name]
        ratio = ours_err / eager_err if eager_err > 0 else math.inf
        passed = ours_err < FP32_BAR if dtype == torch.float32 else ratio <= HALF_BAR
        rows.append(dict(base, output=name, err_flashbob=f"{ours_err:.3e}", err_eager=f"{eager_err:.3e}",
                         ratio=f"{ratio:.3f}", verdict="PASS" if passed else "FAIL"))
    return rows


def run_accuracy(args, kernels) -> None:
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    layouts = [(args.heads, args.heads, d) for d in args.head_dims]
    layouts.append((args.heads, args.gqa_kv_heads, args.head_dims[0]))
    layouts = list(dict.fromkeys(layouts))  # the GQA case is a duplicate when gqa_kv_heads == heads
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    all_rows = []
    with open(args.out, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=FIELDS)
        writer.writeheader()
        for n in args.n:
            for heads, kv_heads, head_dim in layouts:
                for causal in causals:
                    for dtype_name in args.dtypes:
                        start = time.perf_counter()
                        batch = 2 if args.key_mask else 1
                        rows = accuracy_case(kernels, (batch, heads, kv_heads, n, head_dim), dtype_name, causal,
                                             args.device, generator, args.key_mask)
                        writer.writerows(rows)
                        file.flush()
                        all_rows += rows
                        verdicts = sorted({row["verdict"] for row in rows})
                        print(f"N={n} H={heads} Hkv={kv_heads} d={head_dim} causal={causal} {dtype_name}: "
                              f"{'/'.join(verdicts)} ({time.perf_counter() - start:.0f}s)", flush=True)
    print_table(all_rows)
    print(f"wrote {args.out}")


def print_table(rows) -> None:
    """One line per case: flashbob/eager error ratio per output (fp32: flashbob's error), and the verdict."""
    cases = {}
    for row in rows:
        key = (row["n"], row["heads"], row["kv_heads"], row["head_dim"], row["causal"], row["dtype"])
        cases.setdefault(key, []).append(row)
    print(f"\n{'N':>6} {'H':>3} {'Hkv':>3} {'d':>4} {'causal':>6} {'dtype':>5}  "
          + " ".join(f"{name:>8}" for name in OUTPUTS) + "  verdict   (ratio flashbob/eager; fp32: error)")
    for (n, heads, kv_heads, head_dim, causal, dtype), case_rows in cases.items():
        cells = []
        for row in case_rows:
            if "err_flashbob" not in row:
                cells.append(f"{row['verdict'].split()[0]:>8}")
            elif dtype == "fp32":
                cells.append(f"{float(row['err_flashbob']):>8.1e}")
            else:
                cells.append(f"{float(row['ratio']):>8.3f}")
        verdicts = {row["verdict"] for row in case_rows}
        verdict = "PASS" if verdicts == {"PASS"} else "FAIL" if "FAIL" in verdicts else sorted(verdicts)[0][:20]
        case = f"{n:>6} {heads:>3} {kv_heads:>3} {head_dim:>4} {str(causal):>6} {dtype:>5}"
        print(f"{case}  {' '.join(cells)}  {verdict}")
    total = sum(1 for rows_ in cases.values() if all(r["verdict"] == "PASS" for r in rows_))
    print(f"{total}/{len(cases)} cases PASS")


def peak_memory(fn, device) -> tuple[str, float]:
    """(peak GiB or 'OOM', seconds) of ``fn()`` on ``device``, from a clean peak counter."""
    if not device.startswith("cuda"):
        start = time.perf_counter()
        fn()
        return "n/a", time.perf_counter() - start
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        fn()
        torch.cuda.synchronize()
        return f"{torch.cuda.max_memory_allocated() / 2**30:.2f}", time.perf_counter() - start
    except torch.cuda.OutOfMemoryError:
        return "OOM", time.perf_counter() - start
    finally:
        torch.cuda.empty_cache()


def run_memory(args, kernels) -> None:
    from flashbob import reference

    heads, head_dim, dtype = args.heads, args.head_dims[0], torch.bfloat16
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    rows = []
    for n in args.n:

        def flashbob_passes():
            x = random_inputs((1, heads, heads, n, head_dim), dtype, args.device, generator)
            flashbob_outputs(kernels, x, causal=True, scale=head_dim ** -0.5)

        peak, seconds = peak_memory(flashbob_passes, args.device)
        rows.append(dict(impl="flashbob", n=n, heads=heads, head_dim=head_dim, peak_gib=peak, seconds=f"{seconds:.2f}"))
        print(rows[-1], flush=True)

    def eager_passes():
        x = random_inputs((1, heads, heads, args.n[0], head_dim), dtype, args.device, generator)
        reference.backward_over_backward(x["q"], x["k"], x["v"], x["do"], x["dq_bar"], x["dk_bar"], x["dv_bar"],
                                         causal=True, scale=head_dim ** -0.5)

    peak, seconds = peak_memory(eager_passes, args.device)
    rows.append(dict(impl="eager", n=args.n[0], heads=heads, head_dim=head_dim, peak_gib=peak,
                     seconds=f"{seconds:.2f}"))
    print(rows[-1], flush=True)
    write_rows(args.out, rows)
    print(f"\n{'impl':>8} {'N':>6} {'peak GiB':>9} {'s':>7}")
    for row in rows:
        print(f"{row['impl']:>8} {row['n']:>6} {row['peak_gib']:>9} {row['seconds']:>7}")
    print(f"wrote {args.out}")


def main() -> None:
    args = parse_args()
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first import of triton
    from flashbob import kernels

    torch.backends.cuda.matmul.allow_tf32 = False  # eager fp32 at full precision, like the kernels
    torch.backends.cudnn.allow_tf32 = False
    if args.memory:
        run_memory(args, kernels)
    else:
        run_accuracy(args, kernels)


if __name__ == "__main__":
    main()
