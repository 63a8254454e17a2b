r"""The diagonal preconditioner of NewtonCG's conjugate gradient (Martens, 2010, section 4.7):
:math:`M = (d + \lambda)^\xi`, with :math:`d` an exponential moving average of an estimate of the curvature's
diagonal: of :math:`g \circ g` (``"squared_gradients"``), Hutchinson's estimate of :math:`|\operatorname{diag} B|`
(``"hutchinson"``) or the Gauss-Newton-Bartlett estimate of :math:`\operatorname{diag} G` (``"bartlett"``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from optim import distributed as _dist
from optim._closure import graph_errors
from optim.diagonal import CrossEntropyGaussNewton, bartlett_diagonal, hutchinson_diagonal
from optim.loss_hessians import CrossEntropyHessian
from optim.operators import CurvatureOperator, GGNOperator

Kind = Literal["hutchinson", "bartlett", "squared_gradients"]
Precondition = Callable[[Sequence[Tensor]], tuple[Tensor, ...]]


def estimate(
    kind: Kind, operator: CurvatureOperator, g: Sequence[Tensor], *, generator: torch.Generator | None,
    group: _dist.Group, owner: str,
) -> tuple[Tensor, ...]:
    """This step's estimate of the diagonal (the whole batch's, the same on every rank)."""
    if kind == "squared_gradients":
        return tuple(gi * gi for gi in g)
    if kind == "bartlett":
        return _bartlett(operator, generator, group, owner)
    _dist.check_alike(generator, operator.params[0].device, group, owner)
    with graph_errors(owner):
        return tuple(d.abs() for d in hutchinson_diagonal(operator, generator=generator))


def _bartlett(
    operator: CurvatureOperator, generator: torch.Generator | None, group: _dist.Group, owner: str
) -> tuple[Tensor, ...]:
    """The Gauss-Newton-Bartlett diagonal on the outputs of the Gauss-Newton operator (rank average)."""
    local = operator.local if isinstance(operator, _dist.AveragedOperator) else operator
    if not (isinstance(local, GGNOperator) and isinstance(local.loss_hessian, CrossEntropyHessian)):
        raise RuntimeError(
            f"{owner}(preconditioner='bartlett') samples labels from the softmax of the outputs: it needs the "
            "Gauss-Newton curvature (a closure that returns the outputs) with loss_hessian='cross_entropy'"
        )
    hessian = local.loss_hessian
    curvature = CrossEntropyGaussNewton(local.outputs, hessian.targets, local.params, hessian.ignore_index,
                                        hessian.chunk_elements)  # fmt: skip
    with torch.enable_grad(), graph_errors(owner):
        return bartlett_diagonal(curvature, generator=label_generator(generator, group), group=group, owner=owner)


def label_generator(generator: torch.Generator | None, group: _dist.Group) -> torch.Generator | None:
    """The source of Bartlett's labels: the probe generator in one process; distributed, a generator seeded with
    one draw of it (alike on every rank, so the state to checkpoint stays the probe generator's) plus the rank,
    since each rank's rows need independent labels (alike draws would correlate the ranks' rows and bias the
    diagonal)."""
    if group is None:
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    return torch.Generator(device=generator.device).manual_seed(seed + dist.get_rank(group))


def preconditioner(
    estimated: Sequence[Tensor], previous: Sequence[Tensor | None], *, beta: float, damping: float, exponent: float
) -> tuple[Precondition, tuple[Tensor, ...]]:
    r""":math:`r \mapsto r / (d + \lambda)^\xi` and the new diagonal :math:`d = \beta d_{\text{prev}} + (1 - \beta)
    \hat d` (:math:`\hat d` where there is no previous one)."""
    diagonal = tuple(e if d is None else beta * d + (1 - beta) * e for d, e in zip(previous, estimated))
    scale = tuple((d + damping) ** exponent for d in diagonal)
    return (lambda r: tuple(torch._foreach_div(list(r), list(scale)))), diagonal
