"""Randomised stress test of ``flashbob.attention(..., backend="triton")``: forward, backward and BoB
through autograd on tens of thousands of random shapes, flags, layouts and key-padding masks,
against a float64 oracle.

Run on a CUDA machine from the checkout (``--seconds`` plus ~10 s)::

    PYTHONPATH=. python tests/gpu/stress.py --seconds 240 --out docs/results/stress.csv
    PYTHONPATH=. python tests/gpu/stress.py --case-seed 123456789          # replay one case

CPU smoke test (Triton interpreter, tiny shapes; bf16 is wrong in the interpreter)::

    PYTHONPATH=. python tests/gpu/stress.py --device cpu --interpret --seconds 20 --max-len 40 \\
        --head-dims 16 40 --dtypes fp16 fp32 --out /tmp/stress.csv

What a case is. Its compile-relevant half comes from one of ``--families`` fixed combinations
(family ``case_seed % families``, each drawn from ``--seed``): kv heads 1-4 and the GQA group 1-4
(so ``H % Hkv == 0``), a length class for ``N`` and one for ``M`` (block-size bucket 1-16, 17-32,
33-64 or 65+, and length 1, a multiple of 16, even or odd), head_dim from ``--head-dims``, causal,
dtype, a layout for ``q, k, v`` and one for the cotangents (contiguous, ``(B, N, H, d)`` storage
viewed transposed, head_dim stride 2, a slice of a longer sequence, or stride 0 along the batch),
which inputs require grad, which first derivatives feed the second, whether there is a key
mask, a sliding window and document ids. The rest the case draws from its own seed: batch 1-3, lengths ``N`` and ``M`` independently
within the family's classes (up to ``--max-len``; log-uniform above 64: odd and ragged values),
the data, and in masked families a boolean key-padding mask ``key_mask``: per batch element all
keys, a prefix (right padding), a suffix (left padding), a random subset, exactly one key, or
none at all (a batch element whose rows see no key: zero output and gradients), as a ``(B, M)``
tensor or one ``(M,)``/``(1, M)`` row broadcast over the batch. With causal masking, rows before the
first kept key see none, and row 0 sees at most one. In windowed families a ``window`` ``(left, right)``, each
bound None or 0 to ``max(N, M)``; in document families ``(q_ids, k_ids)``, sorted runs or scattered ids (some
queries then see no key). ``B * H * N * M`` is capped at
``--max-elements`` so that the float64 oracle takes milliseconds. The case runs
``O = attention(q, k, v, causal=..., key_mask=..., window=..., document_ids=...)``, ``grad(O, wrt, dO, create_graph=True)`` and the
gradient of the chosen first derivatives with random cotangents, and the same through naive
attention (:mod:`flashbob.reference`) with eager autograd in the case's dtype and in float64.

Each output's error is ``||x - exact|| / max(||exact||, sqrt(numel))``: relative, except for outputs
that vanish in exact arithmetic (dQ or BoB's outputs with one visible key, every output of rows that
see no key), which are held to an absolute error per element (inputs are O(1), so outputs are
O(1) per element). A case PASSes when every output is finite and its error is at most ``RATIO``
times eager's plus ``SLACK[dtype]`` (machine epsilon for half precision; 1e-5 for fp32, accuracy.py's
bar). The summary gives the cases, PASS/FAIL/ERROR/OOM counts with every failure's seed and
parameters, cases/s, error ratios per dtype, the Triton compile keys the run needed, and coverage
counts; ``--out`` gets one CSV row per family, ``--cases-out`` one per case.

Why families. Every new combination of compile-time flags (head_dim, dtype, causal, key mask,
which BoB cotangents exist, the block sizes, and Triton's specialisation of the integer arguments,
lengths and strides, on ``== 1`` and divisibility by 16) compiles new kernels, ~1-2 s each, while a
case takes ~20 ms. Drawn independently (``--families 0``), a case needs ~3 new kernels (6229
distinct specialisations in 2000 draws), so the run measures the compiler. A family needs ~5
kernels; the run goes over every family once first, in ``--workers`` processes that share the GPU
and Triton's on-disk cache (so the compilations run in parallel on the CPU cores), and turns
autotuning off (``FLASHBOB_AUTOTUNE=0`` unless ``--autotune``: tuning compiles and times every
candidate config per length bucket). After that first pass every case reuses compiled kernels.
The CSV's ``compile_keys`` and the summary count the distinct kernel specialisations, with Triton's
``jit_cache_hook`` (nothing is compiled in the interpreter).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import csv
import math
import multiprocessing
import os
import random
import time
from pathlib import Path

import torch

from benchmarks.results import write_rows

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYOUTS = ("contiguous", "transposed", "strided", "sliced", "expanded")
# Key-padding patterns of one batch element, with their weights among masked cases.
MASK_KINDS = {"all": 1, "prefix": 3, "suffix": 2, "random": 2, "one": 2, "none": 1}
MASK_PROBABILITY = 0.5
WINDOW_PROBABILITY = 0.3
DOCUMENTS_PROBABILITY = 0.3
LENGTH_BUCKETS = ((1, 16), (17, 32), (33, 64), (65, None))
FAMILY = ("heads", "kv_heads", "n_class", "m_class", "head_dim", "causal", "dtype", "layout", "cotangent_layout",
          "requires_grad", "second", "masked", "windowed", "documents")
RATIO = 2.0
SLACK = {"bf16": torch.finfo(torch.bfloat16).eps, "fp16": torch.finfo(torch.float16).eps, "fp32": 1e-5}
PARAMETERS = ("case_seed", "family", "batch", "heads", "kv_heads", "n", "m", "head_dim", "causal", "dtype", "layout",
              "cotangent_layout", "requires_grad", "second", "key_mask", "window", "document_ids")
FIELDS = (*PARAMETERS, "worst_output", "err_flashbob", "err_eager", "verdict", "seconds", "compiles", "message")
PROGRESS_SECONDS = 30.0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=240.0, help="time budget; cases run until it is spent")
    parser.add_argument("--cases", type=int, default=None, help="stop after this many cases")
    parser.add_argument("--case-seed", type=int, default=None, help="run only the case with this seed (replay)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the case seeds and of the families")
    parser.add_argument("--families", type=int, default=192,
                        help="number of compile-relevant flag combinations the cases share (0: one per case)")
    parser.add_argument("--max-len", type=int, default=600)
    parser.add_argument("--max-elements", type=int, default=1 << 22, help="cap on B * H * N * M")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[16, 32, 40, 64, 80, 96, 128, 256])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--interpret", action="store_true", help="run the kernels in Triton's interpreter (CPU)")
    parser.add_argument("--autotune", action="store_true",
                        help="keep flashbob's autotuning on (default: FLASHBOB_AUTOTUNE=0, far fewer compilations)")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes running cases (default on CUDA: the CPU cores less 2, at most 14; on CPU: 1)")
    parser.add_argument("--out", type=Path, default=Path("docs/results/stress.csv"), help="one row per family")
    parser.add_argument("--cases-out", type=Path, default=None, help="one row per case (tens of thousands)")
    args = parser.parse_args(argv)
    if args.workers is None:
        args.workers = 1 if args.device == "cpu" else max(1, min(14, (os.cpu_count() or 2) - 2))
    if args.case_seed is not None:
        args.workers = 1
    return args


def draw_length(rng: random.Random, max_len: int) -> int:
    if rng.random() < 0.5:
        return rng.randint(1, min(64, max_len))
    return max(1, min(max_len, round(math.exp(rng.uniform(0, math.log(max_len))))))


def length_class(length: int) -> tuple[int, str]:
    """What a sequence length changes in the compiled kernels: its block-size bucket (1-16, 17-32,
    33-64, 65+: the launch configs depend on the power of two above the length, up to 128) and how
    Triton specialises it and the strides made from it (``== 1``, a multiple of 16, even, odd)."""
    bucket = next(i for i, (low, high) in enumerate(LENGTH_BUCKETS) if high is None or length <= high)
    residue = "1" if length == 1 else "16k" if length % 16 == 0 else "odd" if length % 2 else "even"
    return bucket, residue


def draw_in_class(rng: random.Random, cls: tuple[int, str], max_len: int) -> int:
    """A random length of class ``cls`` (log-uniform in the open-ended bucket)."""
    low, high = LENGTH_BUCKETS[cls[0]]
    choices = [n for n in range(low, min(high or max_len, max_len) + 1) if length_class(n) == cls]
    weights = [1.0 / n if high is None else 1.0 for n in choices]
    return rng.choices(choices, weights=weights)[0]


def draw_family(rng: random.Random, args) -> dict:
    """The compile-relevant half of a case: heads, length classes, head_dim, causal, dtype, layouts,
    which inputs require grad, which first derivatives are differentiated again, masked or not."""
    kv_heads, group = rng.randint(1, 4), rng.choice([1, 1, 2, 3, 4])
    n_class, m_class = length_class(draw_length(rng, args.max_len)), length_class(draw_length(rng, args.max_len))
    requires_grad = [False, False, False]
    while not any(requires_grad):
        requires_grad = [rng.random() < 0.7 for _ in range(3)]
    wrt = [i for i in range(3) if requires_grad[i]]
    second = sorted(rng.sample(wrt, rng.randint(1, len(wrt))))
    return {
        "heads": kv_heads * group, "kv_heads": kv_heads, "n_class": n_class, "m_class": m_class,
        "head_dim": rng.choice(args.head_dims), "causal": rng.random() < 0.5, "dtype": rng.choice(args.dtypes),
        "layout": rng.choice(LAYOUTS), "cotangent_layout": rng.choice(LAYOUTS),
        "requires_grad": "".join("qkv"[i] for i in wrt), "second": "".join("qkv"[i] for i in second),
        "masked": rng.random() < MASK_PROBABILITY, "windowed": rng.random() < WINDOW_PROBABILITY,
        "documents": rng.random() < DOCUMENTS_PROBABILITY,
    }


def draw_key_mask(rng: random.Random, batch: int, m: int) -> tuple[str, tuple[tuple[bool, ...], ...]]:
    """A key-padding mask: its description for the CSV and its rows (one per batch element, or one
    broadcast over the batch). Each row is all keys, a prefix, a suffix, a random subset, one key or
    none."""
    shape = rng.choices(["(B,M)", "(M,)", "(1,M)"], weights=[8, 1, 1])[0]
    rows = []
    for _ in range(batch if shape == "(B,M)" else 1):
        kind = rng.choices(list(MASK_KINDS), weights=list(MASK_KINDS.values()))[0]
        if kind in ("prefix", "suffix"):
            length = rng.choice([1, rng.randint(1, m)])
            keep = [j < length for j in range(m)] if kind == "prefix" else [j >= m - length for j in range(m)]
        elif kind == "random":
            p = rng.uniform(0.05, 0.95)
            keep = [rng.random() < p for _ in range(m)]
        elif kind == "one":
            one = rng.randrange(m)
            keep = [j == one for j in range(m)]
        else:
            keep = [kind == "all"] * m
        rows.append((kind, tuple(keep)))
    description = " ".join(f"{kind}:{sum(keep)}" for kind, keep in rows)
    if shape != "(B,M)":
        description = f"{shape} {description}"
    return description, tuple(keep for _, keep in rows)


def draw_case(case_seed: int, args) -> dict:
    """The parameters of one case, a pure function of its seed and the command line (``--seed``,
    ``--families``, ``--max-len``, ``--max-elements``, ``--head-dims``, ``--dtypes``).

    With ``--families F`` the compile-relevant parameters come from family ``case_seed % F``, the
    same for every case of the family; the case draws its own batch, lengths within the family's
    length classes, key-padding mask and data. With ``--families 0`` every case is its own family.
    """
    rng = random.Random(case_seed)
    family_index = case_seed % args.families if args.families else None
    family_rng = rng if family_index is None else random.Random(f"family {args.seed} {family_index}")
    family = draw_family(family_rng, args)
    heads = family.pop("heads")
    for _ in range(20):  # lengths of the family's classes that fit under --max-elements at batch 1
        n = draw_in_class(rng, family["n_class"], args.max_len)
        m = draw_in_class(rng, family["m_class"], args.max_len)
        if heads * n * m <= args.max_elements:
            break
    batch = max(1, min(rng.randint(1, 3), args.max_elements // (heads * n * m)))
    case = {"case_seed": case_seed, "family": family_index, "batch": batch, "heads": heads, "n": n, "m": m,
            **family}
    case["key_mask"], case["mask_rows"] = draw_key_mask(rng, batch, m) if case["masked"] else ("", None)
    case["window"] = draw_window(rng, max(n, m)) if case["windowed"] else None
    case["document_ids"], case["id_rows"] = draw_documents(rng, batch, n, m) if case["documents"] else ("", None)
    return case


def draw_window(rng: random.Random, longest: int) -> tuple[int | None, int | None]:
    """``(left, right)``: each bound None (unbounded) or 0 to ``longest``, not both None."""
    while True:
        window = tuple(rng.choice([None, 0, rng.randint(0, longest)]) for _ in range(2))
        if window != (None, None):
            return window


def draw_documents(rng: random.Random, batch: int, n: int, m: int) -> tuple[str, tuple[tuple, tuple]]:
    """Document ids per batch element, 1-5 documents in sorted runs (packed sequences) or scattered: their
    description for the CSV and the rows ``(q_ids, k_ids)``."""
    documents = rng.randint(1, 5)
    scattered = rng.random() < 0.3

    def ids(length):
        row = [rng.randrange(documents) for _ in range(length)]
        return tuple(row if scattered else sorted(row))

    rows = tuple(ids(n) for _ in range(batch)), tuple(ids(m) for _ in range(batch))
    return f"{'scattered' if scattered else 'runs'}:{documents}", rows


def make_key_mask(case: dict, device) -> torch.Tensor | None:
    if case["mask_rows"] is None:
        return None
    mask = torch.tensor(case["mask_rows"], dtype=torch.bool, device=device)
    return mask[0] if case["key_mask"].startswith("(M,)") else mask


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


def structured_masks(case: dict, device) -> dict:
    """The case's ``window`` and ``document_ids`` as flashbob.attention takes them (absent ones left out)."""
    masks = {} if case["window"] is None else {"window": case["window"]}
    if case["id_rows"] is not None:
        masks["document_ids"] = tuple(torch.tensor(ids, device=device) for ids in case["id_rows"])
    return masks


def with_dense_masks(attention):
    """``attention`` (naive, :mod:`flashbob.reference`) taking ``window`` and ``document_ids`` as their dense
    mask."""

    def attend(q, k, v, *, causal, key_mask, **structured):
        if not structured:
            return attention(q, k, v, causal=causal, key_mask=key_mask)
        from flashbob import masks

        dense = masks.dense(q.shape[2], k.shape[2], device=q.device, **structured)
        return attention(q, k, v, causal=causal, key_mask=key_mask, attn_mask=dense)

    return attend


def derivatives(attention, inputs, do, bars, case, key_mask) -> dict[str, torch.Tensor]:
    """``O``, first derivatives of the inputs that require grad, second derivatives of the chosen ones."""
    wrt_names = case["requires_grad"]
    leaves = [x.detach().requires_grad_(name in wrt_names) for name, x in zip("qkv", inputs)]
    o = attention(*leaves, causal=case["causal"], key_mask=key_mask, **structured_masks(case, do.device))
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


def errors(x: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor) -> tuple[float, float, bool]:
    """flashbob's and eager's error against ``exact``, and whether ``x`` is finite (one synchronisation)."""
    exact = exact.double()
    floor = math.sqrt(max(exact.numel(), 1))
    stats = torch.stack([(x.double() - exact).norm(), (eager.double() - exact).norm(), exact.norm(),
                         torch.isfinite(x).all().double()]).tolist()
    scale = max(stats[2], floor)
    return stats[0] / scale, stats[1] / scale, stats[3] == 1.0


def run_case(case: dict, device: str, verbose: bool = False) -> dict:
    from flashbob import attention, reference

    dtype = DTYPES[case["dtype"]]
    generator = torch.Generator(device=device).manual_seed(case["case_seed"])
    q_shape = (case["batch"], case["heads"], case["n"], case["head_dim"])
    kv_shape = (case["batch"], case["kv_heads"], case["m"], case["head_dim"])
    inputs = [make_tensor(s, case["layout"], dtype, device, generator) for s in (q_shape, kv_shape, kv_shape)]
    do = make_tensor(q_shape, case["cotangent_layout"], dtype, device, generator)
    bars = [make_tensor(x.shape, case["cotangent_layout"], dtype, device, generator) for x in inputs]
    key_mask = make_key_mask(case, device)
    ours = derivatives(lambda *a, **kw: attention(*a, backend="triton", **kw), inputs, do, bars, case, key_mask)
    naive = with_dense_masks(reference.attention)
    exact = derivatives(naive, [x.double() for x in inputs], do.double(), [b.double() for b in bars], case, key_mask)
    eager = derivatives(naive, inputs, do, bars, case, key_mask)
    worst = None
    for name, x in ours.items():
        ours_err, eager_err, finite = errors(x, eager[name], exact[name])
        excess = math.inf if not finite else ours_err - (RATIO * eager_err + SLACK[case["dtype"]])
        if verbose:
            print(f"  {name:6s} flashbob {ours_err:.3e}  eager {eager_err:.3e}  finite {finite}  "
                  f"{'ok' if excess <= 0 else 'FAIL'}")
        if worst is None or excess > worst[0]:
            worst = (excess, name, ours_err, eager_err, finite)
    excess, name, ours_err, eager_err, finite = worst
    verdict = "PASS" if excess <= 0 else "FAIL"
    message = "" if finite else "non-finite output"
    return {"worst_output": name, "err_flashbob": f"{ours_err:.3e}", "err_eager": f"{eager_err:.3e}",
            "verdict": verdict, "message": message}


# ----------------------------------------------------------------------------- compile keys

_compiled: list[tuple[str, str]] = []  # (kernel, Triton cache key) of every in-process compilation


def _record_compile(*, key, fn, **_) -> None:
    _compiled.append((fn.name, str(key)))  # returns None: Triton goes on to compile


def install_compile_hook() -> None:
    """Count Triton compilations (in-memory cache misses: a compile, or a load from the disk cache)."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
        knobs.runtime.jit_cache_hook = _record_compile
    else:  # Triton < 3.4
        from triton.runtime.jit import JITFunction

        JITFunction.cache_hook = _record_compile


def guarded_case(case: dict, device: str, verbose: bool = False) -> dict:
    """:func:`run_case`, with out-of-memory and any other exception recorded instead of raised; the
    row also carries the compile keys the case needed."""
    start, compiled_before = time.perf_counter(), len(_compiled)
    try:
        result = run_case(case, device, verbose)
    except torch.cuda.OutOfMemoryError:
        result = {"verdict": "OOM"}
        torch.cuda.empty_cache()
    except Exception as failure:  # noqa: BLE001 -- the sweep goes on; the CSV says what broke
        result = {"verdict": "ERROR", "message": f"{type(failure).__name__}: {failure}"[:300]}
    new_keys = _compiled[compiled_before:]
    masks = case.pop("mask_rows") or ()
    return {**case, **result, "seconds": f"{time.perf_counter() - start:.3f}", "compiles": len(new_keys),
            "compile_keys": new_keys, "elements_without_keys": sum(not any(keep) for keep in masks),
            "elements_with_one_key": sum(sum(keep) == 1 for keep in masks)}


def worker_setup(device: str, threads: int) -> None:
    """Process-pool initialiser: the worker's torch settings and the compile counter."""
    torch.set_num_threads(threads)
    settings()
    if device.startswith("cuda"):
        install_compile_hook()


def worker_case(case_seed: int, args) -> dict:
    return guarded_case(draw_case(case_seed, args), args.device)


def settings() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # eager fp32 at full precision, like the kernels
    torch.set_float32_matmul_precision("highest")


# ----------------------------------------------------------------------------- summary

COVERAGE = {
    **{dtype: lambda r, d=dtype: r["dtype"] == d for dtype in DTYPES},
    "causal": lambda r: r["causal"],
    "GQA (H > Hkv)": lambda r: r["heads"] > r["kv_heads"],
    "N != M": lambda r: r["n"] != r["m"],
    "N or M = 1": lambda r: r["n"] == 1 or r["m"] == 1,
    "N or M > 256": lambda r: max(r["n"], r["m"]) > 256,
    "N and M not multiples of 16": lambda r: r["n"] % 16 != 0 and r["m"] % 16 != 0,
    **{f"{layout} inputs": lambda r, x=layout: r["layout"] == x for layout in LAYOUTS},
    "not all of q, k, v require grad": lambda r: r["requires_grad"] != "qkv",
    "a subset of the first derivatives differentiated": lambda r: r["second"] != r["requires_grad"],
    "key mask": lambda r: r["masked"],
    "key mask and causal": lambda r: r["masked"] and r["causal"],
    "key mask broadcast over the batch": lambda r: r["key_mask"].startswith("("),
    "sliding window": lambda r: r["windowed"],
    "document ids": lambda r: r["documents"],
    "window and documents": lambda r: r["windowed"] and r["documents"],
    "a batch element with no visible key": lambda r: r["elements_without_keys"] > 0,
    "a batch element with one visible key": lambda r: r["elements_with_one_key"] > 0,
}
FAMILY_FIELDS = ("family", *FAMILY, "cases", "pass", "fail", "error", "oom", "n_min", "n_max", "m_min", "m_max",
                 "cases_with_an_element_without_keys", "cases_with_an_element_with_one_key", "worst_ratio",
                 "worst_ratio_seed", "compile_keys", "failing_seeds")
MAX_PRINTED_FAILURES = 200


def class_name(cls: tuple[int, str]) -> str:
    low, high = LENGTH_BUCKETS[cls[0]]
    return f"{low}-{high or 'max'} {cls[1]}"


class Tally:
    """Running totals of the cases (rows are not kept: a GPU run does tens of thousands)."""

    def __init__(self) -> None:
        self.verdicts = collections.Counter()
        self.coverage = collections.Counter()
        self.ratios = collections.defaultdict(list)  # dtype -> flashbob's error / eager's, worst output
        self.warm_seconds, self.compiling_seconds, self.compilations = [], 0.0, 0
        self.keys: set[tuple[str, str]] = set()
        self.families: dict = {}
        self.failures: list[dict] = []

    @property
    def cases(self) -> int:
        return sum(self.verdicts.values())

    def add(self, row: dict) -> None:
        self.verdicts[row["verdict"]] += 1
        for name, check in COVERAGE.items():
            self.coverage[name] += bool(check(row))
        ratio = None
        if row.get("err_flashbob") and float(row["err_eager"]) > 0:
            ratio = float(row["err_flashbob"]) / float(row["err_eager"])
            self.ratios[row["dtype"]].append(ratio)
        if row["compiles"]:
            self.compilations += row["compiles"]
            self.compiling_seconds += float(row["seconds"])
            self.keys.update(row["compile_keys"])
        else:
            self.warm_seconds.append(float(row["seconds"]))
        if row["verdict"] != "PASS":
            self.failures.append({key: row.get(key) for key in FIELDS})
        key = (-1 if row["family"] is None else row["family"], *(str(row[name]) for name in FAMILY))
        family = self.families.get(key)
        if family is None:
            family = self.families[key] = {
                "family": row["family"], **{key: row[key] for key in FAMILY}, "cases": 0, "pass": 0, "fail": 0,
                "error": 0, "oom": 0, "n_min": row["n"], "n_max": row["n"], "m_min": row["m"], "m_max": row["m"],
                "cases_with_an_element_without_keys": 0, "cases_with_an_element_with_one_key": 0,
                "worst_ratio": 0.0, "worst_ratio_seed": "", "keys": set(), "failing_seeds": [],
            }
            family["n_class"], family["m_class"] = class_name(row["n_class"]), class_name(row["m_class"])
        family["cases"] += 1
        family[row["verdict"].lower()] += 1
        for name in ("n", "m"):
            family[f"{name}_min"] = min(family[f"{name}_min"], row[name])
            family[f"{name}_max"] = max(family[f"{name}_max"], row[name])
        family["cases_with_an_element_without_keys"] += row["elements_without_keys"] > 0
        family["cases_with_an_element_with_one_key"] += row["elements_with_one_key"] > 0
        if ratio is not None and ratio > family["worst_ratio"]:
            family["worst_ratio"], family["worst_ratio_seed"] = ratio, row["case_seed"]
        family["keys"].update(row["compile_keys"])
        if row["verdict"] != "PASS":
            family["failing_seeds"].append(row["case_seed"])

    def family_rows(self) -> list[dict]:
        rows = []
        for key in sorted(self.families):
            family = dict(self.families[key])
            family["compile_keys"] = len(family.pop("keys"))
            family["worst_ratio"] = f"{family['worst_ratio']:.2f}"
            family["failing_seeds"] = " ".join(map(str, family["failing_seeds"][:10]))
            rows.append(family)
        return rows


def print_summary(tally: Tally, elapsed: float, args) -> None:
    cases, failures = tally.cases, tally.failures
    print(f"\n{cases} cases in {elapsed:.0f}s ({cases / max(elapsed, 1e-9):.1f} cases/s, {args.workers} "
          f"worker{'s' * (args.workers > 1)}): " + ", ".join(f"{v} {c}" for v, c in sorted(tally.verdicts.items()))
          + f"; failures: {len(failures)}")
    for dtype, ratios in sorted(tally.ratios.items()):
        ratios = sorted(ratios)
        print(f"  {dtype}: worst-output error / eager's: median {ratios[len(ratios) // 2]:.2f}, "
              f"max {ratios[-1]:.2f} over {len(ratios)} cases")
    if args.device.startswith("cuda"):
        print(f"  compile keys: {len(tally.keys)} distinct Triton kernel specialisations "
              f"({len({kernel for kernel, _ in tally.keys})} kernels); {tally.compilations} compilations or "
              f"disk-cache loads over {args.workers} workers, taking {tally.compiling_seconds:.0f}s of the "
              "workers' time (whole cases that compiled)")
    if tally.warm_seconds:
        warm = sorted(tally.warm_seconds)
        print(f"  cases that compiled nothing: {len(warm)}, median {warm[len(warm) // 2] * 1e3:.0f} ms per case "
              "per worker")
    print(f"  {len(tally.families)} families (combinations of {', '.join(FAMILY)})")
    print("  cases with: " + ", ".join(f"{name} {count}" for name, count in tally.coverage.items()))
    for row in failures[:MAX_PRINTED_FAILURES]:
        params = " ".join(f"{key}={row[key]}" for key in PARAMETERS)
        detail = row.get("message") or (
            f"{row.get('worst_output')}: {row.get('err_flashbob')} vs eager {row.get('err_eager')}")
        print(f"  {row['verdict']}: {params}: {detail}")
    if len(failures) > MAX_PRINTED_FAILURES:
        print(f"  ... and {len(failures) - MAX_PRINTED_FAILURES} more (every case is in --cases-out)")
    if failures:
        print("replay one with --case-seed SEED (same --seed, --families, --max-len, --max-elements, --head-dims "
              "and --dtypes)")


# ----------------------------------------------------------------------------- main


def case_seeds(args):
    if args.case_seed is not None:
        yield args.case_seed
        return
    master = random.Random(args.seed)
    for family in range(args.families):  # every family once first: all compilations early, in parallel
        yield master.getrandbits(31) // args.families * args.families + family
    while True:
        yield master.getrandbits(31)


def run_in_process(args, record, out_of_time) -> None:
    settings()
    if args.device.startswith("cuda"):
        install_compile_hook()
    for case_seed in case_seeds(args):
        if out_of_time():
            break
        case = draw_case(case_seed, args)
        if args.case_seed is not None:
            print(" ".join(f"{key}={case[key]}" for key in PARAMETERS))
        record(guarded_case(case, args.device, verbose=args.case_seed is not None))
        if args.case_seed is not None:
            break


def run_in_workers(args, record, out_of_time) -> None:
    """Cases in ``args.workers`` spawned processes (CUDA needs spawn), a few in flight per worker."""
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    context = multiprocessing.get_context("spawn")
    seeds = case_seeds(args)
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context, initializer=worker_setup,
                                                initargs=(args.device, threads)) as pool:
        running = set()
        while True:
            while not out_of_time(len(running)) and len(running) < 2 * args.workers:
                running.add(pool.submit(worker_case, next(seeds), args))
            if not running:
                break
            done, running = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                record(future.result())


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first import of triton (workers inherit it)
    if not args.autotune:
        os.environ["FLASHBOB_AUTOTUNE"] = "0"
    import triton

    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"torch {torch.__version__}, Triton {triton.__version__}, {device}; {args.workers} worker(s), "
          f"{args.families} families, autotuning {'on' if args.autotune else 'off'}", flush=True)
    tally, start = Tally(), time.perf_counter()
    last_progress = start
    with contextlib.ExitStack() as stack:
        writer = None
        if args.cases_out is not None:
            args.cases_out.parent.mkdir(parents=True, exist_ok=True)
            cases_file = stack.enter_context(open(args.cases_out, "w", newline=""))
            writer = csv.DictWriter(cases_file, fieldnames=FIELDS, extrasaction="ignore")
            writer.writeheader()

        def record(row: dict) -> None:
            nonlocal last_progress
            tally.add(row)
            if writer is not None:
                writer.writerow(row)
            now = time.perf_counter()
            if row["verdict"] != "PASS" or now - last_progress >= PROGRESS_SECONDS:
                last_progress = now
                print(f"[{now - start:.0f}s] {tally.cases} cases, {len(tally.failures)} failures, "
                      f"{len(tally.keys)} compile keys"
                      + (f"; seed {row['case_seed']}: {row['verdict']}" if row["verdict"] != "PASS" else ""),
                      flush=True)

        def out_of_time(in_flight: int = 0) -> bool:
            over = time.perf_counter() - start >= args.seconds
            return over or (args.cases is not None and tally.cases + in_flight >= args.cases)

        if args.workers == 1:
            run_in_process(args, record, out_of_time)
        else:
            run_in_workers(args, record, out_of_time)
    print_summary(tally, time.perf_counter() - start, args)
    write_rows(args.out, tally.family_rows(), FAMILY_FIELDS)
    print(f"wrote {len(tally.families)} family rows to {args.out}"
          + (f" and {tally.cases} case rows to {args.cases_out}" if args.cases_out is not None else ""))


if __name__ == "__main__":
    main()
