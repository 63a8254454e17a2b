"""Block sizes, warps and pipeline stages of every kernel, chosen in one place."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Launch parameters of one kernel.

    ``block_m`` is the number of query rows and ``block_n`` the number of key rows of a tile (the
    outer block of row kernels is ``block_m``, of column kernels ``block_n``).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# kernel -> configs for head_dim <= 64, <= 128, <= 256 (16-bit inputs). Picked so that ptxas
# reports no (or almost no) register spills for sm_90 in Triton 3.9; not yet timed.
_TABLE = {
    "forward": (BlockConfig(128, 64, 4, 3), BlockConfig(128, 64, 8, 3), BlockConfig(64, 32, 8, 2)),
    "delta": (BlockConfig(64, 1, 4, 1), BlockConfig(32, 1, 4, 1), BlockConfig(16, 1, 4, 1)),
    "dq": (BlockConfig(64, 64, 4, 2), BlockConfig(64, 64, 8, 2), BlockConfig(32, 32, 8, 1)),
    "dkdv": (BlockConfig(32, 64, 4, 2), BlockConfig(32, 64, 8, 2), BlockConfig(32, 32, 8, 1)),
    "bob_rows": (BlockConfig(32, 32, 4, 2), BlockConfig(32, 32, 8, 2), BlockConfig(16, 32, 8, 2)),
    "bob_cols": (BlockConfig(64, 32, 4, 2), BlockConfig(64, 32, 8, 2), BlockConfig(32, 32, 8, 1)),
}
KERNELS = tuple(_TABLE)

_overrides: dict[str, int] = {}


def choose(kernel: str, head_dim: int, dtype: torch.dtype) -> BlockConfig:
    """Launch parameters of ``kernel`` (one of :data:`KERNELS`) for this head_dim and dtype.

    Hand-picked for an H200, pending autotuning: the forward keeps one query tile and one output
    accumulator in registers and takes large tiles; the backward kernels hold two accumulators;
    BoB's row sweep holds four ``(block_m, head_dim)`` accumulators and three input tiles, so its
    tiles shrink as head_dim grows. float32/float64 inputs (exact ``tl.dot`` runs on the CUDA
    cores, not the tensor cores) halve both blocks and take 8 warps.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    size = 0 if head_dim <= 64 else 1 if head_dim <= 128 else 2
    config = _TABLE[kernel][size]
    if dtype.itemsize >= 4:
        config = BlockConfig(max(16, config.block_m // 2), max(1, config.block_n // 2), 8, config.num_stages)
    return dataclasses.replace(config, **_overrides)


@contextlib.contextmanager
def override(**fields: int) -> Iterator[None]:
    """Force fields of every :class:`BlockConfig` inside the ``with`` block, e.g.
    ``override(block_m=16, block_n=16)`` so that small test inputs span several tiles."""
    unknown = set(fields) - {f.name for f in dataclasses.fields(BlockConfig)}
    if unknown:
        raise ValueError(f"unknown BlockConfig fields {sorted(unknown)}")
    previous = dict(_overrides)
    _overrides.update(fields)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(previous)
