"""AdaHessian (Yao et al., 2021): Adam with the second moment of a Hutchinson Hessian-diagonal estimate."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from optim import _closure
from optim import distributed as _dist
from optim.curvature import (
    Distribution,
    HessianOperator,
    _probe,
    _vjp,
    hutchinson_diagonal,
)


class AdaHessian(Optimizer):
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

    Data parallel (``distributed``): each rank's closure returns the mean loss over its equal share
    of the batch, the probe :math:`z_t` is the same on every rank, and the optimizer averages over
    the ranks the loss (a scalar) and, in one all-reduce of :math:`2n` elements, :math:`g_t` and
    :math:`D_t`: the whole batch's values, so the state stays the same on every rank. Without a
    closure the same holds for ``p.grad`` (whether or not DDP averaged it already).

    Example:
        >>> opt = AdaHessian(model.parameters(), lr=0.15)
        >>> loss = opt.step(lambda: loss_fn(model(x), y))

    In a loop that calls ``backward`` itself, keep the gradient's graph::

        loss_fn(model(x), y).backward(create_graph=True)
        opt.step()      # takes H z through p.grad, then detaches p.grad

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate :math:`\eta` (released default 0.15).
        betas: :math:`(\beta_1, \beta_2)` (0.9, 0.999).
        eps: :math:`\epsilon` (1e-4).
        weight_decay: Decoupled weight decay :math:`\lambda`.
        hessian_power: :math:`k \in [0, 1]` (1).
        spatial_average: Average :math:`D` over the last two dimensions of 4-D parameters.
        maximize: Maximise the loss.
        distribution: Hutchinson probes, ``"rademacher"`` or ``"gaussian"``.
        generator: Source of the probes (the global one if ``None``; in distributed mode, one
            seeded alike on every rank, :func:`optim.distributed.shared_generator`).
        distributed: ``True`` (the default process group) or a process group: average over its
            ranks as above. ``False``: one process.
    """

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
        if lr < 0 or eps <= 0 or weight_decay < 0 or not 0 <= hessian_power <= 1:
            raise ValueError("need lr >= 0, eps > 0, weight_decay >= 0 and 0 <= hessian_power <= 1")
        if not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"need 0 <= betas < 1, got {betas}")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, hessian_power=hessian_power,
            spatial_average=spatial_average, maximize=maximize,
        )  # fmt: skip
        super().__init__(params, defaults)
        self.group = _dist.resolve(distributed, "AdaHessian")
        if generator is None and self.group is not None:
            generator = _dist.shared_generator(self.param_groups[0]["params"][0].device, self.group)
        self.distribution, self.generator = distribution, generator
        self.stats: dict[str, float] = {}

    def _probe_products(self, grads: tuple[Tensor, ...], params: list[Tensor]) -> tuple[Tensor, ...]:
        r""":math:`z \circ H z` for one probe :math:`z`, from gradients that carry their graph."""
        z = _probe(params, self.distribution, self.generator)
        with _closure.graph_errors("AdaHessian"):
            hz = _vjp(grads, params, z, retain_graph=False)
        return tuple(zi * hzi for zi, hzi in zip(z, hz))

    @torch.no_grad()
    def step(self, closure: _closure.Closure | None = None) -> Tensor | None:  # type: ignore[override]
        """One AdaHessian step; returns the closure's loss (``None`` without a closure).

        With a closure (forward only, returning the loss or ``(loss, outputs)``) the optimizer
        takes the gradient with ``create_graph=True`` and the Hessian-vector product itself and
        leaves the detached gradient in ``p.grad``. Without one, every ``p.grad`` (parameters
        without one are skipped) must come from ``loss.backward(create_graph=True)``.
        """
        loss = None
        self.stats = dict(loss=float("nan"), hessian_trace=float("nan"), step_skipped=1.0)
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if closure is not None:
            result = _closure.evaluate(closure, "AdaHessian")
            loss = _dist.average_loss(result.loss.detach(), self.group)
            self.stats["loss"] = float(loss)
            if not _closure.all_finite([loss]):
                _closure.warn_skipped("AdaHessian", "loss")
                return loss
            with torch.enable_grad(), _closure.graph_errors("AdaHessian"):
                operator = HessianOperator(result.loss, params)
                estimate = hutchinson_diagonal(operator, 1, self.distribution, self.generator)
            grads = operator.gradient
            del operator, result
        else:
            params = [p for p in params if p.grad is not None]
            if not all(p.grad.requires_grad for p in params):
                raise RuntimeError(
                    "AdaHessian.step() without a closure needs gradients with a graph: call "
                    "loss.backward(create_graph=True), or pass a closure that returns the loss"
                )
            with torch.enable_grad():
                estimate = self._probe_products(tuple(p.grad for p in params), params)
            grads = tuple(p.grad.detach() for p in params)
        averaged = _dist.all_average((*grads, *estimate), self.group)
        grads, estimate = averaged[: len(params)], averaged[len(params) :]
        _closure.store_grads(params, grads)
        if not _closure.all_finite(grads):
            _closure.warn_skipped("AdaHessian", "gradient")
            return loss
        if not _closure.all_finite(estimate):
            _closure.warn_skipped("AdaHessian", "curvature (Hessian estimate)")
            return loss
        self._update(params, grads, estimate)
        self.stats.update(hessian_trace=float(sum(d.sum() for d in estimate)), step_skipped=0.0)
        return loss

    def _update(self, params: list[Tensor], grads: tuple[Tensor, ...], estimate: tuple[Tensor, ...]) -> None:
        groups = {p: group for group in self.param_groups for p in group["params"]}
        for p, g, d in zip(params, grads, estimate):
            group = groups[p]
            beta1, beta2 = group["betas"]
            if group["spatial_average"] and d.dim() == 4:
                d = d.mean(dim=(2, 3), keepdim=True).expand_as(d)
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_hessian_diag_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            m, v = state["exp_avg"], state["exp_hessian_diag_sq"]
            m.mul_(beta1).add_(-g if group["maximize"] else g, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(d, d, value=1 - beta2)
            bias1, bias2 = 1 - beta1 ** state["step"], 1 - beta2 ** state["step"]
            denom = (v / bias2).sqrt().pow(group["hessian_power"]).add_(group["eps"])
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.addcdiv_(m, denom, value=-group["lr"] / bias1)
