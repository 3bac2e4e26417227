"""What every built-in logger shares: one session per fit, written by global rank 0.

The trainer hands every rank the same metrics (already reduced), so one rank
writing is enough and no two processes ever write the same file. A session
opens at ``unison_on_fit_start`` (first among the fit-start hooks, so other
plugins may log from theirs) and closes at ``unison_on_fit_end`` (last) or
``unison_on_exception``; ``step`` is the trainer's, so every backend numbers
the x-axis alike.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any

from unison.errors import ConfigurationError
from unison.plugin import hookimpl

from ._run import RunDirectory, run_metadata


def require(module: str, extra: str, logger: str) -> None:
    """Refuse a logger whose package is missing, naming the extra that installs it."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules[module] is None: Python's way of blocking an import
        found = False
    if not found:
        raise ConfigurationError(
            logger,
            f"the {module!r} package is not installed",
            f"pip install 'unison[{extra}]' (or pip install {module})",
        )


class RunLogger:
    """Base class: subclasses implement ``_start``, ``_log`` and ``_close``."""

    #: Whether the logger needs a run directory for its files.
    needs_directory = True

    def __init__(self, run: RunDirectory | str | os.PathLike[str] | None) -> None:
        if run is None and self.needs_directory:
            raise ConfigurationError(
                type(self).__name__,
                "it writes files and was given no directory",
                "pass a directory, e.g. 'runs/my-run' (each fit makes version_N inside it)",
            )
        self.run = RunDirectory.get(run) if run is not None else None
        #: The directory of the current (or last) run, ``None`` before the first fit and on ranks other than 0.
        self.path: Path | None = None
        self._active = False
        self._warned = False

    @hookimpl
    def unison_on_trainer_init(self, trainer: Any) -> None:
        if self.run is not None:
            self.run.check_local()  # an unwritable directory is refused before training, not at the first fit

    @hookimpl(tryfirst=True)
    def unison_on_fit_start(self, trainer: Any) -> None:
        if not trainer.is_global_zero:
            return
        if self.run is not None:
            self.path = self.run.open(trainer)
            assert self.run.metadata is not None  # open() records it
            metadata = self.run.metadata
        else:
            metadata = run_metadata(trainer)
        try:
            self._start(trainer, metadata)
        except BaseException:
            if self.run is not None:
                self.run.close()
            raise
        self._active = True

    @hookimpl
    def unison_log_metrics(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        if not trainer.is_global_zero:
            return
        if not self._active:
            if not self._warned:  # metrics logged outside fit(): there is no run to put them in
                warnings.warn(
                    f"{type(self).__name__}: metrics logged outside fit() are not recorded "
                    f"({sorted(metrics)} at step {step})",
                    stacklevel=2,
                )
                self._warned = True
            return
        self._log(step, metrics)
        if self.run is not None:
            self.run.upload()  # object storage: at most every upload_every_s seconds; locally nothing

    @hookimpl(trylast=True)
    def unison_on_fit_end(self, trainer: Any) -> None:
        progress = getattr(trainer, "progress", None)
        if self._active and self.run is not None and progress is not None and progress.run_dir is None:
            progress.run_dir = self.run.location  # no root_dir: fit's result names the loggers' run directory
        self._finish(ok=True)

    @hookimpl
    def unison_on_exception(self, trainer: Any, exception: BaseException) -> None:
        try:
            self._finish(ok=False)
        except Exception as exc:  # this hook must not raise: the training error is the one to report
            warnings.warn(f"{type(self).__name__} could not close its run: {exc}", stacklevel=2)

    def _finish(self, ok: bool) -> None:
        if not self._active:
            return
        self._active = False
        try:
            self._close(ok)
        finally:
            if self.run is not None:
                self.run.close()

    # -- implemented by each logger ------------------------------------------ #
    def _start(self, trainer: Any, metadata: dict[str, Any]) -> None:
        """Open the run's files or remote run and record ``metadata`` (config, declaration, versions)."""

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def _close(self, ok: bool) -> None:
        """Flush and close; ``ok`` is ``False`` when fit failed."""
