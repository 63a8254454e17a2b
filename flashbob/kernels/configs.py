"""Launch configurations of every kernel: defaults, autotune spaces, pruning, and the launcher.

On a GPU each kernel is autotuned (``triton.autotune``) over the candidates of its space that
fit, once per (head_dim, dtype, power-of-two bucket of the sequence length) and per compile-time
flag set (causal, which cotangents exist). Set ``FLASHBOB_AUTOTUNE=0`` to skip tuning and use the
hand-picked defaults (the first candidate of each space); Triton's interpreter never tunes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import triton
from triton.runtime.errors import OutOfResources


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


def _load_spaces() -> tuple[dict[str, tuple[BlockConfig, ...]], dict[str, tuple[int, int, int, int]]]:
    """The candidates and footprint of every kernel from ``spaces.json`` beside this module."""
    table = json.loads((Path(__file__).with_name("spaces.json")).read_text())
    spaces = {kernel: tuple(BlockConfig(*c) for c in entry["candidates"]) for kernel, entry in table.items()}
    return spaces, {kernel: tuple(entry["footprint"]) for kernel, entry in table.items()}


# Candidates per kernel for 16-bit inputs, the first one that fits being the default (no tuning), and each
# kernel's footprint: live tiles per program, as (accumulators over the outer block, 16-bit input tiles over
# the outer block, score-shaped tiles block_m x block_n, tiles streamed per loop step over the inner block).
# spaces.json says where the defaults come from.
SPACES, _FOOTPRINT = _load_spaces()
KERNELS = tuple(SPACES)

COLUMN_KERNELS = ("dkdv", "bob_cols", "jvp_cols")  # outer block of keys (block_n), inner of queries
MAX_REGISTERS_PER_THREAD = 256  # sm_90 has 255 per thread: over this estimate a config cannot fit
MAX_SHARED_BYTES = 220 * 1024  # sm_90 allows 227 KiB per block

_overrides: dict[str, int] = {}

def fits(kernel: str, config: BlockConfig, head_dim: int, dtype: torch.dtype) -> bool:
    """Rough register and shared-memory budget of ``config``: configs that cannot fit are pruned."""
    accumulators, inputs, scores, streamed = _FOOTPRINT[kernel]
    block_d = max(16, triton.next_power_of_2(head_dim))
    outer, inner = (config.block_n, config.block_m) if kernel in COLUMN_KERNELS else (config.block_m, config.block_n)
    words = accumulators * outer * block_d + inputs * outer * block_d * dtype.itemsize / 4
    words += scores * config.block_m * config.block_n
    shared = config.num_stages * streamed * inner * block_d * dtype.itemsize
    return words / (32 * config.num_warps) <= MAX_REGISTERS_PER_THREAD and shared <= MAX_SHARED_BYTES


@functools.lru_cache(maxsize=None)
def candidates(kernel: str, head_dim: int, dtype: torch.dtype, length: int) -> tuple[BlockConfig, ...]:
    """The space of ``kernel`` for this head_dim, dtype and sequence length, pruned to what fits.

    Blocks larger than the (power-of-two rounded) length are dropped. 32- and 64-bit inputs take
    half blocks (at least 16, the smallest ``tl.dot``): exact ``tl.dot`` runs on the CUDA cores and needs
    far more registers. The
    smallest config is kept as a last resort so that the result is never empty.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    space = SPACES[kernel]
    if dtype.itemsize >= 4:
        space = tuple(BlockConfig(max(16, c.block_m // 2), c.block_n if c.block_n == 1 else max(16, c.block_n // 2),
                                  c.num_warps, c.num_stages) for c in space)
    limit = max(16, triton.next_power_of_2(length))
    kept = tuple(dict.fromkeys(
        c for c in space if fits(kernel, c, head_dim, dtype) and min(c.block_m, c.block_n) <= limit
    ))
    return kept or (min(space, key=lambda c: (c.block_m * c.block_n, -c.num_warps)),)


def choose(kernel: str, head_dim: int, dtype: torch.dtype, length: int = 1 << 30) -> BlockConfig:
    """The default (untuned) launch parameters: the first candidate that fits, with any
    :func:`override` applied."""
    return dataclasses.replace(candidates(kernel, head_dim, dtype, length)[0], **_overrides)


@contextlib.contextmanager
def override(**fields: int) -> Iterator[None]:
    """Force fields of every :class:`BlockConfig` inside the ``with`` block (tuning is off there),
    e.g. ``override(block_m=16, block_n=16)`` so that small test inputs span several tiles."""
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


def autotune_enabled() -> bool:
    """Tuning runs on real GPUs unless ``FLASHBOB_AUTOTUNE=0`` or an :func:`override` is active."""
    return (
        os.environ.get("FLASHBOB_AUTOTUNE", "1") != "0"
        and os.environ.get("TRITON_INTERPRET", "0") != "1"
        and not _overrides
    )


_TUNERS: dict[tuple, object] = {}


def _tuned(kernel: str, jit_fn, head_dim: int, dtype: torch.dtype, bucket: int, flags: tuple[str, ...]):
    """One ``triton.autotune`` wrapper per (kernel, head_dim, dtype, length bucket, flag names); it
    keys its own cache on the values of the compile-time ``flags`` (and on argument dtypes)."""
    key = (kernel, head_dim, dtype, bucket, flags)
    if key not in _TUNERS:
        space = [
            triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}, num_warps=c.num_warps, num_stages=c.num_stages)
            for c in candidates(kernel, head_dim, dtype, bucket)
        ]
        _TUNERS[key] = triton.autotune(configs=space, key=list(flags))(jit_fn)
    return _TUNERS[key]


def launch(kernel: str, jit_fn, grid, *args, head_dim: int, dtype: torch.dtype, length: int, **constants) -> None:
    """Launch ``jit_fn`` (which takes ``BLOCK_M`` and ``BLOCK_N``) on ``grid``: autotuned when
    :func:`autotune_enabled`, else with :func:`choose`'s config (or the next candidate, if the
    compiler finds that it needs more shared memory or registers than the GPU has). ``length`` is
    the sequence length that sizes the blocks (N for row kernels, M for column kernels)."""
    if autotune_enabled():
        bucket = triton.next_power_of_2(length)
        tuned = _tuned(kernel, jit_fn, head_dim, dtype, bucket, tuple(sorted(constants)))
        tuned[grid](*args, **constants)
        return
    if _overrides:
        fallbacks = (choose(kernel, head_dim, dtype, length),)
    else:  # the fit estimate is rough: a config the compiler rejects falls back to the next one
        fallbacks = candidates(kernel, head_dim, dtype, length)
    for position, config in enumerate(fallbacks):
        try:
            jit_fn[grid](*args, **constants, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                         num_warps=config.num_warps, num_stages=config.num_stages)
            return
        except OutOfResources:
            if position == len(fallbacks) - 1:
                raise


def tuned_configs() -> list[dict]:
    """The configs autotuning picked so far, one row per tuned case (for benchmarks and docs)."""
    return [
        {"kernel": kernel, "head_dim": head_dim, "dtype": str(dtype).removeprefix("torch."), "bucket": bucket,
         "flags": dict(zip(flags, key)), "config": str(config)}
        for (kernel, head_dim, dtype, bucket, flags), tuner in _TUNERS.items()
        for key, config in tuner.cache.items()
    ]
