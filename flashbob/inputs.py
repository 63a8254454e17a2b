"""The rules for flashbob's inputs, in one place: what :func:`flashbob.attention`, :func:`flashbob.sdpa` and
the Triton kernels accept, and the dtype every computation accumulates in.

This module imports no Triton. Every check raises a TypeError or ValueError whose message names the
argument and says what was expected (a RuntimeError for head counts in :func:`check_sdpa_arguments`, as
torch's SDPA raises); ``docs/reliability.md`` lists the cases.
"""

from __future__ import annotations

import math
import numbers
from typing import Literal, get_args

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_NAMES = [str(dtype).removeprefix("torch.") for dtype in SUPPORTED_DTYPES]
#: ``float16, bfloat16, float32 or float64``: the supported dtypes as the error messages name them.
_DTYPE_NAMES = ", ".join(_NAMES[:-1]) + " or " + _NAMES[-1]
BackendName = Literal["auto", "triton", "blocked"]
#: The largest head_dim the Triton kernels take.
MAX_HEAD_DIM = 256
#: CUDA's limit on a grid's second dimension, which the Triton kernels index by ``batch * heads``.
MAX_GRID_Y = 65535


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else float32: the dtype of ``P``, the softmax statistics, the row
    scalars and every accumulator, in both backends (the kernels' matrix-product operands stay in the
    input dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- flashbob.attention


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a ValueError/TypeError naming the offending argument unless ``q`` is ``(batch, heads, N, d)``
    and ``k``, ``v`` are ``(batch, kv_heads, M, d)``, all of one supported dtype and one device, with
    ``heads`` a multiple of ``kv_heads`` and no dimension but the batch empty.

    Each shape is read once into a tuple (every ``x.shape`` builds a ``torch.Size``): this runs at least twice
    per call of :func:`flashbob.attention` and of each of its derivatives."""
    shapes = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_is_tensor(name, x)
        shape = shapes[name] = tuple(x.shape)
        if len(shape) != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, heads, seq, head_dim), got shape {shape}")
        _check_dtype(name, x)
        if shape[2] == 0:
            raise ValueError(f"{name} has sequence length 0; flashbob.attention needs at least 1")
        if shape[1] == 0:
            raise ValueError(f"{name} has 0 heads; flashbob.attention needs at least 1")
        if shape[3] == 0:
            raise ValueError(f"{name} has head_dim 0; flashbob.attention needs at least 1")
    q_shape, k_shape, v_shape = shapes["q"], shapes["k"], shapes["v"]
    for name, x in (("k", k), ("v", v)):
        _check_like(name, x, "q", q)
        shape = shapes[name]
        if shape[0] != q_shape[0]:
            raise ValueError(f"{name} has batch size {shape[0]} but q has {q_shape[0]}")
        if shape[3] != q_shape[3]:
            raise ValueError(f"{name} has head_dim {shape[3]} but q has {q_shape[3]}")
    if v_shape[1:3] != k_shape[1:3]:
        raise ValueError(f"v must have k's heads and length {k_shape[1:3]}, got {v_shape[1:3]}")
    if not _heads_group(q_shape[1], k_shape[1]):
        raise ValueError(
            f"q's {q_shape[1]} heads must be a multiple of k's and v's {k_shape[1]} heads (grouped-query attention)"
        )


def check_options(causal: bool, scale: float | None) -> None:
    """Raise a TypeError for a ``causal`` that is not a bool (see :func:`check_bool`), and check ``scale``
    (:func:`check_scale`)."""
    check_bool("causal", causal)
    check_scale(scale)


def check_bool(name: str, value) -> None:
    """Raise a TypeError unless ``value`` is a bool: anything else (the string ``"no"``, a mask tensor)
    would be read as its truth value."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r:.40}")


def check_scale(scale: float | None) -> None:
    """Raise a TypeError/ValueError unless ``scale`` is None or a finite real number.

    ``scale`` must be a plain number: gradients with respect to it are not computed, so a tensor that
    requires grad would silently lose them. Zero and negative scales are valid (uniform and reversed
    attention) and are computed exactly.
    """
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
    _check_device("key_mask", key_mask, "q", q)
    return key_mask.expand(batch, m).contiguous()


def check_forward_tangents(o_dot: torch.Tensor | None, stats_dot: torch.Tensor | None) -> None:
    """Raise a ValueError unless the tangents of the forward's output and statistics that a backend's
    ``backward_jvp`` may take come together (both or neither)."""
    if (o_dot is None) != (stats_dot is None):
        raise ValueError("o_dot and stats_dot: pass both tangents (the forward's, from forward_jvp) or neither")


def check_backend(backend: str) -> None:
    """Raise a ValueError unless ``backend`` is one of :data:`BackendName`."""
    if backend not in get_args(BackendName):
        raise ValueError(f"backend must be 'auto', 'triton' or 'blocked', got {backend!r}")


def check_triton_limits(q: torch.Tensor, k: torch.Tensor) -> None:
    """Raise a ValueError for shapes the Triton kernels cannot launch, naming the blocked backend as a way out."""
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


# ----------------------------------------------------------------------------- flashbob.sdpa


def check_sdpa_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend) -> None:
    """Raise a TypeError/ValueError (RuntimeError for head counts, as SDPA) naming the argument for
    anything SDPA rejects or :func:`flashbob.sdpa` would misread. :func:`flashbob.sdpa` calls it before
    choosing a path, so that no ``FallbackWarning`` comes ahead of an error."""
    _check_sdpa_tensors(query, key, value, enable_gqa)
    _check_attn_mask(attn_mask, query, _scores_shape(query, key))
    _check_dropout(dropout_p)
    check_bool("is_causal", is_causal)
    check_scale(scale)
    check_backend(backend)


def _check_sdpa_tensors(query, key, value, enable_gqa) -> None:
    """Raise for query/key/value of shape ``(..., L, E)`` that SDPA rejects; the message names the argument."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        _check_is_tensor(name, x)
        if x.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., L, E), got shape {tuple(x.shape)}")
    _check_dtype("query", query)
    for name, x in (("key", key), ("value", value)):
        _check_like(name, x, "query", query)
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key has head_dim {key.shape[-1]} but query has {query.shape[-1]}")
    if value.shape[:-1] != key.shape[:-1]:
        raise ValueError(
            f"value must have key's shape {tuple(key.shape[:-1])} in all but the last dimension, "
            f"got {tuple(value.shape)}"
        )
    check_bool("enable_gqa", enable_gqa)
    heads, kv_heads = (query.shape[-3] if query.dim() > 2 else 1), (key.shape[-3] if key.dim() > 2 else 1)
    broadcast = kv_heads == 1 or (heads == 1 and not enable_gqa)  # a single head broadcasts, as in SDPA
    if heads != kv_heads and not broadcast:
        if not enable_gqa:
            raise RuntimeError(
                f"query has {heads} heads but key has {kv_heads}: pass enable_gqa=True for grouped-query attention"
            )
        if not _heads_group(heads, kv_heads):
            raise RuntimeError(f"the number of heads of key and value ({kv_heads}) must divide query's ({heads})")


def _scores_shape(query: torch.Tensor, key: torch.Tensor) -> torch.Size:
    """``(..., heads, L, S)``, the shape of the attention scores (what ``attn_mask`` must broadcast to).

    The kv heads (dimension -3 of ``key``) count as 1: grouped-query attention repeats them; against a single
    query head they broadcast.
    """
    query_heads = query.shape[-3] if query.dim() > 2 else 1
    key_lead = (*key.shape[:-3], key.shape[-3] if query_heads == 1 else 1) if key.dim() > 2 else ()
    try:
        lead = torch.broadcast_shapes(query.shape[:-2], key_lead)
    except RuntimeError:
        raise ValueError(
            f"the batch dimensions of query {tuple(query.shape)} and key {tuple(key.shape)} do not broadcast"
        ) from None
    return torch.Size((*lead, query.shape[-2], key.shape[-2]))


def _check_attn_mask(attn_mask, query: torch.Tensor, shape: torch.Size) -> None:
    """Raise for an ``attn_mask`` SDPA rejects: not a tensor, a dtype other than bool, float32 or the
    query's (an integer 0/1 mask would otherwise be added to the scores as a bias), another device,
    or a shape that does not broadcast to the scores' ``shape``."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    float_dtypes = tuple(dict.fromkeys((query.dtype, torch.float32)))  # torch 2.13's SDPA accepts these
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in float_dtypes:
        raise TypeError(
            f"attn_mask must be a bool mask (True = attend) or an additive float mask of dtype "
            f"{' or '.join(map(str, float_dtypes))}, got {attn_mask.dtype}; for a 0/1 padding mask (1 = attend, "
            "as Hugging Face's attention_mask) pass attn_mask.bool()"
        )
    _check_device("attn_mask", attn_mask, "query", query)
    try:
        fits = torch.broadcast_shapes(attn_mask.shape, shape) == shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} must broadcast to the scores' shape (..., L, S) = "
            f"{tuple(shape)}"
        )


def _check_dropout(dropout_p) -> None:
    """Raise unless ``dropout_p`` is a number in ``[0, 1]`` (NaN is not)."""
    if not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a number in [0, 1], got {type(dropout_p).__name__} {dropout_p!r:.40}")
    if not 0 <= dropout_p <= 1:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p!r:.40}")


# ----------------------------------------------------------------------------- shared pieces


def _check_is_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _check_dtype(name: str, x: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be {_DTYPE_NAMES}, got {x.dtype}")


def _check_device(name: str, x: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    if x.device != like.device:
        raise ValueError(
            f"{name} is on {x.device} but {like_name} is on {like.device}; all inputs must be on one device"
        )


def _check_like(name: str, x: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    """``x`` has the dtype and device of ``like`` (no silent promotion, no implicit copies)."""
    if x.dtype != like.dtype:
        raise TypeError(f"{name}.dtype ({x.dtype}) must match {like_name}.dtype ({like.dtype})")
    _check_device(name, x, like_name, like)


def _heads_group(heads: int, kv_heads: int) -> bool:
    """Whether ``heads`` query heads split evenly over ``kv_heads`` kv heads (grouped-query attention)."""
    return kv_heads > 0 and heads % kv_heads == 0
