"""Metrics on their way to the loggers (``unison_log_metrics``).

:class:`MetricsLog` is the one path every metric takes: the step's own
(``train/loss``, ``train/grad_norm``, ``train/lr``, skips; ``data/retries`` for a
sharded data source) at each logging
step, validation's, and the user's from :meth:`Trainer.log
<unison.training.trainer.Trainer.log>`. Each sent value is also recorded in
``trainer.progress.metrics`` (the latest per name). Inside the training loop
user metrics wait for the next logging step, so logging from
``training_step`` costs no device synchronisation on steps that are not
logged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from unison.contract.outputs import StepOutput

if TYPE_CHECKING:
    from unison.training.trainer import Trainer

__all__ = ["MetricsLog"]


class MetricsLog:
    """Sends metrics to the trainer's loggers at its current step; keeps user metrics during a step."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self._pending: dict[str, Any] = {}
        #: True inside the training loop: :meth:`log` then waits for the next logging step.
        self.fitting = False

    def log(self, metrics: Mapping[str, Any]) -> None:
        """User metrics: sent now, or (inside the loop) with the next logging step's (the latest per name)."""
        if self.fitting:
            self._pending.update(metrics)
        else:
            self.emit(dict(metrics))

    def log_step(self, output: StepOutput, *, retries: int | None = None) -> None:
        """The step's metrics and the user metrics kept since the last logging step; ``retries``: the
        transient object-storage errors the fit's data source retried so far (``None``: it has no count)."""
        metrics: dict[str, Any] = {
            "train/loss": output.loss,
            "train/grad_norm": output.grad_norm,
            "train/lr": output.lrs[0],
            "train/skipped": float(output.skipped),
            "train/skipped_steps": float(self._trainer.progress.skipped_steps),
        }
        if len(output.lrs) > 1:
            metrics.update({f"train/lr-group{i}": lr for i, lr in enumerate(output.lrs)})
        # Transient object-storage errors the data source retried, its loader workers included; this
        # rank's own (reducing over ranks would cost a collective per logging step).
        if retries is not None:
            metrics["data/retries"] = float(retries)
        metrics.update(self._pending)
        self._pending = {}
        self.emit(metrics)

    def keep(self, metrics: Mapping[str, Any]) -> None:
        """Metrics sent with the next logging step's, or with the fit's last (a checkpoint's time and size:
        the save at the end of a fit then adds no ``unison_log_metrics`` call of its own)."""
        self._pending.update(metrics)

    def flush(self) -> None:
        """Send the user metrics still kept (the fit's end: no logging step follows)."""
        if self._pending:
            self.emit(self._pending)
            self._pending = {}

    def emit(self, metrics: dict[str, Any]) -> None:
        """Send ``metrics`` now (0-dim tensors read as floats) and record them in ``progress.metrics``."""
        trainer = self._trainer
        plain = {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        trainer.progress.metrics.update(plain)
        trainer.pm.unison_log_metrics(trainer=trainer, metrics=plain, step=trainer.progress.global_step)
