"""Randomised stress test of ``flashbob.attention(..., backend="triton")``: forward, backward and BoB
through autograd on thousands of random shapes, flags and layouts, against a float64 oracle.

Run on a CUDA machine from the checkout::

    PYTHONPATH=. python benchmarks/stress_gpu.py --seconds 240 --out docs/stress.csv
    PYTHONPATH=. python benchmarks/stress_gpu.py --case-seed 123456789          # replay one case

CPU smoke test (Triton interpreter, tiny shapes; bf16 is wrong in the interpreter)::

    PYTHONPATH=. python benchmarks/stress_gpu.py --device cpu --interpret --seconds 20 --max-len 40 \\
        --head-dims 16 32 --dtypes fp16 fp32 --out /tmp/stress.csv

Every case draws, from its own seed: batch, kv heads and the GQA group (so ``H % Hkv == 0``),
lengths ``N`` and ``M`` independently (half from 1..64, half log-uniform up to ``--max-len``: odd and
ragged values), head_dim, causal, dtype, a layout for ``q, k, v`` and one for the cotangents
(contiguous, ``(B, N, H, d)`` storage viewed transposed, head_dim stride 2, a slice of a longer
sequence, or stride 0 along the batch), which inputs require grad and which first derivatives feed
the second. It runs ``O = attention(q, k, v)``, ``grad(O, wrt, dO, create_graph=True)`` and the
gradient of the chosen first derivatives with random cotangents, and the same through naive
attention (:mod:`flashbob.reference`) with eager autograd in the case's dtype and in float64.

Each output's error is ``||x - exact|| / max(||exact||, sqrt(numel))``: relative, except for outputs
that vanish in exact arithmetic (dQ or BoB's outputs with one visible key), which are held to an
absolute error per element (inputs are O(1), so outputs are O(1) per element). A case PASSes when
every output is finite and its error is at most ``RATIO`` times eager's plus ``SLACK[dtype]``
(machine epsilon for half precision; 1e-5 for fp32, check_gpu.py's bar). Problems are capped
at ``--max-elements`` score entries (``B * H * N * M``) so that the float64 oracle fits in memory.
One CSV row per case (its worst output), then a summary with every failure's parameters.
"""

from __future__ import annotations

import argparse
import collections
import csv
import math
import os
import random
import time
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYOUTS = ("contiguous", "transposed", "strided", "sliced", "expanded")
RATIO = 2.0
SLACK = {"bf16": torch.finfo(torch.bfloat16).eps, "fp16": torch.finfo(torch.float16).eps, "fp32": 1e-5}
FIELDS = ("case_seed", "batch", "heads", "kv_heads", "n", "m", "head_dim", "causal", "dtype", "layout",
          "cotangent_layout", "requires_grad", "second", "worst_output", "err_flashbob", "err_eager", "verdict",
          "seconds", "message")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=240.0, help="time budget; cases run until it is spent")
    parser.add_argument("--cases", type=int, default=None, help="stop after this many cases")
    parser.add_argument("--case-seed", type=int, default=None, help="run only the case with this seed (replay)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the case seeds")
    parser.add_argument("--max-len", type=int, default=3000)
    parser.add_argument("--max-elements", type=int, default=1 << 26, help="cap on B * H * N * M")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[16, 32, 40, 64, 80, 96, 128, 256])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--interpret", action="store_true", help="run the kernels in Triton's interpreter (CPU)")
    parser.add_argument("--out", type=Path, default=Path("docs/stress.csv"))
    return parser.parse_args()


def draw_length(rng: random.Random, max_len: int) -> int:
    if rng.random() < 0.5:
        return rng.randint(1, min(64, max_len))
    return max(1, min(max_len, round(math.exp(rng.uniform(0, math.log(max_len))))))


def draw_case(case_seed: int, args) -> dict:
    """The parameters of one case, a pure function of its seed and the command line."""
    rng = random.Random(case_seed)
    kv_heads, group, batch = rng.randint(1, 4), rng.choice([1, 1, 2, 3, 4]), rng.randint(1, 3)
    n, m = draw_length(rng, args.max_len), draw_length(rng, args.max_len)
    while batch * kv_heads * group * n * m > args.max_elements:  # shrink heads, then batch, then lengths
        if group > 1:
            group -= 1
        elif kv_heads > 1:
            kv_heads -= 1
        elif batch > 1:
            batch -= 1
        else:
            n, m = max(1, n // 2), max(1, m // 2)
    requires_grad = [False, False, False]
    while not any(requires_grad):
        requires_grad = [rng.random() < 0.7 for _ in range(3)]
    wrt = [i for i in range(3) if requires_grad[i]]
    second = sorted(rng.sample(wrt, rng.randint(1, len(wrt))))
    return dict(case_seed=case_seed, batch=batch, heads=kv_heads * group, kv_heads=kv_heads, n=n, m=m,
                head_dim=rng.choice(args.head_dims), causal=rng.random() < 0.5, dtype=rng.choice(args.dtypes),
                layout=rng.choice(LAYOUTS), cotangent_layout=rng.choice(LAYOUTS),
                requires_grad="".join("qkv"[i] for i in wrt), second="".join("qkv"[i] for i in second))


def make_tensor(shape, layout: str, dtype, device, generator) -> torch.Tensor:
    """A ``(B, H, L, d)`` tensor drawn in float64, rounded to ``dtype``, stored in ``layout``."""
    batch, heads, length, head_dim = shape

    def randn(*size):
        return torch.randn(*size, generator=generator, dtype=torch.float64, device=device).to(dtype)

    if layout == "transposed":
        return randn(batch, length, heads, head_dim).transpose(1, 2)
    if layout == "strided":
        return randn(batch, heads, length, 2 * head_dim)[..., ::2]
    if layout == "sliced":
        return randn(batch, heads, length + 3, head_dim)[:, :, 2 : 2 + length]
    if layout == "expanded":
        return randn(1, heads, length, head_dim).expand(shape)
    return randn(batch, heads, length, head_dim)


def derivatives(attention, inputs, do, bars, case) -> list[torch.Tensor]:
    """``O``, first derivatives of the inputs that require grad, second derivatives of the chosen ones."""
    wrt_names = case["requires_grad"]
    leaves = [x.detach().requires_grad_(name in wrt_names) for name, x in zip("qkv", inputs)]
    o = attention(*leaves, causal=case["causal"])
    wrt = [x for x in leaves if x.requires_grad]
    first = torch.autograd.grad(o, wrt, do, create_graph=True)
    by_name = dict(zip(wrt_names, first))
    pairs = [(by_name[name], bars["qkv".index(name)]) for name in case["second"] if by_name[name].requires_grad]
    if pairs:
        outputs, cotangents = zip(*pairs)
        second = torch.autograd.grad(outputs, wrt, cotangents, materialize_grads=True)
    else:  # e.g. dV when only v requires grad: it does not depend on the inputs
        second = [torch.zeros_like(x) for x in wrt]
    names = ["o", *(f"d{n}" for n in wrt_names), *(f"{n}_bar" for n in wrt_names)]
    return dict(zip(names, (t.detach() for t in (o, *first, *second))))


def error(x: torch.Tensor, exact: torch.Tensor) -> float:
    difference = (x.double() - exact).norm().item()
    return difference / max(exact.norm().item(), math.sqrt(exact.numel()))


def run_case(case: dict, device: str) -> dict:
    from flashbob import attention, reference

    dtype = DTYPES[case["dtype"]]
    generator = torch.Generator(device=device).manual_seed(case["case_seed"])
    q_shape = (case["batch"], case["heads"], case["n"], case["head_dim"])
    kv_shape = (case["batch"], case["kv_heads"], case["m"], case["head_dim"])
    inputs = [make_tensor(s, case["layout"], dtype, device, generator) for s in (q_shape, kv_shape, kv_shape)]
    do = make_tensor(q_shape, case["cotangent_layout"], dtype, device, generator)
    bars = [make_tensor(x.shape, case["cotangent_layout"], dtype, device, generator) for x in inputs]
    ours = derivatives(lambda *a, **kw: attention(*a, backend="triton", **kw), inputs, do, bars, case)
    exact = derivatives(reference.attention, [x.double() for x in inputs], do.double(),
                        [b.double() for b in bars], case)
    eager = derivatives(reference.attention, inputs, do, bars, case)
    worst = None
    for name, x in ours.items():
        finite = bool(torch.isfinite(x).all())
        ours_err, eager_err = error(x, exact[name]), error(eager[name], exact[name])
        excess = math.inf if not finite else ours_err - (RATIO * eager_err + SLACK[case["dtype"]])
        if worst is None or excess > worst[0]:
            worst = (excess, name, ours_err, eager_err, finite)
    excess, name, ours_err, eager_err, finite = worst
    verdict = "PASS" if excess <= 0 else "FAIL"
    message = "" if finite else "non-finite output"
    return dict(worst_output=name, err_flashbob=f"{ours_err:.3e}", err_eager=f"{eager_err:.3e}", verdict=verdict,
                message=message)


def guarded_case(case: dict, device: str) -> dict:
    """:func:`run_case`, with out-of-memory and any other exception recorded instead of raised."""
    start = time.perf_counter()
    try:
        result = run_case(case, device)
    except torch.cuda.OutOfMemoryError:
        result = dict(verdict="OOM")
    except Exception as failure:  # the sweep goes on; the CSV says what broke
        result = dict(verdict="ERROR", message=f"{type(failure).__name__}: {failure}"[:300])
    finally:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return {**case, **result, "seconds": f"{time.perf_counter() - start:.2f}"}


def print_summary(rows: list[dict], elapsed: float) -> None:
    verdicts = collections.Counter(row["verdict"] for row in rows)
    print(f"\n{len(rows)} cases in {elapsed:.0f}s: " + ", ".join(f"{v} {c}" for v, c in sorted(verdicts.items())))
    for dtype in sorted({row["dtype"] for row in rows}):
        ratios = [float(r["err_flashbob"]) / float(r["err_eager"]) for r in rows
                  if r["dtype"] == dtype and r.get("err_flashbob") and float(r["err_eager"]) > 0]
        if ratios:
            print(f"  {dtype}: worst-output error / eager's: median {sorted(ratios)[len(ratios) // 2]:.2f}, "
                  f"max {max(ratios):.2f} over {len(ratios)} cases")
    bad = [row for row in rows if row["verdict"] != "PASS"]
    for row in bad:
        params = " ".join(f"{key}={row[key]}" for key in FIELDS[:13])
        detail = row.get("message") or (
            f"{row.get('worst_output')}: {row.get('err_flashbob')} vs eager {row.get('err_eager')}")
        print(f"  {row['verdict']}: {params}: {detail}")
    if bad:
        print("replay one with --case-seed SEED (same --max-len, --max-elements, --head-dims and --dtypes)")


def main() -> None:
    args = parse_args()
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first import of triton
    torch.backends.cuda.matmul.allow_tf32 = False  # eager fp32 at full precision, like the kernels
    torch.set_float32_matmul_precision("highest")
    master = random.Random(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows, start = [], time.perf_counter()
    with open(args.out, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        while time.perf_counter() - start < args.seconds and (args.cases is None or len(rows) < args.cases):
            case_seed = args.case_seed if args.case_seed is not None else master.getrandbits(31)
            row = guarded_case(draw_case(case_seed, args), args.device)
            writer.writerow(row)
            file.flush()
            rows.append(row)
            if row["verdict"] != "PASS" or len(rows) % 100 == 0:
                print(f"[{time.perf_counter() - start:.0f}s] case {len(rows)} seed {case_seed}: {row['verdict']}",
                      flush=True)
            if args.case_seed is not None:
                break
    print_summary(rows, time.perf_counter() - start)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
