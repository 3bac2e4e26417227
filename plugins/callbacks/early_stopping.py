"""Stop training when a monitored metric stops improving.

The callback watches every ``unison_log_metrics`` call for its ``monitor``
metric (``val/loss`` by default; any metric the trainer or a plugin logs). A
value improves when it beats the best so far by more than ``min_delta``
(lower for ``mode="min"``, higher for ``"max"``); after ``patience``
consecutive checks without improvement it sets ``trainer.should_stop``, and the
trainer ends the fit after the current step on every backend (every rank stops
at the same step: a step that validated agrees on every rank's flag at once,
and the trainer's own metrics are already the same on every rank).

Its state (best value, checks without improvement) is saved in checkpoints, so
a resumed run keeps counting where it stopped.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from unison.errors import ConfigurationError
from unison.plugin import hookimpl


class EarlyStopping:
    """Stop when ``monitor`` has not improved by ``min_delta`` for ``patience`` checks.

    Args:
        monitor: metric name, e.g. ``"val/loss"`` or ``"train/loss"``.
        mode: ``"min"`` (lower is better) or ``"max"``.
        patience: checks without improvement tolerated before stopping.
        min_delta: the smallest change that counts as an improvement (>= 0).
        check_finite: stop at once when the metric is NaN or infinite.
    """

    def __init__(
        self,
        monitor: str = "val/loss",
        mode: Literal["min", "max"] = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        check_finite: bool = True,
    ) -> None:
        if mode not in ("min", "max"):
            raise ConfigurationError("EarlyStopping.mode", f"got {mode!r}", "use 'min' or 'max'")
        if patience < 0:
            raise ConfigurationError("EarlyStopping.patience", f"got {patience}", "pass 0 or more")
        if min_delta < 0:
            raise ConfigurationError("EarlyStopping.min_delta", f"got {min_delta}", "pass a non-negative number")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.check_finite = check_finite
        self.best: float | None = None
        self.wait = 0
        #: The step at which this callback asked to stop, and why (``None`` while training goes on).
        self.stopped_step: int | None = None
        self.reason: str | None = None

    def _improves(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    @hookimpl
    def unison_on_fit_start(self, trainer: Any) -> None:
        self.best, self.wait, self.stopped_step, self.reason = None, 0, None, None

    @hookimpl
    def unison_log_metrics(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        if self.monitor not in metrics or self.stopped_step is not None:
            return
        value = float(metrics[self.monitor])
        if self.check_finite and not math.isfinite(value):
            self._stop(trainer, step, f"{self.monitor} is {value}")
        elif self._improves(value):
            self.best, self.wait = value, 0
        else:
            self.wait += 1
            if self.wait >= self.patience:
                self._stop(
                    trainer,
                    step,
                    f"{self.monitor} did not improve on {self.best:.6g} by more than "
                    f"{self.min_delta} in {self.wait} checks",
                )

    def _stop(self, trainer: Any, step: int, reason: str) -> None:
        self.stopped_step, self.reason = step, reason
        trainer.should_stop = True

    @hookimpl
    def unison_on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[self._key] = {"best": self.best, "wait": self.wait}

    @hookimpl
    def unison_on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(self._key)
        if state is not None:
            self.best, self.wait = state["best"], int(state["wait"])

    @property
    def _key(self) -> str:
        return f"early_stopping:{self.monitor}"  # one entry per monitored metric
