r"""Backward-over-backward of attention in four sweeps, none of which stores an N x M tensor.

The sweeps, in launch order; each name is the sweep's config key in :mod:`.configs` and, for the row
sweeps, the ``SWEEP`` of :func:`_bob_rows_kernel`:

1. ``bob_scalars`` (rows): the row scalars :math:`A` and :math:`C` (:func:`_scalars_step`);
2. ``bob_q_bar`` (rows): :math:`\bar Q = \tau (G_S K + dS\, \bar W)` (:func:`_q_bar_step`);
3. ``bob_do_bar`` (rows): :math:`d\bar O = G_{dP} V + P \bar Z` (:func:`_do_bar_step`);
4. ``bob_cols`` (columns): :math:`\bar K = \tau (G_S^\top Q + dS^\top \bar U)` and
   :math:`\bar V = G_{dP}^\top dO` (:func:`_columns_inner`).

Every sweep recomputes its tiles of :math:`P`, :math:`dP`, :math:`\bar A` and :math:`\bar B`
(:func:`_bob_tile`); the row sweeps walk the key blocks in one loop (:func:`_rows_inner`) and differ
only in what they add up. docs/algorithm.md states the formulas and derives them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common, configs


@triton.jit
def _bob_tile(
    q, k, v, do, u_bar, w_bar, z_bar, row_max, log_sum, delta, rows, keys, N, M, qk_scale, scale, lo, hi, own_ids,
    other_ids_base, key_mask_base, own, tiles_base, tile_bits, query_tiles, key_tiles, TRANSPOSED: tl.constexpr,
    MASKED: tl.constexpr, WITH_DO: tl.constexpr,
    HAS_DQ_BAR: tl.constexpr, HAS_DK_BAR: tl.constexpr, HAS_DV_BAR: tl.constexpr, PRECISION: tl.constexpr,
    DOCUMENTS: tl.constexpr, TILES: tl.constexpr, TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
):
    r"""The tiles every sweep recomputes, for query rows ``rows`` and keys ``keys``:

    .. math::
        P,\quad dP = dO\, V^\top,\quad dP - \Delta,\quad \bar A = \tau (\bar U K^\top + Q \bar W^\top),\quad
        \bar B = dO\, \bar Z^\top

    queries by keys, or keys by queries when ``TRANSPOSED`` (the column sweep). A tile that is zero
    (:math:`\bar A` without :math:`\bar U, \bar W`; :math:`\bar B` without :math:`\bar Z`) or not wanted
    (those with dO without ``WITH_DO``: the dŌ sweep needs neither dP nor :math:`\bar B`) is not formed:
    P stands in for it, and the caller never reads it. The masks: ``lo``, ``hi``, ``own_ids`` of the program's
    positions (queries, or keys when ``TRANSPOSED``) and ``other_ids_base`` (:func:`~flashbob.kernels.common.row_masks`,
    :func:`~flashbob.kernels.common.column_masks`), applied element by element on a ``MASKED`` tile.
    """
    if TRANSPOSED:
        p = common.probabilities_transposed(k, q, row_max, log_sum, rows, keys, N, M, qk_scale, lo, hi, own_ids,
                                            other_ids_base, key_mask_base, own, tiles_base, tile_bits, query_tiles,
                                            key_tiles, MASKED, PRECISION, DOCUMENTS, TILES, TILE_ROWS, TILE_COLS,
                                            HAS_KEY_MASK)
    else:
        p = common.probabilities(q, k, row_max, log_sum, keys, M, qk_scale, lo, hi, own_ids, other_ids_base,
                                 key_mask_base, own, tiles_base, tile_bits, query_tiles, key_tiles, MASKED, PRECISION,
                                 DOCUMENTS, TILES, TILE_ROWS, TILE_COLS, HAS_KEY_MASK)
    dp, dp_centered, a_bar, b_bar = p, p, p, p
    if WITH_DO:
        dp = common.tile_product(do, v, TRANSPOSED=TRANSPOSED, PRECISION=PRECISION)
        if TRANSPOSED:
            dp_centered = dp - delta[None, :]
        else:
            dp_centered = dp - delta[:, None]
    if HAS_DQ_BAR or HAS_DK_BAR:
        a_bar = scale * common.bilinear_tile(q, u_bar, k, w_bar, HAS_DX=HAS_DQ_BAR, HAS_DY=HAS_DK_BAR,
                                             TRANSPOSED=TRANSPOSED, PRECISION=PRECISION)
    if WITH_DO and HAS_DV_BAR:
        b_bar = common.tile_product(do, z_bar, TRANSPOSED=TRANSPOSED, PRECISION=PRECISION)
    return p, dp, dp_centered, a_bar, b_bar


# ----------------------------------------------------------------------------- row sweeps


@triton.jit
def _scalars_step(a, c, p, dp_centered, a_bar, b_bar, HAS_A_BAR: tl.constexpr, HAS_DV_BAR: tl.constexpr):
    r"""Sweep ``bob_scalars``, one key block:

    .. math::
        a_i \mathrel{+}= \textstyle\sum_j P_{ij} \bar A_{ij},\quad c_i \mathrel{+}= \sum_j P_{ij} X_{ij}

    with :math:`X = (dP - \Delta) \circ \bar A + \bar B` (then :math:`A = a` and :math:`C = c - A \circ \Delta`).
    Without :math:`\bar U, \bar W`, ``a`` stays 0.
    """
    x = tl.zeros_like(p)
    if HAS_A_BAR:
        x += dp_centered * a_bar
        a += tl.sum(p * a_bar, 1)
    if HAS_DV_BAR:
        x += b_bar
    c += tl.sum(p * x, 1)
    return a, c


@triton.jit
def _q_bar_step(
    q_bar, a, c, p, dp, dp_centered, a_bar, b_bar, k, w_bar,
    HAS_A_BAR: tl.constexpr, HAS_DK_BAR: tl.constexpr, HAS_DV_BAR: tl.constexpr, PRECISION: tl.constexpr,
):
    r"""Sweep ``bob_q_bar``, one key block:

    .. math::
        \bar Q_i / \tau \mathrel{+}= \textstyle\sum_j G_{S,ij} K_j + dS_{ij} \bar W_j,\quad
        G_S = P \circ (X - A\, dP - C),\quad dS = P \circ (dP - \Delta)

    with :math:`A, C` from ``bob_scalars``; :math:`G_S` is formed in float32 before it is rounded to
    the input dtype for its product (on a row that sees one key it is ~0, and stays so).
    """
    x = tl.zeros_like(p)  # X of bob_scalars
    if HAS_A_BAR:
        x += dp_centered * a_bar
    if HAS_DV_BAR:
        x += b_bar
    g = x - a[:, None] * dp - c[:, None]
    return common.add_product_change(q_bar, p, g, dp_centered, k, w_bar, HAS_DY=HAS_DK_BAR, PRECISION=PRECISION)


@triton.jit
def _do_bar_step(
    do_bar, a, p, a_bar, v, z_bar, HAS_A_BAR: tl.constexpr, HAS_DV_BAR: tl.constexpr, PRECISION: tl.constexpr,
):
    r"""Sweep ``bob_do_bar``, one key block:

    .. math::
        d\bar O_i \mathrel{+}= \textstyle\sum_j G_{dP,ij} V_j + P_{ij} \bar Z_j,\quad G_{dP} = P \circ (\bar A - A)

    with :math:`A` from ``bob_scalars`` (no dP, no product with dO). :math:`G_{dP}` is formed in
    float32 before the rounding, like :math:`G_S` in :func:`_q_bar_step`; it equals
    :math:`(P \circ \bar A) V - A \circ O` because :math:`\sum_j P_{ij} V_j = O_i`.
    """
    if HAS_A_BAR:
        do_bar += tl.dot((p * (a_bar - a[:, None])).to(v.dtype), v, input_precision=PRECISION)
    if HAS_DV_BAR:
        do_bar += tl.dot(p.to(z_bar.dtype), z_bar, input_precision=PRECISION)
    return do_bar


@triton.jit
def _rows_inner(
    acc, a, c, q, do, u_bar, row_max, log_sum, delta, k_src, v_src, w_bar_src, z_bar_src,
    stride_kn, stride_vn, stride_wn, stride_zn, rows, start, end, N, M, qk_scale, scale, lo, hi, row_ids,
    k_ids_base, key_mask_base, own, tiles_base, tile_bits, query_tiles, key_tiles, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, HAS_DQ_BAR: tl.constexpr, HAS_DK_BAR: tl.constexpr, HAS_DV_BAR: tl.constexpr,
    PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr, TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr, SWEEP: tl.constexpr,
    TMA: tl.constexpr,
):
    r"""Add key blocks ``[start, end)`` to a query block's row sweep ``SWEEP``: the scalars ``a, c``
    (:func:`_scalars_step`), or :math:`\bar Q / \tau` (:func:`_q_bar_step`) or :math:`d\bar O`
    (:func:`_do_bar_step`) in ``acc``; what a sweep does not add to passes through unchanged. The key-side
    tiles come through their sources (:func:`~flashbob.kernels.common.tile_sources`); ``MASKED`` and the masks:
    :func:`_bob_tile`."""
    has_a_bar: tl.constexpr = HAS_DQ_BAR or HAS_DK_BAR
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k, v, w_bar, z_bar = common.load_tile_group(k_src, v_src, w_bar_src, z_bar_src, start_n, keys, M, stride_kn,
                                                    stride_vn, stride_wn, stride_zn, HEAD_DIM, BLOCK_D, HAS_DK_BAR,
                                                    HAS_DV_BAR, TMA)
        p, dp, dp_centered, a_bar, b_bar = _bob_tile(
            q, k, v, do, u_bar, w_bar, z_bar, row_max, log_sum, delta, rows, keys, N, M, qk_scale, scale, lo, hi,
            row_ids, k_ids_base, key_mask_base, own, tiles_base, tile_bits, query_tiles, key_tiles, TRANSPOSED=False,
            MASKED=MASKED, WITH_DO=SWEEP != "bob_do_bar",
            HAS_DQ_BAR=HAS_DQ_BAR, HAS_DK_BAR=HAS_DK_BAR, HAS_DV_BAR=HAS_DV_BAR, PRECISION=PRECISION,
            DOCUMENTS=DOCUMENTS, TILES=TILES, TILE_ROWS=TILE_ROWS, TILE_COLS=TILE_COLS, HAS_KEY_MASK=HAS_KEY_MASK,
        )
        if SWEEP == "bob_scalars":
            a, c = _scalars_step(a, c, p, dp_centered, a_bar, b_bar, HAS_A_BAR=has_a_bar, HAS_DV_BAR=HAS_DV_BAR)
        if SWEEP == "bob_q_bar":
            acc = _q_bar_step(acc, a, c, p, dp, dp_centered, a_bar, b_bar, k, w_bar, HAS_A_BAR=has_a_bar,
                              HAS_DK_BAR=HAS_DK_BAR, HAS_DV_BAR=HAS_DV_BAR, PRECISION=PRECISION)
        if SWEEP == "bob_do_bar":
            acc = _do_bar_step(acc, a, p, a_bar, v, z_bar, HAS_A_BAR=has_a_bar, HAS_DV_BAR=HAS_DV_BAR,
                               PRECISION=PRECISION)
    return acc, a, c


@triton.jit
def _bob_rows_kernel(
    Q, K, V, DO, U_BAR, W_BAR, Z_BAR,
    OUT,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don, stride_ub, stride_uh, stride_un, stride_wb, stride_wh, stride_wn,
    stride_zb, stride_zh, stride_zn, stride_outb, stride_outh, stride_outn,
    STATS, DELTA, A, C, KEY_MASK, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, TILE_BITS,
    query_tiles, key_tiles, heads, group, N, M, qk_scale,
    scale, SWEEP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BAND: tl.constexpr, HAS_DQ_BAR: tl.constexpr, HAS_DK_BAR: tl.constexpr, HAS_DV_BAR: tl.constexpr,
    PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr, TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr, TMA: tl.constexpr,
):
    r"""One query block of the row sweep ``SWEEP`` (:func:`_rows_inner`), key blocks split as in the
    forward (:func:`~flashbob.kernels.common.row_masks`: blocks no query sees skipped, partly seen ones masked):

    * ``"bob_scalars"`` stores :math:`A_i = a_i` and :math:`C_i = c_i - A_i \Delta_i`;
    * ``"bob_q_bar"`` reads A and C and stores :math:`\bar Q` into ``OUT``;
    * ``"bob_do_bar"`` reads A and stores :math:`d\bar O` into ``OUT``.

    Absent cotangents' pointers are never read. ``TMA`` (the ``"tma"`` variant): tiles through tensor
    descriptors.
    """
    start_m, rows, batch_head, batch, head, kv_head, key_mask_base = common.query_block(heads, group, KEY_MASK, M, BLOCK_M)
    k_src, v_src, w_bar_src, z_bar_src = common.head_tile_sources(K, V, W_BAR, Z_BAR, batch, kv_head, stride_kb,
                                                                  stride_kh, stride_vb, stride_vh, stride_wb, stride_wh,
                                                                  stride_zb, stride_zh, M, stride_kn, stride_vn,
                                                                  stride_wn, stride_zn, HEAD_DIM, BLOCK_N, BLOCK_D,
                                                                  HAS_DK_BAR, HAS_DV_BAR, TMA)
    q_src = common.head_tile_source(Q, batch, head, stride_qb, stride_qh, N, stride_qn, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
    do_src = common.head_tile_source(DO, batch, head, stride_dob, stride_doh, N, stride_don, HEAD_DIM, BLOCK_M, BLOCK_D,
                                     TMA)
    u_bar_src = common.head_tile_source(U_BAR, batch, head, stride_ub, stride_uh, N, stride_un, HEAD_DIM, BLOCK_M,
                                        BLOCK_D, TMA and HAS_DQ_BAR)
    q = common.load_block(q_src, start_m, rows, N, stride_qn, HEAD_DIM, BLOCK_D, TMA)
    do = common.load_block(do_src, start_m, rows, N, stride_don, HEAD_DIM, BLOCK_D, TMA)
    u_bar = common.optional_block(u_bar_src, start_m, rows, N, stride_un, q, HEAD_DIM, BLOCK_D, PRESENT=HAS_DQ_BAR,
                                  TMA=TMA)
    row_max, log_sum = common.load_softmax_stats(common.softmax_stats_pointer(STATS, batch_head, N), rows, N)
    delta = common.load_rows(common.row_vector_pointer(DELTA, batch_head, N), rows, N)
    acc_dtype = DELTA.dtype.element_ty
    lo, hi, row_ids, k_ids_base, tiles_base, start, whole_start, whole_end, end = common.row_masks(
        rows, batch, N, M, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, query_tiles, key_tiles, BLOCK_N,
        BAND, DOCUMENTS, TILES)

    if SWEEP == "bob_scalars":
        a = tl.zeros([BLOCK_M], dtype=acc_dtype)
        c = tl.zeros([BLOCK_M], dtype=acc_dtype)
    else:  # the dO-bar sweep reads no C: its load is dropped by the compiler
        a = common.load_rows(common.row_vector_pointer(A, batch_head, N), rows, N)
        c = common.load_rows(common.row_vector_pointer(C, batch_head, N), rows, N)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=acc_dtype)  # untouched (and not kept) in the scalar sweep
    for phase in tl.static_range(3):  # the masked blocks, the whole ones, the masked ones
        first, last = common.sweep_phase(phase, start, whole_start, whole_end, end)
        acc, a, c = _rows_inner(
            acc, a, c, q, do, u_bar, row_max, log_sum, delta, k_src, v_src, w_bar_src, z_bar_src, stride_kn, stride_vn,
            stride_wn, stride_zn, rows, first, last, N, M, qk_scale, scale, lo, hi, row_ids, k_ids_base, key_mask_base,
            rows, tiles_base, TILE_BITS, query_tiles, key_tiles, HEAD_DIM, BLOCK_D, BLOCK_N, phase != 1, HAS_DQ_BAR,
            HAS_DK_BAR, HAS_DV_BAR, PRECISION, DOCUMENTS, TILES, TILE_ROWS, TILE_COLS, HAS_KEY_MASK, SWEEP, TMA,
        )

    if SWEEP == "bob_scalars":
        c = c - a * delta
        common.store_rows(common.row_vector_pointer(A, batch_head, N), a, rows, N)
        common.store_rows(common.row_vector_pointer(C, batch_head, N), c, rows, N)
    else:
        if SWEEP == "bob_q_bar":
            acc = acc * scale
        common.store_head_block(OUT, acc, batch, head, stride_outb, stride_outh, start_m, rows, N, stride_outn,
                                HEAD_DIM, BLOCK_M, BLOCK_D, TMA)


# ----------------------------------------------------------------------------- column sweep


@triton.jit
def _columns_inner(
    k_bar, v_bar, k, v, w_bar, z_bar,
    q_src, do_src, u_bar_src, stats_base, delta_base, a_base, c_base, stride_qn, stride_don, stride_un,
    keys, start, end, N, qk_scale, scale, lo, hi, key_ids, q_ids_base, key_mask_base, own, tiles_base, tile_bits,
    query_tiles, key_tiles, M,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
    HAS_DQ_BAR: tl.constexpr, HAS_DK_BAR: tl.constexpr, HAS_DV_BAR: tl.constexpr, PRECISION: tl.constexpr,
    DOCUMENTS: tl.constexpr, TILES: tl.constexpr, TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr, TMA: tl.constexpr,
):
    r"""Sweep ``bob_cols``: add query rows ``[start, end)`` of one query head to a key block's

    .. math::
        \bar K_j / \tau \mathrel{+}= \textstyle\sum_i G_{S,ij} Q_i + dS_{ij} \bar U_i,\quad
        \bar V_j \mathrel{+}= \sum_i G_{dP,ij}\, dO_i

    with :math:`G_S`, :math:`G_{dP}` as in the row sweeps and :math:`A, C` from ``bob_scalars``; tiles
    are kept transposed (keys by queries). ``q_src``, ``do_src``, ``u_bar_src``:
    :func:`~flashbob.kernels.common.tile_source`.
    """
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q = common.load_block(q_src, start_m, rows, N, stride_qn, HEAD_DIM, BLOCK_D, TMA)
        do = common.load_block(do_src, start_m, rows, N, stride_don, HEAD_DIM, BLOCK_D, TMA)
        u_bar = common.optional_block(u_bar_src, start_m, rows, N, stride_un, q, HEAD_DIM, BLOCK_D, PRESENT=HAS_DQ_BAR,
                                      TMA=TMA)
        row_max, log_sum = common.load_softmax_stats(stats_base, rows, N)
        delta = common.load_rows(delta_base, rows, N)
        c = common.load_rows(c_base, rows, N)
        p_t, dp_t, dp_centered_t, a_bar_t, b_bar_t = _bob_tile(
            q, k, v, do, u_bar, w_bar, z_bar, row_max, log_sum, delta, rows, keys, N, M, qk_scale, scale, lo, hi,
            key_ids, q_ids_base, key_mask_base, own, tiles_base, tile_bits, query_tiles, key_tiles, TRANSPOSED=True,
            MASKED=MASKED, WITH_DO=True, HAS_DQ_BAR=HAS_DQ_BAR,
            HAS_DK_BAR=HAS_DK_BAR, HAS_DV_BAR=HAS_DV_BAR, PRECISION=PRECISION, DOCUMENTS=DOCUMENTS, TILES=TILES,
            TILE_ROWS=TILE_ROWS, TILE_COLS=TILE_COLS,
            HAS_KEY_MASK=HAS_KEY_MASK,
        )
        g_s_t = tl.zeros_like(p_t) - c[None, :]
        if HAS_DQ_BAR or HAS_DK_BAR:
            a = common.load_rows(a_base, rows, N)
            g_s_t += dp_centered_t * a_bar_t - a[None, :] * dp_t
            g_dp_t = p_t * (a_bar_t - a[None, :])
            v_bar += tl.dot(g_dp_t.to(do.dtype), do, input_precision=PRECISION)
        if HAS_DV_BAR:
            g_s_t += b_bar_t
        k_bar = common.add_product_change(k_bar, p_t, g_s_t, dp_centered_t, q, u_bar, HAS_DY=HAS_DQ_BAR,
                                          PRECISION=PRECISION)
    return k_bar, v_bar


@triton.jit
def _bob_columns_kernel(
    Q, K, V, DO, U_BAR, W_BAR, Z_BAR,
    K_BAR, V_BAR,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_ub, stride_uh, stride_un, stride_wb, stride_wh, stride_wn, stride_zb, stride_zh, stride_zn,
    stride_kbb, stride_kbh, stride_kbn, stride_vbb, stride_vbh, stride_vbn,
    STATS, DELTA, A, C, KEY_MASK, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, TILE_BITS,
    query_tiles, key_tiles, heads, kv_heads, group, N, M,
    qk_scale, scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BAND: tl.constexpr, HAS_DQ_BAR: tl.constexpr, HAS_DK_BAR: tl.constexpr, HAS_DV_BAR: tl.constexpr,
    PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr, TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr, TMA: tl.constexpr,
):
    r"""Sweep ``bob_cols`` for one key block of one kv head: :math:`\bar K = \tau (G_S^\top Q + dS^\top \bar U)`
    and :math:`\bar V = G_{dP}^\top dO`, summed over the ``group`` query heads sharing it
    (:func:`_columns_inner`); the query rows are split as in the dK/dV kernel. ``TMA`` (the
    ``"tma"`` variant): tiles through tensor descriptors."""
    start_n, keys, batch, kv_head, key_mask_base = common.key_block(kv_heads, KEY_MASK, M, BLOCK_N)
    acc_dtype = DELTA.dtype.element_ty
    k_bar = tl.zeros([BLOCK_N, BLOCK_D], dtype=acc_dtype)
    v_bar = tl.zeros([BLOCK_N, BLOCK_D], dtype=acc_dtype)
    k_src, v_src, w_bar_src, z_bar_src = common.head_tile_sources(K, V, W_BAR, Z_BAR, batch, kv_head, stride_kb,
                                                                  stride_kh, stride_vb, stride_vh, stride_wb, stride_wh,
                                                                  stride_zb, stride_zh, M, stride_kn, stride_vn,
                                                                  stride_wn, stride_zn, HEAD_DIM, BLOCK_N, BLOCK_D,
                                                                  HAS_DK_BAR, HAS_DV_BAR, TMA)
    k, v, w_bar, z_bar = common.load_tile_group(k_src, v_src, w_bar_src, z_bar_src, start_n, keys, M, stride_kn,
                                                stride_vn, stride_wn, stride_zn, HEAD_DIM, BLOCK_D, HAS_DK_BAR,
                                                HAS_DV_BAR, TMA)

    lo, hi, key_ids, q_ids_base, tiles_base, start, whole_start, whole_end, end = common.column_masks(
        keys, batch, N, M, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, query_tiles, key_tiles, BLOCK_M,
        BAND, DOCUMENTS, TILES)
    for member in tl.range(group, num_stages=1):  # never pipelined: common.group_query_head
        head, batch_head, q_base, do_base, stats_base, delta_base = common.group_query_head(
            Q, DO, STATS, DELTA, batch, heads, kv_head, group, member, N, stride_qb, stride_qh, stride_dob, stride_doh)
        a_base = common.row_vector_pointer(A, batch_head, N)
        c_base = common.row_vector_pointer(C, batch_head, N)
        q_src = common.tile_source(q_base, N, stride_qn, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
        do_src = common.tile_source(do_base, N, stride_don, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
        u_bar_src = common.head_tile_source(U_BAR, batch, head, stride_ub, stride_uh, N, stride_un, HEAD_DIM, BLOCK_M,
                                            BLOCK_D, TMA and HAS_DQ_BAR)
        for phase in tl.static_range(3):  # the masked blocks, the whole ones, the masked ones
            first, last = common.sweep_phase(phase, start, whole_start, whole_end, end)
            k_bar, v_bar = _columns_inner(
                k_bar, v_bar, k, v, w_bar, z_bar, q_src, do_src, u_bar_src, stats_base, delta_base, a_base, c_base,
                stride_qn, stride_don, stride_un, keys, first, last, N, qk_scale, scale, lo, hi, key_ids, q_ids_base,
                key_mask_base, keys, tiles_base, TILE_BITS, query_tiles, key_tiles, M, HEAD_DIM, BLOCK_D, BLOCK_M,
                MASKED=phase != 1, HAS_DQ_BAR=HAS_DQ_BAR, HAS_DK_BAR=HAS_DK_BAR, HAS_DV_BAR=HAS_DV_BAR,
                PRECISION=PRECISION, DOCUMENTS=DOCUMENTS, TILES=TILES, TILE_ROWS=TILE_ROWS, TILE_COLS=TILE_COLS,
                HAS_KEY_MASK=HAS_KEY_MASK, TMA=TMA,
            )

    common.store_head_block(K_BAR, k_bar * scale, batch, kv_head, stride_kbb, stride_kbh, start_n, keys, M, stride_kbn,
                            HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    common.store_head_block(V_BAR, v_bar, batch, kv_head, stride_vbb, stride_vbh, start_n, keys, M, stride_vbn,
                            HEAD_DIM, BLOCK_N, BLOCK_D, TMA)


# ----------------------------------------------------------------------------- host wrapper


def bob(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, o: torch.Tensor, stats: torch.Tensor,
    delta: torch.Tensor, dq_bar: torch.Tensor | None, dk_bar: torch.Tensor | None, dv_bar: torch.Tensor | None,
    *, causal: bool, scale: float, allow_tf32: bool = False, key_mask: torch.Tensor | None = None, window=None,
    q_ids: torch.Tensor | None = None, k_ids: torch.Tensor | None = None,
    tile_state: torch.Tensor | None = None, tile_bits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Backward-over-backward: the vector-Jacobian product of :math:`(Q, K, V, dO) \mapsto (dQ, dK, dV)`
    with cotangents :math:`(\bar U, \bar W, \bar Z)` = ``(dq_bar, dk_bar, dv_bar)``.

    .. math::
        \bar A = \tau(\bar U K^\top + Q \bar W^\top),\quad \bar B = dO\, \bar Z^\top,\quad
        A_i = \textstyle\sum_j P_{ij} \bar A_{ij},\quad
        C_i = \sum_j P_{ij} (dP_{ij} - \Delta_i) \bar A_{ij} + \sum_j P_{ij} \bar B_{ij} - A_i \Delta_i,\\
        G_{dP} = P \circ (\bar A - A),\quad G_S = P \circ ((dP - \Delta) \circ \bar A - A\, dP + \bar B - C),\\
        \bar Q = \tau (G_S K + dS\, \bar W),\quad \bar K = \tau (G_S^\top Q + dS^\top \bar U),\quad
        \bar V = G_{dP}^\top dO,\quad d\bar O = G_{dP} V + P \bar Z

    in four sweeps without any N x M tensor (this module's docstring). O, the softmax statistics and
    Δ are treated as constants: the formulas already contain every path through them.

    Args:
        q, k, v, causal, scale, allow_tf32, key_mask, window, q_ids, k_ids: as in :func:`flashbob.kernels.forward`.
        do: the cotangent the backward was run with; delta: from the backward; stats: from the forward.
        o: the forward output (shape-checked only: these kernels form dŌ as :math:`G_{dP} V + P \bar Z`).
        dq_bar: ``(B, H, N, d)``; dk_bar, dv_bar: ``(B, Hkv, M, d)``; each may be None (= zero), which
            compiles its terms out. When all three are None, zeros are returned without a launch.

    Returns:
        ``(q_bar, k_bar, v_bar, do_bar)`` shaped and typed like ``q, k, v, do``.
    """
    common.check_qkv(q, k, v)
    common.check_shaped_like(("do", do, q), ("o", o, q), ("dq_bar", dq_bar, q), ("dk_bar", dk_bar, k),
                             ("dv_bar", dv_bar, v))
    if dq_bar is None and dk_bar is None and dv_bar is None:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(do)
    masks = common.KernelMasks(q, k, causal=causal, window=window, key_mask=key_mask, q_ids=q_ids, k_ids=k_ids,
                               tile_state=tile_state, tile_bits=tile_bits)
    q, k, v, do = (common.operand(x, q) for x in (q, k, v, do))
    batch, heads, n, head_dim = q.shape
    kv_heads, m = k.shape[1], k.shape[2]
    stats, delta = common.softmax_stats(stats, q), common.row_statistic(delta, q)
    a, c = torch.empty_like(delta), torch.empty_like(delta)
    q_bar, k_bar, v_bar, do_bar = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(do)
    # Absent cotangents are passed as placeholders (q or k) that the kernels never read.
    u_bar = q if dq_bar is None else common.operand(dq_bar, q)
    w_bar = k if dk_bar is None else common.operand(dk_bar, q)
    z_bar = k if dv_bar is None else common.operand(dv_bar, q)
    constants = common.kernel_constants(q, masks, allow_tf32, HAS_DQ_BAR=dq_bar is not None,
                                        HAS_DK_BAR=dk_bar is not None, HAS_DV_BAR=dv_bar is not None)
    scalars = (heads // kv_heads, n, m, scale * common.LOG2E.value, scale)

    def row_sweep(sweep: str, out: torch.Tensor) -> None:
        """Launch the row sweep ``sweep`` over every query block; its d-vector output goes to ``out``."""
        configs.launch(
            sweep, _bob_rows_kernel, common.row_grid(n, batch * heads),
            *common.with_strides(q, k, v, do, u_bar, w_bar, z_bar, out), stats, delta, a, c, *masks.row_arguments(),
            heads, *scalars,
            head_dim=head_dim, dtype=q.dtype, length=n, descriptors=(q, k, v, do, u_bar, w_bar, z_bar, out),
            **constants, SWEEP=sweep,
        )

    row_sweep("bob_scalars", out=q_bar)  # A and C (q_bar is not written)
    row_sweep("bob_q_bar", out=q_bar)  # Q-bar, from A and C
    row_sweep("bob_do_bar", out=do_bar)  # dO-bar, from A
    configs.launch(  # K-bar and V-bar, from A and C
        "bob_cols", _bob_columns_kernel, common.column_grid(m, batch * kv_heads),
        *common.with_strides(q, k, v, do, u_bar, w_bar, z_bar, k_bar, v_bar), stats, delta, a, c,
        *masks.column_arguments(), heads, kv_heads, *scalars, head_dim=head_dim, dtype=q.dtype, length=m,
        descriptors=(q, k, v, do, u_bar, w_bar, z_bar, k_bar, v_bar), **constants,
    )
    return q_bar, k_bar, v_bar, do_bar
