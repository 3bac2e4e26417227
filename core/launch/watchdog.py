"""The watchdog: a rank that stops making progress is named within seconds, not at the collective timeout.

Without it a frozen rank (stopped, stuck in the kernel, holding the GIL in a
C call) is noticed only when a peer's collective times out (10 minutes by
default), and the error names no rank. With it:

* Every rank runs a daemon thread that publishes a *heartbeat* to the
  control plane (the rendezvous store, ``MASTER_ADDR:MASTER_PORT``, through a
  client of its own with a short timeout; never the training collectives)
  every ``interval`` seconds: a counter, the rank's last (step, phase), its
  host and pid. The training loop only assigns an in-memory record
  (:meth:`Watchdog.mark`); the hot path makes no store round trip.
* The same thread reads every rank's heartbeat. A rank whose counter has not
  changed for ``stall_timeout_s`` (measured on the reader's own clock, so
  hosts need no synchronised clocks) is *stalled*; so is the store's host when
  the store stops answering for that long. A slow rank is not stalled: its
  thread keeps beating while its step takes as long as it takes.
* On a stall every live rank prints one line naming the stalled rank and
  where every rank is (step, phase), dumps its Python stacks
  (:mod:`faulthandler`), dumps the NCCL flight recorder on CUDA, records the
  error for the launcher and exits with :data:`~unison.errors.EXIT_STALLED`
  (3). A stalled rank that is merely *stopped* (SIGSTOP, state ``T``) on the
  same host is continued first: frozen, it would ignore the launcher's
  SIGTERM for the launcher's whole grace period (30 s for torchrun) and end
  as "killed by SIGKILL". Continued, it notices its own freeze, prints its own
  stacks and exits with the same code.

A rank that finishes (or fails) marks its heartbeat so, and is never blamed. A rank that has found a
stall trains no further: its training thread waits at its next :meth:`Watchdog.mark` (or at the end of
the fit) for the report, and so does a continued rank until its watchdog has judged its own freeze.

The module is past 400 lines (about 670): the stall rules above, the heartbeat thread, where a frozen
rank froze and what a stall does are one mechanism, and the stall detection itself
(:class:`StallDetector`) is pure and tested alone. The report's wording (``_describe``,
``_positions``, ``_store_stalled``) could stand in a module of its own.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import faulthandler
import io
import itertools
import json
import math
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from unison.errors import EXIT_STALLED, ConfigurationError, UnisonError
from unison.launch import collectives, messages

#: Default of ``stall_timeout_s``: far above any healthy pause of a heartbeat
#: thread, far below the collective timeout.
DEFAULT_STALL_TIMEOUT_S = 300.0

_RUNNING, _DONE = "running", "done"

#: How long a peer waits for a woken store host's record of where it froze; how long that host waits at most,
#: once it has reported, for every peer to report too (each says so in the store) before it exits and its
#: store goes with it. A fixed wait raced a peer slowed by a loaded machine: the host left first, the
#: launcher stopped the peer, and the peer's report was never printed.
FRESH_WAIT_S, HOST_LINGER_S = 3.0, 8.0


class StallError(UnisonError):
    """A rank stopped making progress; every live rank ends with :data:`~unison.errors.EXIT_STALLED`."""

    exit_code = EXIT_STALLED


def check_stall_timeout(stall_timeout_s: float | None, collective_timeout_s: float) -> None:
    """Refuse a stall timeout the collective timeout would beat (before any process group)."""
    if stall_timeout_s is not None and stall_timeout_s >= collective_timeout_s:
        raise ConfigurationError(
            "stall_timeout_s",
            f"{stall_timeout_s:g} s is not below the collective timeout ({collective_timeout_s:g} s): a collective "
            "waiting on a hung rank would fail first, without naming it",
            "lower stall_timeout_s (default 300), or raise UNISON_COLLECTIVE_TIMEOUT",
        )


def heartbeat_interval(stall_timeout_s: float) -> float:
    """Seconds between heartbeats: a tenth of the timeout, within [0.5, 5]."""
    return min(5.0, max(0.5, stall_timeout_s / 10))


# --------------------------------------------------------------------------- #
# Detection: pure logic over observed heartbeats
# --------------------------------------------------------------------------- #
@dataclass
class _Seen:
    beat: int
    changed_at: float  # the observer's clock when the beat last changed
    record: dict[str, Any] = field(default_factory=dict)


class StallDetector:
    """Which ranks' heartbeats stopped: fed observations, asked at a time.

    A rank is stalled when its beat counter has not changed for
    ``stall_timeout_s`` of the observer's clock; a rank never seen counts from
    the detector's start. Ranks whose last record says they are done are
    never stalled. Progress (step, phase) is carried for the report only: a
    rank that beats but does not advance is slow, not stalled.
    """

    def __init__(self, world_size: int, stall_timeout_s: float, now: float) -> None:
        self.world_size, self.stall_timeout_s, self.started = world_size, stall_timeout_s, now
        self.seen: dict[int, _Seen] = {}

    def observe(self, rank: int, record: dict[str, Any], now: float) -> None:
        seen = self.seen.get(rank)
        beat = int(record["beat"])
        if seen is None or seen.beat != beat:
            self.seen[rank] = _Seen(beat, now, record)
        else:
            seen.record = record

    def silent_for(self, rank: int, now: float) -> float:
        seen = self.seen.get(rank)
        return now - (seen.changed_at if seen is not None else self.started)

    def done(self, rank: int) -> bool:
        seen = self.seen.get(rank)
        return seen is not None and seen.record.get("state") == _DONE

    def stalled(self, now: float, ranks: Iterable[int] | None = None) -> list[int]:
        ranks = range(self.world_size) if ranks is None else ranks
        return [r for r in ranks if not self.done(r) and self.silent_for(r, now) >= self.stall_timeout_s]

    def where(self, rank: int) -> str:
        seen = self.seen.get(rank)
        if seen is None:
            return "no heartbeat seen"
        rec = seen.record
        return f"step {rec.get('step')} ({rec.get('phase')})"

    def collective(self, rank: int) -> str:
        """The last collective ``rank``'s heartbeat said it entered (:mod:`unison.launch.collectives`)."""
        seen = self.seen.get(rank)
        return collectives.summary(seen.record.get("collective")) if seen is not None else "no heartbeat seen"


# --------------------------------------------------------------------------- #
# The heartbeat thread
# --------------------------------------------------------------------------- #
def store_client(op_timeout_s: float) -> Any:
    """A client of its own to the rendezvous store at ``MASTER_ADDR:MASTER_PORT`` with a short op timeout.

    Its own connection: a store op that waits on a frozen host blocks only
    the heartbeat thread, never the process group's store.
    """
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=op_timeout_s),
        wait_for_workers=False,
    )


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (``/proc/PID/stat`` field 22): a pid's identity."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[19] if len(fields) > 19 else None


def _proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class Watchdog:
    """One rank's heartbeat publisher and stall detector (see the module docstring).

    Args:
        stall_timeout_s: seconds without a heartbeat before a rank is stalled;
            ``None`` disables the watchdog (``mark`` still works, nothing runs).
        rank, world_size: this rank and the world.
        store: a c10d store shared by the ranks (``None``: :func:`store_client`
            makes one on :meth:`start`).
        prefix: store key prefix, the same on every rank for one fit.
        on_stall: what a stall does (default :meth:`exit_stalled`: report,
            dump stacks, exit with code 3); called with the report line.
        store_host_rank: the rank whose process hosts the store (``None``:
            a launcher's agent does), blamed when the store stops answering.
    """

    def __init__(
        self,
        stall_timeout_s: float | None,
        rank: int,
        world_size: int,
        *,
        store: Any = None,
        prefix: str = "unison/watchdog",
        on_stall: Callable[[str], None] | None = None,
        store_host_rank: int | None = 0,
        interval: float | None = None,
    ) -> None:
        self.stall_timeout_s, self.rank, self.world_size = stall_timeout_s, rank, world_size
        self.interval = interval or (heartbeat_interval(stall_timeout_s) if stall_timeout_s else 0.0)
        self.store, self.prefix, self.store_host_rank = store, prefix, store_host_rank
        self.on_stall = on_stall or self.exit_stalled
        #: (step, phase): the only thing the training loop writes.
        self.where: tuple[int, str] = (0, "setup")
        #: The last positions with the monotonic time of each (a frozen rank's report picks the one before
        #: its freeze: :meth:`frozen_at`).
        self._marks: collections.deque[tuple[float, tuple[int, str]]] = collections.deque(maxlen=32)
        self.report: str | None = None
        self._stoppable: list[tuple[int, str | None]] = []
        self._linger = 0.0
        #: This rank reported the store's host as stalled: woken, that host waits for this rank's report.
        self._woke_host = False
        self._own_store = False
        self._beat_count = 0
        #: When the judging thread last ran (monotonic); infinite while it is not running. A training thread
        #: that finds it a whole timeout old was frozen with its process, and waits for the judgement.
        self._alive_at = math.inf
        self._judge_within = stall_timeout_s if stall_timeout_s is not None else math.inf
        #: Set once this rank has found a stall (its own freeze included); ``_stall_handled`` once ``on_stall``
        #: returned (the default reaction never returns: it exits the process).
        self._stall_found = threading.Event()
        self._stall_handled = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._io: threading.Thread | None = None
        self._identity = {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}

    @property
    def enabled(self) -> bool:
        return self.stall_timeout_s is not None and self.world_size > 1

    def mark(self, step: int, phase: str) -> None:
        """Record where this rank is (hot path: a clock read, a comparison, two assignments; no I/O).

        Once a stall is found here, or when the judging thread has not run for a whole stall timeout (this
        process was frozen and has just been continued), the training thread waits for the judgement first
        instead of training on: a stalled world commits no further step or checkpoint.
        """
        now = time.monotonic()
        if self._judgement_due(now):
            self._await_judgement(now)
        self.where = (step, phase)
        self._marks.append((now, self.where))

    def _judgement_due(self, now: float) -> bool:
        """A stall is found, or the judging thread has not run for a whole timeout (this process was frozen)."""
        return now - self._alive_at >= self._judge_within or self._stall_found.is_set()

    def _await_judgement(self, since: float) -> None:
        """Wait until the judging thread has run since ``since`` without finding a stall, or has handled the
        stall it found (the default reaction exits the process meanwhile); at most one stall timeout."""
        deadline = since + self._judge_within
        while not self._stall_found.is_set() and self._alive_at <= since and time.monotonic() < deadline:
            self._stall_found.wait(0.01)
        if self._stall_found.is_set():
            self._stall_handled.wait()

    def frozen_at(self, now: float) -> tuple[tuple[int, str], dict[str, Any] | None]:
        """Where this rank was when it froze, and the last collective it had entered then.

        Called by the judging thread when its own wait of one interval took a whole stall timeout. Once
        the process is continued, its training thread may run on before this one wakes (into the next
        step's collectives), so the current position is not the frozen one. The freeze is the latest gap
        of at least half the timeout between this rank's recorded events (positions, collectives entered)
        and ``now``: what was recorded before that gap is where it froze. (The freeze lasted at least the
        timeout less one interval, which is half the timeout or more.)
        """
        assert self.stall_timeout_s is not None
        marks = list(self._marks)
        times = sorted([at for at, _ in marks] + collectives.RECORDER.entered_at() + [now])
        frozen = now
        for earlier, later in itertools.pairwise(times):
            if later - earlier >= self.stall_timeout_s / 2:
                frozen = earlier
        where = next((pos for at, pos in reversed(marks) if at <= frozen), self.where)
        return where, collectives.RECORDER.describe_before(frozen)

    # -- lifecycle ----------------------------------------------------------- #
    def start(self) -> Watchdog:
        if self.enabled and self._thread is None:
            self._own_store = self.store is None
            if self.store is None:
                self.store = store_client(max(2.0, 2 * self.interval))
            self._publish(_RUNNING)
            assert self.stall_timeout_s is not None
            self._detector = StallDetector(self.world_size, self.stall_timeout_s, time.monotonic())
            self._store_ok_at = self._alive_at = time.monotonic()
            # Two threads: store I/O can block for good on a frozen store host,
            # so the judging never waits on it.
            self._io = threading.Thread(target=self._beat, name="unison-heartbeat", daemon=True)
            self._thread = threading.Thread(target=self._judge, name="unison-watchdog", daemon=True)
            self._io.start()
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the threads and mark this rank done (it is never blamed after this)."""
        if self._thread is None or self._io is None:
            return
        now = time.monotonic()
        if self._judgement_due(now):
            self._await_judgement(now)  # frozen just before the end: the judgement comes first
        self._stop.set()
        for thread in (self._thread, self._io):
            thread.join(timeout=max(5.0, 3 * self.interval))
        self._thread = None
        if not self._io.is_alive():  # not stuck in a store op
            with contextlib.suppress(Exception):  # the store may be gone with a finished rank 0: nobody to tell
                self._publish(_DONE)

    # -- the threads ------------------------------------------------------------- #
    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def _woke_key(self, rank: int) -> str:
        """Where a frozen store host publishes where it froze, once, as it wakes."""
        return f"{self.prefix}/{rank}/woke"

    def _reported_key(self, rank: int) -> str:
        """Set by a rank once its stall report is printed, for a lingering store host."""
        return f"{self.prefix}/{rank}/reported"

    def _publish(self, state: str, at: tuple[tuple[int, str], Any] | None = None, key: str | None = None) -> None:
        """Publish this rank's record: where it is now, or ``at`` (a position and last collective) if given;
        under ``key`` if given (default: this rank's heartbeat key)."""
        self._beat_count += 1
        (step, phase), collective = at if at is not None else (self.where, collectives.RECORDER.describe())
        record = {"beat": self._beat_count, "step": step, "phase": phase, "state": state, **self._identity}
        record["collective"] = collective  # the last one this rank entered
        self.store.set(key or self._key(self.rank), json.dumps(record))

    def _read(self) -> dict[int, dict[str, Any]]:
        keys = [self._key(r) for r in range(self.world_size)]
        # One round trip once every rank has published (a missing key would block multi_get).
        present = keys if self.store.check(keys) else [k for k in keys if self.store.check([k])]
        if not present:
            return {}
        values = self.store.multi_get(present)
        return {int(k.rsplit("/", 1)[1]): json.loads(bytes(v).decode()) for k, v in zip(present, values)}

    def _beat(self) -> None:
        """Publish this rank's heartbeat and read everyone's, every interval.

        The first rounds run at once and then every 0.1 s until every rank's record was read: the ranks'
        pids and hosts are known from the start, so a rank (the store's host included) that freezes
        within the first interval can still be continued.
        """
        wait = 0.0
        while not self._stop.wait(wait):
            try:
                self._publish(_RUNNING)
                records = self._read()
            except Exception:  # the store did not answer: the judge counts how long
                wait = self.interval
                continue
            now = time.monotonic()
            with self._lock:
                for rank, record in records.items():
                    self._detector.observe(rank, record, now)
                self._store_ok_at = now
            wait = self.interval if len(records) == self.world_size else min(self.interval, 0.1)

    def _judge(self) -> None:
        """Every interval: was this process frozen, is the store's host, is any other rank."""
        try:
            self._judge_until_stall()
        finally:
            if not self._stall_found.is_set():
                self._alive_at = math.inf  # no judgement is coming: a training thread never waits for one

    def _judge_until_stall(self) -> None:
        assert self.stall_timeout_s is not None
        others = [r for r in range(self.world_size) if r != self.rank]
        while True:
            stopping = self._stop.wait(self.interval)
            now = time.monotonic()
            if now - self._alive_at >= self.stall_timeout_s:
                # A whole timeout since this thread last ran, wherever it was then (waiting, or judging):
                # this process was frozen (stopped, or starved), and the other ranks named it. Checked on
                # the way out too: a training thread continued first may have reached the end of the fit.
                frozen_for = now - self._alive_at
                before = self.frozen_at(now)
                if self.store_host_rank == self.rank:
                    # Its peers cannot read while the store is frozen with this process: where it froze
                    # goes to the store first, under a key of its own (the heartbeat key may still hold
                    # a beat from before the freeze, or soon one from after it), for the peer that
                    # continued it to report.
                    with contextlib.suppress(Exception):
                        self._publish(_RUNNING, at=before, key=self._woke_key(self.rank))
                    self._linger = HOST_LINGER_S
                (step, phase), collective = before
                self._stalled(
                    f"rank {self.rank} was frozen for {frozen_for:.1f} s at step {step} ({phase}), stopped or "
                    "starved of CPU; the other ranks report it as stalled; its last collective entered: "
                    + collectives.summary(collective)
                )
                return
            self._alive_at = now
            if stopping:
                return
            with self._lock:
                detector, store_ok_at = self._detector, self._store_ok_at
                if self.store_host_rank is not None and detector.done(self.store_host_rank):
                    return  # the store's host finished: nothing left to watch, and nobody to blame
                store_silent = now - store_ok_at if now - store_ok_at >= self.stall_timeout_s else None
                if store_silent is not None:
                    report = ""  # below, outside the lock: continuing the store's host waits for its heartbeat
                else:
                    stalled = detector.stalled(now, others)
                    if not stalled:
                        continue
                    self._stoppable = self._stopped_here(detector, stalled)
                    report = self._describe(detector, stalled, now, others)
            if store_silent is not None:
                self._stall_found.set()  # before the store's host is continued: this rank trains no further
                report = self._store_stalled(detector, others, store_silent)
            self._stalled(report)
            return

    def _store_stalled(self, detector: StallDetector, others: list[int], silent: float) -> str:
        """The report when the store stops answering. Its host, when it is a stopped process on this host, is
        continued first (a stopped rank 0 would otherwise stay stopped until the launcher kills it) and
        its heartbeat after waking, which says where it froze, is what the report gives."""
        host_rank = self.store_host_rank
        host = f"rank {host_rank}" if host_rank is not None else "the launcher"
        report = (
            f"{host} stalled: the control-plane store it hosts ({os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')}) has not answered for {silent:.1f} s"
        )
        if host_rank is not None:
            # Once awake (continued by this rank or another), it lingers until this rank's report is out.
            self._woke_host = True
            with self._lock:
                self._stoppable = self._stopped_here(detector, [host_rank])
            if self.continue_stopped():
                report += "; it was a stopped process on this host and was continued (SIGCONT)"
                fresh = self._fresh_record(host_rank)
                if fresh is not None:
                    with self._lock:
                        detector.observe(host_rank, fresh, time.monotonic())
        with self._lock:
            return report + "; " + self._positions(detector, others)

    def _fresh_record(self, rank: int) -> dict[str, Any] | None:
        """Where ``rank`` froze, as it publishes on waking after it was continued (under its woke key; it then
        lingers until every rank has reported, at most :data:`HOST_LINGER_S`); failing that within
        ``FRESH_WAIT_S``, its latest heartbeat newer than the last one seen; ``None`` if neither comes.

        The heartbeat key alone would race: the first answer of a woken store can be a beat published
        just before the freeze that this rank had not read yet, or one published after the wake."""
        with self._lock:
            seen = self._detector.seen.get(rank)
            old = seen.beat if seen is not None else None
        deadline = time.monotonic() + FRESH_WAIT_S
        store = self.store
        if self._own_store:
            # A new connection: the heartbeat thread's may have timed out mid-request while the store was
            # frozen, and a c10d client that timed out can read the late answer as the next one's.
            with contextlib.suppress(Exception):
                store = store_client(FRESH_WAIT_S)
        newer: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # the store may still be waking, or already gone
                if store.check([self._woke_key(rank)]):
                    return json.loads(bytes(store.get(self._woke_key(rank))).decode())
                record = json.loads(bytes(store.get(self._key(rank))).decode())
                if record.get("beat") != old:
                    newer = record
            time.sleep(0.02)
        return newer

    def _positions(self, detector: StallDetector, others: list[int]) -> str:
        parts = [self._here()]
        for r in others:
            seen = r in detector.seen
            parts.append(f"rank {r}'s last heartbeat at {detector.where(r)}" if seen else f"rank {r}: none seen")
        return "; ".join(parts) + "; " + self._last_collectives(detector, others)

    def _here(self) -> str:
        step, phase = self.where
        return f"rank {self.rank} (this one) at step {step} ({phase})"

    def _last_collectives(self, detector: StallDetector, others: list[int]) -> str:
        """Where each rank is in the collective schedule: this rank's own record, the others' last heartbeats'."""
        mine = collectives.summary(collectives.RECORDER.describe())
        parts = [f"rank {self.rank} (this one): {mine}"] + [f"rank {r}: {detector.collective(r)}" for r in others]
        return "last collective entered: " + "; ".join(parts)

    def _describe(self, detector: StallDetector, stalled: list[int], now: float, others: list[int]) -> str:
        names = []
        for r in stalled:
            rec = detector.seen[r].record if r in detector.seen else {}
            at = f" (pid {rec['pid']} on {rec['host']})" if rec else ""
            silent = detector.silent_for(r, now)
            last = f"its last one at {detector.where(r)}" if rec else "none seen since the watchdog started"
            names.append(f"rank {r}{at}: no heartbeat for {silent:.1f} s, {last}")
        live = [r for r in others if r not in stalled]
        where = [self._here()]
        where += [f"rank {r} at {detector.where(r)}" for r in live]
        return f"stalled {', '.join(names)}; live: {'; '.join(where)}; " + self._last_collectives(detector, others)

    def _stopped_here(self, detector: StallDetector, stalled: list[int]) -> list[tuple[int, str | None]]:
        """(pid, start time) of the stalled ranks that run on this host, as their heartbeats said."""
        found: list[tuple[int, str | None]] = []
        for r in stalled:
            rec = detector.seen[r].record if r in detector.seen else {}
            if rec.get("host") == self._identity["host"] and isinstance(rec.get("pid"), int):
                found.append((rec["pid"], rec.get("start")))
        return found

    def continue_stopped(self) -> list[int]:
        """SIGCONT each stalled rank that is a stopped process (state ``T``) on this host; the pids continued.

        Frozen, it would ignore the launcher's SIGTERM until the launcher's
        grace period ends in SIGKILL; continued, it reports its own freeze and
        exits. The start time guards against a reused pid.
        """
        continued = []
        for pid, start in self._stoppable:
            if _start_time(pid) == start and _proc_state(pid) in ("T", "t"):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGCONT)
                    continued.append(pid)
        return continued

    def _stalled(self, report: str) -> None:
        self.report = report
        self._stall_found.set()
        try:
            self.on_stall(report)
        finally:
            self._stall_handled.set()

    # -- the default reaction ---------------------------------------------------- #
    def exit_stalled(self, report: str) -> None:
        """Print the report line and this rank's Python stacks, dump the NCCL trace, exit with code 3."""
        line = io.StringIO()
        messages.say(
            f"unison: rank {self.rank}: {report}. Python stacks of rank {self.rank} follow; exiting with code "
            f"{EXIT_STALLED}",
            level="error",
            file=line,
        )
        write_whole(line.getvalue().encode() + python_stacks())
        trace = dump_nccl_trace(self.rank)
        if trace:
            messages.say(f"unison: rank {self.rank}: NCCL flight recorder written to {trace}", level="error")
        from unison.launch.lifecycle import record_error

        record_error(StallError(report))
        self.continue_stopped()
        if self._linger:  # the store's host: its peers read where it froze, and report, before the store goes
            self._await_reports(self._linger)
        else:
            self._acknowledge()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STALLED)

    def _acknowledge(self) -> None:
        """Tell a lingering store host that this rank's report is out (it may exit now)."""
        if not self._woke_host:
            return  # nobody waits for it: no store round trip
        with contextlib.suppress(Exception):  # the store may be gone already
            self.store.set(self._reported_key(self.rank), "1")

    def _await_reports(self, most: float) -> None:
        """The woken store host: wait until every other rank has reported, or ``most`` seconds."""
        keys = [self._reported_key(r) for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + most
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if self.store.check(keys):
                    return
            time.sleep(0.05)


def python_stacks() -> bytes:
    """Every thread's Python stack, as :mod:`faulthandler` writes it (it needs a file of the OS's)."""
    try:
        with tempfile.TemporaryFile() as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            return f.read()
    except OSError as exc:  # no temporary file: the report goes out without them
        return f"(Python stacks not available: {exc})\n".encode()


def write_whole(data: bytes) -> None:
    """Write ``data`` to stderr in one system call where it can: the ranks of a job share one stderr, and a
    report printed in pieces (faulthandler writes a stack frame in several) interleaves with a peer's."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stderr without a file descriptor (captured)
        sys.stderr.write(data.decode(errors="replace"))
        sys.stderr.flush()
        return
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def dump_nccl_trace(rank: int) -> str | None:
    """Write torch's NCCL flight recorder (CUDA builds) to ``TORCH_FR_DUMP_TEMP_FILE`` + rank; its path or ``None``."""
    import torch

    from unison._upstream.torch import nccl_flight_recorder_dump

    base = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    if not base or not torch.cuda.is_available():
        return None
    path = f"{base}{rank}"
    try:
        data = nccl_flight_recorder_dump()
        if data is None:  # a build without NCCL
            return None
        with open(path, "wb") as f:
            f.write(data)
    except Exception as exc:  # a failed dump must not hide the stall report
        messages.say(f"unison: rank {rank}: NCCL flight recorder dump failed: {exc}", level="error")
        return None
    return path


_fits = 0


def start_watchdog(stall_timeout_s: float | None, rank: int, world_size: int) -> Watchdog:
    """The watchdog of one fit, started when the world has several ranks (and a timeout); inert otherwise.

    Keys live under ``unison/watchdog/<attempt>/<fit>``: torchrun's restart
    count and this process's count of fits, the same on every rank, so a
    restarted world or a second ``fit`` never reads a previous one's beats.
    The store is the rendezvous store at ``MASTER_ADDR:MASTER_PORT``; its host
    is rank 0, or torchrun's agent when it shares its own store with the
    workers (``TORCHELASTIC_USE_AGENT_STORE``).
    """
    global _fits
    _fits += 1
    if stall_timeout_s is None or world_size < 2 or "MASTER_ADDR" not in os.environ:
        return Watchdog(None, rank, world_size)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return Watchdog(
        stall_timeout_s,
        rank,
        world_size,
        prefix=f"unison/watchdog/{attempt}/{_fits}",
        store_host_rank=None if agent_store else 0,
    ).start()
