"""Hessian-free optimisation (Martens, 2010): truncated CG on the damped Gauss-Newton or Hessian system."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from optim import _closure
from optim import distributed as _dist
from optim.cg import _dot, cg, martens_schedule
from optim.curvature import (
    CrossEntropyHessian,
    CurvatureOperator,
    GGNOperator,
    HessianOperator,
    LossHessian,
    Mode,
    check_deterministic,
    functional,
    hutchinson_diagonal,
)
from optim.sophia import gauss_newton_bartlett

Curvature = Literal["auto", "ggn", "hessian"]
Preconditioner = Literal["hutchinson", "bartlett", "squared_gradients"] | None

#: Settings that belong to the one joint solve; every parameter group must agree on them.
GLOBAL_SETTINGS = (
    "damping", "adapt_damping", "curvature", "curvature_batch", "mode", "max_cg_iters", "cg_tol", "progress_tol",
    "progress_window", "warm_start_decay", "backtrack", "backtrack_accept", "line_search", "preconditioner",
    "precond_exponent", "precond_beta", "maximize",
)  # fmt: skip
ARMIJO_C, ARMIJO_SHRINK, ARMIJO_TRIALS = 1e-2, 0.8, 10  # Martens (2010), section 4.6
DAMPING_DOWN, DAMPING_UP = 2 / 3, 3 / 2  # Levenberg-Marquardt factors (Martens, 2010, section 4.1)


class NewtonCG(_closure.SecondOrderOptimizer):
    r"""Hessian-free (truncated Newton / Gauss-Newton) optimisation in the style of Martens (2010).

    Each step minimises the local quadratic model of the objective :math:`f` (the loss, or minus
    the loss with ``maximize``) around :math:`\theta`,

    .. math:: q(\delta) = f(\theta) + g^\top \delta + \tfrac12 \delta^\top B \delta, \qquad
              (B + \lambda I)\, x = -g,

    by truncated (optionally preconditioned) conjugate gradient :func:`optim.cg.cg` on the damped
    system. :math:`B` is the generalised Gauss-Newton matrix :math:`G = J^\top H_L J` of the model
    outputs (when the closure returns them) or the Hessian :math:`H`. Per step:

    1. One forward (the closure) and its backward for the gradient :math:`g`. The curvature
       products :math:`Bv` run on that forward's graph (reverse mode: one ``create_graph``
       backward, then each product is a backward through it), or, with ``curvature_batch``, on a
       second forward of the first rows of the batch only (Martens' curvature mini-batch):
       :math:`g` is the whole batch's, :math:`B` that of the mean loss over those rows. With
       ``mode="forward"`` the Gauss-Newton product takes :math:`J v` by forward-mode AD (a
       forward pass with tangents, no ``create_graph`` graph; see
       :class:`~optim.curvature.GGNOperator`), and a Hessian product is forward-over-reverse.
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
       :math:`\lambda \leftarrow \tfrac23 \lambda` if :math:`\rho > \tfrac34`.
    5. Armijo line search on :math:`\alpha s`: :math:`\alpha \in \{1, 0.8, 0.8^2, \dots\}` (10 trials),
       the first with :math:`f(\theta + \alpha s) \le f(\theta) + 10^{-2} \alpha\, g^\top s`; none: no step
       (:math:`\alpha = 0`). If :math:`f` is not finite at any trial point of steps 3-5, the step is
       skipped with a warning (parameters unchanged, ``step_skipped = 1``) and only the damping
       adapts (it grows, as :math:`\rho = -\infty`).
    6. Decoupled weight decay: :math:`\theta \leftarrow (1 - \eta\,\text{wd})\,\theta + \alpha s`.

    Steps 3-5 evaluate the closure again (forwards only, under ``torch.no_grad()``) at trial points:
    usually one or two forwards per step. With ``backtrack``, ``line_search`` and ``adapt_damping``
    all off, there are none.

    Data parallel (``distributed``): each rank's closure returns the mean loss over its equal share
    of the batch. The optimizer then averages over the ranks the loss (and each trial loss), the
    gradient and every curvature product (Hutchinson products included), which makes them those of
    the whole batch; CG and the search run on these averages, identically on every rank, so the
    parameters stay replicated with no further communication. Per step: one all-reduce of
    :math:`n` elements for the gradient and one per curvature product (usually ``cg_iters + 1``,
    plus one per Hutchinson probe), one scalar per closure evaluation. The Hutchinson probes must
    be the same on every rank: pass a ``generator`` seeded alike, or leave it ``None`` to get
    :func:`optim.distributed.shared_generator`. Do not wrap the model in DDP (its hooks never run).

    The closure runs the forward and returns the loss, ``(loss, outputs)`` or a dict (keys
    ``loss``, ``outputs``, ``targets``, ``loss_hessian``); it does not call ``backward``. The optimizer
    sets ``p.grad`` to the gradient of the loss. A parameter the loss does not reach (on any rank) is
    left out of the step, as ``torch.optim`` skips one whose ``p.grad`` is ``None``: it is not in the
    CG system, not moved or decayed, gets no state, and its ``p.grad`` is set to ``None``. With
    ``curvature_batch`` the closure takes one argument, ``rows``, a ``slice`` of the batch's leading
    dimension: ``closure()`` is the whole batch (gradient, trial points) and ``closure(slice(0, m))``
    its first :math:`m` rows (curvature); write it as ``def closure(rows=slice(None))`` and index the
    inputs and targets with ``rows``.
    With ``mode="forward"`` the optimizer runs the closure again with tangents attached to the
    parameters, through :func:`optim.functional` of ``module`` (which must hold the parameters and
    be deterministic: no dropout). After each step :attr:`stats` holds ``loss``,
    ``damping`` (used in the step), ``cg_iters``, ``curvature_rows`` (the rows the products ran on;
    NaN when the closure returns neither outputs nor targets, whose leading dimension it counts),
    ``reduction_ratio``, ``step_size`` (:math:`\alpha`),
    ``negative_curvature`` and ``step_skipped`` (a non-finite loss, gradient or curvature, or an
    update that would write a non-finite parameter, skips the step with a warning and leaves
    parameters and state unchanged). The constructor and ``add_param_group`` reject non-finite
    or out-of-range hyperparameters. With every parameter frozen a step changes nothing and
    returns the closure's loss. Sparse gradients are refused with an error.

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
            :mod:`optim.curvature`); ``"forward"`` needs ``module``. Forward-mode Hessian products need
            a forward-mode rule for the backward of every operation (not ``F.silu``'s in torch 2.13);
            the Gauss-Newton product needs only the forward's.
        module: The ``nn.Module`` whose parameters are optimised, for ``mode="forward"``.
        lean_tangents: Forward-mode Gauss-Newton products only: take :math:`J v` with linear layers'
            tangents accumulated in one buffer (:class:`~optim.curvature.GGNOperator`): half the memory
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
            reaches the model decrease of every earlier saved iterate,
            :math:`f(\theta + s_i) - f(\theta) \le \min_{j < i} (q(s_j) - q(0))`, without evaluating those:
            where the earlier iterates' models do not underestimate their decrease (:math:`\rho_j \le 1`), none
            of them is better. One trial forward on such steps, where Martens' backtracking (``False``) evaluates
            at least two whenever two iterates are saved. A fixed floor on the last iterate's own ratio
            :math:`\rho_i` cannot tell this: an earlier iterate whose model predicts a third of the decrease
            beats one with :math:`\rho_i = 1/4`.
        line_search: Armijo backtracking line search. Without it the chosen iterate is taken as it is, with a
            ``RuntimeWarning`` where it raises the loss (where :math:`f` is evaluated at all: with ``backtrack``
            or ``adapt_damping``).
        preconditioner: ``None``, ``"squared_gradients"`` (EMA of :math:`g \circ g`),
            ``"hutchinson"`` (EMA of the Hutchinson estimate of :math:`|\operatorname{diag} B|`, one
            product per step) or ``"bartlett"`` (Gauss-Newton with the cross-entropy only: EMA of the
            Gauss-Newton-Bartlett estimate of :math:`\operatorname{diag} G`, Sophia-G's, from labels sampled
            on the curvature rows: one backward through their graph per step and no product, see
            :func:`optim.sophia.gauss_newton_bartlett`); CG then uses :math:`M = (d + \lambda)^{\xi}`.
        precond_exponent: :math:`\xi` (Martens: 0.75).
        precond_beta: EMA factor of the preconditioner's diagonal :math:`d`.
        weight_decay: Decoupled weight decay of this group.
        maximize: Maximise the loss (minimise :math:`f = -\text{loss}`; the curvature is then
            :math:`-H` or :math:`-G`, so use Hessian mode for a concave loss).
        loss_hessian: :math:`H_L` for GGN mode: ``"cross_entropy"`` (mean over the rows of the
            logits, classes last; rows whose ``targets`` from the closure's dict equal -100 do not
            count), ``"mse"`` (mean), or any :class:`~optim.curvature.LossHessian`. A
            ``loss_hessian`` in the closure's dict overrides it for that batch.
        generator: Source of Hutchinson probes (the global one if ``None``; in distributed mode, a
            generator seeded alike on every rank: a refresh checks that it is, and raises if not).
            Distributed, each refresh's Bartlett labels come from a generator seeded with one draw of it
            plus the rank (each rank's rows need independent labels).
        distributed: ``True`` (the default process group) or a ``torch.distributed`` process group:
            average over its ranks as above. ``False``: one process.
    """

    _owner = "NewtonCG"
    _rules: ClassVar[dict[str, _closure.Rule]] = {
        "lr": _closure.NON_NEGATIVE, "damping": _closure.NON_NEGATIVE, "weight_decay": _closure.NON_NEGATIVE,
        "max_cg_iters": _closure.COUNT, "cg_tol": _closure.NON_NEGATIVE, "progress_tol": _closure.NON_NEGATIVE,
        "progress_window": _closure.COUNT,
        "warm_start_decay": _closure.UNIT_INTERVAL, "precond_exponent": _closure.NON_NEGATIVE,
        "precond_beta": _closure.DECAY,
    }  # fmt: skip

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
        _closure.check_rows("NewtonCG", "curvature_batch", curvature_batch)
        if not isinstance(backtrack_accept, bool):
            raise ValueError(f"NewtonCG: invalid backtrack_accept: {backtrack_accept!r}; expected True or False")
        _closure.check_mode("NewtonCG", mode, module)
        if not isinstance(lean_tangents, bool):
            raise ValueError(f"NewtonCG: invalid lean_tangents: {lean_tangents!r}; expected True or False")
        if lean_tangents and (mode != "forward" or curvature == "hessian"):
            raise ValueError("NewtonCG(lean_tangents=True) is for forward-mode Gauss-Newton products: it needs "
                             f"mode='forward' and curvature 'ggn' or 'auto', got mode={mode!r}, curvature={curvature!r}")
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
        self.group = _dist.resolve(distributed, "NewtonCG")
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
        """Whether the next step differentiates the graph of ``closure()`` (``rows`` false) or ``closure(rows)``
        twice: in reverse mode, the products' call (``closure(rows)`` with ``curvature_batch``, else
        ``closure()``); in forward mode none (:math:`J v` and forward-over-reverse run on passes with tangents,
        :math:`J^\top u` differentiates the graph once)."""
        settings = self.param_groups[0]
        return settings["mode"] == "reverse" and rows == (settings["curvature_batch"] is not None)

    @torch.no_grad()
    def step(self, closure: _closure.Closure | None = None) -> Tensor:  # type: ignore[override]
        """One Hessian-free step; returns the loss at the parameters before the step.

        Args:
            closure: Runs the forward and returns the loss, ``(loss, outputs)`` or a dict; required.
        """
        settings = self.param_groups[0]  # the settings of the joint solve, alike in every group
        params, groups = self._trainable()
        if not params:
            self.stats = {}
            return self._step_without_update(closure)
        global_state = self.state[self.param_groups[0]["params"][0]]
        global_state.setdefault("damping", float(settings["damping"]))
        damping = global_state["damping"]
        sign = -1.0 if settings["maximize"] else 1.0
        result, loss, finite = self._evaluate_loss(closure)
        rows, counted = _closure.curvature_rows("NewtonCG", "curvature_batch", settings["curvature_batch"], result,
                                                closure)
        self.stats = dict(
            loss=self.stats["loss"], damping=damping, cg_iters=0.0, curvature_rows=counted, reduction_ratio=math.nan,
            step_size=0.0, negative_curvature=0.0, step_skipped=1.0,
        )  # fmt: skip
        if not finite:
            return loss
        params, groups, unreached = self._reached(result.loss, params, groups)
        if not params:  # the loss reaches no parameter: nothing to solve for
            _closure.store_grads((), (), unreached)
            self.stats.update(step_skipped=0.0)
            return loss
        lrs, wds = [group["lr"] for group in groups], [group["weight_decay"] for group in groups]
        operator, grads = self._curvature(closure, result, rows, params, settings)
        _closure.store_grads(params, grads, unreached)
        g = tuple(sign * gi for gi in grads)
        if not _closure.all_finite(g):
            _closure.warn_skipped("NewtonCG", "gradient")
            return loss

        def damped(v: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            with _closure.graph_errors("NewtonCG"):
                bv = list(operator.matvec(v))
            return tuple(torch._foreach_add(torch._foreach_neg(bv) if sign < 0 else bv, list(v), alpha=damping))

        precondition, diagonal = self._preconditioner(settings, operator, params, g, damping)
        if diagonal is not None and not _closure.all_finite(diagonal):
            _closure.warn_skipped("NewtonCG", "curvature (preconditioner)")
            return loss
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
            _closure.warn_skipped("NewtonCG", "curvature (CG breakdown)")
            return loss

        # The model decrease q(s) - q(0) = g^T s + s^T B s / 2 of each candidate step s = D x.
        uniform = len(set(lrs)) == 1
        models = []
        for it in solve.iterates:
            if uniform:
                x_ax = 2 * (it.objective + it.bx)
                models.append(lrs[0] * -it.bx + 0.5 * lrs[0] ** 2 * (x_ax - damping * it.xx))
            else:
                s = tuple(lr * xi for lr, xi in zip(lrs, it.x))
                with _closure.graph_errors("NewtonCG"):
                    s_bs = sign * float(_dot(s, operator.matvec(s)))
                models.append(float(_dot(g, s)) + 0.5 * s_bs)
        operator = None  # free the graph before the parameters move (damped's closure shares this cell)
        del result, damped, precondition

        chosen, new_damping, ratio, alpha, found = self._search(
            settings, closure, params, lrs, g, solve, models, sign * self.stats["loss"], sign
        )
        self.stats.update(
            cg_iters=float(solve.iterations), reduction_ratio=ratio,
            negative_curvature=float(solve.status == "negative_curvature"),
        )  # fmt: skip
        if not found:
            unchanged = "the parameters and optimizer state"
            if new_damping != damping:
                unchanged += f" (but the damping, now {new_damping:g})"
                global_state["damping"] = new_damping
            _closure.warn_skipped("NewtonCG", "loss at every trial point of the search", unchanged)
            return loss

        def propose(item: tuple[Tensor, float, float, Tensor]) -> tuple[Tensor]:
            p, lr, wd, xi = item
            return (torch.add(p * (1 - lr * wd), xi, alpha=alpha * lr),)

        items = list(zip(params, lrs, wds, solve.iterates[chosen].x))
        if not _closure.apply_if_finite("NewtonCG", items, propose, lambda item, new: item[0].copy_(new[0])):
            return loss
        for p, xi in zip(params, solve.x):
            self.state[p]["cg_direction"] = xi.clone()
        if diagonal is not None:
            for p, d in zip(params, diagonal):
                self.state[p]["precond_diagonal"] = d
        global_state["damping"] = new_damping
        global_state["step"] = global_state.get("step", 0) + 1
        self.stats.update(step_size=alpha, step_skipped=0.0)
        return loss

    def _curvature(
        self, closure: _closure.Closure, result: _closure.ClosureResult, rows: slice | None, params: list[Tensor],
        settings: dict[str, Any],
    ) -> tuple[CurvatureOperator, tuple[Tensor, ...]]:
        """The curvature operator and the gradient of the loss (rank averages)."""
        operator, grads = self._local_curvature(closure, result, rows, params, settings)
        _closure.check_dense(self._owner, grads)
        if self.group is None:
            return operator, grads
        return _dist.AveragedOperator(operator, self.group), _dist.all_average(grads, self.group)

    def _local_curvature(
        self, closure: _closure.Closure, result: _closure.ClosureResult, rows: slice | None, params: list[Tensor],
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
        with torch.enable_grad(), _closure.graph_errors("NewtonCG"):
            if rows is None and mode == "reverse" and not ggn:
                operator = HessianOperator(result.loss, params)  # the gradient's create_graph backward serves both
                return operator, operator.gradient
            shares_graph = rows is None and ggn  # J^T u runs backward through the whole batch's outputs
            grads = _closure.gradients(result.loss, params, retain_graph=shares_graph)
            grads = tuple(g.detach() for g in grads)
            if not ggn:
                if mode == "forward":
                    loss_fn = functional(self.module, lambda: _closure.parse(call(), "NewtonCG").loss, params)
                    return HessianOperator(loss_fn, params, mode="forward"), grads
                return HessianOperator(_closure.evaluate(call, "NewtonCG", eager=True).loss, params), grads
            evaluated = result if rows is None else _closure.evaluate(call, "NewtonCG", eager=mode == "reverse")
            if evaluated.outputs is None:
                raise RuntimeError("NewtonCG: the closure returned no outputs for its curvature rows, closure(rows)")
            loss_hessian = _closure.loss_hessian_for(self.loss_hessian, evaluated)
            if mode == "reverse":
                return GGNOperator(evaluated.outputs, params, loss_hessian), grads
            outputs_fn = functional(self.module, lambda: _closure.parse(call(), "NewtonCG").outputs, params)
            operator = GGNOperator(outputs_fn, params, loss_hessian, mode="forward", evaluated=evaluated.outputs,
                                   lean_tangents=self.lean_tangents)  # fmt: skip
            return operator, grads

    def _preconditioner(self, settings, operator, params, g, damping):
        r""":math:`r \mapsto r / (d + \lambda)^\xi` and the updated diagonal :math:`d`, or ``(None, None)``."""
        kind = settings["preconditioner"]
        if kind is None:
            return None, None
        if kind == "squared_gradients":
            estimate = tuple(gi * gi for gi in g)
        elif kind == "bartlett":
            estimate = self._bartlett(operator, params)
        else:
            _dist.check_alike(self.generator, params[0].device, self.group, "NewtonCG")
            with _closure.graph_errors("NewtonCG"):
                estimate = tuple(d.abs() for d in hutchinson_diagonal(operator, generator=self.generator))
        beta = settings["precond_beta"]
        diagonal = tuple(
            beta * self.state[p]["precond_diagonal"] + (1 - beta) * e if "precond_diagonal" in self.state[p] else e
            for p, e in zip(params, estimate)
        )
        scale = tuple((d + damping) ** settings["precond_exponent"] for d in diagonal)
        return (lambda r: tuple(torch._foreach_div(list(r), list(scale)))), diagonal

    def _label_generator(self) -> torch.Generator | None:
        """The source of Bartlett's labels: the probe generator in one process; distributed, a generator seeded
        with one draw of it (alike on every rank, so the state to checkpoint stays the probe generator's) plus the
        rank, since each rank's rows need independent labels (alike draws correlated the ranks' rows and biased
        the diagonal)."""
        if self.group is None:
            return self.generator
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.generator.device))
        return torch.Generator(device=self.generator.device).manual_seed(seed + dist.get_rank(self.group))

    def _bartlett(self, operator: CurvatureOperator, params: list[Tensor]) -> tuple[Tensor, ...]:
        """The Gauss-Newton-Bartlett diagonal on the outputs of the Gauss-Newton operator (rank average)."""
        local = operator.local if isinstance(operator, _dist.AveragedOperator) else operator
        if not (isinstance(local, GGNOperator) and isinstance(local.loss_hessian, CrossEntropyHessian)):
            raise RuntimeError(
                "NewtonCG(preconditioner='bartlett') samples labels from the softmax of the outputs: it needs the "
                "Gauss-Newton curvature (a closure that returns the outputs) with loss_hessian='cross_entropy'"
            )
        hessian = local.loss_hessian
        with torch.enable_grad(), _closure.graph_errors("NewtonCG"):
            return gauss_newton_bartlett(
                local.outputs, hessian.targets, params, ignore_index=hessian.ignore_index,
                generator=self._label_generator(), chunk_elements=hessian.chunk_elements, group=self.group,
                owner="NewtonCG",
            )  # fmt: skip

    def _search(self, settings, closure, params, lrs, g, solve, models, f0, sign):
        r"""CG backtracking, damping adaptation and Armijo line search.

        Trial points are evaluated in place; the parameters are restored exactly before returning.

        Returns:
            The chosen iterate's index, the new damping, the reduction ratio :math:`\rho`, the step
            size :math:`\alpha` and whether :math:`f` was finite at some trial point (true when
            none was needed).
        """
        damping = self.state[self.param_groups[0]["params"][0]]["damping"]
        needs_f = settings["backtrack"] or settings["line_search"] or settings["adapt_damping"]
        chosen = len(solve.iterates) - 1
        if not needs_f:
            return chosen, damping, math.nan, 1.0, True
        origin = torch._foreach_add(params, 0.0)  # copies
        values: list[float] = []

        def f(alpha: float, index: int) -> float:
            step = torch._foreach_mul(list(solve.iterates[index].x), [alpha * lr for lr in lrs])
            torch._foreach_copy_(params, torch._foreach_add(origin, step))
            trial = _closure.evaluate(closure, "NewtonCG", graph=False).loss
            value = sign * float(_dist.average_loss(trial, self.group))
            values.append(value if math.isfinite(value) else math.inf)
            return values[-1]

        def accepted(index: int, value: float) -> bool:
            """Whether iterate ``index`` decreased f as much as any earlier saved iterate's model predicts."""
            return settings["backtrack_accept"] and value - f0 <= min(models[:index])

        best = f(1.0, chosen)
        while settings["backtrack"] and chosen > 0 and not accepted(chosen, best):
            previous = f(1.0, chosen - 1)
            if previous >= best:
                break
            chosen, best = chosen - 1, previous
        model = models[chosen]
        ratio = (best - f0) / model if model < 0 else (0.0 if best <= f0 else -math.inf)
        if settings["adapt_damping"]:
            if ratio < 0.25:
                damping *= DAMPING_UP
            elif ratio > 0.75:
                damping *= DAMPING_DOWN
        alpha = 1.0
        if settings["line_search"]:
            if len(set(lrs)) == 1:  # g^T s = -lr b^T x, b = -g the right-hand side of CG
                slope = -lrs[0] * solve.iterates[chosen].bx
            else:
                slope = float(sum(lr * (gi * xi).sum() for lr, gi, xi in zip(lrs, g, solve.iterates[chosen].x)))
            value, trials = best, 1
            if slope >= 0:  # not a descent direction: Armijo's test would let f rise (CG from zero never gives one)
                alpha, value = 0.0, f0
            while value > f0 + ARMIJO_C * alpha * slope:
                if trials == ARMIJO_TRIALS:
                    alpha = 0.0
                    break
                alpha *= ARMIJO_SHRINK
                value, trials = f(alpha, chosen), trials + 1
        elif f0 < best < math.inf:  # without the search the step is taken as it is: say that it raises the loss
            warnings.warn(f"NewtonCG: the step raises the loss from {sign * f0:.6g} to {sign * best:.6g} "
                          "(line_search=False takes it as it is; line_search=True would shorten it)",
                          RuntimeWarning, stacklevel=3)
        torch._foreach_copy_(params, origin)
        return chosen, damping, ratio, alpha, min(values) < math.inf
