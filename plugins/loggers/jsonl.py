"""JSONL metrics: ``version_N/metrics.jsonl``, one JSON object per logging call.

Each line is ``{"step": N, "time": unix_seconds, **metrics}``; the metrics of
one step may span several lines (training metrics, then validation). Floats
are written with ``repr`` precision, so values read back are exactly the
trainer's. Read a file back with :func:`read_jsonl`. A run that resumes its own
version (``root_dir``, see :mod:`unison.training.runs`) keeps the lines up to the
step it resumed from and appends: one series, no step twice.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import IO, Any

from unison.checkpointing.nofollow import open_nofollow, replace_atomically

from ._base import RunLogger
from ._run import RunDirectory

FILE = "metrics.jsonl"


def _json_value(value: float) -> Any:
    # JSON has no inf/nan; a skipped fp16 step's grad norm is inf.
    return value if not isinstance(value, float) or math.isfinite(value) else str(value)


class JSONLLogger(RunLogger):
    """Writes ``metrics.jsonl`` into each fit's run directory (``run/version_N``)."""

    def __init__(self, run: RunDirectory | str | os.PathLike[str]) -> None:
        super().__init__(run)
        self._file: IO[str] | None = None

    @property
    def file(self) -> Path | None:
        """The current run's metrics file (``None`` before the first fit and on other ranks)."""
        return self.path / FILE if self.path is not None else None

    def _start(self, trainer: Any, metadata: dict[str, Any]) -> None:
        assert self.file is not None
        resume_step = self.run.resume_step if self.run is not None else None
        if resume_step is not None and self.file.exists():
            # The run's own file, resumed at resume_step: the steps after it are trained again.
            kept = [line for line in self.file.read_text().splitlines(keepends=True) if _step(line) <= resume_step]
            # (a fresh temporary and a rename, an append that never follows a link: unison.checkpointing.nofollow)
            replace_atomically(self.file, "".join(kept).encode(), "logging.dir", sync=False)
            fd = open_nofollow(self.file, os.O_WRONLY | os.O_APPEND, "logging.dir")
            self._file = open(fd, "a", buffering=1)  # noqa: SIM115 (open for the whole fit; _close closes it)
            return
        # "x": a run never appends to (or replaces) another run's file.
        self._file = self.file.open("x", buffering=1)

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        assert self._file is not None
        record = {"step": step, "time": time.time(), **{k: _json_value(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")

    def _close(self, ok: bool) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf  # a torn last line of a killed run: dropped


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (``"inf"``/``"nan"`` strings become floats)."""
    records = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            records.append({k: float(v) if v in ("inf", "-inf", "nan") else v for k, v in record.items()})
    return records
