"""SophiaH: Sophia with Hutchinson's estimate of the Hessian diagonal."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from optim import distributed as _dist
from optim._autodiff import Mode
from optim._closure import Closure, ClosureResult, check_graph, curvature_rows, evaluate, graph_errors, parse
from optim._gradients import check_dense, reached, select
from optim.diagonal import Distribution, hutchinson_diagonal
from optim.functional import functional
from optim.hyperparameters import COUNT, check_hyperparameters, check_optimizer_mode
from optim.operators import CurvatureOperator, GradientGraphHessian, HessianOperator
from optim.optimizer import Evaluation
from optim.sophia import Estimate, _Sophia


class SophiaH(_Sophia):
    r"""Sophia with Hutchinson's estimate of the Hessian diagonal (Sophia-H).

    .. math:: \hat h = u \circ (H u), \qquad u \sim \mathcal N(0, I)\ \text{(the paper) or Rademacher},

    by :func:`~optim.diagonal.hutchinson_diagonal` on the closure's loss; the update is that of
    the Sophia class docstring (:class:`~optim.sophia_g.SophiaG` shows it in full). A refresh step costs one
    ``create_graph`` backward and one Hessian-vector product, reusing the step's forward; other
    steps cost one ordinary gradient.

    Example:
        >>> opt = SophiaH(model.parameters(), lr=6e-4)
        >>> loss = opt.step(lambda: F.cross_entropy(model(x).flatten(0, -2), y.flatten()))

    In a loop that calls ``backward`` itself, either keep the gradient's graph, as other Sophia-H
    and AdaHessian packages do: on refresh steps :meth:`step` takes :math:`H u` through the graph
    of ``p.grad`` (the same estimate as the closure's, probe for probe: in both, as in ``torch.optim``, a
    parameter the loss does not reach, whose ``p.grad`` is ``None``, is skipped and takes no probe), then
    detaches ``p.grad``::

        loss_fn(model(x), y).backward(create_graph=True)   # create_graph needed on refresh steps only
        opt.step()

    or refresh the estimate yourself before ``backward`` (it keeps the graph)::

        loss = loss_fn(model(x), y)
        if step % 10 == 0:
            opt.update_hessian(loss)
        loss.backward()
        opt.step()

    A first step that finds neither raises ``RuntimeError`` rather than run with :math:`h = 0`.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate :math:`\eta` (the largest per-coordinate step).
        betas: :math:`(\beta_1, \beta_2)` of the gradient and Hessian EMAs (paper: 0.965, 0.99).
        rho: :math:`\rho` (:math:`\gamma` in the paper); 0.01 is the authors' Sophia-H value (levanter).
        weight_decay: Decoupled weight decay :math:`\lambda` (paper's GPT-2 runs: 0.1-0.2).
        eps: :math:`\epsilon` (paper: 1e-15).
        update_period: :math:`k`, steps between Hessian refreshes (paper: 10).
        maximize: Maximise the loss.
        distribution: Hutchinson probes, ``"gaussian"`` (paper) or ``"rademacher"``.
        num_samples: Probes per refresh.
        generator: Source of the probes (the global one if ``None``). Data parallel, the probes must
            be the same on every rank (:math:`\hat h = u \circ \frac1R \sum_r H_r u`, the whole
            batch's estimate): a generator seeded alike, or ``None`` for
            :func:`optim.distributed.shared_generator`.
        distributed: ``True`` (the default process group) or a process group: average over its
            ranks (see the Sophia class docstring). ``False``: one process.
        hessian_batch: Rows of the batch the refresh's estimate runs on: ``None`` (all, on the gradient's
            own forward), a count :math:`m \ge 1` or a fraction :math:`f \in (0, 1)` of the :math:`R` rows
            (the leading dimension of the closure's outputs, or targets; :math:`m = \max(1, \lfloor f R
            \rfloor)`), as NewtonCG's ``curvature_batch``: a refresh step then takes the gradient from
            ``closure()`` (differentiated once) and :math:`\hat h` from ``closure(slice(0, m))``, the estimate of
            the mean loss over those rows (Liu et al. estimate on a subset of the batch too). The closure takes
            ``rows``: ``def closure(rows=slice(None))``. ``stats["hessian_rows"]`` reports :math:`m`.
        mode: How the Hessian-vector products of the estimate differentiate: ``"reverse"`` (reverse over
            reverse: a ``create_graph`` backward of the closure's graph, then a backward of it) or ``"forward"``
            (forward over reverse, :func:`optim.hvp`: the closure runs again with the probe as the parameters'
            tangent, then one backward that carries tangents; no gradient graph is kept). Forward mode needs a
            closure and ``module`` and every operation to have a forward-mode rule of its backward
            (docs/forward_mode.md compares the modes). With ``hessian_batch`` ``None`` a refresh step runs no
            plain pass: the loss and gradient are the values of the first probe's pass.
        module: The ``nn.Module`` whose parameters are optimised, for ``mode="forward"`` (run through
            :func:`optim.functional`). With dropout each probe's pass draws its own mask, so the
            estimate is one of the Hessian averaged over masks (each probe is still unbiased for it), and
            a BatchNorm's running statistics advance once per probe.
        bias_correction: Divide :math:`h` by :math:`1 - \beta_2^{n}` in the update, :math:`n` the refreshes so
            far (see the Sophia class docstring; not in the paper, whose runs are long enough for it not to matter).
    """

    _owner = "SophiaH"
    _plain_loop = (
        "call loss.backward(create_graph=True) before opt.step() (the estimate is then taken through p.grad), or "
        "opt.update_hessian(loss) before loss.backward(), or pass a closure: opt.step(lambda: loss_fn(model(x), y))"
    )

    def __init__(
        self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 6e-4,
        betas: tuple[float, float] = (0.965, 0.99), rho: float = 0.01, weight_decay: float = 0.1, eps: float = 1e-15,
        *, update_period: int = 10, maximize: bool = False, distribution: Distribution = "gaussian",
        num_samples: int = 1, generator: torch.Generator | None = None, distributed: _dist.Distributed = False,
        hessian_batch: int | float | None = None, mode: Mode = "reverse", module: nn.Module | None = None,
        bias_correction: bool = False,
    ) -> None:  # fmt: skip
        check_hyperparameters(self._owner, {"num_samples": num_samples}, {"num_samples": COUNT})
        check_optimizer_mode(self._owner, mode, module)
        super().__init__(params, lr, betas, rho, weight_decay, eps, update_period, maximize, generator, distributed,
                         hessian_batch, bias_correction)
        self.distribution, self.num_samples = distribution, num_samples
        self.mode, self.module = mode, module

    def _hutchinson(
        self, operator: CurvatureOperator, groups: list[dict[str, Any]], gradient: bool = False
    ) -> Estimate:
        r""":math:`\hat h` of ``operator`` (:func:`~optim.diagonal.hutchinson_diagonal`, of :math:`-H` for the
        groups that maximise) and, if ``gradient``, the gradient the operator is taken at (read after the products,
        which in forward mode bring it), averaged over the ranks in one all-reduce: the probes are alike on every
        rank, so averaging :math:`u \circ H_r u` averages :math:`H_r u`."""
        _dist.check_alike(self.generator, operator.params[0].device, self.group, self._owner)
        estimate = hutchinson_diagonal(operator, self.num_samples, self.distribution, self.generator)
        grads = operator.gradient if gradient else ()
        check_dense(self._owner, grads)
        signed = tuple(-e if group["maximize"] else e for e, group in zip(estimate, groups))
        return _dist.all_average_together(grads, signed, self.group)

    def _reverse_operator(self, loss: Tensor, params: list[Tensor]) -> HessianOperator:
        operator = HessianOperator(loss, params)
        check_dense(self._owner, operator.gradient)
        return operator

    def _forward_operator(self, call: Closure, params: list[Tensor], rows: list | None = None,
                          reached_by: list | None = None) -> HessianOperator:  # fmt: skip
        """Forward-over-reverse products of ``call()``'s loss: ``call`` runs again with tangents on the parameters;
        ``rows`` (a list) receives the batch rows of each run (``stats["hessian_rows"]``), ``reached_by`` (a list)
        which parameters the first run's loss reaches on any rank (:func:`optim._gradients.reached`)."""

        def loss() -> Tensor:
            result = parse(call(), self._owner)
            check_graph(result, self._owner)
            if rows is not None:
                rows.append(curvature_rows(self._owner, "hessian_batch", None, result, call)[1])
            return result.loss

        run = functional(self.module, loss, params)

        def tracked(values: list[Tensor]) -> Tensor:
            value = run(values)
            if reached_by is not None and not reached_by:
                reached_by.append(reached(value, values, self.group))
            return value

        return HessianOperator(tracked, params, mode="forward")

    def _take(self, taken: Evaluation) -> bool:
        """In forward mode a refresh on the whole batch runs no pass of its own for the loss and gradient: they
        are the values of the first probe's forward-over-reverse pass (whose tangents give :math:`H u`). Which
        parameters the loss reaches is then known only after that pass: whether the step refreshes is decided
        on every trainable parameter (a parameter without :math:`h` that the last step skipped does not make it
        due), the probes cover them all, and the unreached ones are left out afterwards."""
        if self.mode == "forward" and self.hessian_batch is None:
            due = self._due(taken.params, taken.groups)
            if any(due):
                return self._take_from_first_probe(taken, due)
        return super()._take(taken)

    def _take_from_first_probe(self, taken: Evaluation, due: list[bool]) -> bool:
        r"""The loss, gradient and :math:`\hat h` of a forward-mode refresh on the whole batch (:meth:`_take`)."""
        rows, reached_by = [], []
        with torch.enable_grad(), graph_errors(self._owner):
            operator = self._forward_operator(taken.closure, taken.params, rows, reached_by)
            grads, estimate = self._hutchinson(operator, taken.groups, gradient=True)
        self.stats["hessian_rows"] = rows[0]
        mask = reached_by[0]
        (taken.unreached,) = select([not r for r in mask], taken.params)
        taken.params, taken.groups, due = select(mask, taken.params, taken.groups, due)
        taken.loss = _dist.average_loss(operator.value, self.group)
        if not taken.params:  # the loss reaches no parameter: nothing to update
            self._without_update(taken)
            return False
        self._take_estimate(taken, *map(tuple, select(mask, grads, estimate)), due)
        return True

    def _estimate(self, result: ClosureResult, call: Closure, params: list[Tensor],
                  groups: list[dict[str, Any]]) -> Estimate:  # fmt: skip
        operator = self._reverse_operator(result.loss, params)  # forward mode takes _take's path
        return self._hutchinson(operator, groups, gradient=True)

    def _diagonal(self, call: Closure, params: list[Tensor], groups: list[dict[str, Any]]) -> tuple[Tensor, ...]:
        if self.mode == "reverse":
            operator = self._reverse_operator(evaluate(call, self._owner, eager=True).loss, params)
        else:
            operator = self._forward_operator(call, params)
        return self._hutchinson(operator, groups)[1]

    def _estimate_from_grads(self, params: list[Tensor], groups: list[dict[str, Any]]) -> Estimate | None:
        self._check_reverse("a step without a closure")
        grads = tuple(p.grad for p in params)
        if not any(g.requires_grad for g in grads):
            return None
        return self._hutchinson(GradientGraphHessian(grads, params), groups, gradient=True)

    def _check_reverse(self, what: str) -> None:
        if self.mode == "forward":
            raise RuntimeError(
                f"SophiaH(mode='forward') takes its estimate through a closure, which it runs again with tangents; "
                f"{what} has only a graph to differentiate in reverse mode: pass opt.step(closure), or use "
                "mode='reverse'"
            )

    def differentiates_twice(self, rows: bool = False) -> bool:
        """As for any Sophia in reverse mode; in forward mode no call is (the products run on passes with tangents)."""
        return self.mode == "reverse" and super().differentiates_twice(rows)

    @torch.no_grad()
    def update_hessian(self, loss: Tensor) -> None:
        r"""Refresh :math:`h` from a loss with its graph (kept, so ``loss.backward()`` may follow).

        A parameter the loss does not reach keeps its :math:`h` (none if it has none), as :meth:`step` skips it.

        With ``maximize`` the estimate is that of :math:`-\text{loss}`. A non-finite estimate is
        discarded with a warning.

        Raises:
            TypeError: ``loss`` is not a one-element tensor (logits go to :meth:`SophiaG.update_hessian`).
            RuntimeError: ``loss`` has no autograd graph.
        """
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise TypeError(
                f"SophiaH.update_hessian takes the scalar loss with its graph (before loss.backward()), got {shape}; "
                "logits are what SophiaG.update_hessian takes"
            )
        if not loss.requires_grad:
            raise RuntimeError("SophiaH.update_hessian: the loss has no autograd graph (call it before backward)")
        self._check_reverse("update_hessian(loss)")
        params, groups, _ = self._reached(loss, *self._trainable())
        if not params:  # every parameter frozen, or none reached: nothing to refresh
            return
        with torch.enable_grad(), graph_errors(self._owner):
            _, estimate = self._hutchinson(self._reverse_operator(loss, params), groups)
        self._refresh(params, groups, estimate)
