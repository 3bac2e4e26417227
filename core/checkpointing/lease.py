"""One writer per checkpoint directory: an exclusive, heartbeated lease.

A run that writes checkpoints holds a lease on the directory its
:class:`~unison.checkpointing.checkpointer.Checkpointer` writes to (one resolved path or
URL). The lease is one small JSON record, ``ROOT/.unison-lease``, naming the
owner (a token unique to the job), the run, the host, the pid, when it started
and its latest heartbeat. While the run lives, a daemon thread on the holding
process rewrites the heartbeat every ``ttl / 4`` seconds.

How "exclusive" is made atomic (the storage seam's conditional writes,
:meth:`unison.checkpointing.storage.LocalStorage.write_if`):

* local or shared file systems: every read-compare-write of the record runs
  under ``flock`` on a sibling guard file (``.unison-lease.guard``), and the
  record is replaced with a rename, so readers see a whole record or none;
* object storage: a conditional PUT. Creating is ``If-None-Match: "*"``,
  taking over or renewing is ``If-Match: <ETag read>`` (SeaweedFS and AWS S3
  both honour them); the server refuses the loser of any race with 412.

When a lease counts as stale, and may be taken over (the taker says so in a
warning naming the old owner and why):

* its holder ran on this host and its pid no longer exists (a SIGKILLed or
  crashed job: taken over at once, e.g. by ``--resume auto`` after a crash);
* its heartbeat is older than its ``ttl`` (``UNISON_LEASE_TTL`` seconds,
  default 60): a holder on another host that died, or lost its storage;
* it was released (a finished run deletes it);
* its record cannot be judged (:meth:`Holder.parse`): not JSON, truncated,
  empty, not an object, a field missing or of the wrong type (``pid`` null or
  ``"1"``, ``heartbeat`` ``"now"``), a time that is NaN or infinite, a
  heartbeat or start more than :data:`CLOCK_SKEW_S` in the future, a ttl
  not above 0 or above :data:`MAX_TTL_S`. unison replaces its record in one
  rename under a lock, so no live unison job leaves such a record; a lock that
  could never expire (a heartbeat in the year 2255, a ttl of 1e308) is not a
  lock. The warning names what was wrong with the record.

A holder on *this* host whose pid is alive is refused at once, whatever it
runs (``unison train --resume auto`` while the same run still trains here is
refused in seconds, naming its pid). A run that resumes its own run
(``ckpt_path="auto"``/``"last"``, or a checkpoint inside the directory, as
:class:`~unison.checkpointing.resume.ResumeRequest` reads it, on a directory
whose newest commit belongs to the run named in the lease; the checkpointer
passes ``own_run``) waits up to ``ttl`` for a holder of that run on *another*
host to stop heartbeating before it gives up: that is the run's own crashed
attempt taking its lease back, and only the heartbeat can tell. Any other live
holder is refused at once with a :class:`~unison.errors.ConfigurationError`
(exit code 2) that names it.

Where it is taken, and why there. The trainer checks the lease twice:

1. before any process group, every rank reads the record (no writes): a
   directory held by a live job is refused on every rank alike, so the common
   case (a second job started while the first runs) fails in seconds without
   a rendezvous;
2. right after the process group is up, before the strategy's setup, any
   resume and the first step, rank 0 *takes* the lease and broadcasts the
   outcome; every rank then raises the same error or continues. This is
   where two jobs started together are told apart, atomically.

Taking it before the process group would be earlier but not clean: a rank 0
refused there exits while the job's other ranks sit in the rendezvous until
its timeout (minutes). After the rendezvous one broadcast reaches them all.

A holder that loses its lease (its heartbeat could not be written for longer
than ``ttl`` and another job took over) is told at its next commit, which is
refused (:class:`LeaseLostError`) instead of writing beside the new owner.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
import uuid
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from unison.checkpointing.storage import LocalStorage
from unison.errors import ConfigurationError, UnisonError

#: The lease record's name under the checkpoint root.
LEASE = ".unison-lease"
#: Seconds without a heartbeat after which a lease is stale (``UNISON_LEASE_TTL`` overrides).
DEFAULT_TTL_S = 60.0
#: The largest ttl a record may name (one day); above it the record is invalid, never a lock for ever.
MAX_TTL_S = 86_400.0
#: How far in the future a heartbeat (or start) may lie: clocks of hosts sharing storage differ a little.
CLOCK_SKEW_S = 300.0


class LeaseLostError(UnisonError):
    """This run's lease on its checkpoint directory was taken over by another job; nothing more is committed."""


class LeaseWarning(UserWarning):
    """A stale lease was taken over."""


def lease_ttl() -> float:
    """``UNISON_LEASE_TTL`` (seconds, above 0 and at most :data:`MAX_TTL_S`), else :data:`DEFAULT_TTL_S`."""
    text = os.environ.get("UNISON_LEASE_TTL")
    if text is None:
        return DEFAULT_TTL_S
    try:
        ttl = float(text)
    except ValueError:
        ttl = math.nan
    if not 0 < ttl <= MAX_TTL_S:  # (NaN fails too)
        raise ConfigurationError(
            "UNISON_LEASE_TTL", f"got {text!r}", f"set seconds above 0 and at most {MAX_TTL_S:.0f}, or unset it"
        )
    return ttl


#: The fields of a record and their types (``bool`` is refused where a number is asked: JSON ``true`` is no pid).
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "owner": str,
    "run": str,
    "host": str,
    "pid": int,
    "started": (int, float),
    "heartbeat": (int, float),
    "ttl": (int, float),
}


@dataclass(frozen=True)
class Holder:
    """The contents of a lease record."""

    owner: str
    """Token unique to the job holding the lease."""
    run: str
    """The run it writes checkpoints for (``Manifest.run``)."""
    host: str
    pid: int
    started: float
    """Unix time the lease was taken."""
    heartbeat: float
    """Unix time of the latest heartbeat."""
    ttl: float
    """Seconds without a heartbeat after which the lease is stale."""

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Holder | None:
        """The record in ``data``, or ``None`` when it cannot be judged (:meth:`parse` says why)."""
        return cls.parse(data)[0]

    @classmethod
    def parse(cls, data: bytes, now: float | None = None) -> tuple[Holder | None, str | None]:
        """``(holder, None)`` for a record that can be judged, ``(None, what is wrong)`` otherwise.

        Every field is checked for its type and range before any is used, so
        a record written by hand, by another program, or cut short never
        raises: unknown extra fields are ignored (a newer version's), missing
        or mistyped ones, NaN or infinite times, times more than
        :data:`CLOCK_SKEW_S` ahead and ttls outside ``(0, MAX_TTL_S]`` make
        the record invalid.
        """
        now = time.time() if now is None else now
        if not data.strip():
            return None, "it is empty"
        try:
            record = json.loads(data)
        except (ValueError, RecursionError):
            return None, f"it is not JSON ({len(data)} bytes, truncated or garbled)"
        if not isinstance(record, dict):
            return None, f"it is JSON {json.dumps(record)[:40]}, not an object"
        for name, kind in _FIELDS.items():
            value = record.get(name)
            if name not in record or isinstance(value, bool) or not isinstance(value, kind):
                return None, f"its {name} is {json.dumps(value)[:40] if name in record else 'missing'}"
        holder = cls(**{name: record[name] for name in _FIELDS})
        return (None, problem) if (problem := holder.problem(now)) else (holder, None)

    def problem(self, now: float) -> str | None:
        """What makes the values of a well-typed record impossible, or ``None``."""
        if not 0 < self.pid < 1 << 31:  # (a pid_t; os.kill would overflow on more)
            return f"its pid is {self.pid}"
        for name in ("started", "heartbeat", "ttl"):
            if not math.isfinite(getattr(self, name)):
                return f"its {name} is {getattr(self, name)}"
        if not 0 < self.ttl <= MAX_TTL_S:
            return f"its ttl of {self.ttl:g} s is not above 0 and at most {MAX_TTL_S:.0f} s"
        for name in ("heartbeat", "started"):
            if getattr(self, name) > now + CLOCK_SKEW_S:
                ahead = getattr(self, name) - now
                return f"its {name} lies {ahead:.0f} s in the future (clocks may differ by {CLOCK_SKEW_S:.0f} s)"
        return None

    def describe(self, now: float | None = None) -> str:
        age = max(0.0, (now or time.time()) - self.heartbeat)  # (a clock a little ahead: "0 s ago")
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"run {self.run} (pid {self.pid} on host {self.host}, started {started}, last heartbeat {age:.0f} s ago)"

    @property
    def on_this_host(self) -> bool:
        """Whether the holder ran on this host (its pid then tells whether it lives)."""
        return self.host == socket.gethostname()

    def stale(self, now: float) -> str | None:
        """Why this lease may be taken over, or ``None`` while its holder may be alive."""
        if self.on_this_host and not _pid_alive(self.pid):
            return f"its process {self.pid} on this host is gone"
        if now - self.heartbeat > self.ttl:
            return f"no heartbeat for {now - self.heartbeat:.0f} s (ttl {self.ttl:.0f} s)"
        return None


class Lease:
    """The lease on one checkpoint root, through the checkpointer's storage seam."""

    def __init__(self, storage: LocalStorage, root: Path, ttl: float | None = None) -> None:
        self.storage, self.root = storage, root
        self.path = root / LEASE
        self.ttl = lease_ttl() if ttl is None else ttl
        self.owner = uuid.uuid4().hex
        self._version: str | None = None  # the record's version as we last wrote it; None: not held
        self._record: Holder | None = None
        self._lost: Holder | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- reading ------------------------------------------------------------ #
    def holder(self) -> tuple[Holder | None, str] | None:
        """``(holder, version)`` of the current record (holder ``None`` if invalid), ``None`` when free."""
        found = self.read()
        return None if found is None else (found[0], found[1])

    def read(self) -> tuple[Holder | None, str, str | None] | None:
        """``(holder, version, what is wrong)`` of the current record, ``None`` when there is none.

        ``holder`` is ``None`` exactly when the record cannot be judged; the
        third item then says why (:meth:`Holder.parse`).
        """
        found = self.storage.read_versioned(self.path)
        if found is None:
            return None
        data, version = found
        holder, problem = Holder.parse(data)
        return holder, version, problem

    def refuse_if_held(self, own_run: str | None = None) -> bool:
        """Refuse (ConfigurationError) when a live job holds the lease; ``True`` when no live job holds it.

        ``own_run``: the run this job resumes; a holder of that run whose
        liveness cannot be judged yet is not refused here (:meth:`acquire`
        waits it out), but then the directory is not free either. Read-only:
        safe on every rank before any process group.
        """
        current = self.holder()
        if current is None:
            return True
        holder, _ = current
        if holder is None or holder.owner == self.owner or holder.stale(time.time()) is not None:
            return True
        if own_run is not None and holder.run == own_run and not holder.on_this_host:
            return False
        raise self._refusal(holder)

    # -- taking and giving back --------------------------------------------- #
    def acquire(self, run: str, *, own_run: bool = False) -> None:
        """Take the lease for ``run`` (rank 0 only); a live other holder -> ConfigurationError.

        ``own_run``: this run resumes ``run``; a holder of the same run whose
        liveness cannot be judged (another host) is waited out for up to
        ``ttl`` seconds instead of refused. A holder on this host with a live
        pid is refused at once: its pid says it runs. A record that cannot be
        judged is taken over with a :class:`LeaseWarning` naming what was
        wrong with it.
        """
        deadline = time.monotonic() + self.ttl + 5.0
        while True:
            now = time.time()
            mine = Holder(self.owner, run, socket.gethostname(), os.getpid(), now, now, self.ttl)
            current = self.read()
            if current is None:
                version = self.storage.write_if(self.path, mine.to_bytes(), None)
                if version is not None:
                    return self._hold(mine, version)
                continue  # another job created it first: judge that one
            holder, version, invalid = current
            reason = f"its record is invalid: {invalid}" if holder is None else holder.stale(now)
            if reason is not None:
                new_version = self.storage.write_if(self.path, mine.to_bytes(), version)
                if new_version is None:
                    continue  # changed under us: judge the new record
                whose = f"of {holder.describe(now)}" if holder is not None else f"({self.path})"
                warnings.warn(f"took over the stale lease on {self.root} {whose}: {reason}", LeaseWarning, stacklevel=2)
                return self._hold(mine, new_version)
            assert holder is not None
            if own_run and holder.run == run and not holder.on_this_host and time.monotonic() < deadline:
                time.sleep(1.0)  # our own run's earlier attempt, maybe dead on another host: wait for its ttl
                continue
            raise self._refusal(holder)

    def release(self) -> None:
        """Stop the heartbeat and delete the record, if it is still ours (a finished or failed run)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        with self._lock:
            version, self._version = self._version, None
        if version is not None:
            with contextlib.suppress(Exception):  # a storage outage: the record goes stale on its own
                self.storage.delete_if(self.path, version)

    def check(self) -> None:
        """Raise :class:`LeaseLostError` when another job took this run's lease over (called before commits)."""
        if self._lost is not None:
            raise LeaseLostError(
                f"the lease on {self.root} was taken over by {self._lost.describe()} while this run held it "
                "(its heartbeat could not be written for longer than the ttl); not committing beside it"
            )

    @property
    def held(self) -> bool:
        return self._version is not None

    # -- internals ---------------------------------------------------------- #
    def _hold(self, record: Holder, version: str) -> None:
        self._record, self._version, self._lost = record, version, None
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="unison-lease-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            with self._lock:
                if self._version is None or self._record is None:
                    return
                record = Holder(**{**asdict(self._record), "heartbeat": time.time()})
                try:
                    version = self.storage.write_if(self.path, record.to_bytes(), self._version)
                except Exception:  # an outage: try again at the next beat; the ttl covers a few misses
                    continue
                if version is None:  # the record changed: someone judged us stale and took over
                    current = self.holder()
                    self._lost = current[0] if current and current[0] else self._record
                    self._version = None
                    return
                self._record, self._version = record, version

    def _refusal(self, holder: Holder) -> ConfigurationError:
        if holder.on_this_host:  # its pid is alive here: it is running (or it is another process with that pid)
            fix = (
                f"let that job finish or stop it (pid {holder.pid} on this host), or give this run its own "
                "checkpoint_dir; a lease whose process has ended is taken over at once"
            )
        else:
            fix = (
                "let that job finish, or give this run its own checkpoint_dir; if that job is dead on another host, "
                f"its lease expires {holder.ttl:.0f} s after its last heartbeat and is then taken over"
            )
        return ConfigurationError(
            "checkpoint_dir",
            f"{self.root} is being written by another job: {holder.describe()}; "
            "a checkpoint directory has one writer at a time",
            fix,
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:  # a killed process its parent has not reaped yet is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
