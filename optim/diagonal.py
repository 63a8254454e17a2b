r"""Estimates of the diagonal of a curvature matrix, which Sophia's :math:`h`, AdaHessian's second moment and
NewtonCG's preconditioner are made of. Each estimator is a :class:`DiagonalEstimator`:

- :func:`hutchinson_diagonal`: :math:`z \circ A z` for random probes :math:`z`, of any curvature operator
  :math:`A` (the Hessian: SophiaH, AdaHessian);
- :func:`bartlett_diagonal`: :math:`B\, \hat g \circ \hat g` for the gradient :math:`\hat g` of the loss at labels
  sampled from the model, of the cross-entropy's Gauss-Newton matrix (SophiaG).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from optim import distributed as _dist
from optim._autodiff import Tensors, vjp
from optim.hyperparameters import check_count
from optim.loss_hessians import DEFAULT_CHUNK_ELEMENTS, logit_rows, row_chunks
from optim.operators import OperatorLike, as_operator

Distribution = Literal["rademacher", "gaussian"]


class DiagonalEstimator(Protocol):
    """An estimate of the diagonal of a curvature matrix, from what the estimator reads of it (``curvature``):
    the whole batch's estimate, combined over the ranks of ``group`` (``None``: one process)."""

    def __call__(
        self, curvature: Any, *, generator: torch.Generator | None = None, group: _dist.Group = None
    ) -> tuple[Tensor, ...]:
        """The estimate, one tensor per parameter; random draws come from ``generator`` (the global one if
        ``None``)."""
        ...


def _probe(params: Tensors, distribution: Distribution, generator: torch.Generator | None) -> tuple[Tensor, ...]:
    """Random tensors shaped like ``params`` with i.i.d. zero-mean, unit-variance entries."""
    if distribution == "rademacher":
        signs = (torch.randint(0, 2, p.shape, generator=generator, device=p.device) for p in params)
        return tuple(s.to(p.dtype) * 2 - 1 for s, p in zip(signs, params))
    if distribution == "gaussian":
        return tuple(torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype) for p in params)
    raise ValueError(f"distribution must be 'rademacher' or 'gaussian', got {distribution!r}")


def hutchinson_diagonal(
    operator: OperatorLike,
    num_samples: int = 1,
    distribution: Distribution = "rademacher",
    generator: torch.Generator | None = None,
    *,
    group: _dist.Group = None,
) -> tuple[Tensor, ...]:
    r"""Hutchinson's estimate of the diagonal of a curvature matrix :math:`A`.

    .. math:: \widehat{\operatorname{diag}}(A) = \frac{1}{S} \sum_{s=1}^{S} z_s \circ A z_s,
              \qquad \mathbb{E}\big[\widehat{\operatorname{diag}}(A)\big] = \operatorname{diag}(A),

    with probes :math:`z_s` of i.i.d. Rademacher (:math:`\pm 1`) or standard normal entries. With
    Rademacher probes :math:`z_i^2 = 1`, so a diagonal :math:`A` is recovered exactly from one sample.

    Args:
        operator: A :class:`~optim.operators.CurvatureOperator`, or a ``(loss, params)`` pair for its Hessian.
        num_samples: Number of probes :math:`S`.
        distribution: ``"rademacher"`` or ``"gaussian"``.
        generator: Source of the probes (on the parameters' device); the global one if ``None``.
        group: A process group whose ranks average their estimates: the estimate of the rank-averaged matrix
            :math:`\bar A` when the probes are alike on every rank (:math:`\frac1R \sum_r z \circ A_r z =
            z \circ \bar A z`; a generator from :func:`optim.distributed.shared_generator`).

    Returns:
        The estimate, one tensor per parameter.

    Raises:
        ValueError: ``num_samples`` is not a positive integer.
    """
    check_count("num_samples", num_samples, "probes")
    op = as_operator(operator)
    total = [torch.zeros_like(p) for p in op.params]
    for _ in range(num_samples):
        z = _probe(op.params, distribution, generator)
        for acc, zi, azi in zip(total, z, op.matvec(z), strict=True):
            acc.add_(zi * azi)
    return _dist.all_average(tuple(acc / num_samples for acc in total), group)


@dataclass(frozen=True)
class CrossEntropyGaussNewton:
    r"""The Gauss-Newton matrix of the mean cross-entropy of logits :math:`z(\theta)`, by the parts that
    :func:`bartlett_diagonal` reads: the logits with their graph to the parameters, the targets (rows whose target
    is ``ignore_index`` do not count; ``None``: every row counts), the parameters :math:`\theta`, and the logits
    per chunk of the label sampling."""

    logits: Tensor
    targets: Tensor | None
    params: Sequence[Tensor]
    ignore_index: int = -100
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS


def bartlett_diagonal(
    curvature: CrossEntropyGaussNewton,
    *,
    generator: torch.Generator | None = None,
    group: _dist.Group = None,
    owner: str = "gauss_newton_bartlett",
) -> tuple[Tensor, ...]:
    """:func:`gauss_newton_bartlett` as a :class:`DiagonalEstimator`; ``owner`` starts its error messages."""
    return gauss_newton_bartlett(
        curvature.logits, curvature.targets, curvature.params, ignore_index=curvature.ignore_index,
        generator=generator, chunk_elements=curvature.chunk_elements, group=group, owner=owner,
    )  # fmt: skip


def _sampled_loss_gradient(
    rows: Tensor, counted: Tensor, count: int, generator: torch.Generator | None, chunk_elements: int
) -> Tensor | None:
    r"""The gradient w.r.t. the logits of the loss at labels sampled from the model, a chunk of rows at a time.

    For the counted rows :math:`r` (``counted``), :math:`\hat y_r \sim p_r = \operatorname{softmax}(z_r)`
    and :math:`\hat L = \frac1c \sum_r \ell_{CE}(z_r, \hat y_r)`, whose gradient has the rows

    .. math:: \nabla_{z_r} \hat L = \frac{p_r - e_{\hat y_r}}{c},

    and zeros in the rows that do not count (which never reach the sampler). Each chunk of
    :func:`~optim.loss_hessians.row_chunks` takes its softmax in at least float32, samples its labels
    (``torch.multinomial`` on float32 probabilities) and writes its rows, so besides the result
    (shaped and typed like ``rows``) only a chunk's temporaries are held. On the CPU the draws do
    not depend on the chunk size; on CUDA they may.

    Returns:
        The gradient, or ``None`` when the softmax of a counted row is not finite.
    """
    gradient = torch.zeros(rows.shape, dtype=rows.dtype, device=rows.device)
    for chunk in row_chunks(rows.shape[0], rows.shape[1], chunk_elements):
        mask = counted[chunk]
        z = rows[chunk][mask]
        if z.shape[0] == 0:
            continue
        p = torch.softmax(z, dim=-1, dtype=torch.promote_types(z.dtype, torch.float32))
        if not bool(torch.isfinite(p).all()):
            return None
        sampled = torch.multinomial(p.float(), 1, generator=generator).squeeze(-1)
        p[torch.arange(z.shape[0], device=p.device), sampled] -= 1
        gradient[chunk][mask] = p.div_(count).to(rows.dtype)
    return gradient


def gauss_newton_bartlett(
    logits: Tensor,
    targets: Tensor | None,
    params: Sequence[Tensor],
    *,
    ignore_index: int = -100,
    generator: torch.Generator | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    group: _dist.Group = None,
    owner: str = "gauss_newton_bartlett",
) -> tuple[Tensor, ...]:
    r"""The Gauss-Newton-Bartlett estimate of the diagonal of the cross-entropy's Gauss-Newton matrix (Sophia-G's).

    With the logits :math:`z_b` of the :math:`B` counted rows (targets not ``ignore_index``), labels
    :math:`\hat y_b \sim \operatorname{softmax}(z_b)` sampled from the model and
    :math:`\hat g = \nabla_\theta \frac1B \sum_b \ell_{CE}(z_b, \hat y_b)`,

    .. math:: \hat h = B\, \hat g \circ \hat g, \qquad
              \mathbb{E}[\hat h] = \operatorname{diag} \tfrac1B \textstyle\sum_b J_b^\top H_b J_b,

    the diagonal of the Gauss-Newton matrix of the mean loss (Bartlett's identity: the cross terms of
    different rows vanish in expectation). One backward through the graph of ``logits`` (kept); the
    labels are drawn a chunk of rows at a time (:func:`_sampled_loss_gradient`). With ``group``, the
    ranks' gradients are combined, weighted by their counted rows :math:`B_r`, into the whole batch's
    :math:`\hat g = \sum_r B_r \hat g_r / \sum_r B_r` before squaring. Non-finite logits in counted rows
    give a NaN estimate.
    """
    rows, counted = logit_rows(logits, targets, ignore_index, owner)
    count = max(int(counted.sum()), 1)
    cotangent = _sampled_loss_gradient(rows.detach(), counted, count, generator, chunk_elements)
    if cotangent is not None:
        sampled_grads = vjp([logits], params, [cotangent.view(logits.shape)], retain_graph=True)
    else:  # the estimate at non-finite logits is not finite: the caller skips it with a warning
        sampled_grads = tuple(torch.full_like(p, math.nan) for p in params)
    if group is not None:  # the whole batch's gradient: rank sums of B_r g_r and of B_r
        size = _dist.dist.get_world_size(group)
        local = (*(count * g for g in sampled_grads), logits.new_full((1,), float(count), dtype=torch.float64))
        summed = tuple(size * t for t in _dist.all_average(local, group))
        count = float(summed[-1])
        sampled_grads = tuple(t / count for t in summed[:-1])
    return tuple(count * g * g for g in sampled_grads)


