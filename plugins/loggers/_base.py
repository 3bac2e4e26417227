"""What every built-in logger shares: one session per fit, written by global rank 0.

The trainer hands every rank the same metrics (already reduced), so one rank
writing is enough and no two processes ever write the same file. A session
opens at ``unison_on_fit_start`` (first among the fit-start hooks, so other
plugins may log from theirs) and closes at ``unison_on_fit_end`` (last) or
``unison_on_exception``; ``step`` is the trainer's, so every backend numbers
the x-axis alike.

Write failures (the policy, see docs/logging.md "When a logger cannot write"): a logger whose
write fails while training (a full disk, an I/O error, a server that stopped answering: any
exception from ``_log`` or ``_close``, or an ``OSError`` while opening its run) is reported once,
as one warning naming the logger, where it writes and the error, and is disabled for the rest of
the fit; training goes on. Why not stop: metrics are a record of the run, checkpoints are the run;
a full metrics disk at step 90,000 must not cost the run, and a user who needs the metrics can
resume from the last checkpoint into a directory with space. Lightning and Hugging Face users
expect the same of a failing integration: a warning, not a dead job. The other loggers keep
writing (each is judged on its own write).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any

from unison.errors import ConfigurationError
from unison.plugin import hookimpl

from ._run import RunDirectory, run_metadata


def _first_line(exc: BaseException, limit: int = 300) -> str:
    """An error's first non-empty line, at most ``limit`` characters (a store error can span pages)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else repr(exc)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class LoggerWriteWarning(RuntimeWarning):
    """A logger could not write (a full disk, an I/O error) and is disabled for the rest of the fit."""


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
        #: The write error that disabled this logger for the current fit (``None``: it writes).
        self.failure: BaseException | None = None

    @hookimpl
    def unison_on_trainer_init(self, trainer: Any) -> None:
        if self.run is not None:
            self.run.check_local()  # an unwritable directory is refused before training, not at the first fit

    @hookimpl(tryfirst=True)
    def unison_on_fit_start(self, trainer: Any) -> None:
        if not trainer.is_global_zero:
            return
        self.failure = None  # every fit tries again: space may have been freed since
        opened = False
        try:
            if self.run is not None:
                self.path = self.run.open(trainer)
                opened = True
                assert self.run.metadata is not None  # open() records it
                metadata = self.run.metadata
            else:
                metadata = run_metadata(trainer)
            self._start(trainer, metadata)
        except OSError as exc:
            # The disk (or the server) refused the run's first files: the write-failure policy, as
            # later; other errors (a bad tracking URI, a missing package) are configuration errors.
            if opened and self.run is not None:
                self.run.close()
            self._disable(exc, "opening its run")
            return
        except BaseException:
            if opened and self.run is not None:
                self.run.close()
            raise
        self._active = True

    @hookimpl
    def unison_log_metrics(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        if not trainer.is_global_zero or self.failure is not None:
            return  # a logger disabled by a write error stays quiet for the rest of the fit
        if not self._active:
            if not self._warned:  # metrics logged outside fit(): there is no run to put them in
                warnings.warn(
                    f"{type(self).__name__}: metrics logged outside fit() are not recorded "
                    f"({sorted(metrics)} at step {step})",
                    stacklevel=2,
                )
                self._warned = True
            return
        try:
            self._log(step, metrics)
        except Exception as exc:  # any write failure: reported once, the logger disabled, training goes on
            self._disable(exc, f"logging step {step}")
            return
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
        except Exception as exc:  # the last flush failed: the same policy, the fit's own outcome stands
            self._disable(exc, "closing its run")
        finally:
            if self.run is not None:
                self.run.close()

    def _disable(self, exc: BaseException, during: str) -> None:
        """Apply the write-failure policy: one warning naming this logger, where it writes and the error;
        the logger then writes nothing more in this fit (its files are closed as far as they can be)."""
        first = self.failure is None
        self.failure = exc
        if self._active:
            self._active = False
            with contextlib.suppress(Exception):  # the files are broken already: close what can be
                self._close(False)
            if self.run is not None:
                self.run.close()
        if first:
            warnings.warn(
                f"{type(self).__name__} could not write to {self.location()} while {during} "
                f"({type(exc).__name__}: {_first_line(exc)}); it is disabled for the rest of this run and "
                "training goes on (checkpoints are not affected; the other loggers keep writing)",
                LoggerWriteWarning,
                stacklevel=2,
            )

    def location(self) -> str:
        """Where this logger writes, for messages: its run directory (subclasses name their own)."""
        if self.path is not None:
            return str(self.path)
        return str(self.run.root) if self.run is not None else "its destination"

    # -- implemented by each logger ------------------------------------------ #
    def _start(self, trainer: Any, metadata: dict[str, Any]) -> None:
        """Open the run's files or remote run and record ``metadata`` (config, declaration, versions)."""

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def _close(self, ok: bool) -> None:
        """Flush and close; ``ok`` is ``False`` when fit failed."""
