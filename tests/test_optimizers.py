"""NewtonCG, SophiaH, SophiaG and AdaHessian against closed forms, scipy and hand-written updates, in float64."""

from __future__ import annotations

import copy
import io
import math
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import optim
from optim import AdaHessian, NewtonCG, SophiaG, SophiaH, cg
from recipes.common.transformer import Transformer
from tests.models import MLP

DTYPE = torch.float64
EXACT = dict(damping=0.0, adapt_damping=False, backtrack=False, line_search=False, warm_start_decay=0.0)


def spd(n: int, gen: torch.Generator, *, shift: float = 0.5) -> Tensor:
    """A random symmetric positive definite matrix with eigenvalues at least ``shift``."""
    q = torch.randn(n, n, generator=gen, dtype=DTYPE)
    return q @ q.T / n + shift * torch.eye(n, dtype=DTYPE)


def quadratic(a: Tensor, b: Tensor, params: list[Tensor]) -> Tensor:
    r""":math:`\tfrac12 \theta^\top A \theta - b^\top \theta` of the concatenated parameters."""
    theta = torch.cat([p.reshape(-1) for p in params])
    return 0.5 * theta @ a @ theta - b @ theta


def split(theta: Tensor, sizes: tuple[int, ...]) -> list[Tensor]:
    return [t.clone().requires_grad_() for t in torch.split(theta, list(sizes))]


# --------------------------------------------------------------------------------------------- CG


def test_cg_solves_spd_system_with_and_without_preconditioner(gen):
    a, b = spd(9, gen), torch.randn(9, generator=gen, dtype=DTYPE)
    expected = torch.linalg.solve(a, b)

    def matvec(v):
        y = a @ torch.cat(v)
        return (y[:4], y[4:])

    for precondition in (None, lambda r: tuple(ri / 2.0 for ri in r)):
        result = cg(matvec, (b[:4], b[4:]), max_iter=50, tol=1e-13, precondition=precondition)
        assert result.status == "converged" and result.iterations <= 12
        torch.testing.assert_close(torch.cat(result.x), expected, rtol=1e-10, atol=1e-12)
        x = torch.cat(result.x)
        assert result.objective == pytest.approx(float(0.5 * x @ a @ x - b @ x), rel=1e-10)


def test_cg_warm_start_saved_iterates_and_progress_rule(gen):
    a, b = spd(40, gen, shift=1e-3), torch.randn(40, generator=gen, dtype=DTYPE)
    matvec = lambda v: (a @ v[0],)  # noqa: E731
    result = cg(matvec, (b,), max_iter=200, tol=0.0, progress_tol=5e-2, save_at={1, 2, 5, 9})
    assert result.status == "progress" and 10 < result.iterations < 200
    assert [it.iteration for it in result.iterates] == [1, 2, 5, 9, result.iterations]
    objectives = [it.objective for it in result.iterates]
    assert all(x > y for x, y in zip(objectives, objectives[1:])), "phi must fall along CG"
    warm = cg(matvec, (b,), result.x, max_iter=200, tol=1e-12)
    torch.testing.assert_close(warm.x[0], torch.linalg.solve(a, b), rtol=1e-8, atol=1e-10)
    bad = cg(matvec, (b,), (-50 * torch.linalg.solve(a, b),), max_iter=0)
    assert bad.objective == 0.0 and not bad.x[0].any(), "a warm start worse than zero restarts from zero"


def test_cg_negative_curvature_and_breakdown(gen):
    a = torch.diag(torch.tensor([2.0, -1.0, 3.0], dtype=DTYPE))
    b = torch.tensor([1.0, 1.0, 1.0], dtype=DTYPE)
    calls = []
    result = cg(lambda v: calls.append(1) or (a @ v[0],), (b,), max_iter=10)
    # two products: the first step's, and the one that found p^T A p <= 0 (it was not counted)
    assert result.status == "negative_curvature" and result.iterations == len(calls) == 2
    assert result.iterates[-1].iteration == 1 and result.objective < 0, "the first step still decreases phi"
    nan = cg(lambda v: (v[0] * math.nan,), (b,), max_iter=10)
    assert nan.status == "breakdown" and not nan.x[0].any() and nan.iterations == 1


def test_cg_negative_curvature_on_the_first_iteration_takes_the_step_with_abs_curvature():
    """p0^T A p0 < 0 at once: x1 = (r0^T r0 / |p0^T A p0|) b is taken (it decreases phi) and CG stops after one
    product. Untested before: alpha = rz / pAp (a step uphill, x1 = -2/3 b here) and stopping before the first step
    (x = 0) both went uncaught, the existing case finding negative curvature only on its second iteration."""
    a = torch.diag(torch.tensor([-1.0, -2.0], dtype=DTYPE))
    b = torch.tensor([1.0, 1.0], dtype=DTYPE)
    result = cg(lambda v: (a @ v[0],), (b,), max_iter=10)
    assert result.status == "negative_curvature" and result.iterations == 1
    expected = (2.0 / 3.0) * b  # r0^T r0 = 2, p0^T A p0 = -3
    torch.testing.assert_close(result.x[0], expected, rtol=1e-14, atol=0)
    assert result.objective == pytest.approx(float(0.5 * expected @ a @ expected - b @ expected), rel=1e-12)
    assert result.objective < 0


def test_cg_refuses_an_uphill_warm_start_and_reports_convergence_on_its_last_iteration(gen):
    """A warm start with phi(x0) <= 0 but b^T x0 < 0 (possible under negative curvature) was kept, and CG returned a
    step uphill for b = -g (NewtonCG's Armijo test then let the loss rise); it now restarts from zero. CG that
    converged on its last allowed iteration reported max_iter. save_at 0 keeps the start."""
    a = torch.diag(torch.tensor([2.0, -4.0], dtype=DTYPE))
    b = torch.tensor([1.0, 0.1], dtype=DTYPE)
    x0 = (torch.tensor([0.0, -1.0], dtype=DTYPE),)  # phi(x0) = -2 + 0.1 < 0, b^T x0 = -0.1 < 0
    result = cg(lambda v: (a @ v[0],), (b,), x0, max_iter=5, save_at={0})
    assert result.iterates[0].iteration == 0 and result.iterates[0].bx == 0.0, "started from zero"
    assert all(it.bx > 0 for it in result.iterates[1:]) and float(b @ result.x[0]) > 0
    spd_diag = torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=DTYPE))
    ones = torch.ones(3, dtype=DTYPE)
    for max_iter in (3, 4):
        solved = cg(lambda v: (spd_diag @ v[0],), (ones,), max_iter=max_iter, tol=1e-12)
        assert solved.status == "converged" and solved.iterations == 3, (max_iter, solved.status)


# -------------------------------------------------------------------------------------- NewtonCG


@pytest.mark.parametrize("maximize", [False, True])
def test_newton_cg_solves_strictly_convex_quadratic_in_one_step(gen, maximize):
    n, sizes = 7, (3, 4)
    a, b = spd(n, gen), torch.randn(n, generator=gen, dtype=DTYPE)
    params = split(torch.randn(n, generator=gen, dtype=DTYPE), sizes)
    opt = NewtonCG(params, curvature="hessian", max_cg_iters=n, cg_tol=1e-14, maximize=maximize, **EXACT)
    sign = -1 if maximize else 1
    opt.step(lambda: sign * quadratic(a, b, params))
    torch.testing.assert_close(torch.cat([p.detach() for p in params]), torch.linalg.solve(a, b), rtol=1e-9, atol=1e-11)
    assert 1 <= opt.stats["cg_iters"] <= n and opt.stats["step_skipped"] == 0


def test_newton_cg_group_learning_rates_scale_the_damped_newton_step(gen):
    n, damping = 6, 0.3
    a, b = spd(n, gen), torch.randn(n, generator=gen, dtype=DTYPE)
    theta = torch.randn(n, generator=gen, dtype=DTYPE)
    params = split(theta, (2, 4))
    settings = {**EXACT, "damping": damping}
    opt = NewtonCG([{"params": params[:1]}, {"params": params[1:], "lr": 0.25}], curvature="hessian",
                   max_cg_iters=n, cg_tol=1e-14, **{k: v for k, v in settings.items()})  # fmt: skip
    opt.step(lambda: quadratic(a, b, params))
    newton = torch.linalg.solve(a + damping * torch.eye(n, dtype=DTYPE), b - a @ theta)
    expected = theta + torch.cat([newton[:2], 0.25 * newton[2:]])
    torch.testing.assert_close(torch.cat([p.detach() for p in params]), expected, rtol=1e-9, atol=1e-11)
    with pytest.raises(ValueError, match="may not differ"):
        opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)], "damping": 2.0})


def logistic_data(gen, rows=60, features=3):
    x = torch.randn(rows, features, generator=gen, dtype=DTYPE)
    truth = torch.tensor([1.5, -2.0, 0.5], dtype=DTYPE)
    y = (torch.rand(rows, generator=gen, dtype=DTYPE) < torch.sigmoid(x @ truth)).to(DTYPE)
    return x, y


def test_newton_cg_logistic_regression_matches_scipy(gen):
    """Binary logistic regression with an L2 penalty (strictly convex), exact Hessian."""
    from scipy.optimize import minimize

    x, y = logistic_data(gen)
    reg = 1e-2
    xn, yn = x.numpy(), y.numpy()

    def objective(v):  # written by hand in NumPy: an independent reference
        w, c = v[:-1], v[-1]
        z = xn @ w + c
        loss = np.mean(np.logaddexp(0, z) - yn * z) + 0.5 * reg * w @ w
        r = (1 / (1 + np.exp(-z)) - yn) / len(yn)
        return loss, np.concatenate([xn.T @ r + reg * w, [r.sum()]])

    reference = minimize(objective, np.zeros(4), jac=True, method="BFGS", options={"gtol": 1e-12}).x
    w = torch.zeros(3, dtype=DTYPE, requires_grad=True)
    c = torch.zeros(1, dtype=DTYPE, requires_grad=True)
    opt = NewtonCG([w, c])

    def closure():
        return F.binary_cross_entropy_with_logits(x @ w + c, y) + 0.5 * reg * w @ w

    for _ in range(20):  # the initial damping (1) dominates this small curvature for the first steps
        opt.step(closure)
    np.testing.assert_allclose(torch.cat([w, c]).detach().numpy(), reference, rtol=1e-6, atol=1e-8)


def test_newton_cg_softmax_regression_with_ggn_matches_scipy(gen):
    """Multinomial logistic regression; the closure returns logits, so NewtonCG uses the cross-entropy GGN."""
    from scipy.optimize import minimize

    x = torch.randn(50, 3, generator=gen, dtype=DTYPE)
    y = torch.randint(0, 3, (50,), generator=gen)
    xn, onehot = x.numpy(), F.one_hot(y, 3).to(DTYPE).numpy()

    def objective(v):
        z = xn @ v.reshape(3, 3)
        z = z - z.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        return -np.mean((onehot * logp).sum(axis=1)), (xn.T @ (np.exp(logp) - onehot) / len(xn)).reshape(-1)

    reference = minimize(objective, np.zeros(9), jac=True, method="BFGS", options={"gtol": 1e-12})
    weight = torch.zeros(3, 3, dtype=DTYPE, requires_grad=True)
    opt = NewtonCG([weight])

    def closure():
        logits = x @ weight
        return F.cross_entropy(logits, y), logits

    for _ in range(20):
        opt.step(closure)
    # The softmax is invariant to adding a constant to each row's logits, so compare probabilities.
    probs = torch.softmax(x @ weight.detach(), dim=-1).numpy()
    expected = np.exp(xn @ reference.x.reshape(3, 3))
    np.testing.assert_allclose(probs, expected / expected.sum(axis=1, keepdims=True), rtol=1e-6, atol=1e-9)
    assert opt.stats["loss"] == pytest.approx(reference.fun, rel=1e-9)


def test_newton_cg_without_line_search_warns_when_the_step_raises_the_loss(gen):
    """line_search=False takes the chosen iterate as it is: a step that raises the (evaluated) loss says so; a step
    that lowers it does not warn."""
    x, y = torch.randn(12, 3, generator=gen, dtype=torch.float64), torch.randint(0, 3, (12,), generator=gen)
    for lr, rises in ((64.0, True), (1e-4, False)):  # a short enough step along a descent direction lowers f
        torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
        net = MLP([3, 5, 3])
        closure = lambda: (F.cross_entropy(net(x), y), net(x))  # noqa: E731
        opt = NewtonCG(net.parameters(), lr=lr, damping=1e-3, line_search=False)
        before = F.cross_entropy(net(x), y).item()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step(closure)
        after = F.cross_entropy(net(x), y).item()
        raised = [w for w in caught if "raises the loss" in str(w.message)]
        assert (after > before) == rises and len(raised) == int(rises), (before, after, caught)


@pytest.mark.parametrize(("theta0", "lr", "factor"), [
    (0.5, 1.0, 2 / 3), (0.8, 1.0, 1.0), (1.3, 1.0, 3 / 2), (1.2, 0.5, 2 / 3), (0.5, 1.5, 1.0)])
def test_newton_cg_reduction_ratio_and_damping_adaptation_match_martens(theta0, lr, factor):
    """f = sqrt(1 + theta^2) (curvature falls along the step, so the quadratic model overestimates the decrease):
    s = -lr g / (H + lambda), rho = (f(theta + s) - f(theta)) / (g s + H s^2 / 2) (the undamped model), and lambda
    grows 3/2 below rho = 1/4, shrinks 2/3 above 3/4. The cases put rho at 0.85, 0.61, 0.11, 0.83 (lr 0.5) and 0.54
    (lr 1.5). Before, no test computed rho: the thresholds (1/4 -> 0, 3/4 -> 0.95), the model's damping term and its
    lr^2 could all change unnoticed."""
    damping = 0.1
    theta = torch.tensor([theta0], dtype=DTYPE, requires_grad=True)
    opt = NewtonCG([theta], lr=lr, damping=damping, curvature="hessian", max_cg_iters=1, adapt_damping=True,
                   backtrack=False, line_search=False, warm_start_decay=0.0)  # fmt: skip
    opt.step(lambda: torch.sqrt(1 + theta**2).sum())
    f = lambda t: math.sqrt(1 + t * t)  # noqa: E731
    g, h = theta0 / f(theta0), f(theta0) ** -3
    s = -lr * g / (h + damping)
    rho = (f(theta0 + s) - f(theta0)) / (g * s + 0.5 * h * s * s)
    assert theta.item() == pytest.approx(theta0 + s, rel=1e-12)
    assert opt.stats["reduction_ratio"] == pytest.approx(rho, rel=1e-9)
    assert (rho < 0.25, rho > 0.75) == (factor > 1, factor < 1), rho  # the case lies in the band it claims
    assert opt.state[theta]["damping"] == pytest.approx(damping * factor, rel=1e-15)


@pytest.mark.parametrize(("lr", "expected_alpha"), [(1.985, 0.8), (2.472, 0.8), (2.48, 0.64)])
def test_newton_cg_armijo_line_search_takes_the_first_sufficient_decrease(lr, expected_alpha):
    """f = h theta^2 / 2 + c theta, Newton step x = -g / h scaled by lr: f(theta + a lr x) - f = (g^2 / h) a lr (a lr / 2 - 1)
    and Armijo's test f(theta + a s) <= f + 1e-2 a g^T s with s = lr x holds iff a lr <= 1.98. The lrs sit just past the
    boundaries where Armijo's test without a (f + 1e-2 g^T s), or with a slope missing its lr (g^T x), picks another
    a; both mutations went uncaught before (the suite's functions decreased by far more than the test asks)."""
    h, c, theta0 = 2.0, 1.0, 1.0
    theta = torch.tensor([theta0], dtype=DTYPE, requires_grad=True)
    opt = NewtonCG([theta], lr=lr, damping=0.0, curvature="hessian", max_cg_iters=1, adapt_damping=False,
                   backtrack=False, line_search=True, warm_start_decay=0.0)  # fmt: skip
    opt.step(lambda: (0.5 * h * theta**2 + c * theta).sum())
    f = lambda t: 0.5 * h * t * t + c * t  # noqa: E731
    g = h * theta0 + c
    s = -lr * g / h
    alpha = 1.0  # Armijo by hand: 1, 0.8, 0.8^2, ... until the sufficient decrease holds
    while f(theta0 + alpha * s) > f(theta0) + 1e-2 * alpha * g * s:
        alpha *= 0.8
    assert alpha == pytest.approx(expected_alpha, rel=1e-12)
    assert opt.stats["step_size"] == pytest.approx(alpha, rel=1e-12)
    assert theta.item() == pytest.approx(theta0 + alpha * s, rel=1e-12)


def test_newton_cg_warm_starts_cg_from_the_decayed_last_direction(gen):
    """warm_start_decay = 0.5, one CG iteration per step on a quadratic: step 2's CG starts at x0 = 0.5 x1 (x1 step 1's
    CG solution, before the lr) and takes one CG iteration from there. Before, no test looked at the warm start:
    starting from x1 itself (the decay dropped) went unnoticed."""
    n, lr, decay = 5, 0.5, 0.5
    a, b = spd(n, gen), torch.randn(n, generator=gen, dtype=DTYPE)
    theta0 = torch.randn(n, generator=gen, dtype=DTYPE)
    theta = theta0.clone().requires_grad_()
    opt = NewtonCG([theta], lr=lr, damping=0.0, curvature="hessian", max_cg_iters=1, adapt_damping=False,
                   backtrack=False, line_search=False, warm_start_decay=decay)  # fmt: skip
    closure = lambda: quadratic(a, b, [theta])  # noqa: E731

    def one_cg_iteration(rhs, x0):
        r = rhs - a @ x0
        return x0 + (r @ r) / (r @ a @ r) * r

    opt.step(closure)
    x1 = one_cg_iteration(b - a @ theta0, torch.zeros(n, dtype=DTYPE))
    theta1 = theta0 + lr * x1
    torch.testing.assert_close(theta.detach(), theta1, rtol=1e-12, atol=1e-14)
    opt.step(closure)
    rhs, x0 = b - a @ theta1, decay * x1
    assert 0.5 * x0 @ a @ x0 - rhs @ x0 < 0 and rhs @ x0 > 0, "CG keeps this warm start (it would restart from 0)"
    torch.testing.assert_close(theta.detach(), theta1 + lr * one_cg_iteration(rhs, x0), rtol=1e-12, atol=1e-14)


def test_newton_cg_converges_on_rosenbrock():
    theta = torch.tensor([-1.2, 1.0], dtype=DTYPE, requires_grad=True)
    opt = NewtonCG([theta], curvature="hessian")
    closure = lambda: (1 - theta[0]) ** 2 + 100 * (theta[1] - theta[0] ** 2) ** 2  # noqa: E731
    for _ in range(60):
        opt.step(closure)
    torch.testing.assert_close(theta.detach(), torch.ones(2, dtype=DTYPE), rtol=0, atol=1e-6)


def test_newton_cg_follows_negative_curvature(gen):
    a = torch.diag(torch.tensor([1.0, -2.0, 3.0], dtype=DTYPE))
    theta = torch.tensor([0.5, 0.1, -0.3], dtype=DTYPE, requires_grad=True)
    opt = NewtonCG([theta], curvature="hessian", damping=0.5)
    closure = lambda: 0.5 * theta @ a @ theta + 0.25 * (theta**4).sum()  # noqa: E731
    before = closure().item()
    opt.step(closure)
    assert opt.stats["negative_curvature"] == 1.0 and closure().item() < before


def test_newton_cg_one_forward_with_graph_per_step():
    torch.manual_seed(0)
    model = MLP([3, 5, 2])
    x, y = torch.randn(8, 3, dtype=DTYPE), torch.randint(0, 2, (8,))
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        logits = model(x)
        return F.cross_entropy(logits, y), logits

    opt = NewtonCG(model.parameters())
    for _ in range(3):
        opt.step(closure)
    assert sum(calls) == 3 and len(calls) > 3, "one forward with a graph per step; trial points without"
    assert model[0].weight.grad is not None


# ------------------------------------------------------------------------- hand-written updates


def diagonal_problem(gen):
    """``f = sum(a * theta^2 / 2 + c * theta)`` over two parameters: with Rademacher probes z * Hz = a exactly."""
    a = [torch.rand(3, generator=gen, dtype=DTYPE) * 4 - 1, torch.rand(2, 2, generator=gen, dtype=DTYPE) + 0.5]
    c = [torch.randn(3, generator=gen, dtype=DTYPE), torch.randn(2, 2, generator=gen, dtype=DTYPE)]
    params = [torch.randn(shape, generator=gen, dtype=DTYPE).requires_grad_() for shape in ((3,), (2, 2))]

    def closure():
        return sum((ai * p**2 / 2 + ci * p).sum() for ai, ci, p in zip(a, c, params))

    return a, c, params, closure


def test_sophia_h_update_matches_hand_formula(gen):
    """Per-group lr, update_period and maximize (group 1 maximises: its g and h-hat change sign)."""
    a, c, params, closure = diagonal_problem(gen)
    lrs, (beta1, beta2), rho, wd, eps, k = (0.1, 0.03), (0.9, 0.8), 0.5, 0.2, 1e-15, (2, 3)
    sign = (1.0, -1.0)
    theta = [p.detach().clone() for p in params]
    m = [torch.zeros_like(t) for t in theta]
    h = [torch.zeros_like(t) for t in theta]
    groups = [{"params": [params[0]], "lr": lrs[0], "update_period": k[0]},
              {"params": [params[1]], "lr": lrs[1], "update_period": k[1], "maximize": True}]  # fmt: skip
    opt = SophiaH(groups, betas=(beta1, beta2), rho=rho, weight_decay=wd, eps=eps, distribution="rademacher")
    for t in range(7):
        opt.step(closure)
        unclipped, total = 0, 0
        for i in range(2):
            g = sign[i] * (a[i] * theta[i] + c[i])
            m[i] = beta1 * m[i] + (1 - beta1) * g
            if t % k[i] == 0:
                h[i] = beta2 * h[i] + (1 - beta2) * sign[i] * a[i]
            theta[i] = theta[i] * (1 - lrs[i] * wd)
            ratio = m[i] / torch.clamp(rho * h[i], min=eps)
            unclipped, total = unclipped + int((ratio.abs() < 1).sum()), total + ratio.numel()
            theta[i] = theta[i] - lrs[i] * ratio.clamp(-1, 1)
        for p, expected in zip(params, theta):
            torch.testing.assert_close(p.detach(), expected, rtol=1e-13, atol=1e-15)
        assert opt.stats["unclipped_fraction"] == pytest.approx(unclipped / total)
        assert opt.stats["hessian_refreshed"] == float(t % k[0] == 0 or t % k[1] == 0)
        torch.testing.assert_close(opt.state[params[1]]["hessian"], h[1], rtol=1e-13, atol=1e-15)


def test_sophia_h_bias_correction_over_several_refreshes_matches_hand_formula(gen):
    """bias_correction=True divides rho h by 1 - beta2^n, n the refreshes so far (not the steps): with update_period 2,
    n = 1, 1, 2, 2, 3. The only other test of it stops after one refresh, where 1 - beta2^n = 1 - beta2: the
    mutation rho / (1 - beta2) went uncaught."""
    a, c, params, closure = diagonal_problem(gen)
    lr, (beta1, beta2), rho, eps, k = 0.1, (0.9, 0.8), 0.5, 1e-15, 2
    theta = [p.detach().clone() for p in params]
    m = [torch.zeros_like(t) for t in theta]
    h = [torch.zeros_like(t) for t in theta]
    opt = SophiaH(params, lr=lr, betas=(beta1, beta2), rho=rho, weight_decay=0.0, eps=eps, update_period=k,
                  distribution="rademacher", bias_correction=True)  # fmt: skip
    refreshes = 0
    for t in range(5):
        opt.step(closure)
        refreshes += t % k == 0
        for i in range(2):
            m[i] = beta1 * m[i] + (1 - beta1) * (a[i] * theta[i] + c[i])
            if t % k == 0:
                h[i] = beta2 * h[i] + (1 - beta2) * a[i]
            denominator = torch.clamp(rho * h[i] / (1 - beta2**refreshes), min=eps)
            theta[i] = theta[i] - lr * (m[i] / denominator).clamp(-1, 1)
        for p, expected in zip(params, theta):
            torch.testing.assert_close(p.detach(), expected, rtol=1e-13, atol=1e-15)
        assert opt.state[params[0]]["hessian_refreshes"] == refreshes


def test_sophia_g_update_matches_hand_formula(gen):
    """Softmax regression: g and the Gauss-Newton-Bartlett estimate B * g_hat^2 written out for a linear model."""
    x = torch.randn(6, 3, generator=gen, dtype=DTYPE)
    y = torch.randint(0, 4, (6,), generator=gen)
    weight = torch.randn(3, 4, generator=gen, dtype=DTYPE, requires_grad=True)
    lr, (beta1, beta2), rho, wd, seed = 0.05, (0.9, 0.7), 0.3, 0.1, 1234
    opt = SophiaG([weight], lr=lr, betas=(beta1, beta2), rho=rho, weight_decay=wd, update_period=1,
                  generator=torch.Generator().manual_seed(seed))  # fmt: skip
    samples = torch.Generator().manual_seed(seed)
    theta, m, h = weight.detach().clone(), torch.zeros(3, 4, dtype=DTYPE), torch.zeros(3, 4, dtype=DTYPE)
    for _ in range(3):
        probs = torch.softmax(x @ theta, dim=-1)
        sampled = torch.multinomial(probs.float(), 1, generator=samples).squeeze(-1)
        g = x.T @ (probs - F.one_hot(y, 4)) / 6
        g_hat = x.T @ (probs - F.one_hot(sampled, 4)) / 6
        m = beta1 * m + (1 - beta1) * g
        h = beta2 * h + (1 - beta2) * 6 * g_hat**2
        theta = theta * (1 - lr * wd) - lr * (m / torch.clamp(rho * h, min=1e-15)).clamp(-1, 1)

        def closure():
            logits = x @ weight
            return F.cross_entropy(logits, y), logits

        opt.step(closure)
        torch.testing.assert_close(weight.detach(), theta, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("power", [1.0, 0.5])
def test_adahessian_update_matches_hand_formula(gen, power):
    a, c, params, closure = diagonal_problem(gen)
    lrs, (beta1, beta2), eps, wd = (0.1, 0.05), (0.8, 0.9), 1e-4, 0.1
    theta = [p.detach().clone() for p in params]
    m = [torch.zeros_like(t) for t in theta]
    v = [torch.zeros_like(t) for t in theta]
    groups = [{"params": [params[0]], "lr": lrs[0]}, {"params": [params[1]], "lr": lrs[1]}]
    opt = AdaHessian(groups, betas=(beta1, beta2), eps=eps, weight_decay=wd, hessian_power=power)
    for t in range(1, 4):
        opt.step(closure)
        for i in range(2):
            g = a[i] * theta[i] + c[i]
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * a[i] ** 2
            denom = (v[i] / (1 - beta2**t)).sqrt() ** power + eps
            theta[i] = theta[i] * (1 - lrs[i] * wd) - lrs[i] * m[i] / (1 - beta1**t) / denom
        for p, expected in zip(params, theta):
            torch.testing.assert_close(p.detach(), expected, rtol=1e-13, atol=1e-15)
    assert opt.stats["hessian_trace"] == pytest.approx(float(sum(ai.sum() for ai in a)))


# ----------------------------------------------------------------------------------- plain loops


def mlp_problem(seed=0):
    torch.manual_seed(seed)
    model = MLP([4, 6, 3])
    x, y = torch.randn(10, 4, dtype=DTYPE), torch.randint(0, 3, (10,))
    return model, x, y


def step_on_mlp(opt: torch.optim.Optimizer, model: nn.Module, x: Tensor, y: Tensor, mode: str) -> None:
    """One step on the cross-entropy of ``model(x)``: through a closure (``mode="closure"``), or as the
    plain loop ``loss.backward(create_graph=True); opt.step()``, which must leave no graph on ``p.grad``."""
    if mode == "closure":
        opt.step(lambda: F.cross_entropy(model(x), y))
        return
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward(create_graph=True)
    opt.step()
    assert all(p.grad.grad_fn is None for p in model.parameters())


def test_sophia_plain_loop_with_update_hessian_equals_closure_loop():
    results = []
    for mode in ("closure", "plain"):
        model, x, y = mlp_problem()
        torch.manual_seed(1)
        opt = SophiaH(model.parameters(), lr=1e-2, update_period=3)
        for step in range(7):
            if mode == "closure":
                opt.step(lambda: F.cross_entropy(model(x), y))
                continue
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if step % 3 == 0:
                opt.update_hessian(loss)
            loss.backward()
            opt.step()
            assert opt.stats["hessian_refreshed"] == float(step % 3 == 0)
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-12, atol=1e-14)


def test_sophia_g_plain_loop_and_non_refresh_steps_need_only_the_loss():
    model, x, y = mlp_problem()
    opt = SophiaG(model.parameters(), lr=1e-2, update_period=2)
    logits = model(x)
    opt.update_hessian(logits)
    F.cross_entropy(logits, y).backward()
    opt.step()
    assert opt.stats["hessian_refreshed"] == 1.0
    assert any(s["hessian"].any() for s in opt.state.values() if "hessian" in s)
    opt = SophiaG(model.parameters(), update_period=2)
    opt.step(lambda: (F.cross_entropy(model(x), y), model(x)))
    opt.step(lambda: F.cross_entropy(model(x), y))  # no refresh: the loss alone is enough
    with pytest.raises(RuntimeError, match="logits"):
        opt.step(lambda: F.cross_entropy(model(x), y))


def test_sophia_non_refresh_steps_take_one_plain_gradient(monkeypatch):
    import optim.sophia_h

    built = []
    real = optim.sophia_h.HessianOperator
    monkeypatch.setattr(optim.sophia_h, "HessianOperator", lambda *args: built.append(1) or real(*args))
    model, x, y = mlp_problem()
    opt = SophiaH(model.parameters(), update_period=4)
    for _ in range(8):
        opt.step(lambda: F.cross_entropy(model(x), y))
    assert len(built) == 2


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_adahessian_plain_loop_equals_closure_loop():
    results = []
    for mode in ("closure", "plain"):
        model, x, y = mlp_problem()
        torch.manual_seed(1)
        opt = AdaHessian(model.parameters(), lr=0.05)
        for _ in range(4):
            step_on_mlp(opt, model, x, y, mode)
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------- clear errors


def test_clear_errors_for_missing_or_wrong_closures():
    model, x, y = mlp_problem()
    for opt in (NewtonCG(model.parameters()), SophiaH(model.parameters()), AdaHessian(model.parameters())):
        with pytest.raises(TypeError, match="closure returned str"):
            opt.step(lambda: "loss")
        with pytest.raises(TypeError, match="one-element"):
            opt.step(lambda: F.cross_entropy(model(x), y, reduction="none"))
        with pytest.raises(RuntimeError, match="no autograd graph"):
            opt.step(lambda: F.cross_entropy(model(x), y).detach())

        def calls_backward():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        if not isinstance(opt, SophiaH):  # a SophiaH step off the refresh schedule would not notice
            with pytest.raises(RuntimeError, match="must not call backward"):
                opt.step(calls_backward)
    with pytest.raises(RuntimeError, match="needs a closure"):
        NewtonCG(model.parameters()).step()
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="create_graph=True"):
        AdaHessian(model.parameters()).step()
    with pytest.raises(RuntimeError, match="curvature='ggn'"):
        NewtonCG(model.parameters(), curvature="ggn").step(lambda: F.cross_entropy(model(x), y))


# --------------------------------------------------------------------------- state and guards


def make(name: str, params):
    return {
        "newton_ggn": lambda: NewtonCG(params, preconditioner="hutchinson", max_cg_iters=5),
        "newton_hessian": lambda: NewtonCG(
            params, curvature="hessian", preconditioner="squared_gradients", max_cg_iters=5
        ),
        "sophia_h": lambda: SophiaH(params, lr=1e-2, update_period=3),
        "sophia_g": lambda: SophiaG(params, lr=1e-2, update_period=3),
        "adahessian": lambda: AdaHessian(params, lr=1e-2),
    }[name]()


NAMES = ["newton_ggn", "newton_hessian", "sophia_h", "sophia_g", "adahessian"]


def flat(model) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_continues_bit_for_bit(name):
    model, x, y = mlp_problem()

    def closure_for(m):
        def closure():
            logits = m(x)
            return F.cross_entropy(logits, y), logits

        return closure

    start = copy.deepcopy(model)
    torch.manual_seed(2)
    opt = make(name, model.parameters())
    for _ in range(8):
        opt.step(closure_for(model))
    through, stats = flat(model), dict(opt.stats)

    torch.manual_seed(2)
    first = make(name, start.parameters())
    for _ in range(4):
        first.step(closure_for(start))
    buffer = io.BytesIO()
    torch.save({"model": start.state_dict(), "opt": first.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, map_location="cpu")
    resumed = copy.deepcopy(start)
    resumed.load_state_dict(saved["model"])
    second = make(name, resumed.parameters())
    second.load_state_dict(saved["opt"])
    for _ in range(4):
        second.step(closure_for(resumed))
    assert torch.equal(flat(resumed), through)
    assert second.stats == stats or all(
        a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(second.stats.values(), stats.values())
    )


class Resumable(nn.Module):
    """Embedding, tanh layer and head (about 130 float64 parameters), with one parameter of ``kind``: a vector the
    loss never reaches (``"unreached"``), a frozen hidden weight listed in the optimizer's groups or left out of them
    (``"frozen_in_groups"``, ``"frozen_out_of_groups"``), or the head's weight tied to the embedding (``"tied"``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 6, dtype=DTYPE)
        if kind == "unreached":
            self.unused = nn.Parameter(torch.randn(5, dtype=DTYPE))
        self.hidden = nn.Linear(6, 6, dtype=DTYPE)
        self.head = nn.Linear(6, 7, dtype=DTYPE)
        if kind == "tied":
            self.head.weight = self.embed.weight
        if kind.startswith("frozen"):
            self.hidden.weight.requires_grad_(False)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


RESUMED = {  # each optimizer in each of its modes, built on (params, module, probe generator)
    "sophia_h": lambda params, module, gen: SophiaH(params, lr=1e-2, update_period=2, generator=gen),
    "sophia_h_module": lambda params, module, gen: SophiaH(params, lr=1e-2, update_period=2, generator=gen,
                                                           module=module),
    "sophia_h_forward": lambda params, module, gen: SophiaH(params, lr=1e-2, update_period=2, generator=gen,
                                                            mode="forward", module=module),
    "sophia_h_forward_hessian_batch": lambda params, module, gen: SophiaH(
        params, lr=1e-2, update_period=2, generator=gen, mode="forward", module=module, hessian_batch=5
    ),
    "sophia_g": lambda params, module, gen: SophiaG(params, lr=1e-2, update_period=2, generator=gen),
    "adahessian": lambda params, module, gen: AdaHessian(params, lr=1e-2, generator=gen),
    "newton_ggn": lambda params, module, gen: NewtonCG(params, preconditioner="hutchinson", max_cg_iters=3,
                                                       generator=gen),
    "newton_ggn_forward": lambda params, module, gen: NewtonCG(params, preconditioner="hutchinson", max_cg_iters=3,
                                                               generator=gen, mode="forward", module=module),
    "newton_hessian_module": lambda params, module, gen: NewtonCG(
        params, curvature="hessian", preconditioner="hutchinson", max_cg_iters=3, generator=gen, module=module
    ),
    "newton_hessian_forward": lambda params, module, gen: NewtonCG(
        params, curvature="hessian", preconditioner="hutchinson", max_cg_iters=3, generator=gen, mode="forward",
        module=module,
    ),
}
KINDS = ["unreached", "frozen_in_groups", "frozen_out_of_groups", "tied"]


def resumable(config: str, kind: str, seed: int) -> tuple[Resumable, torch.optim.Optimizer, torch.Generator]:
    """A fresh model initialised from ``seed``, its optimizer ``config`` and the optimizer's probe generator."""
    torch.manual_seed(seed)
    model = Resumable(kind)
    params = [p for p in model.parameters() if p.requires_grad or kind != "frozen_out_of_groups"]
    generator = torch.Generator().manual_seed(seed + 100)
    return model, RESUMED[config](params, model, generator), generator


def same_stats(a: dict, b: dict) -> bool:
    """Two ``stats`` dicts hold the same keys and values, NaN equal to NaN."""
    same = (x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a.values(), b.values()))
    return a.keys() == b.keys() and all(same)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("config", list(RESUMED))
def test_state_dict_round_trip_resumes_bit_for_bit_with_unreached_frozen_and_tied_parameters(config, kind):
    """A run of 2k steps against k steps, the model, the optimizer and its probe generator through ``torch.save``
    into fresh ones (initialised from another seed), and k more: bitwise the same parameters, optimizer state and
    generator state, the same stats and the same ``refreshes_next_step`` before every step. Sophia
    (``update_period=2``) resumes at step 2 (no refresh, k = 1) and at step 3 (a refresh, k = 2); the others take
    curvature every step (k = 1). The checkpoints come from the run itself (``state_dict`` reads, it does not
    change anything)."""
    data = torch.Generator().manual_seed(7)
    tokens, targets = torch.randint(0, 7, (12,), generator=data), torch.randint(0, 7, (12,), generator=data)
    breaks = (1, 2) if config.startswith("sophia") else (1,)

    def step(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[bool, dict]:
        """One step; ``refreshes_next_step`` before it and the stats after it."""

        def closure(rows=slice(None)):
            logits = model(tokens[rows])
            return F.cross_entropy(logits, targets[rows]), logits

        refreshes = opt.refreshes_next_step
        opt.step(closure)
        return refreshes, dict(opt.stats)

    def snapshot(model: nn.Module, opt: torch.optim.Optimizer, generator: torch.Generator) -> tuple:
        return flat(model), copy.deepcopy(opt.state_dict()), generator.get_state()

    model, opt, generator = resumable(config, kind, seed=0)
    through, saved, reached = [], {}, {}
    for t in range(1, 2 * max(breaks) + 1):
        through.append(step(model, opt))
        if t in breaks:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "generator": generator.get_state()}, buffer)  # fmt: skip
            saved[t] = buffer.getvalue()
        reached[t] = snapshot(model, opt, generator)

    for k in breaks:
        checkpoint = torch.load(io.BytesIO(saved[k]), weights_only=True)
        resumed_model, resumed, resumed_generator = resumable(config, kind, seed=1)
        resumed_model.load_state_dict(checkpoint["model"])
        resumed.load_state_dict(checkpoint["optimizer"])
        resumed_generator.set_state(checkpoint["generator"])
        after = [step(resumed_model, resumed) for _ in range(k)]
        params, state, generator_state = reached[2 * k]
        assert torch.equal(flat(resumed_model), params), f"parameters, resumed after {k}"
        assert_same_state(resumed.state_dict(), state)
        assert torch.equal(resumed_generator.get_state(), generator_state)
        expected = through[k : 2 * k]
        assert [r for r, _ in after] == [r for r, _ in expected], f"refreshes_next_step, resumed after {k}"
        assert all(same_stats(a, b) for (_, a), (_, b) in zip(after, expected)), (k, after, expected)


@pytest.mark.parametrize("cls", [SophiaH, SophiaG], ids=lambda cls: cls.__name__)
def test_sophia_optimizer_loaded_between_update_hessian_and_step_takes_the_same_step(cls):
    """``update_hessian`` refreshes :math:`h` for the next step, which then takes no estimate of its own (SophiaH's
    loop keeps the gradient's graph, from which a refresh step would take one): an optimizer loaded from the
    ``state_dict`` written between the two takes bitwise the step the original takes, with the same stats and
    probe draws."""
    results = []
    for reload in (False, True):
        model, x, y = mlp_problem()
        generator = torch.Generator().manual_seed(3)
        opt = cls(model.parameters(), lr=1e-2, update_period=2, generator=generator)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        opt.update_hessian(loss if cls is SophiaH else logits)
        loss.backward(create_graph=cls is SophiaH)
        if reload:
            buffer = io.BytesIO()
            torch.save(opt.state_dict(), buffer)
            opt = cls(model.parameters(), lr=1e-2, update_period=2, generator=generator)
            opt.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
        opt.step()
        results.append((flat(model), copy.deepcopy(opt.state_dict()), dict(opt.stats), generator.get_state()))
    (params, state, stats, draws), (reloaded_params, reloaded_state, reloaded_stats, reloaded_draws) = results
    assert torch.equal(reloaded_params, params) and torch.equal(reloaded_draws, draws)
    assert_same_state(reloaded_state, state)
    assert same_stats(reloaded_stats, stats) and stats["hessian_refreshed"] == 1.0


class NaNCurvature(torch.autograd.Function):
    """Identity whose backward is NaN: inside a first derivative it poisons only the second."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * math.nan


class Square(torch.autograd.Function):
    """``x^2`` with a finite gradient ``2x`` whose own derivative is NaN."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 2 * NaNCurvature.apply(x)


GGN_CURVATURE = {("sophia_g", "curvature"), ("newton_ggn", "curvature")}  # Square poisons H, not G: tested below


def poisoned_closure(model, x, y, cause):
    def closure():
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        w = model[0].weight
        if cause == "loss":
            loss = loss + math.inf
        elif cause == "gradient":
            loss = loss + torch.sqrt(w - w.detach()).sum()  # value 0, gradient inf
        elif cause == "curvature":
            loss = loss + 1e-3 * Square.apply(w).sum()
        return loss, logits

    return closure


def assert_same_state(after: dict, before: dict) -> None:
    """Two optimizer ``state_dict``s hold the same groups and bitwise the same state."""
    assert after["param_groups"] == before["param_groups"]
    assert after["state"].keys() == before["state"].keys()
    for key, values in before["state"].items():
        assert after["state"][key].keys() == values.keys()
        for field, value in values.items():
            new = after["state"][key][field]
            same = torch.equal(value, new) if isinstance(value, Tensor) else value == new
            assert same, f"state {key}/{field} changed"


@pytest.mark.parametrize(
    "name, cause",
    [(n, c) for n in NAMES for c in ("loss", "gradient", "curvature") if (n, c) not in GGN_CURVATURE],
)
def test_non_finite_step_is_skipped_with_warning_and_state_kept(name, cause):
    model, x, y = mlp_problem()
    opt = make(name, model.parameters())
    good = poisoned_closure(model, x, y, None)
    for _ in range(3):  # state exists and the next step (the 4th) refreshes Sophia's estimate
        opt.step(good)
    params, state = flat(model), copy.deepcopy(opt.state_dict())
    with pytest.warns(RuntimeWarning, match=f"non-finite {cause}"):
        opt.step(poisoned_closure(model, x, y, cause))
    assert torch.equal(flat(model), params)
    assert opt.stats["step_skipped"] == 1.0
    assert_same_state(opt.state_dict(), state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step(good)
    assert opt.stats["step_skipped"] == 0.0 and not torch.equal(flat(model), params)


# ------------------------------------------------------------- hyperparameters and odd inputs

BAD_HYPERPARAMETERS = {  # per optimizer, values that each hyperparameter must refuse
    NewtonCG: dict(lr=math.nan, damping=math.inf, weight_decay=-1.0, max_cg_iters=0, cg_tol=math.nan,
                   progress_tol=-math.inf, warm_start_decay=1.5, precond_exponent=math.nan, precond_beta=1.0),
    SophiaH: dict(lr=math.nan, betas=(0.9, math.nan), rho=math.inf, weight_decay=math.nan, eps=0.0,
                  update_period=2.5, num_samples=0),
    SophiaG: dict(lr=math.inf, betas=(math.nan, 0.99), rho=math.nan, eps=math.nan, update_period=0),
    AdaHessian: dict(lr=math.nan, betas=(0.9, 1.0), eps=math.inf, weight_decay=math.inf, hessian_power=math.nan),
}  # fmt: skip


@pytest.mark.parametrize("cls", list(BAD_HYPERPARAMETERS), ids=lambda cls: cls.__name__)
def test_non_finite_or_out_of_range_hyperparameters_are_refused(cls):
    """In the constructor (as a default or a group's own value) and in ``add_param_group``."""
    model, _, _ = mlp_problem()
    first, second = list(model.parameters())[:2], list(model.parameters())[2:]
    for name, value in BAD_HYPERPARAMETERS[cls].items():
        match = f"{cls.__name__}: invalid {re.escape(name) + '.[01].' if name == 'betas' else name}: "
        with pytest.raises(ValueError, match=match):
            cls(first, **{name: value})
        if name == "num_samples":  # an argument of the constructor, not of a group
            continue
        with pytest.raises(ValueError, match=match):
            cls([{"params": first}, {"params": second, name: value}])
        opt = cls(first)
        with pytest.raises(ValueError, match=match):
            opt.add_param_group({"params": second, name: value})
        assert len(opt.param_groups) == 1
    with pytest.raises(ValueError) as error:
        cls(first, lr=math.nan)
    assert str(error.value) == f"{cls.__name__}: invalid lr: nan; expected a finite number >= 0"


@pytest.mark.parametrize("name", NAMES)
def test_update_that_would_make_a_parameter_non_finite_is_skipped(name):
    """A learning rate set to NaN after construction (as a scheduler could): nothing is written."""
    model, x, y = mlp_problem()
    opt = make(name, model.parameters())
    closure = poisoned_closure(model, x, y, None)
    opt.step(closure)
    for group in opt.param_groups:
        group["lr"] = math.nan
        if name.startswith("newton"):  # no trial points: the update is the first non-finite value
            group.update(backtrack=False, line_search=False, adapt_damping=False)
    params, state = flat(model), copy.deepcopy(opt.state_dict())
    with pytest.warns(RuntimeWarning, match="non-finite update \\(a new parameter or state value\\); the step was "
                      "skipped and the parameters and optimizer state left unchanged"):  # fmt: skip
        opt.step(closure)
    assert torch.equal(flat(model), params) and opt.stats["step_skipped"] == 1.0
    assert_same_state(opt.state_dict(), state)


@pytest.mark.parametrize("name", NAMES)
def test_step_with_every_parameter_frozen_changes_nothing_and_returns_the_loss(name):
    model, x, y = mlp_problem()
    model.requires_grad_(False)
    opt = make(name, model.parameters())
    params = flat(model)
    inputs = x.clone().requires_grad_()  # a loss with a graph (through the inputs), and one without
    for closure in (lambda: (F.cross_entropy(model(inputs), y), model(inputs)), poisoned_closure(model, x, y, None)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert torch.equal(opt.step(closure), F.cross_entropy(model(x), y))
    assert torch.equal(flat(model), params) and not any(opt.state.values()) and opt.stats["step_skipped"] == 0.0
    if not name.startswith("newton"):  # trainable, but no parameter has a gradient: a loop without a closure
        model.requires_grad_(True)
        assert opt.step() is None and torch.equal(flat(model), params) and not any(opt.state.values())


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("name", NAMES)
def test_sparse_gradients_are_refused_with_a_clear_error(name):
    embedding = torch.nn.Embedding(5, 3, sparse=True).double()
    tokens, targets = torch.tensor([0, 1, 2, 1]), torch.tensor([0, 1, 2, 0])
    opt = make(name, embedding.parameters())
    weight = embedding.weight.detach().clone()
    match = f"{type(opt).__name__} does not support sparse gradients \\(from nn.Embedding\\(sparse=True\\)"
    with pytest.raises(RuntimeError, match=match):
        opt.step(lambda: (F.cross_entropy(embedding(tokens), targets), embedding(tokens)))
    if not name.startswith("newton"):
        F.cross_entropy(embedding(tokens), targets).backward(create_graph=True)
        with pytest.raises(RuntimeError, match=match):
            opt.step()
    assert torch.equal(embedding.weight, weight)
    assert not any(isinstance(value, Tensor) for state in opt.state.values() for value in state.values())


def test_sophia_g_nan_logits_in_ignored_rows_never_reach_the_sampler():
    """The same steps, bit for bit up to rounding, as on the batch without those rows."""
    model, x, y = mlp_problem()
    ignored = torch.arange(10) % 3 == 0
    targets = torch.where(ignored, -100, y)
    results = []
    for with_ignored_rows in (True, False):
        net = copy.deepcopy(model)
        opt = SophiaG(net.parameters(), lr=1e-2, update_period=1, generator=torch.Generator().manual_seed(5))

        def closure():
            if with_ignored_rows:
                logits = torch.where(ignored[:, None], math.nan, net(x))
                return {"loss": F.cross_entropy(logits, targets), "outputs": logits, "targets": targets}
            logits = net(x[~ignored])
            return {"loss": F.cross_entropy(logits, y[~ignored]), "outputs": logits, "targets": y[~ignored]}

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):
                opt.step(closure)
        hessian = torch.cat([opt.state[p]["hessian"].reshape(-1) for p in net.parameters()])
        results.append((flat(net), hessian))
    assert results[0][1].any() and not torch.equal(results[0][0], flat(model))
    for with_nan, without in zip(*results):
        torch.testing.assert_close(with_nan, without, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("line_search", [True, False])
def test_newton_cg_skips_the_step_when_every_trial_point_is_non_finite(gen, line_search):
    a, b = spd(4, gen), torch.randn(4, generator=gen, dtype=DTYPE)
    theta = torch.randn(4, generator=gen, dtype=DTYPE, requires_grad=True)
    start = theta.detach().clone()

    def closure():  # finite at the starting point only
        return quadratic(a, b, [theta]) + torch.where((theta != start).any(), math.inf, 0.0)

    opt = NewtonCG([theta], line_search=line_search)
    with pytest.warns(RuntimeWarning, match="NewtonCG: non-finite loss at every trial point of the search; the step "
                      "was skipped and the parameters and optimizer state \\(but the damping, now 1.5\\) left"):
        loss = opt.step(closure)
    assert loss == quadratic(a, b, [start]) and torch.equal(theta.detach(), start)
    assert opt.stats["step_skipped"] == 1.0 and opt.stats["step_size"] == 0.0
    assert opt.state[theta] == {"damping": 1.5}


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_sophia_h_create_graph_loop_refreshes_as_the_closure_does():
    """``loss.backward(create_graph=True); opt.step()``: the estimate through p.grad's graph, probe for probe."""
    results = []
    for mode in ("closure", "plain"):
        model, x, y = mlp_problem()
        opt = SophiaH(model.parameters(), lr=1e-2, update_period=2, generator=torch.Generator().manual_seed(7))
        hessians = []
        for step in range(4):
            step_on_mlp(opt, model, x, y, mode)
            assert opt.stats["hessian_refreshed"] == float(step % 2 == 0)
            hessians.append(torch.cat([opt.state[p]["hessian"].reshape(-1) for p in model.parameters()]))
        results.append((flat(model), hessians))
    assert results[0][1][0].any() and not torch.equal(results[0][1][0], results[0][1][2])
    for closure_loop, plain_loop in zip([results[0][0], *results[0][1]], [results[1][0], *results[1][1]]):
        torch.testing.assert_close(plain_loop, closure_loop, rtol=1e-12, atol=1e-14)


def test_sophia_without_an_estimate_or_with_the_wrong_update_hessian_argument_raises():
    model, x, y = mlp_problem()
    for cls, hint in ((SophiaH, "loss.backward\\(create_graph=True\\)"), (SophiaG, "update_hessian\\(logits\\)")):
        opt = cls(model.parameters())
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()  # no graph, no update_hessian: h would stay 0
        params = flat(model)
        with pytest.raises(RuntimeError, match=f"{cls.__name__}.step\\(\\) without a closure found no Hessian "
                           f"estimate on its first step.*{hint}"):  # fmt: skip
            opt.step()
        assert torch.equal(flat(model), params) and not any(opt.state.values())
    logits = model(x)
    with pytest.raises(TypeError, match="SophiaH.update_hessian takes the scalar loss with its graph \\(before "
                       "loss.backward\\(\\)\\), got \\(10, 3\\); logits are what SophiaG.update_hessian takes"):
        SophiaH(model.parameters()).update_hessian(logits)
    with pytest.raises(RuntimeError, match="SophiaH.update_hessian: the loss has no autograd graph"):
        SophiaH(model.parameters()).update_hessian(F.cross_entropy(logits, y).detach())
    with pytest.raises(ValueError, match="SophiaG takes logits with at least 2 classes in the last dimension, "
                       "got \\(\\)"):  # fmt: skip
        SophiaG(model.parameters()).update_hessian(F.cross_entropy(logits, y))


# ------------------------------------------------------------------------- a tiny transformer


def lm_batch():
    gen = torch.Generator().manual_seed(3)
    start = torch.randint(0, 16, (6, 1), generator=gen)
    tokens = (start + torch.arange(13) * torch.randint(1, 3, (6, 1), generator=gen)) % 16
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize(
    "name, factory, steps",
    [
        ("NewtonCG", lambda p: NewtonCG(p), 4),
        ("NewtonCG-hessian", lambda p: NewtonCG(p, curvature="hessian"), 4),
        ("SophiaG", lambda p: SophiaG(p, lr=2e-2), 15),
        ("SophiaH", lambda p: SophiaH(p, lr=2e-2), 15),
        ("AdaHessian", lambda p: AdaHessian(p, lr=2e-2), 25),
    ],
)
def test_each_optimizer_trains_a_tiny_transformer(name, factory, steps):
    torch.manual_seed(0)
    model = Transformer(vocab_size=16, n_outputs=16, d_model=16, n_heads=2, n_kv_heads=1, n_layers=2).double()
    x, y = lm_batch()
    opt = factory(model.parameters())

    def closure():
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()), logits

    losses = [float(opt.step(closure)) for _ in range(steps)]
    with torch.no_grad():
        final = closure()[0].item()
    assert all(math.isfinite(v) for v in opt.stats.values() if isinstance(v, float) and v == v)
    assert final < 0.6 * losses[0], f"{name}: loss {losses[0]:.3f} -> {final:.3f}"


def test_newton_cg_skips_non_finite_gauss_newton_products():
    model, x, y = mlp_problem()
    opt = NewtonCG(model.parameters())
    params = flat(model)

    def closure():
        logits = model(x)
        return {"loss": F.cross_entropy(logits, y), "outputs": logits, "loss_hessian": lambda z, u: u * math.nan}

    with pytest.warns(RuntimeWarning, match="non-finite curvature"):
        opt.step(closure)
    assert torch.equal(flat(model), params) and opt.stats["step_skipped"] == 1.0


def test_closure_dict_targets_mask_ignored_rows_of_the_gauss_newton_matrix():
    model, x, y = mlp_problem()
    targets = y.clone()
    targets[::3] = -100
    results = []
    for per_batch in (True, False):
        net = copy.deepcopy(model)
        loss_hessian = "cross_entropy" if per_batch else optim.CrossEntropyHessian(targets)
        opt = NewtonCG(net.parameters(), loss_hessian=loss_hessian, **EXACT)

        def closure():
            logits = net(x)
            loss = F.cross_entropy(logits, targets)
            return {"loss": loss, "outputs": logits, "targets": targets} if per_batch else (loss, logits)

        opt.step(closure)
        results.append(flat(net))
    assert torch.equal(results[0], results[1]) and not torch.equal(results[0], flat(model))
    with pytest.raises(TypeError, match="unknown keys"):
        opt.step(lambda: {"loss": F.cross_entropy(model(x), y), "logits": model(x)})


@pytest.mark.parametrize("name", ["newton_ggn", "sophia_h", "adahessian"])
def test_complex_parameters_are_refused(name):
    """AdaHessian took a step on a complex parameter (its state holding a complex D^2, the parameter changed) and
    then failed with 'value cannot be converted to type double without overflow'; now every optimizer refuses."""
    real, c = nn.Parameter(torch.ones(2, dtype=DTYPE)), nn.Parameter(torch.ones(3, dtype=torch.complex128))
    with pytest.raises(TypeError, match="does not support complex parameters"):
        make(name, [real, c])
    opt = make(name, [real])
    with pytest.raises(TypeError, match="does not support complex parameters"):
        opt.add_param_group({"params": iter([c])})
    assert len(opt.param_groups) == 1


# ------------------------------------------------------------------------- parameters the loss does not reach


class WithUnused(nn.Module):
    """``MLP([4, 6, 3])`` and a parameter the forward does not use (``uses`` turns it on: it then adds
    ``0.1 * tanh(extra).sum()`` to the logits), registered between the layers or last (not first: the optimizers
    keep their step count in the first parameter's state)."""

    def __init__(self, last: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 6, dtype=DTYPE)
        holder = nn.Module()
        holder.extra = nn.Parameter(torch.randn(5, dtype=DTYPE))
        if not last:
            self.holder = holder
        self.second = nn.Linear(6, 3, dtype=DTYPE)
        if last:
            self.holder = holder
        self.uses = False

    @property
    def extra(self) -> nn.Parameter:
        return self.holder.extra

    def forward(self, x: Tensor) -> Tensor:
        logits = self.second(torch.tanh(self.first(x)))
        return logits + 0.1 * torch.tanh(self.extra).sum() if self.uses else logits


def unused_problem(last: bool = False):
    model = WithUnused(last)
    x, y = torch.randn(10, 4, dtype=DTYPE), torch.randint(0, 3, (10,))
    return model, x, y


def make_decayed(name: str, params, **kwargs):
    seeded = torch.Generator().manual_seed(3)
    return {
        "newton_ggn": lambda: NewtonCG(params, preconditioner="hutchinson", max_cg_iters=5, weight_decay=0.1,
                                       generator=seeded, **kwargs),
        "newton_hessian": lambda: NewtonCG(params, curvature="hessian", preconditioner="squared_gradients",
                                           max_cg_iters=5, weight_decay=0.1, **kwargs),
        "sophia_h": lambda: SophiaH(params, lr=1e-2, update_period=2, weight_decay=0.2, generator=seeded, **kwargs),
        "sophia_g": lambda: SophiaG(params, lr=1e-2, update_period=2, weight_decay=0.2, generator=seeded, **kwargs),
        "adahessian": lambda: AdaHessian(params, lr=1e-2, weight_decay=0.2, generator=seeded, **kwargs),
    }[name]()


def closure_of(model, x, y):
    return lambda: (F.cross_entropy(model(x), y), model(x))


@pytest.mark.parametrize("name", NAMES)
def test_a_parameter_the_closure_loss_does_not_reach_is_skipped_as_torch_optim_skips_it(name):
    """With a closure, a trainable parameter the loss does not use was given a zero gradient: weight decay moved
    it, it got optimizer state and p.grad = 0 (torch.optim skips it: no grad). Now it is left out of the step, and
    the others step exactly as with the parameter not given to the optimizer at all (same probes, same CG)."""
    results = []
    for listed in (True, False):
        model, x, y = unused_problem()
        reached = [*model.first.parameters(), *model.second.parameters()]
        params = list(model.parameters()) if listed else reached
        opt = make_decayed(name, params)
        extra = model.extra.detach().clone()
        for _ in range(3):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                opt.step(closure_of(model, x, y))
            assert opt.stats["step_skipped"] == 0.0
        assert torch.equal(model.extra, extra) and model.extra.grad is None and not opt.state.get(model.extra)
        assert all(p.grad is not None for p in params if p is not model.extra)
        results.append(flat(model))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("name", ["sophia_h", "sophia_g", "adahessian"])
def test_closure_and_plain_loop_agree_on_a_parameter_the_loss_reaches_on_some_steps_only(name):
    """The closure and ``loss.backward(); opt.step()`` give identical parameters and state with weight decay when
    a parameter is unused (on every step, or on some: skipped on those, as torch.optim skips a None p.grad)."""
    schedules = [[False] * 3, [True, False, True, False, False], [False, True, False, True, True]]
    for schedule in schedules[:2] if name == "sophia_g" else schedules:  # SophiaG's loop refreshes when told
        results = []
        for mode in ("closure", "plain"):
            model, x, y = unused_problem()
            opt = make_decayed(name, model.parameters())
            history = []
            for step, uses in enumerate(schedule):
                model.uses = uses
                before = model.extra.detach().clone(), copy.deepcopy(opt.state.get(model.extra, {}))
                if mode == "closure":
                    opt.step(closure_of(model, x, y))
                else:
                    opt.zero_grad()
                    logits = model(x)
                    loss = F.cross_entropy(logits, y)
                    if name == "sophia_g" and step % 2 == 0:
                        opt.update_hessian(logits)
                    loss.backward(create_graph=name != "sophia_g")
                    opt.step()
                if not uses:
                    assert model.extra.grad is None and torch.equal(model.extra, before[0])
                    after = opt.state.get(model.extra, {})
                    assert after.keys() == before[1].keys()
                    assert all(torch.equal(torch.as_tensor(after[k]), torch.as_tensor(v)) for k, v in before[1].items())
                history.append(opt.stats.get("hessian_refreshed"))
            state = [opt.state[p] for p in model.parameters() if p in opt.state]
            results.append((flat(model), state, history))
        torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=1e-14)
        assert results[0][2] == results[1][2]
        assert len(results[0][1]) == len(results[1][1])
        for closure_state, plain_state in zip(results[0][1], results[1][1]):
            assert closure_state.keys() == plain_state.keys()
            for key, value in closure_state.items():
                torch.testing.assert_close(plain_state[key], value, rtol=1e-12, atol=1e-14)


def test_sophia_h_forward_mode_skips_an_unreached_parameter_and_keeps_the_reached_estimate():
    """Forward mode learns which parameters the loss reaches from the first probe's pass; its probes cover every
    parameter, so with the unused one last the reached ones see, on the first refresh, the probes of a reverse-mode
    run without it (the next refresh's differ: the unused one's draws advanced the generator)."""
    results = []
    for mode in ("forward", "reverse"):
        model, x, y = unused_problem(last=True)
        reached = [*model.first.parameters(), *model.second.parameters()]
        params = list(model.parameters()) if mode == "forward" else reached
        opt = SophiaH(params, lr=1e-2, update_period=2, weight_decay=0.2, distribution="rademacher",
                      generator=torch.Generator().manual_seed(3), mode=mode, module=model)
        extra = model.extra.detach().clone()
        refreshed = []
        for _ in range(2):
            opt.step(lambda: F.cross_entropy(model(x), y))
            refreshed.append(opt.stats["hessian_refreshed"])
        assert refreshed == [1.0, 0.0] and opt.refreshes_next_step
        assert torch.equal(model.extra, extra) and model.extra.grad is None and not opt.state.get(model.extra)
        results.append(flat(model))
    torch.testing.assert_close(results[0], results[1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["closure", "plain"])
def test_sophia_a_parameter_never_reached_does_not_make_every_step_a_refresh(mode):
    """With a closure whose loss never reaches a parameter, or in a ``backward(create_graph=True); step()`` loop
    that never gives it a ``p.grad``: ``refreshes_next_step`` follows the schedule, as the steps do."""
    model, x, y = unused_problem()
    opt = SophiaH(model.parameters(), lr=1e-2, update_period=3)
    refreshed = []
    for _ in range(6):
        refreshed.append(opt.refreshes_next_step)
        if mode == "closure":
            opt.step(lambda: F.cross_entropy(model(x), y))
        else:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward(create_graph=True)
            opt.step()
        assert opt.stats["hessian_refreshed"] == refreshed[-1]
    assert refreshed == [True, False, False, True, False, False]


def test_newton_cg_step_with_an_unreached_parameter_matches_the_closed_form(gen):
    """On a quadratic of two tensors and a third it does not use, with weight decay: one exact damped Newton step
    of the two, :math:`(1 - \\eta \\lambda)\\theta + \\eta x`, :math:`A x = b - A\\theta`; the third unchanged."""
    a, b = spd(5, gen), torch.randn(5, dtype=DTYPE, generator=gen)
    first, second = split(torch.randn(5, dtype=DTYPE, generator=gen), (2, 3))
    unused = torch.randn(4, dtype=DTYPE, generator=gen).requires_grad_()
    theta, kept = torch.cat([first, second]).detach(), unused.detach().clone()
    opt = NewtonCG([first, unused, second], lr=0.5, weight_decay=0.3, max_cg_iters=20, **EXACT)
    opt.step(lambda: quadratic(a, b, [first, second]))
    expected = (1 - 0.5 * 0.3) * theta + 0.5 * torch.linalg.solve(a, b - a @ theta)
    torch.testing.assert_close(torch.cat([first, second]).detach(), expected, rtol=1e-10, atol=1e-12)
    assert torch.equal(unused, kept) and unused.grad is None and not opt.state.get(unused)
