"""Attention backward, FlashAttention-2's split: dQ by query block (which also writes delta = rowsum(dO ∘ O)), then
dK/dV by key block."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common, configs


@triton.jit
def _delta_kernel(
    O, DO, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don, DELTA, heads, N,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    r"""The row dot products :math:`O_i \cdot dO_i` of one query block for any two operands in these places
    (:func:`row_dot_products`; forward mode's :math:`\dot\Delta` terms; the backward's own :math:`\Delta` comes from
    the dQ kernel). No key blocks: ``BLOCK_N``, which :func:`~flashbob.kernels.configs.launch` passes to every
    kernel, is unused."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    batch_head = tl.program_id(1)
    batch, head = batch_head // heads, batch_head % heads
    o = common.load_tile(common.head_pointer(O, batch, head, stride_ob, stride_oh), rows, N, stride_on, HEAD_DIM,
                         BLOCK_D)
    do = common.load_tile(common.head_pointer(DO, batch, head, stride_dob, stride_doh), rows, N, stride_don, HEAD_DIM,
                          BLOCK_D)
    acc_dtype = DELTA.dtype.element_ty
    delta = tl.sum(o.to(acc_dtype) * do.to(acc_dtype), 1)
    common.store_rows(common.row_vector_pointer(DELTA, batch_head, N), delta, rows, N)


@triton.jit
def _dkdv_inner(
    dk, dv, k, v, q_src, do_src, stats_base, delta_base, stride_qn, stride_don, keys, start, end, N, qk_scale,
    lo, hi, key_ids, q_ids_base, key_mask_base, own, tiles_base, tile_bits, query_tiles, key_tiles, M,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
    PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr, TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr, TMA: tl.constexpr,
):
    r"""Add query rows ``[start, end)`` of one query head to a key block's
    :math:`dV_j = \sum_i P_{ij}\, dO_i` and :math:`dK_j / \tau = \sum_i dS_{ij}\, Q_i`, with
    :math:`dS = P \circ (dO V^\top - \Delta)`; tiles are kept transposed (keys by queries). ``q_src``,
    ``do_src``: :func:`~flashbob.kernels.common.tile_source`."""
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q = common.load_block(q_src, start_m, rows, N, stride_qn, HEAD_DIM, BLOCK_D, TMA)
        do = common.load_block(do_src, start_m, rows, N, stride_don, HEAD_DIM, BLOCK_D, TMA)
        row_max, log_sum = common.load_softmax_stats(stats_base, rows, N)
        delta = common.load_rows(delta_base, rows, N)
        p_t = common.probabilities_transposed(k, q, row_max, log_sum, rows, keys, N, M, qk_scale, lo, hi, key_ids,
                                              q_ids_base, key_mask_base, own, tiles_base, tile_bits, query_tiles,
                                              key_tiles, MASKED, PRECISION, DOCUMENTS, TILES, TILE_ROWS, TILE_COLS,
                                              HAS_KEY_MASK)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO,
    DK, DV,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    STATS, DELTA, KEY_MASK, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, TILE_BITS,
    query_tiles, key_tiles, heads, kv_heads, group, N, M, qk_scale,
    scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BAND: tl.constexpr, PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr, TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    TMA: tl.constexpr,
):
    r""":math:`dK = \tau\, dS^\top Q` and :math:`dV = P^\top dO` of one key block of one kv head,
    summed over the ``group`` query heads that share it (no atomics).

    Only the queries that see some key of the block are visited (:func:`~flashbob.kernels.common.column_masks`;
    causal: those from the block on), masked where they do not see all of it. ``TMA`` (the ``"tma"`` variant):
    tiles through tensor descriptors.
    """
    start_n, keys, batch, kv_head, key_mask_base = common.key_block(kv_heads, KEY_MASK, M, BLOCK_N)
    acc_dtype = DELTA.dtype.element_ty
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=acc_dtype)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=acc_dtype)
    k_src, v_src = common.key_value_sources(K, V, batch, kv_head, stride_kb, stride_kh, stride_kn, stride_vb,
                                            stride_vh, stride_vn, M, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    k = common.load_block(k_src, start_n, keys, M, stride_kn, HEAD_DIM, BLOCK_D, TMA)
    v = common.load_block(v_src, start_n, keys, M, stride_vn, HEAD_DIM, BLOCK_D, TMA)

    lo, hi, key_ids, q_ids_base, tiles_base, start, whole_start, whole_end, end = common.column_masks(
        keys, batch, N, M, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, query_tiles, key_tiles, BLOCK_M,
        BAND, DOCUMENTS, TILES)
    for member in tl.range(group, num_stages=1):  # never pipelined: common.group_query_head
        _, _, q_base, do_base, stats_base, delta_base = common.group_query_head(
            Q, DO, STATS, DELTA, batch, heads, kv_head, group, member, N, stride_qb, stride_qh, stride_dob, stride_doh)
        q_src = common.tile_source(q_base, N, stride_qn, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
        do_src = common.tile_source(do_base, N, stride_don, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
        for phase in tl.static_range(3):  # the masked blocks, the whole ones, the masked ones
            first, last = common.sweep_phase(phase, start, whole_start, whole_end, end)
            dk, dv = _dkdv_inner(
                dk, dv, k, v, q_src, do_src, stats_base, delta_base, stride_qn, stride_don, keys, first, last, N,
                qk_scale, lo, hi, key_ids, q_ids_base, key_mask_base, keys, tiles_base, TILE_BITS, query_tiles,
                key_tiles, M, HEAD_DIM, BLOCK_D, BLOCK_M, phase != 1, PRECISION, DOCUMENTS, TILES, TILE_ROWS, TILE_COLS,
                HAS_KEY_MASK, TMA,
            )

    common.store_head_block(DK, dk * scale, batch, kv_head, stride_dkb, stride_dkh, start_n, keys, M, stride_dkn,
                            HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    common.store_head_block(DV, dv, batch, kv_head, stride_dvb, stride_dvh, start_n, keys, M, stride_dvn, HEAD_DIM,
                            BLOCK_N, BLOCK_D, TMA)


@triton.jit
def _dq_inner(
    dq, q, do, row_max, log_sum, delta, k_src, v_src, stride_kn, stride_vn, start, end, M, qk_scale, lo, hi, row_ids,
    k_ids_base, key_mask_base, own, tiles_base, tile_bits, query_tiles, key_tiles, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    TMA: tl.constexpr,
):
    r"""Add key blocks ``[start, end)`` to a query block's :math:`dQ_i / \tau = \sum_j dS_{ij} K_j`
    (``k_src``, ``v_src``: :func:`~flashbob.kernels.common.tile_source`; ``MASKED`` and the masks:
    :func:`~flashbob.kernels.common.mask_scores`)."""
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = common.load_block(k_src, start_n, keys, M, stride_kn, HEAD_DIM, BLOCK_D, TMA)
        v = common.load_block(v_src, start_n, keys, M, stride_vn, HEAD_DIM, BLOCK_D, TMA)
        p = common.probabilities(q, k, row_max, log_sum, keys, M, qk_scale, lo, hi, row_ids, k_ids_base, key_mask_base,
                                 own, tiles_base, tile_bits, query_tiles, key_tiles, MASKED, PRECISION, DOCUMENTS,
                                 TILES, TILE_ROWS, TILE_COLS, HAS_KEY_MASK)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _dq_kernel(
    Q, K, V, DO, O,
    DQ,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don, stride_ob, stride_oh, stride_on, stride_dqb, stride_dqh, stride_dqn,
    STATS, DELTA, KEY_MASK, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, TILE_BITS,
    query_tiles, key_tiles, heads, group, N, M, qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BAND: tl.constexpr, PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr, TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    TMA: tl.constexpr,
):
    r""":math:`dQ = \tau\, dS K` of one query block, key blocks split as in the forward (and ``TMA`` as there);
    first its rows' :math:`\Delta_i = dO_i \cdot O_i`, which it stores in ``DELTA`` for the dK/dV sweep (launched
    after it), so that the backward needs no launch of its own for them."""
    start_m, rows, batch_head, batch, head, kv_head, key_mask_base = common.query_block(heads, group, KEY_MASK, M, BLOCK_M)
    k_src, v_src = common.key_value_sources(K, V, batch, kv_head, stride_kb, stride_kh, stride_kn, stride_vb,
                                            stride_vh, stride_vn, M, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    q_src = common.head_tile_source(Q, batch, head, stride_qb, stride_qh, N, stride_qn, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
    do_src = common.head_tile_source(DO, batch, head, stride_dob, stride_doh, N, stride_don, HEAD_DIM, BLOCK_M, BLOCK_D,
                                     TMA)
    q = common.load_block(q_src, start_m, rows, N, stride_qn, HEAD_DIM, BLOCK_D, TMA)
    do = common.load_block(do_src, start_m, rows, N, stride_don, HEAD_DIM, BLOCK_D, TMA)
    o_src = common.head_tile_source(O, batch, head, stride_ob, stride_oh, N, stride_on, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
    o = common.load_block(o_src, start_m, rows, N, stride_on, HEAD_DIM, BLOCK_D, TMA)
    acc_dtype = DELTA.dtype.element_ty
    delta = tl.sum(o.to(acc_dtype) * do.to(acc_dtype), 1)
    common.store_rows(common.row_vector_pointer(DELTA, batch_head, N), delta, rows, N)
    row_max, log_sum = common.load_softmax_stats(common.softmax_stats_pointer(STATS, batch_head, N), rows, N)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=acc_dtype)

    lo, hi, row_ids, k_ids_base, tiles_base, start, whole_start, whole_end, end = common.row_masks(
        rows, batch, N, M, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, query_tiles, key_tiles, BLOCK_N,
        BAND, DOCUMENTS, TILES)
    for phase in tl.static_range(3):  # the masked blocks, the whole ones, the masked ones
        first, last = common.sweep_phase(phase, start, whole_start, whole_end, end)
        dq = _dq_inner(
            dq, q, do, row_max, log_sum, delta, k_src, v_src, stride_kn, stride_vn, first, last, M, qk_scale, lo, hi,
            row_ids, k_ids_base, key_mask_base, rows, tiles_base, TILE_BITS, query_tiles, key_tiles, HEAD_DIM, BLOCK_D,
            BLOCK_N, phase != 1, PRECISION, DOCUMENTS, TILES, TILE_ROWS, TILE_COLS, HAS_KEY_MASK, TMA,
        )
    common.store_head_block(DQ, dq * scale, batch, head, stride_dqb, stride_dqh, start_m, rows, N, stride_dqn, HEAD_DIM,
                            BLOCK_M, BLOCK_D, TMA)


def row_dot_products(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    r""":math:`x_i \cdot y_i` of every row of two ``(B, H, N, d)`` kernel operands (:func:`~flashbob.kernels.common.operand`
    of the same dtype), ``(B, H, N)`` in the accumulator dtype; e.g. :math:`\Delta = \mathrm{rowsum}(O \circ dO)`."""
    batch, heads, n, head_dim = x.shape
    head_dim = int(head_dim)  # a compile-time constant: a symbolic head_dim (torch.compile) is specialised
    out = torch.empty(x.shape[:3], dtype=common.accumulator_dtype(x.dtype), device=x.device)
    configs.launch(
        "delta", _delta_kernel, common.row_grid(n, batch * heads), *common.with_strides(x, y), out, heads, n,
        head_dim=head_dim, dtype=x.dtype, length=n, HEAD_DIM=head_dim, BLOCK_D=common.head_dim_block(head_dim),
    )
    return out


def backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, stats: torch.Tensor, do: torch.Tensor,
    *, causal: bool, scale: float, allow_tf32: bool = False, key_mask: torch.Tensor | None = None, window=None,
    q_ids: torch.Tensor | None = None, k_ids: torch.Tensor | None = None,
    tile_state: torch.Tensor | None = None, tile_bits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Gradients of attention for the output cotangent ``do``.

    .. math::
        P = \mathrm{softmax}_\text{row}(S),\quad \Delta_i = dO_i \cdot O_i,\quad dS = P \circ (dO V^\top - \Delta),\\
        dQ = \tau\, dS K,\quad dK = \tau\, dS^\top Q,\quad dV = P^\top dO

    Args:
        q, k, v, causal, scale, allow_tf32, key_mask, window, q_ids, k_ids: as in :func:`flashbob.kernels.forward`.
        o, stats: the forward's outputs.
        do: ``(B, H, N, d)`` cotangent of ``o``.

    Returns:
        ``dq`` like ``q``; ``dk``, ``dv`` like ``k``, ``v`` (summed over the query heads of each kv
        group); ``delta`` ``(B, H, N)`` in the dtype of ``stats`` (float32, float64 for float64 inputs).
    """
    common.check_qkv(q, k, v)
    common.check_shaped_like(("o", o, q), ("do", do, q))
    masks = common.KernelMasks(q, k, causal=causal, window=window, key_mask=key_mask, q_ids=q_ids, k_ids=k_ids,
                               tile_state=tile_state, tile_bits=tile_bits)
    q, k, v, o, do = (common.operand(x, q) for x in (q, k, v, o, do))
    batch, heads, n, head_dim = q.shape
    kv_heads, m = k.shape[1], k.shape[2]
    stats = common.softmax_stats(stats, q)
    delta = torch.empty(q.shape[:3], dtype=stats.dtype, device=q.device)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    constants = common.kernel_constants(q, masks, allow_tf32)
    scalars = (heads // kv_heads, n, m, scale * common.LOG2E.value, scale)

    configs.launch(  # first: it also writes delta, which dK/dV read
        "dq", _dq_kernel, common.row_grid(n, batch * heads), *common.with_strides(q, k, v, do, o, dq), stats, delta,
        *masks.row_arguments(), heads, *scalars, head_dim=head_dim, dtype=q.dtype, length=n,
        descriptors=(q, k, v, do, o, dq),
        **constants,
    )
    configs.launch(
        "dkdv", _dkdv_kernel, common.column_grid(m, batch * kv_heads), *common.with_strides(q, k, v, do, dk, dv), stats,
        delta, *masks.column_arguments(), heads, kv_heads, *scalars, head_dim=head_dim, dtype=q.dtype, length=m,
        descriptors=(q, k, v, do, dk, dv), **constants,
    )
    return dq, dk, dv, delta
