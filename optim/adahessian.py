"""AdaHessian (Yao et al., 2021): Adam with the second moment of a Hutchinson Hessian-diagonal estimate."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from optim import distributed as _dist
from optim import updates
from optim._gradients import check_dense
from optim.diagonal import Distribution, hutchinson_diagonal
from optim.hyperparameters import BETAS, NON_NEGATIVE, POSITIVE, UNIT_INTERVAL, Rule
from optim.operators import CurvatureOperator, GradientGraphHessian, HessianOperator
from optim.optimizer import Evaluation, SecondOrderOptimizer, Update


class AdaHessian(SecondOrderOptimizer):
    r"""AdaHessian: a Hutchinson estimate of the Hessian diagonal every step, in place of Adam's squared gradient.

    For step :math:`t` with gradient :math:`g_t` (negated with ``maximize``) and a fresh probe
    :math:`z_t` (Rademacher by default):

    .. math::
        D_t &= z_t \circ (H z_t) \quad \text{(averaged over the spatial dimensions of 4-D conv kernels)}, \\
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1)\, g_t, \qquad v_t = \beta_2 v_{t-1} + (1 - \beta_2)\, D_t \circ D_t, \\
        \theta_{t+1} &= (1 - \eta\lambda)\,\theta_t
            - \eta\, \frac{m_t / (1 - \beta_1^t)}{\big(\sqrt{v_t / (1 - \beta_2^t)}\big)^{k} + \epsilon},

    with :math:`k` the Hessian power and :math:`\lambda` decoupled weight decay (as the released
    code applies it). Each step costs one ``create_graph`` backward and one Hessian-vector product.
    :attr:`stats` holds ``loss``, ``hessian_trace`` (:math:`\sum D_t`, a Hutchinson trace estimate)
    and ``step_skipped``.

    A step is skipped with a ``RuntimeWarning`` (parameters and state unchanged,
    ``step_skipped = 1``) when the loss, :math:`g_t` or :math:`D_t` is not finite, or when the
    update would write a non-finite parameter or state value; the constructor and
    ``add_param_group`` reject non-finite hyperparameters. With every parameter frozen, or none
    holding a gradient, a step changes nothing and returns the closure's loss. A parameter the
    closure's loss does not reach is skipped, as ``torch.optim`` skips one whose ``p.grad`` is
    ``None``. Sparse gradients are refused with an error.

    Data parallel (``distributed``): each rank's closure returns the mean loss over its equal share
    of the batch, the probe :math:`z_t` is the same on every rank, and the optimizer averages over
    the ranks the loss (a scalar) and, in one all-reduce of :math:`2n` elements, :math:`g_t` and
    :math:`D_t`: the whole batch's values, so the state stays the same on every rank. Without a
    closure the same holds for ``p.grad`` (whether or not DDP averaged it already); a parameter with
    a ``p.grad`` on some rank only counts on every rank, with zeros where it has none (one more
    all-reduce, of one number per parameter tensor).

    Example:
        >>> opt = AdaHessian(model.parameters(), lr=0.15)
        >>> loss = opt.step(lambda: loss_fn(model(x), y))

    In a loop that calls ``backward`` itself, keep the gradient's graph::

        loss_fn(model(x), y).backward(create_graph=True)
        opt.step()      # takes H z through p.grad (the closure's estimate, probe for probe), then detaches p.grad

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate :math:`\eta` (released default 0.15).
        betas: :math:`(\beta_1, \beta_2)` (0.9, 0.999).
        eps: :math:`\epsilon` (1e-4).
        weight_decay: Decoupled weight decay :math:`\lambda`.
        hessian_power: :math:`k \in [0, 1]` (1).
        spatial_average: Average :math:`D` over the last two dimensions of 4-D parameters, signed, as the
            paper's formula has it (the released code averages :math:`|D|`, which differs where :math:`D`
            changes sign within a kernel).
        maximize: Maximise the loss.
        distribution: Hutchinson probes, ``"rademacher"`` or ``"gaussian"``.
        generator: Source of the probes (the global one if ``None``; in distributed mode, one
            seeded alike on every rank, :func:`optim.distributed.shared_generator`).
        distributed: ``True`` (the default process group) or a process group: average over its
            ranks as above. ``False``: one process.
    """

    _owner = "AdaHessian"
    _rules: ClassVar[dict[str, Rule]] = {
        "lr": NON_NEGATIVE, "betas": BETAS, "eps": POSITIVE, "weight_decay": NON_NEGATIVE,
        "hessian_power": UNIT_INTERVAL,
    }  # fmt: skip

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.15,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-4,
        weight_decay: float = 0.0,
        hessian_power: float = 1.0,
        *,
        spatial_average: bool = True,
        maximize: bool = False,
        distribution: Distribution = "rademacher",
        generator: torch.Generator | None = None,
        distributed: _dist.Distributed = False,
    ) -> None:
        betas = tuple(betas) if isinstance(betas, list) else betas  # a wrong kind is reported by the checks
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, hessian_power=hessian_power,
            spatial_average=spatial_average, maximize=maximize,
        )  # fmt: skip
        super().__init__(params, defaults)
        self.group = _dist.resolve(distributed, self._owner)
        if generator is None and self.group is not None:
            generator = _dist.shared_generator(self.param_groups[0]["params"][0].device, self.group)
        self.distribution, self.generator = distribution, generator

    def _initial_stats(self) -> dict[str, float]:
        return dict(loss=math.nan, hessian_trace=math.nan, step_skipped=1.0)

    def _prepare(self, params: list[Tensor]) -> None:
        _dist.check_alike(self.generator, params[0].device, self.group, self._owner)

    def _differentiate(self, taken: Evaluation) -> None:
        """:math:`g_t` and :math:`D_t` of the closure's loss: its gradient with ``create_graph=True``, then one
        Hessian-vector product."""
        operator = HessianOperator(taken.result.loss, taken.params)
        check_dense(self._owner, operator.gradient)
        self._estimate(operator, taken)

    def _differentiate_gradients(self, taken: Evaluation) -> None:
        """:math:`g_t` and :math:`D_t` through ``p.grad``, which must carry its graph."""
        check_dense(self._owner, (p.grad for p in taken.params))
        if not any(p.grad.requires_grad for p in taken.params):
            raise RuntimeError(
                "AdaHessian.step() without a closure needs gradients with a graph: call "
                "loss.backward(create_graph=True), or pass a closure that returns the loss"
            )
        self._estimate(GradientGraphHessian(tuple(p.grad for p in taken.params), taken.params), taken)

    def _estimate(self, operator: CurvatureOperator, taken: Evaluation) -> None:
        """The gradient the operator is taken at and the Hutchinson estimate :math:`D_t` of its diagonal, averaged
        over the ranks in one all-reduce (the probes are alike on every rank)."""
        estimate = hutchinson_diagonal(operator, 1, self.distribution, self.generator)
        taken.grads, taken.curvature = _dist.all_average_together(operator.gradient, estimate, self.group)
        taken.checks = {"curvature (Hessian estimate)": taken.curvature}

    def _propose(self, taken: Evaluation) -> Update:
        """Each parameter's new value, :math:`m` and :math:`v` (:func:`optim.updates.adahessian`), one parameter
        at a time."""
        return Update(list(zip(taken.params, taken.groups, taken.grads, taken.curvature)), self._propose_one,
                      self._commit)

    def _propose_one(self, item: tuple[Tensor, dict[str, Any], Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        p, group, g, d = item
        beta1, beta2 = group["betas"]
        state = self.state[p]
        zeros = torch.zeros_like(p, memory_format=torch.preserve_format)
        (new_p,), (m,), (v,) = updates.adahessian(
            [p], [g], [d], [state.get("exp_avg", zeros)], [state.get("exp_hessian_diag_sq", zeros)],
            [state.get("step", 0) + 1], lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], hessian_power=group["hessian_power"],
            spatial_average=group["spatial_average"], maximize=group["maximize"],
        )  # fmt: skip
        return new_p, m, v

    def _commit(self, item: tuple, new: tuple[Tensor, Tensor, Tensor]) -> None:
        p, (new_p, m, v) = item[0], new
        p.copy_(new_p)
        state = self.state[p]
        state.update(step=state.get("step", 0) + 1, exp_avg=m, exp_hessian_diag_sq=v)

    def _finish(self, taken: Evaluation, scalars: list[float]) -> None:
        self.stats.update(hessian_trace=float(sum(d.sum() for d in taken.curvature)), step_skipped=0.0)
