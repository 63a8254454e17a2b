"""Exact curvature products (Hessian, generalised Gauss-Newton) and randomised estimators built on them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from scipy.sparse.linalg import LinearOperator

Tensors = Sequence[Tensor]
Distribution = Literal["rademacher", "gaussian"]
Reduction = Literal["mean", "sum"]


def _vjp(
    outputs: Sequence[Tensor | None],
    inputs: Tensors,
    cotangents: Sequence[Tensor | None],
    *,
    retain_graph: bool,
    create_graph: bool = False,
) -> tuple[Tensor, ...]:
    r"""Vector-Jacobian product :math:`\sum_k (\partial y_k / \partial x_i)^\top c_k` for every input :math:`x_i`.

    Outputs that are ``None`` or have no graph contribute nothing; inputs that do not require grad,
    or that no output depends on, get zeros, so the result never holds ``None``.
    """
    pairs = [(y, c) for y, c in zip(outputs, cotangents, strict=True) if y is not None and y.requires_grad]
    active = [x for x in inputs if x.requires_grad]
    if not pairs or not active:
        return tuple(torch.zeros_like(x) for x in inputs)
    ys, cs = zip(*pairs)
    grads = iter(
        torch.autograd.grad(
            ys,
            active,
            cs,
            retain_graph=retain_graph,
            create_graph=create_graph,
            allow_unused=True,
            materialize_grads=True,
        )
    )
    return tuple(next(grads) if x.requires_grad else torch.zeros_like(x) for x in inputs)


def _gradient(loss: Tensor, params: Tensors) -> tuple[Tensor, ...]:
    r"""The gradient :math:`\nabla_\theta L` of a scalar loss, differentiable once more (``create_graph=True``)."""
    return _vjp([loss], params, [None], retain_graph=True, create_graph=True)


def _flatten(tensors: Tensors) -> Tensor:
    """Concatenate tensors into one vector, in order."""
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten(flat: Tensor, like: Tensors) -> tuple[Tensor, ...]:
    """Split a vector into tensors shaped like ``like`` (the inverse of :func:`_flatten`)."""
    chunks = torch.split(flat, [t.numel() for t in like])
    return tuple(c.view_as(t) for c, t in zip(chunks, like, strict=True))


def hvp(
    loss: Tensor,
    params: Tensors,
    vec: Tensors,
    *,
    grads: Sequence[Tensor | None] | None = None,
    retain_graph: bool = False,
) -> tuple[Tensor, ...]:
    r"""Exact Hessian-vector product by reverse-over-reverse differentiation.

    .. math:: H v = \nabla_\theta \big( \nabla_\theta L(\theta)^\top v \big),
              \qquad H = \nabla^2_\theta L(\theta).

    Args:
        loss: Scalar loss :math:`L(\theta)` with an autograd graph to ``params``.
        params: Parameters :math:`\theta = (\theta_1, \dots, \theta_m)`. Those that do not require
            grad are constants: their rows and columns of :math:`H` are zero, so their blocks of the
            result are zero and their blocks of ``vec`` are ignored.
        vec: :math:`v`, one tensor shaped like each parameter.
        grads: :math:`\nabla_\theta L` from ``torch.autograd.grad(loss, params, create_graph=True)``
            (``None`` entries mean zero). When given, ``loss`` is not differentiated again, so one
            gradient graph serves many products; pass ``retain_graph=True`` to keep it for the next.
        retain_graph: Keep the graphs for further differentiation, as in :func:`torch.autograd.grad`.
            By default they are freed, as by ``loss.backward()``.

    Returns:
        :math:`H v`, one tensor per parameter, holding no graph.
    """
    if grads is None:
        grads = _gradient(loss, params)
    return _vjp(grads, params, vec, retain_graph=retain_graph)


class LossHessian(Protocol):
    r"""Hessian-vector product :math:`H_L u = \nabla^2_z \ell(z)\, u` of a loss w.r.t. the model outputs :math:`z`."""

    def __call__(self, outputs: Tensor, vec: Tensor) -> Tensor:
        """Return :math:`H_L u` for outputs :math:`z` and a tangent :math:`u` shaped like them."""
        ...


@dataclass(frozen=True)
class CrossEntropyHessian:
    r"""Hessian of ``F.cross_entropy`` w.r.t. the logits, in closed form.

    Logits :math:`z` have the classes in the last dimension (``(B, V)``, or ``(B, T, V)`` for a
    language model, i.e. ``F.cross_entropy(z.flatten(0, -2), targets.flatten())``). For every row
    :math:`r` with :math:`p_r = \operatorname{softmax}(z_r)`,

    .. math:: (H_L u)_r = \frac{m_r}{c} \big(\operatorname{diag}(p_r) - p_r p_r^\top\big) u_r
              = \frac{m_r}{c}\, p_r \circ \big(u_r - p_r^\top u_r\big),

    where :math:`m_r = [\text{targets}_r \ne \text{ignore\_index}]` and :math:`c = \sum_r m_r`
    for ``reduction="mean"`` (at least 1), :math:`c = 1` for ``"sum"``. The targets enter only
    through :math:`m`; softmax is taken in at least float32.

    Args:
        targets: Class indices shaped like the logits without their last dimension.
        reduction: ``"mean"`` or ``"sum"``, as passed to ``F.cross_entropy``.
        ignore_index: Target value whose rows do not count.
    """

    targets: Tensor
    reduction: Reduction = "mean"
    ignore_index: int = -100

    def __call__(self, outputs: Tensor, vec: Tensor) -> Tensor:
        """Return :math:`H_L u` for logits ``outputs`` and tangent ``vec``."""
        p = torch.softmax(outputs, dim=-1, dtype=torch.promote_types(outputs.dtype, torch.float32))
        hv = p * (vec - (p * vec).sum(dim=-1, keepdim=True))
        counted = (self.targets != self.ignore_index).unsqueeze(-1)
        hv = hv * counted
        if self.reduction == "mean":
            hv = hv / counted.sum().clamp(min=1)
        return hv.to(vec.dtype)


@dataclass(frozen=True)
class MSEHessian:
    r"""Hessian of ``F.mse_loss`` w.r.t. the predictions: :math:`H_L u = \frac{2}{c} u`.

    :math:`c` is the number of prediction entries for ``reduction="mean"`` and 1 for ``"sum"``.

    Args:
        reduction: ``"mean"`` or ``"sum"``, as passed to ``F.mse_loss``.
    """

    reduction: Reduction = "mean"

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
            return hvp(self.loss_fn(z), [z], [vec])[0]


class CurvatureOperator:
    r"""A symmetric :math:`n \times n` matrix on the flattened parameters, known through its products.

    ``op @ x`` takes a flat vector of length :math:`n` (parameters concatenated in order, each
    flattened row-major), an :math:`n \times k` matrix (column by column), or a sequence of
    tensors shaped like the parameters, and returns the same kind. Subclasses implement
    :meth:`matvec`.

    Args:
        params: The parameters :math:`\theta` that index rows and columns.
    """

    def __init__(self, params: Tensors) -> None:
        self.params = tuple(params)
        n = sum(p.numel() for p in self.params)
        self.shape = (n, n)
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device

    def matvec(self, vec: Tensors) -> tuple[Tensor, ...]:
        """Return the product with ``vec``, one tensor per parameter."""
        raise NotImplementedError

    def __matmul__(self, x: Tensor | Tensors) -> Tensor | tuple[Tensor, ...]:
        if not isinstance(x, Tensor):
            return self.matvec(x)
        if x.dim() == 2:
            return torch.stack([self @ column for column in x.T], dim=1)
        return _flatten(self.matvec(_unflatten(x, self.params)))

    def to_scipy(self) -> LinearOperator:
        """A ``scipy.sparse.linalg.LinearOperator`` with float64 NumPy input and output."""
        import numpy as np
        from scipy.sparse.linalg import LinearOperator

        def matvec(x: np.ndarray) -> np.ndarray:
            v = torch.from_numpy(np.asarray(x, dtype=np.float64).reshape(-1))
            return (self @ v.to(self.device, self.dtype)).detach().to("cpu", torch.float64).numpy()

        return LinearOperator(self.shape, matvec=matvec, rmatvec=matvec, dtype=np.float64)


class HessianOperator(CurvatureOperator):
    r"""The Hessian :math:`H = \nabla^2_\theta L(\theta)`; one gradient graph serves every product.

    The constructor runs one backward with ``create_graph=True``; each product is then one more
    vector-Jacobian product of that gradient (:func:`hvp` with ``grads``), retaining the graph.
    The graph lives as long as the operator does.

    Args:
        loss: Scalar loss :math:`L(\theta)` with an autograd graph to ``params``.
        params: Parameters :math:`\theta`; those that do not require grad have zero rows and columns.
    """

    def __init__(self, loss: Tensor, params: Tensors) -> None:
        super().__init__(params)
        self._grads = _gradient(loss, self.params)

    @property
    def gradient(self) -> tuple[Tensor, ...]:
        r""":math:`\nabla_\theta L`, detached: the gradient the products were built on."""
        return tuple(g.detach() for g in self._grads)

    def matvec(self, vec: Tensors) -> tuple[Tensor, ...]:
        """Return :math:`H v`, one tensor per parameter."""
        return _vjp(self._grads, self.params, vec, retain_graph=True)


class GGNOperator(CurvatureOperator):
    r"""The generalised Gauss-Newton matrix :math:`G = J^\top H_L J`.

    :math:`J = \partial z / \partial \theta` is the Jacobian of the model outputs and :math:`H_L`
    the Hessian of the loss w.r.t. the outputs. :math:`J v` is taken by the double-vjp trick: the
    constructor forms :math:`g(u) = J^\top u` for a dummy cotangent :math:`u` with
    ``create_graph=True``, and :math:`J v = \nabla_u (g(u)^\top v)`, which runs the double backward
    of every layer (attention included). Each product costs two vector-Jacobian products and one
    :math:`H_L` product; the graph lives as long as the operator does.

    Args:
        outputs: Model outputs :math:`z(\theta)` with an autograd graph to ``params``.
        params: Parameters :math:`\theta`; those that do not require grad have zero rows and columns.
        loss_hessian: :math:`u \mapsto H_L u`, e.g. :class:`CrossEntropyHessian`, :class:`MSEHessian`
            or :class:`AutogradLossHessian`.
    """

    def __init__(self, outputs: Tensor, params: Tensors, loss_hessian: LossHessian) -> None:
        super().__init__(params)
        self.outputs = outputs
        self.loss_hessian = loss_hessian
        self._dummy = torch.zeros_like(outputs, requires_grad=True)
        self._transposed = _vjp([outputs], self.params, [self._dummy], retain_graph=True, create_graph=True)

    def jvp(self, vec: Tensors) -> Tensor:
        r"""Return :math:`J v`, shaped like the outputs."""
        return _vjp(self._transposed, [self._dummy], vec, retain_graph=True)[0]

    def vjp(self, cotangent: Tensor) -> tuple[Tensor, ...]:
        r"""Return :math:`J^\top c`, one tensor per parameter."""
        return _vjp([self.outputs], self.params, [cotangent], retain_graph=True)

    def matvec(self, vec: Tensors) -> tuple[Tensor, ...]:
        r"""Return :math:`G v = J^\top H_L J v`, one tensor per parameter."""
        return self.vjp(self.loss_hessian(self.outputs.detach(), self.jvp(vec)))


class LossGraphHessian:
    r"""The Hessian of an already computed ``loss`` w.r.t. the ``outputs`` it was computed from,
    by double backward through the loss's own graph: :math:`H_L u = \nabla_z (\nabla_z L^\top u)`.

    The gradient :math:`\nabla_z L` is formed once (``create_graph=True``); each product is one
    more vector-Jacobian product on it. Used by :func:`ggnvp` when no closed form is given.
    """

    def __init__(self, loss: Tensor, outputs: Tensor) -> None:
        self.outputs = outputs
        (self.gradient,) = _vjp([loss], [outputs], [None], retain_graph=True, create_graph=True)

    def __call__(self, outputs: Tensor, vec: Tensor) -> Tensor:
        """Return :math:`H_L u`; ``outputs`` is ignored (the product runs on the loss's own graph)."""
        return _vjp([self.gradient], [self.outputs], [vec], retain_graph=True)[0]


def ggnvp(
    loss: Tensor | None,
    outputs: Tensor,
    params: Tensors,
    vec: Tensors,
    loss_hessian: LossHessian | None = None,
) -> tuple[Tensor, ...]:
    r"""Generalised Gauss-Newton-vector product :math:`G v = J^\top H_L J v` (see :class:`GGNOperator`).

    Args:
        loss: The scalar loss computed from ``outputs``; :math:`H_L` is its Hessian w.r.t. the
            outputs, by double backward through its graph, unless ``loss_hessian`` gives a closed
            form (then ``loss`` may be None). Its graph is kept.
        outputs: Model outputs :math:`z(\theta)` with an autograd graph to ``params``; the graph is kept.
        params: Parameters :math:`\theta`; those that do not require grad have zero rows and columns.
        vec: :math:`v`, one tensor shaped like each parameter.
        loss_hessian: :math:`u \mapsto H_L u` in closed form, e.g. ``CrossEntropyHessian(targets)``
            or ``MSEHessian()`` (faster than autograd).

    Returns:
        :math:`G v`, one tensor per parameter.
    """
    if loss_hessian is None:
        if loss is None:
            raise ValueError("ggnvp needs the loss, or a closed-form loss_hessian such as CrossEntropyHessian(targets)")
        loss_hessian = LossGraphHessian(loss, outputs)
    return GGNOperator(outputs, params, loss_hessian).matvec(vec)


OperatorLike = CurvatureOperator | tuple[Tensor, Tensors]


def _as_operator(operator: OperatorLike) -> CurvatureOperator:
    """An operator as given, or the Hessian of a ``(loss, params)`` pair."""
    if isinstance(operator, CurvatureOperator):
        return operator
    loss, params = operator
    return HessianOperator(loss, params)


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
) -> tuple[Tensor, ...]:
    r"""Hutchinson's estimate of the diagonal of a curvature matrix :math:`A`.

    .. math:: \widehat{\operatorname{diag}}(A) = \frac{1}{S} \sum_{s=1}^{S} z_s \circ A z_s,
              \qquad \mathbb{E}\big[\widehat{\operatorname{diag}}(A)\big] = \operatorname{diag}(A),

    with probes :math:`z_s` of i.i.d. Rademacher (:math:`\pm 1`) or standard normal entries. With
    Rademacher probes :math:`z_i^2 = 1`, so a diagonal :math:`A` is recovered exactly from one sample.

    Args:
        operator: A :class:`CurvatureOperator`, or a ``(loss, params)`` pair for its Hessian.
        num_samples: Number of probes :math:`S`.
        distribution: ``"rademacher"`` or ``"gaussian"``.
        generator: Source of the probes (on the parameters' device); the global one if ``None``.

    Returns:
        The estimate, one tensor per parameter.
    """
    op = _as_operator(operator)
    total = [torch.zeros_like(p) for p in op.params]
    for _ in range(num_samples):
        z = _probe(op.params, distribution, generator)
        for acc, zi, azi in zip(total, z, op.matvec(z), strict=True):
            acc.add_(zi * azi)
    return tuple(acc / num_samples for acc in total)


def trace(
    operator: OperatorLike,
    num_samples: int = 1,
    distribution: Distribution = "rademacher",
    generator: torch.Generator | None = None,
) -> float:
    r"""Hutchinson's estimate of the trace of a curvature matrix :math:`A`.

    .. math:: \widehat{\operatorname{tr}}(A) = \frac{1}{S} \sum_{s=1}^{S} z_s^\top A z_s,
              \qquad \mathbb{E}\big[\widehat{\operatorname{tr}}(A)\big] = \operatorname{tr}(A),

    the sum of :func:`hutchinson_diagonal` over all entries; arguments are as there.
    """
    diagonal = hutchinson_diagonal(operator, num_samples, distribution, generator)
    return float(sum(d.sum() for d in diagonal))


def power_iteration(
    operator: OperatorLike,
    *,
    max_iter: int = 100,
    tol: float = 1e-3,
    generator: torch.Generator | None = None,
) -> tuple[float, tuple[Tensor, ...]]:
    r"""The eigenvalue of largest magnitude of a curvature matrix :math:`A`, and its eigenvector.

    From a random unit :math:`v_0`, iterates :math:`v_{k+1} = A v_k / \lVert A v_k \rVert` and
    returns the Rayleigh quotient :math:`\lambda = v_k^\top A v_k` with :math:`v_k` once the residual
    satisfies :math:`\lVert A v_k - \lambda v_k \rVert \le \text{tol}\, |\lambda|`, or after
    ``max_iter`` products. Convergence is geometric in :math:`|\lambda_2 / \lambda_1|`.

    Args:
        operator: A :class:`CurvatureOperator`, or a ``(loss, params)`` pair for its Hessian.
        max_iter: Maximum number of matrix-vector products (at least 1).
        tol: Relative residual at which to stop.
        generator: Source of :math:`v_0` (on the parameters' device); the global one if ``None``.

    Returns:
        :math:`\lambda` and :math:`v` (unit norm over all parameters, one tensor per parameter).
    """
    op = _as_operator(operator)
    v = torch.randn(op.shape[0], generator=generator, device=op.device, dtype=op.dtype)
    v = v / torch.linalg.vector_norm(v)
    for step in range(max_iter):
        w = op @ v
        eigenvalue = torch.dot(v, w)
        converged = torch.linalg.vector_norm(w - eigenvalue * v) <= tol * eigenvalue.abs()
        if converged or step == max_iter - 1:
            break
        v = w / torch.linalg.vector_norm(w)
    return float(eigenvalue), _unflatten(v, op.params)
