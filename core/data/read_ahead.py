"""How a :class:`~unison.data.shards.ShardedDataset` reads: coalesced byte ranges, read ahead along the plan,
and read counters shared by a loader's processes.

Object storage answers a range request in milliseconds whatever its size up to about a megabyte (measured
on a SeaweedFS server on loopback: 5 ms for 635 bytes, 6 ms for 100 kB, 9 ms for 1 MB, and 1.2-2 ms of
client CPU per request in s3fs), while a sample of a few hundred bytes decodes in tens of microseconds. So
what bounds samples/s is requests per sample and waiting for them, not bytes. Two things follow:

* :func:`coalesce` merges the ranges of one read into fewer spans, reading the bytes between two ranges
  along when that is cheaper than another request, within a waste budget (:data:`WASTE`: bytes read and
  not used, at most 10 % of the bytes used), so read amplification stays at most 1.1 of the samples' bytes.
* :class:`ReadAhead` reads this process's *next* micro-batches before the loader asks for them. The
  trainer's plan is known in advance (:meth:`ShardedDataset.follow_plan`), so the samples a loader worker
  will be asked for are known too: worker ``w`` of ``W`` gets micro-batches ``w, w + W, ...`` (the
  ``DataLoader`` hands index lists to its workers in turn). Groups of them, up to half the read-ahead budget
  in bytes each, are read in background threads as one coalesced ``cat_ranges`` call (concurrent requests
  in s3fs); the larger the group, the more of its ranges are neighbours and merge.

A loader that asks for something else than the plan's next micro-batch (another sampler, a validation pass
over the same object) is served by on-demand reads and leaves the read-ahead where it was.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import os
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["WASTE", "ReadAhead", "ReadStats", "coalesce"]

#: Bytes read between the ranges of one read, at most this fraction of the bytes the ranges hold.
WASTE = 0.1

#: Loader processes whose counts :class:`ReadStats` keeps apart (this process and 127 workers).
SLOTS = 128


class ReadStats:
    """What a dataset read, summed over the process that built it and its ``DataLoader`` workers.

    Each process adds to its own row of a tensor in shared memory (row 0: the process that built the
    dataset; row ``1 + id``: loader worker ``id``), so the counts survive the workers and the main process
    reads their sum: the trainer logs ``retries`` as ``data/retries``. A copy made by plain pickling (not
    a loader worker) counts apart. ``bytes`` counts range reads and whole compressed shards; Parquet row
    groups are read by pyarrow and only counted in ``requests``.
    """

    FIELDS = ("bytes", "requests", "retries")

    def __init__(self) -> None:
        self._counts = torch.zeros(SLOTS, len(self.FIELDS), dtype=torch.int64).share_memory_()
        self._lock, self._pid = threading.Lock(), os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {"_counts": self._counts}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._counts, self._lock, self._pid = state["_counts"], threading.Lock(), os.getpid()

    def add(self, bytes: int = 0, requests: int = 0, retries: int = 0) -> None:
        """Add to this process's counts (thread-safe: read-ahead threads add too)."""
        if self._pid != os.getpid():  # a fork: the lock may have been held by a thread that is not here
            self._lock, self._pid = threading.Lock(), os.getpid()
        info = torch.utils.data.get_worker_info()
        row = 0 if info is None else 1 + info.id % (SLOTS - 1)
        with self._lock:
            self._counts[row].add_(torch.tensor([bytes, requests, retries]))

    def _total(self, field: str) -> int:
        return int(self._counts[:, self.FIELDS.index(field)].sum())

    @property
    def bytes(self) -> int:
        return self._total("bytes")

    @property
    def requests(self) -> int:
        return self._total("requests")

    @property
    def retries(self) -> int:
        return self._total("retries")

    def __repr__(self) -> str:
        return f"ReadStats(bytes={self.bytes}, requests={self.requests}, retries={self.retries})"


#: A record to read: ``(key, file, start, end)``.
Record = tuple[Hashable, Hashable, int, int]
#: A request: ``(file, start, end, records it holds)``.
Span = tuple[Hashable, int, int, list[Record]]


def coalesce(required: Iterable[Record], optional: Iterable[Record] = (), waste: float = WASTE) -> list[Span]:
    """The requests that read every ``required`` record, neighbours of a file joined into one request.

    Joining two neighbours reads the gap between them along. Gaps are joined cheapest first while the
    bytes read and not used stay within ``waste`` times the required bytes; a gap's cost is its bytes
    less those of the ``optional`` records it holds (records wanted soon: they are returned too, not
    wasted). Records of a file must not overlap; a key repeated is read once.
    """
    req = sorted(dict((r[0], r) for r in required).values(), key=lambda r: (str(r[1]), r[2]))
    if not req:
        return []
    # Optional records per file: sorted starts and prefix sums of their sizes, to price each gap.
    by_file: dict[Hashable, list[Record]] = collections.defaultdict(list)
    wanted = {r[0] for r in req}
    for r in optional:
        if r[0] not in wanted:
            by_file[r[1]].append(r)
    starts, sums = {}, {}
    for file, records in by_file.items():
        records.sort(key=lambda r: r[2])
        starts[file] = [r[2] for r in records]
        sums[file] = list(itertools.accumulate((r[3] - r[2] for r in records), initial=0))

    def inside(file: Hashable, lo: int, hi: int) -> tuple[int, int]:
        """Optional records of ``file`` lying in ``[lo, hi)``: their index range."""
        if file not in starts:
            return 0, 0
        return bisect.bisect_left(starts[file], lo), bisect.bisect_left(starts[file], hi)

    costs = []
    for k in range(len(req) - 1):
        (_, file, _, end), (_, following, start, _) = req[k], req[k + 1]
        if file == following and start >= end:
            first, last = inside(file, end, start)
            free = sums[file][last] - sums[file][first] if last > first else 0
            costs.append((start - end - free, k))
    budget, joined = waste * sum(r[3] - r[2] for r in req), set()
    for cost, k in sorted(costs):
        if cost > budget:
            break
        budget -= max(cost, 0)
        joined.add(k)
    spans: list[Span] = []
    first = 0
    for k in range(len(req)):
        if k in joined:
            continue
        file, lo, hi = req[first][1], req[first][2], req[k][3]
        a, b = inside(file, lo, hi)
        spans.append((file, lo, hi, sorted(req[first : k + 1] + by_file[file][a:b], key=lambda r: r[2])))
        first = k + 1
    return spans


class _Held:
    """A record read (or being read) ahead and not yet taken."""

    __slots__ = ("future", "size", "uses")

    def __init__(self, future: Future, size: int, uses: int) -> None:
        #: ``uses``: micro-batches read for that take it (a record read along waits for its own).
        self.future, self.size, self.uses = future, size, uses


class _Batch:
    """A micro-batch of the plan: its indices and its range-read records."""

    __slots__ = ("indices", "records", "size")

    def __init__(self, indices: list[int], records: Sequence[Record]) -> None:
        self.indices, self.records = indices, records
        self.size = sum(r[3] - r[2] for r in records)


class ReadAhead:
    """This process's next micro-batches by the plan, read in the background.

    Each read takes the next micro-batches until their records not yet held reach ``budget / 4`` bytes,
    and looks ``budget / 4`` bytes further along the plan: records wanted soon that lie between two of the
    read's records are read along instead of wasting the gap (:func:`coalesce`), which is what lets a
    windowed order read whole stretches of a shard. Reads start while less than ``budget / 2`` bytes are
    held, so about ``budget`` bytes at most are held per process.

    Args:
        batches: every micro-batch the loader will ask for, in order (all workers together).
        budget: bytes read ahead and not yet taken (about).
        records: ``indices -> [(key, file, start, end)]``: the range-read records of a micro-batch.
        read: ``spans -> {key: bytes}`` (:func:`coalesce`'s spans), retried and counted; run in the
            background threads.
    """

    def __init__(
        self,
        batches: Iterable[Sequence[int]],
        budget: int,
        records: Callable[[Sequence[int]], Sequence[Record]],
        read: Callable[[list[Span]], dict[Hashable, bytes]],
    ) -> None:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        self._source = itertools.islice(iter(batches), worker, None, workers)
        self._budget, self._records, self._read = budget, records, read
        #: Micro-batches whose records are read or being read, in order; then those only looked at.
        self._upcoming: collections.deque[_Batch] = collections.deque()
        self._queued: collections.deque[_Batch] = collections.deque()
        self._held: dict[Hashable, _Held] = {}
        self._in_flight = 0
        # Two threads: the next read runs while the current one may still be waited on.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="unison-read-ahead")

    def take(self, indices: Sequence[int]) -> dict[Hashable, bytes] | None:
        """The records of micro-batch ``indices`` held for it (some may be missing: read them) if it is
        one the plan says comes next, else ``None``."""
        wanted = [int(i) for i in indices]
        if not self._upcoming:  # nothing read yet (or all taken): start only for the plan's next one
            if not self._queued:
                pulled = self._pull()
                if pulled is None:
                    return None
                self._queued.append(pulled)
            if self._queued[0].indices != wanted:
                return None
        self._fill()
        position = next((k for k, batch in enumerate(self._upcoming) if batch.indices == wanted), None)
        if position is None:
            return None
        got: dict[Hashable, bytes] = {}
        for skipped in range(position, -1, -1):  # micro-batches skipped over are dropped with this one
            for key, *_ in self._upcoming.popleft().records:
                held = self._held.get(key)
                if held is None:
                    continue
                if not skipped:
                    got[key] = held.future.result()[key]
                held.uses -= 1
                if held.uses <= 0:
                    del self._held[key]
                    self._in_flight -= held.size
        self._fill()
        return got

    def _pull(self) -> _Batch | None:
        """The plan's next micro-batch of this process, with its records (looked up once)."""
        batch = next(self._source, None)
        return None if batch is None else _Batch([int(i) for i in batch], self._records(batch))

    def _fill(self) -> None:
        """Start reads until ``budget / 2`` bytes are held or the plan is exhausted."""
        target = max(1, self._budget // 4)
        while self._in_flight < self._budget // 2 or not self._upcoming:
            required: dict[Hashable, Record] = {}
            uses: collections.Counter[Hashable] = collections.Counter()
            size, pulled = 0, 0
            while size < target:
                batch = self._queued.popleft() if self._queued else self._pull()
                if batch is None:
                    break
                self._upcoming.append(batch)
                for record in batch.records:
                    pulled += 1
                    if record[0] in self._held:  # read before (along with another read): one more use
                        self._held[record[0]].uses += 1
                        continue
                    uses[record[0]] += 1
                    if record[0] not in required:
                        required[record[0]] = record
                        size += record[3] - record[2]
            if not required:
                if pulled:  # their records are held already (read along before): go on
                    continue
                return  # the plan is exhausted, or its micro-batches hold no range-read records
            optional: dict[Hashable, Record] = {}
            for batch in self._lookahead(target):
                for record in batch.records:
                    if record[0] not in required and record[0] not in self._held:
                        optional[record[0]] = record
            spans = coalesce(required.values(), optional.values())
            future = self._pool.submit(self._read, spans)
            for *_, members in spans:
                for key, _, start, end in members:
                    self._held[key] = _Held(future, end - start, uses[key])
                    self._in_flight += end - start

    def _lookahead(self, target: int) -> list[_Batch]:
        """The micro-batches after those read, up to ``target`` bytes of records (pulled into the queue)."""
        seen, size = [], 0
        for batch in self._queued:
            seen.append(batch)
            size += batch.size
            if size >= target:
                return seen
        while size < target:
            pulled = self._pull()
            if pulled is None:
                break
            self._queued.append(pulled)
            seen.append(pulled)
            size += pulled.size
        return seen
