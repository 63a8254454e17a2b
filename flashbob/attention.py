"""Public entry point :func:`attention`: input checks (the rules are in :mod:`flashbob.inputs`) and backend
dispatch."""

from __future__ import annotations

import functools
import math
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from flashbob import operators
from flashbob.autograd import Attention, apply
from flashbob.inputs import BackendName, check_backend, check_inputs, check_key_mask, check_options
from flashbob.masks import block_tiles, check_document_ids, check_window


@dataclass(frozen=True)
class Backend:
    """The passes one implementation provides, as its operators (:mod:`flashbob.operators`, called as the functions
    of :mod:`flashbob.blocked`): forward, backward, backward-over-backward, and the tangents of the forward and of
    the backward (forward mode)."""

    name: str
    forward: Callable
    backward: Callable
    bob: Callable
    forward_jvp: Callable
    backward_jvp: Callable


BLOCKED = Backend("blocked", *(operators.with_window(operators.BLOCKED[name]) for name in operators.PASSES))
#: The kernels' operators with ``allow_tf32`` bound, by its value; none where the kernels cannot run.
TRITON = {
    allow_tf32: Backend("triton", *(functools.partial(operators.with_window(operators.KERNELS[name]),
                                                      allow_tf32=allow_tf32) for name in operators.PASSES))
    for allow_tf32 in ((False, True) if operators.KERNELS else ())
}


def select_backend(q: torch.Tensor, backend: BackendName) -> Backend:
    """``auto``: Triton kernels for CUDA tensors, the blocked PyTorch code for everything else.

    ``triton`` on CPU tensors runs the kernels in Triton's interpreter, which needs
    ``TRITON_INTERPRET=1`` in the environment before ``triton`` is first imported.
    For float32 inputs the kernels use TF32 matrix products only if
    ``torch.get_float32_matmul_precision()`` is not ``"highest"`` (PyTorch's default is full precision), read as
    the cuBLAS switch it sets, ``torch.backends.cuda.matmul.allow_tf32`` (which torch.compile can read).
    float64 CUDA tensors take the blocked backend under ``auto``: Triton 3.6 fails to compile the
    kernels' float64 matrix products for Hopper (seen on an H200), so ``triton`` refuses them.
    """
    check_backend(backend)
    if backend == "blocked" or (backend == "auto" and (not q.is_cuda or q.dtype == torch.float64)):
        return BLOCKED
    if q.is_cuda and q.dtype == torch.float64:
        raise ValueError("backend='triton' does not take float64 CUDA tensors; use backend='blocked' (or 'auto')")
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got device {q.device}), or TRITON_INTERPRET=1 set "
            "before triton is imported to run the kernels in Triton's interpreter"
        )
    if not q.is_cuda and q.dtype == torch.bfloat16:
        raise ValueError(
            "backend='triton' on CPU tensors (Triton's interpreter) does not take bfloat16: the interpreter computes "
            "tl.dot on bfloat16 operands wrongly (seen with Triton 3.9); use float16, float32 or float64 there, "
            "backend='blocked', or a GPU"
        )
    return TRITON[torch.backends.cuda.matmul.allow_tf32]


def _per_head_block_mask_backend(backend: BackendName) -> Backend:
    """The backend of a call with a block mask that differs between heads: the blocked one (the kernels take one
    block mask for all heads), with a warning, once, where ``auto`` chose the kernels; an error where ``triton``
    was asked for."""
    if backend == "triton":
        raise ValueError("backend='triton' takes a block_mask that is the same for every head (built with H=None); "
                         "use backend='auto' or 'blocked' for one per head")
    from flashbob.dropin import FallbackWarning

    warnings.warn("flashbob.attention: the Triton kernels take a block_mask that is the same for every head; running "
                  "this per-head one on the blocked backend (exact, memory linear in the sequence length, slower)",
                  FallbackWarning, stacklevel=3)
    return BLOCKED


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    document_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    key_mask: torch.Tensor | None = None,
    block_mask=None,
    backend: BackendName = "auto",
) -> torch.Tensor:
    r"""Softmax attention that can be differentiated twice, exactly and without an ``N x M`` tensor.

    .. math:: O = \mathrm{softmax}(\tau\, Q K^\top + \text{mask})\, V, \qquad \tau = d^{-1/2} \text{ by default}

    Args:
        q: queries ``(batch, heads, N, head_dim)``.
        k: keys ``(batch, kv_heads, M, head_dim)``; ``heads`` must be a multiple of ``kv_heads``
            (grouped-query attention: query head ``h`` reads kv head ``h // (heads // kv_heads)``).
        v: values, shaped like ``k``.
        causal: query ``i`` sees key ``j`` iff ``j <= i`` (top-left aligned, as SDPA's ``is_causal``).
        window: ``(left, right)``: query ``i`` sees key ``j`` iff ``i - left <= j <= i + right`` (top-left aligned),
            each bound an int >= 0 or None (unbounded); ``(4095, 0)`` is a causal sliding window of 4096 keys.
        document_ids: packed sequences: an integer ``(batch, N)`` tensor for self-attention, or a pair
            ``(q_ids (batch, N), k_ids (batch, M))``; query ``i`` sees key ``j`` only where the ids are equal.
        scale: softmax scale :math:`\tau`, a finite number (zero and negative are allowed); ``None``
            means ``1 / sqrt(head_dim)``.
        backend: ``"auto"`` (Triton kernels on CUDA, blocked PyTorch elsewhere), ``"triton"`` or ``"blocked"``.
        key_mask: optional bool key-padding mask broadcastable to ``(batch, M)``, True where a key takes
            part. Masked keys get zero ``dK``, ``dV``.
        block_mask: a ``torch.nn.attention.flex_attention.BlockMask`` (``create_block_mask``) built for ``N``
            queries and ``M`` keys; the result equals ``flex_attention(q, k, v, block_mask=block_mask)``. Its
            tiles are held with the element-wise mask of the partial ones only. A block mask that differs between
            heads runs on the blocked backend (the kernels take one for all heads).

        The masks combine by AND (:mod:`flashbob.masks`). A query that sees no key at all gets a zero output row
        and zero gradients (never NaN). The passes skip the blocks that no query of a block sees, so the cost
        follows the visible area, and memory stays linear in the sequence length.

    Returns:
        ``O``, shaped and typed like ``q``. Its backward, taken with ``create_graph=True``, is
        differentiable again through the closed-form backward-over-backward. Under torch.compile the call is
        one operator of the graph (:mod:`flashbob.operators`), differentiable once as compiled graphs are.

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
    window = check_window(window)
    q_ids, k_ids = check_document_ids(document_ids, q, k)
    key_mask = check_key_mask(key_mask, q, k)
    tile_state, tile_bits = (None, None) if block_mask is None else block_tiles(block_mask, q, k)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    chosen = select_backend(q, backend)
    if tile_state is not None and tile_state.shape[1] > 1 and chosen.name == "triton":
        chosen = _per_head_block_mask_backend(backend)
    if torch.compiler.is_compiling():  # traced by torch.compile: its operator, differentiable once
        o, _stats = chosen.forward(q, k, v, key_mask=key_mask, q_ids=q_ids, k_ids=k_ids, tile_state=tile_state,
                                   tile_bits=tile_bits, causal=causal, window=window, scale=float(scale))
    else:
        o, _stats = apply(Attention, q, k, v, key_mask, q_ids, k_ids, tile_state, tile_bits, causal, window,
                          float(scale), chosen)
    return o
