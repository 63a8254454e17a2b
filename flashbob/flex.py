"""FlexAttention drop-ins: :func:`flex_attention` has the signature of ``torch.nn.attention.flex_attention.
flex_attention`` for block masks (mask_mod, no score_mod) and gives every derivative flashbob gives (reverse twice,
forward mode), which torch's has not; :class:`patch_flex_attention` routes torch's function through it."""

from __future__ import annotations

import torch
from torch.nn.attention import flex_attention as torch_flex

from flashbob.attention import attention
from flashbob.patching import Patch, Route


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod=None, block_mask=None,
                   scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                   kernel_options=None, *, return_aux=None, backend: str = "auto") -> torch.Tensor:
    """``torch.nn.attention.flex_attention.flex_attention(query, key, value, block_mask=..., scale=...,
    enable_gqa=...)`` through :func:`flashbob.attention` (``block_mask=``): the same output, differentiable twice
    and in forward mode. ``query`` ``(B, H, N, d)``, ``key``/``value`` ``(B, Hkv, M, d)``; ``Hkv != H`` needs
    ``enable_gqa=True``, as in torch. ``kernel_options`` (FlexAttention's Triton options) are ignored.

    Raises:
        TypeError: a ``score_mod`` (only a block mask's mask_mod is supported); ``return_lse`` or ``return_aux``.
        ValueError: query and key heads that differ without ``enable_gqa``, or a block mask for other lengths.
    """
    if score_mod is not None:
        raise TypeError("flashbob.flex_attention takes no score_mod: it supports block masks (mask_mod) only; use "
                        "torch's flex_attention for a score_mod")
    if return_lse or return_aux is not None:
        raise TypeError("flashbob.flex_attention returns the output only (return_lse and return_aux are not supported)")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("flashbob.flex_attention takes 4-d query, key and value (batch, heads, length, head_dim), "
                         f"got {query.dim()}-d, {key.dim()}-d and {value.dim()}-d")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True for "
                         "grouped-query attention (as torch's flex_attention asks)")
    return attention(query, key, value, block_mask=block_mask, scale=scale, backend=backend)


def _patched_flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                            return_lse=False, kernel_options=None, *, return_aux=None):
    """What torch's ``flex_attention`` is while a :class:`patch_flex_attention` is open in any thread: calls with
    a score_mod, or asking for the log-sum-exp, go to torch's function; the others to :func:`flex_attention`."""
    if score_mod is not None or return_lse or return_aux is not None or not _FLEX_ROUTE.stack():
        return _FLEX_ROUTE.original(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                    enable_gqa=enable_gqa, return_lse=return_lse, kernel_options=kernel_options,
                                    return_aux=return_aux)
    return _FLEX_ROUTE.call(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


_FLEX_ROUTE = Route(torch_flex, "flex_attention", flex_attention, _patched_flex_attention)


class patch_flex_attention(Patch):
    """Route ``torch.nn.attention.flex_attention.flex_attention`` through :func:`flex_attention` for the calls it
    supports (no score_mod, no log-sum-exp); the others keep torch's function.

    A context manager and a decorator, as :class:`flashbob.patch_sdpa`. Code that imported the function by name
    before patching (``from torch.nn.attention.flex_attention import flex_attention``) keeps the original. Example::

        with flashbob.patch_flex_attention():
            grads = torch.autograd.grad(model(x).sum(), params, create_graph=True)   # model calls flex_attention
    """

    route = _FLEX_ROUTE
