"""The values training reports, under the trainer's path: they live in :mod:`unison.contract.outputs`."""

from __future__ import annotations

from unison.contract.outputs import HISTORY_LENGTH, NonFiniteError, Progress, StepOutput

__all__ = ["HISTORY_LENGTH", "NonFiniteError", "Progress", "StepOutput"]
