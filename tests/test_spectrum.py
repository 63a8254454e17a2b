r"""The spectral tools of optim (eigenpairs, spectral_density, hutchpp_trace, trace, PreconditionedOperator) on the
Hessian and the Gauss-Newton matrix of a one-layer transformer whose attention runs through flashbob (blocked
backend), in float64, against the dense matrices' eigendecompositions.

The dense matrices come from torch.func on a copy of the model with flashbob's reference attention (the products
under test never touch it). Eigenvalues and eigenvectors must agree to 1e-8 (ARPACK at tol=0 converges to machine
precision). The stochastic estimates are held to the exact values within five standard deviations of their
sampling error, computed from the exact spectrum (the seeds are fixed, so each test is deterministic; the bound
says how far off a correct estimator could be, not a guess):

- SLQ's moment :math:`\frac1R\sum_r v_r^\top A^p v_r` (:math:`v_r` uniform on the unit sphere) has variance
  :math:`\frac{2}{(n + 2)R}\operatorname{Var}_i(\lambda_i^p)`; Lanczos adds no error for :math:`p < 2\,\text{ncv}`.
- Hutchinson with Rademacher probes: :math:`\frac2S\big(\lVert A\rVert_F^2 - \sum_i A_{ii}^2\big)`.
- Hutch++: at most :math:`\frac2N\lVert PAP\rVert_F^2 \le \frac2N \lVert A\rVert_F^2`; exact when :math:`A` has
  rank :math:`\le N` (the Gauss-Newton matrix of a few tokens).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call, grad, hessian, jacfwd, jacrev

import flashbob
from optim import (
    CrossEntropyHessian,
    CurvatureOperator,
    GGNOperator,
    HessianOperator,
    PreconditionedOperator,
    eigenpairs,
    functional,
    hutchpp_trace,
    spectral_density,
    trace,
)
from recipes.common.transformer import Transformer

DTYPE = torch.float64
VOCAB, BATCH, TOKENS = 5, 2, 6
RTOL = 1e-8


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@dataclass
class Problem:
    """A one-layer transformer (attention and MLP) on ``BATCH x TOKENS`` tokens, its loss, and a copy with
    flashbob's reference attention for the dense matrices."""

    model: torch.nn.Module
    reference: torch.nn.Module
    tokens: Tensor
    targets: Tensor

    @property
    def params(self) -> list[Tensor]:
        return list(self.model.parameters())

    def loss_of(self, logits: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), self.targets.flatten())

    def operator(self, curvature: str, mode: str) -> CurvatureOperator:
        if curvature == "hessian":
            loss = functional(self.model, lambda: self.loss_of(self.model(self.tokens)), self.params)
            return HessianOperator(loss if mode == "forward" else loss(self.params), self.params, mode=mode)
        outputs = functional(self.model, lambda: self.model(self.tokens), self.params)
        outputs = outputs if mode == "forward" else outputs(self.params)
        return GGNOperator(outputs, self.params, CrossEntropyHessian(self.targets), mode=mode)

    def _reference_logits(self, theta: Tensor) -> Tensor:
        names = [name for name, _ in self.reference.named_parameters()]
        shapes = [p.shape for p in self.reference.parameters()]
        values = torch.split(theta, [math.prod(s) for s in shapes])
        return functional_call(self.reference, {n: v.view(s) for n, v, s in zip(names, values, shapes)},
                               (self.tokens,))

    def dense(self, curvature: str) -> Tensor:
        theta = torch.cat([p.detach().reshape(-1) for p in self.reference.parameters()])
        if curvature == "hessian":
            matrix = jacfwd(grad(lambda t: self.loss_of(self._reference_logits(t))))(theta)
        else:
            logits = self._reference_logits(theta).detach()
            jacobian = jacrev(self._reference_logits)(theta).reshape(logits.numel(), -1)
            loss_hessian = hessian(self.loss_of)(logits).reshape(logits.numel(), logits.numel())
            matrix = jacobian.T @ loss_hessian @ jacobian
        return (matrix + matrix.T) / 2


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The products of 616 parameters gain nothing from threads, and one thread is immune to a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def problem() -> Problem:
    torch.manual_seed(0)
    config = dict(vocab_size=VOCAB, n_outputs=VOCAB, d_model=8, n_heads=2, n_layers=1, mlp_ratio=2.0)
    model = Transformer(**config, attention=functools.partial(flashbob.attention, backend="blocked")).double()
    reference = Transformer(**config, attention=flashbob.reference.attention).double()
    reference.load_state_dict(model.state_dict())
    tokens, targets = torch.randint(0, VOCAB, (2, BATCH, TOKENS))
    return Problem(model, reference, tokens, targets)


@pytest.fixture(scope="module")
def dense(problem: Problem) -> dict[str, Tensor]:
    return {curvature: problem.dense(curvature) for curvature in ("hessian", "ggn")}


@pytest.fixture(scope="module")
def spectra(dense: dict[str, Tensor]) -> dict[str, Tensor]:
    return {curvature: torch.linalg.eigvalsh(matrix) for curvature, matrix in dense.items()}


def expected_top(eigenvalues: Tensor, k: int, which: str) -> Tensor:
    key = {"LA": -eigenvalues, "SA": eigenvalues, "LM": -eigenvalues.abs()}[which]
    return eigenvalues[key.argsort()[:k]]


@pytest.mark.parametrize(("curvature", "mode", "which"), [
    ("hessian", "reverse", "LA"), ("hessian", "reverse", "SA"), ("hessian", "reverse", "LM"),
    ("hessian", "forward", "LA"), ("ggn", "reverse", "LA"), ("ggn", "forward", "LA"),
])
def test_eigenpairs_match_the_dense_eigendecomposition(problem, dense, spectra, curvature, mode, which):
    k = 4
    values, vectors = eigenpairs(problem.operator(curvature, mode), k, which=which, generator=seeded(0))
    expected = expected_top(spectra[curvature], k, which)
    assert values.dtype == DTYPE and values.shape == (k,) and vectors.shape == (dense[curvature].shape[0], k)
    torch.testing.assert_close(values, expected, rtol=RTOL, atol=0)
    residual = torch.linalg.vector_norm(dense[curvature] @ vectors - vectors * values, dim=0)
    assert (residual <= RTOL * values.abs()).all(), residual / values.abs()
    torch.testing.assert_close(vectors.T @ vectors, torch.eye(k, dtype=DTYPE), rtol=0, atol=1e-10)


@pytest.mark.parametrize("curvature", ["hessian", "ggn"])
def test_spectral_density_moments_match_the_exact_spectrum(problem, spectra, curvature):
    eigenvalues, repeats = spectra[curvature], 8
    n = eigenvalues.numel()
    boundaries = (0.0, None) if curvature == "ggn" else None
    density = spectral_density(problem.operator(curvature, "reverse"), 24, num_repeats=repeats, num_points=512,
                               boundaries=boundaries, generator=seeded(1))
    assert density.nodes.shape == density.weights.shape == (repeats, 24) and density.dimension == n
    torch.testing.assert_close(density.weights.sum(dim=1), torch.ones(repeats, dtype=DTYPE))
    for power in (0, 1, 2, 3):
        exact = float((eigenvalues**power).mean())
        spread = float((eigenvalues**power).var(correction=0))
        tolerance = 5 * math.sqrt(2 * spread / ((n + 2) * repeats)) + 1e-12 * abs(exact)
        assert abs(density.moment(power) - exact) <= tolerance, (power, density.moment(power), exact, tolerance)
    assert density.moment(1) * n == pytest.approx(density.expectation(lambda x: x) * n)
    # the curve spans the spectrum, integrates to 1, and its mean is the quadrature's
    assert density.grid[0] <= eigenvalues.min() and density.grid[-1] >= eigenvalues.max()
    assert density.density.min() >= 0
    span = float(eigenvalues.max() - eigenvalues.min())
    assert np.trapezoid(density.density.numpy(), density.grid.numpy()) == pytest.approx(1, abs=1e-3)
    mean = np.trapezoid((density.grid * density.density).numpy(), density.grid.numpy())
    assert mean == pytest.approx(density.moment(1), abs=1e-3 * span)


def test_hutchpp_is_exact_on_a_gauss_newton_matrix_of_low_rank(problem, dense):
    """The GGN of cross-entropy has rank <= tokens x (classes - 1) = 48: Hutch++'s sketch of 48 probes spans it."""
    rank = BATCH * TOKENS * (VOCAB - 1)
    estimate = hutchpp_trace(problem.operator("ggn", "reverse"), 3 * rank, generator=seeded(2))
    assert estimate == pytest.approx(float(dense["ggn"].trace()), rel=RTOL)


@pytest.mark.parametrize("estimator", ["hutchpp", "hutchinson"])
def test_trace_estimates_of_the_hessian_are_within_their_sampling_error(problem, dense, estimator):
    matrix = dense["hessian"]
    frobenius_squared = float((matrix**2).sum())
    if estimator == "hutchpp":
        third = 20
        estimate = hutchpp_trace(problem.operator("hessian", "reverse"), 3 * third, generator=seeded(3))
        bound = 2 * frobenius_squared / third
    else:
        samples = 30
        estimate = trace(problem.operator("hessian", "reverse"), samples, generator=seeded(3))
        bound = 2 * (frobenius_squared - float((matrix.diagonal() ** 2).sum())) / samples
    assert abs(estimate - float(matrix.trace())) <= 5 * math.sqrt(bound)


def test_preconditioned_operator_has_the_spectrum_of_the_preconditioned_hessian(problem, dense):
    generator = seeded(4)
    inverse_diagonal = [torch.rand(p.shape, generator=generator, dtype=DTYPE) + 0.1 for p in problem.params]
    d = torch.cat([t.reshape(-1) for t in inverse_diagonal])
    expected = torch.linalg.eigvals(d[:, None] * dense["hessian"]).real.sort(descending=True).values[:2]
    operator = PreconditionedOperator(problem.operator("hessian", "reverse"), inverse_diagonal)
    values, vectors = eigenpairs(operator, 2, generator=seeded(5))
    torch.testing.assert_close(values, expected, rtol=RTOL, atol=0)
    scaled = d.sqrt()[:, None] * vectors  # eigenvectors of P^{-1} H
    torch.testing.assert_close(d[:, None] * (dense["hessian"] @ scaled), scaled * values, rtol=0,
                               atol=RTOL * float(values.abs().max()))


def test_a_generator_makes_the_estimates_reproducible_and_leaves_the_global_state(problem):
    operator = problem.operator("hessian", "reverse")
    before = torch.get_rng_state()
    first = hutchpp_trace(operator, 9, generator=seeded(6))
    assert torch.equal(torch.get_rng_state(), before)
    assert hutchpp_trace(operator, 9, generator=seeded(6)) == first
    assert hutchpp_trace(operator, 9, generator=seeded(7)) != first
    one, two = (spectral_density(operator, 4, num_points=8, boundaries=(-1.0, 1.0), generator=seeded(8))
                for _ in range(2))
    assert torch.equal(one.nodes, two.nodes) and torch.equal(one.density, two.density)


def _bad(call: Callable[[], object], match: str, error: type[Exception] = ValueError) -> None:
    with pytest.raises(error, match=match):
        call()


def test_bad_arguments_raise_errors_that_name_them(problem):
    op = problem.operator("hessian", "reverse")
    n = op.shape[0]
    _bad(lambda: eigenpairs(op, 0), "eigenpairs: k must be a positive integer")
    _bad(lambda: eigenpairs(op, n), f"eigenpairs: k must be less than the operator's size n = {n}")
    _bad(lambda: eigenpairs(op, 2, which="BE"), "eigenpairs: which must be one of 'LA', 'SA', 'LM', got 'BE'")
    _bad(lambda: eigenpairs(op, 2, tol=-1.0), "eigenpairs: tol must be a finite number >= 0")
    _bad(lambda: eigenpairs(op, 2, ncv=2), "eigenpairs: ncv must satisfy k < ncv <= n")
    _bad(lambda: eigenpairs(op, 2, max_iter=0), "eigenpairs: max_iter must be a positive integer")
    _bad(lambda: eigenpairs(op, 4, ncv=6, max_iter=1), "eigenpairs: ARPACK found .* raise max_iter", RuntimeError)
    _bad(lambda: spectral_density(op, 1), r"spectral_density: ncv must be in \[2, n")
    _bad(lambda: spectral_density(op, n + 1), r"spectral_density: ncv must be in \[2, n")
    _bad(lambda: spectral_density(op, 4, num_repeats=0), "spectral_density: num_repeats must be a positive integer")
    _bad(lambda: spectral_density(op, 4, num_points=1), "spectral_density: num_points must be at least 2")
    _bad(lambda: spectral_density(op, 4, kappa=1.0), "spectral_density: kappa must be a finite number > 1")
    _bad(lambda: spectral_density(op, 4, margin=math.nan), "spectral_density: margin must be a finite number >= 0")
    _bad(lambda: spectral_density(op, 4, boundaries=(1.0, 0.0)), "spectral_density: boundaries must have low < high")
    _bad(lambda: spectral_density(op, 4, boundaries=1.0), "spectral_density: boundaries must be None or a pair")
    _bad(lambda: hutchpp_trace(op, 10), "hutchpp_trace: num_products must be a multiple of 3 less than n")
    _bad(lambda: hutchpp_trace(op, 3 * n), "hutchpp_trace: num_products must be a multiple of 3 less than n")
    _bad(lambda: hutchpp_trace(op, 0), "hutchpp_trace: num_products must be a positive integer")
    _bad(lambda: hutchpp_trace(op, 9, "uniform"), "hutchpp_trace: distribution must be 'rademacher' or 'gaussian'")
    _bad(lambda: PreconditionedOperator(op, [torch.ones(3)]), "inverse_diagonal must hold one tensor shaped like")
    _bad(lambda: PreconditionedOperator(op, [-torch.ones_like(p) for p in problem.params]),
         "every entry of inverse_diagonal must be finite and > 0")
    density = spectral_density(op, 4, num_points=8, boundaries=(-1.0, 1.0), generator=seeded(0))
    _bad(lambda: density.moment(-1), "SpectralDensity.moment: power must be an integer >= 0")


def test_lanczos_breakdown_is_an_error(problem):
    """A zero matrix ends Lanczos at its first step (0 / 0): the error says to lower ncv."""
    params = problem.params
    zero = HessianOperator(sum((p * 1.0).sum() for p in params), params)  # linear in the parameters: H = 0
    _bad(lambda: spectral_density(zero, 4, boundaries=(-1.0, 1.0)), "Lanczos broke down .* lower ncv", RuntimeError)


def test_missing_curvlinops_is_an_import_error_that_says_how_to_install_it(problem, monkeypatch):
    for name in [name for name in sys.modules if name == "curvlinops" or name.startswith("curvlinops.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "curvlinops", None)
    op = problem.operator("hessian", "reverse")
    install = r"pip install --no-deps curvlinops-for-pytorch"
    _bad(lambda: spectral_density(op, 4), f"spectral_density needs curvlinops .*{install}", ImportError)
    _bad(lambda: hutchpp_trace(op, 9), f"hutchpp_trace needs curvlinops .*{install}", ImportError)
