r"""Which keys each query sees: the masks of :func:`flashbob.attention`, their checks, and their host-side forms.

Query :math:`i` sees key :math:`j` where every mask given allows it (the masks combine by AND):

* ``causal``: :math:`j \le i` (top-left aligned);
* ``window = (left, right)``: :math:`i - \text{left} \le j \le i + \text{right}`, a bound of None being unbounded;
  ``causal`` is the window ``(None, 0)``, and the two combine into one *band* ``(left, right)``;
* ``document_ids``: :math:`\text{id}^q_i = \text{id}^k_j` (packed sequences);
* ``key_mask``: key :math:`j` is kept;
* ``block_mask``: a FlexAttention ``BlockMask`` (mask_mod only) allows :math:`(i, j)`. It is held as its tiles
  (:func:`block_tiles`): the state of each (query block, key block) tile, empty, whole or partial, and the
  element-wise mask of the partial tiles only, so that its memory follows the partial tiles, not ``N x M``.

Masks enter the attention formulas only through :math:`P`: a hidden entry has :math:`S_{ij} = -\infty`, so
:math:`P_{ij} = 0`, and every row scalar and BoB term sums over visible entries only. The passes skip the blocks
no query of a block sees (:func:`document_ranges` gives their bounds for documents) and evaluate the mask element
by element only where a block is partly visible; :class:`Mask` does this for the blocked backend and
:mod:`flashbob.kernels.common` for the kernels.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

Band = tuple[int | None, int | None]

#: ``tile_state`` entries: a tile no query of sees any key of, a tile seen whole; a partial tile holds its index
#: into ``tile_bits`` (>= 0).
EMPTY, WHOLE = -1, -2
#: Tiles whose mask_mod is evaluated at once (bounds the temporaries of the evaluation).
TILES_PER_EVALUATION = 256


def check_window(window) -> Band | None:
    """Validate ``window = (left, right)``: each bound an int >= 0 or None (unbounded). Returns it as a tuple."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a pair (left, right) of ints >= 0 or None, got {window!r}")
    for name, bound in zip(("left", "right"), window):
        if bound is None:
            continue
        if isinstance(bound, bool) or not isinstance(bound, int):
            raise TypeError(f"window's {name} bound must be an int >= 0 or None, got {bound!r}")
        if bound < 0:
            raise ValueError(f"window's {name} bound must be >= 0 (None for unbounded), got {bound}")
    return int(window[0]) if window[0] is not None else None, int(window[1]) if window[1] is not None else None


def band(causal: bool, window: Band | None) -> Band | None:
    """The band ``(left, right)`` that ``causal`` and ``window`` allow together, or None when neither bounds it.
    ``causal`` is the band ``(None, 0)``."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0
    return None if left is None and right is None else (left, right)


def check_document_ids(document_ids, q: torch.Tensor, k: torch.Tensor):
    """Validate ``document_ids``: one integer ``(B, N)`` tensor for self-attention (``N == M``), or a pair
    ``(q_ids (B, N), k_ids (B, M))``. Returns ``(q_ids, k_ids)`` as contiguous int64 tensors, or ``(None, None)``."""
    if document_ids is None:
        return None, None
    batch, n, m = q.shape[0], q.shape[2], k.shape[2]
    if isinstance(document_ids, torch.Tensor):
        if n != m:
            raise ValueError(
                f"document_ids as one tensor is for self-attention (N == M); got N = {n}, M = {m}: pass a pair "
                "(q_ids (batch, N), k_ids (batch, M))"
            )
        pair = (document_ids, document_ids)
    elif isinstance(document_ids, (tuple, list)) and len(document_ids) == 2:
        pair = tuple(document_ids)
    else:
        raise TypeError(
            "document_ids must be an integer tensor (batch, N) or a pair (q_ids (batch, N), k_ids (batch, M)), "
            f"got {type(document_ids).__name__}"
        )
    checked = []
    single = isinstance(document_ids, torch.Tensor)
    for name, axis, ids, length in zip(("q_ids", "k_ids"), "NM", pair, (n, m)):
        name = "document_ids" if single else f"document_ids' {name}"
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{name} must be an integer torch.Tensor, got {type(ids).__name__}")
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"{name} must be an integer tensor (e.g. torch.long), got {ids.dtype}")
        if tuple(ids.shape) != (batch, length):
            raise ValueError(f"{name} must have shape (batch, {axis}) = {(batch, length)}, got {tuple(ids.shape)}")
        if ids.device != q.device:
            raise ValueError(f"{name} is on {ids.device} but q is on {q.device}; all inputs must be on one device")
        checked.append(ids.to(torch.int64).contiguous())
    return tuple(checked)


def band_bounds(index: torch.Tensor, other_length: int, band_: Band | None, *, transposed: bool = False):
    """For each position in ``index`` (queries, or keys when ``transposed``), the range ``[lo, hi)`` of the other
    axis that the band lets it see (keys ``[i - left, i + right]``; queries ``[j - right, j + left]``)."""
    lo = torch.zeros_like(index)
    hi = torch.full_like(index, other_length)
    if band_ is not None:
        before, after = band_[::-1] if transposed else band_
        if before is not None:
            lo = (index - before).clamp(min=0)
        if after is not None:
            hi = (index + after + 1).clamp(max=other_length)
    return lo, hi


def document_ranges(own_ids: torch.Tensor, other_ids: torch.Tensor) -> torch.Tensor:
    """``(B, 4, L)`` int32: for each of the ``L`` positions of one side (queries, or keys), the hull
    ``[lo, hi)`` of the positions of the other side in its document, and ``[whole_lo, whole_hi)``, where it sees
    every position: the hull itself if the document is one run there, else empty. Computed by sorting, in
    ``O((N + M) log M)``; the passes skip the blocks outside the hull and mask only where a block is not whole.
    A position whose document has no member on the other side gets empty ranges."""
    sorted_ids, order = torch.sort(other_ids, dim=-1, stable=True)
    own_ids = own_ids.contiguous()
    first = torch.searchsorted(sorted_ids, own_ids, side="left")
    after = torch.searchsorted(sorted_ids, own_ids, side="right")
    count = after - first
    last_index = order.shape[-1] - 1
    lo = torch.gather(order, -1, first.clamp(max=last_index))
    hi = torch.gather(order, -1, (after - 1).clamp(min=0, max=last_index)) + 1
    present = count > 0
    lo, hi = torch.where(present, lo, 0), torch.where(present, hi, 0)
    whole = present & (hi - lo == count)
    return torch.stack((lo, hi, lo, torch.where(whole, hi, lo)), dim=1).to(torch.int32).contiguous()


@torch.compiler.disable  # host work (its tiles are data-dependent): a graph break under torch.compile
def block_tiles(block_mask, q: torch.Tensor, k: torch.Tensor):
    """Validate a FlexAttention ``BlockMask`` for ``q``, ``k`` and return its tiles ``(tile_state, tile_bits)``, or
    ``(None, None)``.

    ``tile_state`` is int32 ``(B, H or 1, ceil(N / rows), ceil(M / cols))`` for the block mask's tile size
    ``(rows, cols)``: :data:`EMPTY`, :data:`WHOLE`, or the index of a partial tile in ``tile_bits``, bool
    ``(partial tiles, rows, cols)``, its mask_mod evaluated there (False past N and M). The tiles the block mask
    lists as full are whole, the others it lists partial (all of them when it keeps no full blocks apart). The
    result is kept per block mask and device, as a block mask is made once and used by many calls. Under
    torch.compile the call breaks the graph here (``window=`` and ``document_ids=`` do not)."""
    if block_mask is None:
        return None, None
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise TypeError("block_mask must be a torch.nn.attention.flex_attention.BlockMask (create_block_mask), "
                        f"got {type(block_mask).__name__}")
    batch, heads, n, m = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    q_len, kv_len = (int(x) for x in block_mask.seq_lengths)
    if (q_len, kv_len) != (n, m):
        raise ValueError(f"block_mask was built for Q_LEN = {q_len}, KV_LEN = {kv_len} but the inputs have N = {n} "
                         f"queries and M = {m} keys; build it with create_block_mask(..., Q_LEN={n}, KV_LEN={m})")
    mask_batch, mask_heads = block_mask.kv_num_blocks.shape[:2]
    if mask_batch not in (1, batch) or mask_heads not in (1, heads):
        raise ValueError(f"block_mask has batch {mask_batch} and {mask_heads} heads; the inputs have batch {batch} "
                         f"and {heads} heads (a block mask's batch and heads must be 1 or the inputs')")
    key = (id(block_mask), q.device)
    if key not in _TILES:
        _TILES[key] = _tiles(block_mask, n, m, q.device)
        weakref.finalize(block_mask, _TILES.pop, key, None)
    tile_state, tile_bits = _TILES[key]
    return tile_state.expand(batch, *tile_state.shape[1:]), tile_bits


_TILES: dict = {}


def _tiles(block_mask, n: int, m: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = (int(x) for x in block_mask.BLOCK_SIZE)
    q_blocks, k_blocks = -(-n // rows), -(-m // cols)
    mask_batch, mask_heads = block_mask.kv_num_blocks.shape[:2]
    state = torch.full((mask_batch, mask_heads, q_blocks, k_blocks), EMPTY, dtype=torch.int32, device=device)

    def listed(counts, indices):
        counts, indices = counts[..., :q_blocks].to(device), indices[..., :q_blocks, :].to(device)
        valid = torch.arange(indices.shape[-1], device=device) < counts[..., None]
        b, h, query_block, slot = valid.nonzero(as_tuple=True)
        return b, h, query_block, indices[b, h, query_block, slot].long()

    if block_mask.full_kv_num_blocks is not None:
        b, h, query_block, key_block = listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        state[b, h, query_block, key_block] = WHOLE
    b, h, query_block, key_block = listed(block_mask.kv_num_blocks, block_mask.kv_indices)
    state[b, h, query_block, key_block] = torch.arange(len(b), dtype=torch.int32, device=device)
    bits = torch.zeros(len(b), rows, cols, dtype=torch.bool, device=device)
    evaluate = torch.vmap(torch.vmap(torch.vmap(block_mask.mask_mod, in_dims=(None, None, None, 0)),
                                     in_dims=(None, None, 0, None)), in_dims=(0, 0, 0, 0))
    for start in range(0, len(b), TILES_PER_EVALUATION):
        part = slice(start, start + TILES_PER_EVALUATION)
        query = query_block[part, None] * rows + torch.arange(rows, device=device)
        key = key_block[part, None] * cols + torch.arange(cols, device=device)
        inside = (query < n)[:, :, None] & (key < m)[:, None, :]
        allowed = evaluate(b[part], h[part], query.clamp(max=n - 1), key.clamp(max=m - 1))
        bits[part] = allowed.to(torch.bool) & inside
    return state, bits


def tile_ranges(tile_state: torch.Tensor, tile_bits: torch.Tensor, n: int, m: int, *,
                transposed: bool = False) -> torch.Tensor:
    """``(B, 4, N)`` int32, as :func:`document_ranges`, for a block mask's tiles (one set for all heads:
    ``tile_state`` ``(B, 1, N tiles, M tiles)``): each query's keys ``[lo, hi)`` from its tile row's first to
    last non-empty tile, and ``[whole_lo, whole_hi)`` the first run of whole tiles in it; each key's queries
    with ``transposed`` (``(B, 4, M)``)."""
    state = tile_state[:, 0]
    own_size, other_size = tile_bits.shape[1:] if not transposed else tile_bits.shape[1:][::-1]
    own_length, other_length = (m, n) if transposed else (n, m)
    if transposed:
        state = state.transpose(1, 2)
    tiles = torch.arange(state.shape[-1], device=state.device)
    seen = state != EMPTY
    present = seen.any(dim=-1)
    first = torch.where(seen, tiles, state.shape[-1]).amin(dim=-1)
    last = torch.where(seen, tiles, -1).amax(dim=-1)
    whole = state == WHOLE
    whole_first = torch.where(whole, tiles, state.shape[-1]).amin(dim=-1)
    after = tiles >= whole_first[..., None]
    run = torch.cumprod(torch.where(after, whole, True).int(), dim=-1) * after
    whole_end = whole_first + run.sum(dim=-1)
    lo = torch.where(present, first * other_size, 0)
    hi = torch.where(present, ((last + 1) * other_size).clamp(max=other_length), 0)
    has_whole = whole.any(dim=-1)
    whole_lo = torch.where(has_whole, whole_first * other_size, lo)
    whole_hi = torch.where(has_whole, (whole_end * other_size).clamp(max=other_length), lo)
    ranges = torch.stack((lo, hi, whole_lo, whole_hi), dim=1).repeat_interleave(own_size, dim=-1)
    return ranges[..., :own_length].to(torch.int32).contiguous()


def intersect_ranges(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """The ranges (``(B, 4, L)``, :func:`document_ranges`) that both allow."""
    if a is None or b is None:
        return a if b is None else b
    return torch.stack((torch.maximum(a[:, 0], b[:, 0]), torch.minimum(a[:, 1], b[:, 1]),
                        torch.maximum(a[:, 2], b[:, 2]), torch.minimum(a[:, 3], b[:, 3])), dim=1).contiguous()


@dataclass(frozen=True)
class Mask:
    """The masks of one attention call over ``n`` queries and ``m`` keys, as the blocked backend evaluates them on
    panels: :meth:`visible` on a block of the score matrix, :meth:`keys_seen_by` and :meth:`queries_seeing` for
    the part of a panel any position can see."""

    n: int
    m: int
    band: Band | None = None
    key_mask: torch.Tensor | None = None
    q_ids: torch.Tensor | None = None
    k_ids: torch.Tensor | None = None
    tile_state: torch.Tensor | None = None
    tile_bits: torch.Tensor | None = None

    def visible(self, rows: slice, cols: slice, device: torch.device) -> torch.Tensor | None:
        """Bool ``(B or 1, H or 1, len(rows), len(cols))``: True where query ``i`` sees key ``j`` (in head ``h``,
        for a block mask per head); None when all do."""
        keep = None
        i = torch.arange(rows.start, rows.stop, device=device)
        j = torch.arange(cols.start, cols.stop, device=device)
        if self.band is not None:
            lo, hi = band_bounds(i, self.m, self.band)
            keep = ((j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None]))[None, None]
        if self.q_ids is not None:
            keep = _and(keep, (self.q_ids[:, rows, None] == self.k_ids[:, None, cols])[:, None])
        if self.key_mask is not None:
            keep = _and(keep, self.key_mask[:, None, None, cols])
        if self.tile_state is not None:
            tile_rows, tile_cols = self.tile_bits.shape[1:]
            state = self.tile_state[:, :, i // tile_rows][:, :, :, j // tile_cols]
            bits = self.tile_bits[state.clamp(min=0), (i % tile_rows)[:, None], (j % tile_cols)[None, :]]
            keep = _and(keep, (state == WHOLE) | ((state >= 0) & bits))
        return keep

    def keys_seen_by(self, rows: slice) -> slice:
        """The keys that any query of ``rows`` may see (a superset: the band and the documents' hulls)."""
        lo, hi = self._bounds(rows, self.m, transposed=False)
        return slice(lo, max(lo, hi))

    def queries_seeing(self, cols: slice) -> slice:
        """The queries that may see any key of ``cols`` (a superset, as :meth:`keys_seen_by`)."""
        lo, hi = self._bounds(cols, self.n, transposed=True)
        return slice(lo, max(lo, hi))

    def _bounds(self, span: slice, other_length: int, *, transposed: bool) -> tuple[int, int]:
        lo, hi = self._band_and_document_bounds(span, other_length, transposed=transposed)
        if self.tile_state is not None and hi > lo:
            tile_rows, tile_cols = self.tile_bits.shape[1:]
            own, other = (tile_cols, tile_rows) if transposed else (tile_rows, tile_cols)
            state = self.tile_state.transpose(2, 3) if transposed else self.tile_state
            seen = (state[:, :, span.start // own:-(-span.stop // own)] != EMPTY).any(dim=(0, 1, 2)).nonzero()
            if len(seen) == 0:
                return 0, 0
            lo, hi = max(lo, int(seen[0]) * other), min(hi, (int(seen[-1]) + 1) * other)
        return lo, hi

    def _band_and_document_bounds(self, span: slice, other_length: int, *, transposed: bool) -> tuple[int, int]:
        if self.band is None and self.q_ids is None:
            return 0, other_length
        device = (self.q_ids if self.q_ids is not None else torch.empty(0)).device
        index = torch.arange(span.start, span.stop, device=device)
        lo, hi = band_bounds(index, other_length, self.band, transposed=transposed)
        if self.q_ids is not None:
            own, other = (self.k_ids, self.q_ids) if transposed else (self.q_ids, self.k_ids)
            ranges = document_ranges(own[:, span], other)
            lo, hi = torch.maximum(lo, ranges[:, 0]), torch.minimum(hi, ranges[:, 1])
        seen = lo < hi
        if not bool(seen.any()):
            return 0, 0
        return int(lo[seen].min()), int(hi[seen].max())


def _and(keep: torch.Tensor | None, more: torch.Tensor) -> torch.Tensor:
    return more if keep is None else keep & more


def dense(n: int, m: int, *, causal: bool = False, window: Band | None = None, key_mask=None, document_ids=None,
          block_mask=None, device=None) -> torch.Tensor:
    """The materialised ``(B or 1, H or 1, N, M)`` bool mask of these masks (True = visible), to compare with or
    to pass to a materialising attention as ``attn_mask``. ``document_ids``: a ``(B, N)`` tensor or a pair;
    ``block_mask``: a FlexAttention ``BlockMask`` (evaluated by its own ``to_dense`` rules: its tiles and
    mask_mod)."""
    if isinstance(document_ids, torch.Tensor):
        document_ids = (document_ids, document_ids)
    q_ids, k_ids = document_ids if document_ids is not None else (None, None)
    tile_state = tile_bits = None
    if block_mask is not None:
        tile_state, tile_bits = _tiles(block_mask, n, m, device or block_mask.kv_num_blocks.device)
    mask = Mask(n, m, band(causal, check_window(window)), key_mask, q_ids, k_ids, tile_state, tile_bits)
    keep = mask.visible(slice(0, n), slice(0, m), device)
    if keep is None:
        return torch.ones(1, 1, n, m, dtype=torch.bool, device=device)
    return keep
