"""The last collective this rank entered, for the watchdog's stall report; the time it waited in them.

A hung job is explained by where each rank is in the collective schedule: rank 0 waits in step 7's
gradient all-reduce while rank 1 never left step 6's. :data:`RECORDER` keeps, per process, the last
collective entered as ``(operation, group, step, micro-step, phase)``; the watchdog publishes it with
every heartbeat and names it for every rank in its report (:mod:`unison.launch.watchdog`).

Where it is recorded, and why there:

* **The ``torch.distributed`` functions** that the trainer and the strategies call from Python
  (``all_reduce``, ``broadcast``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``barrier``,
  point-to-point ``send``/``recv``...): :func:`install` wraps the module's functions once per process;
  the operation is the function's name and the group its ranks and backend.
* **The strategy's own sync points**, whose collectives may run in C++ and never pass through
  those functions (DDP's reducer all-reduces gradients inside ``backward``): the training loop,
  which decides where gradients are synchronised (the accumulation declaration), records each
  ``backward`` it calls outside ``no_sync()`` as ``backward (gradient sync)`` and a pipeline's
  ``forward_backward`` as ``forward_backward (pipeline schedule)``, and counts the
  step's micro-steps (0-based), so a record says which micro-batch a rank was in.

Recording costs a few attribute assignments per call: no I/O, no lock, no device work; the group is
described (its ranks looked up) only when a heartbeat is published, every few seconds.

The same wrappers time the *blocking* calls on CPU (gloo) groups: a rank that waits there for a slow
peer spends that time waiting, not computing. :attr:`CollectiveRecorder.wait_s` adds it up for
straggler reports (:mod:`unison.plugins.callbacks.stragglers`). Asynchronous calls, calls on device
(NCCL) groups, whose host side returns before the device has waited, and collectives run in C++
(DDP's gradient all-reduce) are not timed: there the wait cannot be told apart from the work.
"""

from __future__ import annotations

import collections
import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

#: The ``torch.distributed`` functions wrapped by :func:`install`.
WRAPPED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    # Not isend/irecv: torch.distributed.P2POp accepts only the original functions (an identity check against
    # distributed_c10d's own names), so a pipeline schedule building P2POps from torch.distributed fails on a wrapper.
    "batch_isend_irecv",
)


class CollectiveRecorder:
    """One process's last collective entered, its micro-step count and its time waited in collectives."""

    def __init__(self) -> None:
        #: ``(operation, group, step, micro_step, phase)`` of the last collective entered, or ``None``.
        self.last: tuple[str, Any, int, int | None, str] | None = None
        #: The last few entered, with the monotonic time of each (a frozen rank's report picks the one
        #: before its freeze: :meth:`describe_before`).
        self.recent: collections.deque[tuple[float, tuple[str, Any, int, int | None, str]]] = collections.deque(
            maxlen=16
        )
        #: Seconds spent in blocking collectives on CPU groups (reset by whoever reads it per window).
        self.wait_s = 0.0
        self.micro = 0
        self._micro_step: int | None = None
        self._where: Callable[[], tuple[int, str]] = lambda: (0, "setup")
        self._cpu: dict[int, bool] = {}

    def follow(self, where: Callable[[], tuple[int, str]]) -> None:
        """Take ``(step, phase)`` from ``where`` (the watchdog's record of this rank's position)."""
        self._where = where
        self._micro_step, self.micro = None, 0
        self._cpu.clear()  # a new fit may have a new default group

    def enter(self, op: str, group: Any) -> None:
        """Record that this rank enters ``op`` on ``group`` now (the hot path: assignments only)."""
        step, phase = self._where()
        self.last = (op, group, step, self.micro if step == self._micro_step else None, phase)
        self.recent.append((time.monotonic(), self.last))

    def micro_step(self) -> None:
        """A micro-step's backward begins: count it within the step."""
        step = self._where()[0]
        if step == self._micro_step:
            self.micro += 1
        else:
            self._micro_step, self.micro = step, 0

    def on_cpu(self, group: Any) -> bool:
        """Whether ``group`` (``None``: the default group) runs on CPU (gloo), where a blocking call waits."""
        key = id(group)
        known = self._cpu.get(key)
        if known is None:
            try:
                known = self._cpu[key] = dist.get_backend(group) == "gloo"
            except (RuntimeError, ValueError):  # not a group of this process (yet)
                return False
        return known

    def describe(self) -> dict[str, Any] | None:
        """The last collective as plain data (for a heartbeat): op, group, step, micro_step, phase."""
        return _as_record(self.last)

    def describe_before(self, moment: float) -> dict[str, Any] | None:
        """The last collective entered at or before the monotonic time ``moment``, as :meth:`describe` gives it."""
        found = None
        for at, entry in self.recent:
            if at <= moment:
                found = entry
        return _as_record(found)

    def entered_at(self) -> list[float]:
        """The monotonic times of the recent entries."""
        return [at for at, _ in self.recent]


def _as_record(entry: tuple[str, Any, int, int | None, str] | None) -> dict[str, Any] | None:
    if entry is None:
        return None
    op, group, step, micro, phase = entry
    return {"op": op, "group": describe_group(group), "step": step, "micro_step": micro, "phase": phase}


#: This process's recorder.
RECORDER = CollectiveRecorder()


def describe_group(group: Any) -> str:
    """``world (gloo)``, or ``ranks [0, 2] (nccl)``: a group as a report names it."""
    try:
        backend = dist.get_backend(group)
        if group is None or group is dist.group.WORLD:
            return f"world ({backend})"
        return f"ranks {dist.get_process_group_ranks(group)} ({backend})"
    except (RuntimeError, ValueError, AttributeError):  # destroyed or never joined
        return "a group no longer known"


def summary(record: dict[str, Any] | None) -> str:
    """One phrase for a report: ``all_reduce on world (gloo) at step 6, micro-step 1 (optimizer_step)``."""
    if not record:
        return "none yet"
    micro = f", micro-step {record['micro_step']}" if record.get("micro_step") is not None else ""
    return f"{record['op']} on {record['group']} at step {record['step']}{micro} ({record['phase']})"


# --------------------------------------------------------------------------- #
# Installing the recording
# --------------------------------------------------------------------------- #
_installed = False


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    params = list(inspect.signature(fn).parameters)
    group_at = params.index("group") if "group" in params else None
    async_at = params.index("async_op") if "async_op" in params else None
    blocking_kind = name not in ("isend", "irecv", "batch_isend_irecv")
    recorder = RECORDER

    @functools.wraps(fn)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[group_at] if group_at is not None and len(args) > group_at else None)
        recorder.enter(name, group)
        asynchronous = kwargs.get(
            "async_op", args[async_at] if async_at is not None and len(args) > async_at else False
        )
        if asynchronous or not blocking_kind or not recorder.on_cpu(group):
            return fn(*args, **kwargs)
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            recorder.wait_s += time.perf_counter() - started

    recorded.__unison_recorded__ = True  # type: ignore[attr-defined]  # marks a wrapper: never wrapped twice
    return recorded


def install(where: Callable[[], tuple[int, str]]) -> None:
    """Record this process's collectives (once), at ``where()``'s step.

    Called by the trainer when a fit of several ranks starts. The strategy's own sync points are
    recorded by the training loop where it calls them (:meth:`CollectiveRecorder.enter`,
    :meth:`CollectiveRecorder.micro_step`); nothing of the strategy is wrapped.
    """
    global _installed
    RECORDER.follow(where)
    if not _installed:
        for name in WRAPPED:
            fn = getattr(dist, name, None)
            if fn is not None and not getattr(fn, "__unison_recorded__", False):
                setattr(dist, name, _wrap(name, fn))
        _installed = True
