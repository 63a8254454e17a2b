r"""Forward mode of attention: the tangent of O, and the tangents of the backward's (dQ, dK, dV).

Per (batch, head), with :math:`S = \tau Q K^\top`, :math:`P = \mathrm{softmax}_\text{row}(S)` from the
forward's statistics, :math:`dP = dO\, V^\top` and :math:`\Delta_i = dO_i \cdot O_i`:

.. math::
    \dot S = \tau(\dot Q K^\top + Q \dot K^\top),\quad \dot r_i = \textstyle\sum_j P_{ij} \dot S_{ij},\quad
    \dot O = (P \circ \dot S) V - \dot r \circ O + P \dot V,\\
    \dot\Delta_i = d\dot O_i \cdot O_i + dO_i \cdot \dot O_i,\quad
    d\dot P = d\dot O\, V^\top + dO\, \dot V^\top,\quad
    d\dot S = P \circ ((\dot S - \dot r) \circ (dP - \Delta) + d\dot P - \dot\Delta),\\
    d\dot Q = \tau(d\dot S K + dS \dot K),\quad d\dot K = \tau(d\dot S^\top Q + dS^\top \dot Q),\quad
    d\dot V = (P \circ (\dot S - \dot r))^\top dO + P^\top d\dot O

Schedule (no N x M tensor): :func:`forward_jvp` is one row sweep (which also gives :math:`\dot r`, the
statistics' tangent); :func:`backward_jvp` is a row sweep for the row scalars :math:`\dot r, \dot\Delta` (no
d-vector accumulator: :math:`dO_i \cdot \dot O_i` is summed from :math:`dP` directly), a row sweep for
:math:`d\dot Q` and a column sweep for :math:`d\dot K, d\dot V`: 5 + 8 + 10 matrix products per tile pair,
46 N·M·d FLOPs (non-causal; 24 N·M·d by the benchmarks' convention). Given :func:`forward_jvp`'s tangents (as
in forward-over-reverse) the first sweep is replaced by two row dot products: 8 + 10 products, 36 N·M·d.
Absent tangents are compiled out (``HAS_Q_DOT``, ...).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashbob.inputs import check_forward_tangents

from . import common, configs
from .backward import row_dot_products


@triton.jit
def _p_s_dot(
    p, q, q_dot, k, v_src, k_dot_src, stride_vn, stride_kdn, start_n, keys, M, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_Q_DOT: tl.constexpr, HAS_K_DOT: tl.constexpr,
    PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    r"""The V tile of keys ``keys = start_n + arange`` and :math:`P \circ \dot S` with
    :math:`\dot S = \tau(\dot Q K^\top + Q \dot K^\top)` (queries by keys; at least one of :math:`\dot Q, \dot K`
    present; ``v_src``, ``k_dot_src``: :func:`~flashbob.kernels.common.tile_source`)."""
    v = common.load_block(v_src, start_n, keys, M, stride_vn, HEAD_DIM, BLOCK_D, TMA)
    k_dot = common.optional_block(k_dot_src, start_n, keys, M, stride_kdn, k, HEAD_DIM, BLOCK_D, PRESENT=HAS_K_DOT,
                                  TMA=TMA)
    s_dot = scale * common.bilinear_tile(q, q_dot, k, k_dot, HAS_DX=HAS_Q_DOT, HAS_DY=HAS_K_DOT, TRANSPOSED=False,
                                         PRECISION=PRECISION)
    return v, p * s_dot


# ----------------------------------------------------------------------------- row sweep: O-dot (forward mode)


@triton.jit
def _o_dot_inner(
    acc, r_rounded, q, q_dot, row_max, log_sum, k_src, v_src, k_dot_src, v_dot_src,
    stride_kn, stride_vn, stride_kdn, stride_vdn, start, end, M, qk_scale, scale, lo, hi, row_ids, k_ids_base,
    key_mask_base, own, tiles_base, tile_bits, query_tiles, key_tiles,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_Q_DOT: tl.constexpr, HAS_K_DOT: tl.constexpr, HAS_V_DOT: tl.constexpr, PRECISION: tl.constexpr,
    DOCUMENTS: tl.constexpr, TILES: tl.constexpr, TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr, TMA: tl.constexpr,
):
    r"""Add key blocks ``[start, end)`` to a query block's
    :math:`\mathrm{acc}_i \mathrel{+}= \sum_j \tilde X_{ij} V_j + P_{ij} \dot V_j` and
    ``r_rounded`` :math:`\mathrel{+}= \sum_j \tilde X_{ij}`, with :math:`X = P \circ \dot S` and
    :math:`\tilde X` its rounding to the input dtype (the matmul operand); :math:`\sum_j \tilde X_{ij}` is
    :math:`\dot r_i` up to that rounding.

    The caller subtracts ``r_rounded`` times O: :math:`\sum_j \tilde X_{ij} (V_j - O_i)` cancels exactly
    where it should (a row with one visible key has :math:`\dot O = \dot V_j`, and its term
    :math:`\tilde X (V_j - O_i)` is 0 in any dtype), where :math:`\dot r_i O_i` would leave the rounding
    of :math:`\tilde X`. Key-side tiles through their sources (:func:`~flashbob.kernels.common.tile_sources`);
    ``MASKED`` and the masks: :func:`~flashbob.kernels.common.mask_scores`.
    """
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = common.load_block(k_src, start_n, keys, M, stride_kn, HEAD_DIM, BLOCK_D, TMA)
        p = common.probabilities(q, k, row_max, log_sum, keys, M, qk_scale, lo, hi, row_ids, k_ids_base, key_mask_base,
                                 own, tiles_base, tile_bits, query_tiles, key_tiles, MASKED, PRECISION, DOCUMENTS,
                                 TILES, TILE_ROWS, TILE_COLS, HAS_KEY_MASK)
        if HAS_Q_DOT or HAS_K_DOT:
            v, p_s_dot = _p_s_dot(p, q, q_dot, k, v_src, k_dot_src, stride_vn, stride_kdn, start_n, keys, M, scale,
                                  HEAD_DIM, BLOCK_D, HAS_Q_DOT=HAS_Q_DOT, HAS_K_DOT=HAS_K_DOT, PRECISION=PRECISION,
                                  TMA=TMA)
            p_s_dot_rounded = p_s_dot.to(v.dtype)
            r_rounded += tl.sum(p_s_dot_rounded.to(r_rounded.dtype), 1)
            acc += tl.dot(p_s_dot_rounded, v, input_precision=PRECISION)
        if HAS_V_DOT:
            v_dot = common.load_block(v_dot_src, start_n, keys, M, stride_vdn, HEAD_DIM, BLOCK_D, TMA)
            acc += tl.dot(p.to(v_dot.dtype), v_dot, input_precision=PRECISION)
    return acc, r_rounded


@triton.jit
def _o_dot_kernel(
    Q, K, V, O, Q_DOT, K_DOT, V_DOT,
    O_DOT,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_qdb, stride_qdh, stride_qdn, stride_kdb, stride_kdh, stride_kdn, stride_vdb, stride_vdh, stride_vdn,
    stride_odb, stride_odh, stride_odn,
    STATS, R_DOT, KEY_MASK, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, TILE_BITS,
    query_tiles, key_tiles, heads, group, N, M,
    qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BAND: tl.constexpr, HAS_Q_DOT: tl.constexpr, HAS_K_DOT: tl.constexpr, HAS_V_DOT: tl.constexpr,
    PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr, TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr, TMA: tl.constexpr,
):
    r"""One query block's :math:`\dot O = \mathrm{acc} - \tilde r \circ O` (:func:`_o_dot_inner`) and
    :math:`\tilde r`, the tangent of the row log-sum-exp, into ``R_DOT``; key blocks split as in the forward.
    Rows that see no key have P = 0 and O = 0, so :math:`\dot O = 0` and :math:`\tilde r = 0`.
    ``TMA`` (the ``"tma"`` variant): as in the forward."""
    start_m, rows, batch_head, batch, head, kv_head, key_mask_base = common.query_block(heads, group, KEY_MASK, M, BLOCK_M)

    q_src = common.head_tile_source(Q, batch, head, stride_qb, stride_qh, N, stride_qn, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
    q_dot_src = common.head_tile_source(Q_DOT, batch, head, stride_qdb, stride_qdh, N, stride_qdn, HEAD_DIM, BLOCK_M,
                                        BLOCK_D, TMA and HAS_Q_DOT)
    q = common.load_block(q_src, start_m, rows, N, stride_qn, HEAD_DIM, BLOCK_D, TMA)
    q_dot = common.optional_block(q_dot_src, start_m, rows, N, stride_qdn, q, HEAD_DIM, BLOCK_D, PRESENT=HAS_Q_DOT,
                                  TMA=TMA)
    acc_dtype = STATS.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=acc_dtype)
    r_rounded = tl.zeros([BLOCK_M], dtype=acc_dtype)
    row_max, log_sum = common.load_softmax_stats(common.softmax_stats_pointer(STATS, batch_head, N), rows, N)
    k_src, v_src, k_dot_src, v_dot_src = common.head_tile_sources(K, V, K_DOT, V_DOT, batch, kv_head, stride_kb,
                                                                  stride_kh, stride_vb, stride_vh, stride_kdb,
                                                                  stride_kdh, stride_vdb, stride_vdh, M, stride_kn,
                                                                  stride_vn, stride_kdn, stride_vdn, HEAD_DIM, BLOCK_N,
                                                                  BLOCK_D, HAS_K_DOT, HAS_V_DOT, TMA)
    lo, hi, row_ids, k_ids_base, tiles_base, start, whole_start, whole_end, end = common.row_masks(
        rows, batch, N, M, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, query_tiles, key_tiles, BLOCK_N,
        BAND, DOCUMENTS, TILES)
    for phase in tl.static_range(3):  # the masked blocks, the whole ones, the masked ones
        first, last = common.sweep_phase(phase, start, whole_start, whole_end, end)
        acc, r_rounded = _o_dot_inner(
            acc, r_rounded, q, q_dot, row_max, log_sum, k_src, v_src, k_dot_src, v_dot_src, stride_kn, stride_vn,
            stride_kdn, stride_vdn, first, last, M, qk_scale, scale, lo, hi, row_ids, k_ids_base, key_mask_base, rows,
            tiles_base, TILE_BITS, query_tiles, key_tiles, HEAD_DIM, BLOCK_D, BLOCK_N, phase != 1, HAS_Q_DOT, HAS_K_DOT,
            HAS_V_DOT, PRECISION, DOCUMENTS, TILES, TILE_ROWS, TILE_COLS, HAS_KEY_MASK, TMA,
        )
    o_src = common.head_tile_source(O, batch, head, stride_ob, stride_oh, N, stride_on, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
    o_dot_src = common.head_tile_source(O_DOT, batch, head, stride_odb, stride_odh, N, stride_odn, HEAD_DIM, BLOCK_M,
                                        BLOCK_D, TMA)
    o = common.load_block(o_src, start_m, rows, N, stride_on, HEAD_DIM, BLOCK_D, TMA)
    common.store_block(o_dot_src, acc - r_rounded[:, None] * o.to(acc_dtype), start_m, rows, N, stride_odn, HEAD_DIM,
                       BLOCK_D, TMA)
    common.store_rows(common.row_vector_pointer(R_DOT, batch_head, N), r_rounded, rows, N)


# ----------------------------------------------------------------------------- row sweep: r-dot, Delta-dot


@triton.jit
def _row_scalars_inner(
    r_dot, delta_dot, q, q_dot, do, row_max, log_sum, delta, k_src, v_src, k_dot_src, v_dot_src,
    stride_kn, stride_vn, stride_kdn, stride_vdn, start, end, M, qk_scale, scale, lo, hi, row_ids, k_ids_base,
    key_mask_base, own, tiles_base, tile_bits, query_tiles, key_tiles,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_Q_DOT: tl.constexpr, HAS_K_DOT: tl.constexpr, HAS_V_DOT: tl.constexpr, PRECISION: tl.constexpr,
    DOCUMENTS: tl.constexpr, TILES: tl.constexpr, TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr, TMA: tl.constexpr,
):
    r"""Add key blocks ``[start, end)`` to a query block's :math:`\dot r_i \mathrel{+}= \sum_j P_{ij} \dot S_{ij}`
    and ``delta_dot`` :math:`\mathrel{+}= \sum_j P_{ij} (\dot S_{ij} (dP_{ij} - \Delta_i) + (dO \dot V^\top)_{ij})`,
    which is :math:`dO_i \cdot \dot O_i` (:math:`\sum_j P_{ij} (dP_{ij} - \Delta_i) = 0`), all in float32.
    Key-side tiles and the masks as in :func:`_o_dot_inner`."""
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = common.load_block(k_src, start_n, keys, M, stride_kn, HEAD_DIM, BLOCK_D, TMA)
        p = common.probabilities(q, k, row_max, log_sum, keys, M, qk_scale, lo, hi, row_ids, k_ids_base, key_mask_base,
                                 own, tiles_base, tile_bits, query_tiles, key_tiles, MASKED, PRECISION, DOCUMENTS,
                                 TILES, TILE_ROWS, TILE_COLS, HAS_KEY_MASK)
        x = tl.zeros_like(p)
        if HAS_Q_DOT or HAS_K_DOT:
            v, p_s_dot = _p_s_dot(p, q, q_dot, k, v_src, k_dot_src, stride_vn, stride_kdn, start_n, keys, M, scale,
                                  HEAD_DIM, BLOCK_D, HAS_Q_DOT=HAS_Q_DOT, HAS_K_DOT=HAS_K_DOT, PRECISION=PRECISION,
                                  TMA=TMA)
            r_dot += tl.sum(p_s_dot, 1)
            x += p_s_dot * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
        if HAS_V_DOT:
            v_dot = common.load_block(v_dot_src, start_n, keys, M, stride_vdn, HEAD_DIM, BLOCK_D, TMA)
            x += p * tl.dot(do, tl.trans(v_dot), input_precision=PRECISION)
        delta_dot += tl.sum(x, 1)
    return r_dot, delta_dot


@triton.jit
def _row_scalars_kernel(
    Q, K, V, O, DO, Q_DOT, K_DOT, V_DOT, DO_DOT,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don,
    stride_qdb, stride_qdh, stride_qdn, stride_kdb, stride_kdh, stride_kdn, stride_vdb, stride_vdh, stride_vdn,
    stride_dodb, stride_dodh, stride_dodn,
    STATS, DELTA, R_DOT, DELTA_DOT, KEY_MASK, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, TILE_BITS,
    query_tiles, key_tiles, heads, group, N, M,
    qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BAND: tl.constexpr, HAS_Q_DOT: tl.constexpr, HAS_K_DOT: tl.constexpr, HAS_V_DOT: tl.constexpr,
    HAS_DO_DOT: tl.constexpr, PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    TMA: tl.constexpr,
):
    r"""The backward's first sweep: one query block's row scalars :math:`\dot r` and
    :math:`\dot\Delta_i = d\dot O_i \cdot O_i + dO_i \cdot \dot O_i` (:func:`_row_scalars_inner`; no
    d-vector accumulator, :math:`\dot O` itself is never formed); key blocks split as in the forward, the
    sweep compiled out without :math:`\dot Q, \dot K, \dot V`. Rows that see no key have P = 0 and O = 0,
    so both are 0. ``TMA`` (the ``"tma"`` variant): as in the forward."""
    start_m, rows, batch_head, batch, head, kv_head, key_mask_base = common.query_block(heads, group, KEY_MASK, M, BLOCK_M)

    acc_dtype = STATS.dtype.element_ty
    r_dot = tl.zeros([BLOCK_M], dtype=acc_dtype)
    delta_dot = tl.zeros([BLOCK_M], dtype=acc_dtype)
    if HAS_Q_DOT or HAS_K_DOT or HAS_V_DOT:
        q_src = common.head_tile_source(Q, batch, head, stride_qb, stride_qh, N, stride_qn, HEAD_DIM, BLOCK_M, BLOCK_D,
                                        TMA)
        q_dot_src = common.head_tile_source(Q_DOT, batch, head, stride_qdb, stride_qdh, N, stride_qdn, HEAD_DIM,
                                            BLOCK_M, BLOCK_D, TMA and HAS_Q_DOT)
        do_src = common.head_tile_source(DO, batch, head, stride_dob, stride_doh, N, stride_don, HEAD_DIM, BLOCK_M,
                                         BLOCK_D, TMA)
        q = common.load_block(q_src, start_m, rows, N, stride_qn, HEAD_DIM, BLOCK_D, TMA)
        q_dot = common.optional_block(q_dot_src, start_m, rows, N, stride_qdn, q, HEAD_DIM, BLOCK_D,
                                      PRESENT=HAS_Q_DOT, TMA=TMA)
        do = common.load_block(do_src, start_m, rows, N, stride_don, HEAD_DIM, BLOCK_D, TMA)
        row_max, log_sum = common.load_softmax_stats(common.softmax_stats_pointer(STATS, batch_head, N), rows, N)
        delta = common.load_rows(common.row_vector_pointer(DELTA, batch_head, N), rows, N)
        k_src, v_src, k_dot_src, v_dot_src = common.head_tile_sources(K, V, K_DOT, V_DOT, batch, kv_head, stride_kb,
                                                                      stride_kh, stride_vb, stride_vh, stride_kdb,
                                                                      stride_kdh, stride_vdb, stride_vdh, M, stride_kn,
                                                                      stride_vn, stride_kdn, stride_vdn, HEAD_DIM,
                                                                      BLOCK_N, BLOCK_D, HAS_K_DOT, HAS_V_DOT, TMA)
        lo, hi, row_ids, k_ids_base, tiles_base, start, whole_start, whole_end, end = common.row_masks(
            rows, batch, N, M, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, query_tiles, key_tiles,
            BLOCK_N, BAND, DOCUMENTS, TILES)
        for phase in tl.static_range(3):  # the masked blocks, the whole ones, the masked ones
            first, last = common.sweep_phase(phase, start, whole_start, whole_end, end)
            r_dot, delta_dot = _row_scalars_inner(
                r_dot, delta_dot, q, q_dot, do, row_max, log_sum, delta, k_src, v_src, k_dot_src, v_dot_src, stride_kn,
                stride_vn, stride_kdn, stride_vdn, first, last, M, qk_scale, scale, lo, hi, row_ids, k_ids_base,
                key_mask_base, rows, tiles_base, TILE_BITS, query_tiles, key_tiles, HEAD_DIM, BLOCK_D, BLOCK_N, phase !=
                1, HAS_Q_DOT, HAS_K_DOT, HAS_V_DOT, PRECISION, DOCUMENTS, TILES, TILE_ROWS, TILE_COLS, HAS_KEY_MASK,
                TMA,
            )
    if HAS_DO_DOT:
        o_src = common.head_tile_source(O, batch, head, stride_ob, stride_oh, N, stride_on, HEAD_DIM, BLOCK_M, BLOCK_D,
                                        TMA)
        do_dot_src = common.head_tile_source(DO_DOT, batch, head, stride_dodb, stride_dodh, N, stride_dodn, HEAD_DIM,
                                             BLOCK_M, BLOCK_D, TMA)
        o = common.load_block(o_src, start_m, rows, N, stride_on, HEAD_DIM, BLOCK_D, TMA)
        do_dot = common.load_block(do_dot_src, start_m, rows, N, stride_dodn, HEAD_DIM, BLOCK_D, TMA)
        delta_dot += tl.sum(do_dot.to(acc_dtype) * o.to(acc_dtype), 1)
    common.store_rows(common.row_vector_pointer(R_DOT, batch_head, N), r_dot, rows, N)
    common.store_rows(common.row_vector_pointer(DELTA_DOT, batch_head, N), delta_dot, rows, N)


# ----------------------------------------------------------------------------- row sweep: dQ-dot


@triton.jit
def _dq_dot_inner(
    dq_dot, q, q_dot, do, do_dot, row_max, log_sum, delta, r_dot, delta_dot,
    k_src, v_src, k_dot_src, v_dot_src, stride_kn, stride_vn, stride_kdn, stride_vdn,
    start, end, M, qk_scale, scale, lo, hi, row_ids, k_ids_base,
    key_mask_base, own, tiles_base, tile_bits, query_tiles, key_tiles,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_Q_DOT: tl.constexpr, HAS_K_DOT: tl.constexpr, HAS_V_DOT: tl.constexpr, HAS_DO_DOT: tl.constexpr,
    PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr, TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr, TMA: tl.constexpr,
):
    r"""Add key blocks ``[start, end)`` to a query block's
    :math:`d\dot Q_i / \tau \mathrel{+}= \sum_j d\dot S_{ij} K_j + dS_{ij} \dot K_j` with
    :math:`d\dot S = P \circ ((\dot S - \dot r) \circ (dP - \Delta) + d\dot P - \dot\Delta)`; key-side tiles
    and the masks as in :func:`_o_dot_inner`."""
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k, v, k_dot, v_dot = common.load_tile_group(k_src, v_src, k_dot_src, v_dot_src, start_n, keys, M, stride_kn,
                                                    stride_vn, stride_kdn, stride_vdn, HEAD_DIM, BLOCK_D, HAS_K_DOT,
                                                    HAS_V_DOT, TMA)
        p = common.probabilities(q, k, row_max, log_sum, keys, M, qk_scale, lo, hi, row_ids, k_ids_base, key_mask_base,
                                 own, tiles_base, tile_bits, query_tiles, key_tiles, MASKED, PRECISION, DOCUMENTS,
                                 TILES, TILE_ROWS, TILE_COLS, HAS_KEY_MASK)
        dp_centered = tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None]
        g = tl.zeros_like(p) - delta_dot[:, None]
        if HAS_Q_DOT or HAS_K_DOT:
            s_dot = scale * common.bilinear_tile(q, q_dot, k, k_dot, HAS_DX=HAS_Q_DOT, HAS_DY=HAS_K_DOT,
                                                 TRANSPOSED=False, PRECISION=PRECISION)
            g += (s_dot - r_dot[:, None]) * dp_centered
        if HAS_DO_DOT or HAS_V_DOT:  # dP-dot = dO-dot V^T + dO V-dot^T
            g += common.bilinear_tile(do, do_dot, v, v_dot, HAS_DX=HAS_DO_DOT, HAS_DY=HAS_V_DOT, TRANSPOSED=False,
                                      PRECISION=PRECISION)
        dq_dot = common.add_product_change(dq_dot, p, g, dp_centered, k, k_dot, HAS_DY=HAS_K_DOT, PRECISION=PRECISION)
    return dq_dot


@triton.jit
def _dq_dot_kernel(
    Q, K, V, DO, Q_DOT, K_DOT, V_DOT, DO_DOT,
    DQ_DOT,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_qdb, stride_qdh, stride_qdn, stride_kdb, stride_kdh, stride_kdn, stride_vdb, stride_vdh, stride_vdn,
    stride_dodb, stride_dodh, stride_dodn,
    stride_dqdb, stride_dqdh, stride_dqdn,
    STATS, DELTA, R_DOT, DELTA_DOT, KEY_MASK, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, TILE_BITS,
    query_tiles, key_tiles, heads, group, N, M,
    qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BAND: tl.constexpr, HAS_Q_DOT: tl.constexpr, HAS_K_DOT: tl.constexpr, HAS_V_DOT: tl.constexpr,
    HAS_DO_DOT: tl.constexpr, PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    TMA: tl.constexpr,
):
    r""":math:`d\dot Q = \tau (d\dot S K + dS \dot K)` of one query block, with :math:`\dot r, \Delta, \dot\Delta`
    from the first sweep; key blocks split as in the forward, ``TMA`` (the ``"tma"`` variant) as there."""
    start_m, rows, batch_head, batch, head, kv_head, key_mask_base = common.query_block(heads, group, KEY_MASK, M, BLOCK_M)

    q_src, do_src, q_dot_src, do_dot_src = common.head_tile_sources(Q, DO, Q_DOT, DO_DOT, batch, head, stride_qb,
                                                                    stride_qh, stride_dob, stride_doh, stride_qdb,
                                                                    stride_qdh, stride_dodb, stride_dodh, N, stride_qn,
                                                                    stride_don, stride_qdn, stride_dodn, HEAD_DIM,
                                                                    BLOCK_M, BLOCK_D, HAS_Q_DOT, HAS_DO_DOT, TMA)
    q, do, q_dot, do_dot = common.load_tile_group(q_src, do_src, q_dot_src, do_dot_src, start_m, rows, N, stride_qn,
                                                  stride_don, stride_qdn, stride_dodn, HEAD_DIM, BLOCK_D, HAS_Q_DOT,
                                                  HAS_DO_DOT, TMA)
    row_max, log_sum = common.load_softmax_stats(common.softmax_stats_pointer(STATS, batch_head, N), rows, N)
    delta = common.load_rows(common.row_vector_pointer(DELTA, batch_head, N), rows, N)
    r_dot = common.load_rows(common.row_vector_pointer(R_DOT, batch_head, N), rows, N)
    delta_dot = common.load_rows(common.row_vector_pointer(DELTA_DOT, batch_head, N), rows, N)
    dq_dot = tl.zeros([BLOCK_M, BLOCK_D], dtype=DELTA.dtype.element_ty)

    k_src, v_src, k_dot_src, v_dot_src = common.head_tile_sources(K, V, K_DOT, V_DOT, batch, kv_head, stride_kb,
                                                                  stride_kh, stride_vb, stride_vh, stride_kdb,
                                                                  stride_kdh, stride_vdb, stride_vdh, M, stride_kn,
                                                                  stride_vn, stride_kdn, stride_vdn, HEAD_DIM, BLOCK_N,
                                                                  BLOCK_D, HAS_K_DOT, HAS_V_DOT, TMA)
    lo, hi, row_ids, k_ids_base, tiles_base, start, whole_start, whole_end, end = common.row_masks(
        rows, batch, N, M, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, query_tiles, key_tiles, BLOCK_N,
        BAND, DOCUMENTS, TILES)
    for phase in tl.static_range(3):  # the masked blocks, the whole ones, the masked ones
        first, last = common.sweep_phase(phase, start, whole_start, whole_end, end)
        dq_dot = _dq_dot_inner(
            dq_dot, q, q_dot, do, do_dot, row_max, log_sum, delta, r_dot, delta_dot, k_src, v_src, k_dot_src, v_dot_src,
            stride_kn, stride_vn, stride_kdn, stride_vdn, first, last, M, qk_scale, scale, lo, hi, row_ids, k_ids_base,
            key_mask_base, rows, tiles_base, TILE_BITS, query_tiles, key_tiles, HEAD_DIM, BLOCK_D, BLOCK_N, phase != 1,
            HAS_Q_DOT, HAS_K_DOT, HAS_V_DOT, HAS_DO_DOT, PRECISION, DOCUMENTS, TILES, TILE_ROWS, TILE_COLS,
            HAS_KEY_MASK, TMA,
        )
    common.store_head_block(DQ_DOT, dq_dot * scale, batch, head, stride_dqdb, stride_dqdh, start_m, rows, N,
                            stride_dqdn, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)


# ----------------------------------------------------------------------------- column sweep: dK-dot, dV-dot


@triton.jit
def _dk_dot_dv_dot_inner(
    dk_dot, dv_dot, k, v, k_dot, v_dot, q_src, do_src, q_dot_src, do_dot_src,
    stats_base, delta_base, r_dot_base, delta_dot_base, stride_qn, stride_don, stride_qdn, stride_dodn,
    keys, start, end, N, qk_scale, scale, lo, hi, key_ids, q_ids_base, key_mask_base, own, tiles_base, tile_bits,
    query_tiles, key_tiles, M,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
    HAS_Q_DOT: tl.constexpr, HAS_K_DOT: tl.constexpr, HAS_V_DOT: tl.constexpr, HAS_DO_DOT: tl.constexpr,
    PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr, TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr, TMA: tl.constexpr,
):
    r"""Add query rows ``[start, end)`` of one query head to a key block's

    .. math::
        d\dot K_j / \tau \mathrel{+}= \textstyle\sum_i d\dot S_{ij} Q_i + dS_{ij} \dot Q_i,\quad
        d\dot V_j \mathrel{+}= \sum_i P_{ij} (\dot S_{ij} - \dot r_i)\, dO_i + P_{ij}\, d\dot O_i

    with :math:`\dot r, \Delta, \dot\Delta` from the first sweep; tiles are kept transposed (keys by queries).
    Query-side tiles through their sources (:func:`~flashbob.kernels.common.tile_sources`).
    """
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q, do, q_dot, do_dot = common.load_tile_group(q_src, do_src, q_dot_src, do_dot_src, start_m, rows, N,
                                                      stride_qn, stride_don, stride_qdn, stride_dodn, HEAD_DIM,
                                                      BLOCK_D, HAS_Q_DOT, HAS_DO_DOT, TMA)
        row_max, log_sum = common.load_softmax_stats(stats_base, rows, N)
        delta = common.load_rows(delta_base, rows, N)
        delta_dot = common.load_rows(delta_dot_base, rows, N)
        p_t = common.probabilities_transposed(k, q, row_max, log_sum, rows, keys, N, M, qk_scale, lo, hi, key_ids,
                                              q_ids_base, key_mask_base, own, tiles_base, tile_bits, query_tiles,
                                              key_tiles, MASKED, PRECISION, DOCUMENTS, TILES, TILE_ROWS, TILE_COLS,
                                              HAS_KEY_MASK)
        dp_centered_t = tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :]
        g_t = tl.zeros_like(p_t) - delta_dot[None, :]
        if HAS_Q_DOT or HAS_K_DOT:
            r_dot = common.load_rows(r_dot_base, rows, N)
            # S-dot^T = K-dot Q^T + K Q-dot^T
            s_dot_t = scale * common.bilinear_tile(k, k_dot, q, q_dot, HAS_DX=HAS_K_DOT, HAS_DY=HAS_Q_DOT,
                                                   TRANSPOSED=False, PRECISION=PRECISION)
            s_dot_centered_t = s_dot_t - r_dot[None, :]
            g_t += s_dot_centered_t * dp_centered_t
            dv_dot += tl.dot((p_t * s_dot_centered_t).to(do.dtype), do, input_precision=PRECISION)
        if HAS_DO_DOT or HAS_V_DOT:
            g_t += common.bilinear_tile(v, v_dot, do, do_dot, HAS_DX=HAS_V_DOT, HAS_DY=HAS_DO_DOT, TRANSPOSED=False,
                                        PRECISION=PRECISION)
        dk_dot = common.add_product_change(dk_dot, p_t, g_t, dp_centered_t, q, q_dot, HAS_DY=HAS_Q_DOT,
                                           PRECISION=PRECISION)
        if HAS_DO_DOT:
            dv_dot += tl.dot(p_t.to(do_dot.dtype), do_dot, input_precision=PRECISION)
    return dk_dot, dv_dot


@triton.jit
def _dk_dot_dv_dot_kernel(
    Q, K, V, DO, Q_DOT, K_DOT, V_DOT, DO_DOT,
    DK_DOT, DV_DOT,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_qdb, stride_qdh, stride_qdn, stride_kdb, stride_kdh, stride_kdn, stride_vdb, stride_vdh, stride_vdn,
    stride_dodb, stride_dodh, stride_dodn,
    stride_dkdb, stride_dkdh, stride_dkdn, stride_dvdb, stride_dvdh, stride_dvdn,
    STATS, DELTA, R_DOT, DELTA_DOT, KEY_MASK, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, TILE_BITS,
    query_tiles, key_tiles, heads, kv_heads, group,
    N, M, qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BAND: tl.constexpr, HAS_Q_DOT: tl.constexpr, HAS_K_DOT: tl.constexpr, HAS_V_DOT: tl.constexpr,
    HAS_DO_DOT: tl.constexpr, PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    TMA: tl.constexpr,
):
    r""":math:`d\dot K = \tau (d\dot S^\top Q + dS^\top \dot Q)` and
    :math:`d\dot V = (P \circ (\dot S - \dot r))^\top dO + P^\top d\dot O` of one key block of one kv head,
    summed over the ``group`` query heads sharing it; the query rows are split as in the dK/dV kernel. One sweep for both: a dK-dot sweep and a dV-dot sweep apart (8 + 5 products against 10)
    took 36.4 ms against 24.3 ms on the H200 (bf16, d = 128, H = 16, N = 16K, tuned configs). ``TMA`` (the
    ``"tma"`` variant): tiles through tensor descriptors."""
    start_n, keys, batch, kv_head, key_mask_base = common.key_block(kv_heads, KEY_MASK, M, BLOCK_N)
    acc_dtype = DELTA.dtype.element_ty
    dk_dot = tl.zeros([BLOCK_N, BLOCK_D], dtype=acc_dtype)
    dv_dot = tl.zeros([BLOCK_N, BLOCK_D], dtype=acc_dtype)
    k_src, v_src, k_dot_src, v_dot_src = common.head_tile_sources(K, V, K_DOT, V_DOT, batch, kv_head, stride_kb,
                                                                  stride_kh, stride_vb, stride_vh, stride_kdb,
                                                                  stride_kdh, stride_vdb, stride_vdh, M, stride_kn,
                                                                  stride_vn, stride_kdn, stride_vdn, HEAD_DIM, BLOCK_N,
                                                                  BLOCK_D, HAS_K_DOT, HAS_V_DOT, TMA)
    k, v, k_dot, v_dot = common.load_tile_group(k_src, v_src, k_dot_src, v_dot_src, start_n, keys, M, stride_kn,
                                                stride_vn, stride_kdn, stride_vdn, HEAD_DIM, BLOCK_D, HAS_K_DOT,
                                                HAS_V_DOT, TMA)

    lo, hi, key_ids, q_ids_base, tiles_base, start, whole_start, whole_end, end = common.column_masks(
        keys, batch, N, M, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, query_tiles, key_tiles, BLOCK_M,
        BAND, DOCUMENTS, TILES)
    for member in tl.range(group, num_stages=1):  # never pipelined: common.group_query_head
        head, batch_head, q_base, do_base, stats_base, delta_base = common.group_query_head(
            Q, DO, STATS, DELTA, batch, heads, kv_head, group, member, N, stride_qb, stride_qh, stride_dob, stride_doh)
        q_dot_base = common.head_pointer(Q_DOT, batch, head, stride_qdb, stride_qdh)
        do_dot_base = common.head_pointer(DO_DOT, batch, head, stride_dodb, stride_dodh)
        q_src, do_src, q_dot_src, do_dot_src = common.tile_sources(q_base, do_base, q_dot_base, do_dot_base, N,
                                                                   stride_qn, stride_don, stride_qdn, stride_dodn,
                                                                   HEAD_DIM, BLOCK_M, BLOCK_D, HAS_Q_DOT, HAS_DO_DOT,
                                                                   TMA)
        r_dot_base = common.row_vector_pointer(R_DOT, batch_head, N)
        delta_dot_base = common.row_vector_pointer(DELTA_DOT, batch_head, N)
        for phase in tl.static_range(3):  # the masked blocks, the whole ones, the masked ones
            first, last = common.sweep_phase(phase, start, whole_start, whole_end, end)
            dk_dot, dv_dot = _dk_dot_dv_dot_inner(
                dk_dot, dv_dot, k, v, k_dot, v_dot, q_src, do_src, q_dot_src, do_dot_src, stats_base, delta_base,
                r_dot_base, delta_dot_base, stride_qn, stride_don, stride_qdn, stride_dodn, keys, first, last, N,
                qk_scale, scale, lo, hi, key_ids, q_ids_base, key_mask_base, keys, tiles_base, TILE_BITS, query_tiles,
                key_tiles, M, HEAD_DIM, BLOCK_D, BLOCK_M, phase != 1, HAS_Q_DOT, HAS_K_DOT, HAS_V_DOT, HAS_DO_DOT,
                PRECISION, DOCUMENTS, TILES, TILE_ROWS, TILE_COLS, HAS_KEY_MASK, TMA,
            )

    common.store_head_block(DK_DOT, dk_dot * scale, batch, kv_head, stride_dkdb, stride_dkdh, start_n, keys, M,
                            stride_dkdn, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    common.store_head_block(DV_DOT, dv_dot, batch, kv_head, stride_dvdb, stride_dvdh, start_n, keys, M, stride_dvdn,
                            HEAD_DIM, BLOCK_N, BLOCK_D, TMA)


# ----------------------------------------------------------------------------- host wrappers


def _tangent_operand(x: torch.Tensor | None, placeholder: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """An absent tangent's kernel argument is ``placeholder`` (never read), a present one's is :func:`operand`."""
    return placeholder if x is None else common.operand(x, q)


def forward_jvp(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, stats: torch.Tensor,
    q_dot: torch.Tensor | None, k_dot: torch.Tensor | None, v_dot: torch.Tensor | None,
    *, causal: bool, scale: float, key_mask: torch.Tensor | None = None, allow_tf32: bool = False, window=None,
    q_ids: torch.Tensor | None = None, k_ids: torch.Tensor | None = None,
    tile_state: torch.Tensor | None = None, tile_bits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Forward mode of attention: the tangents of :math:`O` and of the statistics along :math:`(\dot Q, \dot K, \dot V)`.

    .. math::
        \dot S = \tau(\dot Q K^\top + Q \dot K^\top),\quad \dot r_i = \textstyle\sum_j P_{ij} \dot S_{ij},\quad
        \dot O = (P \circ \dot S) V - \dot r \circ O + P \dot V

    in one row sweep (P from the forward's statistics, no N x M tensor).

    Args:
        q, k, v, causal, scale, allow_tf32, key_mask, window, q_ids, k_ids: as in :func:`flashbob.kernels.forward`.
        o, stats: the forward's outputs (constants here).
        q_dot: ``(B, H, N, d)``; k_dot, v_dot: ``(B, Hkv, M, d)``; each may be None (= zero), which compiles
            its terms out. When all three are None, zeros are returned without a launch.

    Returns:
        ``o_dot`` shaped and typed like ``q``; 0 in rows that see no key. ``stats_dot``, a tangent of ``stats``
        whose :func:`~flashbob.kernels.common.logsumexp` (a linear map) is :math:`\dot r`
        (:func:`~flashbob.kernels.common.statistics_tangent`): :func:`backward_jvp` takes both and then needs
        no sweep for its row scalars.
    """
    common.check_qkv(q, k, v)
    common.check_shaped_like(("o", o, q), ("q_dot", q_dot, q), ("k_dot", k_dot, k), ("v_dot", v_dot, v))
    if q_dot is None and k_dot is None and v_dot is None:
        return torch.zeros_like(q), torch.zeros_like(stats)
    masks = common.KernelMasks(q, k, causal=causal, window=window, key_mask=key_mask, q_ids=q_ids, k_ids=k_ids,
                               tile_state=tile_state, tile_bits=tile_bits)
    q, k, v, o = (common.operand(x, q) for x in (q, k, v, o))
    stats = common.softmax_stats(stats, q)
    r_dot = torch.empty(q.shape[:3], dtype=stats.dtype, device=q.device)
    constants = common.kernel_constants(q, masks, allow_tf32, HAS_Q_DOT=q_dot is not None,
                                        HAS_K_DOT=k_dot is not None, HAS_V_DOT=v_dot is not None)
    q_dot, k_dot, v_dot = (_tangent_operand(x, like, q) for x, like in ((q_dot, q), (k_dot, k), (v_dot, k)))
    o_dot = torch.empty_like(q)
    batch, heads, n, head_dim = q.shape
    configs.launch(
        "jvp_fwd", _o_dot_kernel, common.row_grid(n, batch * heads),
        *common.with_strides(q, k, v, o, q_dot, k_dot, v_dot, o_dot), stats, r_dot, *masks.row_arguments(),
        heads, heads // k.shape[1], n, k.shape[2], scale * common.LOG2E.value, scale, head_dim=head_dim, dtype=q.dtype,
        length=n, descriptors=(q, k, v, o, q_dot, k_dot, v_dot, o_dot), **constants,
    )
    return o_dot, common.statistics_tangent(r_dot)


def backward_jvp(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, o: torch.Tensor, stats: torch.Tensor,
    delta: torch.Tensor, q_dot: torch.Tensor | None, k_dot: torch.Tensor | None, v_dot: torch.Tensor | None,
    do_dot: torch.Tensor | None, *, causal: bool, scale: float, key_mask: torch.Tensor | None = None,
    allow_tf32: bool = False, o_dot: torch.Tensor | None = None, stats_dot: torch.Tensor | None = None, window=None,
    q_ids: torch.Tensor | None = None, k_ids: torch.Tensor | None = None,
    tile_state: torch.Tensor | None = None, tile_bits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Forward mode of the backward: the tangents of :math:`(dQ, dK, dV)` along :math:`(\dot Q, \dot K, \dot V, d\dot O)`.

    .. math::
        \dot\Delta_i = d\dot O_i \cdot O_i + dO_i \cdot \dot O_i,\quad
        d\dot S = P \circ ((\dot S - \dot r) \circ (dP - \Delta) + d\dot O V^\top + dO \dot V^\top - \dot\Delta),\\
        d\dot Q = \tau(d\dot S K + dS \dot K),\quad d\dot K = \tau(d\dot S^\top Q + dS^\top \dot Q),\quad
        d\dot V = (P \circ (\dot S - \dot r))^\top dO + P^\top d\dot O

    in three sweeps: rows (:math:`\dot r` and :math:`\dot\Delta`, with
    :math:`dO_i \cdot \dot O_i = \sum_j P_{ij} (\dot S_{ij} (dP_{ij} - \Delta_i) + (dO \dot V^\top)_{ij})`
    summed in float32), rows (:math:`d\dot Q`), columns (:math:`d\dot K, d\dot V`). Given the tangents of
    O and of the statistics (``o_dot``, ``stats_dot`` from :func:`forward_jvp`, as in a forward-over-reverse
    product, where the forward's tangent is computed anyway), the first sweep is not needed:
    :math:`\dot r` is the statistics' tangent's log-sum-exp and :math:`\dot\Delta` two row dot products.
    Without them O, the statistics and Δ are constants: the formulas contain every path through them.

    Args:
        q, k, v, causal, scale, allow_tf32, key_mask, window, q_ids, k_ids: as in :func:`flashbob.kernels.forward`.
        do: the cotangent the backward was run with; o, stats: forward outputs; delta: from the backward.
        o_dot, stats_dot: both or neither: the tangents of ``o`` and ``stats`` along the same ``q_dot, k_dot,
            v_dot`` (:func:`forward_jvp`'s).
        q_dot, do_dot: ``(B, H, N, d)``; k_dot, v_dot: ``(B, Hkv, M, d)``; each may be None (= zero), which
            compiles its terms out. When all four and ``o_dot`` are None, zeros are returned without a launch.

    Returns:
        ``(dq_dot, dk_dot, dv_dot)`` shaped and typed like ``q, k, v`` (``dk_dot``, ``dv_dot`` summed over
        the query heads of each kv group); 0 from rows that see no key.
    """
    common.check_qkv(q, k, v)
    common.check_shaped_like(("do", do, q), ("o", o, q), ("q_dot", q_dot, q), ("k_dot", k_dot, k), ("v_dot", v_dot, v),
                             ("do_dot", do_dot, q))
    check_forward_tangents(o_dot, stats_dot)
    if q_dot is None and k_dot is None and v_dot is None and do_dot is None and o_dot is None:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    masks = common.KernelMasks(q, k, causal=causal, window=window, key_mask=key_mask, q_ids=q_ids, k_ids=k_ids,
                               tile_state=tile_state, tile_bits=tile_bits)
    q, k, v, do, o = (common.operand(x, q) for x in (q, k, v, do, o))
    batch, heads, n, head_dim = q.shape
    kv_heads, m = k.shape[1], k.shape[2]
    stats, delta = common.softmax_stats(stats, q), common.row_statistic(delta, q)
    constants = common.kernel_constants(q, masks, allow_tf32, HAS_Q_DOT=q_dot is not None,
                                        HAS_K_DOT=k_dot is not None, HAS_V_DOT=v_dot is not None,
                                        HAS_DO_DOT=do_dot is not None)
    tangents = tuple(
        _tangent_operand(x, like, q) for x, like in ((q_dot, q), (k_dot, k), (v_dot, k), (do_dot, q))
    )
    dq_dot, dk_dot, dv_dot = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    scalars = (heads // kv_heads, n, m, scale * common.LOG2E.value, scale)
    if o_dot is None:
        r_dot, delta_dot = torch.empty_like(delta), torch.empty_like(delta)
        configs.launch(
            "jvp_rows", _row_scalars_kernel, common.row_grid(n, batch * heads),
            *common.with_strides(q, k, v, o, do, *tangents), stats, delta, r_dot, delta_dot,
            *masks.row_arguments(), heads, *scalars, head_dim=head_dim, dtype=q.dtype, length=n,
            descriptors=(q, k, v, o, do, *tangents),
            **constants,
        )
    else:
        common.check_shaped_like(("o_dot", o_dot, q), ("stats_dot", stats_dot, stats))
        r_dot = common.logsumexp(common.softmax_stats(stats_dot, q)).contiguous()
        delta_dot = row_dot_products(do, common.operand(o_dot, q))
        if do_dot is not None:
            delta_dot += row_dot_products(common.operand(do_dot, q), o)
    row_scalars = (stats, delta, r_dot, delta_dot)
    configs.launch(
        "jvp_dq", _dq_dot_kernel, common.row_grid(n, batch * heads),
        *common.with_strides(q, k, v, do, *tangents, dq_dot), *row_scalars, *masks.row_arguments(), heads,
        *scalars, head_dim=head_dim, dtype=q.dtype, length=n, descriptors=(q, k, v, do, *tangents, dq_dot), **constants,
    )
    configs.launch(
        "jvp_cols", _dk_dot_dv_dot_kernel, common.column_grid(m, batch * kv_heads),
        *common.with_strides(q, k, v, do, *tangents, dk_dot, dv_dot), *row_scalars, *masks.column_arguments(),
        heads, kv_heads, *scalars,
        head_dim=head_dim, dtype=q.dtype, length=m, descriptors=(q, k, v, do, *tangents, dk_dot, dv_dot), **constants,
    )
    return dq_dot, dk_dot, dv_dot
