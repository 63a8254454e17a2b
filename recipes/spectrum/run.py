r"""The spectrum recipe: for each checkpoint of an LM-recipe run, each context length and each of the Hessian and
the Gauss-Newton matrix of the mean next-token loss on fixed validation windows,

- the top ``k`` eigenvalues (:func:`optim.eigenpairs`: scipy's ``eigsh``, ARPACK),
- the trace (:func:`optim.hutchpp_trace`: curvlinops' Hutch++) and :math:`\operatorname{tr}(A^2)/n`,
- the eigenvalue density (:func:`optim.spectral_density`: curvlinops' stochastic Lanczos quadrature),

and, with ``--sharpness``, Adam's preconditioned sharpness at the run's own context length
(:mod:`recipes.spectrum.sharpness`). The products run through the model's attention for curvature (flashbob, or
``--attention eager`` for materialised attention).

Outputs in ``--out`` (default ``<run folder>/spectrum``):

- ``spectrum.csv``: a row per (step, length, curvature): loss, ``eigenvalue_1..k``, ``trace_hutchpp``,
  ``trace_slq``, ``second_moment_slq``, and for each stage (``eigen``, ``trace``, ``density``) its products,
  seconds and seconds inside the products;
- ``density.csv``: the density curves (step, length, curvature, eigenvalue, density);
- ``sharpness.csv`` (``--sharpness``): step, lr, beta1, top eigenvalue, preconditioned sharpness, threshold;
- ``density_hessian.png``, ``density_ggn.png``, ``spectrum.png`` and ``sharpness.png``.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch
from tqdm import tqdm

from recipes.spectrum import checkpoints, measure, plots, sharpness

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def run(args: argparse.Namespace) -> dict[str, Path]:
    """Compute and write everything the module docstring lists; returns the files written, by label.

    Raises:
        ValueError: a setting out of range, or a checkpoint that does not fit (message naming it).
        FileNotFoundError: a checkpoint or run folder that does not exist.
    """
    _check(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = checkpoints.find(args.checkpoint, args.run)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    out = Path(args.out) if args.out else paths[0].parent.parent / "spectrum"
    out.mkdir(parents=True, exist_ok=True)
    settings = measure.Settings(k=args.k, which=args.which, tol=args.tol, ncv=args.ncv, repeats=args.repeats,
                                points=args.points, trace_products=args.trace_products)
    rows, density_rows, sharpness_rows = [], [], []
    for path in tqdm(paths, desc="checkpoints", disable=args.quiet):
        ckpt = checkpoints.load(path)
        model = checkpoints.model(ckpt, device, DTYPES[args.dtype], args.attention)
        lengths = args.lengths or [ckpt.cfg.data.context_length]
        for length in tqdm(lengths, desc=f"step {ckpt.step}", leave=False, disable=args.quiet):
            batches = checkpoints.validation_batches(ckpt.cfg, length, args.batch_size, args.batches)
            for kind in args.curvature:
                row, curve = _measure(model, batches, kind, settings, args, device, f"{kind} at {length:,}")
                key = {"step": ckpt.step, "length": length, "curvature": kind, "mode": args.mode}
                rows.append({**key, **row})
                density_rows += [{**key, "eigenvalue": float(x), "density": float(y)}
                                 for x, y in zip(curve.grid, curve.density)]
        if args.sharpness:
            sharpness_rows.append({"step": ckpt.step, **_sharpness(ckpt, model, args, device)})
    outputs = {"spectrum": out / "spectrum.csv", "density": out / "density.csv"}
    _write(outputs["spectrum"], rows)
    _write(outputs["density"], density_rows)
    for kind in args.curvature:
        outputs[f"density plot ({kind})"] = out / f"density_{kind}.png"
        plots.densities(density_rows, kind, outputs[f"density plot ({kind})"])
    outputs["plot"] = out / "spectrum.png"
    plots.summary(rows, outputs["plot"])
    if sharpness_rows:
        outputs["sharpness"], outputs["sharpness plot"] = out / "sharpness.csv", out / "sharpness.png"
        _write(outputs["sharpness"], sharpness_rows)
        plots.sharpness(sharpness_rows, outputs["sharpness plot"])
    return outputs


def _measure(model, batches, kind, settings, args, device, label):
    with tqdm(desc=label, unit="product", leave=False, disable=args.quiet) as bar:
        operator, loss = measure.curvature(model, batches, kind, args.mode)
        counted = measure.CountedOperator(operator, bar)
        generator = torch.Generator(device).manual_seed(args.seed)
        row, curve = measure.measure(counted, kind, settings, generator)
    return {"loss": loss, **row}, curve


def _sharpness(ckpt, model, args, device) -> dict[str, float]:
    """Adam's preconditioned sharpness on the validation windows at the run's context length."""
    batches = checkpoints.validation_batches(ckpt.cfg, ckpt.cfg.data.context_length, args.batch_size, args.batches)
    with tqdm(desc="preconditioned sharpness", unit="product", leave=False, disable=args.quiet) as bar:
        operator, _ = measure.curvature(model, batches, "hessian", args.mode)
        counted = measure.CountedOperator(operator, bar)
        generator = torch.Generator(device).manual_seed(args.seed)
        result = sharpness.preconditioned_sharpness(counted, checkpoints.adamw(ckpt, model), tol=args.tol,
                                                    generator=generator)
    return {"length": ckpt.cfg.data.context_length, **result}


def _write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _check(args: argparse.Namespace) -> None:
    """Settings the tools would reject later, rejected now with the option's name."""
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0 (0: PyTorch's default), got {args.threads}")
    counts = {"--k": args.k, "--ncv": args.ncv, "--repeats": args.repeats, "--points": args.points,
              "--batch-size": args.batch_size, "--batches": args.batches, "--trace-products": args.trace_products}
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if args.trace_products % 3:
        raise ValueError(f"--trace-products must be a multiple of 3 (Hutch++), got {args.trace_products}")
    if args.ncv < 2 or args.points < 2:
        raise ValueError(f"--ncv and --points must be at least 2, got {args.ncv} and {args.points}")
    if not args.tol >= 0:
        raise ValueError(f"--tol must be >= 0, got {args.tol}")
    if args.lengths and min(args.lengths) < 1:
        raise ValueError(f"--lengths must be positive numbers of tokens, got {args.lengths}")
