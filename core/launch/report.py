"""The one failure report of a torchrun job that ``unison run`` / ``unison train`` print.

:func:`watch_torchrun` tells the workers that failed on their own from those
torchrun terminated because of them; :func:`summarize_failures` orders the
real failures, picks the first and writes the report and the job's exit code.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def watch_torchrun() -> Iterator[set[int]]:
    """Yield the pids of the workers that failed before torchrun began stopping the others.

    After the first failure torchrun terminates every surviving worker
    (SIGTERM, SIGKILL after a grace period) and reports those too, by
    signal, with nothing to tell them from a worker the OOM killer or an
    operator killed. The pids it had seen fail when it first closes a
    worker group are the real failures. Also quiets torchrun's own per-worker
    error log, which the launcher's report replaces.
    """
    from torch.distributed.elastic.multiprocessing import api

    from unison._upstream.torch import torchrun_worker_failures

    failed_before_close: set[int] = set()
    closing: weakref.WeakSet[Any] = weakref.WeakSet()  # the worker contexts close() was called on
    original = api.PContext.close

    def close(self: Any, *args: Any, **kwargs: Any) -> None:
        if self not in closing:  # the first close: nothing terminated yet
            closing.add(self)
            failed_before_close.update(f.pid for f in torchrun_worker_failures(self).values())
        return original(self, *args, **kwargs)

    log = logging.getLogger(api.__name__)
    level = log.level
    api.PContext.close = close
    log.setLevel(logging.CRITICAL)
    try:
        yield failed_before_close
    finally:
        api.PContext.close = original
        log.setLevel(level)


def _record(failure: Any) -> dict[str, Any]:
    """What the worker recorded about its failure (:func:`unison.launch.lifecycle.record_error`), or ``{}``."""
    info = failure.error_file_data.get("message", {}) if isinstance(failure.error_file_data, dict) else {}
    if not isinstance(info, dict):
        return {}
    extra = info.get("extraInfo", {})
    return {"message": str(info.get("message", "")), **(extra if isinstance(extra, dict) else {})}


def _what(failure: Any, record: dict[str, Any], code: int) -> str:
    """One line for a worker's own failure: its exception's first line, the stall, or its signal."""
    from unison.errors import EXIT_STALLED

    if record.get("message"):
        return f"{record['message'].strip().splitlines()[0][:300]} (exit code {code})"
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()} from outside the job (the OOM killer, an operator...)"
    if failure.exitcode == EXIT_STALLED:
        return f"stalled: the watchdog found a rank that stopped making progress (exit code {EXIT_STALLED})"
    return f"exit code {code}, no error recorded"


def summarize_failures(failures: dict[int, Any], failed_before_close: set[int] | None = None) -> tuple[int, list[str]]:
    """``(exit code, report lines)`` for torchrun's failed workers: one report for the job, first failure first.

    ``failed_before_close`` holds the pids torchrun saw fail before it began
    terminating the rest (:func:`watch_torchrun`); a worker outside it that
    recorded no exception was stopped by torchrun because of the first failure
    and is reported as such, never as a failure of its own (``None``: every
    worker counts). A worker that recorded an exception counts whenever it
    exited: a rank that raised may still be tearing down when the peer it
    left behind fails and is seen first.

    Among the real failures: workers killed by a signal first (nothing in the
    job kills a worker by signal before torchrun closes it, while the other
    ranks of a killed worker fail in their next collective with "connection
    closed"), then ranks that exited with the watchdog's code (a stall is
    found first-hand, its peers' errors follow),
    then by the time each worker recorded its exception (sub-second, written by
    :func:`unison.launch.lifecycle.record_error`), then by the time torchrun saw the rest.

    The first failure's report follows the headline: a ConfigurationError's
    message (once, however many ranks raised it), an exception's traceback,
    then one line per failed rank. Its exit code is the job's: 2 for a
    ConfigurationError, 1 for an exception, 3 for a stall, 128 + N for signal
    N; 75 when every failed rank stopped on request after a checkpoint.
    """
    from unison.errors import EXIT_STALLED
    from unison.launch.lifecycle import PREEMPTED_EXIT_CODE

    records = {rank: _record(f) for rank, f in failures.items()}

    def real(rank: int) -> bool:  # torchrun's SIGTERM ends a worker without a recorded exception
        if not failed_before_close or "unison_time" in records[rank]:
            return True
        return failures[rank].pid in failed_before_close

    def when(rank: int) -> tuple[int, float, int]:
        failure, precise = failures[rank], records[rank].get("unison_time")
        # (a worker that recorded an exception may still be killed by torchrun while it exits)
        first_hand = (
            2 if precise is not None else 0 if failure.exitcode < 0 else 1 if failure.exitcode == EXIT_STALLED else 2
        )
        return (first_hand, float(precise) if precise is not None else float(failure.timestamp), rank)

    ordered = sorted((r for r in failures if real(r)), key=when) or sorted(failures, key=when)
    stopped = sorted(r for r in failures if r not in ordered)
    if all(failures[r].exitcode == PREEMPTED_EXIT_CODE for r in ordered):
        return PREEMPTED_EXIT_CODE, [
            f"unison run: stopped on request after a checkpoint (exit code {PREEMPTED_EXIT_CODE})"
        ]

    def exit_code(rank: int) -> int:  # what the worker exited with, or was exiting with when torchrun closed it
        recorded, exitcode = records[rank].get("unison_exit_code"), failures[rank].exitcode
        return int(recorded) if recorded is not None else 128 - exitcode if exitcode < 0 else exitcode or 1

    head = records[ordered[0]]
    code = exit_code(ordered[0])
    lines = [f"unison run: rank {ordered[0]} failed first; the job exits with code {code}"]
    if head.get("unison_kind") == "configuration":
        lines.append(f"error: {head['message'].split(': ', 1)[-1]}")
    elif head.get("unison_kind") == "stall":
        pass  # the stall's report and every live rank's stacks are printed by the ranks themselves
    elif head.get("py_callstack"):
        lines.append(str(head["py_callstack"]).rstrip())
    for i, rank in enumerate(ordered):
        failure, record = failures[rank], records[rank]
        if record.get("unison_kind") == "stall":
            what = f"exit code {exit_code(rank)}: {record['message'].strip().splitlines()[0][:300]}"
        elif i == 0 and record.get("unison_kind") == "configuration":
            what = f"configuration error, message above (exit code {exit_code(rank)})"
        elif i == 0 and record.get("py_callstack"):
            what = f"{record['message'].split(':', 1)[0]}, traceback above (exit code {exit_code(rank)})"
        elif i > 0 and record.get("message") and record.get("message") == head.get("message"):
            what = f"the same error (exit code {exit_code(rank)})"
        else:
            what = _what(failure, record, exit_code(rank))
        lines.append(f"  rank {rank} (pid {failure.pid}){' failed first' if i == 0 else ''}: {what}")
    for rank in stopped:
        pid = failures[rank].pid
        lines.append(f"  rank {rank} (pid {pid}): stopped by the launcher after rank {ordered[0]} failed")
    return code, lines
