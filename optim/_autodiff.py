"""The autograd passes that every curvature product is made of: vector-Jacobian products (reverse mode),
forward-over-reverse Hessian products and forward-mode Jacobian-vector products."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Literal

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor

from optim import compiled
from optim._tangent_products import LeanLinearTangents
from optim.forward_mode_checks import forward_mode_errors

Tensors = Sequence[Tensor]
Mode = Literal["reverse", "forward"]
ParamFunction = Callable[[tuple[Tensor, ...]], Tensor]
"""A function of parameter values: called with one tensor per parameter, in order (see :func:`optim.functional`)."""


def function_of_params(fn: Tensor | ParamFunction, argument: str, caller: str) -> ParamFunction:
    """``fn`` if it is a function of the parameter values; a clear error for a computed tensor."""
    if callable(fn) and not isinstance(fn, Tensor):
        return fn
    raise TypeError(
        f"{caller}(mode='forward') needs {argument} as a function of the parameter values, e.g. "
        f"optim.functional(model, closure), not a computed {type(fn).__name__}: forward mode runs the model "
        "again with tangents attached to the parameters"
    )


def evaluate(fn: Tensor | ParamFunction, params: Tensors) -> Tensor:
    """``fn`` if it is a computed tensor, else ``fn`` called (with autograd on) on the parameters themselves."""
    if isinstance(fn, Tensor):
        return fn
    with torch.enable_grad():
        return fn(tuple(params))


def vjp(
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
    with compiled.explained("optim"):
        grads = iter(torch.autograd.grad(ys, active, cs, retain_graph=retain_graph, create_graph=create_graph,
                                         allow_unused=True, materialize_grads=True))
    return tuple(next(grads) if x.requires_grad else torch.zeros_like(x) for x in inputs)


def gradient(loss: Tensor, params: Tensors) -> tuple[Tensor, ...]:
    r"""The gradient :math:`\nabla_\theta L` of a scalar loss, differentiable once more (``create_graph=True``)."""
    return vjp([loss], params, [None], retain_graph=True, create_graph=True)


def flatten(tensors: Tensors) -> Tensor:
    """Concatenate tensors into one vector, in order."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: Tensor, like: Tensors) -> tuple[Tensor, ...]:
    """Split a vector into tensors shaped like ``like`` (the inverse of :func:`flatten`)."""
    chunks = torch.split(flat, [t.numel() for t in like])
    return tuple(c.view_as(t) for c, t in zip(chunks, like, strict=True))


def _tangent(dual: Tensor) -> Tensor:
    """The tangent of ``dual`` at the current dual level (zeros when it has none), without a graph."""
    tangent = fwAD.unpack_dual(dual).tangent
    return torch.zeros_like(dual) if tangent is None else tangent.detach()


def _primal(dual: Tensor) -> Tensor:
    """The value of ``dual`` at the current dual level, without its tangent or a graph."""
    return fwAD.unpack_dual(dual).primal.detach()


def _dual_params(params: Tensors, vec: Tensors, *, requires_grad: bool) -> tuple[Tensor, ...]:
    """Inside a dual level: every parameter that requires grad as a dual tensor with tangent ``vec``
    (a leaf of its own that requires grad if ``requires_grad``); the others as constants."""
    return tuple(
        fwAD.make_dual(p.detach().requires_grad_(requires_grad), v) if p.requires_grad else p.detach()
        for p, v in zip(params, vec, strict=True)
    )


def forward_over_reverse(
    loss_fn: ParamFunction, params: Tensors, vec: Tensors
) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...]]:
    r"""``(L, grad L, H v)``: one forward pass with tangents, then one backward (without ``create_graph``)
    whose every step also carries its tangent; :math:`Hv` is the tangent of :math:`\nabla_\theta L` along
    :math:`v`, and the loss and gradient at :math:`\theta` come with it as the pass's values."""
    with torch.enable_grad(), fwAD.dual_level(), forward_mode_errors():
        duals = _dual_params(params, vec, requires_grad=True)
        loss = loss_fn(duals)
        grads = vjp([loss], duals, [None], retain_graph=False)
        return _primal(loss), tuple(_primal(g) for g in grads), tuple(_tangent(g) for g in grads)


def forward_jvp(outputs_fn: ParamFunction, params: Tensors, vec: Tensors, *, lean: bool = False) -> Tensor:
    r""":math:`Jv`, the tangent of the outputs along :math:`v`, by one forward pass with tangents and
    no autograd graph (nothing is saved for a backward); with ``lean``, linear layers write both terms
    of their tangents into one buffer (:class:`~optim._tangent_products.LeanLinearTangents`)."""
    with torch.no_grad(), fwAD.dual_level(), forward_mode_errors(), LeanLinearTangents() if lean else nullcontext():
        return _tangent(outputs_fn(_dual_params(params, vec, requires_grad=False)))
