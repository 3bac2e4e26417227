"""Weights & Biases: one W&B run per fit, offline by default.

Offline (the default) writes the run under ``version_N/wandb/offline-run-*/``
and contacts no server; ``wandb sync`` uploads it later, and
``wandb leet inspect --json`` (W&B's own reader) prints its records. The run's
config is the unison metadata (resolved config, strategy declaration,
versions); metrics go with ``run.log(metrics, step=step)`` at the trainer's
step. Needs ``pip install 'unison[wandb]'``.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from ._base import RunLogger, require
from ._run import RunDirectory


class WandbLogger(RunLogger):
    """Logs each fit as a W&B run in ``run/version_N/wandb``.

    Args:
        run: the run directory root (or a shared :class:`RunDirectory`).
        project: W&B project name.
        mode: ``"offline"`` (files only), ``"online"`` (needs a login), or ``"disabled"``.
        entity, tags: passed to ``wandb.init``.
    """

    def __init__(
        self,
        run: RunDirectory | str | os.PathLike[str],
        *,
        project: str = "unison",
        mode: Literal["offline", "online", "disabled"] = "offline",
        entity: str | None = None,
        tags: list[str] | None = None,
    ) -> None:
        require("wandb", "wandb", "WandbLogger")
        super().__init__(run)
        self.project, self.mode, self.entity, self.tags = project, mode, entity, list(tags or [])
        self._run: Any = None

    def _start(self, trainer: Any, metadata: dict[str, Any]) -> None:
        import wandb

        assert self.path is not None and self.run is not None
        self._run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.run.name,
            dir=str(self.path),
            mode=self.mode,
            tags=self.tags,
            config=metadata,
            reinit="create_new",
            # No console capture or system sampling: the run records what unison logs.
            settings=wandb.Settings(
                console="off", silent=True, x_disable_stats=True, save_code=False, disable_git=True
            ),
        )

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def _close(self, ok: bool) -> None:
        if self._run is not None:
            self._run.finish(exit_code=0 if ok else 1)
            self._run = None
