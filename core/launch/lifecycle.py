"""The life of a training process: joining the world, stop requests, and how it ends.

* :func:`init_process_group` joins the world with a rendezvous timeout of
  minutes (a peer that never arrives fails the start quickly), then gives the
  group its longer collective timeout.
* :class:`RunGuard` wraps ``Trainer.fit``. It turns SIGTERM and SIGUSR1 (what
  schedulers send before they kill a job: Kubernetes, SLURM's ``--signal``)
  into a *stop request* that the trainer honours at the next optimizer-step
  boundary, and, under torchrun, records the exception that ended the run in
  torchrun's error file so the launcher can name the first failure.
* :meth:`RunGuard.watch` ties the run's :class:`~unison.launch.watchdog.Watchdog`
  (hung ranks named in seconds) to the guarded ``fit``: it stops before the
  process group goes away. NCCL groups get torch's flight recorder
  (:func:`enable_nccl_flight_recorder`).
* :class:`Preempted` is how ``fit`` ends after a stop request: a
  ``SystemExit`` with :data:`PREEMPTED_EXIT_CODE`, raised once a checkpoint
  is committed.

Why the stop is agreed collectively: a scheduler may signal one rank (one
node) only, or the ranks at different moments. Every rank all-reduces its
flag at each step boundary, without waiting for it until the next one
(:mod:`unison.training.stopping`), so all ranks stop after the same optimizer
step, one step after the signal, and write one consistent checkpoint.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from types import FrameType, TracebackType
from typing import Any

import torch

from unison._upstream.torch import set_default_group_timeout
from unison.launch import messages

#: Exit code of a run that stopped on request after committing a checkpoint
#: (EX_TEMPFAIL: "temporary failure, try again"). Restart it with
#: ``ckpt_path="auto"`` to continue exactly where it stopped.
PREEMPTED_EXIT_CODE = 75

#: Signals that request a stop at the next step boundary.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

#: Seconds to wait for every rank to join the process group
#: (``UNISON_RENDEZVOUS_TIMEOUT`` overrides).
RENDEZVOUS_TIMEOUT_S = 180.0
#: Seconds a collective may wait for the other ranks once training runs
#: (``UNISON_COLLECTIVE_TIMEOUT`` overrides); checkpoint writes happen inside it.
COLLECTIVE_TIMEOUT_S = 600.0


class Preempted(SystemExit):
    """``fit`` stopped on a stop request after committing a checkpoint (exit code 75).

    A ``SystemExit``, so a script that does not catch it exits with
    :data:`PREEMPTED_EXIT_CODE` and no traceback, and ``except Exception``
    does not swallow it.
    """

    def __init__(self, step: int, signal_name: str, checkpoint: str | None) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step, self.signal_name, self.checkpoint = step, signal_name, checkpoint

    def __str__(self) -> str:
        where = f"checkpoint {self.checkpoint}" if self.checkpoint else "no checkpoint_dir, nothing saved"
        return f"stopped by {self.signal_name} after step {self.step} ({where})"


def _seconds(env: str, default: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get(env, default)))


def init_process_group(backend: str) -> None:
    """Join the world described by the ``env://`` variables.

    The rendezvous (store connection and the backend's full mesh) gets
    ``UNISON_RENDEZVOUS_TIMEOUT`` (default 180 s): a rank that is missing
    fails the start within minutes instead of the process-group default of
    10 to 30. The group then gets ``UNISON_COLLECTIVE_TIMEOUT`` (default
    600 s) for collectives, which must outlast the slowest checkpoint write.
    """
    dist = torch.distributed
    _warn_shared_store()
    if "nccl" in backend:
        enable_nccl_flight_recorder()
    dist.init_process_group(backend, timeout=_seconds("UNISON_RENDEZVOUS_TIMEOUT", RENDEZVOUS_TIMEOUT_S))
    set_default_group_timeout(_seconds("UNISON_COLLECTIVE_TIMEOUT", COLLECTIVE_TIMEOUT_S))


def collective_timeout_s() -> float:
    """The collective timeout :func:`init_process_group` gives the group, in seconds."""
    return _seconds("UNISON_COLLECTIVE_TIMEOUT", COLLECTIVE_TIMEOUT_S).total_seconds()


def enable_nccl_flight_recorder() -> None:
    """Turn on torch's NCCL flight recorder unless the environment already configures it.

    It keeps the last collectives of each rank (``TORCH_NCCL_TRACE_BUFFER_SIZE``)
    and writes them to ``TORCH_FR_DUMP_TEMP_FILE`` + rank on a collective
    timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``); the watchdog
    (:mod:`unison.launch.watchdog`) dumps it on a stall and prints the path. Must run
    before the NCCL group is created.
    """
    import tempfile

    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(tempfile.gettempdir(), "unison_nccl_trace_rank_"))


def _warn_shared_store() -> None:
    """torchrun's shared rendezvous store breaks worker restarts; say so once, on rank 0.

    With it, a restarted world reads the dead worker's address from the
    previous attempt's keys and hangs or is refused. ``unison run`` and
    ``unison train`` switch it off; plain ``torchrun`` needs
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
    """
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("RANK") == "0":
        warnings.warn(
            "torchrun runs with --max-restarts and its shared rendezvous store: a restarted world can hang or be "
            "refused connecting to the dead worker's old address. Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "(unison run and unison train do)",
            RuntimeWarning,
            stacklevel=3,
        )


class RunGuard:
    """Context manager around one ``fit``: stop signals in, error report out.

    Signal handlers are installed only in the main thread (Python allows no
    other) and the previous ones are restored on exit. A second signal of
    the same kind while a stop is pending goes to the previous handler
    (by default: terminate now), so an impatient operator still wins.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: str | None = None
        #: The number of the stop signal received, 0 for none (or a stop asked for by :meth:`request_stop`).
        self.signum = 0
        self._previous: dict[signal.Signals, Any] = {}
        self._watchdog: Any = None

    def watch(self, watchdog: Any) -> Any:
        """Stop ``watchdog`` (a :class:`~unison.launch.watchdog.Watchdog`) when the guarded ``fit`` ends."""
        self._watchdog = watchdog
        return watchdog

    # -- stop requests -------------------------------------------------------- #
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is not None:
            previous = self._previous.get(sig, signal.SIG_DFL)
            signal.signal(sig, previous)
            if callable(previous):
                previous(signum, frame)
            else:
                os.kill(os.getpid(), signum)
            return
        self.received, self.signum = sig.name, int(sig)

    def request_stop(self, reason: str = "request") -> None:
        """Ask for a stop at the next step boundary, as a signal would."""
        self.received = self.received or reason

    def preempt(self, trainer: Any, reason: str) -> None:
        """On every rank, once the trainer agreed on a stop request: commit a checkpoint, raise :class:`Preempted`.

        Called at an optimizer-step boundary by the trainer (which agrees on
        the request with the all-reduce that carries ``should_stop``;
        :class:`~unison.training.stopping.StopAgreement`). The
        checkpoint is written only with a ``checkpoint_dir`` and only when this
        step is not committed already (a periodic save just did it).
        """
        checkpointer = trainer.checkpointer
        path = None
        if checkpointer is not None:
            if checkpointer.last_step != trainer.global_step:
                trainer.save_checkpoint()
            path = checkpointer.latest()
        stop = Preempted(trainer.global_step, reason, str(path) if path else None)
        if trainer.is_global_zero:
            messages.say(f"unison: {stop}; exiting with code {PREEMPTED_EXIT_CODE}", level="warning")
        raise stop

    # -- context -------------------------------------------------------------- #
    def __enter__(self) -> RunGuard:
        _register_exit_drain()
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._watchdog is not None:  # before the process group goes: its store may go with it
            self._watchdog.stop()
            self._watchdog = None
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if exc is not None and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            record_error(exc)  # the time it happened, before a peer's fallout


#: Set in the environment of the workers ``unison run`` / ``unison train`` start: the launcher prints the
#: job's one failure report, so a worker records its error (:func:`record_error`) instead of printing it.
LAUNCHER_ENV = "UNISON_LAUNCHER_REPORTS"

_recorded: BaseException | None = None


def exit_code_for(exc: BaseException) -> int:
    """The exit code a worker ends with after ``exc``: its ``exit_code`` (2 for a ConfigurationError, 3 for a
    stall), else 1 (see :mod:`unison.errors`)."""
    from unison.errors import EXIT_FAILED

    return int(getattr(exc, "exit_code", EXIT_FAILED))


def record_error(exc: BaseException) -> bool:
    """Write ``exc`` to torchrun's error file for this worker (when there is one); ``True`` when written.

    torchrun then knows each failed worker's exception, and ``unison run``
    reports the first one instead of every rank's fallout. The format is
    torchrun's own (``ErrorHandler.record_exception``) plus ``unison_time``, a
    sub-second timestamp (torchrun's whole seconds cannot order a rank's
    error before the "connection closed" it causes on the others),
    ``unison_exit_code`` and ``unison_kind`` (``"configuration"``, ``"stall"``
    or ``"exception"``). The same exception recorded twice keeps its first time.
    """
    global _recorded
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    if exc is _recorded:
        return True
    from unison.errors import EXIT_CONFIGURATION, EXIT_STALLED

    now = time.time()
    code = exit_code_for(exc)
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                "timestamp": str(int(now)),
                "unison_time": now,
                "unison_exit_code": code,
                "unison_kind": {EXIT_CONFIGURATION: "configuration", EXIT_STALLED: "stall"}.get(code, "exception"),
            },
        }
    }
    # Whole or not at all: torchrun's agent parses the file of every failed worker, and one cut short (this
    # worker killed mid-write by the agent's SIGTERM after a peer died) made the agent itself fail on
    # the JSON, ending the job instead of restarting it. Written beside it, then renamed over it.
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as f:
            json.dump(data, f)
        os.replace(partial, path)
    except OSError:  # reporting must never mask the real error
        with contextlib.suppress(OSError):
            os.unlink(partial)
        return False
    _recorded = exc
    return True


def report_worker_failure(exc: BaseException) -> int:
    """Record or print the exception that ends a worker; return the exit code to end with.

    Under ``unison run`` / ``unison train`` (:data:`LAUNCHER_ENV` set) the
    error goes to torchrun's error file only, and the launcher prints one
    report for the whole job: the first failure's message (a
    ConfigurationError) or traceback, and one line per other rank. Elsewhere
    (plain ``torchrun``, one process) it is printed here: a ConfigurationError
    as its one-line message, anything else as a traceback.
    """
    from unison.errors import EXIT_CONFIGURATION

    code = exit_code_for(exc)
    if record_error(exc) and os.environ.get(LAUNCHER_ENV) == "1":
        return code
    if code == EXIT_CONFIGURATION:
        messages.say(f"error: {exc}", level="error")
    elif messages.log_format() == "json":  # the traceback as one record's message
        messages.say("".join(traceback.format_exception(exc)).rstrip(), level="error")
    else:
        traceback.print_exception(exc)
    return code


# --------------------------------------------------------------------------- #
# A clean end of the process
# --------------------------------------------------------------------------- #
_drain_registered = False


def _register_exit_drain() -> None:
    global _drain_registered
    if not _drain_registered:
        atexit.register(drain_collective_threads)
        _drain_registered = True


def _gloo_worker_threads() -> int:
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return -1  # cannot tell: drain anyway
    count = 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().startswith("pt_gloo")
        except OSError:
            continue
    return count


def drain_collective_threads() -> None:
    """At interpreter exit: let gloo's worker threads finish with Python before it shuts down.

    Why (measured; the cause of ``terminate called without an active
    exception`` and SIGABRT in a rank of a run that had finished): a gloo
    worker thread releases the work object of the last collective it ran
    after the caller has already moved on; if that work holds the last
    reference to a tensor that Python created, releasing it needs the GIL.
    When the main thread reaches interpreter finalization first, the worker's
    ``take_gil`` ends its thread with a forced unwind through a ``noexcept``
    destructor, and ``std::terminate`` aborts the process. It happens only for
    process groups that outlive ``destroy_process_group`` because something
    still references them (a ``ZeroRedundancyOptimizer`` default argument,
    DeepSpeed's group registry, FSDP state inside the user's module, DTensor's
    planner cache); a group whose last reference goes away in
    ``destroy_process_group`` joins its threads there, while Python is alive.

    This handler runs before finalization (``atexit``) and hands the GIL over
    until every such waiting thread had it: a short sleep lets a waiter take
    it, and CPython's forced switching makes a busy holder yield to any thread
    that has waited a switch interval. Only runs when gloo threads exist.
    """
    if _gloo_worker_threads() == 0:
        return
    interval = sys.getswitchinterval()
    for _ in range(4):
        time.sleep(interval)  # a thread waiting for the GIL takes it now
        end = time.monotonic() + 2 * interval
        while time.monotonic() < end:  # holding it, the main thread must hand it to a thread that waited
            pass
