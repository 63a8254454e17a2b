"""Blocked pure-PyTorch FlashBoB: the backend for CPU (and any non-CUDA) tensors.

It runs the same algorithm as the Triton kernels, with panels instead of tiles: every pass
sweeps the ``N x M`` score matrix one panel at a time (a block of rows, or of columns in the
second pass of BoB and of the backward's JVP), so at most one ``block x M`` (or ``N x block``) slice
of it exists at once and memory is linear in the sequence length. Each pass's docstring gives its
formulas; the names are:

* ``S = τ Q Kᵀ``, ``P = exp(S - lse)``, ``dP = dO Vᵀ``, ``Δ = rowsum(dO ∘ O)``, ``dS = P ∘ (dP - Δ)``
* cotangents of the backward's outputs: ``Ū`` (for dQ), ``W̄`` (for dK), ``Z̄`` (for dV)
* dual scores ``Ā = τ (Ū Kᵀ + Q W̄ᵀ)`` and ``B̄ = dO Z̄ᵀ``; row scalars ``A = rowsum(P ∘ Ā)`` and
  ``C = rowsum(P ∘ (dP - Δ) ∘ Ā) + rowsum(P ∘ B̄) - A Δ``
* forward mode: tangents ``Q̇, K̇, V̇, dȮ`` of the inputs, ``Ṡ = τ (Q̇ Kᵀ + Q K̇ᵀ)``, row scalars
  ``ṙ = rowsum(P ∘ Ṡ)`` (the tangent of ``lse``) and ``Δ̇`` (of ``Δ``), ``Ṗ = P ∘ (Ṡ - ṙ)``

Grouped-query attention is handled by viewing the query heads as ``(kv_heads, group)`` and
broadcasting keys and values over the group axis; gradients of keys and values sum over it.
Arithmetic is in the accumulator dtype (float32, float64 for float64 inputs:
:func:`flashbob.inputs.accumulator_dtype`); results are cast back to the input dtype. Autocast is
turned off inside every pass (as the Triton kernels ignore it): under it, the panels' float32 matrix
products would otherwise run in the autocast dtype.

Every pass normalises ``P`` by its own row sums ``σ = rowsum(exp(S - lse))`` (1 up to the rounding
of ``lse``) instead of trusting ``exp(S - lse)`` to sum to one: when scores are large (``|S| ~ 1e4``
in float32, where ``lse`` is rounded by ~1e-3) an unnormalised ``P`` makes ``rowsum(dS)`` non-zero,
and a component shared by all keys then leaks into ``dQ`` and BoB's outputs. Row sweeps see whole
rows and compute ``σ`` themselves; column sweeps read the ``σ`` their row sweep stored.

The masks (``causal``, ``window``, document ids ``q_ids``/``k_ids``, the key-padding mask ``key_mask``, a block
mask's ``tile_state``/``tile_bits``; see :mod:`flashbob.masks`) set the scores of hidden entries to ``-inf``, and
a panel spans only the keys (or queries) that some row (or column) of it may see. A row that sees no key gets ``lse = +inf`` (so that every later
``P = exp(S - lse)`` is 0) and ``σ = 1``: its output and all its gradients are exactly zero.
"""

from __future__ import annotations

import functools

import torch
from einops import rearrange

from flashbob.inputs import accumulator_dtype, check_forward_tangents
from flashbob.masks import Mask, band

#: Largest number of score-matrix elements (summed over batch and heads) one panel may hold.
PANEL_ELEMENTS = 1 << 22


def panel_size(rows: int, row_length: int, batch_heads: int, block: int | None = None) -> int:
    """Rows per panel: ``block`` if given, else as many as fit in :data:`PANEL_ELEMENTS`."""
    if block is None:
        block = PANEL_ELEMENTS // max(1, row_length * batch_heads)
    return max(1, min(rows, block))


def _without_autocast(compute):
    """Run a pass with autocast off on its inputs' device, so that it computes in the accumulator dtype."""

    @functools.wraps(compute)
    def wrapper(q, *args, **kwargs):
        device = q.device.type
        if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                return compute(q, *args, **kwargs)
        return compute(q, *args, **kwargs)

    return wrapper


def _grouped(x: torch.Tensor | None, kv_heads: int, dtype: torch.dtype) -> torch.Tensor | None:
    """``(b, kv_heads * g, n, d) -> (b, kv_heads, g, n, d)`` in the compute dtype."""
    if x is None:
        return None
    return rearrange(x.to(dtype), "b (h g) ... -> b h g ...", h=kv_heads)


def _kv(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``(b, kv_heads, m, d) -> (b, kv_heads, 1, m, d)``: broadcast over the query group."""
    return None if x is None else x.to(dtype).unsqueeze(2)


def _ungroup(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return rearrange(x, "b h g ... -> b (h g) ...").to(like.dtype)


def _sum_group(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return x.sum(dim=2).to(like.dtype)


def _scores(q, k, rows: slice, cols: slice, scale: float, mask: Mask) -> torch.Tensor:
    """Scaled scores ``τ Q[rows] K[cols]ᵀ`` of one panel, ``-inf`` where the mask hides a key."""
    s = scale * q[..., rows, :] @ k[..., cols, :].transpose(-1, -2)
    keep = mask.visible(rows, cols, s.device)
    if keep is not None:  # (batch, heads or 1, rows, cols) -> the grouped layout of s
        keep = keep[:, :, None] if keep.shape[1] == 1 else rearrange(keep, "b (h g) ... -> b h g ...", h=s.shape[1])
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _probabilities(s: torch.Tensor, lse: torch.Tensor, sigma: torch.Tensor | None = None):
    """``P = exp(S - lse) / σ`` and ``σ``, computed from the panel (which must hold whole rows) when not given.
    Rows without a visible key have ``P = 0`` and ``σ = 1``."""
    p = torch.exp(s - lse[..., None])
    if sigma is None:
        sigma = p.sum(-1)
        sigma = torch.where(sigma == 0, torch.ones_like(sigma), sigma)  # no visible key (NaN stays NaN)
    return p / sigma[..., None], sigma


def _mask(q, k, causal: bool, window, key_mask, q_ids, k_ids, tile_state, tile_bits) -> Mask:
    """The pass's masks (:class:`flashbob.masks.Mask`), on ``q``'s device."""
    if key_mask is not None:
        key_mask = key_mask.to(device=q.device, dtype=torch.bool)
    return Mask(q.shape[2], k.shape[2], band(causal, window), key_mask, q_ids, k_ids, tile_state, tile_bits)


def _panels(length: int, size: int):
    for start in range(0, length, size):
        yield slice(start, min(start + size, length))


@_without_autocast
def forward(q, k, v, *, causal: bool, scale: float, block: int | None = None, key_mask=None, window=None, q_ids=None,
            k_ids=None, tile_state=None, tile_bits=None):
    """Attention output ``O = softmax(S) V`` and ``lse = logsumexp_row(S)``, one row panel at a time
    (``lse = +inf`` and ``O = 0`` for rows that see no key)."""
    dtype = accumulator_dtype(q.dtype)
    mask = _mask(q, k, causal, window, key_mask, q_ids, k_ids, tile_state, tile_bits)
    kv_heads, n, m = k.shape[1], q.shape[2], k.shape[2]
    qg, kg, vg = _grouped(q, kv_heads, dtype), _kv(k, dtype), _kv(v, dtype)
    o = torch.empty_like(qg)
    lse = torch.empty(qg.shape[:-1], dtype=dtype, device=q.device)
    for rows in _panels(n, panel_size(n, m, qg.shape[:3].numel(), block)):
        cols = mask.keys_seen_by(rows)
        s = _scores(qg, kg, rows, cols, scale, mask)
        panel_lse = torch.logsumexp(s, dim=-1)
        # no visible key: lse = -inf -> +inf, so that P = exp(S - lse) = 0
        panel_lse = panel_lse.masked_fill(panel_lse == float("-inf"), float("inf"))
        lse[..., rows] = panel_lse
        o[..., rows, :] = _probabilities(s, lse[..., rows])[0] @ vg[..., cols, :]
    return _ungroup(o, q), rearrange(lse, "b h g n -> b (h g) n")


@_without_autocast
def backward(q, k, v, o, lse, do, *, causal: bool, scale: float, block: int | None = None, key_mask=None, window=None,
             q_ids=None, k_ids=None, tile_state=None, tile_bits=None):
    """First backward ``(dQ, dK, dV, Δ)``: ``dV = Pᵀ dO``, ``dQ = τ dS K``, ``dK = τ dSᵀ Q``."""
    dtype = accumulator_dtype(q.dtype)
    mask = _mask(q, k, causal, window, key_mask, q_ids, k_ids, tile_state, tile_bits)
    kv_heads, n, m = k.shape[1], q.shape[2], k.shape[2]
    qg, kg, vg = _grouped(q, kv_heads, dtype), _kv(k, dtype), _kv(v, dtype)
    dog, og = _grouped(do, kv_heads, dtype), _grouped(o, kv_heads, dtype)
    lseg = _grouped(lse, kv_heads, dtype)
    delta = (dog * og).sum(-1)
    dq = torch.zeros_like(qg)
    dk = torch.zeros(qg.shape[:2] + kg.shape[2:], dtype=dtype, device=q.device)
    dv = torch.zeros_like(dk)
    for rows in _panels(n, panel_size(n, m, qg.shape[:3].numel(), block)):
        cols = mask.keys_seen_by(rows)
        p, _ = _probabilities(_scores(qg, kg, rows, cols, scale, mask), lseg[..., rows])
        dp = dog[..., rows, :] @ vg[..., cols, :].transpose(-1, -2)
        ds = p * (dp - delta[..., rows, None])
        dq[..., rows, :] = scale * ds @ kg[..., cols, :]
        dk[..., cols, :] += scale * (ds.transpose(-1, -2) @ qg[..., rows, :]).sum(2, keepdim=True)
        dv[..., cols, :] += (p.transpose(-1, -2) @ dog[..., rows, :]).sum(2, keepdim=True)
    return (
        _ungroup(dq, q),
        dk.squeeze(2).to(k.dtype),
        dv.squeeze(2).to(v.dtype),
        rearrange(delta, "b h g n -> b (h g) n"),
    )


def _dual_scores(q, k, u_bar, w_bar, rows: slice, cols: slice, scale: float):
    """``Ā = τ (Ū Kᵀ + Q W̄ᵀ)`` on one panel, or None when both cotangents are absent.

    The same bilinear form gives the tangents ``Ṡ = τ (Q̇ Kᵀ + Q K̇ᵀ)`` and ``dṖ = dȮ Vᵀ + dO V̇ᵀ``."""
    terms = []
    if u_bar is not None:
        terms.append(u_bar[..., rows, :] @ k[..., cols, :].transpose(-1, -2))
    if w_bar is not None:
        terms.append(q[..., rows, :] @ w_bar[..., cols, :].transpose(-1, -2))
    return scale * sum(terms) if terms else None


def _bob_panel(t: dict, rows: slice, cols: slice, scale: float):
    """One panel of BoB: ``P``, ``dS``, ``G_S``, ``P ∘ Ā`` (None if ``Ā`` is absent), ``A``, ``C`` and ``σ``.

    ``A``, ``C`` and the row sums ``σ`` are taken from ``t`` when present (pass 2 reads what pass 1
    stored) and computed from the panel otherwise (pass 1 sees whole rows)::

        G_dP = P ∘ (Ā - A)
        G_S  = P ∘ ((dP - Δ) ∘ Ā - A dP + B̄ - C)
    """
    sigma = t["sigma"][..., rows] if "sigma" in t else None
    scores = _scores(t["q"], t["k"], rows, cols, scale, t["mask"])
    p, sigma = _probabilities(scores, t["lse"][..., rows], sigma)
    delta = t["delta"][..., rows, None]
    dp = t["do"][..., rows, :] @ t["v"][..., cols, :].transpose(-1, -2)
    ds = p * (dp - delta)
    a_bar = _dual_scores(t["q"], t["k"], t["u_bar"], t["w_bar"], rows, cols, scale)
    b_bar = None if t["z_bar"] is None else t["do"][..., rows, :] @ t["z_bar"][..., cols, :].transpose(-1, -2)
    if "a" in t:
        a, c = t["a"][..., rows], t["c"][..., rows]
    else:
        a = torch.zeros_like(delta[..., 0]) if a_bar is None else (p * a_bar).sum(-1)
        c = -a * delta[..., 0]
        if a_bar is not None:
            c = c + (ds * a_bar).sum(-1)
        if b_bar is not None:
            c = c + (p * b_bar).sum(-1)
    inner = -c[..., None].expand_as(p)
    if a_bar is not None:
        inner = inner + (dp - delta) * a_bar - a[..., None] * dp
    if b_bar is not None:
        inner = inner + b_bar
    return p, ds, p * inner, None if a_bar is None else p * a_bar, a, c, sigma


@_without_autocast
def bob(
    q, k, v, do, o, lse, delta, dq_bar, dk_bar, dv_bar, *, causal: bool, scale: float, block: int | None = None,
    key_mask=None, window=None, q_ids=None, k_ids=None, tile_state=None, tile_bits=None,
):
    """Backward-over-backward: the cotangents ``(Q̄, K̄, V̄, dŌ)`` of ``(Q, K, V, dO)``.

    Inputs are the backward's inputs, its saved ``O``, ``lse``, ``Δ`` (constants: the formulas
    include every path through them) and the cotangents ``Ū = dq_bar``, ``W̄ = dk_bar``,
    ``Z̄ = dv_bar`` of its outputs, each possibly None (zero). Two sweeps:

    * pass 1, row panels: ``A``, ``C`` and the row outputs
      ``Q̄ = τ (G_S K + dS W̄)``, ``dŌ = (P ∘ Ā) V - A ∘ O + P Z̄``;
    * pass 2, column panels, reading ``A``, ``C``: ``K̄ = τ (G_Sᵀ Q + dSᵀ Ū)``, ``V̄ = G_dPᵀ dO``.
    """
    if dq_bar is None and dk_bar is None and dv_bar is None:
        return tuple(torch.zeros_like(x) for x in (q, k, v, do))
    dtype = accumulator_dtype(q.dtype)
    kv_heads, n, m = k.shape[1], q.shape[2], k.shape[2]
    t = {
        "q": _grouped(q, kv_heads, dtype), "do": _grouped(do, kv_heads, dtype),
        "lse": _grouped(lse, kv_heads, dtype), "delta": _grouped(delta, kv_heads, dtype),
        "u_bar": _grouped(dq_bar, kv_heads, dtype),
        "k": _kv(k, dtype), "v": _kv(v, dtype), "w_bar": _kv(dk_bar, dtype), "z_bar": _kv(dv_bar, dtype),
        "mask": _mask(q, k, causal, window, key_mask, q_ids, k_ids, tile_state, tile_bits),
    }
    mask = t["mask"]
    og = _grouped(o, kv_heads, dtype)
    q_bar, do_bar = torch.zeros_like(t["q"]), torch.zeros_like(t["do"])
    a, c, sigma = (torch.empty_like(t["delta"]) for _ in range(3))
    batch_heads = t["q"].shape[:3].numel()
    for rows in _panels(n, panel_size(n, m, batch_heads, block)):
        cols = mask.keys_seen_by(rows)
        p, ds, g_s, p_a_bar, a[..., rows], c[..., rows], sigma[..., rows] = _bob_panel(t, rows, cols, scale)
        q_bar[..., rows, :] = g_s @ t["k"][..., cols, :]
        if t["w_bar"] is not None:
            q_bar[..., rows, :] += ds @ t["w_bar"][..., cols, :]
        q_bar[..., rows, :] *= scale
        do_bar[..., rows, :] = -a[..., rows, None] * og[..., rows, :]
        if p_a_bar is not None:
            do_bar[..., rows, :] += p_a_bar @ t["v"][..., cols, :]
        if t["z_bar"] is not None:
            do_bar[..., rows, :] += p @ t["z_bar"][..., cols, :]
    t["a"], t["c"], t["sigma"] = a, c, sigma
    k_bar = torch.zeros(t["q"].shape[:2] + t["k"].shape[2:], dtype=dtype, device=q.device)
    v_bar = torch.zeros_like(k_bar)
    for cols in _panels(m, panel_size(m, n, batch_heads, block)):
        rows = mask.queries_seeing(cols)
        p, ds, g_s, p_a_bar, a_panel, _, _ = _bob_panel(t, rows, cols, scale)
        k_panel = g_s.transpose(-1, -2) @ t["q"][..., rows, :]
        if t["u_bar"] is not None:
            k_panel += ds.transpose(-1, -2) @ t["u_bar"][..., rows, :]
        k_bar[..., cols, :] = scale * k_panel.sum(2, keepdim=True)
        if p_a_bar is not None:
            g_dp = p_a_bar - a_panel[..., None] * p
            v_bar[..., cols, :] = (g_dp.transpose(-1, -2) @ t["do"][..., rows, :]).sum(2, keepdim=True)
    return _ungroup(q_bar, q), k_bar.squeeze(2).to(k.dtype), v_bar.squeeze(2).to(v.dtype), _ungroup(do_bar, do)


def _total(*terms):
    """The sum of the terms that are present; None when every term is None (an absent, zero tangent)."""
    present = [x for x in terms if x is not None]
    return sum(present[1:], present[0]) if present else None


def _matmul(a, b):
    """``a @ b``, or None when either factor is absent."""
    return None if a is None or b is None else a @ b


def _part(x, index: slice):
    """Rows ``index`` (along the sequence axis) of ``x``, or None when ``x`` is absent."""
    return None if x is None else x[..., index, :]


def _tangent_inputs(q, k, v, lse, q_dot, k_dot, v_dot, mask: Mask) -> dict:
    """The grouped compute-dtype operands shared by both JVPs (see :func:`_grouped`, :func:`_kv`)."""
    dtype, kv_heads = accumulator_dtype(q.dtype), k.shape[1]
    return {
        "q": _grouped(q, kv_heads, dtype), "q_dot": _grouped(q_dot, kv_heads, dtype),
        "lse": _grouped(lse, kv_heads, dtype),
        "k": _kv(k, dtype), "k_dot": _kv(k_dot, dtype), "v": _kv(v, dtype), "v_dot": _kv(v_dot, dtype),
        "mask": mask,
    }


def _tangent_panel(t: dict, rows: slice, cols: slice, scale: float):
    """``P``, ``σ``, ``ṙ`` and ``Ṗ = P ∘ (Ṡ - ṙ)`` (the tangent of ``P``) of one panel, with
    ``Ṡ = τ (Q̇ Kᵀ + Q K̇ᵀ)`` and ``ṙ = rowsum(P ∘ Ṡ)``; ``Ṗ`` is None (and ``ṙ = 0``) when ``Q̇`` and
    ``K̇`` are absent.

    ``σ`` and ``ṙ`` are taken from ``t`` when present (the column sweep reads what the row sweep
    stored) and computed from the panel otherwise (row sweeps see whole rows). Masked entries have
    ``P = 0``, so the value of ``Ṡ`` there does not matter.
    """
    scores = _scores(t["q"], t["k"], rows, cols, scale, t["mask"])
    p, sigma = _probabilities(scores, t["lse"][..., rows], t["sigma"][..., rows] if "sigma" in t else None)
    s_dot = _dual_scores(t["q"], t["k"], t["q_dot"], t["k_dot"], rows, cols, scale)
    if s_dot is None:
        return p, sigma, torch.zeros_like(sigma), None
    r_dot = t["r_dot"][..., rows] if "r_dot" in t else (p * s_dot).sum(-1)
    return p, sigma, r_dot, p * (s_dot - r_dot[..., None])


def _output_tangent(t: dict, p, p_dot, cols: slice):
    """``Ȯ = Ṗ V + P V̇`` on one row panel (None when both terms are absent)."""
    return _total(_matmul(p_dot, t["v"][..., cols, :]), _matmul(p, _part(t["v_dot"], cols)))


@_without_autocast
def forward_jvp(
    q, k, v, o, lse, q_dot, k_dot, v_dot, *, causal: bool, scale: float, block: int | None = None, key_mask=None,
    window=None, q_ids=None, k_ids=None, tile_state=None, tile_bits=None,
):
    """Tangent ``Ȯ`` of the attention output for tangents ``Q̇, K̇, V̇`` of ``Q, K, V`` (each possibly None = zero).

    With ``Ṡ = τ (Q̇ Kᵀ + Q K̇ᵀ)`` and ``ṙ_i = Σ_j P_ij Ṡ_ij`` (the tangent of ``lse``)::

        Ṗ = P ∘ (Ṡ - ṙ),    Ȯ = Ṗ V + P V̇  (= (P ∘ Ṡ) V - ṙ ∘ O + P V̇)

    One sweep of row panels; each panel holds whole rows, so ``ṙ`` is subtracted before the product
    with ``V`` (a component of ``Ṡ`` shared by a whole row cancels exactly) and the saved output ``o``
    is not needed here (the Triton kernels, which stream the keys, use the right-hand form).
    ``lse`` is the forward's statistics. Returns ``(Ȯ, ṙ)``, ``ṙ`` being the tangent of ``lse``; rows that
    see no key get ``Ȯ = 0`` and ``ṙ = 0``.
    """
    if q_dot is None and k_dot is None and v_dot is None:
        return torch.zeros_like(q), torch.zeros_like(lse)
    mask = _mask(q, k, causal, window, key_mask, q_ids, k_ids, tile_state, tile_bits)
    t = _tangent_inputs(q, k, v, lse, q_dot, k_dot, v_dot, mask)
    n, m = q.shape[2], k.shape[2]
    o_dot = torch.zeros_like(t["q"])
    lse_dot = torch.zeros_like(t["lse"])
    for rows in _panels(n, panel_size(n, m, t["q"].shape[:3].numel(), block)):
        cols = mask.keys_seen_by(rows)
        p, _, lse_dot[..., rows], p_dot = _tangent_panel(t, rows, cols, scale)
        o_dot[..., rows, :] = _output_tangent(t, p, p_dot, cols)
    return _ungroup(o_dot, q), rearrange(lse_dot, "b h g n -> b (h g) n").to(lse.dtype)


def _score_gradient_tangent(t: dict, rows: slice, cols: slice, p, p_dot, delta_dot):
    """``dS = P ∘ (dP - Δ)`` and its tangent ``dṠ = Ṗ ∘ (dP - Δ) + P ∘ (dṖ - Δ̇)`` on one panel,
    with ``dP = dO Vᵀ`` and ``dṖ = dȮ Vᵀ + dO V̇ᵀ``; ``delta_dot`` is ``Δ̇`` of the panel's rows."""
    do = t["do"][..., rows, :]
    dp_minus_delta = do @ t["v"][..., cols, :].transpose(-1, -2) - t["delta"][..., rows, None]
    dp_dot = _dual_scores(t["do"], t["v"], t["do_dot"], t["v_dot"], rows, cols, 1.0)
    inner = -delta_dot[..., None] if dp_dot is None else dp_dot - delta_dot[..., None]
    ds_dot = p * inner if p_dot is None else p * inner + p_dot * dp_minus_delta
    return p * dp_minus_delta, ds_dot


def _row_dots(do, o_dot, do_dot, o):
    """``Δ̇ = rowsum(dO ∘ Ȯ + dȮ ∘ O)``, either term absent (None) when its tangent is; 0 when both are."""
    delta_dot = _total(
        None if o_dot is None else (do * o_dot).sum(-1), None if do_dot is None else (do_dot * o).sum(-1)
    )
    return torch.zeros_like(do[..., 0]) if delta_dot is None else delta_dot


@_without_autocast
def backward_jvp(
    q, k, v, do, o, lse, delta, q_dot, k_dot, v_dot, do_dot, *, causal: bool, scale: float,
    block: int | None = None, key_mask=None, o_dot=None, stats_dot=None, window=None, q_ids=None,
    k_ids=None, tile_state=None, tile_bits=None,
):
    """Tangents ``(dQ̇, dK̇, dV̇)`` of the first backward ``(Q, K, V, dO) -> (dQ, dK, dV)`` (forward-over-reverse).

    ``o``, ``lse`` and ``Δ = delta`` are the saved forward and backward results; without ``o_dot`` and
    ``stats_dot`` they are constants here and the formulas include every path through them (``ṙ`` and ``Ȯ`` are
    recomputed). Any of the tangents ``Q̇, K̇, V̇, dȮ`` may be None (zero)::

        Δ̇   = rowsum(dȮ ∘ O + dO ∘ Ȯ)
        dṠ  = P ∘ ((Ṡ - ṙ) ∘ (dP - Δ) + dṖ - Δ̇)
        dQ̇  = τ (dṠ K + dS K̇)
        dK̇  = τ (dṠᵀ Q + dSᵀ Q̇)
        dV̇  = Ṗᵀ dO + Pᵀ dȮ

    (``Ṡ``, ``ṙ``, ``Ṗ``, ``Ȯ`` as in :func:`forward_jvp`; ``dṖ = dȮ Vᵀ + dO V̇ᵀ``). Two sweeps, as in
    :func:`bob`: row panels compute ``ṙ``, ``Ȯ``, ``Δ̇`` and ``dQ̇`` and store ``ṙ``, ``Δ̇``, ``σ``
    (``N`` floats each); column panels read them and accumulate ``dK̇`` and ``dV̇`` (summed over the
    query heads of a group). Rows that see no key get zero tangents.

    ``o_dot``, ``stats_dot`` (both or neither): the tangents of ``o`` and ``lse`` along the same ``Q̇, K̇, V̇``
    (:func:`forward_jvp`'s, as in a forward-over-reverse product); given, ``ṙ`` and ``Δ̇`` are taken from them
    instead of ``Ȯ`` being recomputed.
    """
    check_forward_tangents(o_dot, stats_dot)
    if q_dot is None and k_dot is None and v_dot is None and do_dot is None and o_dot is None:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dtype, kv_heads, n, m = accumulator_dtype(q.dtype), k.shape[1], q.shape[2], k.shape[2]
    mask = _mask(q, k, causal, window, key_mask, q_ids, k_ids, tile_state, tile_bits)
    t = _tangent_inputs(q, k, v, lse, q_dot, k_dot, v_dot, mask)
    t.update(
        do=_grouped(do, kv_heads, dtype), do_dot=_grouped(do_dot, kv_heads, dtype),
        delta=_grouped(delta, kv_heads, dtype),
    )
    og = _grouped(o, kv_heads, dtype)
    batch_heads = t["q"].shape[:3].numel()
    dq_dot = torch.zeros_like(t["q"])
    r_dot, delta_dot, sigma = (torch.empty_like(t["delta"]) for _ in range(3))
    if o_dot is not None:  # the forward's tangents: ṙ and Δ̇ without recomputing Ȯ
        t["r_dot"] = _grouped(stats_dot, kv_heads, dtype)
        delta_dot = _row_dots(t["do"], _grouped(o_dot, kv_heads, dtype), t["do_dot"], og)
    for rows in _panels(n, panel_size(n, m, batch_heads, block)):
        cols = mask.keys_seen_by(rows)
        p, sigma[..., rows], r_dot[..., rows], p_dot = _tangent_panel(t, rows, cols, scale)
        if o_dot is None:
            panel_o_dot = _output_tangent(t, p, p_dot, cols)
            delta_dot[..., rows] = _row_dots(
                t["do"][..., rows, :], panel_o_dot, _part(t["do_dot"], rows), og[..., rows, :]
            )
        ds, ds_dot = _score_gradient_tangent(t, rows, cols, p, p_dot, delta_dot[..., rows])
        dq_dot[..., rows, :] = scale * _total(ds_dot @ t["k"][..., cols, :], _matmul(ds, _part(t["k_dot"], cols)))
    t.update(r_dot=r_dot, delta_dot=delta_dot, sigma=sigma)
    dk_dot = torch.zeros(t["q"].shape[:2] + t["k"].shape[2:], dtype=dtype, device=q.device)
    dv_dot = torch.zeros_like(dk_dot)
    for cols in _panels(m, panel_size(m, n, batch_heads, block)):
        rows = mask.queries_seeing(cols)
        p, _, _, p_dot = _tangent_panel(t, rows, cols, scale)
        ds, ds_dot = _score_gradient_tangent(t, rows, cols, p, p_dot, delta_dot[..., rows])
        k_panel = _total(
            ds_dot.transpose(-1, -2) @ t["q"][..., rows, :], _matmul(ds.transpose(-1, -2), _part(t["q_dot"], rows))
        )
        v_panel = _total(
            None if p_dot is None else p_dot.transpose(-1, -2) @ t["do"][..., rows, :],
            _matmul(p.transpose(-1, -2), _part(t["do_dot"], rows)),
        )
        dk_dot[..., cols, :] = scale * k_panel.sum(2, keepdim=True)
        if v_panel is not None:
            dv_dot[..., cols, :] = v_panel.sum(2, keepdim=True)
    return _ungroup(dq_dot, q), dk_dot.squeeze(2).to(k.dtype), dv_dot.squeeze(2).to(v.dtype)
