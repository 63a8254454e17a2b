"""Where a kernel's launch configuration comes from: a tuned table shipped per GPU, a tuning cache on disk,
and a small tuner for what neither holds.

A configuration is tuned per *key*: the kernel, head_dim, dtype, length bucket (the sequence length rounded
up to a power of two) and the values of the kernel's compile-time flags (causal, which cotangents or tangents
are present, key mask, dot precision; head_dim fixes the others).

**Shipped tables.** ``flashbob/kernels/tuned/<GPU>.json``, one file per GPU model, named after
``torch.cuda.get_device_name()`` with every run of characters other than letters and digits turned into
``_`` (``NVIDIA H200`` -> ``NVIDIA_H200.json``); ``benchmarks/tune_table.py`` writes them. A key the table
holds exactly is used as it is. A length outside the table's buckets takes the entry of the *nearest bucket*
of the same kernel, head_dim, dtype and flags: nearest in ``log2`` of the length, the longer bucket on a tie,
among the entries whose configuration is a candidate at this length (blocks no longer than the bucket).

**Tuning cache.** One JSON file per key under ``<cache>/tuning/<GPU>/triton-<version>/``, where ``<cache>``
is ``$FLASHBOB_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashbob``, else ``~/.cache/flashbob``. A file is written
to a temporary name in the same folder and moved into place with ``os.replace``, which is atomic: a reader
sees a whole old file or a whole new one, and processes that tune the same key at once each leave a whole,
valid file (the last one wins). One file per key means that no writer has to merge with another, so no lock
is needed (none to go stale after a crash, none that a network file system would not honour). A file that
cannot be read or does not hold its key is ignored with a warning, and rewritten when the key is tuned again.

**Tuner.** :func:`tune` times each candidate with :func:`benchmark` (``triton.testing.do_bench``, median)
and keeps the fastest; candidates the compiler rejects (out of shared memory or registers) are skipped. It
prints one line per kernel it tunes to stderr. Every kernel writes each output element once, from inputs it
does not write, with no atomics: timing the candidates on the launch's own buffers needs no reset, and the
caller launches the pick once more so that the outputs are the pick's.
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


def tune(key: Key, candidates: Sequence[Config], run: Callable[[Config], None]) -> tuple[Config, dict[Config, float]]:
    """The fastest of ``candidates`` for ``key`` and each one's time in ms: ``run(config)`` launches the
    kernel with ``config``; candidates the compiler rejects are skipped (:data:`REJECTED`). Prints one line
    to stderr. Raises the last rejection if every candidate is rejected."""
    start = time.perf_counter()
    print(f"flashbob: tuning {key.describe()} over {len(candidates)} configs ...", end="", file=sys.stderr, flush=True)
    timings, rejection = {}, None
    for config in candidates:
        try:
            timings[config] = _timer(lambda config=config: run(config))
        except REJECTED as error:
            rejection = error
    if not timings:
        print(" every config was rejected", file=sys.stderr, flush=True)
        raise rejection
    best = min(timings, key=timings.get)
    block_m, block_n, num_warps, num_stages = best
    print(f" BLOCK_M={block_m} BLOCK_N={block_n} num_warps={num_warps} num_stages={num_stages}: {timings[best]:.3f} ms "
          f"(tuned in {time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
    return best, timings
