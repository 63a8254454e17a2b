"""Command line of the spectrum recipe: Hessian and Gauss-Newton spectra of LM-recipe checkpoints.

    python -m recipes.spectrum --checkpoint runs/tiny/checkpoints/step_00000200.pt --lengths 256 1024
    python -m recipes.spectrum --run runs/gpu_32k --lengths 2048 8192 32768 --k 10 --sharpness

See :mod:`recipes.spectrum.run` for what it computes and writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recipes.spectrum.measure import CURVATURES
from recipes.spectrum.run import run


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipes.spectrum", description=(
        "Top eigenvalues, trace and density of the Hessian and the Gauss-Newton matrix of an LM-recipe model's "
        "validation loss, at several context lengths and training steps; CSV and PNG outputs."))
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", nargs="+", metavar="PATH", help="checkpoint files (step_*.pt) of recipes.lm")
    source.add_argument("--run", metavar="DIR", help="a run folder of recipes.lm: every checkpoint in it")
    p.add_argument("--lengths", nargs="+", type=int, metavar="N",
                   help="context lengths in tokens (default: the run's data.context_length)")
    p.add_argument("--batch-size", type=int, default=1, help="validation windows per batch (default 1)")
    p.add_argument("--batches", type=int, default=1, help="validation batches whose mean loss is taken (default 1)")
    p.add_argument("--curvature", nargs="+", choices=CURVATURES, default=list(CURVATURES),
                   help="which matrices (default both)")
    p.add_argument("--mode", choices=("reverse", "forward"), default="reverse", help="products' mode (default reverse)")
    p.add_argument("--k", type=int, default=10, help="top eigenvalues (default 10)")
    p.add_argument("--which", choices=("LA", "LM"), default="LA",
                   help="LA: largest algebraic (default), LM: largest magnitude")
    p.add_argument("--tol", type=float, default=1e-3, help="relative residual of the eigenpairs (default 1e-3)")
    p.add_argument("--ncv", type=int, default=64, help="Lanczos steps per density run (default 64)")
    p.add_argument("--repeats", type=int, default=4, help="Lanczos runs averaged in the density (default 4)")
    p.add_argument("--points", type=int, default=512, help="grid points of the density (default 512)")
    p.add_argument("--trace-products", type=int, default=30, help="Hutch++ products, a multiple of 3 (default 30)")
    p.add_argument("--sharpness", action="store_true",
                   help="also Adam's preconditioned sharpness at the run's context length (AdamW runs)")
    p.add_argument("--attention", help="replace the model's attention, e.g. eager (materialised), for comparison")
    p.add_argument("--device", default="auto", help="auto (cuda if there is one), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="of the model (default float32)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads of torch's products; 0: PyTorch's default (one per core); 1 on a busy machine")
    p.add_argument("--seed", type=int, default=0, help="of the random vectors (the same for every measurement)")
    p.add_argument("--out", help="output folder (default: <run folder>/spectrum)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> dict[str, Path]:
    p = parser()
    args = p.parse_args(argv)
    try:
        outputs = run(args)
    except (ValueError, FileNotFoundError) as error:
        p.error(str(error))
    print("\n".join(f"{label}: {path}" for label, path in outputs.items()), file=sys.stderr)
    return outputs


if __name__ == "__main__":
    main()
