"""unison's own messages, as text lines for people or one JSON object per line for log services.

Every line unison itself prints (setup, run directory, resume, progress, stragglers, the watchdog's
stall report, a stop request, the launcher's one failure report per job) goes through :func:`say`. In
the ``text`` format (the default) it prints the line as it always did. In the ``json`` format
(``--log-format json``, ``Trainer(log_format="json")`` or ``UNISON_LOG_FORMAT=json``) it prints one
JSON object per line instead::

    {"time": "2026-01-02T03:04:05.678Z", "level": "info", "rank": 0, "node": "host-a", "step": 40,
     "run_id": "3f2a...", "message": "train step 40/150 | loss 2.3456 | ..."}

``rank`` is the process's global rank (``null`` in a launcher), ``node`` its host name, ``step`` the
optimizer steps completed by the fit in progress (``null`` outside one), ``run_id`` the job's id
(:func:`run_id`). In the ``json`` format Python warnings and records of the standard ``logging``
module that reach the root logger (torch's own, the elastic launcher's) are written the same way, with
``level`` ``warning`` (or the record's level). Why an environment variable carries the choice: the
launcher and the workers it starts are separate processes, and each must print in the same format.
Text that native code writes straight to the file descriptors (``faulthandler``'s stack dumps in a
stall report, a C++ library's own warnings) is not unison's and stays as it is.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import sys
import uuid
import warnings
from collections.abc import Callable
from typing import Any, TextIO

from unison.errors import ConfigurationError

#: The environment variable that carries the log format to every process of a job.
FORMAT_ENV = "UNISON_LOG_FORMAT"
#: The environment variable that carries the job's id (set by ``unison run`` for a single-node job).
RUN_ID_ENV = "UNISON_RUN_ID"
FORMATS = ("text", "json")

_step: Callable[[], int | None] | None = None
_rank: Callable[[], int | None] | None = None
_process_run_id: str | None = None
_original_showwarning = warnings.showwarning
_handler: logging.Handler | None = None


def log_format() -> str:
    """The format in force: ``UNISON_LOG_FORMAT`` when it names one, else ``text``."""
    value = os.environ.get(FORMAT_ENV, "text")
    return value if value in FORMATS else "text"


def check_format(value: str | None, option: str = "log_format") -> None:
    """Refuse a format that is not ``text`` or ``json`` (before any process group), naming ``option``."""
    if value is not None and value not in FORMATS:
        raise ConfigurationError(option, f"{value!r} is not a log format", 'use "text" or "json"')


def configure(
    fmt: str | None, step: Callable[[], int | None] | None = None, rank: Callable[[], int | None] | None = None
) -> None:
    """Use ``fmt`` in this process and in every process it starts (``None``: keep the one in force).

    ``step`` answers the ``step`` field (the trainer's optimizer steps completed), ``rank`` the
    ``rank`` field where no launcher set ``RANK`` (a trainer's own world of one). ``json`` also
    routes Python warnings and root-logger records through :func:`say`; ``text`` restores them.
    """
    global _step, _rank
    check_format(fmt, "log_format")
    if fmt is not None:
        os.environ[FORMAT_ENV] = fmt  # inherited by torchrun and its workers
    if step is not None:
        _step = step
    if rank is not None:
        _rank = rank
    _route_python_output(log_format() == "json")


def run_id() -> str:
    """The job's id, the same on every rank: ``UNISON_RUN_ID``, else torchrun's ``TORCHELASTIC_RUN_ID``
    (a multi-node job's ``--rdzv-id``), else one id made for this process."""
    global _process_run_id
    for name in (RUN_ID_ENV, "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(name)
        if value and value != "none":  # torchrun's default rdzv id is the word "none"
            return value
    if _process_run_id is None:
        _process_run_id = uuid.uuid4().hex[:12]
    return _process_run_id


def rank() -> int | None:
    """This process's global rank as its launcher set it, else its trainer's; ``None`` in a launcher."""
    value = os.environ.get("RANK")
    if value is not None and value.isdigit():
        return int(value)
    return _rank() if _rank is not None else None


def node() -> str:
    """This process's node: its host name."""
    return socket.gethostname()


def record(message: str, level: str = "info", step: int | None = None) -> dict[str, Any]:
    """The JSON object :func:`say` prints for ``message`` (the text form's ``unison: `` prefix dropped)."""
    if step is None and _step is not None:
        try:
            step = _step()
        except Exception:  # a message must never fail: the step is context, not content
            step = None
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "time": now.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "level": level,
        "rank": rank(),
        "node": node(),
        "step": step,
        "run_id": run_id(),
        "message": message.removeprefix("unison: "),
    }


def say(message: str, *, level: str = "info", file: TextIO | None = None, step: int | None = None) -> None:
    """Print one of unison's messages on ``file`` (default stderr) in the format in force."""
    out = file if file is not None else sys.stderr
    if log_format() == "json":
        out.write(json.dumps(record(message, level, step), default=str) + "\n")
    else:
        out.write(message + "\n")
    out.flush()


# --------------------------------------------------------------------------- #
# Python warnings and the logging module, in the json format
# --------------------------------------------------------------------------- #
def _json_showwarning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    say(f"{category.__name__}: {message} ({filename}:{lineno})", level="warning", file=file)


class _JSONHandler(logging.Handler):
    def emit(self, rec: logging.LogRecord) -> None:
        try:
            say(f"{rec.name}: {rec.getMessage()}", level=rec.levelname.lower())
        except Exception:  # logging must never raise into the caller
            self.handleError(rec)


def _route_python_output(json_format: bool) -> None:
    global _handler
    root = logging.getLogger()
    if json_format:
        warnings.showwarning = _json_showwarning
        if _handler is None:
            _handler = _JSONHandler(logging.WARNING)
            root.addHandler(_handler)
    else:
        if warnings.showwarning is _json_showwarning:
            warnings.showwarning = _original_showwarning
        if _handler is not None:
            root.removeHandler(_handler)
            _handler = None


# A worker started by a launcher in the json format prints in it from its first line on.
if log_format() == "json":
    _route_python_output(True)
