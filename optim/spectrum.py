r"""The spectrum of a curvature matrix :math:`A` (:math:`n \times n`, symmetric), from its products alone.

- :func:`eigenpairs`: the :math:`k` extreme eigenvalues and their eigenvectors, by scipy's ``eigsh`` (ARPACK's
  implicitly restarted Lanczos) on the operator's ``to_scipy()``; :func:`power_iteration`: the one of largest
  magnitude, on the operator's device.
- :func:`spectral_density`: the eigenvalue density by stochastic Lanczos quadrature (curvlinops, Papyan 2020).
- :func:`trace` (Hutchinson) and :func:`hutchpp_trace` (Hutch++, curvlinops).

curvlinops is an optional dependency: the two functions that use it import it when called. They take optim's
operators as they are: curvlinops reads ``shape``, ``dtype``, ``device``, ``A @ x`` on flat vectors and
matrices, and ``to_scipy()``, which every :class:`~optim.operators.CurvatureOperator` has.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from optim._autodiff import unflatten
from optim._curvlinops import curvlinops, drawing_from
from optim.diagonal import Distribution, hutchinson_diagonal
from optim.hyperparameters import check_count
from optim.operators import OperatorLike, as_operator

Which = Literal["LA", "SA", "LM"]
WHICH = {"LA": "largest algebraic", "SA": "smallest algebraic", "LM": "largest magnitude"}


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


class Eigenpairs(NamedTuple):
    r"""Eigenvalues :math:`\lambda_1, \dots, \lambda_k` of a curvature matrix :math:`A` and orthonormal
    eigenvectors :math:`V = [v_1 \cdots v_k]`, :math:`A v_i = \lambda_i v_i`.

    Attributes:
        values: ``(k,)``, float64 on the CPU.
        vectors: ``(n, k)`` on the operator's device, in its dtype; column ``i`` is :math:`v_i`, flat over the
            parameters (concatenated in order, each flattened row-major: ``operator @ vectors`` takes it as it is).
    """

    values: Tensor
    vectors: Tensor


def eigenpairs(
    operator: OperatorLike,
    k: int = 1,
    *,
    which: Which = "LA",
    tol: float = 0.0,
    ncv: int | None = None,
    max_iter: int | None = None,
    generator: torch.Generator | None = None,
) -> Eigenpairs:
    r"""The :math:`k` extreme eigenvalues of a curvature matrix :math:`A` and their eigenvectors.

    ``scipy.sparse.linalg.eigsh`` (ARPACK's implicitly restarted Lanczos method) on ``operator.to_scipy()``: it
    keeps a Krylov basis of ``ncv`` vectors of length :math:`n` in float64 on the host, extends it by one product
    :math:`A v` at a time and restarts it, filtered towards the wanted end of the spectrum, until every wanted Ritz
    pair :math:`(\lambda, v)` satisfies :math:`\lVert A v - \lambda v \rVert \le \text{tol}\, |\lambda|`.

    ``which``: ``"LA"`` the largest eigenvalues (:math:`\lambda_1 \ge \dots \ge \lambda_k`: the sharpness and the
    outliers of a Hessian), ``"SA"`` the smallest (ascending: the most negative curvature), ``"LM"`` those of
    largest magnitude (descending :math:`|\lambda|`). The products are as precise as the operator's dtype: with a
    float32 model, ``tol`` of about 1e-4 or more (0, machine precision in float64, would not be reached).

    Args:
        operator: A :class:`~optim.operators.CurvatureOperator`, or a ``(loss, params)`` pair for its Hessian.
        k: How many eigenpairs, ``1 <= k < n``.
        which: ``"LA"``, ``"SA"`` or ``"LM"`` (above).
        tol: Relative residual at which a pair has converged, >= 0; 0: machine precision.
        ncv: Lanczos vectors ARPACK keeps, ``k < ncv <= n``; ``None``: scipy's ``min(n, max(2k + 1, 20))``.
        max_iter: Restarts allowed (scipy's ``maxiter``); ``None``: scipy's ``10 n``.
        generator: Source of the starting vector (on the parameters' device); the global one if ``None``.

    Returns:
        :class:`Eigenpairs`, in the order above.

    Raises:
        ValueError: ``k``, ``which``, ``tol``, ``ncv`` or ``max_iter`` is out of range; the message names it.
        RuntimeError: ARPACK did not converge within ``max_iter`` restarts.
    """
    from scipy.sparse.linalg import ArpackNoConvergence, eigsh

    op = as_operator(operator)
    n = op.shape[0]
    check_count("eigenpairs: k", k, "eigenpairs")
    if k >= n:
        raise ValueError(f"eigenpairs: k must be less than the operator's size n = {n} (ARPACK), got {k}")
    if which not in WHICH:
        raise ValueError(f"eigenpairs: which must be one of {', '.join(map(repr, WHICH))}, got {which!r}")
    _check_number("eigenpairs: tol", tol, minimum=0.0)
    if ncv is not None:
        check_count("eigenpairs: ncv", ncv, "Lanczos vectors")
        if not k < ncv <= n:
            raise ValueError(f"eigenpairs: ncv must satisfy k < ncv <= n ({k} < ncv <= {n}), got {ncv}")
    if max_iter is not None:
        check_count("eigenpairs: max_iter", max_iter, "restarts")
    v0 = torch.randn(n, generator=generator, device=op.device, dtype=op.dtype).to("cpu", torch.float64).numpy()
    try:
        values, vectors = eigsh(op.to_scipy(), k=k, which=which, tol=tol, ncv=ncv, maxiter=max_iter, v0=v0)
    except ArpackNoConvergence as error:
        raise RuntimeError(
            f"eigenpairs: ARPACK found {len(error.eigenvalues)} of the {k} {WHICH[which]} eigenpairs to tol={tol} "
            f"within max_iter={max_iter} restarts; raise max_iter, ncv or tol"
        ) from error
    values = torch.from_numpy(values)
    order = {"LA": -values, "SA": values, "LM": -values.abs()}[which].argsort(stable=True)
    vectors = torch.from_numpy(vectors)[:, order].to(op.device, op.dtype)
    return Eigenpairs(values[order], vectors)


@dataclass(frozen=True)
class SpectralDensity:
    r"""The eigenvalue density :math:`\phi(\lambda) = \frac1n \sum_{i=1}^n \delta(\lambda - \lambda_i)` of a
    curvature matrix :math:`A`, by stochastic Lanczos quadrature (:func:`spectral_density`).

    Each of :math:`R` runs starts Lanczos from a random unit vector :math:`v` and, after :math:`m` products,
    eigendecomposes its tridiagonal matrix :math:`T_m = \sum_j \theta_j u_j u_j^\top`: the Ritz values
    :math:`\theta_j` are the quadrature's nodes and :math:`\tau_j = (e_1^\top u_j)^2` its weights
    (:math:`\sum_j \tau_j = 1`), so that for any function :math:`f`

    .. math:: v^\top f(A)\, v \approx \sum_{j=1}^m \tau_j f(\theta_j)
              \quad \text{(exact for polynomials of degree} < 2m\text{)}, \qquad
              \mathbb{E}_v\big[v^\top f(A)\, v\big] = \tfrac1n \operatorname{tr} f(A) = \int f\, \phi.

    Attributes:
        grid: ``(num_points,)`` eigenvalues :math:`\lambda` at which the curve is given.
        density: ``(num_points,)`` the curve: the nodes of every run, each a Gaussian of weight :math:`\tau_j`,
            averaged over the runs (it integrates to 1; the Gaussians widen every moment above the first).
        nodes: ``(R, m)`` the Ritz values :math:`\theta_j` of each run.
        weights: ``(R, m)`` their weights :math:`\tau_j`.
        boundaries: The estimates of :math:`\lambda_{\min}, \lambda_{\max}` the grid spans (with a margin).
        dimension: :math:`n`.
    """

    grid: Tensor
    density: Tensor
    nodes: Tensor
    weights: Tensor
    boundaries: tuple[float, float]
    dimension: int

    def expectation(self, f: Callable[[Tensor], Tensor]) -> float:
        r"""The quadrature's estimate of :math:`\frac1n \operatorname{tr} f(A) = \int f\,\phi`:
        :math:`\frac1R \sum_r \sum_j \tau_{rj} f(\theta_{rj})`, for ``f`` applied elementwise to a tensor."""
        return float((self.weights * f(self.nodes)).sum(dim=1).mean())

    def moment(self, power: int) -> float:
        r"""The estimate of :math:`\frac1n \operatorname{tr}(A^p) = \frac1n \sum_i \lambda_i^p` for ``power``
        :math:`p \ge 0`; :math:`n` times the first is an estimate of the trace."""
        if isinstance(power, bool) or not isinstance(power, numbers.Integral) or power < 0:
            raise ValueError(f"SpectralDensity.moment: power must be an integer >= 0, got {power!r}")
        return self.expectation(lambda x: x**power)


def spectral_density(
    operator: OperatorLike,
    ncv: int = 64,
    *,
    num_repeats: int = 1,
    num_points: int = 1024,
    kappa: float = 3.0,
    margin: float = 0.05,
    boundaries: tuple[float | None, float | None] | None = None,
    boundaries_tol: float = 1e-2,
    generator: torch.Generator | None = None,
) -> SpectralDensity:
    r"""The eigenvalue density of a curvature matrix :math:`A` by stochastic Lanczos quadrature (SLQ).

    curvlinops' implementation of Papyan (2020), "Traces of class/cross-class structure pervade deep learning
    spectra", algorithm 2: ``num_repeats`` runs of ``ncv`` Lanczos steps (``ncv`` products each, without
    reorthogonalisation, as in the paper), each from a random unit vector; the Ritz values of each run, as
    Gaussians whose width is :math:`2 / ((\text{ncv} - 1)\sqrt{8 \ln \kappa})` of the spectrum's span, on a grid
    over :math:`[\lambda_{\min}, \lambda_{\max}]` widened by ``margin`` of it each side (the :class:`SpectralDensity`
    gives the quadrature too). The boundaries are ARPACK's estimates to ``boundaries_tol`` unless given (a
    ``None`` in the pair: that one is estimated), e.g. ``(0.0, None)`` for a Gauss-Newton matrix, which is
    positive semi-definite, or the :math:`\lambda_{\max}` that :func:`eigenpairs` found.

    This calls curvlinops' ``fast_lanczos`` and ``lanczos_approximate_spectrum_from_iter`` (the steps of its
    ``lanczos_approximate_spectrum``) rather than that function, which returns the curve alone: the Ritz values
    and weights are what the moments, the trace and any :math:`\frac1n\operatorname{tr} f(A)` are read from
    (:meth:`SpectralDensity.expectation`), without running Lanczos again.

    The error of the quadrature's moments is the sampling error of :math:`v`: for :math:`v` uniform on the unit
    sphere, :math:`\operatorname{Var}(v^\top A^p v) = \frac{2}{n + 2}\operatorname{Var}_i(\lambda_i^p)`, divided
    by ``num_repeats``; Lanczos' own error is nil for :math:`p < 2\,\text{ncv}` in exact arithmetic.

    Args:
        operator: A :class:`~optim.operators.CurvatureOperator`, or a ``(loss, params)`` pair for its Hessian.
        ncv: Lanczos steps per run (nodes of the quadrature), ``2 <= ncv <= n``; more resolve the bulk better.
        num_repeats: Runs averaged, >= 1.
        num_points: Points of the grid, >= 2.
        kappa: Width parameter of the Gaussians, > 1 (Papyan's 3).
        margin: Share of the span added to each side of the grid, >= 0.
        boundaries: Known :math:`(\lambda_{\min}, \lambda_{\max})`, either ``None``; ``None``: both estimated.
        boundaries_tol: Relative accuracy of the estimated boundaries (ARPACK's ``tol``), >= 0.
        generator: Source of the random start vectors (curvlinops draws from the global generator: with a
            generator the runs draw from a fork of it seeded from this one); the global one if ``None``.

    Returns:
        :class:`SpectralDensity`.

    Raises:
        ValueError: an argument out of range; the message names it.
        ImportError: curvlinops is not installed (the message says how to install it).
        RuntimeError: Lanczos broke down (a non-finite Ritz value: :math:`A` has fewer than ``ncv`` distinct
            eigenvalues along the start vector, e.g. a Gauss-Newton matrix of rank below ``ncv``); lower ``ncv``.
    """
    lanczos = curvlinops("curvlinops.papyan2020traces.spectrum", "spectral_density")
    op = as_operator(operator)
    n = op.shape[0]
    check_count("spectral_density: ncv", ncv, "Lanczos steps")
    if not 2 <= ncv <= n:
        raise ValueError(f"spectral_density: ncv must be in [2, n = {n}] (Lanczos steps), got {ncv}")
    check_count("spectral_density: num_repeats", num_repeats, "Lanczos runs")
    check_count("spectral_density: num_points", num_points, "grid points")
    if num_points < 2:
        raise ValueError(f"spectral_density: num_points must be at least 2 (grid points), got {num_points}")
    _check_number("spectral_density: kappa", kappa, minimum=1.0, open_=True)
    _check_number("spectral_density: margin", margin, minimum=0.0)
    _check_number("spectral_density: boundaries_tol", boundaries_tol, minimum=0.0)
    _check_boundaries(boundaries)
    breakdown = (f"spectral_density: Lanczos broke down (a zero residual, then non-finite values): the operator has "
                 f"fewer than ncv={ncv} distinct eigenvalues along the start vector (a matrix of low rank?); lower ncv")
    with drawing_from(generator, op.device):
        low, high = lanczos.approximate_boundaries(op, tol=boundaries_tol, boundaries=boundaries)
        try:
            runs = [lanczos.fast_lanczos(op, ncv) for _ in range(num_repeats)]
        except torch.linalg.LinAlgError as error:  # eigh of a tridiagonal matrix holding NaN
            raise RuntimeError(breakdown) from error
    nodes = torch.stack([values for values, _ in runs]).cpu().double()
    weights = torch.stack([vectors[0] ** 2 for _, vectors in runs]).cpu().double()
    if not torch.isfinite(nodes).all():
        raise RuntimeError(breakdown)
    low, high = float(low), float(high)
    curves = [lanczos.lanczos_approximate_spectrum_from_iter(run, (low, high), num_points, kappa, margin)
              for run in runs]
    grid = curves[0][0].cpu().double()
    density = torch.stack([curve for _, curve in curves]).mean(dim=0).cpu().double()
    return SpectralDensity(grid, density, nodes, weights, (low, high), n)


def hutchpp_trace(operator: OperatorLike, num_products: int = 30, distribution: Distribution = "rademacher",
                  generator: torch.Generator | None = None) -> float:
    r"""The Hutch++ estimate of the trace of a curvature matrix :math:`A` (Meyer, Musco, Musco and Woodruff, 2021),
    by curvlinops' ``hutchpp_trace``.

    With :math:`N = \text{num\_products} / 3` random probes in :math:`S` and :math:`G` each, :math:`Q` an orthonormal
    basis of :math:`AS` and :math:`P = I - QQ^\top`,

    .. math:: \widehat{\operatorname{tr}}(A) = \operatorname{tr}(Q^\top A Q)
              + \frac1N \operatorname{tr}(G^\top P A P G),

    the trace on the span of :math:`AS` exactly plus Hutchinson's estimate on the rest. It is unbiased; the
    variance of the second term is at most :math:`\frac2N \lVert PAP \rVert_F^2`, small where a few eigenvalues
    dominate (the outliers of a Hessian), and nil when :math:`A` has rank :math:`\le N`. Costs ``num_products``
    products and holds :math:`2N` vectors of length :math:`n`.

    Args:
        operator: A :class:`~optim.operators.CurvatureOperator`, or a ``(loss, params)`` pair for its Hessian.
        num_products: Products :math:`3N`: a positive multiple of 3, less than :math:`n`.
        distribution: Entries of the probes: ``"rademacher"`` or ``"gaussian"``.
        generator: Source of the probes (curvlinops draws from the global generator: with a generator the probes
            come from a fork of it seeded from this one); the global one if ``None``.

    Raises:
        ValueError: ``num_products`` or ``distribution`` is out of range; the message names it.
        ImportError: curvlinops is not installed (the message says how to install it).
    """
    module = curvlinops("curvlinops", "hutchpp_trace")
    op = as_operator(operator)
    check_count("hutchpp_trace: num_products", num_products, "products")
    if num_products % 3 or num_products >= op.shape[0]:
        raise ValueError(f"hutchpp_trace: num_products must be a multiple of 3 less than n = {op.shape[0]} (below "
                         f"n the exact trace costs no more), got {num_products}")
    names = {"rademacher": "rademacher", "gaussian": "normal"}
    if distribution not in names:
        raise ValueError(f"hutchpp_trace: distribution must be 'rademacher' or 'gaussian', got {distribution!r}")
    with drawing_from(generator, op.device):
        return float(module.hutchpp_trace(op, num_products, names[distribution]))


def _check_number(name: str, value: object, *, minimum: float, open_: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite real number >= ``minimum`` (> with ``open_``)."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not real or value < minimum or (open_ and value == minimum):
        raise ValueError(f"{name} must be a finite number {'>' if open_ else '>='} {minimum:g}, got {value!r}")


def _check_boundaries(boundaries: object) -> None:
    """``None``, or a pair of finite numbers or ``None``, the first less than the second."""
    pair = isinstance(boundaries, (tuple, list)) and len(boundaries) == 2
    if boundaries is not None and not (pair and all(
        b is None or (isinstance(b, numbers.Real) and not isinstance(b, bool) and math.isfinite(b)) for b in boundaries
    )):
        raise ValueError(f"spectral_density: boundaries must be None or a pair (low, high) of finite numbers or None, "
                         f"got {boundaries!r}")
    if pair and None not in boundaries and not boundaries[0] < boundaries[1]:
        raise ValueError(f"spectral_density: boundaries must have low < high, got {tuple(boundaries)!r}")
