"""Sophia (Liu et al., 2023): clipped steps preconditioned by a Hutchinson or Gauss-Newton-Bartlett Hessian diagonal."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.optim import Optimizer

from optim import _closure
from optim import distributed as _dist
from optim.curvature import Distribution, HessianOperator, hutchinson_diagonal


class _Sophia(Optimizer):
    r"""The update shared by :class:`SophiaH` and :class:`SophiaG` (Liu et al., 2023, Algorithm 3).

    For step :math:`t = 1, 2, \dots` with gradient :math:`g_t` (negated with ``maximize``):

    .. math::
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1)\, g_t, \\
        h_t &= \beta_2 h_{t-k} + (1 - \beta_2)\, \hat h_t \quad \text{if } t \bmod k = 1,
              \text{ else } h_t = h_{t-1}, \\
        \theta_t &\leftarrow (1 - \eta \lambda)\, \theta_t, \qquad
        \theta_{t+1} = \theta_t - \eta\, \operatorname{clip}\!\big(m_t / \max(\rho\, h_t, \epsilon),\, 1\big),

    with :math:`m_0 = h_0 = 0` and :math:`\operatorname{clip}(z, 1) = \max(\min(z, 1), -1)`
    element-wise. This is the paper's form with :math:`\gamma = \rho`; the released PyTorch code
    writes the denominator as :math:`\rho \cdot \text{bs} \cdot h + \epsilon` with :math:`h` an EMA
    of :math:`\hat g \circ \hat g` and ``bs`` the tokens per batch, which equals ours for
    SophiaG because our :math:`\hat h` already carries the factor :math:`B` (so no batch size need be
    passed to :meth:`step`). The :math:`\max` (not :math:`+\epsilon`) keeps the update pointing
    along :math:`m` where a Hutchinson estimate is negative: there the step is
    :math:`\eta \operatorname{sign}(m)`. :attr:`stats` reports ``unclipped_fraction``, the share
    of coordinates with :math:`|m / \max(\rho h, \epsilon)| < 1` (the paper's "win rate"), and
    ``clip_fraction`` :math:`= 1 -` that, ``hessian_refreshed``, ``loss`` and ``step_skipped``.

    Data parallel (``distributed``): each rank's closure returns the mean loss over its equal share
    of the batch; the optimizer averages the loss, the gradient and the fresh estimate
    :math:`\hat h` over the ranks (one all-reduce of :math:`n` elements per step, :math:`2n` on
    refresh steps, plus a scalar for the loss), so :math:`m`, :math:`h` and the parameters stay the
    same on every rank. Without a closure, ``p.grad`` is averaged too (redundant, but harmless, if
    a DDP-wrapped model's ``backward`` already did it).
    """

    _owner = "Sophia"
    _probes_per_rank = False  # the default generator's draws: alike on every rank, or independent per rank

    def __init__(
        self, params, lr, betas, rho, weight_decay, eps, update_period, maximize, generator, distributed
    ) -> None:
        if lr < 0 or rho < 0 or weight_decay < 0 or eps <= 0:
            raise ValueError(f"need lr, rho, weight_decay >= 0 and eps > 0, got {lr}, {rho}, {weight_decay}, {eps}")
        if not all(0 <= beta < 1 for beta in betas) or update_period < 1:
            raise ValueError(f"need 0 <= betas < 1 and update_period >= 1, got {betas}, {update_period}")
        defaults = dict(
            lr=lr, betas=tuple(betas), rho=rho, weight_decay=weight_decay, eps=eps, update_period=update_period,
            maximize=maximize,
        )  # fmt: skip
        super().__init__(params, defaults)
        self.group = _dist.resolve(distributed, self._owner)
        if generator is None and self.group is not None:
            device = self.param_groups[0]["params"][0].device
            generator = _dist.shared_generator(device, self.group, per_rank=self._probes_per_rank)
        self.generator = generator
        self.stats: dict[str, float] = {}
        self._pending_refresh = False

    def _global(self) -> dict[str, Any]:
        """State shared by all parameters, kept (as in ``torch.optim.LBFGS``) in the first parameter's state."""
        return self.state[self.param_groups[0]["params"][0]]

    def _trainable(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def _estimate(
        self, result: _closure.ClosureResult, params: list[Tensor]
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """Gradient and fresh diagonal estimate :math:`\\hat h` from one closure evaluation, averaged over the ranks."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: _closure.Closure | None = None) -> Tensor | None:  # type: ignore[override]
        """One Sophia step; returns the closure's loss (``None`` without a closure).

        With a closure (which runs the forward and returns what the subclass needs, without
        calling backward) the optimizer takes the gradient itself, and every ``update_period``-th
        step (the first included) refreshes :math:`h` from the same forward. Without one it uses
        ``p.grad`` from the caller's ``loss.backward()`` (parameters without a gradient are
        skipped) and the estimate from the last :meth:`update_hessian`.
        """
        count = self._global().get("step", 0)
        loss, estimate = None, None
        params = self._trainable()
        self.stats = dict(loss=float("nan"), hessian_refreshed=0.0, unclipped_fraction=float("nan"),
                          clip_fraction=float("nan"), step_skipped=1.0)  # fmt: skip
        if closure is not None:
            result = _closure.evaluate(closure, self._owner)
            loss = _dist.average_loss(result.loss.detach(), self.group)
            self.stats["loss"] = float(loss)
            if not _closure.all_finite([loss]):
                _closure.warn_skipped(self._owner, "loss")
                return loss
            refresh = count % self.param_groups[0]["update_period"] == 0
            with torch.enable_grad(), _closure.graph_errors(self._owner):
                if refresh:
                    grads, estimate = self._estimate(result, params)
                else:
                    grads = tuple(g.detach() for g in _closure.gradients(result.loss, params))
                    grads = _dist.all_average(grads, self.group)
            _closure.store_grads(params, grads)
        else:
            params = [p for p in params if p.grad is not None]
            grads = _dist.all_average(tuple(p.grad for p in params), self.group)
        if not _closure.all_finite(grads):
            _closure.warn_skipped(self._owner, "gradient")
            return loss
        if estimate is not None and not _closure.all_finite(estimate):
            _closure.warn_skipped(self._owner, "curvature (Hessian estimate)")
            return loss
        if estimate is not None:
            self._refresh(params, estimate)
        self._update(params, grads)
        self._global()["step"] = count + 1
        self.stats["hessian_refreshed"] = float(self._pending_refresh)
        self.stats["step_skipped"] = 0.0
        self._pending_refresh = False
        return loss

    def _state(self, p: Tensor) -> dict[str, Any]:
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["hessian"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _groups_of(self, params: list[Tensor]) -> list[dict[str, Any]]:
        index = {p: group for group in self.param_groups for p in group["params"]}
        return [index[p] for p in params]

    def _refresh(self, params: list[Tensor], estimate: tuple[Tensor, ...]) -> None:
        r""":math:`h \leftarrow \beta_2 h + (1 - \beta_2) \hat h`."""
        for p, group, e in zip(params, self._groups_of(params), estimate):
            beta2 = group["betas"][1]
            self._state(p)["hessian"].mul_(beta2).add_(e, alpha=1 - beta2)
        self._pending_refresh = True

    def _update(self, params: list[Tensor], grads: tuple[Tensor, ...]) -> None:
        unclipped, total = [], 0
        for p, group, g in zip(params, self._groups_of(params), grads):
            state = self._state(p)
            beta1 = group["betas"][0]
            m, h = state["exp_avg"], state["hessian"]
            m.mul_(beta1).add_(-g if group["maximize"] else g, alpha=1 - beta1)
            p.mul_(1 - group["lr"] * group["weight_decay"])
            ratio = m / (group["rho"] * h).clamp(min=group["eps"])
            unclipped.append((ratio.abs() < 1).sum())
            total += ratio.numel()
            p.add_(ratio.clamp(-1, 1), alpha=-group["lr"])
        if total:
            fraction = float(torch.stack(unclipped).sum()) / total
            self.stats.update(unclipped_fraction=fraction, clip_fraction=1 - fraction)


class SophiaH(_Sophia):
    r"""Sophia with Hutchinson's estimate of the Hessian diagonal (Sophia-H).

    .. math:: \hat h = u \circ (H u), \qquad u \sim \mathcal N(0, I)\ \text{(the paper) or Rademacher},

    by :func:`~optim.curvature.hutchinson_diagonal` on the closure's loss; the update is that of
    the Sophia class docstring (:class:`SophiaG` shows it in full). A refresh step costs one
    ``create_graph`` backward and one Hessian-vector product, reusing the step's forward; other
    steps cost one ordinary gradient.

    Example:
        >>> opt = SophiaH(model.parameters(), lr=6e-4)
        >>> loss = opt.step(lambda: F.cross_entropy(model(x).flatten(0, -2), y.flatten()))

    In a loop that calls ``backward`` itself, refresh the estimate first (it keeps the graph)::

        loss = loss_fn(model(x), y)
        if step % 10 == 0:
            opt.update_hessian(loss)
        loss.backward()
        opt.step()

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
    """

    _owner = "SophiaH"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 6e-4,
        betas: tuple[float, float] = (0.965, 0.99),
        rho: float = 0.01,
        weight_decay: float = 0.1,
        eps: float = 1e-15,
        *,
        update_period: int = 10,
        maximize: bool = False,
        distribution: Distribution = "gaussian",
        num_samples: int = 1,
        generator: torch.Generator | None = None,
        distributed: _dist.Distributed = False,
    ) -> None:
        super().__init__(params, lr, betas, rho, weight_decay, eps, update_period, maximize, generator, distributed)
        self.distribution, self.num_samples = distribution, num_samples

    def _hutchinson(
        self, loss: Tensor, params: list[Tensor], with_gradient: bool = True
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        operator = HessianOperator(loss, params)
        estimate = hutchinson_diagonal(operator, self.num_samples, self.distribution, self.generator)
        sign = -1.0 if self.param_groups[0]["maximize"] else 1.0
        # The probes are alike on every rank, so averaging u * H_r u averages H_r u; one all-reduce for both.
        grads = operator.gradient if with_gradient else ()
        averaged = _dist.all_average((*grads, *(sign * e for e in estimate)), self.group)
        return averaged[: len(grads)], averaged[len(grads) :]

    def _estimate(self, result, params):
        return self._hutchinson(result.loss, params)

    @torch.no_grad()
    def update_hessian(self, loss: Tensor) -> None:
        r"""Refresh :math:`h` from a loss with its graph (kept, so ``loss.backward()`` may follow).

        With ``maximize`` the estimate is that of :math:`-\text{loss}`. A non-finite estimate is
        discarded with a warning.
        """
        params = self._trainable()
        with torch.enable_grad():
            _, estimate = self._hutchinson(loss, params, with_gradient=False)
        if not _closure.all_finite(estimate):
            _closure.warn_skipped(self._owner, "curvature (Hessian estimate)")
            return
        self._refresh(params, estimate)


class SophiaG(_Sophia):
    r"""Sophia with the Gauss-Newton-Bartlett estimate of the Hessian diagonal (Sophia-G), for softmax cross-entropy.

    With logits :math:`z_b` of the :math:`B` counted rows (tokens), labels
    :math:`\hat y_b \sim \operatorname{softmax}(z_b)` sampled from the model itself and
    :math:`\hat L = \frac1B \sum_b \ell_{CE}(z_b, \hat y_b)`,

    .. math:: \hat g = \nabla_\theta \hat L, \qquad \hat h = B\, \hat g \circ \hat g,

    an unbiased-in-expectation estimate of the Gauss-Newton diagonal (Bartlett's identity). Then

    .. math::
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1)\, g_t, \qquad
        h_t = \beta_2 h_{t-k} + (1 - \beta_2)\, \hat h_t \ \text{every } k \text{ steps (the first included)}, \\
        \theta_{t+1} &= (1 - \eta\lambda)\,\theta_t
            - \eta\, \operatorname{clip}\!\big(m_t / \max(\rho\, h_t, \epsilon),\, 1\big).

    The closure returns ``(loss, logits)`` (classes in the last dimension) or a dict with
    ``loss``, ``outputs`` and optionally ``targets`` (rows whose target is ``ignore_index`` are not
    sampled). A refresh step costs one more ordinary backward (of :math:`\hat L`) on the same
    forward; other steps cost one gradient, and may return the loss alone.

    Example:
        >>> opt = SophiaG(model.parameters(), lr=6e-4)
        >>> def closure():
        ...     logits = model(x)
        ...     return F.cross_entropy(logits.flatten(0, -2), y.flatten()), logits
        >>> loss = opt.step(closure)

    In a loop that calls ``backward`` itself::

        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, -2), y.flatten())
        if step % 10 == 0:
            opt.update_hessian(logits)   # samples labels; keeps the graph
        loss.backward()
        opt.step()

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate :math:`\eta` (the largest per-coordinate step).
        betas: :math:`(\beta_1, \beta_2)` (paper: 0.965, 0.99).
        rho: :math:`\rho` (:math:`\gamma` in the paper); 0.04 is the released code's default
            (its GPT-2 small config uses 0.05).
        weight_decay: Decoupled weight decay :math:`\lambda` (released default 0.1).
        eps: :math:`\epsilon` (paper: 1e-15).
        update_period: :math:`k` (paper: 10).
        maximize: Maximise the loss (the estimate, a Gauss-Newton diagonal, is unchanged).
        ignore_index: Target value of rows that are not sampled, when the closure gives ``targets``.
        generator: Source of the sampled labels (the global one if ``None``; in distributed mode, a
            generator seeded differently on each rank, from one broadcast seed).
        distributed: ``True`` (the default process group) or a process group. Each rank samples
            labels for its own rows; the ranks' sampled-loss gradients are combined, weighted by
            their counted rows :math:`B_r`, into the whole batch's
            :math:`\hat g = \sum_r B_r \hat g_r / \sum_r B_r` before squaring (one all-reduce
            of :math:`n + 1` elements on refresh steps besides the gradient's).
    """

    _owner = "SophiaG"
    _probes_per_rank = True  # each rank samples labels for its own rows

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 6e-4,
        betas: tuple[float, float] = (0.965, 0.99),
        rho: float = 0.04,
        weight_decay: float = 0.1,
        eps: float = 1e-15,
        *,
        update_period: int = 10,
        maximize: bool = False,
        ignore_index: int = -100,
        generator: torch.Generator | None = None,
        distributed: _dist.Distributed = False,
    ) -> None:
        super().__init__(params, lr, betas, rho, weight_decay, eps, update_period, maximize, generator, distributed)
        self.ignore_index = ignore_index

    def _bartlett(self, logits: Tensor, targets: Tensor | None, params: list[Tensor]) -> tuple[Tensor, ...]:
        rows = logits.reshape(-1, logits.shape[-1])
        probs = torch.softmax(rows.detach().float(), dim=-1)
        sampled = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        if targets is not None:
            counted = targets.reshape(-1) != self.ignore_index
            rows, sampled = rows[counted], sampled[counted]
        count = max(rows.shape[0], 1)
        sampled_loss = F.cross_entropy(rows, sampled, reduction="sum") / count
        sampled_grads = _closure.gradients(sampled_loss, params, retain_graph=True)
        if self.group is not None:  # the whole batch's gradient: rank sums of B_r g_r and of B_r
            size = _dist.dist.get_world_size(self.group)
            local = (*(count * g for g in sampled_grads), logits.new_full((1,), float(count), dtype=torch.float64))
            summed = tuple(size * t for t in _dist.all_average(local, self.group))
            count = float(summed[-1])
            sampled_grads = tuple(t / count for t in summed[:-1])
        return tuple(count * g * g for g in sampled_grads)

    def _estimate(self, result, params):
        if result.outputs is None:
            raise RuntimeError(
                "SophiaG refreshes its estimate from the logits: on refresh steps the closure must return "
                "(loss, logits) or a dict with 'outputs'"
            )
        grads = _closure.gradients(result.loss, params, retain_graph=True)
        grads = _dist.all_average(tuple(g.detach() for g in grads), self.group)
        return grads, self._bartlett(result.outputs, result.targets, params)

    @torch.no_grad()
    def update_hessian(self, logits: Tensor, targets: Tensor | None = None) -> None:
        """Refresh :math:`h` from logits with their graph (kept, so ``loss.backward()`` may follow).

        Args:
            logits: Model outputs, classes in the last dimension.
            targets: Optional labels shaped like ``logits`` without its last dimension; rows equal
                to ``ignore_index`` are not sampled.
        """
        params = self._trainable()
        with torch.enable_grad():
            estimate = self._bartlett(logits, targets, params)
        if not _closure.all_finite(estimate):
            _closure.warn_skipped(self._owner, "curvature (Hessian estimate)")
            return
        self._refresh(params, estimate)
