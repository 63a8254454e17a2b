"""Hessian-free optimisation (Martens, 2010): truncated CG on the damped Gauss-Newton or Hessian system."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from optim import distributed as _dist
from optim import line_search, preconditioner, updates
from optim._autodiff import Mode
from optim._closure import Closure, ClosureResult, curvature_rows, evaluate, graph_errors, loss_hessian_for, parse
from optim._finite import all_finite, user_stacklevel, warn_skipped
from optim._gradients import check_dense, gradients
from optim.cg import CGResult, _dot, cg, martens_schedule
from optim.forward_mode_checks import check_deterministic
from optim.functional import functional
from optim.hyperparameters import (COUNT, DECAY, NON_NEGATIVE, UNIT_INTERVAL, Rule, check_flag, check_optimizer_mode,
                                   check_rows)
from optim.loss_hessians import LossHessian
from optim.operators import CurvatureOperator, GGNOperator, HessianOperator
from optim.optimizer import Evaluation, SecondOrderOptimizer, Update

Curvature = Literal["auto", "ggn", "hessian"]
Preconditioner = preconditioner.Kind | None

#: Settings that belong to the one joint solve; every parameter group must agree on them.
GLOBAL_SETTINGS = (
    "damping", "adapt_damping", "curvature", "curvature_batch", "mode", "max_cg_iters", "cg_tol", "progress_tol",
    "progress_window", "warm_start_decay", "backtrack", "backtrack_accept", "line_search", "preconditioner",
    "precond_exponent", "precond_beta", "maximize",
)  # fmt: skip


@dataclass
class _Solved:
    r"""What a step made of its curvature: the CG solve, the preconditioner's diagonal (``None`` without one), the
    damping for the next step and the step size :math:`\alpha`."""

    solve: CGResult
    diagonal: tuple[Tensor, ...] | None
    damping: float
    step_size: float


class NewtonCG(SecondOrderOptimizer):
    r"""Hessian-free (truncated Newton / Gauss-Newton) optimisation in the style of Martens (2010).

    Each step minimises the local quadratic model of the objective :math:`f` (the loss, or minus
    the loss with ``maximize``) around :math:`\theta`,

    .. math:: q(\delta) = f(\theta) + g^\top \delta + \tfrac12 \delta^\top B \delta, \qquad
              (B + \lambda I)\, x = -g,

    by truncated (optionally preconditioned) conjugate gradient :func:`optim.cg.cg` on the damped
    system. :math:`B` is the generalised Gauss-Newton matrix :math:`G = J^\top H_L J` of the model
    outputs (when the closure returns them) or the Hessian :math:`H`. Per step:

    1. One forward (the closure) and its backward for the gradient :math:`g`. The curvature products
       :math:`Bv` run on that forward's graph (reverse mode: one ``create_graph`` backward, then each product
       is a backward through it), or, with ``curvature_batch``, on a second forward of the first rows of the
       batch only (Martens' curvature mini-batch): :math:`g` is the whole batch's, :math:`B` that of the mean
       loss over those rows. With ``mode="forward"`` the Gauss-Newton product takes :math:`J v` by forward-mode
       AD (:class:`~optim.operators.GGNOperator`), and a Hessian product is forward-over-reverse.
    2. CG warm-starts from ``warm_start_decay`` times the last step's final CG iterate and stops
       on Martens' relative-progress rule, ``max_cg_iters``, a small residual, or
       :math:`p^\top (B + \lambda I) p \le 0` (negative curvature, possible in Hessian mode:
       the iterate so far, or a descent step along the first direction, is kept).
    3. The step is :math:`s = D x` with :math:`D` the learning rate of each parameter's group.
       CG backtracking (Martens, section 4.6) evaluates :math:`f(\theta + s_i)` at iterates saved at
       iterations :math:`\lceil 1.3^j \rceil`, from the last backwards while :math:`f` falls (and, with
       ``backtrack_accept``, until an iterate's actual decrease reaches the model decrease of every earlier one).
    4. Levenberg-Marquardt: with the reduction ratio
       :math:`\rho = (f(\theta + s) - f(\theta)) / (q(s) - q(0))` (undamped model),
       :math:`\lambda \leftarrow \tfrac32 \lambda` if :math:`\rho < \tfrac14` and
       :math:`\lambda \leftarrow \tfrac23 \lambda` if :math:`\rho > \tfrac34`
       (:func:`optim.line_search.levenberg_marquardt`).
    5. Armijo line search on :math:`\alpha s`: :math:`\alpha \in \{1, 0.8, 0.8^2, \dots\}` (10 trials),
       the first with :math:`f(\theta + \alpha s) \le f(\theta) + 10^{-2} \alpha\, g^\top s`; none: no step
       (:math:`\alpha = 0`). If :math:`f` is not finite at any trial point of steps 3-5, the step is
       skipped with a warning (parameters unchanged, ``step_skipped = 1``) and only the damping
       adapts (it grows, as :math:`\rho = -\infty`).
    6. Decoupled weight decay: :math:`\theta \leftarrow (1 - \eta\,\text{wd})\,\theta + \alpha s`
       (:func:`optim.updates.newton_cg`).

    Steps 3-5 evaluate the closure again (forwards only, under ``torch.no_grad()``) at trial points:
    usually one or two forwards per step. With ``backtrack``, ``line_search`` and ``adapt_damping``
    all off, there are none.

    Data parallel (``distributed``): each rank's closure returns the mean loss over its equal share
    of the batch. The optimizer then averages over the ranks the loss (and each trial loss), the
    gradient and every curvature product (Hutchinson products included), which makes them those of
    the whole batch; CG and the search run on these averages, identically on every rank, so the
    parameters stay replicated with no further communication (docs/distributed.md counts it). The
    Hutchinson probes must be the same on every rank: pass a ``generator`` seeded alike, or leave it
    ``None`` to get :func:`optim.distributed.shared_generator`. Do not wrap the model in DDP (its hooks
    never run).

    The closure runs the forward and returns the loss, ``(loss, outputs)`` or a dict (keys ``loss``, ``outputs``,
    ``targets``, ``loss_hessian``) without calling ``backward``. With ``curvature_batch`` it takes ``rows``, a
    ``slice`` of the batch's leading dimension (``def closure(rows=slice(None))``, indexing the inputs and targets
    with it): ``closure()`` is the whole batch (gradient, trial points), ``closure(slice(0, m))`` its first
    :math:`m` rows (curvature). With ``mode="forward"`` the optimizer runs the closure again with tangents attached
    to the parameters, through :func:`optim.functional` of ``module`` (which must hold the parameters and be
    deterministic: no dropout). The step is :meth:`~optim.optimizer.SecondOrderOptimizer.step`: ``p.grad`` holds
    the gradient; a parameter the loss does not reach (on any rank) is left out (not in the CG system, not moved
    or decayed, no state, ``p.grad`` ``None``); a non-finite loss, gradient, curvature or update skips the step
    with a warning; every parameter frozen, it changes nothing and returns the closure's loss; sparse gradients
    are refused. :attr:`stats` holds ``loss``, ``damping`` (used in the step), ``cg_iters``, ``curvature_rows``
    (the rows the products ran on; NaN when the closure returns neither outputs nor targets, whose leading
    dimension it counts), ``reduction_ratio``, ``step_size`` (:math:`\alpha`), ``negative_curvature`` and
    ``step_skipped``.

    Example:
        >>> opt = NewtonCG(model.parameters())
        >>> def closure():
        ...     logits = model(x)
        ...     return F.cross_entropy(logits.flatten(0, -2), y.flatten()), logits
        >>> loss = opt.step(closure)   # GGN with the cross-entropy Hessian of the logits

    The products on a quarter of the batch, by forward mode:

        >>> opt = NewtonCG(model.parameters(), curvature_batch=0.25, mode="forward", module=model)
        >>> def closure(rows=slice(None)):
        ...     logits = model(x[rows])
        ...     return F.cross_entropy(logits.flatten(0, -2), y[rows].flatten()), logits

    Args:
        params: Parameters or parameter groups. Groups may differ in ``lr`` and ``weight_decay``
            only; the other settings belong to the one joint solve.
        lr: Scale :math:`\eta` of the CG step in this group (1 is the Newton step).
        damping: Initial Tikhonov damping :math:`\lambda`.
        adapt_damping: Levenberg-Marquardt adaptation of :math:`\lambda` from :math:`\rho`.
        curvature: ``"ggn"``, ``"hessian"``, or ``"auto"``: GGN when the closure returns outputs.
        curvature_batch: Rows of the batch the curvature products run on: ``None`` (all, on the
            gradient's own graph), a count :math:`m \ge 1`, or a fraction :math:`f \in (0, 1)` of the
            :math:`R` rows (the leading dimension of the closure's outputs, or targets):
            :math:`m = \max(1, \lfloor f R \rfloor)`. The first :math:`m` rows (of a shuffled batch, a
            random subset) are evaluated again by ``closure(slice(0, m))``, which costs one forward of
            :math:`m` rows and makes every product :math:`R / m` times cheaper (Martens used 1/100 of
            the gradient's batch).
        mode: ``"reverse"`` or ``"forward"``: how a curvature product differentiates (see above and
            :mod:`optim.products`); ``"forward"`` needs ``module``. Forward-mode Hessian products need
            a forward-mode rule for the backward of every operation (not ``F.silu``'s in torch 2.13);
            the Gauss-Newton product needs only the forward's.
        module: The ``nn.Module`` whose parameters are optimised, for ``mode="forward"``.
        lean_tangents: Forward-mode Gauss-Newton products only: take :math:`J v` with linear layers'
            tangents accumulated in one buffer (:class:`~optim.operators.GGNOperator`): half the memory
            at a large output layer (an LM head's logits), for a few microseconds of dispatch per torch call.
        max_cg_iters: Most CG iterations (curvature products) per step.
        cg_tol: CG stops at relative residual ``cg_tol``.
        progress_tol: Martens' :math:`\epsilon` of the relative-progress rule (0: off): CG stops at
            iteration :math:`i > k` when :math:`\phi(x_i) < 0` and
            :math:`(\phi(x_i) - \phi(x_{i-k})) / \phi(x_i) < k \epsilon`, with
            :math:`k = \max(\text{progress\_window}, \lceil i / 10 \rceil)`.
        progress_window: The smallest :math:`k` of that rule (Martens: 10, so the rule can stop CG
            from iteration 11 on; a smaller window lets it stop a short solve).
        warm_start_decay: :math:`\zeta` of the warm start :math:`x_0 = \zeta x_{\text{prev}}` (0: cold start).
        backtrack: CG backtracking over saved iterates.
        backtrack_accept: Backtracking stops at the first iterate evaluated (the last first) whose actual decrease
            reaches the model decrease of every earlier saved iterate (:func:`optim.line_search.backtrack`): one
            trial forward on such steps, where Martens' backtracking (``False``) evaluates at least two whenever
            two iterates are saved (see docs/optimizers.md).
        line_search: Armijo backtracking line search. Without it the chosen iterate is taken as it is, with a
            ``RuntimeWarning`` where it raises the loss (where :math:`f` is evaluated at all: with ``backtrack``
            or ``adapt_damping``).
        preconditioner: ``None``, ``"squared_gradients"`` (EMA of :math:`g \circ g`),
            ``"hutchinson"`` (EMA of the Hutchinson estimate of :math:`|\operatorname{diag} B|`, one
            product per step) or ``"bartlett"`` (Gauss-Newton with the cross-entropy only: EMA of the
            Gauss-Newton-Bartlett estimate of :math:`\operatorname{diag} G`, Sophia-G's, from labels sampled
            on the curvature rows: one backward through their graph per step and no product, see
            :func:`optim.diagonal.gauss_newton_bartlett`); CG then uses :math:`M = (d + \lambda)^{\xi}`.
        precond_exponent: :math:`\xi` (Martens: 0.75).
        precond_beta: EMA factor of the preconditioner's diagonal :math:`d`.
        weight_decay: Decoupled weight decay of this group.
        maximize: Maximise the loss (minimise :math:`f = -\text{loss}`; the curvature is then
            :math:`-H` or :math:`-G`, so use Hessian mode for a concave loss).
        loss_hessian: :math:`H_L` for GGN mode: ``"cross_entropy"`` (mean over the rows of the
            logits, classes last; rows whose ``targets`` from the closure's dict equal -100 do not
            count), ``"mse"`` (mean), or any :class:`~optim.loss_hessians.LossHessian`. A
            ``loss_hessian`` in the closure's dict overrides it for that batch.
        generator: Source of Hutchinson probes (the global one if ``None``; in distributed mode, a
            generator seeded alike on every rank: a refresh checks that it is, and raises if not).
            Distributed, each refresh's Bartlett labels come from a generator seeded with one draw of it
            plus the rank (each rank's rows need independent labels).
        distributed: ``True`` (the default process group) or a ``torch.distributed`` process group:
            average over its ranks as above. ``False``: one process.
    """

    _owner = "NewtonCG"
    _rules: ClassVar[dict[str, Rule]] = {
        "lr": NON_NEGATIVE, "damping": NON_NEGATIVE, "weight_decay": NON_NEGATIVE, "max_cg_iters": COUNT,
        "cg_tol": NON_NEGATIVE, "progress_tol": NON_NEGATIVE, "progress_window": COUNT,
        "warm_start_decay": UNIT_INTERVAL, "precond_exponent": NON_NEGATIVE, "precond_beta": DECAY,
    }  # fmt: skip
    _needs_closure = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1.0,
        damping: float = 1.0,
        *,
        adapt_damping: bool = True,
        curvature: Curvature = "auto",
        curvature_batch: int | float | None = None,
        mode: Mode = "reverse",
        module: nn.Module | None = None,
        lean_tangents: bool = False,
        max_cg_iters: int = 20,
        cg_tol: float = 1e-10,
        progress_tol: float = 5e-4,
        progress_window: int = 10,
        warm_start_decay: float = 0.95,
        backtrack: bool = True,
        backtrack_accept: bool = False,
        line_search: bool = True,
        preconditioner: Preconditioner = None,
        precond_exponent: float = 0.75,
        precond_beta: float = 0.95,
        weight_decay: float = 0.0,
        maximize: bool = False,
        loss_hessian: str | LossHessian = "cross_entropy",
        generator: torch.Generator | None = None,
        distributed: _dist.Distributed = False,
    ) -> None:
        if curvature not in ("auto", "ggn", "hessian"):
            raise ValueError(f"curvature must be 'auto', 'ggn' or 'hessian', got {curvature!r}")
        if preconditioner not in (None, "hutchinson", "bartlett", "squared_gradients"):
            raise ValueError(
                f"preconditioner must be None, 'hutchinson', 'bartlett' or 'squared_gradients': {preconditioner!r}"
            )
        if preconditioner == "bartlett" and curvature == "hessian":
            raise ValueError("NewtonCG(preconditioner='bartlett') estimates the Gauss-Newton diagonal: it needs "
                             "curvature='ggn' or 'auto', not 'hessian'")
        check_rows(self._owner, "curvature_batch", curvature_batch)
        check_flag(self._owner, "backtrack_accept", backtrack_accept)
        check_optimizer_mode(self._owner, mode, module)
        check_flag(self._owner, "lean_tangents", lean_tangents)
        if lean_tangents and (mode != "forward" or curvature == "hessian"):
            raise ValueError(
                "NewtonCG(lean_tangents=True) is for forward-mode Gauss-Newton products: it needs mode='forward' and "
                f"curvature 'ggn' or 'auto', got mode={mode!r}, curvature={curvature!r}"
            )
        defaults = dict(
            lr=lr, damping=damping, adapt_damping=adapt_damping, curvature=curvature, curvature_batch=curvature_batch,
            mode=mode, max_cg_iters=max_cg_iters, cg_tol=cg_tol, progress_tol=progress_tol,
            progress_window=progress_window, warm_start_decay=warm_start_decay, backtrack=backtrack,
            backtrack_accept=backtrack_accept, line_search=line_search, preconditioner=preconditioner,
            precond_exponent=precond_exponent, precond_beta=precond_beta, weight_decay=weight_decay, maximize=maximize,
        )  # fmt: skip
        super().__init__(params, defaults)
        self.module, self.lean_tangents = module, lean_tangents
        self.loss_hessian = loss_hessian
        self.group = _dist.resolve(distributed, self._owner)
        if generator is None and self.group is not None:
            generator = _dist.shared_generator(self.param_groups[0]["params"][0].device, self.group)
        self.generator = generator

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; it may set its own ``lr`` and ``weight_decay``, but must share the other settings."""
        super().add_param_group(param_group)
        first, new = self.param_groups[0], self.param_groups[-1]
        differ = [key for key in GLOBAL_SETTINGS if new[key] != first[key]]
        if differ:
            self.param_groups.pop()
            raise ValueError(f"NewtonCG solves one system for all groups; groups may not differ in {differ}")

    def differentiates_twice(self, rows: bool = False) -> bool:
        r"""Whether the next step differentiates the graph of ``closure()`` (``rows`` false) or ``closure(rows)``
        twice: in reverse mode, the products' call (``closure(rows)`` with ``curvature_batch``, else
        ``closure()``); in forward mode none (:math:`J v` and forward-over-reverse run on passes with tangents,
        :math:`J^\top u` differentiates the graph once)."""
        settings = self.param_groups[0]
        return settings["mode"] == "reverse" and rows == (settings["curvature_batch"] is not None)

    def _prepare(self, params: list[Tensor]) -> None:
        """The shared state of the joint solve: ``damping``, and ``step``, the steps taken."""
        self._global().setdefault("damping", float(self.param_groups[0]["damping"]))

    def _evaluated(self, taken: Evaluation) -> None:
        """The curvature rows and the step's statistics."""
        settings = self.param_groups[0]
        taken.rows, counted = curvature_rows(self._owner, "curvature_batch", settings["curvature_batch"],
                                             taken.result, taken.closure)  # fmt: skip
        self.stats = dict(
            loss=self.stats["loss"], damping=self._global()["damping"], cg_iters=0.0, curvature_rows=counted,
            reduction_ratio=math.nan, step_size=0.0, negative_curvature=0.0, step_skipped=1.0,
        )  # fmt: skip

    def _differentiate(self, taken: Evaluation) -> None:
        taken.curvature, taken.grads = self._curvature(taken.closure, taken.result, taken.rows, taken.params,
                                                       self.param_groups[0])  # fmt: skip

    def _propose(self, taken: Evaluation) -> Update | None:
        """Steps 2-5 of the class docstring: the CG solve and the search along it; ``None`` where the step is
        skipped (a non-finite preconditioner, a CG breakdown, or no finite trial point)."""
        settings = self.param_groups[0]  # the settings of the joint solve, alike in every group
        sign = -1.0 if settings["maximize"] else 1.0
        damping = self._global()["damping"]
        lrs, wds = [group["lr"] for group in taken.groups], [group["weight_decay"] for group in taken.groups]
        g = tuple(sign * gi for gi in taken.grads)
        solved = self._solve(taken, g, lrs, damping, sign)
        if solved is None:
            return None
        solve, diagonal, models = solved
        chosen, new_damping, ratio, alpha, found = self._search(
            settings, taken.closure, taken.params, lrs, g, solve, models, sign * self.stats["loss"], sign
        )
        self.stats.update(
            cg_iters=float(solve.iterations), reduction_ratio=ratio,
            negative_curvature=float(solve.status == "negative_curvature"),
        )  # fmt: skip
        if not found:
            unchanged = "the parameters and optimizer state"
            if new_damping != damping:
                unchanged += f" (but the damping, now {new_damping:g})"
                self._global()["damping"] = new_damping
            warn_skipped(self._owner, "loss at every trial point of the search", unchanged)
            return None
        taken.curvature = _Solved(solve, diagonal, new_damping, alpha)
        items = list(zip(taken.params, lrs, wds, solve.iterates[chosen].x))
        return Update(items, functools.partial(self._propose_one, alpha), lambda item, new: item[0].copy_(new[0]))

    @staticmethod
    def _propose_one(alpha: float, item: tuple[Tensor, float, float, Tensor]) -> tuple[Tensor]:
        p, lr, wd, x = item
        return (updates.newton_cg([p], [x], [lr], [wd], alpha)[0],)

    def _solve(
        self, taken: Evaluation, g: tuple[Tensor, ...], lrs: list[float], damping: float, sign: float
    ) -> tuple[CGResult, tuple[Tensor, ...] | None, list[float]] | None:
        r"""The preconditioned CG solve of :math:`(B + \lambda I)\, x = -g`, the preconditioner's new diagonal, and
        the model decrease :math:`q(s) - q(0) = g^\top s + s^\top B s / 2` of each saved iterate's step
        :math:`s = D x`; ``None`` (with a warning) where the preconditioner is not finite or CG breaks down. The
        curvature operator, and with it the closure's graph, goes when this returns: before the search moves the
        parameters."""
        settings, params = self.param_groups[0], taken.params
        operator, taken.curvature = taken.curvature, None

        def damped(v: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            with graph_errors(self._owner):
                bv = list(operator.matvec(v))
            return tuple(torch._foreach_add(torch._foreach_neg(bv) if sign < 0 else bv, list(v), alpha=damping))

        precondition, diagonal = self._preconditioner(settings, operator, params, g, damping)
        if diagonal is not None and not all_finite(diagonal):
            warn_skipped(self._owner, "curvature (preconditioner)")
            return None
        decay = settings["warm_start_decay"]
        x0 = None
        if decay > 0 and all("cg_direction" in self.state[p] for p in params):
            x0 = tuple(decay * self.state[p]["cg_direction"] for p in params)
        max_iters = settings["max_cg_iters"]
        solve = cg(
            damped, tuple(-gi for gi in g), x0, max_iter=max_iters, tol=settings["cg_tol"],
            progress_tol=settings["progress_tol"], progress_window=settings["progress_window"],
            precondition=precondition,
            save_at=martens_schedule(max_iters) if settings["backtrack"] else (),
        )  # fmt: skip
        if solve.status == "breakdown":
            warn_skipped(self._owner, "curvature (CG breakdown)")
            return None
        models, uniform = [], len(set(lrs)) == 1
        for it in solve.iterates:
            if uniform:
                x_ax = 2 * (it.objective + it.bx)
                models.append(lrs[0] * -it.bx + 0.5 * lrs[0] ** 2 * (x_ax - damping * it.xx))
            else:
                s = tuple(lr * xi for lr, xi in zip(lrs, it.x))
                with graph_errors(self._owner):
                    s_bs = sign * float(_dot(s, operator.matvec(s)))
                models.append(float(_dot(g, s)) + 0.5 * s_bs)
        return solve, diagonal, models

    def _finish(self, taken: Evaluation, scalars: list[float]) -> None:
        solved: _Solved = taken.curvature
        for p, x in zip(taken.params, solved.solve.x):
            self.state[p]["cg_direction"] = x.clone()
        if solved.diagonal is not None:
            for p, d in zip(taken.params, solved.diagonal):
                self.state[p]["precond_diagonal"] = d
        shared = self._global()
        shared["damping"] = solved.damping
        shared["step"] = shared.get("step", 0) + 1
        self.stats.update(step_size=solved.step_size, step_skipped=0.0)

    def _curvature(
        self, closure: Closure, result: ClosureResult, rows: slice | None, params: list[Tensor],
        settings: dict[str, Any],
    ) -> tuple[CurvatureOperator, tuple[Tensor, ...]]:
        """The curvature operator and the gradient of the loss (rank averages)."""
        operator, grads = self._local_curvature(closure, result, rows, params, settings)
        check_dense(self._owner, grads)
        if self.group is None:
            return operator, grads
        return _dist.AveragedOperator(operator, self.group), _dist.all_average(grads, self.group)

    def _local_curvature(
        self, closure: Closure, result: ClosureResult, rows: slice | None, params: list[Tensor],
        settings: dict[str, Any],
    ) -> tuple[CurvatureOperator, tuple[Tensor, ...]]:
        """The operator on the whole batch's graph (``rows`` None) or on ``closure(rows)``; the gradient."""
        kind, mode = settings["curvature"], settings["mode"]
        if mode == "forward":  # CG needs one matrix; each forward-mode product runs the model again
            check_deterministic("NewtonCG", self.module)
        if kind == "ggn" and result.outputs is None:
            raise RuntimeError("NewtonCG(curvature='ggn') needs the closure to return (loss, outputs)")
        ggn = kind == "ggn" or (kind == "auto" and result.outputs is not None)
        call = closure if rows is None else functools.partial(closure, rows)
        if rows is None and mode == "reverse" and not ggn:
            operator = HessianOperator(result.loss, params)  # the gradient's create_graph backward serves both
            return operator, operator.gradient
        shares_graph = rows is None and ggn  # J^T u runs backward through the whole batch's outputs
        grads = tuple(g.detach() for g in gradients(result.loss, params, retain_graph=shares_graph))
        if not ggn:
            if mode == "forward":
                loss_fn = functional(self.module, lambda: parse(call(), self._owner).loss, params)
                return HessianOperator(loss_fn, params, mode="forward"), grads
            return HessianOperator(evaluate(call, self._owner, eager=True).loss, params), grads
        evaluated = result if rows is None else evaluate(call, self._owner, eager=mode == "reverse")
        if evaluated.outputs is None:
            raise RuntimeError("NewtonCG: the closure returned no outputs for its curvature rows, closure(rows)")
        loss_hessian = loss_hessian_for(self.loss_hessian, evaluated)
        if mode == "reverse":
            return GGNOperator(evaluated.outputs, params, loss_hessian), grads
        outputs_fn = functional(self.module, lambda: parse(call(), self._owner).outputs, params)
        operator = GGNOperator(outputs_fn, params, loss_hessian, mode="forward", evaluated=evaluated.outputs,
                               lean_tangents=self.lean_tangents)  # fmt: skip
        return operator, grads

    def _preconditioner(self, settings, operator, params, g, damping):
        r""":math:`r \mapsto r / (d + \lambda)^\xi` and the updated diagonal :math:`d`
        (:mod:`optim.preconditioner`), or ``(None, None)``."""
        if settings["preconditioner"] is None:
            return None, None
        estimated = preconditioner.estimate(settings["preconditioner"], operator, g, generator=self.generator,
                                            group=self.group, owner=self._owner)  # fmt: skip
        return preconditioner.preconditioner(
            estimated, [self.state[p].get("precond_diagonal") for p in params], beta=settings["precond_beta"],
            damping=damping, exponent=settings["precond_exponent"],
        )  # fmt: skip

    def _search(self, settings, closure, params, lrs, g, solve, models, f0, sign):
        r"""Steps 3-5 of the class docstring (:mod:`optim.line_search`), evaluating the closure at the trial points in
        place; the parameters are restored exactly before returning.

        Returns:
            The chosen iterate's index, the new damping, the reduction ratio :math:`\rho`, the step
            size :math:`\alpha` and whether :math:`f` was finite at some trial point (true when
            none was needed).
        """
        damping = self._global()["damping"]
        chosen = len(solve.iterates) - 1
        if not (settings["backtrack"] or settings["line_search"] or settings["adapt_damping"]):
            return chosen, damping, math.nan, 1.0, True
        origin = torch._foreach_add(params, 0.0)  # copies
        values: list[float] = []

        def f(alpha: float, index: int) -> float:
            step = torch._foreach_mul(list(solve.iterates[index].x), [alpha * lr for lr in lrs])
            torch._foreach_copy_(params, torch._foreach_add(origin, step))
            trial = evaluate(closure, self._owner, graph=False).loss
            value = sign * float(_dist.average_loss(trial, self.group))
            values.append(value if math.isfinite(value) else math.inf)
            return values[-1]

        if settings["backtrack"]:
            chosen, best = line_search.backtrack(f, models, f0, accept=settings["backtrack_accept"])
        else:
            best = f(1.0, chosen)
        ratio = line_search.reduction_ratio(best, f0, models[chosen])
        if settings["adapt_damping"]:
            damping = line_search.levenberg_marquardt(damping, ratio)
        alpha = 1.0
        if settings["line_search"]:
            if len(set(lrs)) == 1:  # g^T s = -lr b^T x, b = -g the right-hand side of CG
                slope = -lrs[0] * solve.iterates[chosen].bx
            else:
                slope = float(sum(lr * (gi * xi).sum() for lr, gi, xi in zip(lrs, g, solve.iterates[chosen].x)))
            alpha = line_search.armijo(lambda a: f(a, chosen), best, f0, slope)
        elif f0 < best < math.inf:  # without the search the step is taken as it is: say that it raises the loss
            warnings.warn(f"NewtonCG: the step raises the loss from {sign * f0:.6g} to {sign * best:.6g} "
                          "(line_search=False takes it as it is; line_search=True would shorten it)",
                          RuntimeWarning, stacklevel=user_stacklevel())
        torch._foreach_copy_(params, origin)
        return chosen, damping, ratio, alpha, min(values) < math.inf
