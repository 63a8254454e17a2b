"""SophiaG: Sophia with the Gauss-Newton-Bartlett estimate of the Hessian diagonal, for softmax cross-entropy."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from optim import distributed as _dist
from optim._closure import Closure, ClosureResult, evaluate
from optim._gradients import check_dense, gradients
from optim.diagonal import CrossEntropyGaussNewton, bartlett_diagonal
from optim.hyperparameters import COUNT, check_hyperparameters
from optim.loss_hessians import DEFAULT_CHUNK_ELEMENTS, logit_rows
from optim.sophia import Estimate, _Sophia


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
    sampled, and never reach the sampler, so NaN logits there do no harm). A refresh step costs
    one more ordinary backward (of :math:`\hat L`) on the same forward; other steps cost one
    gradient, and may return the loss alone. Non-finite logits in counted rows give a non-finite
    estimate: the refresh is skipped with a warning.

    Example:
        >>> opt = SophiaG(model.parameters(), lr=6e-4)
        >>> def closure():
        ...     logits = model(x)
        ...     return F.cross_entropy(logits.flatten(0, -2), y.flatten()), logits
        >>> loss = opt.step(closure)

    In a loop that calls ``backward`` itself (a first step without an estimate raises ``RuntimeError``)::

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
        chunk_elements: Logits per chunk of the label sampling: the softmax and the sampled
            loss's gradient w.r.t. the logits are formed a chunk of rows at a time, so a refresh
            holds one tensor the size of the logits (that gradient) besides a chunk's float32
            temporaries (see :func:`~optim.loss_hessians.row_chunks`).
        hessian_batch: Rows of the batch the label sampling runs on, as in :class:`SophiaH`: ``None`` (all),
            a count or a fraction; the closure then takes ``rows`` and returns ``(loss, logits)`` of those rows.
        bias_correction: Divide :math:`h` by :math:`1 - \beta_2^{n}` in the update (see :class:`_Sophia`; not in
            the paper, whose runs are long enough for it not to matter).
    """

    _owner = "SophiaG"
    _probes_per_rank = True  # each rank samples labels for its own rows
    _plain_loop = (
        "call opt.update_hessian(logits) before loss.backward() every update_period steps, or pass a closure that "
        "returns (loss, logits)"
    )

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
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        hessian_batch: int | float | None = None,
        bias_correction: bool = False,
    ) -> None:
        check_hyperparameters(self._owner, {"chunk_elements": chunk_elements}, {"chunk_elements": COUNT})
        super().__init__(params, lr, betas, rho, weight_decay, eps, update_period, maximize, generator, distributed,
                         hessian_batch, bias_correction)
        self.ignore_index, self.chunk_elements = ignore_index, chunk_elements

    def _check_logits(self, logits: Tensor, targets: Tensor | None) -> None:
        """Raise ``ValueError`` unless ``logits`` have at least 2 classes in the last dimension and ``targets``
        (if given) one entry per row (:func:`~optim.loss_hessians.logit_rows`)."""
        if not isinstance(logits, Tensor) or logits.dim() < 1 or logits.shape[-1] < 2:
            got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(
                f"SophiaG takes logits with at least 2 classes in the last dimension, got {got} (a loss goes to "
                "SophiaH.update_hessian)"
            )
        logit_rows(logits, targets, self.ignore_index, self._owner)

    def _bartlett(self, logits: Tensor, targets: Tensor | None, params: list[Tensor]) -> tuple[Tensor, ...]:
        r""":math:`\hat h` of the cross-entropy's Gauss-Newton matrix at ``logits``
        (:func:`~optim.diagonal.bartlett_diagonal`), combined over the ranks."""
        self._check_logits(logits, targets)
        curvature = CrossEntropyGaussNewton(logits, targets, params, self.ignore_index, self.chunk_elements)
        return bartlett_diagonal(curvature, generator=self.generator, group=self.group, owner=self._owner)

    def _estimate(self, result: ClosureResult, call: Closure, params: list[Tensor],
                  groups: list[dict[str, Any]]) -> Estimate:  # fmt: skip
        grads = tuple(g.detach() for g in gradients(result.loss, params, retain_graph=True))
        check_dense(self._owner, grads)
        grads = _dist.all_average(grads, self.group)
        return grads, self._bartlett_of(result, params)

    def _diagonal(self, call: Closure, params: list[Tensor], groups: list[dict[str, Any]]) -> tuple[Tensor, ...]:
        return self._bartlett_of(evaluate(call, self._owner), params)

    def _bartlett_of(self, result: ClosureResult, params: list[Tensor]) -> tuple[Tensor, ...]:
        if result.outputs is None:
            raise RuntimeError(
                "SophiaG refreshes its estimate from the logits: on refresh steps the closure must return "
                "(loss, logits) or a dict with 'outputs'"
            )
        return self._bartlett(result.outputs, result.targets, params)

    def differentiates_twice(self, rows: bool = False) -> bool:
        """False: the Gauss-Newton-Bartlett estimate differentiates the graph once (a backward of the loss at
        sampled labels), so every call may run a once-differentiable attention."""
        return False

    @torch.no_grad()
    def update_hessian(self, logits: Tensor, targets: Tensor | None = None) -> None:
        """Refresh :math:`h` from logits with their graph (kept, so ``loss.backward()`` may follow).

        A parameter the logits do not reach keeps its :math:`h` (none if it has none), as :meth:`step` skips it.

        Args:
            logits: Model outputs, classes in the last dimension.
            targets: Optional labels shaped like ``logits`` without its last dimension; rows equal
                to ``ignore_index`` are not sampled.

        Raises:
            ValueError: ``logits`` is not a tensor with at least 2 classes in the last dimension
                (a loss goes to :meth:`SophiaH.update_hessian`), or ``targets`` do not match its rows.
            RuntimeError: ``logits`` has no autograd graph.
        """
        self._check_logits(logits, targets)
        if not logits.requires_grad:
            raise RuntimeError("SophiaG.update_hessian: the logits have no autograd graph (call it before backward)")
        params, groups, _ = self._reached(logits, *self._trainable())
        if not params:  # every parameter frozen, or none reached: nothing to refresh
            return
        with torch.enable_grad():
            estimate = self._bartlett(logits, targets, params)
        self._refresh(params, groups, estimate)
