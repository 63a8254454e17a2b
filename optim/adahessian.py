"""AdaHessian (Yao et al., 2021): Adam with the second moment of a Hutchinson Hessian-diagonal estimate."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from optim import _closure
from optim import distributed as _dist
from optim.curvature import Distribution, HessianOperator, hutchinson_diagonal


class AdaHessian(_closure.SecondOrderOptimizer):
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
    _rules: ClassVar[dict[str, _closure.Rule]] = {
        "lr": _closure.NON_NEGATIVE, "betas": _closure.BETAS, "eps": _closure.POSITIVE,
        "weight_decay": _closure.NON_NEGATIVE, "hessian_power": _closure.UNIT_INTERVAL,
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

    @torch.no_grad()
    def step(self, closure: _closure.Closure | None = None) -> Tensor | None:  # type: ignore[override]
        """One AdaHessian step; returns the closure's loss (``None`` without a closure).

        With a closure (forward only, returning the loss or ``(loss, outputs)``) the optimizer
        takes the gradient with ``create_graph=True`` and the Hessian-vector product itself and
        leaves the detached gradient in ``p.grad``; a parameter the loss does not reach is skipped
        (no update, decay or state; ``p.grad`` set to ``None``), as ``torch.optim`` skips one without
        a gradient. Without one, ``p.grad`` (parameters without one are skipped) must come from
        ``loss.backward(create_graph=True)``.
        """
        loss = None
        self.stats = dict(loss=float("nan"), hessian_trace=float("nan"), step_skipped=1.0)
        params, groups = self._trainable()
        if closure is None:
            params, groups = self._with_grad(params, groups)
        if not params:
            return self._step_without_update(closure)
        _dist.check_alike(self.generator, params[0].device, self.group, self._owner)
        unreached = []
        if closure is not None:
            result, loss, finite = self._evaluate_loss(closure)
            if not finite:
                return loss
            params, groups, unreached = self._reached(result.loss, params, groups)
            if not params:  # the loss reaches no parameter: nothing to update
                _closure.store_grads((), (), unreached)
                self.stats.update(step_skipped=0.0)
                return loss
            with torch.enable_grad(), _closure.graph_errors(self._owner):
                operator = HessianOperator(result.loss, params)
                _closure.check_dense(self._owner, operator.gradient)
                estimate = hutchinson_diagonal(operator, 1, self.distribution, self.generator)
            del result
        else:
            _closure.check_dense(self._owner, (p.grad for p in params))
            if not any(p.grad.requires_grad for p in params):
                raise RuntimeError(
                    "AdaHessian.step() without a closure needs gradients with a graph: call "
                    "loss.backward(create_graph=True), or pass a closure that returns the loss"
                )
            with torch.enable_grad(), _closure.graph_errors(self._owner):
                operator = _closure.GradientGraphHessian(tuple(p.grad for p in params), params)
                estimate = hutchinson_diagonal(operator, 1, self.distribution, self.generator)
        grads = operator.gradient
        del operator  # frees the gradient's graph (p.grad is replaced by the detached gradient below)
        averaged = _dist.all_average((*grads, *estimate), self.group)
        grads, estimate = averaged[: len(params)], averaged[len(params) :]
        _closure.store_grads(params, grads, unreached)
        if not _closure.all_finite(grads):
            _closure.warn_skipped(self._owner, "gradient")
            return loss
        if not _closure.all_finite(estimate):
            _closure.warn_skipped(self._owner, "curvature (Hessian estimate)")
            return loss
        items = list(zip(params, groups, grads, estimate))
        if _closure.apply_if_finite(self._owner, items, lambda item: self._propose(*item), self._commit):
            self.stats.update(hessian_trace=float(sum(d.sum() for d in estimate)), step_skipped=0.0)
        return loss

    def _propose(
        self, p: Tensor, group: dict[str, Any], g: Tensor, d: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The new parameter, :math:`m` and :math:`v` of one parameter (out of place)."""
        beta1, beta2 = group["betas"]
        if group["spatial_average"] and d.dim() == 4:
            d = d.mean(dim=(2, 3), keepdim=True).expand_as(d)
        state = self.state[p]
        zeros = torch.zeros_like(p, memory_format=torch.preserve_format)
        m, v = state.get("exp_avg", zeros), state.get("exp_hessian_diag_sq", zeros)
        step = state.get("step", 0) + 1
        m = torch.add(m * beta1, -g if group["maximize"] else g, alpha=1 - beta1)
        v = torch.addcmul(v * beta2, d, d, value=1 - beta2)
        bias1, bias2 = 1 - beta1**step, 1 - beta2**step
        denom = (v / bias2).sqrt().pow(group["hessian_power"]).add_(group["eps"])
        new_p = torch.addcdiv(p * (1 - group["lr"] * group["weight_decay"]), m, denom, value=-group["lr"] / bias1)
        return new_p, m, v

    def _commit(self, item: tuple, new: tuple[Tensor, Tensor, Tensor]) -> None:
        p, (new_p, m, v) = item[0], new
        p.copy_(new_p)
        state = self.state[p]
        state.update(step=state.get("step", 0) + 1, exp_avg=m, exp_hessian_diag_sq=v)
