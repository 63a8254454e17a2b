"""Naive, materialising attention: the test oracle, never used on a hot path.

Every function here builds the full ``N x M`` score matrix and differentiates through it with
PyTorch autograd, so its outputs are correct by construction (in the dtype it is run in; tests
run it in float64). Shapes follow :func:`torch.nn.functional.scaled_dot_product_attention`:
``q`` is ``(batch, heads, N, d)``, ``k`` and ``v`` are ``(batch, kv_heads, M, d)`` with
``heads % kv_heads == 0`` (grouped-query attention).
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
) -> torch.Tensor:
    r"""Softmax attention :math:`O = \mathrm{softmax}(\tau Q K^\top + \text{mask}) V`, materialised."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    scores = scale * q @ k.transpose(-1, -2)
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def attention_backward(q, k, v, do, *, causal=False, scale=None, create_graph=False):
    """The first backward ``(dQ, dK, dV)`` of :func:`attention` for output cotangent ``do``."""
    with torch.enable_grad():
        inputs = [t if t.requires_grad else t.detach().requires_grad_() for t in (q, k, v)]
        out = attention(*inputs, causal=causal, scale=scale)
        return torch.autograd.grad(out, inputs, do, create_graph=create_graph)


def backward_over_backward(q, k, v, do, dq_bar=None, dk_bar=None, dv_bar=None, *, causal=False, scale=None):
    """The BoB outputs ``(Q_bar, K_bar, V_bar, dO_bar)``: the vector-Jacobian product of the map
    ``(Q, K, V, dO) -> (dQ, dK, dV)`` with cotangents ``(dq_bar, dk_bar, dv_bar)`` (None = zero)."""
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (q, k, v, do)]
        grads = attention_backward(*inputs, causal=causal, scale=scale, create_graph=True)
        pairs = [(g, c) for g, c in zip(grads, (dq_bar, dk_bar, dv_bar)) if c is not None]
        if not pairs:
            return tuple(torch.zeros_like(t) for t in inputs)
        outs, cots = zip(*pairs)
        result = torch.autograd.grad(outs, inputs, cots, allow_unused=True)
    return tuple(torch.zeros_like(t) if r is None else r for r, t in zip(result, inputs))
