r"""Forward-mode rules for linear layers that write both terms of a tangent into one buffer (opt-in).

The tangent of :math:`y = a B` (``a @ b`` with a matrix ``b``, and ``F.linear`` with
:math:`B = W^\top`) is :math:`\dot y = \dot a B + a \dot B`. PyTorch's forward-mode rule for the
matrix product forms both terms as tensors of their own and adds them, with a zero tensor standing
in for a missing tangent: at the output of a language model's head, whose logits are the largest
tensor of the model, a Jacobian-vector product then holds the logits four times at once (the
value, two terms and their sum). :class:`LeanLinearTangents` computes :math:`\dot a B` (or
:math:`a \dot B` alone when only one operand has a tangent) and accumulates the other term into it
in place (``addmm_``), so a product holds the value and one tangent: half as much. The arithmetic
is the same two matrix products and one sum.

Only what :class:`optim.operators.GGNOperator`'s forward-mode :math:`J v` runs with
``lean_tangents=True``, without an autograd graph, goes through these rules; with gradients enabled
(forward over reverse), where the backward needs the tangents of saved tensors, PyTorch's own rules
apply. Being a ``TorchFunctionMode``, it sees every torch call of the forward, which costs a few
microseconds each: hence opt-in.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from optim import _compat

_MATMULS = {torch.matmul, Tensor.matmul, Tensor.__matmul__}


def _plain(x: object) -> bool:
    """Whether ``x`` is no tensor, or one whose type leaves ``__torch_function__`` to PyTorch: a subclass that overrides
    it (say to compute ``F.linear`` its own way) must see every product of the tangent, which ``addmm_`` would skip."""
    return not isinstance(x, Tensor) or _compat.torch_function_is_default(x)


def _split(x: object) -> tuple[object, Tensor | None]:
    """``(primal, tangent)`` of a tensor at the current dual level; anything else as it is, without tangent."""
    if not isinstance(x, Tensor):
        return x, None
    primal, tangent = fwAD.unpack_dual(x)
    return primal, tangent


def _product_tangent(first: Tensor | None, a: Tensor, b_tangent: Tensor | None, product) -> Tensor:
    r"""``first`` (:math:`\dot a B`, or None) plus :math:`a \dot B` written into it; ``product(a, b)`` is the
    layer's own product (``a @ b`` or ``F.linear(a, b)``), which gives the dtype that autocast picks."""
    if b_tangent is None:
        return first
    if first is None:
        return product(a, b_tangent)
    if first.numel() == 0 or a.shape[-1] == 0:  # an empty result, or an empty sum: a dB is nothing or zero
        return first
    first = first.contiguous()
    rows = first.view(-1, first.shape[-1])
    right = b_tangent if product is torch.matmul else b_tangent.t()
    return rows.addmm_(a.reshape(-1, a.shape[-1]).to(first.dtype), right.to(first.dtype)).view(first.shape)


def _linear(a: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    r""":math:`a W^\top + b` and its tangent, both terms in one buffer."""
    (a, a_dot), (weight, weight_dot), (bias, bias_dot) = _split(a), _split(weight), _split(bias)
    value = F.linear(a, weight, bias)
    tangent = _product_tangent(None if a_dot is None else F.linear(a_dot, weight), a, weight_dot, F.linear)
    if bias_dot is not None:
        tangent = bias_dot.to(value.dtype).expand(value.shape).clone() if tangent is None else tangent.add_(bias_dot)
    return value if tangent is None else fwAD.make_dual(value, tangent)


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    r""":math:`a B` for a matrix :math:`B` and its tangent, both terms in one buffer."""
    (a, a_dot), (b, b_dot) = _split(a), _split(b)
    value = torch.matmul(a, b)
    tangent = _product_tangent(None if a_dot is None else torch.matmul(a_dot, b), a, b_dot, torch.matmul)
    return value if tangent is None else fwAD.make_dual(value, tangent)


class LeanLinearTangents(TorchFunctionMode):
    """Inside a dual level without gradients: ``F.linear`` and ``a @ b`` (``b`` a matrix, ``a`` at least a
    matrix) take their tangents by :func:`_linear` and :func:`_matmul`; everything else as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_grad_enabled() and (func is F.linear or func in _MATMULS) and _lean_applies(args, kwargs):
            if func is F.linear and len(args) >= 2 and all(isinstance(x, Tensor) for x in args[:2]):
                if args[1].dim() == 2 and set(kwargs) <= {"bias"}:
                    return _linear(*args, **kwargs)
            if func in _MATMULS and not kwargs and len(args) == 2 and all(isinstance(x, Tensor) for x in args):
                if args[1].dim() == 2 and args[0].dim() >= 2:
                    return _matmul(*args)
        return func(*args, **kwargs)


def _lean_applies(args: tuple, kwargs: dict) -> bool:
    """Whether the lean rules may run: outside torch.func transforms (under ``vmap`` over tangents one operand may
    be batched and the buffer not, which an in-place sum cannot hold) and on operands that leave their products to
    PyTorch (:func:`_plain`). Elsewhere PyTorch's rules apply."""
    return not _compat.inside_functorch_transform() and all(_plain(x) for x in (*args, *kwargs.values()))
