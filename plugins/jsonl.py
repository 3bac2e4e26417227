"""JSONL metrics logger: one JSON object per line, written by rank 0.

Enable it by passing ``JSONLLogger(path)`` in ``loggers=``, or with
``[logging] jsonl = "path"`` in a ``unison train`` config file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from unison.plugin import hookimpl


class JSONLLogger:
    """Appends ``{"step": N, "time": t, **metrics}`` lines to ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @hookimpl
    def unison_log_metrics(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        if not trainer.is_global_zero:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@hookimpl
def unison_plugins_from_config(config: Any) -> list[Any]:
    return [JSONLLogger(config.logging.jsonl)] if config.logging.jsonl else []
