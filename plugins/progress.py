"""Progress display with rich, on rank 0: a bar with step, loss and learning rate.

Pass ``ProgressBar()`` in ``callbacks=`` (``unison train`` adds one unless
``[logging] progress = false``). It draws only on rank 0 and only
when stdout is a terminal unless ``force=True`` (in a log file it prints one
line every ``every`` steps instead of redrawing).
"""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from unison.plugin import hookimpl


class ProgressBar:
    def __init__(self, every: int = 10, force: bool = False) -> None:
        self.every = every
        self.live = force or sys.stdout.isatty()
        self._progress: Progress | None = None
        self._task: Any = None
        self._console = Console()

    @hookimpl
    def unison_on_fit_start(self, trainer: Any) -> None:
        if not trainer.is_global_zero or not self.live:
            return
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=self._console,
        )
        self._progress.start()
        self._task = self._progress.add_task(
            "train", total=trainer.settings.max_steps, completed=trainer.global_step, info=""
        )

    @hookimpl
    def unison_on_train_step_end(self, trainer: Any, step: int, output: Any) -> None:
        if not trainer.is_global_zero:
            return
        info = f"loss {output.loss:.4f}  lr {output.lrs[0]:.2e}" + ("  (skipped)" if output.skipped else "")
        if self._progress is not None:
            self._progress.update(self._task, completed=step + 1, info=info)
        elif (step + 1) % self.every == 0 or step + 1 == trainer.settings.max_steps:
            self._console.print(f"step {step + 1}/{trainer.settings.max_steps}  {info}")

    @hookimpl
    def unison_on_validation_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        if trainer.is_global_zero:
            self._console.print(f"step {step}: val loss {metrics['val/loss']:.4f}")

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    @hookimpl
    def unison_on_fit_end(self, trainer: Any) -> None:
        self._stop()

    @hookimpl
    def unison_on_exception(self, trainer: Any, exception: BaseException) -> None:
        self._stop()


@hookimpl
def unison_plugins_from_config(config: Any) -> list[Any]:
    return [ProgressBar()] if config.logging.progress else []
