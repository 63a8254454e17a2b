"""Naive, materialising attention: the test oracle, never used on a hot path.

Every function here builds the full ``N x M`` score matrix and differentiates through it with
PyTorch autograd, so its outputs are correct by construction (in the dtype it is run in; tests
run it in float64). Shapes follow :func:`torch.nn.functional.scaled_dot_product_attention`:
``q`` is ``(batch, heads, N, d)``, ``k`` and ``v`` are ``(batch, kv_heads, M, d)`` with
``heads % kv_heads == 0`` (grouped-query attention). ``key_mask`` is an optional boolean
``(batch, M)`` key-padding mask (True = keep); a query that sees no key at all (all its keys
masked) gets a zero output row and zero gradients, never NaN.
"""

from __future__ import annotations

import math

import torch
from einops import repeat


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat each kv head ``heads // kv_heads`` times so it lines up with the query heads."""
    return repeat(x, "b h m d -> b (h g) m d", g=heads // x.shape[1])


def causal_mask(n: int, m: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean ``(n, m)`` mask, True where query ``i`` may see key ``j`` (``j <= i``, top-left aligned)."""
    rows = torch.arange(n, device=device)[:, None]
    cols = torch.arange(m, device=device)[None, :]
    return cols <= rows


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Softmax attention :math:`O = \mathrm{softmax}(\tau Q K^\top + \text{mask}) V`, materialised.

    Rows with no visible key are defined as zero: their scores are replaced by zeros (a finite,
    uniform softmax) and the softmax is multiplied by 0, so every derivative of them is 0, not NaN.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    scores = scale * q @ k.transpose(-1, -2)
    keep = visible(q.shape[0], q.shape[2], k.shape[2], causal=causal, key_mask=key_mask, device=q.device)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if key_mask is None:  # no row is empty: a causal query sees key 0
        return torch.softmax(scores, dim=-1) @ v
    any_key = keep.any(-1, keepdim=True)
    return (torch.softmax(scores.masked_fill(~any_key, 0.0), dim=-1) * any_key) @ v


def visible(batch, n, m, *, causal=False, key_mask=None, device=None) -> torch.Tensor | None:
    """Boolean mask broadcastable to ``(batch, heads, n, m)``, True where query ``i`` sees key ``j``;
    None when nothing is masked."""
    keep = None
    if causal:
        keep = causal_mask(n, m, device)[None, None]
    if key_mask is not None:
        keys = key_mask.to(device=device, dtype=torch.bool).expand(batch, m)[:, None, None, :]
        keep = keys if keep is None else keep & keys
    return keep


def attention_backward(q, k, v, do, *, causal=False, scale=None, create_graph=False, key_mask=None):
    """The first backward ``(dQ, dK, dV)`` of :func:`attention` for output cotangent ``do``."""
    with torch.enable_grad():
        inputs = [t if t.requires_grad else t.detach().requires_grad_() for t in (q, k, v)]
        out = attention(*inputs, causal=causal, scale=scale, key_mask=key_mask)
        return torch.autograd.grad(out, inputs, do, create_graph=create_graph)


def backward_over_backward(
    q, k, v, do, dq_bar=None, dk_bar=None, dv_bar=None, *, causal=False, scale=None, key_mask=None
):
    """The BoB outputs ``(Q_bar, K_bar, V_bar, dO_bar)``: the vector-Jacobian product of the map
    ``(Q, K, V, dO) -> (dQ, dK, dV)`` with cotangents ``(dq_bar, dk_bar, dv_bar)`` (None = zero)."""
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (q, k, v, do)]
        grads = attention_backward(*inputs, causal=causal, scale=scale, create_graph=True, key_mask=key_mask)
        pairs = [(g, c) for g, c in zip(grads, (dq_bar, dk_bar, dv_bar)) if c is not None]
        if not pairs:
            return tuple(torch.zeros_like(t) for t in inputs)
        outs, cots = zip(*pairs)
        result = torch.autograd.grad(outs, inputs, cots, allow_unused=True)
    return tuple(torch.zeros_like(t) if r is None else r for r, t in zip(result, inputs))
