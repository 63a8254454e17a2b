"""Curvature matrices known through their products: the Hessian, the generalised Gauss-Newton matrix and the
Hessian through gradients that carry their graph, as operators on the flattened parameters."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from optim._autodiff import (
    Mode,
    ParamFunction,
    Tensors,
    evaluate,
    flatten,
    forward_jvp,
    forward_over_reverse,
    function_of_params,
    gradient,
    unflatten,
    vjp,
)
from optim.forward_mode_checks import check_deterministic
from optim.hyperparameters import check_flag, check_mode
from optim.loss_hessians import CrossEntropyHessian, LossHessian

if TYPE_CHECKING:
    from scipy.sparse.linalg import LinearOperator


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
        return flatten(self.matvec(unflatten(x, self.params)))

    def to_scipy(self) -> LinearOperator:
        """A ``scipy.sparse.linalg.LinearOperator`` with float64 NumPy input and output."""
        import numpy as np
        from scipy.sparse.linalg import LinearOperator

        def matvec(x: np.ndarray) -> np.ndarray:
            v = torch.from_numpy(np.asarray(x, dtype=np.float64).reshape(-1))
            parts = [part.to(self.device, p.dtype) for part, p in zip(unflatten(v, self.params), self.params)]
            product = self.matvec(parts)  # each parameter's block in its own dtype (not all in the first one's)
            return torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in product]).numpy()

        return LinearOperator(self.shape, matvec=matvec, rmatvec=matvec, dtype=np.float64)


class HessianOperator(CurvatureOperator):
    r"""The Hessian :math:`H = \nabla^2_\theta L(\theta)`.

    ``mode="reverse"``: the constructor runs one backward with ``create_graph=True``; each product
    is then one more vector-Jacobian product of that gradient (:func:`hvp` with ``grads``), retaining
    the graph, which lives as long as the operator does. Each product costs one backward of the
    backward; the memory of the gradient graph is held between products.

    ``mode="forward"``: nothing is kept; each product is a fresh forward-over-reverse pass
    (:func:`hvp` with ``mode="forward"``: a forward with tangents and a backward), so a product
    costs about twice a reverse-mode one, but no graph outlives it. The pass's values are the loss
    and the gradient at :math:`\theta`: the first product keeps them (:attr:`value`,
    :attr:`gradient`), so an estimator that needs the gradient too (Sophia's refresh) takes it
    without a pass of its own.

    Args:
        loss: Scalar loss :math:`L(\theta)`: a tensor with an autograd graph to ``params``
            (``"reverse"`` only), or a function of the parameter values (see :func:`optim.functional`).
        params: Parameters :math:`\theta`; those that do not require grad have zero rows and columns.
        mode: ``"reverse"`` (reverse-over-reverse) or ``"forward"`` (forward-over-reverse).

    Attributes:
        value: :math:`L(\theta)`, detached: in reverse mode from the constructor, in forward mode from
            the first product (``None`` before it).
    """

    def __init__(self, loss: Tensor | ParamFunction, params: Tensors, *, mode: Mode = "reverse") -> None:
        check_mode(mode)
        super().__init__(params)
        self.mode = mode
        self.value: Tensor | None = None
        if mode == "forward":
            self._loss_fn = function_of_params(loss, "the loss", "HessianOperator")
        else:
            evaluated = evaluate(loss, self.params)
            self.value = evaluated.detach()
            self._grads = gradient(evaluated, self.params)

    @cached_property
    def gradient(self) -> tuple[Tensor, ...]:
        r""":math:`\nabla_\theta L`, detached: the gradient the products are taken at (in forward mode the
        first product's, or, asked before any product, one ordinary backward's)."""
        if self.mode == "reverse":
            return tuple(g.detach() for g in self._grads)
        return vjp([evaluate(self._loss_fn, self.params)], self.params, [None], retain_graph=False)

    def matvec(self, vec: Tensors) -> tuple[Tensor, ...]:
        """Return :math:`H v`, one tensor per parameter."""
        if self.mode == "forward":
            value, gradient, product = forward_over_reverse(self._loss_fn, self.params, vec)
            if self.value is None:
                self.value = value
                self.__dict__.setdefault("gradient", gradient)  # the cached property's slot
            return product
        return vjp(self._grads, self.params, vec, retain_graph=True)


class GGNOperator(CurvatureOperator):
    r"""The generalised Gauss-Newton matrix :math:`G = J^\top H_L J`.

    :math:`J = \partial z / \partial \theta` is the Jacobian of the model outputs and :math:`H_L`
    the Hessian of the loss w.r.t. the outputs. Every product is :math:`J^\top (H_L (J v))`: a
    Jacobian-vector product, an :math:`H_L` product and a vector-Jacobian product through the graph
    of the outputs, which the operator keeps. The modes differ in how :math:`J v` is taken:

    ``mode="reverse"``: by the double-vjp trick. The constructor forms :math:`g(u) = J^\top u` for a
    dummy cotangent :math:`u` with ``create_graph=True``, and :math:`J v = \nabla_u (g(u)^\top v)`,
    which runs the double backward of every layer (attention included). A product costs two
    backwards and the operator holds the forward graph and the ``create_graph`` backward graph.

    ``mode="forward"``: by forward mode, :math:`J v = \frac{\mathrm{d}}{\mathrm{d}\varepsilon}
    z(\theta + \varepsilon v)|_{\varepsilon=0}` (as curvlinops computes it): each product runs the
    model once more with tangents and without autograd (nothing saved), then one backward. The
    operator holds only the forward graph, so it needs less memory; a product costs a forward and
    a backward, about the same as in reverse mode. ``outputs`` must then be a function of the
    parameter values, deterministic (no dropout), so that the extra forward passes agree with the
    graph. ``lean_tangents=True`` takes the tangent :math:`\dot x W + x \dot W` of a linear layer
    (``F.linear``, ``x @ W``) in one buffer (:class:`~optim._tangent_products.LeanLinearTangents`): half
    the memory of :math:`J v` at a language model's head, for a few microseconds of dispatch per torch
    call (see docs/curvature.md).

    Args:
        outputs: Model outputs :math:`z(\theta)`: a tensor with an autograd graph to ``params``
            (``"reverse"`` only), or a function of the parameter values (see :func:`optim.functional`).
        params: Parameters :math:`\theta`; those that do not require grad have zero rows and columns.
        loss_hessian: :math:`u \mapsto H_L u`, e.g. :class:`CrossEntropyHessian`, :class:`MSEHessian`
            or :class:`AutogradLossHessian`.
        mode: ``"reverse"`` (double-vjp) or ``"forward"`` (forward-mode :math:`J v`).
        evaluated: ``"forward"`` only: the outputs already computed at the parameters' current values,
            with their graph (what ``outputs(params)`` would return); spares the constructor that forward.
        lean_tangents: ``"forward"`` only: take :math:`J v` with the lean rules of linear layers (above).

    Raises:
        ValueError: ``mode`` is neither; ``evaluated`` or ``lean_tangents`` with ``"reverse"``, or
            ``lean_tangents`` not a bool.
    """

    def __init__(
        self,
        outputs: Tensor | ParamFunction,
        params: Tensors,
        loss_hessian: LossHessian,
        *,
        mode: Mode = "reverse",
        evaluated: Tensor | None = None,
        lean_tangents: bool = False,
    ) -> None:
        check_mode(mode)
        check_flag("GGNOperator", "lean_tangents", lean_tangents)
        super().__init__(params)
        self.mode = mode
        self.loss_hessian = loss_hessian
        self.lean_tangents = lean_tangents
        if mode == "forward":
            self._outputs_fn = function_of_params(outputs, "the outputs", "GGNOperator")
        elif evaluated is not None:
            raise ValueError("GGNOperator: evaluated is for mode='forward' (in reverse mode pass the outputs)")
        elif lean_tangents:
            raise ValueError("GGNOperator: lean_tangents is for mode='forward' (reverse mode takes J v by backward)")
        self.outputs = evaluate(outputs, self.params) if evaluated is None else evaluated
        if mode == "reverse":
            self._dummy = torch.zeros_like(self.outputs, requires_grad=True)
            self._transposed = vjp([self.outputs], self.params, [self._dummy], retain_graph=True, create_graph=True)

    def jvp(self, vec: Tensors) -> Tensor:
        r"""Return :math:`J v`, shaped like the outputs.

        Raises:
            RuntimeError: ``"forward"`` with outputs from :func:`functional` of a module that would run with
                dropout (:func:`check_deterministic`).
        """
        if self.mode == "forward":
            check_deterministic("GGNOperator", getattr(self._outputs_fn, "module", None))
            return forward_jvp(self._outputs_fn, self.params, vec, lean=self.lean_tangents)
        return vjp(self._transposed, [self._dummy], vec, retain_graph=True)[0]

    def vjp(self, cotangent: Tensor) -> tuple[Tensor, ...]:
        r"""Return :math:`J^\top c`, one tensor per parameter."""
        return vjp([self.outputs], self.params, [cotangent], retain_graph=True)

    def matvec(self, vec: Tensors) -> tuple[Tensor, ...]:
        r"""Return :math:`G v = J^\top H_L J v`, one tensor per parameter.

        A :class:`CrossEntropyHessian` writes :math:`H_L J v` over :math:`J v` when that is a
        buffer of the product's own (not a view of ``vec``), so the product holds one tensor the
        size of the outputs where it would hold two.
        """
        tangent = self.jvp(vec)
        if isinstance(self.loss_hessian, CrossEntropyHessian) and _own_buffer(tangent, vec):
            return self.vjp(self.loss_hessian(self.outputs.detach(), tangent, out=tangent))
        return self.vjp(self.loss_hessian(self.outputs.detach(), tangent))


def _own_buffer(tensor: Tensor, others: Tensors) -> bool:
    """Whether ``tensor`` may be overwritten: contiguous, without a graph, sharing memory with none of ``others``."""
    storage = tensor.untyped_storage().data_ptr()
    return (
        tensor.is_contiguous()
        and not tensor.requires_grad
        and all(other.untyped_storage().data_ptr() != storage for other in others)
    )



class GradientGraphHessian(CurvatureOperator):
    r"""The Hessian through gradients that carry their graph, as ``p.grad`` does after
    ``loss.backward(create_graph=True)``: :math:`H v = \nabla_\theta (g^\top v)`, the graph retained.

    It gives the same products as :class:`HessianOperator` on the loss itself.

    Args:
        grads: :math:`g = \nabla_\theta L`, one tensor per parameter; those without a graph are
            constants (zero rows of :math:`H`).
        params: The parameters :math:`\theta`.
    """

    def __init__(self, grads: Sequence[Tensor], params: Sequence[Tensor]) -> None:
        super().__init__(params)
        self._grads = tuple(grads)

    @property
    def gradient(self) -> tuple[Tensor, ...]:
        r""":math:`\nabla_\theta L`, detached."""
        return tuple(g.detach() for g in self._grads)

    def matvec(self, vec: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """Return :math:`H v`, one tensor per parameter."""
        return vjp(self._grads, self.params, vec, retain_graph=True)


OperatorLike = CurvatureOperator | tuple[Tensor, Tensors]


def as_operator(operator: OperatorLike) -> CurvatureOperator:
    """An operator as given, or the Hessian of a ``(loss, params)`` pair."""
    if isinstance(operator, CurvatureOperator):
        return operator
    loss, params = operator
    return HessianOperator(loss, params)
