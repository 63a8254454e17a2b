"""What a run tells the person who started it: the progress bar's postfix (the step's loss and the last
validation loss), and at the end where the run's outputs are and how long it took."""

from __future__ import annotations

from pathlib import Path


def postfix(loss: float, val: float | None, extra: dict[str, str]) -> dict[str, str]:
    """The progress bar's postfix: the step's training ``loss``, the last validation loss ``val`` (from the
    first evaluation on) and the recipe's ``extra`` (e.g. ``{"acc": "0.81"}``), in that order."""
    shown = {"loss": f"{loss:.3f}"}
    if val is not None:
        shown["val"] = f"{val:.3f}"
    return {**shown, **extra}


def duration(seconds: float) -> str:
    """``seconds`` as a person reads them: ``8.2 s``, ``3 min 05 s``, ``2 h 07 min``."""
    if seconds < 59.95:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes + (seconds >= 30), 60)
    return f"{hours} h {minutes:02d} min"


def report(name: str, run_dir: Path, first_step: int, step: int, steps: int, seconds: float,
           checkpoint: Path | None, more: dict[str, str]) -> str:
    """The end of the run ``name``: which steps it trained (``first_step`` to ``step`` of ``steps``; short of
    ``steps``, ``train.max_seconds`` stopped it), its wall time, and where its outputs are: the run folder
    ``run_dir``, its config and metrics log, its last ``checkpoint``, and ``more`` (label: place, e.g. where
    W&B keeps the run)."""
    stopped = "" if step == steps else " (stopped by train.max_seconds)"
    places = {"run folder": run_dir, "config": run_dir / "config.yaml", "metrics": run_dir / "metrics.jsonl",
              **({} if checkpoint is None else {"checkpoint": checkpoint}), **more}
    width = max(map(len, places))
    return "\n".join([f"{name}: trained steps {first_step}-{step} of {steps}{stopped}; wall time {duration(seconds)}",
                      *(f"  {label:{width}}  {place}" for label, place in places.items())])
