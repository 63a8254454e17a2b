"""Atomic, verified training checkpoints and the random-number-generator states that make resuming exact.

A checkpoint is written to a temporary file in the target folder, flushed to disk, and renamed
over its final name (``step_00001000.pt``); a process killed mid-write leaves at most a stray
temporary file (``.step_*.pt.tmp-<pid>``, removed by :func:`remove_temporaries` at the next start),
never a broken checkpoint, and :func:`latest` only ever sees finished ones. A write that fails
(disk full, no permission) removes its temporary file and raises :class:`CheckpointWriteError`
naming the checkpoint and the cause; the checkpoints already written are untouched.

The file is ``torch.save``'s zip archive followed by a footer line holding the SHA-256 of the
archive, ``flashbob-checkpoint-sha256:<64 hex digits>\n`` (check one by hand with
``head -c -92 step_00001000.pt | sha256sum``). :func:`load` verifies it before unpickling
anything: a file whose bytes changed after it was written (a flipped bit, a zeroed block, a cut
end) raises :class:`CheckpointReadError` naming the file; torch's own reader does not check the
zip entries' CRCs and would load most such damage silently.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import random
import re
import warnings
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

NAME = re.compile(r"step_(\d{8})\.pt")
TEMPORARY = re.compile(r"\..+\.tmp-\d+")  # an interrupted atomic write's file: .<final name>.tmp-<pid>
FOOTER_PREFIX = b"flashbob-checkpoint-sha256:"
FOOTER_SIZE = len(FOOTER_PREFIX) + 64 + 1  # prefix, hex digest, newline
CHUNK = 1 << 20


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; ``errno`` is the cause's, if it was an operating-system error."""


class CheckpointReadError(ValueError):
    """A checkpoint file exists but cannot be read (truncated, corrupt, or not a checkpoint)."""


def _os_cause(error: BaseException) -> OSError | None:
    """The operating-system error behind ``error``: itself, or one in its chain (``torch.save``
    turns a failed write of its file into a RuntimeError whose context is the OSError)."""
    while error is not None:
        if isinstance(error, OSError):
            return error
        error = error.__cause__ or error.__context__
    return None


def rng_state() -> dict:
    """States of Python's, NumPy's and torch's global generators (and CUDA's, if present)."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = numpy_state["state"]["key"].tolist()
    return {
        "python": random.getstate(),
        "numpy": numpy_state,
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned, on any machine: CUDA states are skipped without CUDA
    (a checkpoint written on a GPU resumes on a CPU) and cut to the GPUs there are."""
    random.setstate(state["python"])
    numpy_state = dict(state["numpy"])
    numpy_state["state"] = {**numpy_state["state"], "key": np.asarray(numpy_state["state"]["key"], dtype=np.uint32)}
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():  # written on a machine with more GPUs: the first ones
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])


def rng_states(generator: torch.Generator | None) -> dict:
    """This process's generator states: the global ones (:func:`rng_state`) and ``generator``'s (an
    optimizer's own, for its probes; ``None`` if it has none), with the type of device that
    generator is on (CPU and CUDA generators differ in kind)."""
    return {**rng_state(), "optimizer": generator.get_state() if generator is not None else None,
            "optimizer_device": generator.device.type if generator is not None else None}


def restore_rng(state: dict, generator: torch.Generator | None, rank: int = 0, world_size: int = 1) -> None:
    """Restore this rank's generator states from a checkpoint written by as many processes (each
    rank's :func:`rng_states` under ``"rng_ranks"``; older checkpoints hold one, under ``"rng"``);
    with another number of processes, warn and keep fresh states."""
    per_rank = state.get("rng_ranks", [state["rng"]])
    if len(per_rank) != world_size:
        warnings.warn(f"the checkpoint was written by {len(per_rank)} process(es), this run has {world_size}: "
                      "random-number states start afresh, so the run continues at the same data position but "
                      "not bit for bit", RuntimeWarning, stacklevel=2)
        return
    mine = per_rank[rank]
    set_rng_state(mine)
    if generator is None or mine.get("optimizer") is None:
        return
    saved_on = mine.get("optimizer_device")  # None in checkpoints written before it was recorded
    problem = f"it was a {saved_on} generator's" if saved_on not in (None, generator.device.type) else None
    if problem is None:
        try:
            generator.set_state(mine["optimizer"].cpu())
        except RuntimeError as error:  # a CUDA generator's state does not fit a CPU generator, nor the reverse
            problem = str(error)
    if problem is not None:
        warnings.warn(f"the optimizer's generator state in the checkpoint does not fit this run's "
                      f"{generator.device.type} generator ({problem}): its random probes start afresh, so the "
                      "run continues at the same step but not bit for bit", RuntimeWarning, stacklevel=2)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A binary file that also feeds every byte written through it to a SHA-256."""

    def __init__(self, file):
        self.file, self.sha256 = file, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def footer(digest: str) -> bytes:
    """The last line of a checkpoint: its archive's SHA-256 as 64 hex digits."""
    return FOOTER_PREFIX + digest.encode("ascii") + b"\n"


def save(directory: Path, step: int, state: dict, keep: int = 0) -> Path:
    """Write ``state`` atomically as ``directory/step_<step>.pt`` with its SHA-256 footer; keep only
    the newest ``keep`` (0: all).

    Raises:
        CheckpointWriteError: the folder could not be made or the file not written (disk full, no
            permission, ...). The temporary file is removed; earlier checkpoints are untouched.
    """
    final = directory / f"step_{step:08d}.pt"
    temporary = directory / f".{final.name}.tmp-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(temporary, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(state, writer)
            f.write(footer(writer.sha256.hexdigest()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, final)
        _fsync_dir(directory)
    except BaseException as error:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: clean up, then let them through
            raise
        cause = _os_cause(error)
        reason = (cause.strerror or str(cause)) if cause is not None else f"{type(error).__name__}: {error}"
        failure = CheckpointWriteError(
            f"could not write checkpoint {final}: {reason}; the checkpoints already in {directory} are intact"
        )
        failure.errno = None if cause is None else cause.errno
        raise failure from error
    if keep > 0:
        for old in checkpoints(directory)[:-keep]:
            old.unlink()
    return final


def remove_temporaries(directory: Path) -> list[tuple[Path, int]]:
    """Delete the temporary files that interrupted atomic writes left in ``directory``; returns
    ``(path, size in bytes)`` of each. Only call it while no other process writes there."""
    if not directory.is_dir():
        return []
    removed = []
    for path in sorted(directory.iterdir()):
        if TEMPORARY.fullmatch(path.name) and path.is_file():
            size = path.stat().st_size
            path.unlink(missing_ok=True)
            removed.append((path, size))
    return removed


def checkpoints(directory: Path) -> list[Path]:
    """Finished checkpoints in ``directory``, oldest step first (temporary files are not among them)."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if NAME.fullmatch(p.name)), key=lambda p: p.name)


def latest(directory: Path) -> Path | None:
    """The finished checkpoint with the highest step, or ``None``."""
    found = checkpoints(directory)
    return found[-1] if found else None


def sha256_of(file: BinaryIO, length: int) -> str:
    """The hex SHA-256 of the first ``length`` bytes of the open binary ``file``, read from its start in chunks."""
    sha256 = hashlib.sha256()
    file.seek(0)
    while length > 0 and (chunk := file.read(min(CHUNK, length))):
        sha256.update(chunk)
        length -= len(chunk)
    return sha256.hexdigest()


def verify(path: Path) -> None:
    """Check that ``path`` ends in a SHA-256 footer matching the bytes before it.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointReadError: the footer is missing or the digest differs: the file is truncated,
            damaged, or was not written by :func:`save`.
    """
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size >= FOOTER_SIZE:
            f.seek(size - FOOTER_SIZE)
            stored = f.read(FOOTER_SIZE)
        if size < FOOTER_SIZE or not (stored.startswith(FOOTER_PREFIX) and stored.endswith(b"\n")):
            raise CheckpointReadError("no SHA-256 footer at its end: truncated, damaged, or not written by this "
                                      "version of recipes.common.checkpoint.save")
        digest = sha256_of(f, size - FOOTER_SIZE)
    if footer(digest) != stored:
        raise CheckpointReadError("its SHA-256 differs from the one written with it: the file is damaged")


def load(path: Path) -> dict:
    """A checkpoint's state, tensors on the CPU, after :func:`verify` (``weights_only``: no
    arbitrary code is unpickled).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointReadError: ``path`` is truncated, damaged or not a checkpoint; the message names it
            and the earlier checkpoints next to it.
    """
    try:
        verify(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except (CheckpointReadError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
        earlier = [p.name for p in checkpoints(path.parent) if p.name < path.name]
        hint = f"; earlier checkpoints there: {', '.join(earlier)}" if earlier else ""
        reason = (str(error) or type(error).__name__).splitlines()[0]
        raise CheckpointReadError(f"checkpoint {path} cannot be read ({reason}){hint}") from error
