"""The trace and the eigenvalue of largest magnitude of a curvature matrix, from its products."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from optim._autodiff import unflatten
from optim.diagonal import Distribution, hutchinson_diagonal
from optim.hyperparameters import check_count
from optim.operators import OperatorLike, as_operator


def trace(
    operator: OperatorLike,
    num_samples: int = 1,
    distribution: Distribution = "rademacher",
    generator: torch.Generator | None = None,
) -> float:
    r"""Hutchinson's estimate of the trace of a curvature matrix :math:`A`.

    .. math:: \widehat{\operatorname{tr}}(A) = \frac{1}{S} \sum_{s=1}^{S} z_s^\top A z_s,
              \qquad \mathbb{E}\big[\widehat{\operatorname{tr}}(A)\big] = \operatorname{tr}(A),

    the sum of :func:`hutchinson_diagonal` over all entries; arguments are as there.
    """
    diagonal = hutchinson_diagonal(operator, num_samples, distribution, generator)
    return float(sum(d.sum() for d in diagonal))


def power_iteration(
    operator: OperatorLike,
    *,
    max_iter: int = 100,
    tol: float = 1e-3,
    generator: torch.Generator | None = None,
) -> tuple[float, tuple[Tensor, ...]]:
    r"""The eigenvalue of largest magnitude of a curvature matrix :math:`A`, and its eigenvector.

    From a random unit :math:`v_0`, iterates :math:`v_{k+1} = A v_k / \lVert A v_k \rVert` and
    returns the Rayleigh quotient :math:`\lambda = v_k^\top A v_k` with :math:`v_k` once the residual
    satisfies :math:`\lVert A v_k - \lambda v_k \rVert \le \text{tol}\, |\lambda|`, or after
    ``max_iter`` products, with a ``RuntimeWarning`` that gives the residual: then :math:`\lambda` need not
    be an eigenvalue (it does not converge when :math:`|\lambda_2| = |\lambda_1|`, e.g. a saddle with
    eigenvalues :math:`\pm\lambda`). Convergence is geometric in :math:`|\lambda_2 / \lambda_1|`.

    Args:
        operator: A :class:`~optim.operators.CurvatureOperator`, or a ``(loss, params)`` pair for its Hessian.
        max_iter: Maximum number of matrix-vector products (at least 1).
        tol: Relative residual at which to stop.
        generator: Source of :math:`v_0` (on the parameters' device); the global one if ``None``.

    Returns:
        :math:`\lambda` and :math:`v` (unit norm over all parameters, one tensor per parameter).

    Raises:
        ValueError: ``max_iter`` is not a positive integer.
    """
    check_count("power_iteration: max_iter", max_iter, "products")
    op = as_operator(operator)
    v = torch.randn(op.shape[0], generator=generator, device=op.device, dtype=op.dtype)
    v = v / torch.linalg.vector_norm(v)
    for step in range(max_iter):
        w = op @ v
        eigenvalue = torch.dot(v, w)
        residual = torch.linalg.vector_norm(w - eigenvalue * v)
        if residual <= tol * eigenvalue.abs():
            break
        if step == max_iter - 1:
            warnings.warn(
                f"power_iteration did not converge in {max_iter} products: relative residual "
                f"{float(residual / eigenvalue.abs()):.3g} > tol {tol}, so {float(eigenvalue):.6g} need not be an "
                "eigenvalue (the two largest eigenvalues may have equal magnitude); raise max_iter or check A",
                RuntimeWarning, stacklevel=2,
            )  # fmt: skip
            break
        v = w / torch.linalg.vector_norm(w)
    return float(eigenvalue), unflatten(v, op.params)
