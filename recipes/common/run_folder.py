"""The run folder every recipe writes, ``<out_dir>/<name>/``: one run at a time, leftovers of
killed writes removed, and resuming from its newest checkpoint that is intact.

:func:`numbered_name` gives a run that takes its name from its config a folder of its own:
``<name>``, ``<name>_2``, ``<name>_3``, ... are the runs of that config, a new one takes the next
number and ``--resume auto`` continues the highest. :func:`claim` locks the folder for the life of a run (a second run started on it stops with
:class:`RunLockedError`) and deletes the temporary files of writes a killed process left. :func:`resume` reads the checkpoint ``train.resume`` names
(``auto``: this run's newest readable one, skipping damaged ones with a warning; none on a fresh
run); :func:`snapshot` and :func:`restore` save and load the stateful parts of a recipe (model,
optimizer, scheduler, data position), refusing a checkpoint of another model or optimizer with a
:class:`~recipes.common.config.ConfigError` naming the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path

from recipes.common.config import ConfigError
from recipes.common import checkpoint

LOCK_NAME = "run.lock"


class RunLockedError(RuntimeError):
    """The run folder is in use by another run."""


class RunLock:
    """An exclusive ``fcntl.flock`` on ``<run dir>/run.lock``, a file holding ``"<pid> <host>"``.

    The kernel drops the lock when its process dies, however it dies; the file it leaves then
    names a dead process and is taken over, with a warning, by the next run on the same host.
    A file naming another host is never taken over (that process cannot be checked from here).
    :meth:`release` deletes the file. On a file system without ``flock`` (some network mounts)
    the run goes on unlocked, with a warning.
    """

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock.

        Raises:
            RunLockedError: a live run holds it, or a leftover lock names another host.
        """
        while self.fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 4096).decode(errors="replace").split() or ["?", "?"]
                os.close(fd)
                raise RunLockedError(f"{self.path.parent} is in use by another run (pid {holder[0]} on "
                                     f"{holder[-1]}); wait for it to end or choose another name") from None
            except OSError as error:
                os.close(fd)
                warnings.warn(f"cannot lock {self.path} ({error.strerror}): the file system does not support flock, "
                              "so nothing stops a second run on this folder", RuntimeWarning, stacklevel=4)
                return
            if not _same_file(fd, self.path):  # the holder deleted it between our open and flock: retry
                os.close(fd)
                continue
            self._take_over(fd)
            self.fd = fd

    def _take_over(self, fd: int) -> None:
        """Write this process into the locked file, after checking what an earlier run left there."""
        pid, _, host = os.read(fd, 4096).decode(errors="replace").strip().partition(" ")
        this_host = socket.gethostname()
        if pid and host != this_host:
            os.close(fd)
            raise RunLockedError(f"{self.path} names pid {pid} on host {host}, which cannot be checked from "
                                 f"{this_host}; if no run uses {self.path.parent}, delete {self.path}")
        if pid:
            warnings.warn(f"taking over the stale lock {self.path} of process {pid}, which is no longer running",
                          RuntimeWarning, stacklevel=4)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {this_host}\n".encode(), 0)
        os.fsync(fd)

    def release(self) -> None:
        """Delete the lock file and drop the lock."""
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def claim(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir`` for a run: create and lock it and remove the temporary files that killed
    writes left there (with a warning); unlock it on leaving.

    Raises:
        RunLockedError: another live run holds ``run_dir``.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(run_dir)
    lock.acquire()
    try:
        for folder in (run_dir, run_dir / "checkpoints"):
            removed = checkpoint.remove_temporaries(folder)
            if removed:
                megabytes = sum(size for _, size in removed) / 1e6
                warnings.warn(f"removed {len(removed)} temporary file(s) of interrupted writes from {folder} "
                              f"({megabytes:.1f} MB): {', '.join(path.name for path, _ in removed)}",
                              RuntimeWarning, stacklevel=3)
        yield
    finally:
        lock.release()


def numbered_name(out_dir: str | Path, name: str, resume: str | None) -> str:
    """The run name of a run whose name comes from its config (none was given on the command line).

    The folders ``<name>``, ``<name>_2``, ``<name>_3``, ... under ``out_dir`` are the runs of a config named
    ``name``; one that holds anything (a lock, a log, checkpoints) is taken. A fresh run (``resume`` None)
    takes the number after the highest taken one (``name`` itself where none is taken); ``resume="auto"``
    continues the highest taken one (``name`` where none is); a resume from a checkpoint file or folder keeps
    ``name``.
    """
    if resume not in (None, "auto"):
        return name
    first = Path(out_dir) / name
    numbered = (re.fullmatch(re.escape(first.name) + r"_([2-9]|[1-9][0-9]+)", path.name) for path in
                (first.parent.iterdir() if first.parent.is_dir() else ()))
    taken = [int(match[1]) for match in numbered if match and _taken(first.parent / match[0])]
    highest = max(taken, default=1 if _taken(first) else 0)
    number = highest if resume == "auto" else highest + 1
    return name if number <= 1 else f"{name}_{number}"


def _taken(path: Path) -> bool:
    """Whether ``path`` holds a run: it exists and is not an empty folder."""
    return path.exists() and not (path.is_dir() and not any(path.iterdir()))


def resume(resume: str | None, run_dir: Path) -> tuple[Path, dict] | None:
    """The checkpoint ``train.resume`` names and its verified state, or ``None`` (start from scratch).

    ``None``: no resume, where ``run_dir`` holds no checkpoint yet. ``auto``: the newest intact
    checkpoint of ``run_dir`` (``None`` if it has none yet). A folder: its newest intact checkpoint.
    A file: that checkpoint. A damaged checkpoint met on the way down a folder is skipped with a
    warning naming it.

    Raises:
        ConfigError: the file or folder does not exist, or the folder holds no checkpoint; or no
            resume in a run folder that holds an earlier run's checkpoints (a fresh run there would
            leave them among its own: its pruning deletes its new ones, ``auto`` resumes theirs).
        CheckpointReadError: the file is damaged, or every checkpoint in the folder is.
    """
    if resume is None:
        earlier = checkpoint.latest(run_dir / "checkpoints")
        if earlier is not None:
            raise ConfigError(f"{run_dir} holds the checkpoints of an earlier run (newest: {earlier.name}); continue "
                              f"it with --resume auto (train.resume=auto), or start a new run under another name= "
                              f"(without name= the config's runs are numbered: a new one gets a folder of its own), "
                              f"or delete {earlier.parent} to start afresh")
        return None
    target = run_dir / "checkpoints" if resume == "auto" else Path(resume)
    if resume == "auto" or target.is_dir():
        found = checkpoint.checkpoints(target)
        if not found and resume != "auto":
            raise ConfigError(f"train.resume: no checkpoint in {target}")
        for path in reversed(found):
            try:
                return path, checkpoint.load(path)
            except checkpoint.CheckpointReadError as error:
                warnings.warn(f"skipping a damaged checkpoint: {error}", RuntimeWarning, stacklevel=2)
        if found:
            raise checkpoint.CheckpointReadError(f"every checkpoint in {target} is damaged: "
                                                 f"{', '.join(p.name for p in found)}")
        return None
    if not target.is_file():
        raise ConfigError(f"train.resume: {target} does not exist")
    return target, checkpoint.load(target)


def snapshot(**parts) -> dict:
    """``state_dict()`` of each part (``None`` stays ``None``), and under ``"classes"`` the class
    name of each, which :func:`restore` checks."""
    return {**{name: None if part is None else part.state_dict() for name, part in parts.items()},
            "classes": {name: type(part).__name__ for name, part in parts.items() if part is not None}}


def restore(source: Path, state: dict, **parts) -> None:
    """Load what :func:`snapshot` saved into ``parts`` (``None`` parts are skipped).

    Raises:
        ConfigError: naming ``source``: a part is missing from the checkpoint or of another class
            (another optimizer, another recipe), or its state does not fit (another model size).
    """
    parts = {name: part for name, part in parts.items() if part is not None}
    classes = state.get("classes", {})
    for name, part in parts.items():
        if state.get(name) is None or name not in classes:
            raise ConfigError(f"train.resume: checkpoint {source} holds no {name} state; it was not written by "
                              "this recipe")
        if classes[name] != type(part).__name__:
            raise ConfigError(f"train.resume: checkpoint {source} holds {classes[name]} {name} state; this run's "
                              f"{name} is {type(part).__name__}")
    for name, part in parts.items():
        try:
            part.load_state_dict(state[name])
        except (RuntimeError, ValueError, KeyError) as error:
            raise ConfigError(f"train.resume: checkpoint {source} does not fit this run's {name}: "
                              f"{_first_reason(error)}") from None


RESTORED_OPTIMIZER_SETTINGS = ("lr", "betas", "eps", "weight_decay", "decay_all", "kwargs")
"""Settings of a recipe's ``optimizer`` section that its state (param groups, the scheduler's base lr) restores."""


def check_restored_settings(source: Path, state: dict, optimizer: dict) -> None:
    """Refuse a resume that changes a setting the restored optimizer state would silently override.

    ``optimizer`` is this run's ``optimizer`` config section, compared with the one saved in the
    checkpoint (under ``state["config"]``; older checkpoints without it are not checked).

    Raises:
        ConfigError: naming ``source``, the first changed setting and both values.
    """
    saved = (state.get("config") or {}).get("optimizer") or {}
    for key in RESTORED_OPTIMIZER_SETTINGS:
        if key in saved and key in optimizer and saved[key] != optimizer[key]:
            raise ConfigError(
                f"train.resume: checkpoint {source} ran with optimizer.{key}={saved[key]}, this run asks for "
                f"{optimizer[key]}; the resumed optimizer state would keep the saved value: drop the change, or "
                "start a new run"
            )


def _first_reason(error: BaseException) -> str:
    """The first line of ``error`` that says something: torch's ``load_state_dict`` opens with a
    header line (``Error(s) in loading state_dict for GPT:``) and lists one problem per line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    if len(lines) > 1 and lines[0].endswith(":"):
        more = f" (and {len(lines) - 2} more)" if len(lines) > 2 else ""
        return lines[1] + more
    return lines[0]
