"""Pieces shared by the attention kernels: tile loads and stores, and the host-side checks."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from flashbob.inputs import accumulator_dtype, check_inputs, check_triton_limits
from flashbob.masks import band, document_ranges, intersect_ranges, tile_ranges

from . import tracing

# exp(x) = exp2(x * log2(e)): the kernels work in base 2.
LOG2E = tl.constexpr(math.log2(math.e))


# ----------------------------------------------------------------------------- device helpers


@triton.jit
def query_block(heads, group, KEY_MASK, M, BLOCK_M: tl.constexpr):
    """Where a row kernel's program works (grid: query blocks x ``batch * heads``): its first query
    ``start_m``, its query ``rows``, ``batch_head = batch * heads + head``, ``batch``, ``head``, the kv head
    it reads (``group`` query heads share one) and its row of the key-padding mask (:func:`key_mask_pointer`)."""
    start_m = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1)
    batch, head = batch_head // heads, batch_head % heads
    key_mask_base = key_mask_pointer(KEY_MASK, batch, M)
    return start_m, start_m + tl.arange(0, BLOCK_M), batch_head, batch, head, head // group, key_mask_base


@triton.jit
def key_block(kv_heads, KEY_MASK, M, BLOCK_N: tl.constexpr):
    """Where a column kernel's program works (grid: key blocks x ``batch * kv_heads``): its first key
    ``start_n``, its ``keys``, ``batch``, the ``kv_head`` whose keys they are and its row of the
    key-padding mask (:func:`key_mask_pointer`)."""
    start_n = tl.program_id(0) * BLOCK_N
    batch_kv_head = tl.program_id(1)
    batch, kv_head = batch_kv_head // kv_heads, batch_kv_head % kv_heads
    key_mask_base = key_mask_pointer(KEY_MASK, batch, M)
    return start_n, start_n + tl.arange(0, BLOCK_N), batch, kv_head, key_mask_base


@triton.jit
def group_query_head(
    Q, DO, STATS, DELTA, batch, heads, kv_head, group, member, N, stride_qb, stride_qh, stride_dob, stride_doh,
):
    """The ``member``-th of the ``group`` query heads that share ``kv_head``, as a column kernel reads it: the
    ``head``, ``batch_head = batch * heads + head`` and the starts of its Q, dO, softmax statistics and delta.

    The column kernels loop over the members with ``tl.range(group, num_stages=1)``: never pipelined, because
    where N == 1 Triton folds the query loop inside away and would pipeline this one instead, whose tensor
    descriptors (the ``"tma"`` variant) its pipeliner cannot predicate on sm_90."""
    head = kv_head * group + member
    batch_head = batch * heads + head
    q_base = head_pointer(Q, batch, head, stride_qb, stride_qh)
    do_base = head_pointer(DO, batch, head, stride_dob, stride_doh)
    stats_base = softmax_stats_pointer(STATS, batch_head, N)
    delta_base = row_vector_pointer(DELTA, batch_head, N)
    return head, batch_head, q_base, do_base, stats_base, delta_base


@triton.jit
def head_pointer(X, batch, head, stride_batch, stride_head):
    """Pointer to the ``(rows, head_dim)`` matrix of one (batch, head), offsets in int64."""
    return X + batch.to(tl.int64) * stride_batch + head.to(tl.int64) * stride_head


@triton.jit
def load_tile(X, rows, n_rows, stride_row, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``rows`` of the ``(n_rows, HEAD_DIM)`` matrix at ``X`` (unit column stride) as a
    ``(len(rows), BLOCK_D)`` tile; zero outside the matrix (ragged tails, head_dim padding)."""
    cols = tl.arange(0, BLOCK_D)
    pointers = X + rows.to(tl.int64)[:, None] * stride_row + cols[None, :]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM)
    return tl.load(pointers, mask=mask, other=0.0)


@triton.jit
def store_tile(X, tile, rows, n_rows, stride_row, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store a ``(len(rows), BLOCK_D)`` tile into the ``(n_rows, HEAD_DIM)`` matrix at ``X``,
    converted to its dtype; padding rows and columns are dropped."""
    cols = tl.arange(0, BLOCK_D)
    pointers = X + rows.to(tl.int64)[:, None] * stride_row + cols[None, :]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM)
    tl.store(pointers, tile.to(X.dtype.element_ty), mask=mask)


@triton.jit
def tile_source(X, n_rows, stride_row, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                TMA: tl.constexpr):
    """What the ``(BLOCK_ROWS, BLOCK_D)`` tiles of the ``(n_rows, HEAD_DIM)`` matrix at ``X`` (unit column
    stride) are read and written through: with ``TMA`` a tensor descriptor (TMA on Hopper: loads are zero
    outside the matrix and stores clipped to it, as :func:`load_tile` and :func:`store_tile` mask them), else
    ``X`` itself. The host checks that descriptors can address the matrix
    (:func:`~flashbob.kernels.configs.descriptors_usable`)."""
    if TMA:
        source = tl.make_tensor_descriptor(X, shape=[n_rows, HEAD_DIM], strides=[stride_row, 1],
                                           block_shape=[BLOCK_ROWS, BLOCK_D])
    else:
        source = X
    return source


@triton.jit
def head_tile_source(X, batch, head, stride_batch, stride_head, n_rows, stride_row, HEAD_DIM: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """:func:`tile_source` of the ``(n_rows, HEAD_DIM)`` matrix of one (batch, head) (:func:`head_pointer`)."""
    return tile_source(head_pointer(X, batch, head, stride_batch, stride_head), n_rows, stride_row, HEAD_DIM,
                       BLOCK_ROWS, BLOCK_D, TMA)


@triton.jit
def load_block(source, start, rows, n_rows, stride_row, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               TMA: tl.constexpr):
    """Rows ``rows = start + arange`` of a matrix through its :func:`tile_source`, as :func:`load_tile` reads them."""
    if TMA:
        tile = source.load([start, 0])
    else:
        tile = load_tile(source, rows, n_rows, stride_row, HEAD_DIM, BLOCK_D)
    return tile


@triton.jit
def store_block(source, tile, start, rows, n_rows, stride_row, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                TMA: tl.constexpr):
    """Store ``tile`` into rows ``rows = start + arange`` of a matrix through its :func:`tile_source`, converted
    to its dtype, as :func:`store_tile` does."""
    if TMA:
        source.store([start, 0], tile.to(source.dtype))
    else:
        store_tile(source, tile, rows, n_rows, stride_row, HEAD_DIM, BLOCK_D)


@triton.jit
def store_head_block(X, tile, batch, head, stride_batch, stride_head, start, rows, n_rows, stride_row,
                     HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """:func:`store_block` of ``tile`` into the ``(n_rows, HEAD_DIM)`` matrix of one (batch, head), through its
    :func:`head_tile_source`: how a kernel writes its output block."""
    source = head_tile_source(X, batch, head, stride_batch, stride_head, n_rows, stride_row, HEAD_DIM, BLOCK_ROWS,
                              BLOCK_D, TMA)
    store_block(source, tile, start, rows, n_rows, stride_row, HEAD_DIM, BLOCK_D, TMA)


@triton.jit
def row_vector_pointer(X, batch_head, n_rows):
    """Pointer to the row statistics (delta, A, C) of one (batch, head) in a contiguous
    ``(batch, heads, n_rows)`` tensor; ``batch_head = batch * heads + head``."""
    return X + batch_head.to(tl.int64) * n_rows


@triton.jit
def load_rows(base, rows, n_rows):
    """Entries ``rows`` of a row statistic (delta, A, C, ...) whose row 0 is at ``base``; 0 past ``n_rows``."""
    return tl.load(base + rows, mask=rows < n_rows, other=0.0)


@triton.jit
def store_rows(base, values, rows, n_rows):
    """Store ``values`` into entries ``rows`` of a row statistic whose row 0 is at ``base``; rows past
    ``n_rows`` are dropped."""
    tl.store(base + rows, values, mask=rows < n_rows)


@triton.jit
def softmax_stats_pointer(STATS, batch_head, n_rows):
    """Pointer to the softmax statistics of one (batch, head) in a contiguous ``(batch, heads, 2, n_rows)``
    tensor (see :func:`load_softmax_stats`)."""
    return STATS + batch_head.to(tl.int64) * 2 * n_rows


@triton.jit
def load_softmax_stats(stats_base, rows, n_rows):
    r"""Row maximum :math:`m_i` of the base-2 scores :math:`s_{ij} = \tau\, q_i \cdot k_j \log_2 e` and
    :math:`\log_2 \ell_i` with :math:`\ell_i = \sum_j 2^{s_{ij} - m_i}`, so that
    :math:`P_{ij} = 2^{(s_{ij} - m_i) - \log_2 \ell_i}`. Rows past ``n_rows`` read :math:`(+\infty, 0)`,
    like rows that see no key, so that their P is 0.

    The two numbers are kept apart rather than summed into one float32 lse: :math:`s - m` is exact where
    it matters (the largest scores of a row), so P of a row sums to 1 to float32 rounding however large
    the scores are, and a row with one visible key gets P = 1 exactly."""
    row_max = tl.load(stats_base + rows, mask=rows < n_rows, other=float("inf"))
    log_sum = tl.load(stats_base + n_rows + rows, mask=rows < n_rows, other=0.0)
    return row_max, log_sum


@triton.jit
def ranges_pointer(RANGES, batch, length):
    """Start of one batch element's ``(4, length)`` document ranges (:func:`flashbob.masks.document_ranges`)."""
    return RANGES + batch.to(tl.int64) * 4 * length


@triton.jit
def visible_ranges(own, n_own, n_other, before, after, ranges_base, BAND: tl.constexpr, RANGED: tl.constexpr):
    r"""For each position ``own`` of a program's block (its queries in a row kernel, its keys in a column kernel):
    the range ``[lo, hi)`` of the other axis that it may see, and ``[whole_lo, whole_hi)``, where it sees every
    position. The band lets position :math:`x` see :math:`[x - \text{before}, x + \text{after}]` (a row kernel
    passes the window's ``(left, right)``, a column kernel ``(right, left)``); with ``RANGED``, the ranges at
    ``ranges_base`` (:func:`ranges_pointer`; documents' and a block mask's tiles', intersected on the host) narrow
    both."""
    lo = tl.zeros_like(own)
    hi = tl.zeros_like(own) + n_other
    if BAND:
        lo = tl.maximum(own - before, 0)
        hi = tl.minimum(own + after + 1, n_other)
    whole_lo = lo
    whole_hi = hi
    if RANGED:
        valid = own < n_own
        lo = tl.maximum(lo, tl.load(ranges_base + own, mask=valid, other=0))
        hi = tl.minimum(hi, tl.load(ranges_base + n_own + own, mask=valid, other=0))
        whole_lo = tl.maximum(whole_lo, tl.load(ranges_base + 2 * n_own + own, mask=valid, other=0))
        whole_hi = tl.minimum(whole_hi, tl.load(ranges_base + 3 * n_own + own, mask=valid, other=0))
    return lo, hi, whole_lo, whole_hi


@triton.jit
def sweep_bounds(own, n_own, n_other, lo, hi, whole_lo, whole_hi, BLOCK: tl.constexpr, OPEN_END: tl.constexpr):
    """Where a program's loop over the other axis goes, in steps of ``BLOCK``: ``(start, whole_start, whole_end,
    end)``. It visits ``[start, end)``, the union of its positions' ranges (:func:`visible_ranges`), so that blocks
    no position sees are never visited; the blocks in ``[whole_start, whole_end)`` lie in every position's whole
    range and need no mask but the key-padding one; the blocks before and after them are masked element by
    element (:func:`visible`). ``OPEN_END`` (column kernels): positions past ``n_other`` may be in a whole block
    (their softmax statistics make P = 0 there); row kernels' whole blocks end at ``n_other``."""
    valid = own < n_own
    seen = valid & (lo < hi)
    start = tl.min(tl.where(seen, lo, n_other), 0)
    end = tl.maximum(tl.max(tl.where(seen, hi, 0), 0), start)
    grid_end = start + (end - start + BLOCK - 1) // BLOCK * BLOCK
    common_lo = tl.max(tl.where(valid, whole_lo, 0), 0)
    common_hi = tl.min(tl.where(valid, whole_hi, n_other), 0)
    whole_start = tl.minimum(start + (tl.maximum(common_lo - start, 0) + BLOCK - 1) // BLOCK * BLOCK, grid_end)
    if OPEN_END:
        common_hi = tl.where(common_hi >= n_other, grid_end, common_hi)
    whole_end = whole_start + tl.maximum(common_hi - whole_start, 0) // BLOCK * BLOCK
    return start, whole_start, whole_end, end


@triton.jit
def sweep_phase(phase: tl.constexpr, start, whole_start, whole_end, end):
    """The blocks ``[first, last)`` of phase ``phase`` of a sweep over :func:`sweep_bounds`: 0, the masked blocks
    before the whole ones; 1, the whole blocks (no element-wise mask); 2, the masked blocks after them. Every
    kernel runs its inner loop once per phase, in a ``tl.static_range(3)``, unmasked in phase 1 alone."""
    if phase == 0:
        first, last = start, whole_start
    elif phase == 1:
        first, last = whole_start, whole_end
    else:
        first, last = whole_end, end
    return first, last


@triton.jit
def own_ids(IDS, batch, own, n_own, DOCUMENTS: tl.constexpr):
    """The document ids of a program's positions ``own`` (of ``(B, n_own)`` ids); ``own`` itself, never read,
    without documents."""
    if DOCUMENTS:
        ids = tl.load(IDS + batch.to(tl.int64) * n_own + own, mask=own < n_own, other=-1)
    else:
        ids = own
    return ids


@triton.jit
def row_masks(rows, batch, N, M, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, query_tiles,
              key_tiles, BLOCK_N: tl.constexpr, BAND: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr):
    """A row kernel's masks for its query ``rows``: :func:`own_masks` seen from the queries."""
    return own_masks(rows, batch, N, M, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, query_tiles,
                     key_tiles, BLOCK_N, BAND, DOCUMENTS, TILES, False)


@triton.jit
def column_masks(keys, batch, N, M, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, query_tiles,
                 key_tiles, BLOCK_M: tl.constexpr, BAND: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr):
    """A column kernel's masks for its ``keys``: :func:`own_masks` seen from the keys (the band's bounds swap)."""
    return own_masks(keys, batch, M, N, IDS_K, IDS_Q, RANGES, window_right, window_left, TILE_STATE, query_tiles,
                     key_tiles, BLOCK_M, BAND, DOCUMENTS, TILES, True)


@triton.jit
def own_masks(own, batch, n_own, n_other, IDS_OWN, IDS_OTHER, RANGES, before, after, TILE_STATE, query_tiles,
              key_tiles, BLOCK: tl.constexpr, BAND: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr,
              OPEN_END: tl.constexpr):
    """A program's masks for its positions ``own`` (queries of a row kernel, keys of a column kernel): each
    position's visible range ``[lo, hi)`` on the other axis (:func:`visible_ranges`, ``before``/``after`` its band),
    the positions' document ids, the start of the other axis' ids and of this batch element's tiles
    (:func:`tile_visible`), and the loop over the other axis, :func:`sweep_bounds`."""
    lo, hi, whole_lo, whole_hi = visible_ranges(own, n_own, n_other, before, after,
                                                ranges_pointer(RANGES, batch, n_own), BAND, DOCUMENTS or TILES)
    start, whole_start, whole_end, end = sweep_bounds(own, n_own, n_other, lo, hi, whole_lo, whole_hi, BLOCK,
                                                      OPEN_END)
    return lo, hi, own_ids(IDS_OWN, batch, own, n_own, DOCUMENTS), IDS_OTHER + batch.to(tl.int64) * n_other, \
        tiles_pointer(TILE_STATE, batch, query_tiles, key_tiles), start, whole_start, whole_end, end


@triton.jit
def tiles_pointer(TILE_STATE, batch, query_tiles, key_tiles):
    """Start of one batch element's ``(query_tiles, key_tiles)`` tile states (:func:`flashbob.masks.block_tiles`)."""
    return TILE_STATE + batch.to(tl.int64) * query_tiles * key_tiles


@triton.jit
def tile_visible(queries, keys, tiles_base, tile_bits, query_tiles, key_tiles, TILE_ROWS: tl.constexpr,
                 TILE_COLS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """A block mask's ``(queries, keys)`` booleans (``(keys, queries)`` when ``TRANSPOSED``): True where the
    tile of ``(i, j)`` is whole, or partial with its bit set in ``tile_bits`` ``(partial tiles, TILE_ROWS,
    TILE_COLS)`` (:func:`flashbob.masks.block_tiles`; -2 whole, -1 empty, else the partial tile's index)."""
    if TRANSPOSED:
        i = queries[None, :]
        j = keys[:, None]
    else:
        i = queries[:, None]
        j = keys[None, :]
    query_tile = tl.minimum(i // TILE_ROWS, query_tiles - 1)
    key_tile = tl.minimum(j // TILE_COLS, key_tiles - 1)
    state = tl.load(tiles_base + query_tile * key_tiles + key_tile)
    partial = state >= 0
    offset = state.to(tl.int64) * (TILE_ROWS * TILE_COLS) + (i % TILE_ROWS) * TILE_COLS + j % TILE_COLS
    bits = tl.load(tile_bits + tl.where(partial, offset, 0), mask=partial, other=0)
    return (state == -2) | (bits != 0)


@triton.jit
def visible(other, n_other, lo, hi, ids, other_ids_base, own, tiles_base, tile_bits, query_tiles, key_tiles,
            DOCUMENTS: tl.constexpr, TILES: tl.constexpr, TILE_ROWS: tl.constexpr, TILE_COLS: tl.constexpr,
            TRANSPOSED: tl.constexpr):
    """``(own, other)`` booleans of a tile, True where the program's position ``own`` sees the other axis' position
    ``other``: inside its range ``[lo, hi)`` (:func:`visible_ranges`), with documents of its document (``ids``;
    the other side's ids start at ``other_ids_base``), and with a block mask where its tile allows
    (:func:`tile_visible`). Row kernels' tiles are queries by keys, column kernels' (``TRANSPOSED``) keys by
    queries. The key-padding mask is applied apart (:func:`kept_keys`)."""
    mask = (other[None, :] >= lo[:, None]) & (other[None, :] < hi[:, None])
    if DOCUMENTS:
        other_ids = tl.load(other_ids_base + other, mask=other < n_other, other=-1)
        mask = mask & (ids[:, None] == other_ids[None, :])
    if TILES:
        if TRANSPOSED:
            mask = mask & tile_visible(other, own, tiles_base, tile_bits, query_tiles, key_tiles, TILE_ROWS,
                                       TILE_COLS, True)
        else:
            mask = mask & tile_visible(own, other, tiles_base, tile_bits, query_tiles, key_tiles, TILE_ROWS,
                                       TILE_COLS, False)
    return mask


@triton.jit
def kept_keys(key_mask_base, keys, M):
    """``(len(keys),)`` booleans of the key-padding mask row at ``key_mask_base`` (uint8, 1 = keep);
    False past ``M``."""
    return tl.load(key_mask_base + keys, mask=keys < M, other=0) != 0


@triton.jit
def mask_scores(scores, keys, M, lo, hi, row_ids, k_ids_base, key_mask_base, own, tiles_base, tile_bits, query_tiles,
                key_tiles, MASKED: tl.constexpr, DOCUMENTS: tl.constexpr, TILES: tl.constexpr,
                TILE_ROWS: tl.constexpr, TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr):
    r"""A row kernel's ``scores`` (queries ``own`` by keys) with :math:`-\infty` where a query does not see a key:
    element by element (:func:`visible`) on a ``MASKED`` tile; on a whole one (:func:`sweep_bounds`) only
    where the key-padding mask drops the key."""
    if MASKED:
        visible_keys = visible(keys, M, lo, hi, row_ids, k_ids_base, own, tiles_base, tile_bits, query_tiles,
                               key_tiles, DOCUMENTS, TILES, TILE_ROWS, TILE_COLS, False)
        scores = tl.where(visible_keys, scores, float("-inf"))
    if HAS_KEY_MASK:
        scores = tl.where(kept_keys(key_mask_base, keys, M)[None, :], scores, float("-inf"))
    return scores


@triton.jit
def probabilities(
    q, k, row_max, log_sum, keys, M, qk_scale, lo, hi, row_ids, k_ids_base, key_mask_base, own, tiles_base, tile_bits,
    query_tiles, key_tiles, MASKED: tl.constexpr, PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr,
    TILES: tl.constexpr, TILE_ROWS: tl.constexpr, TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
):
    r"""Tile :math:`P_{ij} = 2^{(s_{ij} - m_i) - \log_2 \ell_i}` of a row kernel (:func:`load_softmax_stats`),
    zero where the query does not see the key (:func:`mask_scores`); ``qk_scale`` is :math:`\tau \log_2 e`."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    scores = mask_scores(scores, keys, M, lo, hi, row_ids, k_ids_base, key_mask_base, own, tiles_base, tile_bits,
                         query_tiles, key_tiles, MASKED, DOCUMENTS, TILES, TILE_ROWS, TILE_COLS, HAS_KEY_MASK)
    return tl.exp2((scores - row_max[:, None]) - log_sum[:, None])


@triton.jit
def probabilities_transposed(
    k, q, row_max, log_sum, rows, keys, N, M, qk_scale, lo, hi, key_ids, q_ids_base, key_mask_base, own, tiles_base,
    tile_bits, query_tiles, key_tiles, MASKED: tl.constexpr, PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr,
    TILES: tl.constexpr, TILE_ROWS: tl.constexpr, TILE_COLS: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
):
    r"""Tile :math:`P^\top` (keys by queries) of a column kernel, zero where the query does not see the key:
    element by element (:func:`visible`, each key's visible queries ``[lo, hi)``) on a ``MASKED`` tile, and
    for keys the key-padding mask drops. Keys past M need no mask (their rows are never stored); queries past N
    come with ``row_max = +inf`` (:func:`load_softmax_stats`), so that their P is 0."""
    scores = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
    if MASKED:
        visible_queries = visible(rows, N, lo, hi, key_ids, q_ids_base, own, tiles_base, tile_bits, query_tiles,
                                  key_tiles, DOCUMENTS, TILES, TILE_ROWS, TILE_COLS, True)
        scores = tl.where(visible_queries, scores, float("-inf"))
    if HAS_KEY_MASK:
        scores = tl.where(kept_keys(key_mask_base, keys, M)[:, None], scores, float("-inf"))
    return tl.exp2((scores - row_max[None, :]) - log_sum[None, :])


@triton.jit
def optional_block(source, start, rows, n_rows, stride_row, placeholder, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, PRESENT: tl.constexpr, TMA: tl.constexpr):
    """:func:`load_block` of an operand that may be absent (a cotangent or tangent that is zero);
    ``placeholder``, which the caller never reads, when it is."""
    if PRESENT:
        tile = load_block(source, start, rows, n_rows, stride_row, HEAD_DIM, BLOCK_D, TMA)
    else:
        tile = placeholder
    return tile


@triton.jit
def tile_sources(
    x_base, y_base, dx_base, dy_base, n_rows, stride_x, stride_y, stride_dx, stride_dy, HEAD_DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DX: tl.constexpr, HAS_DY: tl.constexpr, TMA: tl.constexpr,
):
    """:func:`tile_source` of two operands and of their directions, all ``(n_rows, HEAD_DIM)``, the tiles that
    :func:`load_tile_group` reads; an absent direction's source is its pointer, which is never read."""
    x_src = tile_source(x_base, n_rows, stride_x, HEAD_DIM, BLOCK_ROWS, BLOCK_D, TMA)
    y_src = tile_source(y_base, n_rows, stride_y, HEAD_DIM, BLOCK_ROWS, BLOCK_D, TMA)
    dx_src = tile_source(dx_base, n_rows, stride_dx, HEAD_DIM, BLOCK_ROWS, BLOCK_D, TMA and HAS_DX)
    dy_src = tile_source(dy_base, n_rows, stride_dy, HEAD_DIM, BLOCK_ROWS, BLOCK_D, TMA and HAS_DY)
    return x_src, y_src, dx_src, dy_src


@triton.jit
def key_value_sources(K, V, batch, kv_head, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, M,
                      HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """The :func:`head_tile_source` of one kv head's keys and values (``BLOCK_N`` rows a tile)."""
    k_src = head_tile_source(K, batch, kv_head, stride_kb, stride_kh, M, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    v_src = head_tile_source(V, batch, kv_head, stride_vb, stride_vh, M, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    return k_src, v_src


@triton.jit
def head_tile_sources(
    X, Y, DX, DY, batch, head, stride_xb, stride_xh, stride_yb, stride_yh, stride_dxb, stride_dxh, stride_dyb,
    stride_dyh, n_rows, stride_x, stride_y, stride_dx, stride_dy, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_DX: tl.constexpr, HAS_DY: tl.constexpr, TMA: tl.constexpr,
):
    """:func:`tile_sources` of one (batch, head) of two operands and their directions (:func:`head_pointer`)."""
    x_base = head_pointer(X, batch, head, stride_xb, stride_xh)
    y_base = head_pointer(Y, batch, head, stride_yb, stride_yh)
    dx_base = head_pointer(DX, batch, head, stride_dxb, stride_dxh)
    dy_base = head_pointer(DY, batch, head, stride_dyb, stride_dyh)
    return tile_sources(x_base, y_base, dx_base, dy_base, n_rows, stride_x, stride_y, stride_dx, stride_dy, HEAD_DIM,
                        BLOCK_ROWS, BLOCK_D, HAS_DX, HAS_DY, TMA)


@triton.jit
def load_tile_group(
    x_src, y_src, dx_src, dy_src, start, rows, n_rows, stride_x, stride_y, stride_dx, stride_dy,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DX: tl.constexpr, HAS_DY: tl.constexpr, TMA: tl.constexpr,
):
    r"""Rows ``rows = start + arange`` of two operands ``x``, ``y`` and of their optional directions ``dx``, ``dy``
    (cotangents or tangents: e.g. :math:`K, V, \bar W, \bar Z` or :math:`Q, dO, \dot Q, d\dot O`), in that
    order, through their sources (:func:`tile_sources`); ``x`` and ``y`` stand in for an absent ``dx`` and
    ``dy`` (:func:`optional_block`)."""
    x = load_block(x_src, start, rows, n_rows, stride_x, HEAD_DIM, BLOCK_D, TMA)
    y = load_block(y_src, start, rows, n_rows, stride_y, HEAD_DIM, BLOCK_D, TMA)
    dx = optional_block(dx_src, start, rows, n_rows, stride_dx, x, HEAD_DIM, BLOCK_D, PRESENT=HAS_DX, TMA=TMA)
    dy = optional_block(dy_src, start, rows, n_rows, stride_dy, y, HEAD_DIM, BLOCK_D, PRESENT=HAS_DY, TMA=TMA)
    return x, y, dx, dy


@triton.jit
def tile_product(x, y, TRANSPOSED: tl.constexpr, PRECISION: tl.constexpr):
    r"""The tile :math:`x y^\top` of a block of query-side rows ``x`` and key-side rows ``y``
    (queries by keys), or its transpose :math:`y x^\top` (keys by queries) when ``TRANSPOSED``."""
    if TRANSPOSED:
        product = tl.dot(y, tl.trans(x), input_precision=PRECISION)
    else:
        product = tl.dot(x, tl.trans(y), input_precision=PRECISION)
    return product


@triton.jit
def bilinear_tile(x, dx, y, dy, HAS_DX: tl.constexpr, HAS_DY: tl.constexpr, TRANSPOSED: tl.constexpr,
                  PRECISION: tl.constexpr):
    r"""The tile :math:`dx\, y^\top + x\, dy^\top` (:func:`tile_product`'s orientation): the change of
    :math:`x y^\top` along :math:`(dx, dy)`, e.g. BoB's dual scores :math:`\bar U K^\top + Q \bar W^\top` or
    forward mode's :math:`\dot Q K^\top + Q \dot K^\top`. An absent direction's term is compiled out; at
    least one of ``HAS_DX``, ``HAS_DY`` must hold."""
    if HAS_DX:
        product = tile_product(dx, y, TRANSPOSED=TRANSPOSED, PRECISION=PRECISION)
        if HAS_DY:
            product += tile_product(x, dy, TRANSPOSED=TRANSPOSED, PRECISION=PRECISION)
    else:
        product = tile_product(x, dy, TRANSPOSED=TRANSPOSED, PRECISION=PRECISION)
    return product


@triton.jit
def add_product_change(acc, p, g, dp_centered, y, dy, HAS_DY: tl.constexpr, PRECISION: tl.constexpr):
    r"""``acc`` plus the change of :math:`dS\, Y` (:math:`dS = P \circ (dP - \Delta)`) along a direction:
    :math:`(P \circ G)\, Y + dS\, \dot Y`, where :math:`P \circ G` is the change of dS and ``dy`` the change
    of ``y`` (its term compiled out without ``HAS_DY``). The score-shaped factors are rounded to the
    dtype of the rows they multiply. E.g. BoB's :math:`\bar Q / \tau \mathrel{+}= G_S K + dS\, \bar W`, or
    forward mode's :math:`d\dot Q / \tau \mathrel{+}= d\dot S K + dS \dot K`; keys by queries in column sweeps."""
    acc += tl.dot((p * g).to(y.dtype), y, input_precision=PRECISION)
    if HAS_DY:
        acc += tl.dot((p * dp_centered).to(dy.dtype), dy, input_precision=PRECISION)
    return acc


# ----------------------------------------------------------------------------- host helpers


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise unless ``q (B, H, N, d)``, ``k, v (B, Hkv, M, d)`` are attention inputs the kernels can
    launch (:func:`flashbob.inputs.check_inputs`, :func:`flashbob.inputs.check_triton_limits`)."""
    check_inputs(q, k, v)
    check_triton_limits(q, k)


def key_mask_operand(key_mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The bool key-padding mask as a contiguous ``(B, M)`` uint8 tensor (1 = keep) and ``HAS_KEY_MASK``
    (TypeError for another dtype); without a mask, a one-byte placeholder the kernels never read
    (:func:`key_mask_placeholder`; a new one where ``q`` is traced, as a graph takes no tensor made outside it)."""
    if key_mask is None:
        if tracing.traced((q,)):
            return torch.empty(1, dtype=torch.uint8, device=q.device), False
        return key_mask_placeholder(q.device), False
    if key_mask.dtype != torch.bool:  # a cast to uint8 would read 0.5 or 256 as 0 (masked), not as True
        raise TypeError(f"key_mask must be a bool tensor (True = keep the key), got {key_mask.dtype}")
    if key_mask.shape != (q.shape[0], k.shape[2]):
        raise ValueError(f"key_mask must have shape (batch, M) = {(q.shape[0], k.shape[2])}; got {tuple(key_mask.shape)}")
    return key_mask.to(device=q.device, dtype=torch.uint8).contiguous(), True


@functools.cache
def key_mask_placeholder(device: torch.device) -> torch.Tensor:
    """The one-byte uint8 tensor passed as the key-padding mask when there is none, made once per device: the
    kernels never read it, and a new one per call would cost an allocation (and on a GPU a fill kernel)."""
    return torch.zeros(1, dtype=torch.uint8, device=device)


@triton.jit
def key_mask_pointer(KEY_MASK, batch, M):
    """Start of one batch element's row of the ``(B, M)`` key-padding mask."""
    return KEY_MASK + batch.to(tl.int64) * M


def operand(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype of ``like`` with unit stride along head_dim (the kernels' only layout
    requirement: other strides are passed to the kernels). Copies only when that is not already so."""
    x = in_dtype(x, like.dtype)
    return x if x.stride(-1) == 1 else x.contiguous()


def in_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, skipped when ``x`` already has that dtype: the same tensor either way, for a comparison
    of ~0.1 us instead of a ~2 us call (the kernels' wrappers make five to eleven per call)."""
    return x if x.dtype == dtype else x.to(dtype)


def row_statistic(x: torch.Tensor, q: torch.Tensor, name: str = "delta") -> torch.Tensor:
    """A ``(B, H, N)`` statistic of ``q``'s rows (delta) as a contiguous tensor in the accumulator
    dtype (copied only if needed: N floats per head, cheap)."""
    if x.shape != q.shape[:3]:
        raise ValueError(f"{name} must have shape {tuple(q.shape[:3])}; got {tuple(x.shape)}")
    return in_dtype(x, accumulator_dtype(q.dtype)).contiguous()


def softmax_stats(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The forward's ``(B, H, 2, N)`` softmax statistics of ``q``'s rows, contiguous, accumulator dtype."""
    batch, heads, n, _ = q.shape
    if x.shape != (batch, heads, 2, n):
        raise ValueError(f"stats must be the forward's softmax statistics of shape {(batch, heads, 2, n)}; "
                         f"got {tuple(x.shape)}")
    return in_dtype(x, accumulator_dtype(q.dtype)).contiguous()


def logsumexp(stats: torch.Tensor) -> torch.Tensor:
    r"""Natural-log :math:`\mathrm{lse}_i = \log \sum_j e^{S_{ij}} = (m_i + \log_2 \ell_i) / \log_2 e` from
    the forward's ``(B, H, 2, N)`` statistics; ``+inf`` for rows that see no key."""
    return (stats[:, :, 0] + stats[:, :, 1]) / LOG2E.value


def statistics_tangent(r_dot: torch.Tensor) -> torch.Tensor:
    r"""A tangent of the ``(B, H, 2, N)`` statistics whose :func:`logsumexp` is ``r_dot`` ``(B, H, N)``, the
    tangent :math:`\dot r` of the row log-sum-exp: :math:`(0, \dot r \log_2 e)` (the statistics are used only
    through :math:`m + \log_2 \ell`, so this is as good a tangent as any other with that sum)."""
    return torch.stack((torch.zeros_like(r_dot), r_dot * LOG2E.value), dim=2)


def dot_precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    """``input_precision`` of ``tl.dot``: tf32 only for float32 inputs that allow it."""
    return "tf32" if dtype == torch.float32 and allow_tf32 else "ieee"


@functools.cache
def head_dim_block(head_dim: int) -> int:
    """Padded head_dim of a tile: the next power of two, at least 16 (the smallest ``tl.dot`` size)."""
    return max(16, triton.next_power_of_2(head_dim))


def strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, row) strides of a ``(B, H, rows, d)`` tensor with unit stride along d."""
    return x.stride()[:3]


def with_strides(*tensors: torch.Tensor) -> tuple:
    """A kernel's leading arguments: the ``(B, H, rows, d)`` operands ``tensors``, then the
    :func:`strides` of each, in the same order."""
    return (*tensors, *(s for x in tensors for s in strides(x)))


def row_grid(n: int, batch_heads: int):
    """The launch grid of a row kernel: a program per block of ``BLOCK_M`` of the ``n`` queries and per
    (batch, head)."""
    return lambda meta: (triton.cdiv(n, meta["BLOCK_M"]), batch_heads)


def column_grid(m: int, batch_kv_heads: int):
    """The launch grid of a column kernel: a program per block of ``BLOCK_N`` of the ``m`` keys and per
    (batch, kv head)."""
    return lambda meta: (triton.cdiv(m, meta["BLOCK_N"]), batch_kv_heads)


def check_shaped_like(*named: tuple[str, torch.Tensor | None, torch.Tensor]) -> None:
    """Raise ValueError unless each present ``x`` of ``(name, x, like)`` has the shape of ``like``."""
    for name, x, like in named:
        if x is not None and x.shape != like.shape:
            raise ValueError(f"{name} must have shape {tuple(like.shape)}; got {tuple(x.shape)}")


def kernel_constants(q: torch.Tensor, masks: KernelMasks, allow_tf32: bool, **flags: bool) -> dict:
    """The compile-time arguments of every attention kernel for inputs like ``q`` with ``masks``, plus ``flags``
    (which cotangents or tangents are present)."""
    head_dim = int(q.shape[-1])  # a compile-time constant: a symbolic head_dim (torch.compile) is specialised
    return dict(HEAD_DIM=head_dim, BLOCK_D=head_dim_block(head_dim), PRECISION=dot_precision(q.dtype, allow_tf32),
                BAND=masks.band, DOCUMENTS=masks.documents, TILES=masks.tiles, TILE_ROWS=masks.tile_rows,
                TILE_COLS=masks.tile_cols, HAS_KEY_MASK=masks.has_key_mask, **flags)


class KernelMasks:
    """The masks of a kernel launch (:mod:`flashbob.masks`) as its arguments: after the kernel's tensors and
    strides, ``KEY_MASK, IDS_Q, IDS_K, RANGES, window_left, window_right, TILE_STATE, TILE_BITS, query_tiles,
    key_tiles`` (:meth:`row_arguments` for the kernels that sweep keys per query block, :meth:`column_arguments`
    for those that sweep queries per key block), and the flags ``BAND``, ``DOCUMENTS``, ``TILES`` (with the tile
    size ``TILE_ROWS``, ``TILE_COLS``), ``HAS_KEY_MASK`` (:func:`kernel_constants`).

    The band is the window's ``(left, right)`` with ``causal`` as ``right = 0``; an unbounded side is passed as
    ``N + M``, which no distance reaches. ``RANGES`` (the positions' visible ranges: the documents'
    :func:`flashbob.masks.document_ranges` and a block mask's :func:`flashbob.masks.tile_ranges`, intersected) are
    made on first use, the queries' for row kernels and the keys' for column kernels. A block mask comes as its
    tiles (:func:`flashbob.masks.block_tiles`), one set for all heads. Absent masks are passed as a placeholder the
    kernels never read."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, *, causal: bool, window, key_mask, q_ids, k_ids,
                 tile_state=None, tile_bits=None):
        if tile_state is not None and tile_state.shape[1] != 1:
            raise ValueError("the Triton kernels take a block_mask that is the same for every head; flashbob.attention "
                             "runs a per-head block mask on the blocked backend")
        self.key_mask, self.has_key_mask = key_mask_operand(key_mask, q, k)
        placeholder = key_mask_operand(None, q, k)[0]
        self.n, self.m = n, m = q.shape[2], k.shape[2]
        band_ = band(causal, window)
        self.band = band_ is not None
        unbounded = n + m
        left, right = band_ if band_ is not None else (0, 0)
        self.left = unbounded if left is None else min(left, unbounded)
        self.right = unbounded if right is None else min(right, unbounded)
        self.documents = q_ids is not None
        self.q_ids = q_ids.to(q.device).contiguous() if self.documents else placeholder
        self.k_ids = k_ids.to(q.device).contiguous() if self.documents else placeholder
        self.tiles = tile_state is not None
        self.tile_state, self.tile_bits = tile_state, tile_bits
        self.tile_rows, self.tile_cols = tile_bits.shape[1:] if self.tiles else (16, 16)
        self.query_tiles, self.key_tiles = tile_state.shape[2:] if self.tiles else (1, 1)
        self._placeholder = placeholder

    @functools.cached_property
    def q_ranges(self) -> torch.Tensor:
        return self._ranges(transposed=False)

    @functools.cached_property
    def k_ranges(self) -> torch.Tensor:
        return self._ranges(transposed=True)

    def _ranges(self, *, transposed: bool) -> torch.Tensor:
        documents = tiles = None
        if self.documents:
            documents = document_ranges(self.k_ids, self.q_ids) if transposed else document_ranges(self.q_ids, self.k_ids)
        if self.tiles:
            tiles = tile_ranges(self.tile_state, self.tile_bits, self.n, self.m, transposed=transposed)
        ranges = intersect_ranges(documents, tiles)
        return self._placeholder if ranges is None else ranges

    @functools.cached_property
    def _tile_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.tiles:
            return self._placeholder, self._placeholder
        bits = self.tile_bits.to(torch.uint8).contiguous() if self.tile_bits.numel() else self._placeholder
        return self.tile_state.to(torch.int32).contiguous(), bits

    def row_arguments(self) -> tuple:
        return (self.key_mask, self.q_ids, self.k_ids, self.q_ranges, self.left, self.right, *self._tile_operands,
                self.query_tiles, self.key_tiles)

    def column_arguments(self) -> tuple:
        return (self.key_mask, self.q_ids, self.k_ids, self.k_ranges, self.left, self.right, *self._tile_operands,
                self.query_tiles, self.key_tiles)
