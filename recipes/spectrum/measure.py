r"""One measurement of the spectrum recipe: the Hessian or Gauss-Newton matrix of the mean next-token loss on a
few validation batches, as an operator, and its top eigenvalues (:func:`optim.eigenpairs`), trace
(:func:`optim.hutchpp_trace`) and density (:func:`optim.spectral_density`), with the products each took and
their time."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm import tqdm

import optim
from optim import CurvatureOperator, SpectralDensity
from recipes.lm.model import GPT, cross_entropy
from recipes.spectrum.checkpoints import Batch

CURVATURES = ("hessian", "ggn")


@dataclass(frozen=True)
class Settings:
    """What to compute: ``k`` eigenvalues (``which`` end, to ``tol``), a density of ``repeats`` Lanczos runs of
    ``ncv`` steps on ``points`` grid points, a Hutch++ trace of ``trace_products`` products."""

    k: int = 10
    which: str = "LA"
    tol: float = 1e-3
    ncv: int = 64
    repeats: int = 4
    points: int = 512
    trace_products: int = 30


class MeanOperator(CurvatureOperator):
    r""":math:`\frac1M \sum_m A_m`: the curvature of the mean loss over :math:`M` batches of equal size, one product
    of each per product (each holds its own graph in reverse mode)."""

    def __init__(self, operators: Sequence[CurvatureOperator]) -> None:
        super().__init__(operators[0].params)
        self.operators = tuple(operators)

    def matvec(self, vec):
        total = None
        for op in self.operators:
            product = op.matvec(vec)
            total = list(product) if total is None else [t.add_(p) for t, p in zip(total, product)]
        return tuple(t / len(self.operators) for t in total)


class CountedOperator(CurvatureOperator):
    """An operator that counts its products and their time (the device synchronised after each), and advances a
    progress bar by one per product."""

    def __init__(self, operator: CurvatureOperator, bar: tqdm | None = None) -> None:
        super().__init__(operator.params)
        self.operator, self.bar = operator, bar
        self.products, self.seconds = 0, 0.0

    def matvec(self, vec):
        start = time.perf_counter()
        product = self.operator.matvec(vec)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - start
        self.products += 1
        if self.bar is not None:
            self.bar.update(1)
        return product

    def reset(self) -> tuple[int, float]:
        """The products and seconds so far, then zero."""
        counts, (self.products, self.seconds) = (self.products, self.seconds), (0, 0.0)
        return counts


def curvature(model: GPT, batches: Sequence[Batch], kind: str, mode: str) -> tuple[CurvatureOperator, float]:
    r"""The ``kind`` (``hessian`` or ``ggn``) of the mean cross-entropy over ``batches`` w.r.t. every parameter
    of ``model``, in ``mode``, with the attention the model uses for curvature; and the mean loss.

    The Gauss-Newton matrix is :math:`J^\top H_L J`, :math:`J` the Jacobian of the logits and :math:`H_L` the
    cross-entropy's Hessian w.r.t. them.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    parts = [_operator(model, params, inputs.to(device), targets.to(device), kind, mode) for inputs, targets in batches]
    operators, losses = zip(*parts)
    return (operators[0] if len(operators) == 1 else MeanOperator(operators)), sum(losses) / len(losses)


def _operator(model: GPT, params: list[Tensor], inputs: Tensor, targets: Tensor, kind: str,
              mode: str) -> tuple[CurvatureOperator, float]:
    """One batch's operator and loss."""

    def logits() -> Tensor:
        with model.attention.for_curvature():
            return model(inputs)

    if kind == "hessian":
        if mode == "forward":
            loss = optim.functional(model, lambda: cross_entropy(logits(), targets), params)
            with torch.no_grad():
                return optim.HessianOperator(loss, params, mode="forward"), float(loss(params))
        op = optim.HessianOperator(cross_entropy(logits(), targets), params)
        return op, float(op.value)
    outputs = optim.functional(model, logits, params) if mode == "forward" else None
    evaluated = logits()
    loss_hessian = optim.CrossEntropyHessian(targets)
    if mode == "forward":
        op = optim.GGNOperator(outputs, params, loss_hessian, mode="forward", evaluated=evaluated)
    else:
        op = optim.GGNOperator(evaluated, params, loss_hessian)
    return op, float(cross_entropy(evaluated.detach(), targets))


def measure(operator: CountedOperator, kind: str, settings: Settings,
            generator: torch.Generator) -> tuple[dict[str, float], SpectralDensity]:
    """The top eigenvalues, the Hutch++ and SLQ traces, :math:`\\operatorname{tr}(A^2)/n`, and the products and
    seconds of each computation (``*_product_seconds``: the time inside the products), and the density."""
    n = operator.shape[0]
    row: dict[str, float] = {"parameters": n}
    start = time.perf_counter()
    top = optim.eigenpairs(operator, settings.k, which=settings.which, tol=settings.tol, generator=generator)
    row.update(_costs("eigen", operator, start))
    row.update({f"eigenvalue_{i + 1}": float(value) for i, value in enumerate(top.values)})
    start = time.perf_counter()
    row["trace_hutchpp"] = optim.hutchpp_trace(operator, settings.trace_products, generator=generator)
    row.update(_costs("trace", operator, start))
    low = 0.0 if kind == "ggn" else None  # a Gauss-Newton matrix is positive semi-definite
    high = float(top.values[0]) if settings.which == "LA" else None
    start = time.perf_counter()
    density = optim.spectral_density(operator, settings.ncv, num_repeats=settings.repeats,
                                     num_points=settings.points, boundaries=(low, high), generator=generator)
    row.update(_costs("density", operator, start))
    row.update({"trace_slq": n * density.moment(1), "second_moment_slq": density.moment(2),
                "lambda_min_estimate": density.boundaries[0], "lambda_max_estimate": density.boundaries[1]})
    return row, density


def _costs(stage: str, operator: CountedOperator, start: float) -> dict[str, float]:
    products, seconds = operator.reset()
    return {f"{stage}_products": products, f"{stage}_seconds": time.perf_counter() - start,
            f"{stage}_product_seconds": seconds}
