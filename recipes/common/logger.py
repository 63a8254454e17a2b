"""Metrics of a run: always a JSONL file in the run folder, and Weights & Biases unless disabled.

W&B runs offline by default (``logger.wandb_mode: offline``): everything is written under
``<run dir>/wandb/offline-run-*`` and nothing touches the network; ``wandb sync`` uploads it
later. ``logger.wandb_mode: online`` (after ``wandb login``) streams instead; ``logger.kind: none``
turns W&B off.

A run that resumes continues its log: the rows ``metrics.jsonl`` holds past the resumed step (logged
by the interrupted process after its last checkpoint) are dropped before the first new one, and
W&B continues the same run, whose id is kept in ``<run dir>/wandb_run_id``. A run that starts
from scratch starts a fresh log and a new W&B run.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import warnings
from pathlib import Path

WANDB_ID_FILE = "wandb_run_id"


class RunLogger:
    """Writes each ``log(step, metrics)`` as one JSON line to ``metrics.jsonl`` and to W&B.

    ``start_step`` is the step the run starts from: 0 for a fresh run, the checkpoint's step for a
    resumed one.
    """

    def __init__(self, run_dir: Path, config: dict, *, kind: str, project: str, name: str,
                 wandb_mode: str, entity: str | None = None, start_step: int = 0):
        self.path = run_dir / "metrics.jsonl"
        drop_rows_after(self.path, start_step)
        self.file = open(self.path, "a", encoding="utf-8")
        self.run = None
        self.wandb: dict[str, str] = {}  # where W&B keeps the run, for a person: its offline folder or online page
        if kind == "wandb":
            import wandb

            self.run = wandb.init(
                project=project,
                entity=entity,
                name=name,
                config=config,
                dir=str(run_dir),
                mode=wandb_mode,
                id=wandb_run_id(run_dir, fresh=start_step == 0),
                resume="allow",
                settings=wandb.Settings(silent=True, console="off"),
            )
            if wandb_mode == "offline":
                folder = self.run.settings.sync_dir
                self.wandb = {"W&B offline": folder, "upload": f"wandb sync {folder}"}
            elif wandb_mode == "online":
                self.wandb = {"W&B": self.run.url}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record ``metrics`` at ``step`` (JSONL lines also carry the wall-clock ``time``)."""
        self.file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self.file.flush()
        if self.run is not None:
            self.run.log(metrics, step=step)

    def close(self) -> None:
        """Flush and close the JSONL file and finish the W&B run."""
        self.file.close()
        if self.run is not None:
            import wandb

            self.run.finish()
            wandb.teardown()  # finish() returns before the service has flushed the run's files


def drop_rows_after(path: Path, step: int) -> None:
    """Keep only the rows of the JSONL log ``path`` up to ``step`` (and drop a line cut mid-write),
    with a warning saying how many went; the file is replaced atomically."""
    if not path.is_file():
        return
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            row_step = None
        if isinstance(row_step, int) and row_step <= step:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        warnings.warn(f"{path}: dropped {dropped} row(s) logged past step {step}, where this run starts",
                      RuntimeWarning, stacklevel=3)
        _write_atomically(path, "".join(kept))


def wandb_run_id(run_dir: Path, fresh: bool) -> str:
    """The W&B run id kept in ``run_dir``: a new one (16 hex digits) for a ``fresh`` run, or when none is kept yet."""
    path = run_dir / WANDB_ID_FILE
    if not fresh and path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = secrets.token_hex(8)
    _write_atomically(path, run_id + "\n")
    return run_id


def _write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` through a temporary file, so a crash leaves the old or the new content."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)
