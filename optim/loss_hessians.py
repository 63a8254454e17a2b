r"""Hessians of a loss with respect to the model outputs, :math:`H_L u = \nabla^2_z \ell(z)\, u`: the middle factor
of a Gauss-Newton product. In closed form for the cross-entropy (a chunk of rows at a time) and the squared
error; by autograd for any other loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

from optim._autodiff import gradient, vjp

Reduction = Literal["mean", "sum"]


class LossHessian(Protocol):
    r"""Hessian-vector product :math:`H_L u = \nabla^2_z \ell(z)\, u` of a loss w.r.t. the model outputs :math:`z`."""

    def __call__(self, outputs: Tensor, vec: Tensor) -> Tensor:
        """Return :math:`H_L u` for outputs :math:`z` and a tangent :math:`u` shaped like them."""
        ...


DEFAULT_CHUNK_ELEMENTS = 2**24
"""Logits per chunk of the cross-entropy curvature (:class:`CrossEntropyHessian`, SophiaG's label sampling):
16,777,216, so each float32 temporary of a chunk takes 64 MiB (512 rows at :math:`V = 32768`)."""


def check_reduction(reduction: str, owner: str) -> None:
    """Raise ``ValueError`` unless ``reduction`` is ``"mean"`` or ``"sum"`` (the products would take any other value
    for ``"sum"``)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{owner}: reduction must be 'mean' or 'sum', got {reduction!r}")


def check_chunk_elements(chunk_elements: int) -> None:
    """Raise ``ValueError`` unless ``chunk_elements`` (logits per chunk) is a positive integer."""
    if isinstance(chunk_elements, bool) or not isinstance(chunk_elements, int) or chunk_elements < 1:
        raise ValueError(f"chunk_elements must be a positive integer (logits per chunk), got {chunk_elements!r}")


def row_chunks(rows: int, classes: int, chunk_elements: int) -> list[slice]:
    """Consecutive slices covering ``range(rows)``, of ``max(1, chunk_elements // classes)`` rows each
    (the last may be shorter)."""
    check_chunk_elements(chunk_elements)
    step = max(1, chunk_elements // max(classes, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def logit_rows(logits: Tensor, targets: Tensor | None, ignore_index: int, owner: str) -> tuple[Tensor, Tensor]:
    """The logits as rows ``(R, V)`` (a view where the layout allows) and the mask of the rows that count.

    A row counts unless its target is ``ignore_index``; without ``targets`` every row counts.

    Raises:
        ValueError: ``logits`` has no class dimension; ``targets`` has not one entry per row, or is shaped
            neither like the logits without their last dimension nor flat (e.g. ``(T, B)`` targets for
            ``(B, T, V)`` logits, whose rows would be matched to the wrong targets).
    """
    if logits.dim() < 1:
        raise ValueError(f"{owner}: the logits need the classes in their last dimension, got a scalar")
    rows = logits.reshape(-1, logits.shape[-1])
    if targets is None:
        return rows, torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    if targets.numel() != rows.shape[0]:
        raise ValueError(
            f"{owner}: {targets.numel()} targets for the {rows.shape[0]} rows of the logits {tuple(logits.shape)}"
        )
    if targets.dim() > 1 and logits.dim() > 2 and targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"{owner}: targets {tuple(targets.shape)} do not line up with the logits {tuple(logits.shape)}: "
            f"expected them shaped {tuple(logits.shape[:-1])}, or flattened"
        )
    return rows, targets.reshape(-1).to(rows.device) != ignore_index


@dataclass(frozen=True)
class CrossEntropyHessian:
    r"""Hessian of ``F.cross_entropy`` w.r.t. the logits, in closed form, a chunk of rows at a time.

    Logits :math:`z` have the classes in the last dimension (``(B, V)``, or ``(B, T, V)`` for a
    language model, i.e. ``F.cross_entropy(z.flatten(0, -2), targets.flatten())``). For every row
    :math:`r` with :math:`p_r = \operatorname{softmax}(z_r)`,

    .. math:: (H_L u)_r = \frac{m_r}{c} \big(\operatorname{diag}(p_r) - p_r p_r^\top\big) u_r
              = \frac{m_r}{c}\, p_r \circ \big(u_r - p_r^\top u_r\big),

    where :math:`m_r = [\text{targets}_r \ne \text{ignore\_index}]` and :math:`c = \sum_r m_r`
    for ``reduction="mean"`` (at least 1), :math:`c = 1` for ``"sum"``. The targets enter only
    through :math:`m`; ignored rows are exactly zero (even where their logits are not finite).

    Rows are independent, so the product runs over chunks of ``chunk_elements // V`` rows:
    softmax is taken in at least float32 for one chunk at a time and each chunk's result is
    written into the output (dtype of ``u``). Beyond the output, a product holds a few float32
    chunks (about ``4 * chunk_elements * 4`` bytes), not float32 copies of all :math:`R \cdot V`
    logits; the result is the same for every chunk size (each row's arithmetic is unchanged).

    Args:
        targets: Class indices, one per row of the logits (shaped like them without their last
            dimension, or flattened).
        reduction: ``"mean"`` or ``"sum"``, as passed to ``F.cross_entropy``.
        ignore_index: Target value whose rows do not count.
        chunk_elements: Logits per chunk (rounded down to whole rows, at least one row).

    Raises:
        ValueError: ``reduction`` is neither ``"mean"`` nor ``"sum"``, or ``chunk_elements`` is not a
            positive integer; at a product, ``targets`` has not one entry per row, or ``out`` is not a
            contiguous tensor shaped like ``vec``.
    """

    targets: Tensor
    reduction: Reduction = "mean"
    ignore_index: int = -100
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS

    def __post_init__(self) -> None:
        check_reduction(self.reduction, "CrossEntropyHessian")
        check_chunk_elements(self.chunk_elements)

    def __call__(self, outputs: Tensor, vec: Tensor, *, out: Tensor | None = None) -> Tensor:
        """Return :math:`H_L u` for logits ``outputs`` and tangent ``vec``.

        ``out`` receives the result (and is returned); it may be ``vec`` itself, which is then
        overwritten chunk by chunk, each chunk read before it is written.
        """
        logits, counted = logit_rows(outputs, self.targets, self.ignore_index, "CrossEntropyHessian")
        tangent = vec.reshape(logits.shape)
        if out is None:
            out = torch.empty(vec.shape, dtype=vec.dtype, device=vec.device)
        elif out.shape != vec.shape or out.dtype != vec.dtype or not out.is_contiguous():
            raise ValueError(
                f"CrossEntropyHessian: out must be a contiguous {vec.dtype} tensor of shape {tuple(vec.shape)}, got "
                f"{out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}"
            )
        count = counted.sum().clamp_min(1) if self.reduction == "mean" else 1  # a tensor: no host synchronisation
        result = out.view(logits.shape)
        for rows in row_chunks(logits.shape[0], logits.shape[1], self.chunk_elements):
            z, u = logits[rows], tangent[rows]
            p = torch.softmax(z, dim=-1, dtype=torch.promote_types(z.dtype, torch.float32))
            hv = (u - (p * u).sum(dim=-1, keepdim=True)).mul_(p)
            result[rows] = hv.masked_fill_(~counted[rows, None], 0).div_(count)
        return out


@dataclass(frozen=True)
class MSEHessian:
    r"""Hessian of ``F.mse_loss`` w.r.t. the predictions: :math:`H_L u = \frac{2}{c} u`.

    :math:`c` is the number of prediction entries for ``reduction="mean"`` and 1 for ``"sum"``.

    Args:
        reduction: ``"mean"`` or ``"sum"``, as passed to ``F.mse_loss``.

    Raises:
        ValueError: ``reduction`` is neither.
    """

    reduction: Reduction = "mean"

    def __post_init__(self) -> None:
        check_reduction(self.reduction, "MSEHessian")

    def __call__(self, outputs: Tensor, vec: Tensor) -> Tensor:
        """Return :math:`H_L u` for predictions ``outputs`` and tangent ``vec``."""
        count = outputs.numel() if self.reduction == "mean" else 1
        return vec * (2.0 / count)


@dataclass(frozen=True)
class AutogradLossHessian:
    r"""Any twice-differentiable loss of the outputs, by autograd: :math:`H_L u = \nabla_z (\nabla_z \ell(z)^\top u)`.

    Args:
        loss_fn: Scalar loss :math:`\ell(z)` of the outputs alone (targets closed over), e.g.
            ``lambda z: F.cross_entropy(z.flatten(0, 1), y.flatten())``.
    """

    loss_fn: Callable[[Tensor], Tensor]

    def __call__(self, outputs: Tensor, vec: Tensor) -> Tensor:
        """Return :math:`H_L u` on a detached copy of ``outputs``, leaving the model graph alone."""
        with torch.enable_grad():
            z = outputs.detach().requires_grad_()
            return vjp(gradient(self.loss_fn(z), [z]), [z], [vec], retain_graph=False)[0]


class LossGraphHessian:
    r"""The Hessian of an already computed ``loss`` w.r.t. the ``outputs`` it was computed from,
    by double backward through the loss's own graph: :math:`H_L u = \nabla_z (\nabla_z L^\top u)`.

    The gradient :math:`\nabla_z L` is formed once (``create_graph=True``); each product is one
    more vector-Jacobian product on it. Used by :func:`optim.ggnvp` when no closed form is given.
    """

    def __init__(self, loss: Tensor, outputs: Tensor) -> None:
        self.outputs = outputs
        (self.gradient,) = gradient(loss, [outputs])

    def __call__(self, outputs: Tensor, vec: Tensor) -> Tensor:
        """Return :math:`H_L u`; ``outputs`` is ignored (the product runs on the loss's own graph)."""
        return vjp([self.gradient], [self.outputs], [vec], retain_graph=True)[0]

