"""Exact curvature-vector products: the Hessian's, :func:`hvp`, and the generalised Gauss-Newton matrix's,
:func:`ggnvp`, each by reverse or forward mode."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from optim._autodiff import (
    Mode,
    ParamFunction,
    Tensors,
    evaluate,
    forward_over_reverse,
    function_of_params,
    gradient,
    vjp,
)
from optim.hyperparameters import check_mode
from optim.loss_hessians import LossGraphHessian, LossHessian
from optim.operators import GGNOperator


def hvp(
    loss: Tensor | ParamFunction,
    params: Tensors,
    vec: Tensors,
    *,
    grads: Sequence[Tensor | None] | None = None,
    retain_graph: bool = False,
    mode: Mode = "reverse",
) -> tuple[Tensor, ...]:
    r"""Exact Hessian-vector product :math:`Hv`, :math:`H = \nabla^2_\theta L(\theta)`.

    ``mode="reverse"`` (reverse-over-reverse) differentiates the gradient once more:

    .. math:: H v = \nabla_\theta \big( \nabla_\theta L(\theta)^\top v \big),

    a backward with ``create_graph=True`` (whose graph, the size of the whole model's backward,
    is kept until the second backward has run) and a backward through that graph.

    ``mode="forward"`` (forward-over-reverse) takes the directional derivative of the gradient:

    .. math:: H v = \frac{\mathrm{d}}{\mathrm{d}\varepsilon}
              \nabla_\theta L(\theta + \varepsilon v) \Big|_{\varepsilon = 0},

    one forward pass that carries the tangent :math:`v` (``torch.autograd.forward_ad``), then one
    ordinary backward (no ``create_graph``) whose every step also carries its tangent. It needs
    ``loss`` as a function of the parameter values, since the model must run again with the
    tangents attached (:func:`optim.functional` makes one from a module and a closure), and every
    operation to have a forward-mode rule of its backward. No gradient graph is built; instead the
    forward pass keeps the tangent of every activation it saves, so which mode needs less memory
    depends on the model (docs/forward_mode.md compares them).

    Args:
        loss: The scalar loss :math:`L(\theta)`: a tensor with an autograd graph to ``params``
            (``"reverse"`` only), or a function that computes it from parameter values, called with
            one tensor per parameter in the order of ``params`` (either mode).
        params: Parameters :math:`\theta = (\theta_1, \dots, \theta_m)`. Those that do not require
            grad are constants: their rows and columns of :math:`H` are zero, so their blocks of the
            result are zero and their blocks of ``vec`` are ignored.
        vec: :math:`v`, one tensor shaped like each parameter.
        grads: :math:`\nabla_\theta L` from ``torch.autograd.grad(loss, params, create_graph=True)``
            (``None`` entries mean zero). When given, ``loss`` is not differentiated again, so one
            gradient graph serves many products; pass ``retain_graph=True`` to keep it for the next.
            ``"reverse"`` only.
        retain_graph: Keep the graphs for further differentiation, as in :func:`torch.autograd.grad`.
            By default they are freed, as by ``loss.backward()``. ``"reverse"`` only.
        mode: ``"reverse"`` (reverse-over-reverse) or ``"forward"`` (forward-over-reverse).

    Returns:
        :math:`H v`, one tensor per parameter, holding no graph.

    Raises:
        ValueError: ``mode`` is neither, or ``grads``/``retain_graph`` are given with ``"forward"``.
        TypeError: ``mode="forward"`` with ``loss`` a computed tensor.
        NotImplementedError: ``mode="forward"`` through an operation that PyTorch (or a custom
            ``autograd.Function``) gives no forward-mode rule, e.g. the backward of ``F.silu`` in torch 2.13.
    """
    check_mode(mode)
    if mode == "forward":
        if grads is not None or retain_graph:
            raise ValueError(
                "hvp(mode='forward') builds no gradient graph: grads and retain_graph are for mode='reverse'"
            )
        return forward_over_reverse(function_of_params(loss, "the loss", "hvp"), params, vec)[2]
    if grads is None:
        grads = gradient(evaluate(loss, params), params)
    return vjp(grads, params, vec, retain_graph=retain_graph)


def ggnvp(
    loss: Tensor | None,
    outputs: Tensor | ParamFunction,
    params: Tensors,
    vec: Tensors,
    loss_hessian: LossHessian | None = None,
    *,
    mode: Mode = "reverse",
    lean_tangents: bool = False,
) -> tuple[Tensor, ...]:
    r"""Generalised Gauss-Newton-vector product :math:`G v = J^\top H_L J v` (see
    :class:`~optim.operators.GGNOperator`).

    Args:
        loss: The scalar loss computed from ``outputs`` (a tensor); :math:`H_L` is its Hessian w.r.t.
            the outputs, by double backward through its graph, unless ``loss_hessian`` gives it
            (then ``loss`` may be None). Its graph is kept.
        outputs: Model outputs :math:`z(\theta)`: a tensor with an autograd graph to ``params``
            (``"reverse"`` only; the graph is kept), or a function of the parameter values (see
            :func:`optim.functional`; then ``loss_hessian`` is needed).
        params: Parameters :math:`\theta`; those that do not require grad have zero rows and columns.
        vec: :math:`v`, one tensor shaped like each parameter.
        loss_hessian: :math:`u \mapsto H_L u`, e.g. ``CrossEntropyHessian(targets)`` or ``MSEHessian()``
            in closed form (faster than autograd), or :class:`~optim.loss_hessians.AutogradLossHessian`.
        mode: ``"reverse"`` (:math:`J v` by double-vjp) or ``"forward"`` (by forward mode).
        lean_tangents: ``"forward"`` only: linear layers' tangents in one buffer
            (:class:`~optim.operators.GGNOperator`).

    Returns:
        :math:`G v`, one tensor per parameter.
    """
    check_mode(mode)
    if loss_hessian is None:
        if loss is None or not isinstance(outputs, Tensor):
            raise ValueError(
                "ggnvp needs the loss and the outputs it was computed from, or a loss_hessian such as "
                "CrossEntropyHessian(targets) or AutogradLossHessian(loss_of_outputs) (always with mode='forward')"
            )
        loss_hessian = LossGraphHessian(loss, outputs)
    return GGNOperator(outputs, params, loss_hessian, mode=mode, lean_tangents=lean_tangents).matvec(vec)

