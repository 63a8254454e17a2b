"""Attention forward: FlashAttention-2 online softmax, one program per (query block, batch*head)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common, configs


@triton.jit
def _forward_inner(
    acc, row_max, row_sum, q, k_src, v_src, stride_kn, stride_vn, start, end, M, qk_scale, lo, hi, row_ids,
    k_ids_base, key_mask_base, own, tiles_base, tile_bits, query_tiles, key_tiles, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr, BAND: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, TMA: tl.constexpr,
):
    r"""Fold key blocks ``[start, end)`` into the online softmax of one query block.

    With :math:`s_{ij} = \tau\, q_i \cdot k_j \log_2 e` (base 2), running max :math:`m_i`, running sum
    :math:`\ell_i = \sum_j 2^{s_{ij} - m_i}` and unnormalised output
    :math:`\mathrm{acc}_i = \sum_j 2^{s_{ij} - m_i} v_j`, a new block rescales both by
    :math:`2^{m_i^{old} - m_i^{new}}` before adding its own terms. Where a mask can hide a row's every key so far
    (:math:`m_i = -\infty`), the exponentials use 0 as the shift, so that they are 0 instead of NaN.
    ``k_src``, ``v_src``: :func:`~flashbob.kernels.common.tile_source`; ``MASKED`` and the masks:
    :func:`~flashbob.kernels.common.mask_scores`.
    """
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = common.load_block(k_src, start_n, keys, M, stride_kn, HEAD_DIM, BLOCK_D, TMA)
        v = common.load_block(v_src, start_n, keys, M, stride_vn, HEAD_DIM, BLOCK_D, TMA)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        scores = common.mask_scores(scores, keys, M, lo, hi, row_ids, k_ids_base, key_mask_base, own, tiles_base,
                                    tile_bits, query_tiles, key_tiles, MASKED, DOCUMENTS, TILES, TILE_ROWS, TILE_COLS,
                                    HAS_KEY_MASK)
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        if HAS_KEY_MASK or BAND or DOCUMENTS or TILES:
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        else:
            shift = new_max
        rescale = tl.exp2(row_max - shift)
        p = tl.exp2(scores - shift[:, None])
        row_sum = row_sum * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def _forward_kernel(
    Q, K, V,
    O,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
    STATS, KEY_MASK, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, TILE_BITS,
    query_tiles, key_tiles, heads, group, N, M, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BAND: tl.constexpr, PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr, TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    TMA: tl.constexpr,
):
    r""":math:`O = \mathrm{softmax}(\tau Q K^\top) V` and the softmax statistics :math:`(m_i, \log_2 \ell_i)`
    (:func:`~flashbob.kernels.common.load_softmax_stats`) for one query block. Only the keys some query of the
    block sees are visited (:func:`~flashbob.kernels.common.row_masks`): the blocks every query sees whole
    without an element-wise mask, those before and after them masked. Rows that see no key store
    :math:`O_i = 0` and :math:`(+\infty, 0)`. ``TMA`` (the ``"tma"`` variant): tiles through tensor descriptors."""
    start_m, rows, batch_head, batch, head, kv_head, key_mask_base = common.query_block(heads, group, KEY_MASK, M, BLOCK_M)
    k_src, v_src = common.key_value_sources(K, V, batch, kv_head, stride_kb, stride_kh, stride_kn, stride_vb,
                                            stride_vh, stride_vn, M, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    q_src = common.head_tile_source(Q, batch, head, stride_qb, stride_qh, N, stride_qn, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
    q = common.load_block(q_src, start_m, rows, N, stride_qn, HEAD_DIM, BLOCK_D, TMA)
    acc_dtype = STATS.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=acc_dtype)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=acc_dtype)
    row_sum = tl.zeros([BLOCK_M], dtype=acc_dtype)

    lo, hi, row_ids, k_ids_base, tiles_base, start, whole_start, whole_end, end = common.row_masks(
        rows, batch, N, M, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, query_tiles, key_tiles, BLOCK_N,
        BAND, DOCUMENTS, TILES)
    for phase in tl.static_range(3):  # the masked blocks, the whole ones, the masked ones
        first, last = common.sweep_phase(phase, start, whole_start, whole_end, end)
        acc, row_max, row_sum = _forward_inner(
            acc, row_max, row_sum, q, k_src, v_src, stride_kn, stride_vn, first, last, M, qk_scale, lo, hi, row_ids,
            k_ids_base, key_mask_base, rows, tiles_base, TILE_BITS, query_tiles, key_tiles, HEAD_DIM, BLOCK_D, BLOCK_N,
            phase != 1, PRECISION, BAND, DOCUMENTS, TILES, TILE_ROWS, TILE_COLS, HAS_KEY_MASK, TMA,
        )

    o_src = common.head_tile_source(O, batch, head, stride_ob, stride_oh, N, stride_on, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
    if HAS_KEY_MASK or BAND or DOCUMENTS or TILES:
        seen = row_sum != 0  # a NaN sum (a NaN or +inf score) counts as seen, so that it reaches O and the statistics
        row_sum = tl.where(seen, row_sum, 1.0)
        row_max = tl.where(seen, row_max, float("inf"))
    o = acc / row_sum[:, None]
    common.store_block(o_src, o, start_m, rows, N, stride_on, HEAD_DIM, BLOCK_D, TMA)
    stats_base = common.softmax_stats_pointer(STATS, batch_head, N)
    tl.store(stats_base + rows, row_max, mask=rows < N)
    tl.store(stats_base + N + rows, tl.log2(row_sum), mask=rows < N)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float, allow_tf32: bool = False,
    key_mask: torch.Tensor | None = None, window=None, q_ids: torch.Tensor | None = None,
    k_ids: torch.Tensor | None = None,
    tile_state: torch.Tensor | None = None, tile_bits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Attention output and the softmax statistics of its rows.

    .. math::
        S = \tau Q K^\top\ (\text{causal: } S_{ij} = -\infty \text{ for } j > i),\quad
        O = \mathrm{softmax}_\text{row}(S)\, V,\quad
        m_i = \max_j S_{ij} \log_2 e,\quad \log_2 \ell_i = \log_2 \textstyle\sum_j 2^{S_{ij} \log_2 e - m_i}

    Args:
        q: ``(B, H, N, d)`` queries.
        k, v: ``(B, Hkv, M, d)`` keys and values, ``H % Hkv == 0`` (query head ``h`` reads kv head
            ``h // (H // Hkv)``).
        causal: top-left aligned causal mask (query ``i`` sees key ``j`` iff ``j <= i``).
        scale: :math:`\tau`.
        allow_tf32: float32 inputs only: let ``tl.dot`` round its operands to tf32.
        key_mask: optional bool ``(B, M)`` key-padding mask, True = keep.
        window: optional ``(left, right)`` band, each bound an int >= 0 or None.
        q_ids, k_ids: optional document ids ``(B, N)`` and ``(B, M)`` (both or neither).

        The masks combine by AND (:mod:`flashbob.masks`). Rows that see no key get ``o = 0`` and statistics
        ``(+inf, 0)``.

    Returns:
        ``o`` shaped and typed like ``q``; ``stats`` ``(B, H, 2, N)`` holding :math:`m` and :math:`\log_2 \ell`
        in float32 (float64 for float64 inputs), the input of :func:`backward` and :func:`bob`;
        :func:`~flashbob.kernels.common.logsumexp` turns it into the row log-sum-exp.
    """
    common.check_qkv(q, k, v)
    masks = common.KernelMasks(q, k, causal=causal, window=window, key_mask=key_mask, q_ids=q_ids, k_ids=k_ids,
                               tile_state=tile_state, tile_bits=tile_bits)
    q, k, v = (common.operand(x, q) for x in (q, k, v))
    batch, heads, n, head_dim = q.shape
    kv_heads, m = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    stats = torch.empty((batch, heads, 2, n), dtype=common.accumulator_dtype(q.dtype), device=q.device)
    configs.launch(
        "forward", _forward_kernel, common.row_grid(n, batch * heads), *common.with_strides(q, k, v, o), stats,
        *masks.row_arguments(), heads, heads // kv_heads, n, m, scale * common.LOG2E.value, head_dim=head_dim,
        dtype=q.dtype, length=n, descriptors=(q, k, v, o), **common.kernel_constants(q, masks, allow_tf32),
    )
    return o, stats
