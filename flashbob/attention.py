"""Public entry point :func:`attention`: input checks and backend dispatch."""

from __future__ import annotations

import functools
import math
import numbers
import os
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from flashbob import blocked
from flashbob.autograd import Attention

BackendName = Literal["auto", "triton", "blocked"]
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: CUDA's limit on a grid's second dimension, which the Triton kernels index by ``batch * heads``.
MAX_GRID_Y = 65535


@dataclass(frozen=True)
class Backend:
    """The passes one implementation provides (signatures as in :mod:`flashbob.blocked`): forward,
    backward, backward-over-backward, and the tangents of the forward and of the backward (forward mode)."""

    name: str
    forward: Callable
    backward: Callable
    bob: Callable
    forward_jvp: Callable
    backward_jvp: Callable


def _triton_backend(allow_tf32: bool) -> Backend:
    from flashbob import kernels  # imports triton; only when the Triton backend is used

    bind = functools.partial(functools.partial, allow_tf32=allow_tf32)
    return Backend(
        "triton",
        *(bind(f) for f in (kernels.forward, kernels.backward, kernels.bob, kernels.forward_jvp, kernels.backward_jvp)),
    )


BLOCKED = Backend("blocked", blocked.forward, blocked.backward, blocked.bob, blocked.forward_jvp, blocked.backward_jvp)


def select_backend(q: torch.Tensor, backend: BackendName) -> Backend:
    """``auto``: Triton kernels for CUDA tensors, the blocked PyTorch code for everything else.

    ``triton`` on CPU tensors runs the kernels in Triton's interpreter, which needs
    ``TRITON_INTERPRET=1`` in the environment before ``triton`` is first imported.
    For float32 inputs the kernels use TF32 matrix products only if
    ``torch.get_float32_matmul_precision()`` is not ``"highest"`` (PyTorch's default is full precision).
    float64 CUDA tensors take the blocked backend under ``auto``: Triton 3.6 fails to compile the
    kernels' float64 matrix products for Hopper (seen on an H200), so ``triton`` refuses them.
    """
    if backend not in ("auto", "triton", "blocked"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'blocked', got {backend!r}")
    if backend == "blocked" or (backend == "auto" and (not q.is_cuda or q.dtype == torch.float64)):
        return BLOCKED
    if q.is_cuda and q.dtype == torch.float64:
        raise ValueError("backend='triton' does not take float64 CUDA tensors; use backend='blocked' (or 'auto')")
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got device {q.device}), or TRITON_INTERPRET=1 set "
            "before triton is imported to run the kernels in Triton's interpreter"
        )
    return _triton_backend(allow_tf32=torch.get_float32_matmul_precision() != "highest")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a ValueError/TypeError naming the offending argument for anything malformed."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, heads, seq, head_dim), got shape {tuple(x.shape)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
        if x.shape[2] == 0:
            raise ValueError(f"{name} has sequence length 0; flashbob.attention needs at least 1")
        if x.shape[1] == 0:
            raise ValueError(f"{name} has 0 heads; flashbob.attention needs at least 1")
        if x.shape[3] == 0:
            raise ValueError(f"{name} has head_dim 0; flashbob.attention needs at least 1")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}.dtype ({x.dtype}) must match q.dtype ({q.dtype})")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; all inputs must be on one device")
        if x.shape[0] != q.shape[0]:
            raise ValueError(f"{name} has batch size {x.shape[0]} but q has {q.shape[0]}")
        if x.shape[3] != q.shape[3]:
            raise ValueError(f"{name} has head_dim {x.shape[3]} but q has {q.shape[3]}")
    if v.shape[1:3] != k.shape[1:3]:
        raise ValueError(f"v must have k's heads and length {tuple(k.shape[1:3])}, got {tuple(v.shape[1:3])}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"q's {q.shape[1]} heads must be a multiple of k's and v's {k.shape[1]} heads (grouped-query attention)"
        )


def check_options(causal: bool, scale: float | None) -> None:
    """Raise a TypeError/ValueError for a ``causal`` that is not a bool or a ``scale`` that is not a finite number.

    A non-bool ``causal`` (say the string ``"no"``, or a mask tensor) would otherwise be read as its
    truth value. ``scale`` must be a plain number: gradients with respect to it are not computed, so a
    tensor that requires grad would silently lose them. Zero and negative scales are valid (uniform
    and reversed attention) and are computed exactly.
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r:.40}")
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__} {scale!r:.40}")
    try:
        finite = math.isfinite(scale)
    except OverflowError:  # an int (or Fraction) beyond float's range, e.g. 10**400
        too_large = f"a value too large for a float ({type(scale).__name__})"
        raise ValueError(f"scale must be a finite number, got {too_large}") from None
    if not finite:
        raise ValueError(f"scale must be a finite number, got {scale}")


def check_key_mask(key_mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """Validate a key-padding mask and return it as a contiguous ``(batch, M)`` bool tensor (or None).

    Accepted: a bool tensor broadcastable to ``(batch, M)`` (True = the key takes part).
    """
    if key_mask is None:
        return None
    if not isinstance(key_mask, torch.Tensor):
        raise TypeError(f"key_mask must be a bool torch.Tensor or None, got {type(key_mask).__name__}")
    if key_mask.dtype != torch.bool:
        raise TypeError(f"key_mask must be a bool tensor (True = keep the key), got {key_mask.dtype}")
    batch, m = q.shape[0], k.shape[2]
    try:
        fits = key_mask.dim() <= 2 and torch.broadcast_shapes(key_mask.shape, (batch, m)) == (batch, m)
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"key_mask must broadcast to (batch, M) = {(batch, m)}, got shape {tuple(key_mask.shape)}")
    if key_mask.device != q.device:
        raise ValueError(f"key_mask is on {key_mask.device} but q is on {q.device}")
    return key_mask.expand(batch, m).contiguous()


def check_triton_limits(q: torch.Tensor, k: torch.Tensor) -> None:
    """Raise a ValueError for shapes the Triton kernels cannot launch, naming the blocked backend as a way out."""
    from flashbob.kernels.common import MAX_HEAD_DIM

    if q.shape[3] > MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim {q.shape[3]} is larger than the Triton kernels' {MAX_HEAD_DIM}; use backend='blocked'"
        )
    for name, x in (("q", q), ("k", k)):
        if x.shape[0] * x.shape[1] > MAX_GRID_Y:
            raise ValueError(
                f"{name}'s batch * heads = {x.shape[0] * x.shape[1]} is more than the {MAX_GRID_Y} programs the "
                "Triton kernels can launch along one grid axis; split the batch into chunks, or use backend='blocked'"
            )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    backend: BackendName = "auto",
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Softmax attention that can be differentiated twice, exactly and without an ``N x M`` tensor.

    .. math:: O = \mathrm{softmax}(\tau\, Q K^\top + \text{mask})\, V, \qquad \tau = d^{-1/2} \text{ by default}

    Args:
        q: queries ``(batch, heads, N, head_dim)``.
        k: keys ``(batch, kv_heads, M, head_dim)``; ``heads`` must be a multiple of ``kv_heads``
            (grouped-query attention: query head ``h`` reads kv head ``h // (heads // kv_heads)``).
        v: values, shaped like ``k``.
        causal: query ``i`` sees key ``j`` iff ``j <= i`` (top-left aligned, as SDPA's ``is_causal``).
        scale: softmax scale :math:`\tau`, a finite number (zero and negative are allowed); ``None``
            means ``1 / sqrt(head_dim)``.
        backend: ``"auto"`` (Triton kernels on CUDA, blocked PyTorch elsewhere), ``"triton"`` or ``"blocked"``.
        key_mask: optional bool key-padding mask broadcastable to ``(batch, M)``, True where a key takes
            part (combines with ``causal``). Masked keys get zero ``dK``, ``dV``; a query that sees no
            key at all gets a zero output row and zero gradients (never NaN).

    Returns:
        ``O``, shaped and typed like ``q``. Its backward, taken with ``create_graph=True``, is
        differentiable again through the closed-form backward-over-backward.

    Raises:
        TypeError, ValueError: malformed inputs or options, with a message naming the argument
            (``docs/reliability.md`` lists every case). NaN and Inf in the inputs are not checked
            (that would cost a device synchronisation): they propagate to the outputs.

    Example:
        >>> q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
        >>> (dq,) = torch.autograd.grad(attention(q, k, v).square().sum(), q, create_graph=True)
        >>> hvp = torch.autograd.grad(dq.sum(), (q, k, v))   # second derivative, exact
    """
    check_inputs(q, k, v)
    check_options(causal, scale)
    key_mask = check_key_mask(key_mask, q, k)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    chosen = select_backend(q, backend)
    if chosen.name == "triton":
        check_triton_limits(q, k)
    o, _stats = Attention.apply(q, k, v, key_mask, causal, float(scale), chosen)
    return o
