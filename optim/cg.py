"""Truncated conjugate gradient over tuples of tensors, with Martens' stopping rule and saved iterates."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

Tensors = tuple[Tensor, ...]
Status = Literal["converged", "progress", "max_iter", "negative_curvature", "breakdown"]


def _dot(a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
    r""":math:`\sum_i \langle a_i, b_i \rangle` as a 0-d tensor."""
    return sum((x * y).sum() for x, y in zip(a, b, strict=True))


class _Flat:
    """Tuples of tensors shaped like ``like`` as one vector in their common dtype (:meth:`join`), and back
    (:meth:`split`: views where the dtypes agree), so that CG's vector operations are one kernel each."""

    def __init__(self, like: Sequence[Tensor]) -> None:
        if not like:
            raise ValueError("cg: b holds no tensor")
        self.like = tuple(like)
        self.dtype = functools.reduce(torch.promote_types, (t.dtype for t in self.like))
        self.sizes = [t.numel() for t in self.like]

    def join(self, tensors: Sequence[Tensor]) -> Tensor:
        return torch.cat([t.reshape(-1).to(self.dtype) for t in tensors])

    def split(self, flat: Tensor) -> Tensors:
        parts = torch.split(flat, self.sizes)
        return tuple(part.view(t.shape).to(t.dtype) for part, t in zip(parts, self.like))


@dataclass(frozen=True)
class CGIterate:
    r"""A CG iterate :math:`x_i` with :math:`\phi(x_i)`, :math:`b^\top x_i` and :math:`x_i^\top x_i`.

    The curvature along it follows as :math:`x_i^\top A x_i = 2(\phi(x_i) + b^\top x_i)`.
    """

    iteration: int
    x: Tensors
    objective: float
    bx: float
    xx: float


@dataclass
class CGResult:
    r"""What :func:`cg` found.

    Attributes:
        x: The last iterate.
        iterations: Matrix-vector products spent in the iteration, the one that found negative
            curvature or a non-finite value included (not counting the one for ``x0``).
        status: Why it stopped: ``"converged"`` (residual below ``tol``), ``"progress"`` (Martens'
            relative-progress rule), ``"max_iter"``, ``"negative_curvature"`` (:math:`p^\top A p \le 0`)
            or ``"breakdown"`` (a non-finite product; ``x`` is the last finite iterate).
        objective: :math:`\phi(x)`.
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
    ``precondition`` :math:`M^{-1} r` for a symmetric positive definite :math:`M`. Inside, a vector is
    one tensor (the tuple concatenated in its common dtype; ``matvec`` and ``precondition`` see views of
    it), so each inner product and update is one kernel whatever the number of parameters, and an
    iteration reads all its scalars with one host synchronisation (plus one at the start). With
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

    A warm start with :math:`\phi(x_0) > 0` is worse than :math:`x = 0`, and one with :math:`b^\top x_0 \le 0`
    points away from :math:`b` (uphill when :math:`b = -g`, which a negative-curvature :math:`A` allows even at
    :math:`\phi(x_0) \le 0`), so CG then starts from zero: from zero every iterate before a negative curvature
    has :math:`b^\top x_i > 0`.

    Args:
        matvec: :math:`v \mapsto A v` for symmetric :math:`A`.
        b: Right-hand side.
        x0: Starting point; zero if ``None``.
        max_iter: Maximum number of iterations (products with :math:`A`).
        tol: Relative residual at which to stop.
        progress_tol: Martens' :math:`\epsilon` (he used :math:`5 \cdot 10^{-4}`); 0 turns the rule off.
        progress_window: Smallest :math:`k` of that rule (Martens: 10).
        precondition: :math:`r \mapsto M^{-1} r`; the identity if ``None``.
        save_at: Iterations whose iterates to keep (e.g. :func:`martens_schedule`; 0 is the start); the last
            is always kept.

    Returns:
        A :class:`CGResult`.
    """
    flat = _Flat(b)

    def product(v: Tensor) -> Tensor:
        return flat.join(matvec(flat.split(v)))

    def preconditioned(r: Tensor) -> Tensor:
        return flat.join(precondition(flat.split(r))) if precondition is not None else r

    b = flat.join(b)
    x, r = torch.zeros_like(b), b
    if x0 is not None:
        x = flat.join(x0)
        r = b - product(x)
    bb, rr, bx, xr = torch.stack([b @ b, r @ r, b @ x, x @ r]).tolist()  # one host synchronisation
    if x0 is not None and (-0.5 * (bx + xr) > 0 or bx <= 0):
        x, r, rr, bx, xr = torch.zeros_like(b), b, bb, 0.0, 0.0
    objectives = [-0.5 * (bx + xr)]
    if not math.isfinite(objectives[0] + rr):
        start = CGIterate(0, flat.split(x), objectives[0], bx, math.nan)
        return CGResult(start.x, 0, "breakdown", objectives[0], [start])
    z = preconditioned(r)
    p, rz = z, r @ z
    iterates = [CGIterate(0, flat.split(x), objectives[0], bx, float(x @ x))] if 0 in save_at else []
    status: Status = "max_iter"
    i = products = 0
    while i < max_iter:
        if math.sqrt(rr) <= tol * math.sqrt(bb):
            status = "converged"
            break
        ap = product(p)
        products += 1
        pap = p @ ap
        alpha = rz / pap.abs()  # with |pAp|: a first direction of negative curvature is still a descent step
        x_next, r_next = torch.addcmul(x, p, alpha), torch.addcmul(r, ap, alpha, value=-1)
        saved = i + 1 in save_at
        scalars = [rz, pap, r_next @ r_next, b @ x_next, x_next @ r_next] + ([x_next @ x_next] if saved else [])
        rz_value, pap_value, rr_next, bx_next, xr_next, *xx = torch.stack(scalars).tolist()  # one host sync
        if not (math.isfinite(rz_value) and math.isfinite(pap_value)):
            status = "breakdown"
            break
        if pap_value <= 0:
            status = "negative_curvature"
            if i > 0 or pap_value == 0:
                break
        x, r, rr, bx, i = x_next, r_next, rr_next, bx_next, i + 1
        objectives.append(-0.5 * (bx + xr_next))
        if saved:
            iterates.append(CGIterate(i, flat.split(x), objectives[-1], bx, xx[0]))
        if status == "negative_curvature":
            break
        k = max(progress_window, math.ceil(0.1 * i))
        phi = objectives[-1]
        if progress_tol > 0 and i > k and phi < 0 and (phi - objectives[-1 - k]) / phi < k * progress_tol:
            status = "progress"
            break
        z = preconditioned(r)
        rz_next = r @ z
        p, rz = torch.addcmul(z, p, rz_next / rz), rz_next
    if status == "max_iter" and math.sqrt(rr) <= tol * math.sqrt(bb):  # converged on the last allowed iteration
        status = "converged"
    if not iterates or iterates[-1].iteration != i:
        iterates.append(CGIterate(i, flat.split(x), objectives[-1], bx, float(x @ x)))
    return CGResult(iterates[-1].x, products, status, objectives[-1], iterates)
