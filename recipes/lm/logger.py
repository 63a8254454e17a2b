"""Metrics of a run: always a JSONL file in the run folder, and Weights & Biases unless disabled.

W&B runs offline by default (``logger.wandb_mode: offline``): everything is written under
``<run dir>/wandb/offline-run-*`` and nothing touches the network; ``wandb sync`` uploads it
later. ``logger.wandb_mode: online`` (after ``wandb login``) streams instead; ``logger.kind: none``
turns W&B off.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class RunLogger:
    """Writes each ``log(step, metrics)`` as one JSON line to ``metrics.jsonl`` and to W&B."""

    def __init__(self, run_dir: Path, config: dict, *, kind: str, project: str, name: str,
                 wandb_mode: str, entity: str | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.file = open(self.path, "a", encoding="utf-8")
        self.run = None
        if kind == "wandb":
            import wandb

            self.run = wandb.init(
                project=project,
                entity=entity,
                name=name,
                config=config,
                dir=str(run_dir),
                mode=wandb_mode,
                settings=wandb.Settings(silent=True, console="off"),
            )

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
