"""Wall time of optimizer steps, shared by the progress display and the Throughput callback.

A step's time runs from ``unison_on_train_step_start`` to
``unison_on_train_step_end``: loading its micro-batches, forward, backward,
the optimizer step. Validation, checkpoints and logging between steps are not
in it. ``StepOutput`` values (samples, tokens) are read only when rates are
asked for, never per step, so timing adds no device synchronisation.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any


class StepWindow:
    """The last ``size`` steps' wall times and outputs (``None``: every step since :meth:`clear`)."""

    def __init__(self, size: int | None = None) -> None:
        self._steps: deque[tuple[float, Any]] = deque(maxlen=size)
        self._started: float | None = None

    def start(self) -> None:
        self._started = time.perf_counter()

    def end(self, output: Any) -> None:
        if self._started is None:  # a step whose start this plugin did not see (registered mid-step)
            return
        self._steps.append((time.perf_counter() - self._started, output))
        self._started = None

    def clear(self) -> None:
        self._steps.clear()

    def __len__(self) -> int:
        return len(self._steps)

    def rates(self) -> dict[str, float]:
        """``step_time`` (mean seconds), ``samples_per_s`` and, when every step counted tokens, ``tokens_per_s``."""
        if not self._steps:
            return {}
        seconds = sum(dt for dt, _ in self._steps)
        out = {"step_time": seconds / len(self._steps)}
        if seconds <= 0:
            return out
        out["samples_per_s"] = sum(o.samples for _, o in self._steps) / seconds
        tokens = [o.tokens for _, o in self._steps]
        if all(t is not None for t in tokens):
            out["tokens_per_s"] = sum(tokens) / seconds
        return out
