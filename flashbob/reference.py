"""Naive, materialising attention: the test oracle, and :func:`flashbob.sdpa`'s exact fallback.

Every function here builds the full ``N x M`` score matrix and differentiates through it with
PyTorch autograd, so its outputs are correct by construction (in the dtype it is run in; tests
run it in float64). Shapes follow :func:`torch.nn.functional.scaled_dot_product_attention`:
``q`` is ``(..., heads, N, d)``, ``k`` and ``v`` are ``(..., kv_heads, M, d)`` with
``heads % kv_heads == 0`` (grouped-query attention). ``key_mask`` is an optional boolean
``(batch, M)`` key-padding mask (True = keep) of 4-d inputs, ``attn_mask`` SDPA's mask (bool:
True = attend; float: added to the scores); a query that sees no key at all (all its keys hidden by
a boolean mask) gets a zero output row and zero gradients, never NaN.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import repeat


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat each kv head (dimension -3) ``heads // kv_heads`` times so it lines up with the query heads."""
    if x.dim() < 3 or x.shape[-3] == heads or heads == 1:  # one query head broadcasts over the kv heads
        return x
    return repeat(x, "... h m d -> ... (h g) m d", g=heads // x.shape[-3])


def causal_mask(n: int, m: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean ``(n, m)`` mask, True where query ``i`` may see key ``j`` (``j <= i``, top-left aligned)."""
    rows = torch.arange(n, device=device)[:, None]
    cols = torch.arange(m, device=device)[None, :]
    return cols <= rows


def attention(q, k, v, *, causal=False, scale=None, key_mask=None, attn_mask=None, dropout_p=0.0) -> torch.Tensor:
    r"""Softmax attention :math:`O = \mathrm{softmax}(\tau Q K^\top + \text{mask}) V`, materialised.

    Args:
        q, k, v: ``(..., heads, N, d)`` queries, ``(..., kv_heads, M, d)`` keys and ``(..., kv_heads, M, d_v)``
            values; the kv heads are repeated to the query heads' number (grouped-query attention).
        causal: query ``i`` sees key ``j`` iff ``j <= i`` (top-left aligned).
        scale: :math:`\tau`; None means ``1 / sqrt(d)``.
        key_mask: optional bool ``(batch, M)`` key-padding mask of 4-d inputs, True = keep the key.
        attn_mask: optional mask broadcastable to the scores ``(..., heads, N, M)``, as SDPA's: bool
            (True = attend) or float (added to the scores).
        dropout_p: dropout probability on the attention weights (as SDPA's ``dropout_p``).

    Rows with no visible key are defined as zero: their scores are replaced by zeros (a finite,
    uniform softmax) and the softmax is multiplied by 0, so every derivative of them is 0, not NaN.
    """
    weights = probabilities(q, k, causal=causal, scale=scale, key_mask=key_mask, attn_mask=attn_mask)
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ expand_kv(v, _heads(q))


def probabilities(q, k, *, causal=False, scale=None, key_mask=None, attn_mask=None) -> torch.Tensor:
    """The attention weights ``P = softmax_row(S)`` over the visible keys (:func:`masked_scores`); a row
    that sees no key is 0. A float ``attn_mask`` hides a key with ``-inf``, so a row whose every score
    is ``-inf`` sees none too (a NaN score still reaches the output)."""
    scores, keep = masked_scores(q, k, causal=causal, scale=scale, key_mask=key_mask, attn_mask=attn_mask)
    if key_mask is None and attn_mask is None:
        return torch.softmax(scores, dim=-1)  # no row is empty: a causal query sees key 0
    any_key = (scores != float("-inf")).any(-1, keepdim=True)
    return torch.softmax(scores.masked_fill(~any_key, 0.0), dim=-1) * any_key


def log_sum_exp(q, k, *, causal=False, scale=None, key_mask=None) -> torch.Tensor:
    r"""The softmax statistic :math:`\mathrm{lse}_i = \log \sum_j e^{S_{ij}}` over the keys query ``i``
    sees, ``(..., heads, N)``; ``-inf`` for a row that sees no key (where the backends store ``+inf``)."""
    return torch.logsumexp(masked_scores(q, k, causal=causal, scale=scale, key_mask=key_mask)[0], dim=-1)


def masked_scores(q, k, *, causal=False, scale=None, key_mask=None, attn_mask=None):
    """The scores ``S = τ Q Kᵀ`` (plus a float ``attn_mask``), ``-inf`` where a key is hidden, and the
    boolean mask of the visible keys (:func:`visible`; None when nothing is hidden)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0  # d = 0: every score is 0 whatever the scale
    scores = scale * q @ expand_kv(k, _heads(q)).transpose(-1, -2)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        scores = (scores + attn_mask).to(scores.dtype)
    keep = visible(q, k, causal=causal, key_mask=key_mask, attn_mask=attn_mask)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores, keep


def visible(q, k, *, causal=False, key_mask=None, attn_mask=None) -> torch.Tensor | None:
    """Boolean mask broadcastable to the scores, True where query ``i`` sees key ``j``: the causal mask,
    ``key_mask`` and a bool ``attn_mask`` combined (a float one hides nothing here); None when nothing is masked."""
    n, m = q.shape[-2], k.shape[-2]
    keep = causal_mask(n, m, q.device) if causal else None
    if key_mask is not None:
        keys = key_mask.to(device=q.device, dtype=torch.bool).expand(q.shape[0], m)[:, None, None, :]
        keep = keys if keep is None else keep & keys
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = attn_mask if keep is None else keep & attn_mask
    return keep


def _heads(q: torch.Tensor) -> int:
    """The number of query heads (dimension -3; 1 for ``(L, E)`` inputs)."""
    return q.shape[-3] if q.dim() > 2 else 1


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
