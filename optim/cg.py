"""Truncated conjugate gradient over tuples of tensors, with Martens' stopping rule and saved iterates."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

Tensors = tuple[Tensor, ...]
Status = Literal["converged", "progress", "max_iter", "negative_curvature", "breakdown"]


def _dot(a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
    """:math:`\\sum_i \\langle a_i, b_i \\rangle` as a 0-d tensor."""
    return sum((x * y).sum() for x, y in zip(a, b, strict=True))


def _axpy(alpha: Tensor | float, x: Sequence[Tensor], y: Sequence[Tensor]) -> Tensors:
    """:math:`y + \\alpha x`, out of place (``torch._foreach`` ops: two kernel launches, not two per tensor)."""
    if len(x) != len(y):
        raise ValueError(f"_axpy: {len(x)} tensors in x, {len(y)} in y")
    if not x:
        return ()
    return tuple(torch._foreach_add(list(y), torch._foreach_mul(list(x), alpha)))


@dataclass(frozen=True)
class CGIterate:
    r"""A CG iterate :math:`x_i` with :math:`\phi(x_i)` and :math:`b^\top x_i`.

    The curvature along it follows as :math:`x_i^\top A x_i = 2(\phi(x_i) + b^\top x_i)`.
    """

    iteration: int
    x: Tensors
    objective: float
    bx: float


@dataclass
class CGResult:
    """What :func:`cg` found.

    Attributes:
        x: The last iterate.
        iterations: Matrix-vector products spent in the iteration (not counting the one for ``x0``).
        status: Why it stopped: ``"converged"`` (residual below ``tol``), ``"progress"`` (Martens'
            relative-progress rule), ``"max_iter"``, ``"negative_curvature"`` (:math:`p^\\top A p \\le 0`)
            or ``"breakdown"`` (a non-finite product; ``x`` is the last finite iterate).
        objective: :math:`\\phi(x)`.
        iterates: The iterates saved at ``save_at``, in order, always ending with the last one.
    """

    x: Tensors
    iterations: int
    status: Status
    objective: float
    iterates: list[CGIterate] = field(default_factory=list)


def martens_schedule(max_iter: int, gamma: float = 1.3) -> set[int]:
    r"""Iterations :math:`\lceil \gamma^j \rceil \le` ``max_iter`` whose iterates Martens (2010) keeps."""
    saved, j = set(), 0
    while (i := math.ceil(gamma**j)) <= max_iter:
        saved.add(i)
        j += 1
    return saved


def cg(
    matvec: Callable[[Tensors], Sequence[Tensor]],
    b: Sequence[Tensor],
    x0: Sequence[Tensor] | None = None,
    *,
    max_iter: int = 50,
    tol: float = 1e-10,
    progress_tol: float = 0.0,
    progress_window: int = 10,
    precondition: Callable[[Tensors], Sequence[Tensor]] | None = None,
    save_at: Collection[int] = (),
) -> CGResult:
    r"""Preconditioned CG for :math:`A x = b`, minimising :math:`\phi(x) = \tfrac12 x^\top A x - b^\top x`.

    Vectors are tuples of tensors (one per parameter); ``matvec`` computes :math:`A v` and
    ``precondition`` :math:`M^{-1} r` for a symmetric positive definite :math:`M`. With
    :math:`r_i = b - A x_i`, :math:`z_i = M^{-1} r_i`:

    .. math:: \alpha_i = \frac{r_i^\top z_i}{p_i^\top A p_i}, \quad x_{i+1} = x_i + \alpha_i p_i, \quad
              r_{i+1} = r_i - \alpha_i A p_i, \quad p_{i+1} = z_{i+1} + \frac{r_{i+1}^\top z_{i+1}}{r_i^\top z_i} p_i,

    and :math:`\phi(x_i) = -\tfrac12 x_i^\top (b + r_i)` costs no product. The iteration stops when

    - :math:`\lVert r_i \rVert \le \text{tol}\, \lVert b \rVert` (``"converged"``);
    - Martens' (2010) rule holds (``"progress"``, when ``progress_tol`` :math:`= \epsilon > 0`): with
      :math:`k = \max(\text{progress\_window}, \lceil i/10 \rceil)`, :math:`i > k`, :math:`\phi(x_i) < 0` and
      :math:`(\phi(x_i) - \phi(x_{i-k})) / \phi(x_i) < k \epsilon`;
    - :math:`p_i^\top A p_i \le 0` (``"negative_curvature"``): on the first iteration the step
      :math:`x_1 = x_0 + (r_0^\top z_0 / |p_0^\top A p_0|)\, p_0` still decreases :math:`\phi` and is taken;
      later the current iterate is returned (as in Steihaug's truncated CG);
    - a product or inner product is not finite (``"breakdown"``).

    A warm start with :math:`\phi(x_0) > 0` is worse than :math:`x = 0`, so CG then starts from zero.

    Args:
        matvec: :math:`v \mapsto A v` for symmetric :math:`A`.
        b: Right-hand side.
        x0: Starting point; zero if ``None``.
        max_iter: Maximum number of iterations (products with :math:`A`).
        tol: Relative residual at which to stop.
        progress_tol: Martens' :math:`\epsilon` (he used :math:`5 \cdot 10^{-4}`); 0 turns the rule off.
        progress_window: Smallest :math:`k` of that rule (Martens: 10).
        precondition: :math:`r \mapsto M^{-1} r`; the identity if ``None``.
        save_at: Iterations whose iterates to keep (e.g. :func:`martens_schedule`); the last is always kept.

    Returns:
        A :class:`CGResult`.
    """
    b = tuple(b)
    b_norm = math.sqrt(float(_dot(b, b)))
    if x0 is not None:
        x = tuple(x0)
        r = _axpy(-1.0, matvec(x), b)
        if float(-0.5 * _dot(x, _axpy(1.0, r, b))) > 0:
            x0 = None
    if x0 is None:
        x, r = tuple(torch.zeros_like(t) for t in b), b
    z = tuple(precondition(r)) if precondition is not None else r
    p, rz = z, _dot(r, z)
    bx = float(_dot(b, x))
    objectives = [-0.5 * (bx + float(_dot(x, r)))]
    iterates: list[CGIterate] = []
    status: Status = "max_iter"
    if not (math.isfinite(objectives[0]) and torch.isfinite(rz)):
        return CGResult(x, 0, "breakdown", objectives[0], [CGIterate(0, x, objectives[0], bx)])
    i = 0
    while i < max_iter:
        if math.sqrt(float(_dot(r, r))) <= tol * b_norm:
            status = "converged"
            break
        ap = tuple(matvec(p))
        pap = _dot(p, ap)
        if not torch.isfinite(pap):
            status = "breakdown"
            break
        if pap <= 0:
            status = "negative_curvature"
            if i > 0 or pap == 0:
                break
            alpha = rz / pap.abs()
        else:
            alpha = rz / pap
        x, r = _axpy(alpha, p, x), _axpy(-alpha, ap, r)
        i += 1
        bx = float(_dot(b, x))
        objectives.append(-0.5 * (bx + float(_dot(x, r))))
        if i in save_at:
            iterates.append(CGIterate(i, x, objectives[-1], bx))
        if status == "negative_curvature":
            break
        k = max(progress_window, math.ceil(0.1 * i))
        phi = objectives[-1]
        if progress_tol > 0 and i > k and phi < 0 and (phi - objectives[-1 - k]) / phi < k * progress_tol:
            status = "progress"
            break
        z = tuple(precondition(r)) if precondition is not None else r
        rz_next = _dot(r, z)
        p, rz = _axpy(rz_next / rz, p, z), rz_next
    if not iterates or iterates[-1].iteration != i:
        iterates.append(CGIterate(i, x, objectives[-1], bx))
    return CGResult(x, i, status, objectives[-1], iterates)
