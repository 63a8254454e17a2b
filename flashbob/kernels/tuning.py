"""Where a kernel's launch configuration comes from: tuned tables shipped per GPU, the user's tuning cache on
disk, and the tuner that fills the cache when asked (:func:`tune`, ``FLASHBOB_AUTOTUNE=1``).

A configuration is tuned per *key*: the kernel, head_dim, dtype, length bucket (the sequence length rounded
up to a power of two) and the values of the kernel's compile-time flags (causal, which cotangents or tangents
are present, key mask, dot precision; head_dim fixes the others).

**Lookup order** (``configs.pick`` applies it; with default settings nothing is ever tuned):

1. the user's tuning cache (below), where it holds the key;
2. the table of this GPU, found by its exact name (``torch.cuda.get_device_name()``);
3. the tables of its architecture, found by compute capability ``major.minor``
   (:data:`ARCHITECTURE_TABLES`; sm90, e.g. an H100 PCIe, H100 NVL, H800 or GH200: the H200's table, then the
   H100's); not on ROCm, whose capabilities do not name NVIDIA architectures;
4. the kernel's built-in default (the first candidate of ``spaces.json`` that fits).

A table serves a key if it has an entry of the same kernel, head_dim, dtype and flags (a *family*): the
key's own length bucket, else the *nearest bucket* (nearest in ``log2`` of the length, the longer bucket on
a tie, among the entries whose configuration is a candidate at this length). So a length that no table
lists takes its neighbour's configuration without tuning, and the first table in the order above that
holds the family wins. ``FLASHBOB_AUTOTUNE=1`` tunes, instead of steps 3 and 4, what neither the cache nor
this GPU's own table holds; ``configs.py`` describes every setting.

**Shipped tables.** ``flashbob/kernels/tuned/<GPU>.json``, one file per GPU model, named after
``torch.cuda.get_device_name()`` with every run of characters other than letters and digits turned into
``_`` (``NVIDIA H200`` -> ``NVIDIA_H200.json``, ``NVIDIA H100 80GB HBM3`` -> ``NVIDIA_H100_80GB_HBM3.json``);
each records the compute capability of its GPU. ``benchmarks/tune_table.py`` writes them.

**Tuning cache.** One JSON file per key under ``<cache>/tuning/<GPU>/triton-<version>/``, where ``<cache>``
is ``$FLASHBOB_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashbob``, else ``~/.cache/flashbob``; :func:`tune`
(``flashbob.tune``) and ``FLASHBOB_AUTOTUNE=1`` write it, and what it holds wins over every table. A file is
written to a temporary name in the same folder and moved into place with ``os.replace``, which is atomic: a
reader sees a whole old file or a whole new one, and processes that tune the same key at once each leave a
whole, valid file (the last one wins). One file per key means that no writer has to merge with another, so
no lock is needed (none to go stale after a crash, none that a network file system would not honour). A
file that cannot be read or does not hold its key is ignored with a warning, and rewritten when the key is
tuned again.

**Tuner.** :func:`tune_key` times each candidate with :func:`benchmark` (``triton.testing.do_bench``,
median) and keeps the fastest; candidates the compiler rejects (out of shared memory or registers) are
skipped. It reports one line per kernel it tunes on stderr (through the progress bar of :func:`tune`, if
one is shown). Every kernel writes each output element once, from inputs it does not write, with no
atomics: timing the candidates on the launch's own buffers needs no reset, and the caller launches the pick
once more so that the outputs are the pick's. :func:`tune` runs the kernels of a Hessian-vector product at
the shapes it is given with tuning on, so that each key is tuned once and stored in the cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import triton
import triton.testing
from triton.compiler.errors import CompileTimeAssertionFailure
from triton.runtime.errors import OutOfResources, PTXASError

#: The folder of the shipped tables, one ``<GPU>.json`` each.
TABLE_DIR = Path(__file__).with_name("tuned")
#: The shipped tables that a GPU without a table of its own uses, per compute capability ``"major.minor"``, in
#: the order they are consulted (the first that holds a key's family serves it). Every shipped table records
#: its GPU's capability and is listed here under it (``tests/test_tuning.py`` checks this); a name whose
#: table is not shipped is skipped.
ARCHITECTURE_TABLES: dict[str, tuple[str, ...]] = {
    "9.0": ("NVIDIA H200", "NVIDIA H100 80GB HBM3"),  # Hopper (sm90)
}
#: Compiler errors that rule a candidate out (the ones ``triton.autotune`` skips too).
REJECTED = (OutOfResources, CompileTimeAssertionFailure, PTXASError)

Config = tuple  # (block_m, block_n, num_warps, num_stages[, variant]): configs.config_tuple


@dataclasses.dataclass(frozen=True)
class Key:
    """What a tuned configuration is for. ``flags`` holds ``(name, value)`` of the compile-time flags, sorted."""

    kernel: str
    head_dim: int
    dtype: str
    bucket: int
    flags: tuple[tuple[str, Any], ...]

    def family(self) -> tuple:
        """The key without its length bucket: the entries the nearest-bucket rule may choose from."""
        return self.kernel, self.head_dim, self.dtype, self.flags

    def sort_key(self) -> tuple:
        """Orders a table: by kernel, head_dim, dtype, flags, then length bucket."""
        return self.kernel, self.head_dim, self.dtype, json.dumps(self.flags), self.bucket

    def describe(self) -> str:
        flags = " ".join(f"{name}={value}" for name, value in self.flags)
        return f"{self.kernel} (head_dim {self.head_dim}, {self.dtype}, length <= {self.bucket}, {flags})"

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "head_dim": self.head_dim, "dtype": self.dtype, "bucket": self.bucket,
                "flags": dict(self.flags)}

    @classmethod
    def from_json(cls, entry: dict) -> Key:
        """The key of a table or cache entry; raises KeyError, TypeError or ValueError if it is malformed."""
        flags = entry["flags"]
        if not isinstance(flags, dict):
            raise TypeError(f"flags must be an object, got {flags!r}")
        key = cls(str(entry["kernel"]), int(entry["head_dim"]), str(entry["dtype"]), int(entry["bucket"]),
                  tuple(sorted(flags.items())))
        if key.head_dim < 1 or key.bucket < 1:
            raise ValueError(f"head_dim and bucket must be positive, got {key.head_dim} and {key.bucket}")
        return key


def bucket(length: int) -> int:
    """The length bucket of a sequence length: the next power of two (at least 16)."""
    return max(16, triton.next_power_of_2(length))


def gpu_file_name(gpu: str) -> str:
    """``gpu`` as a file name: every run of characters other than letters and digits becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9]+", "_", gpu).strip("_")


def _config(value: Any) -> Config:
    """``value`` as a configuration: four positive integers, optionally followed by the name of a
    variant (``configs.BlockConfig``; none: the kernel's default variant); raises ValueError or TypeError
    otherwise."""
    if (not isinstance(value, list) or len(value) not in (4, 5)
            or not all(isinstance(x, int) and x > 0 for x in value[:4])
            or (len(value) == 5 and not isinstance(value[4], str))):
        raise ValueError(f"a configuration is 4 positive integers (block_m, block_n, num_warps, num_stages) and "
                         f"optionally a variant name, got {value!r}")
    return tuple(value)


# ----------------------------------------------------------------------------- shipped tables


@functools.cache
def load_table(path: Path) -> dict[Key, Config]:
    """The entries of the table at ``path`` (empty if there is none); a malformed table raises ValueError."""
    if not path.exists():
        return {}
    try:
        return {Key.from_json(entry): _config(entry["config"]) for entry in json.loads(path.read_text())["entries"]}
    except (OSError, KeyError, TypeError, ValueError, RecursionError) as error:
        raise ValueError(f"the tuned table {path} is malformed: {error!r}") from error


def table_path(gpu: str) -> Path:
    """Where the shipped table of ``gpu`` is (or would be)."""
    return TABLE_DIR / f"{gpu_file_name(gpu)}.json"


def capability_name(capability: tuple[int, int]) -> str:
    """A compute capability as :data:`ARCHITECTURE_TABLES` and the tables' headers write it: ``(9, 0)`` -> ``"9.0"``."""
    major, minor = capability
    return f"{major}.{minor}"


def tables_for(gpu: str, capability: str | None) -> list[tuple[str, Path]]:
    """The shipped tables that serve ``gpu`` (of compute capability ``capability``, ``"9.0"``; None: unknown),
    in lookup order, each with the source name that a pick from it reports: its own (``"table"``), then those
    of its architecture (``"arch_table"``, :data:`ARCHITECTURE_TABLES`, without its own)."""
    own = table_path(gpu)
    chain = [("table", own)]
    for name in ARCHITECTURE_TABLES.get(capability, ()) if capability is not None else ():
        path = table_path(name)
        if path != own:
            chain.append(("arch_table", path))
    return chain


@functools.cache
def table_header(path: Path) -> dict:
    """The metadata of the table at ``path`` (everything but its entries; empty if there is none)."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as error:
        raise ValueError(f"the tuned table {path} is malformed: {error!r}") from error
    return {name: value for name, value in data.items() if name != "entries"}


def lookup(table: dict[Key, Config], key: Key, allowed: Sequence[Config]) -> Config | None:
    """The table's configuration for ``key``: its own entry, else that of the nearest bucket of the same
    kernel, head_dim, dtype and flags (nearest in ``log2`` of the length, the longer on a tie); only
    configurations in ``allowed`` (the candidates at this length) count. None if there is none."""
    family = [(k.bucket, config) for k, config in table.items() if k.family() == key.family() and config in allowed]
    if not family:
        return None
    distance = lambda entry: (abs(math.log2(entry[0]) - math.log2(key.bucket)), -entry[0])
    return min(family, key=distance)[1]


def write_table(path: Path, gpu: str, entries: dict[Key, Config], **metadata: Any) -> None:
    """Write a table for ``gpu``: ``metadata`` (e.g. the Triton version, the shapes tuned) and one entry per
    line, sorted, atomically (:func:`write_json`)."""
    lines = [json.dumps({**key.to_json(), "config": list(_config(list(config)))}) for key, config in
             sorted(entries.items(), key=lambda item: item[0].sort_key())]  # _config: never write what cannot load
    header = "".join(f" {json.dumps(name)}: {json.dumps(value)},\n" for name, value in {"gpu": gpu, **metadata}.items())
    write_json(path, "{\n" + header + ' "entries": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n")
    load_table.cache_clear()
    table_header.cache_clear()


# ----------------------------------------------------------------------------- tuning cache


def cache_root() -> Path:
    """``$FLASHBOB_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashbob``, else ``~/.cache/flashbob``."""
    if os.environ.get("FLASHBOB_CACHE_DIR"):
        return Path(os.environ["FLASHBOB_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashbob"


def cache_path(gpu: str, key: Key) -> Path:
    """The cache file of ``key`` on ``gpu`` with this Triton version."""
    flags = hashlib.sha1(json.dumps(key.flags).encode()).hexdigest()[:12]
    name = f"{key.kernel}-d{key.head_dim}-{key.dtype}-n{key.bucket}-{flags}.json"
    return cache_root() / "tuning" / gpu_file_name(gpu) / f"triton-{triton.__version__}" / name


def read_cache(gpu: str, key: Key) -> Config | None:
    """The cached configuration of ``key``, or None: none cached, or a file that cannot be read or holds
    another key (then with a warning; the key is tuned again and the file rewritten)."""
    path = cache_path(gpu, key)
    try:  # Path.exists() raises PermissionError for a folder that cannot be searched: read, and catch
        entry = json.loads(path.read_text())
        if Key.from_json(entry["key"]) != key:
            raise ValueError(f"it holds another key, {entry['key']}")
        return _config(entry["config"])
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, KeyError, TypeError, ValueError, RecursionError) as error:  # JSONDecodeError: a ValueError
        warnings.warn(f"flashbob: ignoring the unreadable tuning cache file {path} ({error}); the kernel is "
                      "tuned again and the file rewritten", RuntimeWarning, stacklevel=2)
        return None


def write_cache(gpu: str, key: Key, config: Config, timings: dict[Config, float]) -> None:
    """Store the tuned ``config`` of ``key`` (and each candidate's time in ms); a cache that cannot be
    written gives a warning, not an error."""
    entry = {"key": key.to_json(), "config": list(config), "gpu": gpu, "triton": triton.__version__,
             "times_ms": [[list(c), ms] for c, ms in timings.items()]}
    path = cache_path(gpu, key)
    try:
        write_json(path, json.dumps(entry, indent=1) + "\n")
    except OSError as error:
        warnings.warn(f"flashbob: cannot write the tuning cache file {path} ({error}); the pick holds for this "
                      "process only (set FLASHBOB_CACHE_DIR to a writable folder)", RuntimeWarning, stacklevel=2)


def write_json(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: to a temporary file in the same folder, then ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    try:
        os.chmod(file.name, 0o666 & ~_umask())  # mkstemp's 0600 would hide a shared cache from its other users
        os.replace(file.name, path)
    except OSError:
        os.unlink(file.name)
        raise


@functools.cache
def _umask() -> int:
    """The process's umask (read once: setting it is the only way to read it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ----------------------------------------------------------------------------- tuner


def benchmark(run: Callable[[], None]) -> float:
    """Median time of ``run`` in ms (``triton.testing.do_bench``, the warm-up and repetitions of
    ``triton.autotune``: 25 ms and 100 ms)."""
    return triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")


_timer: Callable[[Callable[[], None]], float] = benchmark


@contextlib.contextmanager
def timed_by(timer: Callable[[Callable[[], None]], float]) -> Iterator[None]:
    """Time candidates with ``timer`` (``run -> ms``) instead of :func:`benchmark` inside the ``with`` block."""
    global _timer
    previous, _timer = _timer, timer
    try:
        yield
    finally:
        _timer = previous


def tune_key(key: Key, candidates: Sequence[Config],
             run: Callable[[Config], None]) -> tuple[Config, dict[Config, float]]:
    """The fastest of ``candidates`` for ``key`` and each one's time in ms: ``run(config)`` launches the
    kernel with ``config``; candidates the compiler rejects are skipped (:data:`REJECTED`). Reports one line
    (stderr, or the progress bar of :func:`tune`). Raises the last rejection if every candidate is rejected."""
    start = time.perf_counter()
    _report_start(f"flashbob: tuning {key.describe()} over {len(candidates)} configs ...")
    timings, rejection = {}, None
    for config in candidates:
        try:
            timings[config] = _timer(lambda config=config: run(config))
        except REJECTED as error:
            rejection = error
    if not timings:
        _report_end(" every config was rejected")
        raise rejection
    best = min(timings, key=timings.get)
    block_m, block_n, num_warps, num_stages = best[:4]
    _report_end(f" BLOCK_M={block_m} BLOCK_N={block_n} num_warps={num_warps} num_stages={num_stages}: "
                f"{timings[best]:.3f} ms (tuned in {time.perf_counter() - start:.1f} s)")
    return best, timings


_bar = None  # the progress bar of tune(), if it shows one: the tuner's lines go through it
_line = ""  # the start of the line being reported while a bar is shown


def _report_start(text: str) -> None:
    global _line
    if _bar is None:
        print(text, end="", file=sys.stderr, flush=True)
    else:
        _line = text
        _bar.set_postfix_str(text.removeprefix("flashbob: tuning ").split(" (")[0], refresh=True)


def _report_end(text: str) -> None:
    if _bar is None:
        print(text, file=sys.stderr, flush=True)
    else:
        _bar.write(_line + text, file=sys.stderr)


# ----------------------------------------------------------------------------- tuning for given shapes

#: The groups of kernels that one Hessian-vector product launches: the forward and backward, BoB's four
#: sweeps, and the forward-mode kernels (forward-over-reverse).
PARTS = ("first_order", "bob", "forward_mode")


def run_hvp_kernels(head_dim: int, dtype: Any, causal: bool, length: int, heads: int, *, batch: int = 1,
                    parts: Sequence[str] = PARTS, mode: str = "force", device: Any = "cuda") -> None:
    """Launch, once, every kernel that one Hessian-vector product runs at this shape (inputs ``(batch,
    heads, length, head_dim)`` of ``dtype``, a ``torch.dtype`` or its name) in reverse mode (forward,
    backward, BoB with all three cotangents) and in forward mode (``forward_jvp``, ``backward_jvp`` with every
    tangent). The kernels of ``parts`` (:data:`PARTS`) launch in tuning ``mode`` (``configs.tuning_as``:
    ``"force"`` tunes each, ``"fill"`` each that the cache lacks), the others with their defaults."""
    import torch

    from flashbob import kernels

    from . import configs

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    generator = torch.Generator(device=device).manual_seed(0)
    tensor = lambda: torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype, generator=generator)
    q, k, v, do, q_bar, k_bar, v_bar, q_dot, k_dot, v_dot, do_dot = (tensor() for _ in range(11))
    options = {"causal": causal, "scale": head_dim**-0.5}
    launch_mode = lambda part: configs.tuning_as(mode if part in parts else "defaults")
    with launch_mode("first_order"):
        o, stats = kernels.forward(q, k, v, **options)
        _, _, _, delta = kernels.backward(q, k, v, o, stats, do, **options)
    with launch_mode("bob"):
        kernels.bob(q, k, v, do, o, stats, delta, q_bar, k_bar, v_bar, **options)
    with launch_mode("forward_mode"):
        kernels.forward_jvp(q, k, v, o, stats, q_dot, k_dot, v_dot, **options)
        kernels.backward_jvp(q, k, v, do, o, stats, delta, q_dot, k_dot, v_dot, do_dot, **options)
    if q.is_cuda:
        torch.cuda.synchronize(q.device)


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple, set, frozenset, range)) else (value,)


def tune(lengths: int | Sequence[int], *, head_dim: int | Sequence[int] = 128, dtype: Any = "bfloat16",
         causal: bool | Sequence[bool] = (False, True), heads: int = 16, batch: int = 1, forward_mode: bool = True,
         retune: bool = False, device: Any = None, progress: bool = True) -> list[dict]:
    """Tune the launch configurations of every kernel of attention, its backward, BoB and (``forward_mode``)
    the forward-mode kernels on this GPU for the given shapes, and store them in the tuning cache
    (``$FLASHBOB_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashbob``, else ``~/.cache/flashbob``), which every later
    launch on this GPU model reads first. Nothing else ever tunes, unless ``FLASHBOB_AUTOTUNE=1``.

    Each combination of ``lengths``, ``head_dim``, ``dtype`` and ``causal`` (each a value or a sequence of
    them) is one shape, ``(batch, heads, length, head_dim)``; a key is tuned per length bucket (the next power
    of two), and lengths between the tuned ones take the nearest tuned bucket. Keys the cache already holds
    are kept unless ``retune``; the GPU's shipped tables are not consulted (what is tuned here wins over
    them). Shows a progress bar over the shapes (``tqdm``, if installed and ``progress``) and one line per
    kernel tuned; each kernel takes seconds to a minute, most of it compiling the candidates the first time.

    Example::

        flashbob.tune([4096, 16384], head_dim=128, dtype=torch.bfloat16, causal=True)

    Args:
        device: the CUDA device to tune on (default: the current one); the cache is per GPU model.

    Returns:
        One row per key launched: kernel, head_dim, dtype, bucket, flags, gpu, config (block_m, block_n,
        num_warps, num_stages, variant) and source (``"tuned"`` now, ``"cache"`` kept from before,
        ``"default"`` for a kernel with one candidate).

    Raises:
        RuntimeError: there is no CUDA GPU (or ``device`` is not one).
    """
    import torch

    from . import configs

    device = torch.device("cuda" if device is None else device)
    index, gpu, _ = configs._gpu((torch.empty(0, device=device),))
    if gpu is None:
        raise RuntimeError(f"flashbob.tune tunes on a CUDA GPU; {device} is not one")
    dtypes = [getattr(torch, d) if isinstance(d, str) else d for d in _as_tuple(dtype)]
    shapes = [(d, dt, bool(c), int(n)) for d in _as_tuple(head_dim) for dt in dtypes for c in _as_tuple(causal)
              for n in _as_tuple(lengths)]
    parts = PARTS if forward_mode else PARTS[:2]
    mode = "force" if retune else "fill"
    for memo in [memo for memo in configs._PICKS if memo[1] == gpu and memo[2] in ("fill", "force")]:
        del configs._PICKS[memo]  # so that an earlier call's picks are not reused: cached ones are read again
    global _bar
    bar = _progress_bar(len(shapes)) if progress else None
    _bar = bar
    try:
        with torch.cuda.device(index) if index is not None else contextlib.nullcontext():
            for d, dt, c, n in shapes:
                shape = f"head_dim {d}, {str(dt).removeprefix('torch.')}, causal={int(c)}, N={n}"
                if bar is None and progress:
                    print(f"flashbob.tune: {shape}", file=sys.stderr, flush=True)
                elif bar is not None:
                    bar.set_description_str(f"flashbob.tune {shape}")
                run_hvp_kernels(d, dt, c, n, heads, batch=batch, parts=parts, mode=mode, device=device)
                if bar is not None:
                    bar.update()
    finally:
        _bar = None
        if bar is not None:
            bar.close()
    wanted = {(d, str(dt).removeprefix("torch."), bucket(n)) for d, dt, _, n in shapes}
    launched = {memo: chosen for memo, chosen in configs._PICKS.items()
                if memo[1] == gpu and memo[2] == mode and (memo[0].head_dim, memo[0].dtype, memo[0].bucket) in wanted}
    keys = {key for key, _, _ in launched}
    for memo in list(configs._PICKS):  # this process's other picks of these keys read the cache again
        if memo[0] in keys and memo[1] == gpu and memo[2] != mode:
            del configs._PICKS[memo]
    return [{**key.to_json(), "gpu": gpu, "config": dataclasses.asdict(chosen.config), "source": chosen.source}
            for (key, _, _), chosen in launched.items()]


def _progress_bar(total: int):
    """A ``tqdm`` bar over ``total`` shapes on stderr, or None if ``tqdm`` is not installed."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="shape", file=sys.stderr, dynamic_ncols=True)
