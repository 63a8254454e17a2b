r"""A curvature matrix seen through a diagonal preconditioner, as a symmetric operator with the spectrum of
:math:`P^{-1} A`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from optim._autodiff import Tensors
from optim.operators import CurvatureOperator, OperatorLike, as_operator


class PreconditionedOperator(CurvatureOperator):
    r"""The symmetric matrix :math:`D^{1/2} A D^{1/2}` for a curvature matrix :math:`A` and a positive diagonal
    :math:`D = P^{-1}`.

    :math:`P^{-1} A` is not symmetric, but it is similar to this one,
    :math:`P^{-1} A = D^{1/2} \big(D^{1/2} A D^{1/2}\big) D^{-1/2}`, so the two have the same eigenvalues, and
    :math:`u` is an eigenvector of this operator exactly when :math:`D^{1/2} u` is one of :math:`P^{-1} A`. The
    largest, :math:`\lambda_1(P^{-1} H)` of a Hessian :math:`H`, is the preconditioned sharpness of an optimizer
    whose step is :math:`-P^{-1} g` (Cohen et al., 2022, "Adaptive gradient methods at the edge of stability");
    :func:`optim.eigenpairs` takes this operator like any other. Each product is one product with :math:`A`.

    Args:
        operator: :math:`A`: a :class:`~optim.operators.CurvatureOperator`, or a ``(loss, params)`` pair for its
            Hessian.
        inverse_diagonal: :math:`D`, one tensor per parameter, shaped like it, every entry finite and > 0.

    Raises:
        ValueError: ``inverse_diagonal`` does not hold one tensor shaped like each parameter, or has an entry
            that is not finite and positive.
    """

    def __init__(self, operator: OperatorLike, inverse_diagonal: Sequence[Tensor]) -> None:
        op = as_operator(operator)
        super().__init__(op.params)
        self.operator = op
        diagonal = tuple(inverse_diagonal)
        if len(diagonal) != len(op.params) or any(d.shape != p.shape for d, p in zip(diagonal, op.params)):
            raise ValueError(
                "PreconditionedOperator: inverse_diagonal must hold one tensor shaped like each parameter "
                f"({[tuple(p.shape) for p in op.params]}), got {[tuple(d.shape) for d in diagonal]}"
            )
        if not all(bool(torch.isfinite(d).all() and (d > 0).all()) for d in diagonal):
            raise ValueError("PreconditionedOperator: every entry of inverse_diagonal must be finite and > 0 "
                             "(a diagonal preconditioner's inverse)")
        self.scale = tuple(d.sqrt().to(p.device, p.dtype) for d, p in zip(diagonal, op.params))

    def matvec(self, vec: Tensors) -> tuple[Tensor, ...]:
        r"""Return :math:`D^{1/2} A D^{1/2} v`, one tensor per parameter."""
        inner = self.operator.matvec([s * v for s, v in zip(self.scale, vec, strict=True)])
        return tuple(s * w for s, w in zip(self.scale, inner, strict=True))
