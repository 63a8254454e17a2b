"""Backward-over-backward of attention: row sweeps (Q̄, dŌ, A, C), then a column sweep (K̄, V̄)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from .common import (
    LOG2E,
    check_qkv,
    column_block_masked_end,
    dot_precision,
    head_dim_block,
    head_pointer,
    key_mask_operand,
    key_mask_pointer,
    load_softmax_stats,
    load_tile,
    operand,
    probabilities,
    probabilities_transposed,
    row_block_key_ranges,
    row_statistic,
    row_vector_pointer,
    softmax_stats,
    softmax_stats_pointer,
    store_tile,
    strides,
)

# Row sweeps of the schedules (the PHASE of _bob_rows_kernel):
TWO_PASS_ROWS = tl.constexpr(0)  # two-pass: A, C and the row outputs in one sweep (four d-vector accumulators)
SCALARS = tl.constexpr(1)  # three- and four-pass, sweep 1: only the row scalars A, C
DIRECT_ROWS = tl.constexpr(2)  # three-pass, sweep 2: both row outputs from G_S, G_dP with A, C known
Q_BAR_ROWS = tl.constexpr(3)  # four-pass, sweep 2: Q-bar alone (one accumulator)
DO_BAR_ROWS = tl.constexpr(4)  # four-pass, sweep 3: dO-bar alone (one accumulator, no dP)


@triton.jit
def _bob_rows_inner(
    a, c, r1, r2, r3, r4, q, do, u_bar, row_max, log_sum, delta,
    k_base, v_base, w_bar_base, z_bar_base, stride_kn, stride_vn, stride_wn, stride_zn,
    rows, start, end, M, qk_scale, scale, key_mask_base,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASK_CAUSAL: tl.constexpr,
    HAS_DQ_BAR: tl.constexpr, HAS_DK_BAR: tl.constexpr, HAS_DV_BAR: tl.constexpr, PRECISION: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, PHASE: tl.constexpr,
):
    r"""Add key blocks ``[start, end)`` to a query block's row scalars and d-vectors.

    Per tile, with :math:`\bar A = \tau(\bar U K^\top + Q \bar W^\top)`, :math:`\bar B = dO \bar Z^\top`,
    :math:`dP = dO V^\top` and :math:`X = (dP - \Delta) \circ \bar A + \bar B`:

    * ``TWO_PASS_ROWS``: :math:`a_i \mathrel{+}= \sum_j P_{ij} \bar A_{ij}`,
      :math:`c_i \mathrel{+}= \sum_j P_{ij} X_{ij}`, :math:`r_1 \mathrel{+}= (P \circ X) K + dS\, \bar W`,
      :math:`r_2 \mathrel{+}= (P \circ dP) K`, :math:`r_3 \mathrel{+}= P K`,
      :math:`r_4 \mathrel{+}= (P \circ \bar A) V + P \bar Z`;
    * ``SCALARS``: only ``a`` and ``c``;
    * ``DIRECT_ROWS`` (``a``, ``c`` hold the finished :math:`A, C`): :math:`r_1 \mathrel{+}= G_S K + dS\, \bar W`
      and :math:`r_4 \mathrel{+}= G_{dP} V + P \bar Z` (``Q_BAR_ROWS``: only :math:`r_1`; ``DO_BAR_ROWS``: only
      :math:`r_4`, without :math:`dP`) with :math:`G_S = P \circ (X - A\, dP - C)` and
      :math:`G_{dP} = P \circ (\bar A - A)`. They equal the two-pass row outputs (:math:`\sum_j P_{ij} V_j = O_i`)
      without their cancellation: with one-hot rows :math:`r_1 - A r_2 - C r_3` and :math:`r_4 - A O` cancel
      to ~0 after each term was rounded to the input dtype, which costs bf16 a few times eager's error.

    Terms of absent cotangents are compiled out; without :math:`\bar U` and :math:`\bar W`,
    :math:`\bar A = 0` and ``a``, ``r2`` stay zero.
    """
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(k_base, keys, M, stride_kn, HEAD_DIM, BLOCK_D)
        v = load_tile(v_base, keys, M, stride_vn, HEAD_DIM, BLOCK_D)
        if HAS_DK_BAR:
            w_bar = load_tile(w_bar_base, keys, M, stride_wn, HEAD_DIM, BLOCK_D)
        if HAS_DV_BAR:
            z_bar = load_tile(z_bar_base, keys, M, stride_zn, HEAD_DIM, BLOCK_D)
        p = probabilities(q, k, row_max, log_sum, rows, keys, M, qk_scale, MASK_CAUSAL, PRECISION, key_mask_base,
                          HAS_KEY_MASK)
        if PHASE != DO_BAR_ROWS:
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            dp_centered = dp - delta[:, None]
        x = tl.zeros_like(p)
        if HAS_DQ_BAR or HAS_DK_BAR:
            a_bar = tl.zeros_like(p)
            if HAS_DQ_BAR:
                a_bar += tl.dot(u_bar, tl.trans(k), input_precision=PRECISION)
            if HAS_DK_BAR:
                a_bar += tl.dot(q, tl.trans(w_bar), input_precision=PRECISION)
            a_bar = a_bar * scale
            if PHASE != DO_BAR_ROWS:
                x += dp_centered * a_bar
            if PHASE == TWO_PASS_ROWS or PHASE == SCALARS:
                p_a_bar = p * a_bar
                a += tl.sum(p_a_bar, 1)
            if PHASE == TWO_PASS_ROWS:
                r2 += tl.dot((p * dp).to(k.dtype), k, input_precision=PRECISION)
                r4 += tl.dot(p_a_bar.to(v.dtype), v, input_precision=PRECISION)
            if PHASE == DIRECT_ROWS or PHASE == DO_BAR_ROWS:  # G_dP = P o (A-bar - A), formed before the rounding
                r4 += tl.dot((p * (a_bar - a[:, None])).to(v.dtype), v, input_precision=PRECISION)
        if HAS_DV_BAR:
            if PHASE != DO_BAR_ROWS:
                x += tl.dot(do, tl.trans(z_bar), input_precision=PRECISION)
            if PHASE == TWO_PASS_ROWS or PHASE == DIRECT_ROWS or PHASE == DO_BAR_ROWS:
                r4 += tl.dot(p.to(z_bar.dtype), z_bar, input_precision=PRECISION)
        if PHASE == DIRECT_ROWS or PHASE == Q_BAR_ROWS:
            g_s = p * (x - a[:, None] * dp - c[:, None])
            r1 += tl.dot(g_s.to(k.dtype), k, input_precision=PRECISION)
        if PHASE == TWO_PASS_ROWS or PHASE == SCALARS:
            p_x = p * x
            c += tl.sum(p_x, 1)
            if PHASE == TWO_PASS_ROWS:
                r1 += tl.dot(p_x.to(k.dtype), k, input_precision=PRECISION)
                r3 += tl.dot(p.to(k.dtype), k, input_precision=PRECISION)
        if HAS_DK_BAR and (PHASE == TWO_PASS_ROWS or PHASE == DIRECT_ROWS or PHASE == Q_BAR_ROWS):
            r1 += tl.dot((p * dp_centered).to(w_bar.dtype), w_bar, input_precision=PRECISION)
    return a, c, r1, r2, r3, r4


@triton.jit
def _bob_rows_kernel(
    Q, K, V, O, DO, STATS, DELTA, U_BAR, W_BAR, Z_BAR, Q_BAR, DO_BAR, A, C,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don,
    stride_ub, stride_uh, stride_un, stride_wb, stride_wh, stride_wn, stride_zb, stride_zh, stride_zn,
    stride_qbb, stride_qbh, stride_qbn, stride_dobb, stride_dobh, stride_dobn,
    heads, group, N, M, qk_scale, scale, KEY_MASK,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_DQ_BAR: tl.constexpr, HAS_DK_BAR: tl.constexpr, HAS_DV_BAR: tl.constexpr,
    PRECISION: tl.constexpr, HAS_KEY_MASK: tl.constexpr, PHASE: tl.constexpr,
):
    r"""A row sweep of BoB for one query block (``PHASE``, see :func:`_bob_rows_inner`), then its outputs:

    .. math::
        A_i = a_i,\quad C_i = c_i - A_i \Delta_i,\quad
        \bar Q_i = \tau\,(r_{1,i} - A_i r_{2,i} - C_i r_{3,i}),\quad d\bar O_i = r_{4,i} - A_i O_i

    ``TWO_PASS_ROWS`` stores all four (:math:`A, C` for the column sweep); ``SCALARS`` stores
    :math:`A, C`; ``DIRECT_ROWS`` reads them and stores :math:`\bar Q_i = \tau\, r_{1,i}` and
    :math:`d\bar O_i = r_{4,i}`. Absent cotangents' pointers are never read.
    """
    start_m = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1)
    batch, head = batch_head // heads, batch_head % heads
    kv_head = head // group
    k_base = head_pointer(K, batch, kv_head, stride_kb, stride_kh)
    v_base = head_pointer(V, batch, kv_head, stride_vb, stride_vh)
    w_bar_base = head_pointer(W_BAR, batch, kv_head, stride_wb, stride_wh)
    z_bar_base = head_pointer(Z_BAR, batch, kv_head, stride_zb, stride_zh)
    key_mask_base = key_mask_pointer(KEY_MASK, batch, M)

    rows = start_m + tl.arange(0, BLOCK_M)
    q = load_tile(head_pointer(Q, batch, head, stride_qb, stride_qh), rows, N, stride_qn, HEAD_DIM, BLOCK_D)
    do = load_tile(head_pointer(DO, batch, head, stride_dob, stride_doh), rows, N, stride_don, HEAD_DIM, BLOCK_D)
    if HAS_DQ_BAR:
        u_bar = load_tile(head_pointer(U_BAR, batch, head, stride_ub, stride_uh), rows, N, stride_un, HEAD_DIM, BLOCK_D)
    else:
        u_bar = tl.zeros_like(q)  # placeholder, never read
    row_max, log_sum = load_softmax_stats(softmax_stats_pointer(STATS, batch_head, N), rows, N)
    delta = tl.load(row_vector_pointer(DELTA, batch_head, N) + rows, mask=rows < N, other=0.0)
    acc_dtype = DELTA.dtype.element_ty
    if PHASE == DIRECT_ROWS or PHASE == Q_BAR_ROWS or PHASE == DO_BAR_ROWS:
        a = tl.load(row_vector_pointer(A, batch_head, N) + rows, mask=rows < N, other=0.0)
        c = tl.load(row_vector_pointer(C, batch_head, N) + rows, mask=rows < N, other=0.0)
    else:
        a = tl.zeros([BLOCK_M], dtype=acc_dtype)
        c = tl.zeros([BLOCK_M], dtype=acc_dtype)
    r1 = tl.zeros([BLOCK_M, BLOCK_D], dtype=acc_dtype)
    r2 = tl.zeros([BLOCK_M, BLOCK_D], dtype=acc_dtype)
    r3 = tl.zeros([BLOCK_M, BLOCK_D], dtype=acc_dtype)
    r4 = tl.zeros([BLOCK_M, BLOCK_D], dtype=acc_dtype)

    unmasked_end, end = row_block_key_ranges(start_m, M, BLOCK_M, BLOCK_N, CAUSAL)
    a, c, r1, r2, r3, r4 = _bob_rows_inner(
        a, c, r1, r2, r3, r4, q, do, u_bar, row_max, log_sum, delta, k_base, v_base, w_bar_base, z_bar_base,
        stride_kn, stride_vn, stride_wn, stride_zn, rows, 0, unmasked_end, M, qk_scale, scale,
        key_mask_base, HEAD_DIM, BLOCK_D, BLOCK_N, False, HAS_DQ_BAR, HAS_DK_BAR, HAS_DV_BAR, PRECISION, HAS_KEY_MASK,
        PHASE,
    )
    if CAUSAL:
        a, c, r1, r2, r3, r4 = _bob_rows_inner(
            a, c, r1, r2, r3, r4, q, do, u_bar, row_max, log_sum, delta, k_base, v_base, w_bar_base, z_bar_base,
            stride_kn, stride_vn, stride_wn, stride_zn, rows, unmasked_end, end, M, qk_scale, scale,
            key_mask_base, HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_DQ_BAR, HAS_DK_BAR, HAS_DV_BAR, PRECISION,
            HAS_KEY_MASK, PHASE,
        )

    if PHASE == TWO_PASS_ROWS or PHASE == SCALARS:
        c = c - a * delta
        tl.store(row_vector_pointer(A, batch_head, N) + rows, a, mask=rows < N)
        tl.store(row_vector_pointer(C, batch_head, N) + rows, c, mask=rows < N)
    if PHASE == TWO_PASS_ROWS:
        q_bar = scale * (r1 - a[:, None] * r2 - c[:, None] * r3)
        o = load_tile(head_pointer(O, batch, head, stride_ob, stride_oh), rows, N, stride_on, HEAD_DIM, BLOCK_D)
        do_bar = r4 - a[:, None] * o.to(acc_dtype)
    else:
        q_bar = scale * r1
        do_bar = r4
    if PHASE == TWO_PASS_ROWS or PHASE == DIRECT_ROWS or PHASE == Q_BAR_ROWS:
        q_bar_base = head_pointer(Q_BAR, batch, head, stride_qbb, stride_qbh)
        store_tile(q_bar_base, q_bar, rows, N, stride_qbn, HEAD_DIM, BLOCK_D)
    if PHASE == TWO_PASS_ROWS or PHASE == DIRECT_ROWS or PHASE == DO_BAR_ROWS:
        do_bar_base = head_pointer(DO_BAR, batch, head, stride_dobb, stride_dobh)
        store_tile(do_bar_base, do_bar, rows, N, stride_dobn, HEAD_DIM, BLOCK_D)


@triton.jit
def _bob_columns_inner(
    k_bar, v_bar, k, v, w_bar, z_bar,
    q_base, do_base, u_bar_base, stats_base, delta_base, a_base, c_base, stride_qn, stride_don, stride_un,
    keys, start, end, N, qk_scale, scale, key_mask_base, M,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, MASK_CAUSAL: tl.constexpr,
    HAS_DQ_BAR: tl.constexpr, HAS_DK_BAR: tl.constexpr, HAS_DV_BAR: tl.constexpr, PRECISION: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr,
):
    r"""Add query rows ``[start, end)`` of one query head to a key block's

    .. math::
        \bar K_j / \tau \mathrel{+}= \textstyle\sum_i G_{S,ij} Q_i + dS_{ij} \bar U_i,\quad
        \bar V_j \mathrel{+}= \sum_i G_{dP,ij}\, dO_i,\\
        G_{dP} = P \circ (\bar A - A),\quad G_S = P \circ ((dP - \Delta) \circ \bar A - A\, dP + \bar B - C)

    with :math:`A, C` from the row sweep; tiles are kept transposed (keys by queries).
    """
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q = load_tile(q_base, rows, N, stride_qn, HEAD_DIM, BLOCK_D)
        do = load_tile(do_base, rows, N, stride_don, HEAD_DIM, BLOCK_D)
        if HAS_DQ_BAR:
            u_bar = load_tile(u_bar_base, rows, N, stride_un, HEAD_DIM, BLOCK_D)
        row_max, log_sum = load_softmax_stats(stats_base, rows, N)
        delta = tl.load(delta_base + rows, mask=rows < N, other=0.0)
        c = tl.load(c_base + rows, mask=rows < N, other=0.0)
        p_t = probabilities_transposed(
            k, q, row_max, log_sum, rows, keys, qk_scale, MASK_CAUSAL, PRECISION, key_mask_base, M, HAS_KEY_MASK
        )
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dp_centered_t = dp_t - delta[None, :]
        g_s_t = tl.zeros_like(p_t) - c[None, :]
        if HAS_DQ_BAR or HAS_DK_BAR:
            a = tl.load(a_base + rows, mask=rows < N, other=0.0)
            a_bar_t = tl.zeros_like(p_t)
            if HAS_DQ_BAR:
                a_bar_t += tl.dot(k, tl.trans(u_bar), input_precision=PRECISION)
            if HAS_DK_BAR:
                a_bar_t += tl.dot(w_bar, tl.trans(q), input_precision=PRECISION)
            a_bar_t = a_bar_t * scale
            g_s_t += dp_centered_t * a_bar_t - a[None, :] * dp_t
            g_dp_t = p_t * (a_bar_t - a[None, :])
            v_bar += tl.dot(g_dp_t.to(do.dtype), do, input_precision=PRECISION)
        if HAS_DV_BAR:
            g_s_t += tl.dot(z_bar, tl.trans(do), input_precision=PRECISION)
        k_bar += tl.dot((p_t * g_s_t).to(q.dtype), q, input_precision=PRECISION)
        if HAS_DQ_BAR:
            k_bar += tl.dot((p_t * dp_centered_t).to(u_bar.dtype), u_bar, input_precision=PRECISION)
    return k_bar, v_bar


@triton.jit
def _bob_columns_kernel(
    Q, K, V, DO, STATS, DELTA, A, C, U_BAR, W_BAR, Z_BAR, K_BAR, V_BAR,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don, stride_ub, stride_uh, stride_un,
    stride_wb, stride_wh, stride_wn, stride_zb, stride_zh, stride_zn,
    stride_kbb, stride_kbh, stride_kbn, stride_vbb, stride_vbh, stride_vbn,
    heads, kv_heads, group, N, M, qk_scale, scale, KEY_MASK,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_DQ_BAR: tl.constexpr, HAS_DK_BAR: tl.constexpr, HAS_DV_BAR: tl.constexpr,
    PRECISION: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
):
    r"""BoB pass 2 for one key block of one kv head: :math:`\bar K = \tau (G_S^\top Q + dS^\top \bar U)`
    and :math:`\bar V = G_{dP}^\top dO`, summed over the ``group`` query heads sharing it; the
    causal split of the query rows is the one of the dK/dV kernel."""
    start_n = tl.program_id(0) * BLOCK_N
    batch_kv_head = tl.program_id(1)
    batch, kv_head = batch_kv_head // kv_heads, batch_kv_head % kv_heads
    keys = start_n + tl.arange(0, BLOCK_N)
    key_mask_base = key_mask_pointer(KEY_MASK, batch, M)
    k = load_tile(head_pointer(K, batch, kv_head, stride_kb, stride_kh), keys, M, stride_kn, HEAD_DIM, BLOCK_D)
    v = load_tile(head_pointer(V, batch, kv_head, stride_vb, stride_vh), keys, M, stride_vn, HEAD_DIM, BLOCK_D)
    if HAS_DK_BAR:
        w_bar_base = head_pointer(W_BAR, batch, kv_head, stride_wb, stride_wh)
        w_bar = load_tile(w_bar_base, keys, M, stride_wn, HEAD_DIM, BLOCK_D)
    else:
        w_bar = tl.zeros_like(k)  # placeholder, never read
    if HAS_DV_BAR:
        z_bar_base = head_pointer(Z_BAR, batch, kv_head, stride_zb, stride_zh)
        z_bar = load_tile(z_bar_base, keys, M, stride_zn, HEAD_DIM, BLOCK_D)
    else:
        z_bar = tl.zeros_like(k)  # placeholder, never read
    acc_dtype = DELTA.dtype.element_ty
    k_bar = tl.zeros([BLOCK_N, BLOCK_D], dtype=acc_dtype)
    v_bar = tl.zeros([BLOCK_N, BLOCK_D], dtype=acc_dtype)

    masked_end = column_block_masked_end(start_n, N, BLOCK_M, BLOCK_N, CAUSAL)
    for member in range(group):
        head = kv_head * group + member
        batch_head = batch * heads + head
        q_base = head_pointer(Q, batch, head, stride_qb, stride_qh)
        do_base = head_pointer(DO, batch, head, stride_dob, stride_doh)
        u_bar_base = head_pointer(U_BAR, batch, head, stride_ub, stride_uh)
        stats_base = softmax_stats_pointer(STATS, batch_head, N)
        delta_base = row_vector_pointer(DELTA, batch_head, N)
        a_base = row_vector_pointer(A, batch_head, N)
        c_base = row_vector_pointer(C, batch_head, N)
        if CAUSAL:
            k_bar, v_bar = _bob_columns_inner(
                k_bar, v_bar, k, v, w_bar, z_bar, q_base, do_base, u_bar_base, stats_base, delta_base, a_base,
                c_base, stride_qn, stride_don, stride_un, keys, start_n, masked_end, N, qk_scale, scale,
                key_mask_base, M, HEAD_DIM, BLOCK_D, BLOCK_M, True, HAS_DQ_BAR, HAS_DK_BAR, HAS_DV_BAR, PRECISION,
                HAS_KEY_MASK,
            )
        k_bar, v_bar = _bob_columns_inner(
            k_bar, v_bar, k, v, w_bar, z_bar, q_base, do_base, u_bar_base, stats_base, delta_base, a_base,
            c_base, stride_qn, stride_don, stride_un, keys, masked_end, N, N, qk_scale, scale,
            key_mask_base, M, HEAD_DIM, BLOCK_D, BLOCK_M, False, HAS_DQ_BAR, HAS_DK_BAR, HAS_DV_BAR, PRECISION,
            HAS_KEY_MASK,
        )

    k_bar_base = head_pointer(K_BAR, batch, kv_head, stride_kbb, stride_kbh)
    store_tile(k_bar_base, k_bar * scale, keys, M, stride_kbn, HEAD_DIM, BLOCK_D)
    v_bar_base = head_pointer(V_BAR, batch, kv_head, stride_vbb, stride_vbh)
    store_tile(v_bar_base, v_bar, keys, M, stride_vbn, HEAD_DIM, BLOCK_D)


def bob(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, o: torch.Tensor, stats: torch.Tensor,
    delta: torch.Tensor, dq_bar: torch.Tensor | None, dk_bar: torch.Tensor | None, dv_bar: torch.Tensor | None,
    *, causal: bool, scale: float, allow_tf32: bool = False, key_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Backward-over-backward: the vector-Jacobian product of :math:`(Q, K, V, dO) \mapsto (dQ, dK, dV)`
    with cotangents :math:`(\bar U, \bar W, \bar Z)` = ``(dq_bar, dk_bar, dv_bar)``.

    .. math::
        \bar A = \tau(\bar U K^\top + Q \bar W^\top),\quad \bar B = dO\, \bar Z^\top,\quad
        A_i = \textstyle\sum_j P_{ij} \bar A_{ij},\quad
        C_i = \sum_j P_{ij} (dP_{ij} - \Delta_i) \bar A_{ij} + \sum_j P_{ij} \bar B_{ij} - A_i \Delta_i,\\
        G_{dP} = P \circ (\bar A - A),\quad G_S = P \circ ((dP - \Delta) \circ \bar A - A\, dP + \bar B - C),\\
        \bar Q = \tau (G_S K + dS\, \bar W),\quad \bar K = \tau (G_S^\top Q + dS^\top \bar U),\quad
        \bar V = G_{dP}^\top dO,\quad d\bar O = (P \circ \bar A) V - A \circ O + P \bar Z

    computed without any N x M tensor in the schedule :func:`~flashbob.kernels.configs.bob_schedule` names:
    ``two_pass``: rows (:math:`\bar Q, d\bar O, A, C` in one sweep), then columns (:math:`\bar K, \bar V`);
    ``three_pass``: the row scalars :math:`A, C`, then the row outputs from :math:`G_S` directly (half the
    accumulators, so larger query tiles, for 3 more matrix products per tile), then columns; ``four_pass``:
    as three-pass with the row outputs split into a :math:`\bar Q` sweep and a :math:`d\bar O` sweep (one
    accumulator each, 3 more products per tile again). O, the
    softmax statistics and Δ are treated as constants: the formulas already contain every path through them.

    Args:
        q, k, v, causal, scale, allow_tf32, key_mask: as in :func:`flashbob.kernels.forward`.
        do: the cotangent the backward was run with; o, stats: forward outputs; delta: from the backward.
        dq_bar: ``(B, H, N, d)``; dk_bar, dv_bar: ``(B, Hkv, M, d)``; each may be None (= zero), which
            compiles its terms out. When all three are None, zeros are returned without a launch.

    Returns:
        ``(q_bar, k_bar, v_bar, do_bar)`` shaped and typed like ``q, k, v, do``.
    """
    check_qkv(q, k, v)
    shaped_like = (("do", do, q), ("o", o, q), ("dq_bar", dq_bar, q), ("dk_bar", dk_bar, k), ("dv_bar", dv_bar, v))
    for name, x, like in shaped_like:
        if x is not None and x.shape != like.shape:
            raise ValueError(f"{name} must have shape {tuple(like.shape)}; got {tuple(x.shape)}")
    if dq_bar is None and dk_bar is None and dv_bar is None:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(do)
    key_mask, has_key_mask = key_mask_operand(key_mask, q, k)
    q, k, v, do, o = (operand(x, q) for x in (q, k, v, do, o))
    batch, heads, n, head_dim = q.shape
    kv_heads, m = k.shape[1], k.shape[2]
    stats, delta = softmax_stats(stats, q), row_statistic(delta, q)
    a, c = torch.empty_like(delta), torch.empty_like(delta)
    q_bar, k_bar, v_bar, do_bar = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(do)
    # Absent cotangents are passed as placeholders (q or k) that the kernels never read.
    u_bar = q if dq_bar is None else operand(dq_bar, q)
    w_bar = k if dk_bar is None else operand(dk_bar, q)
    z_bar = k if dv_bar is None else operand(dv_bar, q)
    constants = dict(
        HEAD_DIM=head_dim, BLOCK_D=head_dim_block(head_dim), CAUSAL=causal,
        PRECISION=dot_precision(q.dtype, allow_tf32),
        HAS_DQ_BAR=dq_bar is not None, HAS_DK_BAR=dk_bar is not None, HAS_DV_BAR=dv_bar is not None,
        HAS_KEY_MASK=has_key_mask,
    )
    qk_scale = scale * LOG2E.value

    row_sweep = (
        q, k, v, o, do, stats, delta, u_bar, w_bar, z_bar, q_bar, do_bar, a, c,
        *strides(q), *strides(k), *strides(v), *strides(o), *strides(do), *strides(u_bar), *strides(w_bar),
        *strides(z_bar), *strides(q_bar), *strides(do_bar), heads, heads // kv_heads, n, m, qk_scale, scale, key_mask,
    )
    sweeps = {
        "two_pass": [("bob_rows", TWO_PASS_ROWS)],
        "three_pass": [("bob_scalars", SCALARS), ("bob_rows_direct", DIRECT_ROWS)],
        "four_pass": [("bob_scalars", SCALARS), ("bob_rows_q_bar", Q_BAR_ROWS), ("bob_rows_do_bar", DO_BAR_ROWS)],
    }[configs.bob_schedule()]
    for name, phase in sweeps:
        configs.launch(
            name, _bob_rows_kernel, lambda meta: (triton.cdiv(n, meta["BLOCK_M"]), batch * heads), *row_sweep,
            head_dim=head_dim, dtype=q.dtype, length=n, **constants, PHASE=phase.value,
        )
    configs.launch(
        "bob_cols", _bob_columns_kernel, lambda meta: (triton.cdiv(m, meta["BLOCK_N"]), batch * kv_heads),
        q, k, v, do, stats, delta, a, c, u_bar, w_bar, z_bar, k_bar, v_bar,
        *strides(q), *strides(k), *strides(v), *strides(do), *strides(u_bar), *strides(w_bar), *strides(z_bar),
        *strides(k_bar), *strides(v_bar), heads, kv_heads, heads // kv_heads, n, m, qk_scale, scale, key_mask,
        head_dim=head_dim, dtype=q.dtype, length=m, **constants,
    )
    return q_bar, k_bar, v_bar, do_bar
