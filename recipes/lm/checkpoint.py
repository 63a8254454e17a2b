"""Atomic training checkpoints and the random-number-generator states that make resuming exact.

A checkpoint is written to a temporary file in the target folder, flushed to disk, and renamed
over its final name (``step_00001000.pt``); a process killed mid-write leaves at most a stray
temporary file (``.step_*.pt.tmp-<pid>``, safe to delete), never a broken checkpoint, and
:func:`latest` only ever sees finished ones. A write that fails (disk full, no permission) removes
its temporary file and raises :class:`CheckpointWriteError` naming the checkpoint and the cause;
the checkpoints already written are untouched. An unreadable checkpoint raises
:class:`CheckpointReadError` naming the file.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import re
from pathlib import Path

import numpy as np
import torch

NAME = re.compile(r"step_(\d{8})\.pt")


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


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: Path, step: int, state: dict, keep: int = 0) -> Path:
    """Write ``state`` atomically as ``directory/step_<step>.pt``; keep only the newest ``keep`` (0: all).

    Raises:
        CheckpointWriteError: the folder could not be made or the file not written (disk full, no
            permission, ...). The temporary file is removed; earlier checkpoints are untouched.
    """
    final = directory / f"step_{step:08d}.pt"
    temporary = directory / f".{final.name}.tmp-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(temporary, "wb") as f:
            torch.save(state, f)
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


def checkpoints(directory: Path) -> list[Path]:
    """Finished checkpoints in ``directory``, oldest step first (temporary files are not among them)."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if NAME.fullmatch(p.name)), key=lambda p: p.name)


def latest(directory: Path) -> Path | None:
    """The finished checkpoint with the highest step, or ``None``."""
    found = checkpoints(directory)
    return found[-1] if found else None


def load(path: Path) -> dict:
    """A checkpoint's state, tensors on the CPU (``weights_only``: no arbitrary code is unpickled).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointReadError: ``path`` is truncated, corrupt or not a checkpoint; the message names it
            and the earlier checkpoints next to it.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as error:
        earlier = [p.name for p in checkpoints(path.parent) if p.name < path.name]
        hint = f"; earlier checkpoints there: {', '.join(earlier)}" if earlier else ""
        reason = (str(error) or type(error).__name__).splitlines()[0]
        raise CheckpointReadError(f"checkpoint {path} cannot be read ({reason}){hint}") from error
