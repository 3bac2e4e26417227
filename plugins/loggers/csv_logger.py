"""CSV metrics: ``version_N/metrics.csv``, one row per step.

Columns are ``step``, ``time`` and every metric name in the order first
seen. All metrics logged at one step (the training metrics, then the
validation loss) share that step's row; a cell is empty where a metric was not
logged. When a new metric appears the file is rewritten with the wider header
(through a temporary file and an atomic rename, so a reader never sees half a
file). Values are written with ``repr`` precision: ``float(cell)`` is exactly
what the trainer computed. Read a file with :func:`read_csv` or any CSV reader.
"""

from __future__ import annotations

import csv
import io
import os
import time
from pathlib import Path
from typing import Any

from unison.checkpointing.nofollow import open_nofollow, replace_atomically

from ._base import RunLogger
from ._run import RunDirectory

FILE = "metrics.csv"


class CSVLogger(RunLogger):
    """Writes ``metrics.csv`` into each fit's run directory (``run/version_N``).

    A row is written when a later step's metrics arrive and at the end of the
    fit, so the file always holds every completed step.
    """

    def __init__(self, run: RunDirectory | str | os.PathLike[str]) -> None:
        super().__init__(run)
        self._columns: list[str] = []
        self._row: dict[str, Any] | None = None

    @property
    def file(self) -> Path | None:
        return self.path / FILE if self.path is not None else None

    def _start(self, trainer: Any, metadata: dict[str, Any]) -> None:
        assert self.file is not None
        self._columns, self._row = ["step", "time"], None
        resume_step = self.run.resume_step if self.run is not None else None
        if resume_step is not None and self.file.exists():
            # The run's own file, resumed at resume_step: rows after it are trained again; the
            # resumed step's row stays open, so metrics logged at that step again join it.
            with self.file.open(newline="") as f:
                reader = csv.DictReader(f)
                self._columns = list(reader.fieldnames or self._columns)
                rows = [r for r in reader if r.get("step", "").isdigit() and int(r["step"]) <= resume_step]
            if rows and int(rows[-1]["step"]) == resume_step:
                last = rows.pop()
                self._row = {k: v for k, v in last.items() if v != ""}
                self._row["step"] = resume_step
            self._replace(rows)
            return
        with self.file.open("x", newline="") as f:  # "x": never another run's file
            csv.writer(f).writerow(self._columns)

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        if self._row is not None and self._row["step"] != step:
            self._flush()
        if self._row is None:
            self._row = {"step": step}
        self._row.update(metrics)
        self._row["time"] = time.time()

    def _close(self, ok: bool) -> None:
        self._flush()

    def _flush(self) -> None:
        if self._row is None:
            return
        row, self._row = self._row, None
        new = [k for k in row if k not in self._columns]
        assert self.file is not None
        if new:
            self._columns += new
            self._rewrite()
        # O_NOFOLLOW: an append never follows a link planted at the file's name (unison.checkpointing.nofollow)
        with open(open_nofollow(self.file, os.O_WRONLY | os.O_APPEND, "logging.dir"), "a", newline="") as f:
            csv.writer(f).writerow([_cell(row.get(c)) for c in self._columns])

    def _rewrite(self) -> None:
        """Rewrite the file under the wider header (atomic replace)."""
        assert self.file is not None
        with self.file.open(newline="") as f:
            rows = list(csv.DictReader(f))
        self._replace(rows)

    def _replace(self, rows: list[dict[str, Any]]) -> None:
        """The file holds ``rows`` under the current header: a fresh temporary renamed onto it (never a link)."""
        assert self.file is not None
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=self._columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
        replace_atomically(self.file, text.getvalue().encode(), "logging.dir", sync=False)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else str(value)


def read_csv(path: str | os.PathLike[str]) -> list[dict[str, float]]:
    """The rows of a ``metrics.csv`` as ``{column: float}`` (empty cells left out; ``step`` an int)."""
    with Path(path).open(newline="") as f:
        rows = []
        for raw in csv.DictReader(f):
            row: dict[str, Any] = {k: float(v) for k, v in raw.items() if v != ""}
            row["step"] = int(row["step"])
            rows.append(row)
        return rows
