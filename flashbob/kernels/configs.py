"""Launch configurations of every kernel: candidates, defaults, pruning, where a launch's configuration
comes from, and the launcher.

Each kernel has a space of candidate configurations (``spaces.json``), pruned to what fits the head_dim,
dtype and length (:func:`candidates`); the first one that fits is the default. A launch uses, for its key
(kernel, head_dim, dtype, length bucket and compile-time flags; :mod:`.tuning` describes the key, the
tables and the cache), the first of

1. the configuration in the user's tuning cache (``$FLASHBOB_CACHE_DIR``, else ``~/.cache/flashbob``);
2. this GPU's shipped table, found by its exact device name: the key's own entry, else that of the nearest
   length bucket of the same kernel, head_dim, dtype and flags;
3. the shipped tables of this GPU's architecture (compute capability ``major.minor``; sm90: the H200's
   table, then the H100's; ``tuning.ARCHITECTURE_TABLES``), in that order, by the same rule;
4. the default.

Nothing is tuned unless asked. ``FLASHBOB_AUTOTUNE``: unset or ``0`` (the default), as above;
``1`` tunes, in place of steps 3 and 4, each key that neither the cache nor this GPU's own table holds (every
candidate is timed at the key's first launch, the fastest stored in the cache); ``force`` tunes every key at
its first launch in the process, ignoring cache and tables, and stores the picks in the cache
(benchmarks/tune_table.py); ``defaults`` uses the defaults whatever the cache and tables hold (to time them
against the tuned ones). ``flashbob.tune(...)`` (``tuning.tune``) tunes the kernels of given shapes into the
cache. Inside :func:`override`, and in Triton's interpreter, the default is used. A configuration the
compiler rejects gives way to the next candidate.

Variants: a kernel may have code paths besides the base one (``"tma"``: tiles through tensor descriptors,
TMA on Hopper). ``spaces.json`` names each kernel's variants and its default one, which a configuration
without a variant runs (candidates, tuning, table and cache entries of four numbers); an entry of five, or
``override(variant=...)``, names one. Where tensor descriptors cannot address the operands (a GPU before
Hopper, unaligned strides) ``"tma"`` falls back to the base code with the same tiles (:func:`variant_for`).

``FLASHBOB_KERNEL_VARIANT`` (:func:`forced_variant`): unset, each launch runs its configuration's variant;
a variant's name (``base``, ``tma``), every kernel that has that variant runs it, whatever the
configuration says (``override(variant=...)`` still wins), e.g. to run a whole program or the test suite
on one variant. A key tuned while it is set is timed with the variant and its tiles are cached like any
other pick.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import triton

from flashbob import _compat
from flashbob.kernels import tracing, tuning


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Launch parameters of one kernel.

    ``block_m`` is the number of query rows and ``block_n`` the number of key rows of a tile (the
    outer block of row kernels is ``block_m``, of column kernels ``block_n``). ``variant`` names the code
    path: ``"base"`` or one that ``spaces.json`` lists for the kernel (``"tma"``: tiles read and written
    through tensor descriptors, TMA on Hopper); ``None``, the kernel's default (:func:`variant_for`).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    variant: str | None = None


def _load_spaces() -> tuple[dict[str, tuple[BlockConfig, ...]], dict[str, tuple[int, int, int, int]],
                             dict[str, tuple[str, ...]]]:
    """The candidates, footprint and variants (its default first) of every kernel from ``spaces.json`` beside
    this module."""
    table = json.loads((Path(__file__).with_name("spaces.json")).read_text())
    spaces = {kernel: tuple(BlockConfig(*c) for c in entry["candidates"]) for kernel, entry in table.items()}
    variants = {}
    for kernel, entry in table.items():
        default = entry.get("default_variant", "base")
        variants[kernel] = (default, *(name for name in ("base", *entry.get("variants", ())) if name != default))
    return spaces, {kernel: tuple(entry["footprint"]) for kernel, entry in table.items()}, variants


# Candidates per kernel for 16-bit inputs, the first one that fits being the default (no tuning), and each
# kernel's footprint: live tiles per program, as (accumulators over the outer block, 16-bit input tiles over
# the outer block, score-shaped tiles block_m x block_n, tiles streamed per loop step over the inner block).
# spaces.json says where the defaults come from. VARIANTS: each kernel's code paths, its default first (what a
# configuration without a variant runs, tuned ones included); a table or cache entry, or override(variant=...),
# may name another.
SPACES, _FOOTPRINT, VARIANTS = _load_spaces()
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


@functools.cache
def candidates(kernel: str, head_dim: int, dtype: torch.dtype, length: int) -> tuple[BlockConfig, ...]:
    """The space of ``kernel`` for this head_dim, dtype and sequence length, pruned to what fits.

    Blocks larger than the (power-of-two rounded) length are dropped. 32- and 64-bit inputs take
    half blocks (at least 16, the smallest ``tl.dot``): exact ``tl.dot`` runs on the CUDA cores and needs
    far more registers. The smallest config is kept as a last resort so that the result is never empty.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    space = SPACES[kernel]
    if dtype.itemsize >= 4:
        space = tuple(BlockConfig(max(16, c.block_m // 2), c.block_n if c.block_n == 1 else max(16, c.block_n // 2),
                                  c.num_warps, c.num_stages) for c in space)
    limit = tuning.bucket(length)
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
    e.g. ``override(block_m=16, block_n=16)`` so that small test inputs span several tiles, or
    ``override(variant="tma")`` (kernels without that variant run their base code)."""
    unknown = set(fields) - {f.name for f in dataclasses.fields(BlockConfig)}
    if unknown:
        raise ValueError(f"unknown BlockConfig fields {sorted(unknown)}")
    known_variants = sorted({name for names in VARIANTS.values() for name in names})
    if fields.get("variant", "base") not in known_variants:
        raise ValueError(f"unknown variant {fields['variant']!r}; expected one of {known_variants}")
    previous = dict(_overrides)
    _overrides.update(fields)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(previous)


_mode: str | None = None  # the tuning mode inside tuning_as(), whatever FLASHBOB_AUTOTUNE says
MODES = {"0": "off", "1": "on", "force": "force", "defaults": "defaults"}


def tuning_mode() -> str:
    """``"off"``, ``"on"``, ``"force"`` or ``"defaults"`` from ``FLASHBOB_AUTOTUNE`` (``0``, ``1``, ``force``,
    ``defaults``; unset or empty is ``0``: no tuning; this module's docstring says what each does), or the mode
    of :func:`tuning_as` (which may also be ``"fill"``); ``"defaults"`` inside :func:`override` and in Triton's
    interpreter."""
    value = os.environ.get("FLASHBOB_AUTOTUNE") or "0"
    if value not in MODES:
        raise ValueError(f"FLASHBOB_AUTOTUNE must be 1, 0, force or defaults; got {value!r}")
    if _overrides or _in_interpreter():
        return "defaults"
    return _mode or MODES[value]


def _in_interpreter() -> bool:
    """Whether the kernels run in Triton's interpreter, where timing them means nothing."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@contextlib.contextmanager
def tuning_as(mode: str) -> Iterator[None]:
    """Launches inside the ``with`` block pick their configuration in tuning ``mode`` (:func:`tuning_mode`'s
    values, or ``"fill"``: the cache's configuration, else tune and store it; the tables are not consulted),
    whatever ``FLASHBOB_AUTOTUNE`` says (:func:`override` and the interpreter still give the defaults)."""
    if mode not in (*MODES.values(), "fill"):
        raise ValueError(f"unknown tuning mode {mode!r}")
    global _mode
    previous, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = previous


def autotune_enabled() -> bool:
    """Whether a launch may tune (:func:`tuning_mode` is ``"on"``, ``"force"`` or ``"fill"``)."""
    return tuning_mode() in ("on", "force", "fill")


@dataclasses.dataclass(frozen=True)
class Pick:
    """The configuration a key is launched with, and where it came from: ``"cache"``, ``"table"`` (this GPU's),
    ``"arch_table"`` (its architecture's), ``"tuned"`` or ``"default"``."""

    config: BlockConfig
    source: str


_PICKS: dict[tuple[tuning.Key, str | None, str], Pick] = {}  # per (key, GPU, tuning mode), for this process


#: Compile-time arguments that are not flags of a tuning key: head_dim fixes BLOCK_D, and a block mask's tiles
#: are tuned as the masks without them.
NOT_TUNING_FLAGS = ("HEAD_DIM", "BLOCK_D", "TILES", "TILE_ROWS", "TILE_COLS")


def tuning_key(kernel: str, head_dim: int, dtype: torch.dtype, length: int, constants: dict) -> tuning.Key:
    """The key of a launch: its compile-time ``constants`` but :data:`NOT_TUNING_FLAGS` are its flags. Memoised on
    its arguments (:func:`_tuning_key`): every launch asks for its key."""
    return _tuning_key(kernel, head_dim, dtype, length, tuple(constants.items()))


@functools.lru_cache(maxsize=4096)
def _tuning_key(kernel: str, head_dim: int, dtype: torch.dtype, length: int,
                constants: tuple[tuple[str, object], ...]) -> tuning.Key:
    flags = tuple(sorted((name, value) for name, value in constants if name not in NOT_TUNING_FLAGS))
    return tuning.Key(kernel, head_dim, str(dtype).removeprefix("torch."), tuning.bucket(length), flags)


def config_tuple(config: BlockConfig) -> tuning.Config:
    """``config`` as tables and caches hold it: ``(block_m, block_n, num_warps, num_stages)``, with the variant
    appended if it names one (none: the kernel's default)."""
    values = dataclasses.astuple(config)
    return values[:4] if config.variant is None else values


def pick(key: tuning.Key, space: tuple[BlockConfig, ...], gpu: str | None, mode: str,
         run: Callable[[BlockConfig], None], capability: str | None = None) -> Pick:
    """The configuration of a launch with ``key`` among the candidates ``space`` on ``gpu`` (None: not a GPU,
    only the default) of compute capability ``capability`` (``"9.0"``; None: unknown, no architecture table)
    in tuning ``mode`` (:func:`tuning_mode`), by the order of this module's docstring; ``run(config)``
    launches the kernel, for tuning. A cache or table entry may also name a candidate's variant; tuning times
    the candidates in the kernel's default variant."""
    tuned = [config_tuple(config) for config in space]
    allowed = tuned + [config_tuple(dataclasses.replace(config, variant=variant)) for config in space
                       for variant in VARIANTS.get(key.kernel, ("base",))]
    if gpu is None or mode == "defaults":
        return Pick(space[0], "default")
    if mode in ("on", "off", "fill"):
        cached = tuning.read_cache(gpu, key)
        if cached in allowed:
            return Pick(BlockConfig(*cached), "cache")
        if cached is not None:
            warnings.warn(f"flashbob: ignoring the tuning cache file {tuning.cache_path(gpu, key)}: its configuration "
                          f"{list(cached)} is not a candidate of {key.describe()}", RuntimeWarning, stacklevel=2)
    tables = tuning.tables_for(gpu, capability) if mode in ("on", "off") else []
    for source, path in tables[:1] if mode == "on" else tables:  # "on" tunes what this GPU's own table lacks
        listed = tuning.lookup(tuning.load_table(path), key, allowed)
        if listed is not None:
            return Pick(BlockConfig(*listed), source)
    if mode in ("on", "force", "fill") and len(space) > 1:
        best, timings = tuning.tune_key(key, tuned, lambda config: run(BlockConfig(*config)))
        tuning.write_cache(gpu, key, best, timings)
        return Pick(BlockConfig(*best), "tuned")
    return Pick(space[0], "default")


def launch(kernel: str, jit_fn, grid, *args, head_dim: int, dtype: torch.dtype, length: int,
           descriptors: tuple[torch.Tensor, ...] = (), **constants) -> None:
    """Launch ``jit_fn`` (which takes ``BLOCK_M`` and ``BLOCK_N``) on ``grid`` with the configuration that
    :func:`pick` gives its key (once per process), or the next candidate if the compiler finds that it needs
    more shared memory or registers than the GPU has; inside :func:`override`, with :func:`choose`'s.
    ``length`` is the sequence length that sizes the blocks (N for row kernels, M for column kernels).
    A kernel with variants also takes ``TMA``; ``descriptors`` are the operands that its ``"tma"`` variant
    addresses through tensor descriptors (:func:`variant_for`). Triton launches on the current device: on
    another GPU than the operands', the launch (and any tuning) runs with theirs made current. On traced tensors
    (torch.compile) it is recorded, untuned, and in the interpreter skipped (:mod:`.tracing`)."""
    if tracing.traced(args) and tracing.interpreted():
        return
    head_dim, length = int(head_dim), int(length)  # symbolic sizes (torch.compile's dynamic shapes) are specialised
    index, gpu, capability = _gpu(args)
    if index is not None and index != torch.cuda.current_device():
        with torch.cuda.device(index):
            _launch(kernel, jit_fn, grid, args, head_dim, dtype, length, descriptors, constants, gpu, capability)
    else:
        _launch(kernel, jit_fn, grid, args, head_dim, dtype, length, descriptors, constants, gpu, capability)


def _launch(kernel: str, jit_fn, grid, args: tuple, head_dim: int, dtype: torch.dtype, length: int,
            descriptors: tuple[torch.Tensor, ...], constants: dict, gpu: str | None, capability: str | None) -> None:
    run = functools.partial(_run, kernel, tracing.launcher(jit_fn, args), grid, args, constants,
                            descriptors=descriptors)
    if _overrides:
        run(choose(kernel, head_dim, dtype, length))
        return
    key = tuning_key(kernel, head_dim, dtype, length, constants)
    space = candidates(kernel, head_dim, dtype, length)
    mode = tuning_mode()
    memo = (key, gpu, "off" if mode != "defaults" and tracing.traced(args) else mode)  # nothing to time when traced
    if memo not in _PICKS:
        _PICKS[memo] = pick(key, space, *memo[1:], run=run, capability=capability)
    chosen = _PICKS[memo]
    for config in _fallback_order(chosen.config, space):
        try:
            run(config)
        except tuning.REJECTED as error:  # the ones the tuner skips too (a table tuned with another Triton)
            rejected = error
            continue
        if config != chosen.config:  # remembered, so that the rejected one is not compiled again
            _PICKS[memo] = dataclasses.replace(chosen, config=config)
        return
    raise rejected


def _fallback_order(first: BlockConfig, space: tuple[BlockConfig, ...]) -> Iterator[BlockConfig]:
    """``first``, then the other candidates of ``space`` in order, each once: the configurations a launch tries
    until the compiler accepts one. Lazy: the usual launch, whose first configuration compiles, compares none."""
    yield first
    yield from (config for config in space if config != first)


def variant_for(kernel: str, config: BlockConfig, descriptors: tuple[torch.Tensor, ...]) -> str:
    """The variant that a launch of ``kernel`` with ``config`` runs: ``config.variant`` (``None``: the kernel's
    default) if the kernel has it and, for ``"tma"``, if :func:`descriptors_usable` holds for the
    ``descriptors`` operands; else ``"base"`` (the same outputs, the same tiles; :func:`override` may name a
    variant that other kernels lack)."""
    variant = config.variant or VARIANTS[kernel][0]
    if variant not in VARIANTS[kernel]:
        return "base"
    if variant == "tma" and not descriptors_usable(descriptors):
        return "base"
    return variant


def descriptors_usable(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether tensor descriptors (TMA) can address every ``(B, H, rows, d)`` tensor of ``tensors``: on an NVIDIA
    GPU of compute capability 9 or more (or in Triton's interpreter, which emulates them), with 16-byte aligned
    starts, unit stride along d and 16-byte multiples for the other strides (what TMA requires), the rows'
    not 0 (a matrix expanded along its rows: a descriptor's stride must be positive; the batch and head
    strides only move its start). ROCm GPUs, which torch also calls ``cuda``, run the base code."""
    if not tensors:
        return False
    device = tensors[0].device
    if device.type == "cuda":
        if torch.version.hip is not None:
            return False
        if _compute_capability(torch.cuda.current_device() if device.index is None else device.index)[0] < 9:
            return False
    elif os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    for x in tensors:  # plain loops: this runs at every launch of a kernel with the variant
        *outer, last = x.stride()
        if last != 1 or tracing.address(x) % 16 or outer[-1] == 0:
            return False
        size = x.element_size()
        for stride in outer:
            if stride * size % 16:
                return False
    return True


def forced_variant() -> str | None:
    """The variant ``FLASHBOB_KERNEL_VARIANT`` names (``None`` if unset or empty).

    Raises:
        ValueError: it names no variant of any kernel.
    """
    value = os.environ.get("FLASHBOB_KERNEL_VARIANT", "")
    if not value:
        return None
    known = sorted({name for names in VARIANTS.values() for name in names})
    if value not in known:
        raise ValueError(f"FLASHBOB_KERNEL_VARIANT must be one of {', '.join(known)} or unset; got {value!r}")
    return value


def _run(kernel: str, jit_fn, grid, args: tuple, constants: dict, config: BlockConfig, *,
         descriptors: tuple[torch.Tensor, ...] = ()) -> None:
    forced = forced_variant()
    if forced in VARIANTS[kernel] and "variant" not in _overrides:
        config = dataclasses.replace(config, variant=forced)
    variant = variant_for(kernel, config, descriptors)
    if len(VARIANTS[kernel]) > 1:
        constants = {**constants, "TMA": variant == "tma"}
    if variant == "tma" and descriptors[0].device.type == "cuda":
        _ensure_allocator()
    jit_fn[grid](*args, **constants, BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps,
                 num_stages=config.num_stages)


def _gpu(args: tuple) -> tuple[int | None, str | None, str | None]:
    """The index, name and architecture (:func:`_architecture`) of the GPU that holds the first tensor of
    ``args``; ``(None, None, None)`` if it is not on a GPU. One lookup per launch: the index picks the device to
    launch on, the name and architecture the configuration."""
    device = next((x.device for x in args if isinstance(x, torch.Tensor)), None)
    if device is None or device.type != "cuda":
        return None, None, None
    index = torch.cuda.current_device() if device.index is None else device.index
    return index, _device_name(index), _architecture(index)


def _ensure_allocator() -> None:
    """Tensor descriptors made inside a kernel live in global scratch memory that Triton asks its allocator for;
    if this thread has none (Triton's default raises), give it one that takes the memory from torch."""
    if not _compat.triton_has_allocator():
        triton.set_allocator(_scratch)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.cache
def _compute_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _architecture(index: int) -> str | None:
    """The compute capability of GPU ``index`` as ``"major.minor"`` (``"9.0"``: Hopper), which picks the
    architecture's tables; None on ROCm, whose capabilities (gfx90a reports 9.0) name no NVIDIA architecture."""
    if torch.version.hip is not None:
        return None
    return tuning.capability_name(_compute_capability(index))


def tuned_configs() -> list[dict]:
    """The configuration each key launched in this process uses and its source (:class:`Pick`), one row per
    key: kernel, head_dim, dtype, bucket, flags, gpu, config, source (for benchmarks and docs)."""
    return [{**key.to_json(), "gpu": gpu, "config": dataclasses.asdict(chosen.config), "source": chosen.source}
            for (key, gpu, _), chosen in _PICKS.items()]
