"""What makes second-order steps cheaper, in float64 on the CPU: Martens' CG stopping
rule, preconditioned CG, NewtonCG's curvature mini-batch and forward-mode products, and the attention
switch that runs the steps without curvature on torch SDPA."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import hessian
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.profile_step import Counter, Profiler
from optim import AdaHessian, NewtonCG, SophiaG, SophiaH, cg, hvp
from optim import CrossEntropyHessian, GGNOperator, _autodiff, functional
from recipes.common.config import ConfigError
from recipes.common.transformer import AttentionSwitch, Transformer
from recipes.lm import optimizers
from recipes.lm.model import GPT
from recipes.lm.train import load_config
from tests.models import MLP
from tests.runs import LM

DTYPE = torch.float64
EXACT = dict(adapt_damping=False, backtrack=False, line_search=False, warm_start_decay=0.0, cg_tol=1e-14)


def spd(n: int, gen: torch.Generator, eigenvalues: Tensor) -> Tensor:
    """A random symmetric matrix with the given eigenvalues."""
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=DTYPE))
    return q @ torch.diag(eigenvalues) @ q.T


# ------------------------------------------------------------------------------------------------ CG


@pytest.mark.parametrize(("eps", "window"), [(5e-4, 10), (1e-2, 2), (1e-3, 1)])
def test_cg_progress_rule_stops_at_the_first_iteration_where_it_holds(gen, eps, window):
    """Martens (2010): stop at i > k when phi_i < 0 and (phi_i - phi_{i-k}) / phi_i < k eps, k = max(window, i/10).
    With window 1 the rule holds only past iteration 30 (33-39 over 30 seeds), where k = i/10 > window: k = window
    there (the i/10 term dropped) went unnoticed by the other two cases, which stop before i/10 exceeds the window."""
    n = 80  # condition number 1e3: over 200 seeds the rule first holds by iteration 46 (1e4: never, for 15% of them)
    a = spd(n, gen, torch.logspace(-3, 0, n, dtype=DTYPE))
    b = torch.randn(n, generator=gen, dtype=DTYPE)
    matvec = lambda v: (a @ v[0],)  # noqa: E731
    full = cg(matvec, (b,), max_iter=n, tol=0.0, save_at=range(1, n + 1))
    phi = [0.0] + [it.objective for it in full.iterates]  # phi(x_0 = 0) = 0
    for i, it in enumerate(full.iterates, 1):  # phi from its definition, not from CG's own bookkeeping
        x = it.x[0]
        assert phi[i] == pytest.approx(float(0.5 * x @ a @ x - b @ x), rel=1e-9)
    expected = next(
        i for i in range(1, n + 1)
        if i > (k := max(window, math.ceil(i / 10))) and phi[i] < 0 and (phi[i] - phi[i - k]) / phi[i] < k * eps
    )  # fmt: skip
    stopped = cg(matvec, (b,), max_iter=n, tol=0.0, progress_tol=eps, progress_window=window)
    assert (stopped.status, stopped.iterations) == ("progress", expected)
    assert expected < n
    if window == 1:
        assert math.ceil(expected / 10) > window, "the case must reach iterations where k = i/10"


def test_preconditioned_cg_solves_an_ill_conditioned_system_in_fewer_iterations(gen):
    """A = D C D with D spanning 4 decades: Jacobi preconditioning (M = diag A) undoes most of the scaling."""
    n = 60
    c = spd(n, gen, torch.linspace(1, 4, n, dtype=DTYPE))
    d = torch.diag(torch.logspace(-2, 2, n, dtype=DTYPE)[torch.randperm(n, generator=gen)])
    a, b = d @ c @ d, torch.randn(n, generator=gen, dtype=DTYPE)
    matvec = lambda v: (a @ v[0],)  # noqa: E731
    jacobi = lambda r: (r[0] / a.diagonal(),)  # noqa: E731
    expected = torch.linalg.solve(a, b)
    plain = cg(matvec, (b,), max_iter=10 * n, tol=1e-10)
    preconditioned = cg(matvec, (b,), max_iter=10 * n, tol=1e-10, precondition=jacobi)
    assert preconditioned.status == "converged"
    assert preconditioned.iterations < plain.iterations / 3, (preconditioned.iterations, plain.iterations)
    torch.testing.assert_close(preconditioned.x[0], expected, rtol=1e-6, atol=1e-8)


def test_newton_cg_hutchinson_preconditioner_is_martens_diagonal(gen):
    """With a diagonal curvature, Rademacher probes give diag B exactly, so M = (diag B + lambda)^xi with xi = 1 is
    the damped system itself: PCG solves it in one iteration, plain CG needs one per distinct eigenvalue."""
    n, damping = 6, 0.3
    curvature = torch.rand(n, generator=gen, dtype=DTYPE) * 10 + 0.1
    c = torch.randn(n, generator=gen, dtype=DTYPE)
    theta0 = torch.randn(n, generator=gen, dtype=DTYPE)
    expected = theta0 - (curvature * theta0 + c) / (curvature + damping)
    iterations = {}
    for preconditioner in (None, "hutchinson"):
        theta = theta0.clone().requires_grad_()
        opt = NewtonCG([theta], damping=damping, curvature="hessian", max_cg_iters=n, preconditioner=preconditioner,
                       precond_exponent=1.0, **EXACT)  # fmt: skip
        opt.step(lambda: (0.5 * curvature * theta**2 + c * theta).sum())
        torch.testing.assert_close(theta.detach(), expected, rtol=1e-10, atol=1e-12)
        iterations[preconditioner] = opt.stats["cg_iters"]
    assert iterations == {None: n, "hutchinson": 1}


def test_newton_cg_preconditioner_diagonal_is_an_ema_of_absolute_estimates(gen):
    """An indefinite diagonal Hessian a (Rademacher probes give z * Hz = a exactly): the Hutchinson estimate kept is
    |a|, and over two steps the diagonal is beta d_1 + (1 - beta) e_2. Before, only one step on a positive diagonal
    was checked: the abs dropped, and the EMA's weights swapped, both went unnoticed."""
    n, beta = 6, 0.7
    a = torch.rand(n, generator=gen, dtype=DTYPE) * 4 + 0.5
    a[::2] *= -1
    c = torch.randn(n, generator=gen, dtype=DTYPE)
    theta = torch.randn(n, generator=gen, dtype=DTYPE).requires_grad_()
    opt = NewtonCG([theta], damping=10.0, curvature="hessian", max_cg_iters=n, preconditioner="hutchinson",
                   precond_beta=beta, **EXACT)  # fmt: skip
    opt.step(lambda: (0.5 * a * theta**2 + c * theta).sum())
    torch.testing.assert_close(opt.state[theta]["precond_diagonal"], a.abs(), rtol=1e-14, atol=0)
    squared = NewtonCG([theta], damping=10.0, curvature="hessian", max_cg_iters=n, preconditioner="squared_gradients",
                       precond_beta=beta, **EXACT)  # fmt: skip
    grads = []
    for _ in range(2):
        grads.append((a * theta + c).detach())
        squared.step(lambda: (0.5 * a * theta**2 + c * theta).sum())
    expected = beta * grads[0] ** 2 + (1 - beta) * grads[1] ** 2
    torch.testing.assert_close(squared.state[theta]["precond_diagonal"], expected, rtol=1e-13, atol=0)


def test_newton_cg_bartlett_preconditioner_is_the_gauss_newton_bartlett_diagonal_of_the_curvature_rows(gen):
    """preconditioner='bartlett' with curvature_batch 3: d = 3 g_hat^2, g_hat the gradient of the mean cross-entropy of
    rows 0-2 at labels drawn (seeded generator) from their softmax; PCG still solves (G_3 + lambda I) x = -g_8."""
    x, y, w0 = softmax_regression(gen)
    damping = 0.1
    weight = w0.clone().requires_grad_()
    # up to 2n iterations for n = 12 unknowns: in floating point PCG may need more than n (14 on seed 1766728149)
    opt = NewtonCG([weight], damping=damping, curvature_batch=3, preconditioner="bartlett", max_cg_iters=24,
                   generator=torch.Generator().manual_seed(7), **EXACT)  # fmt: skip
    opt.step(softmax_regression_closure(x, y, weight))
    probabilities = torch.softmax(x[:3] @ w0, dim=-1)
    labels = torch.multinomial(probabilities.float(), 1, generator=torch.Generator().manual_seed(7)).squeeze(-1)
    g_hat = torch.func.grad(lambda w: F.cross_entropy(x[:3] @ w, labels))(w0)
    torch.testing.assert_close(opt.state[weight]["precond_diagonal"], 3 * g_hat**2, rtol=1e-12, atol=1e-15)
    g = torch.func.grad(lambda w: F.cross_entropy(x @ w, y))(w0).reshape(-1)
    g3 = hessian(lambda w: F.cross_entropy(x[:3] @ w, y[:3]))(w0).reshape(12, 12)
    step = torch.linalg.solve(g3 + damping * torch.eye(12, dtype=DTYPE), -g)
    torch.testing.assert_close(weight.detach(), w0 + step.reshape(3, 4), rtol=1e-9, atol=1e-11)
    with pytest.raises(ValueError, match="preconditioner='bartlett'\\) estimates the Gauss-Newton diagonal"):
        NewtonCG([weight], curvature="hessian", preconditioner="bartlett")
    with pytest.raises(RuntimeError, match="preconditioner='bartlett'\\) samples labels .* returns the outputs"):
        NewtonCG([weight], preconditioner="bartlett").step(lambda: F.cross_entropy(x @ weight, y))


def test_newton_cg_passes_the_progress_window_to_cg(gen):
    """A long CG solve stops earlier with a short window (Martens' k = 10 cannot stop before iteration 11)."""
    n = 40
    a = spd(n, gen, torch.logspace(-3, 0, n, dtype=DTYPE))
    b = torch.randn(n, generator=gen, dtype=DTYPE)
    iterations = []
    for window in (10, 2):
        theta = torch.zeros(n, dtype=DTYPE, requires_grad=True)
        opt = NewtonCG([theta], damping=0.0, curvature="hessian", max_cg_iters=n, progress_tol=1e-2,
                       progress_window=window, **EXACT)  # fmt: skip
        opt.step(lambda: 0.5 * theta @ a @ theta - b @ theta)
        iterations.append(opt.stats["cg_iters"])
    assert 10 < iterations[0] < n and iterations[1] < iterations[0], iterations


# ------------------------------------------------------------------------------- curvature mini-batch


def softmax_regression(gen, rows=8, features=3, classes=4):
    x = torch.randn(rows, features, generator=gen, dtype=DTYPE)
    y = torch.randint(0, classes, (rows,), generator=gen)
    weight = torch.randn(features, classes, generator=gen, dtype=DTYPE)
    return x, y, weight


@pytest.mark.parametrize("curvature_batch", [3, 0.4])
def test_curvature_batch_takes_the_products_on_exactly_the_requested_rows(gen, curvature_batch):
    """Gradient of all 8 rows, curvature of the first floor(0.4 * 8) = 3: the step is -(G_3 + lambda I)^-1 g_8,
    G_3 the Hessian (= GGN, the model is linear) of the mean loss over rows 0-2 by torch.func."""
    x, y, w0 = softmax_regression(gen)
    damping = 0.1
    weight = w0.clone().requires_grad_()
    seen = []

    def closure(rows=slice(None)):
        seen.append(torch.arange(len(x))[rows].tolist())
        logits = x[rows] @ weight
        return F.cross_entropy(logits, y[rows]), logits

    opt = NewtonCG([weight], damping=damping, curvature_batch=curvature_batch, max_cg_iters=12, **EXACT)
    opt.step(closure)
    assert seen == [list(range(8)), [0, 1, 2]]
    assert opt.stats["curvature_rows"] == 3 and opt.differentiates_twice(rows=True) and not opt.differentiates_twice()
    g = torch.func.grad(lambda w: F.cross_entropy(x @ w, y))(w0).reshape(-1)
    g3 = hessian(lambda w: F.cross_entropy(x[:3] @ w, y[:3]))(w0).reshape(12, 12)
    step = torch.linalg.solve(g3 + damping * torch.eye(12, dtype=DTYPE), -g)
    torch.testing.assert_close(weight.detach(), w0 + step.reshape(3, 4), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weight.grad, g.reshape(3, 4), rtol=1e-12, atol=1e-14)


def test_curvature_batch_bad_input_is_named(gen):
    x, y, w0 = softmax_regression(gen)
    weight = w0.clone().requires_grad_()
    for bad in (1.0, 0.0, 0, -2, True, "half"):
        with pytest.raises(ValueError, match=f"invalid curvature_batch: {bad!r}; expected None"):
            NewtonCG([weight], curvature_batch=bad)
    with pytest.raises(TypeError, match=r"closure\(rows\).*takes no argument: write it as def closure"):
        NewtonCG([weight], curvature_batch=2).step(lambda: F.cross_entropy(x @ weight, y))
    with pytest.raises(RuntimeError, match=r"curvature_batch=0.5\) takes the batch's rows from .* returned neither"):
        NewtonCG([weight], curvature_batch=0.5, curvature="hessian").step(lambda rows=None: (x @ weight).sum())
    with pytest.raises(ValueError, match="mode='forward'\\) needs module="):
        NewtonCG([weight], mode="forward")


def rho_that_splits(m: Tensor, h: Tensor) -> float:
    """A rho at which Sophia's first step clip(m / max(rho h, eps), 1) clips some coordinates and leaves others
    unclipped, for any data: the geometric mean of the two middle ratios |m| / h over the coordinates with h > 0
    (a fixed rho left every coordinate clipped on some seeds, and the step then did not depend on h)."""
    ratios = (m.abs() / h)[h > 0].sort().values
    assert len(ratios) > 0, "no positive curvature estimate: every coordinate is clipped at any rho"
    if len(ratios) == 1:
        return 2 * ratios[0].item()
    middle = len(ratios) // 2
    return math.sqrt(ratios[middle - 1].item() * ratios[middle].item())


def softmax_regression_closure(x: Tensor, y: Tensor, weight: Tensor, seen: list | None = None):
    def closure(rows=slice(None)):
        if seen is not None:
            seen.append(torch.arange(len(x))[rows].tolist())
        logits = x[rows] @ weight
        return F.cross_entropy(logits, y[rows]), logits

    return closure


def check_first_step_on_three_rows(make_optimizer, x, y, w0, g, h, lr, b1, eps) -> Tensor:
    """The first step of a Sophia optimizer ``make_optimizer(weight, rho)`` refreshing its estimate on rows 0-2: the
    closure sees all 8 rows, then rows 0-2, and the step is theta - lr clip(m / max(rho h, eps), 1) with
    m = (1 - b1) g, for a rho that clips some coordinates and not others. Returns the stepped weight."""
    rho = rho_that_splits((1 - b1) * g, h)
    weight, seen = w0.clone().requires_grad_(), []
    opt = make_optimizer(weight, rho)
    opt.step(softmax_regression_closure(x, y, weight, seen))
    assert seen == [list(range(8)), [0, 1, 2]] and opt.stats["hessian_rows"] == 3
    assert 0 < opt.stats["unclipped_fraction"] < 1  # else the step would not depend on h
    expected = w0 - lr * ((1 - b1) * g / (rho * h).clamp_min(eps)).clamp(-1, 1)
    torch.testing.assert_close(weight.detach(), expected, rtol=1e-12, atol=1e-14)
    return weight


@pytest.mark.parametrize("hessian_batch", [3, 0.4])
def test_sophia_h_hessian_batch_estimates_on_exactly_the_requested_rows(gen, hessian_batch):
    """A refresh with hessian_batch: gradient g_8 of all 8 rows from closure(), h_hat = u * (H_3 u) from closure(rows
    0-2), H_3 the Hessian of the mean loss over rows 0-2 by torch.func, u the Gaussian probe of the seeded generator;
    the first step is then theta - lr clip(m / max(rho h, eps), 1) with m = (1 - b1) g_8, h = (1 - b2) h_hat."""
    x, y, w0 = softmax_regression(gen)
    lr, (b1, b2), eps = 0.1, (0.9, 0.99), 1e-15
    u = torch.randn(w0.shape, generator=torch.Generator().manual_seed(3), dtype=DTYPE)
    h3 = hessian(lambda w: F.cross_entropy(x[:3] @ w, y[:3]))(w0).reshape(12, 12)
    h = (1 - b2) * u * (h3 @ u.reshape(-1)).reshape(u.shape)
    g = torch.func.grad(lambda w: F.cross_entropy(x @ w, y))(w0)
    weight = check_first_step_on_three_rows(
        lambda weight, rho: SophiaH([weight], lr=lr, betas=(b1, b2), rho=rho, weight_decay=0.0, eps=eps,
                                    hessian_batch=hessian_batch, generator=torch.Generator().manual_seed(3)),
        x, y, w0, g, h, lr, b1, eps)
    torch.testing.assert_close(weight.grad, g, rtol=1e-12, atol=1e-14)


def test_sophia_bias_correction_divides_h_by_one_minus_beta2_to_the_refreshes(gen):
    """bias_correction=True: the first step's denominator is rho * h / (1 - b2) = rho * h_hat (one estimate, not
    (1 - b2) of it); by a closure and by update_hessian (which counts its refresh too); the default leaves the
    paper's update; a non-bool is refused."""
    x, y, w0 = softmax_regression(gen)
    lr, (b1, b2), eps = 0.1, (0.9, 0.99), 1e-15
    u = torch.randn(w0.shape, generator=torch.Generator().manual_seed(3), dtype=DTYPE)
    h3 = hessian(lambda w: F.cross_entropy(x[:3] @ w, y[:3]))(w0).reshape(12, 12)
    h_hat = u * (h3 @ u.reshape(-1)).reshape(u.shape)
    g = torch.func.grad(lambda w: F.cross_entropy(x @ w, y))(w0)
    for corrected in (True, False):
        # each case's rho splits its own denominator, so that ignoring the correction (h 100x smaller) would clip more
        rho = rho_that_splits((1 - b1) * g, h_hat if corrected else (1 - b2) * h_hat)
        denominator = rho * (h_hat if corrected else (1 - b2) * h_hat)
        expected = w0 - lr * ((1 - b1) * g / denominator.clamp_min(eps)).clamp(-1, 1)
        weight = w0.clone().requires_grad_()
        opt = SophiaH([weight], lr=lr, betas=(b1, b2), rho=rho, weight_decay=0.0, eps=eps, hessian_batch=3,
                      bias_correction=corrected, generator=torch.Generator().manual_seed(3))  # fmt: skip
        opt.step(softmax_regression_closure(x, y, weight))
        torch.testing.assert_close(weight.detach(), expected, rtol=1e-12, atol=1e-14)
        assert opt.state[weight]["hessian_refreshes"] == 1
        assert 0 < opt.stats["unclipped_fraction"] < 1  # the denominator matters for some coordinates
        weight = w0.clone().requires_grad_()  # the loop that refreshes by itself
        opt = SophiaH([weight], lr=lr, betas=(b1, b2), rho=rho, weight_decay=0.0, eps=eps, bias_correction=corrected,
                      generator=torch.Generator().manual_seed(3))  # fmt: skip
        loss = F.cross_entropy(x[:3] @ weight, y[:3])
        opt.update_hessian(loss)
        weight.grad = g.clone()
        opt.step()
        torch.testing.assert_close(weight.detach(), expected, rtol=1e-12, atol=1e-14)
        assert opt.state[weight]["hessian_refreshes"] == 1
    with pytest.raises(ValueError, match="SophiaG: invalid bias_correction: 1; expected True or False"):
        SophiaG([w0.clone().requires_grad_()], bias_correction=1)


@pytest.mark.parametrize("hessian_batch", [None, 3])
def test_sophia_h_forward_mode_takes_the_same_steps_as_reverse_mode(gen, hessian_batch):
    """SophiaH(mode="forward") takes each refresh's Hessian-vector products by forward-over-reverse (the closure run
    again with the probe as tangent); with the same probes its steps equal reverse mode's, on the whole batch's
    forward or on closure(rows); no call is differentiated twice."""
    x, y = torch.randn(8, 5, generator=gen, dtype=DTYPE), torch.randint(0, 3, (8,), generator=gen)
    weights = {}
    for mode in ("reverse", "forward"):
        torch.manual_seed(0)
        model = MLP([5, 6, 3])
        opt = SophiaH(model.parameters(), lr=0.05, betas=(0.9, 0.5), rho=10.0, update_period=2,
                      hessian_batch=hessian_batch, mode=mode, module=model,
                      generator=torch.Generator().manual_seed(1))  # fmt: skip
        twice = []
        for _ in range(3):
            twice += [opt.differentiates_twice(), opt.differentiates_twice(rows=True)]
            opt.step(lambda rows=slice(None), model=model: (F.cross_entropy(model(x[rows]), y[rows]), model(x[rows])))
        assert any(twice) == (mode == "reverse")
        assert opt.stats["unclipped_fraction"] > 0.3  # so that the steps depend on the estimates
        weights[mode] = [p.detach() for p in model.parameters()]
    for a, b in zip(weights["forward"], weights["reverse"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("num_samples", [1, 3])
def test_sophia_h_forward_refresh_on_the_whole_batch_is_one_pass_per_probe(gen, num_samples):
    """A forward-mode refresh without hessian_batch runs the closure once per probe, each time with tangents, and
    no plain pass: the loss and gradient are the first pass's values (the stats report the loss; the step equals
    one that takes the gradient by its own backward, i.e. reverse mode's); a plain step runs it once, plainly."""
    x, y = torch.randn(8, 5, generator=gen, dtype=DTYPE), torch.randint(0, 3, (8,), generator=gen)
    weights, losses = {}, {}
    for mode in ("reverse", "forward"):
        torch.manual_seed(0)
        model = MLP([5, 6, 3])
        opt = SophiaH(model.parameters(), lr=0.05, betas=(0.9, 0.5), rho=10.0, update_period=2, mode=mode,
                      module=model, num_samples=num_samples, generator=torch.Generator().manual_seed(1))  # fmt: skip
        passes = []

        def closure(model=model, passes=passes):
            passes.append(fwAD.unpack_dual(model[0].weight).tangent is not None)
            return F.cross_entropy(model(x), y), model(x)

        for step in range(2):
            passes.clear()
            opt.step(closure)
            if mode == "forward":
                assert passes == ([True] * num_samples if step == 0 else [False]), passes
            if step == 0:
                assert opt.stats["hessian_rows"] == 8 and opt.stats["hessian_refreshed"] == 1
        losses[mode] = opt.stats["loss"]
        weights[mode] = [p.detach() for p in model.parameters()]
    assert losses["forward"] == pytest.approx(losses["reverse"], rel=1e-13)
    for a, b in zip(weights["forward"], weights["reverse"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_sophia_h_forward_refresh_refuses_a_loss_without_graph(gen):
    x, y, w0 = softmax_regression(gen)
    model = MLP(list(w0.shape))
    opt = SophiaH(model.parameters(), mode="forward", module=model)
    with pytest.raises(RuntimeError, match="SophiaH: the closure's loss has no autograd graph"):
        opt.step(lambda: F.cross_entropy(model(x), y).detach())


def test_sophia_h_forward_mode_needs_a_module_and_a_closure(gen):
    """mode='forward' without module=, an unknown mode, and forward mode without a closure (update_hessian, or a
    step after backward(create_graph=True)) are errors that say what to do."""
    x, y, w0 = softmax_regression(gen)
    weight = w0.clone().requires_grad_()
    with pytest.raises(ValueError, match=r"SophiaH\(mode='forward'\) needs module="):
        SophiaH([weight], mode="forward")
    with pytest.raises(ValueError, match="SophiaH: mode must be 'reverse' or 'forward', got 'both'"):
        SophiaH([weight], mode="both")
    model = MLP(list(w0.shape))
    opt = SophiaH(model.parameters(), mode="forward", module=model)
    loss = F.cross_entropy(model(x), y)
    with pytest.raises(RuntimeError, match=r"mode='forward'\) takes its estimate through a closure.*update_hessian"):
        opt.update_hessian(loss)
    loss.backward(create_graph=True)
    with pytest.raises(RuntimeError, match=r"mode='forward'\) takes its estimate through a closure.*without a closure"):
        opt.step()


def test_sophia_g_hessian_batch_samples_labels_on_exactly_the_requested_rows(gen):
    """SophiaG's refresh with hessian_batch 3: labels drawn from softmax of rows 0-2's logits (the seeded generator),
    g_hat the gradient of their mean cross-entropy, h_hat = 3 g_hat^2 (Gauss-Newton-Bartlett on the 3 rows)."""
    x, y, w0 = softmax_regression(gen)
    lr, (b1, b2), eps = 0.1, (0.9, 0.99), 1e-15
    probabilities = torch.softmax(x[:3] @ w0, dim=-1)
    labels = torch.multinomial(probabilities.float(), 1, generator=torch.Generator().manual_seed(5)).squeeze(-1)
    g_hat = torch.func.grad(lambda w: F.cross_entropy(x[:3] @ w, labels))(w0)
    h = (1 - b2) * 3 * g_hat**2
    g = torch.func.grad(lambda w: F.cross_entropy(x @ w, y))(w0)
    check_first_step_on_three_rows(
        lambda weight, rho: SophiaG([weight], lr=lr, betas=(b1, b2), rho=rho, weight_decay=0.0, eps=eps,
                                    hessian_batch=3, generator=torch.Generator().manual_seed(5)),
        x, y, w0, g, h, lr, b1, eps)


def test_hessian_batch_bad_input_is_named(gen):
    x, y, w0 = softmax_regression(gen)
    weight = w0.clone().requires_grad_()
    for cls in (SophiaH, SophiaG):
        for bad in (1.0, 0, True):
            with pytest.raises(ValueError, match=f"{cls.__name__}: invalid hessian_batch: {bad!r}; expected None"):
                cls([weight], hessian_batch=bad)
        with pytest.raises(TypeError, match=r"hessian_batch=...\) evaluates the curvature on closure\(rows\).*no arg"):
            cls([weight], hessian_batch=2).step(lambda: (F.cross_entropy(x @ weight, y), x @ weight))


# ------------------------------------------------------------------------------------- host synchronisations


def test_sophia_step_without_refresh_synchronises_the_host_once(gen):
    """The loss, gradient and update of a plain step are checked for finiteness together, with the unclipped count:
    one host synchronisation (the loss, the gradient, the update and the count were read one by one before)."""
    x, y, w0 = softmax_regression(gen)
    weight = w0.clone().requires_grad_()
    opt = SophiaH([weight], update_period=10)
    closure = softmax_regression_closure(x, y, weight)
    opt.step(closure)
    counter = Counter()
    with counter:
        opt.step(closure)
    assert opt.stats["hessian_refreshed"] == 0 and counter.total_syncs == 1, counter.sync_ops


def quadratic(count: int, gen: torch.Generator) -> tuple[list[Tensor], Callable[[], Tensor]]:
    """``count`` parameter tensors of 3 entries and a convex quadratic loss of them."""
    params = [torch.randn(3, generator=gen, dtype=DTYPE).requires_grad_() for _ in range(count)]
    curvatures = [spd(3, gen, torch.rand(3, generator=gen, dtype=DTYPE) + 0.5) for _ in range(count)]
    return params, lambda: sum(0.5 * p @ a @ p + p.sum() for p, a in zip(params, curvatures))


def test_newton_cg_synchronises_once_per_cg_iteration_whatever_the_number_of_tensors(gen):
    """CG works on one flat vector: per iteration one host synchronisation and the same few operations besides the
    product for 2 or 12 parameter tensors (every inner product and update was one per tensor, read one by one)."""
    ops, iterations = {}, {}
    for count in (2, 12):
        params, closure = quadratic(count, gen)
        opt = NewtonCG(params, curvature="hessian", max_cg_iters=5, cg_tol=0.0, progress_tol=0.0)
        opt.step(closure)
        profiler, trials = Profiler(cuda=False), []

        def counted(closure=closure, trials=trials):
            trials.append(not torch.is_grad_enabled())
            return closure()

        counter = Counter(profiler)
        profiler.install()
        try:
            with counter, profiler.phase("step"):
                opt.step(counted)
        finally:
            profiler.restore()
        iterations[count], trials = opt.stats["cg_iters"], sum(trials)
        assert counter.syncs["step / CG"] == 1 + iterations[count], counter.sync_ops
        assert "step / CG / Hessian product" not in counter.syncs
        # the loss, the gradient's finiteness, one per trial point (its loss), the update's finiteness
        assert counter.total_syncs == 1 + iterations[count] + 3 + trials, counter.sync_ops
        ops[count] = counter.ops["step / CG"]
    assert iterations[2] == iterations[12] == 5 and ops[2] == ops[12], ops


def test_newton_cg_maximize_searches_on_minus_the_loss(gen):
    """maximize=True on L takes the steps of maximize=False on -L, search and damping included (the search compared
    -L at the trial points with +L at the start)."""
    stats = {}
    for maximize in (False, True):
        params, closure = quadratic(3, torch.Generator().manual_seed(4))
        opt = NewtonCG(params, curvature="hessian", max_cg_iters=2, maximize=maximize, damping=0.3)
        sign = -1 if maximize else 1
        for _ in range(3):
            opt.step(lambda sign=sign, closure=closure: sign * closure())
        stats[maximize] = ([p.detach() for p in params], {k: opt.stats[k] for k in ("damping", "reduction_ratio")})
    torch.testing.assert_close(stats[True][0], stats[False][0], rtol=1e-12, atol=1e-14)
    assert stats[True][1] == pytest.approx(stats[False][1], rel=1e-12)


def test_newton_cg_backtrack_accept_takes_the_last_iterate_only_when_it_beats_the_earlier_models(gen):
    """backtrack_accept on f = q + c |theta - theta_0|^4 (the quartic adds nothing to g or H at theta_0, so q is
    the exact model and f - q = c |s|^4): c = 0 (every rho_i = 1): one trial forward and the last iterate, where
    Martens' backtracking evaluates two; c such that q(s_1) < f(s_2) - f_0 <= q(s_2) / 4 and f(s_1) < f(s_2): the
    last iterate's ratio is at least 1/4 (a fixed floor of 1/4 took it) but it misses the first's model decrease,
    so backtracking goes on and takes Martens' (better) first iterate."""
    n = 6
    for _ in range(200):  # a random problem where such a c exists (CG's first step reaches q(s_1) < q(s_2) / 4)
        a = spd(n, gen, torch.logspace(-1, 1, n, dtype=DTYPE))
        b, theta0 = torch.randn(n, generator=gen, dtype=DTYPE), torch.randn(n, generator=gen, dtype=DTYPE)
        g = a @ theta0 + b
        solve = cg(lambda v, a=a: (a @ v[0],), (-g,), max_iter=2, save_at={1, 2})
        q = [float(g @ it.x[0] + 0.5 * it.x[0] @ a @ it.x[0]) for it in solve.iterates]
        s1, s2 = (it.x[0] for it in solve.iterates)
        c_between = 0.5 * (q[0] + q[1] / 4 - 2 * q[1]) / float(s2.norm() ** 4)  # f(s_2) - f_0 halfway
        if q[0] < q[1] / 4 and q[0] + c_between * float(s1.norm() ** 4) < q[1] + c_between * float(s2.norm() ** 4):
            break
    else:
        pytest.fail("no random problem of 200 has a first CG step with q(s_1) < q(s_2) / 4")
    runs = {}
    for c in (0.0, c_between):
        for name, options in {"martens": {}, "accept": {"backtrack_accept": True}, "last": {"backtrack": False}}.items():
            theta, trials = theta0.clone().requires_grad_(), []

            def closure(theta=theta, c=c, trials=trials):
                trials.append(not torch.is_grad_enabled())
                return 0.5 * theta @ a @ theta + b @ theta + c * (theta - theta0).square().sum() ** 2

            opt = NewtonCG([theta], curvature="hessian", max_cg_iters=2, damping=0.0, **options)
            opt.step(closure)
            runs[c, name] = (theta.detach(), sum(trials), opt.stats["step_size"])
    assert [runs[0.0, name][1] for name in ("martens", "accept")] == [2, 1]
    torch.testing.assert_close(runs[0.0, "accept"][0], theta0 + s2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(runs[0.0, "martens"][0], theta0 + s2, rtol=1e-12, atol=1e-12)
    assert runs[c_between, "accept"][1] == runs[c_between, "martens"][1] >= 2
    assert runs[c_between, "accept"][2] == runs[c_between, "martens"][2] == 1.0
    torch.testing.assert_close(runs[c_between, "accept"][0], theta0 + s1, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(runs[c_between, "martens"][0], theta0 + s1, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(runs[c_between, "last"][0], theta0 + s1), "the last iterate differs"
    for bad in (0.25, None, "yes"):
        with pytest.raises(ValueError, match="invalid backtrack_accept"):
            NewtonCG([theta0.clone().requires_grad_()], backtrack_accept=bad)


# -------------------------------------------------------------------------------------- forward mode


def mlp_closure(model: nn.Module, x: Tensor, y: Tensor):
    def closure(rows=slice(None)):
        logits = model(x[rows])
        return F.cross_entropy(logits, y[rows]), logits

    return closure


@pytest.mark.parametrize("curvature_batch", [None, 4])
@pytest.mark.parametrize("curvature", ["ggn", "hessian"])
def test_forward_mode_takes_the_same_steps_as_reverse_mode(curvature, curvature_batch):
    """Two full NewtonCG steps (Hutchinson preconditioner, backtracking, damping, line search) per mode."""
    torch.manual_seed(0)
    x, y = torch.randn(10, 4, dtype=DTYPE), torch.randint(0, 3, (10,))
    models = {"reverse": MLP([4, 6, 3])}
    models["forward"] = copy.deepcopy(models["reverse"])
    initial = [p.detach().clone() for p in models["reverse"].parameters()]
    losses = {}
    for mode, model in models.items():
        opt = NewtonCG(model.parameters(), curvature=curvature, curvature_batch=curvature_batch, mode=mode,
                       module=model, preconditioner="hutchinson", max_cg_iters=6,
                       generator=torch.Generator().manual_seed(1))  # fmt: skip
        losses[mode] = [float(opt.step(mlp_closure(model, x, y))) for _ in range(2)]
        assert opt.stats["step_skipped"] == 0 and opt.stats["cg_iters"] >= 1
    assert losses["forward"] == pytest.approx(losses["reverse"], rel=1e-12)
    for p, q in zip(models["forward"].parameters(), models["reverse"].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-10)
    assert all(not torch.equal(p, p0) for p, p0 in zip(models["forward"].parameters(), initial)), "the steps moved"


def test_forward_mode_gauss_newton_step_through_flashbob_attention(monkeypatch):
    """The forward-mode GGN product runs flashbob's forward-mode rules (blocked backend), with PyTorch's rules for
    the linear layers or the lean ones (lean_tangents: each J v runs under them); the same step as reverse mode."""
    entered = []

    class Recorded(_autodiff.LeanLinearTangents):
        def __enter__(self):
            entered.append(1)
            return super().__enter__()

    monkeypatch.setattr(_autodiff, "LeanLinearTangents", Recorded)
    torch.manual_seed(0)
    config = dict(vocab_size=11, n_outputs=11, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, attention="blocked")
    models = {"reverse": Transformer(**config).double()}
    models["forward"], models["lean"] = copy.deepcopy(models["reverse"]), copy.deepcopy(models["reverse"])
    tokens = torch.randint(0, 11, (3, 6))
    for name, model in models.items():
        def closure(rows=slice(None), model=model):
            logits = model(tokens[rows, :-1])
            return F.cross_entropy(logits.flatten(0, 1), tokens[rows, 1:].flatten()), logits

        mode = "reverse" if name == "reverse" else "forward"
        opt = NewtonCG(model.parameters(), curvature_batch=2, mode=mode, module=model, max_cg_iters=4,
                       lean_tangents=name == "lean")  # fmt: skip
        opt.step(closure)
        if name == "lean":
            assert len(entered) == opt.stats["cg_iters"] >= 1  # one J v per CG product
        else:
            assert not entered
    for name in ("forward", "lean"):
        for p, q in zip(models[name].parameters(), models["reverse"].parameters()):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-10)


def test_lean_tangents_bad_input_is_named():
    weight = nn.Parameter(torch.randn(3, 2, dtype=DTYPE))
    with pytest.raises(ValueError, match="NewtonCG: invalid lean_tangents: 1; expected True or False"):
        NewtonCG([weight], lean_tangents=1)
    for kwargs in ({}, {"mode": "forward", "module": nn.Linear(2, 3), "curvature": "hessian"}):
        with pytest.raises(ValueError, match=r"NewtonCG\(lean_tangents=True\) is for forward-mode Gauss-Newton"):
            NewtonCG([weight], lean_tangents=True, **kwargs)
    with pytest.raises(ValueError, match="GGNOperator: lean_tangents is for mode='forward'"):
        GGNOperator(torch.randn(2, 3, dtype=DTYPE) @ weight, [weight], CrossEntropyHessian(torch.zeros(2)),
                    lean_tangents=True)  # fmt: skip
    with pytest.raises(ValueError, match="GGNOperator: invalid lean_tangents: 'yes'"):
        GGNOperator(lambda values: values[0], [weight], CrossEntropyHessian(torch.zeros(2)), mode="forward",
                    lean_tangents="yes")  # fmt: skip


class ZeroTangents(TorchDispatchMode):
    """Counts the implicit zero tangents (ZeroTensors) that forward AD creates for operands without a tangent."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__.startswith("_efficientzerotensor")
        return func(*args, **(kwargs or {}))


def test_gpt_pass_with_tangents_gives_no_operand_an_implicit_zero_tangent():
    """RoPE's cos/sin and RMSNorm's epsilon enter a pass with tangents as constants with real zero tangents: forward
    AD then creates no ZeroTensor (each costs a Python meta function, ~0.5 ms of host time; there were 82 per
    forward of a 4-layer GPT), and the forward-mode GGN product still equals the reverse-mode one (float64)."""
    model = gpt("blocked")
    tokens = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    vec = tuple(torch.randn(p.shape, dtype=DTYPE, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(params))
    hessian = CrossEntropyHessian(tokens[:, 1:])
    outputs = functional(model, lambda: model(tokens[:, :-1]), params)
    forward = GGNOperator(outputs, params, hessian, mode="forward")
    with ZeroTangents() as zeros:
        product = forward.matvec(vec)
    assert zeros.count == 0
    want = GGNOperator(model(tokens[:, :-1]), params, hessian).matvec(vec)
    for got, expected in zip(product, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------ which steps take curvature


def test_refreshes_next_step_says_which_steps_take_curvature(gen):
    """SophiaH/G refresh on exactly the steps whose stats report a refresh (and not after update_hessian); there
    SophiaH differentiates closure() twice, or closure(rows) with hessian_batch, SophiaG never (its estimate is one
    backward). AdaHessian: every step, closure(). NewtonCG in reverse mode: the products' call (closure(rows) with
    curvature_batch); in forward mode none (J v runs on passes with tangents, J^T u differentiates once)."""
    x, y, w0 = softmax_regression(gen)

    def closure(rows=slice(None)):
        logits = x[rows] @ weight
        return F.cross_entropy(logits, y[rows]), logits

    for cls, hessian_batch in ((SophiaH, None), (SophiaH, 2), (SophiaG, None), (SophiaG, 0.5)):
        weight = w0.clone().requires_grad_()
        opt = cls([weight], update_period=3, hessian_batch=hessian_batch)
        predicted, twice, refreshed = [], [], []
        for _ in range(7):
            predicted.append(opt.refreshes_next_step)
            twice.append((opt.differentiates_twice(), opt.differentiates_twice(rows=True)))
            opt.step(closure)
            refreshed.append(bool(opt.stats["hessian_refreshed"]))
        assert predicted == refreshed == [True, False, False, True, False, False, True], cls.__name__
        expected = {(SophiaH, None): [(r, False) for r in refreshed], (SophiaH, 2): [(False, r) for r in refreshed]}
        assert twice == expected.get((cls, hessian_batch), [(False, False)] * 7), (cls.__name__, hessian_batch)
        assert not opt.refreshes_next_step
    opt = SophiaH([weight], update_period=1)
    opt.update_hessian(F.cross_entropy(x @ weight, y))
    assert not opt.refreshes_next_step, "update_hessian refreshed h for the next step"
    assert AdaHessian([weight]).refreshes_next_step and AdaHessian([weight]).differentiates_twice()
    for settings, whole, rows in (({}, True, False), ({"curvature_batch": 2}, False, True),
                                  ({"mode": "forward", "module": nn.Linear(1, 1)}, False, False),
                                  ({"mode": "forward", "module": nn.Linear(1, 1), "curvature_batch": 2}, False, False)):
        opt = NewtonCG([weight], **settings)
        assert opt.refreshes_next_step and (opt.differentiates_twice(), opt.differentiates_twice(True)) == (whole, rows)


# ------------------------------------------------------------------------------------ attention switch


def counted(switch: AttentionSwitch, calls: list[str]) -> None:
    """Make ``switch`` record in ``calls`` which of its attentions ran."""
    for name in ("first_order", "twice"):
        def attend(*args, inner=getattr(switch, name), name=name, **kwargs):
            calls.append(name)
            return inner(*args, **kwargs)

        setattr(switch, name, attend)


def gpt(attention: str) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=16, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, attention=attention).double()


def test_sdpa_attention_matches_eager_and_switches_to_flashbob_for_curvature():
    tokens = torch.randint(0, 16, (2, 9))
    sdpa, eager = gpt("sdpa"), gpt("eager")
    torch.testing.assert_close(sdpa(tokens), eager(tokens), rtol=1e-12, atol=1e-12)
    calls = []
    counted(sdpa.attention, calls)
    sdpa(tokens)
    with sdpa.attention.for_curvature():
        sdpa(tokens)
        with sdpa.attention.for_curvature(False):
            sdpa(tokens)
        sdpa(tokens)
    sdpa(tokens)
    assert calls == ["first_order"] * 2 + ["twice"] * 2 + ["first_order"] * 2 + ["twice"] * 2 + ["first_order"] * 2
    assert eager.attention.twice is eager.attention.first_order, "eager attention is twice differentiable itself"
    with pytest.raises(ValueError, match="attention must be one of auto, triton, blocked, eager, sdpa, got 'flash'"):
        GPT(attention="flash")


def train(model: GPT, opt: torch.optim.Optimizer, batches: list[tuple[Tensor, Tensor]]) -> list[float]:
    def forward(inputs, targets):  # the recipe's forward, but in float64 throughout
        logits = model(inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), logits

    return [optimizers.train_step(opt, forward, [batch], 0.0, for_curvature=model.attention.for_curvature)[0]
            for batch in batches]


@pytest.mark.parametrize("name", ["sophiah", "sophiah_rows", "sophiah_forward", "sophiah_rows_forward", "newtoncg"])
def test_recipe_runs_sdpa_on_steps_without_curvature_and_matches_flashbob(name):
    """SophiaH (update_period 2): steps 1 and 3 refresh through flashbob, steps 2 and 4 run SDPA alone; with
    hessian_batch the refresh steps take the gradient on SDPA and the estimate on closure(rows) through flashbob;
    in forward mode the estimate's pass with tangents runs flashbob, the rest SDPA: on the whole batch that pass
    (closure() with tangents) is the refresh step's only pass, its values the loss and gradient.
    NewtonCG with a curvature batch in forward mode: closure() (gradient, trial points) and closure(rows) (the graph
    that J^T u differentiates once) on SDPA, the forward-mode J v of each CG product on flashbob. Losses and weights
    equal those of a model that always runs flashbob (blocked backend)."""
    tokens = torch.randint(0, 16, (4, 3, 9))
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    settings = {"sophiah": ("sophiah", dict(lr=1e-2, update_period=2)),
                "sophiah_rows": ("sophiah", dict(lr=1e-2, update_period=2, hessian_batch=1)),
                "sophiah_forward": ("sophiah", dict(lr=1e-2, update_period=2, mode="forward")),
                "sophiah_rows_forward": ("sophiah", dict(lr=1e-2, update_period=2, hessian_batch=1, mode="forward")),
                "newtoncg": ("newtoncg", dict(curvature_batch=1, mode="forward", max_cg_iters=3,
                                              warm_start_decay=0.0))}  # fmt: skip
    optimizer, kwargs = settings[name]
    models = {attention: gpt(attention) for attention in ("sdpa", "blocked")}
    calls = []
    counted(models["sdpa"].attention, calls)
    losses, per_step, cg_iters = {}, [], []
    for attention, model in models.items():
        generator = torch.Generator().manual_seed(0)  # the same probes for both
        opt = optimizers.build_optimizer(model, optimizer, {}, {**kwargs, "generator": generator}, 0.0, False)
        losses[attention] = []
        for batch in batches:
            losses[attention] += train(model, opt, [batch])
            per_step.append(calls[:])
            cg_iters.append(opt.stats.get("cg_iters"))
            calls.clear()
    assert losses["sdpa"] == pytest.approx(losses["blocked"], rel=1e-10)
    for p, q in zip(models["sdpa"].parameters(), models["blocked"].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-10)
    layers, sdpa_steps = 2, per_step[: len(batches)]
    first, twice = ["first_order"] * layers, ["twice"] * layers
    if name in ("sophiah", "sophiah_forward"):
        assert sdpa_steps == [twice, first] * 2
    elif name.startswith("sophiah"):  # rows: the gradient on SDPA, the estimate's pass after it
        assert sdpa_steps == [first + twice, first] * 2
    else:
        for calls, iterations in zip(sdpa_steps, cg_iters):
            # closure(), closure(rows), one forward-mode J v per CG product, closure() at the search's trial points
            assert calls[: 2 * layers] == first * 2 and calls.count("twice") == layers * iterations
            assert calls[-1] == "first_order" and iterations >= 1


def test_sdpa_refuses_curvature_outside_the_switch_and_the_recipe_lists_it():
    """Torch's fused attention is differentiable once: a curvature product through it fails loudly (the recipe
    switches to flashbob first); model.attention accepts sdpa and names it among the choices."""
    model = gpt("sdpa")
    tokens = torch.randint(0, 16, (1, 9))
    params = list(model.parameters())
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    with pytest.raises(RuntimeError, match="derivative for .*scaled_dot_product.* is not implemented"):
        hvp(loss, params, [torch.ones_like(p) for p in params])
    with model.attention.for_curvature():
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        assert all(torch.isfinite(v).all() for v in hvp(loss, params, [torch.ones_like(p) for p in params]))
    assert load_config(str(LM.configs / "tiny.yaml"), ["model.attention=sdpa"]).model.attention == "sdpa"
    with pytest.raises(ConfigError, match="model.attention must be one of auto, triton, blocked, eager, sdpa; got"):
        load_config(str(LM.configs / "tiny.yaml"), ["model.attention=flash"])
