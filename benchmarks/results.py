"""Writing a benchmark's finished result rows to CSV."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from pathlib import Path


def write_rows(path: str | Path, rows: Sequence[dict], fieldnames: Iterable[str] | None = None) -> None:
    """Write ``rows`` to the CSV ``path`` (its folder is created) under a header of ``fieldnames``,
    or of the first row's keys; a column a row lacks is left empty, a key not in the header is an error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0] if fieldnames is None else fieldnames))
        writer.writeheader()
        writer.writerows(rows)
