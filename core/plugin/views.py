"""What a lifecycle hook is given as ``trainer``: :class:`TrainerView`.

The plugin system sits below the trainer (:mod:`unison.training` uses it), so the hook specifications
and the plugin manager name this protocol, not :class:`unison.Trainer`. The running trainer is the
object passed, with all of its public attributes; the protocol lists the ones the hook documentation
relies on, and mypy checks that :class:`unison.Trainer` satisfies it wherever the trainer calls a hook.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["TrainerView"]


class TrainerView(Protocol):
    """The running :class:`unison.Trainer`, as a hook sees it."""

    #: Set it to ``True`` on any rank to stop every rank after the same step.
    should_stop: bool

    @property
    def is_global_zero(self) -> bool:
        """Whether this process is global rank 0."""
        ...

    def log(self, metrics: Mapping[str, Any]) -> None:
        """Send metrics to every logger at the current step."""
        ...
