"""A map-style dataset over shard files on local disk or in object storage, read by byte range.

:class:`ShardedDataset` takes shard URLs or globs (``"s3://bucket/train/*.jsonl"``, any fsspec URL,
local paths), indexes each shard once (:mod:`unison.data.shard_index`: sample count and byte ranges,
cached keyed by the object's ETag or mtime and size) and maps global sample *i* to (shard, position).

Why map-style: the trainer's plan (:mod:`unison.data.plan`) already decides which global samples form
step *k* and which data-parallel rank takes which, by seed and epoch and never by rank. Being map-style,
this source is handed exactly the samples of this rank, so it reads only their bytes:

* The ``DataLoader`` calls :meth:`ShardedDataset.__getitems__` with one micro-batch slice; its records'
  byte ranges go out in one ``cat_ranges`` call (concurrent in s3fs), coalesced and read ahead along the
  trainer's plan (:mod:`unison.data.read_ahead`, :meth:`ShardedDataset.follow_plan`). JSON-lines and tar
  shards are thus read at about the bytes of the samples taken: at any world size, the ranks together
  read each sample once per pass (at most 1.1x).
* Parquet is read by row group, the smallest unit it has; the last :attr:`cache_blocks` row groups
  read by this process are kept. A row group holding samples of several ranks is read by each.
* Compressed JSON lines have no random access: a shard is read and decompressed whole when first
  touched, and the last :attr:`cache_blocks` such shards are kept.
* Resume seeks: the plan recomputes step *k*'s indices, so nothing before it is read again.

Shuffling: by default the trainer's global permutation (by seed and epoch). With ``shuffle_window=W``
the source gives the epoch's order itself (:meth:`epoch_order`): shards in a seeded order, samples
permuted within consecutive windows of *W* samples (or runs of ``shuffle_chunk`` consecutive samples
permuted, which cuts the number of range requests by that factor). Fewer shards are open at a time
and Parquet row groups and compressed shards are read about once per pass instead of once per sample
taken, at the price of randomness (a sample only meets samples of its window in a batch, and its
run's neighbours always).

Failures: a missing or unreadable shard, or a record that does not parse, is a :class:`ShardError`
naming the shard URL, the position in the shard and the global sample index. A shard whose version
changed since its index was built is re-indexed (``on_change="reindex"``, with a warning) or refused
(``on_change="error"``) when the dataset is built, and refused when a process first reads it: samples of
two versions are never mixed; a shard rewritten *while* a run reads it is refused at its first record
whose bytes are not the CRC-32 its index holds (every record is checked as it is read, read ahead or
not; Parquet row groups by the shard's version after each read). Transient object-storage errors are
retried with the checkpoints' bounded backoff (``UNISON_STORAGE_RETRY_S``) and counted in
:attr:`ReadStats.retries` (summed over the loader's workers; the trainer logs it as ``data/retries``).
"""

from __future__ import annotations

import bisect
import collections
import functools
import json
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from unison.data.plan import window_order
from unison.data.read_ahead import ReadAhead, ReadStats, coalesce
from unison.data.shard_index import (
    IndexCache,
    ShardError,
    ShardIndex,
    build_index,
    decompressor,
    shard_format,
    version_of,
)

__all__ = ["ReadStats", "ShardError", "ShardedDataset"]


#: File-system clients a loader worker inherited from its parent (see :meth:`ShardedDataset.filesystem`).
_INHERITED: list[Any] = []


#: Formats read by record byte range (the others by block: Parquet row groups, compressed shards).
_RANGED = ("jsonl", "tar")


def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


class ShardedDataset(Dataset):
    """Samples of shard files (JSON lines, WebDataset tar, Parquet), each read by byte range.

    Args:
        urls: one URL, path or glob, or a list of them; shards are taken in the given order, each glob's
            matches sorted by name.
        decode: ``sample -> anything`` (e.g. tensors), run in the loader workers. A JSON-lines sample is
            the parsed JSON value, a Parquet sample a ``{column: value}`` dict, a tar sample a
            ``{extension: bytes}`` dict. ``None``: the sample as read.
        storage_options: keyword arguments of the fsspec file system (s3fs's ``endpoint_url``, ``key``...);
            by default s3fs reads ``AWS_*`` variables, as checkpoints do.
        index_dir: where shard indexes are cached (a directory or an fsspec URL); default
            ``$UNISON_DATA_CACHE`` or ``~/.cache/unison/shard-index``.
        on_change: ``"reindex"`` or ``"error"`` for a shard whose ETag (or mtime and size) differs from its
            cached index.
        shuffle_window: ``None`` for the trainer's global permutation, or the window size of the
            shard-order + window shuffle (see the module doc).
        shuffle_chunk: with ``shuffle_window``, runs of this many consecutive samples of a shard stay
            together and the runs are permuted within each window: a rank's slice is then read in
            about ``slice / shuffle_chunk`` ranges instead of one per sample.
        cache_blocks: Parquet row groups or decompressed shards kept per process.
        read_ahead: bytes of JSON-lines and tar records each process reads ahead of the loader once the
            trainer has given the plan (:meth:`follow_plan`); 0 reads each micro-batch when asked.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        decode: Callable[[Any], Any] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        index_dir: str | None = None,
        on_change: str = "reindex",
        shuffle_window: int | None = None,
        shuffle_chunk: int = 1,
        cache_blocks: int = 4,
        read_ahead: int = 32 << 20,
    ) -> None:
        if on_change not in ("reindex", "error"):
            raise ValueError(f"on_change must be 'reindex' or 'error', not {on_change!r}")
        if shuffle_window is not None and shuffle_window < 1:
            raise ValueError(f"shuffle_window must be a positive number of samples, not {shuffle_window}")
        if shuffle_chunk < 1:
            raise ValueError(f"shuffle_chunk must be a positive number of samples, not {shuffle_chunk}")
        self.patterns = [urls] if isinstance(urls, str) else list(urls)
        if not self.patterns:
            raise ShardError("no shard URLs given")
        self.decode = decode
        self.storage_options = dict(storage_options or {})
        self.on_change, self.shuffle_window, self.shuffle_chunk = on_change, shuffle_window, shuffle_chunk
        self.cache_blocks, self.read_ahead = cache_blocks, read_ahead
        self._plan: Iterable[Sequence[int]] | None = None
        self._ahead: ReadAhead | None = None
        self._ahead_pid: int | None = None
        self.stats = ReadStats()
        self._fs_pid: int | None = None
        self._fs: Any = None
        #: Shards whose version this process checked (on its first read of each).
        self._verified: set[int] = set()
        self._blocks: collections.OrderedDict[tuple[int, int], Any] = collections.OrderedDict()
        fs = self.filesystem()
        shards = self._list(fs)
        cache = IndexCache(index_dir or IndexCache.default_location())
        #: (fs path, index) of every shard, in order.
        self.shards: list[tuple[str, ShardIndex]] = [self._index(fs, cache, path, info) for path, info in shards]
        self._offsets = [0]
        for _, index in self.shards:
            self._offsets.append(self._offsets[-1] + index.count)
        self._order: tuple[int, int, torch.Tensor] | None = None

    # -- file system, per process ---------------------------------------------- #
    def filesystem(self) -> Any:
        """This process's fsspec file system (a loader worker opens its own: clients do not survive a fork)."""
        if self._fs is None or self._fs_pid != os.getpid():
            import fsspec

            options = dict(self.storage_options)
            if self.patterns[0].startswith(("s3://", "s3a://")):
                # botocore's own retry loop cut to one try, as for checkpoints: this module retries
                # (bounded, counted), and the two would multiply.
                one_try = {"retries": {"max_attempts": 1, "mode": "standard"}}
                options["config_kwargs"] = {**one_try, **options.get("config_kwargs", {})}
            fs, _ = fsspec.core.url_to_fs(self.patterns[0], skip_instance_cache=True, **options)
            if hasattr(fs, "retries"):
                fs.retries = 1  # s3fs's own retry loop; this module retries (bounded, counted) instead
            if self._fs is not None:
                # A client inherited through fork stays referenced: closing it here would close the
                # parent's connections from this process's event loop.
                _INHERITED.append(self._fs)
            self._fs, self._fs_pid = fs, os.getpid()
            self._verified = set()
            self._blocks = collections.OrderedDict()
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_fs=None, _fs_pid=None, _blocks=collections.OrderedDict(), _ahead=None, _ahead_pid=None)
        return state

    def _local(self, fs: Any) -> bool:
        protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        return "file" in protocols or "local" in protocols

    def _retrying(self, what: str, url: str, call: Callable[[], Any]) -> Any:
        """``call()``, retried on transient object-storage errors with the checkpoints' bounded backoff."""
        if self._local(self.filesystem()):
            return call()
        from unison.checkpointing.retry import call_retrying, first_line

        def give_up(tries: int, waited: float, budget: float, exc: BaseException) -> ShardError:
            return ShardError(
                f"{url}: failed to {what} after {tries} tries over {waited:.0f} s "
                f"(UNISON_STORAGE_RETRY_S={budget:g}); last error: {type(exc).__name__}: {first_line(exc)}"
            )

        return call_retrying(call, lambda: self.stats.add(retries=1), give_up)

    # -- listing and indexing --------------------------------------------------- #
    def _list(self, fs: Any) -> list[tuple[str, dict[str, Any]]]:
        import fsspec

        found: list[tuple[str, dict[str, Any]]] = []
        for pattern in self.patterns:
            _, path = fsspec.core.url_to_fs(pattern, **self.storage_options)
            if _is_glob(path):
                matches = self._retrying("list", pattern, functools.partial(fs.glob, path, detail=True))
                files = sorted((p, i) for p, i in matches.items() if i.get("type", "file") != "directory")
                if not files:
                    raise ShardError(f"{pattern}: no shard matches")
                found.extend(files)
                continue
            try:
                found.append((path, self._retrying("look up", pattern, functools.partial(fs.info, path))))
            except FileNotFoundError:
                raise ShardError(f"{pattern}: shard not found") from None
        return found

    def _index(self, fs: Any, cache: IndexCache, path: str, info: dict[str, Any]) -> tuple[str, ShardIndex]:
        url = fs.unstrip_protocol(path)
        version = version_of(info)
        cached = cache.load(url)
        if cached is not None and cached.version == version and cached.complete:
            return path, cached
        with cache.building(url):  # one process of a job builds it; the others wait, then load it
            cached = cache.load(url)
            if cached is not None and cached.version == version and cached.complete:
                return path, cached
            if cached is not None and cached.version != version:
                if self.on_change == "error":
                    raise ShardError(
                        f"{url} changed since its index was built (was {cached.version}, now {version}); "
                        "its samples would differ from the ones indexed",
                    )
                warnings.warn(f"{url} changed since its index was built: indexing it again", stacklevel=3)
            index = self._retrying("index", url, lambda: build_index(fs, path, url, shard_format(path), version))
            cache.store(index)
        return path, index

    # -- sizes and order ----------------------------------------------------------- #
    def __len__(self) -> int:
        return self._offsets[-1]

    def locate(self, i: int) -> tuple[int, int]:
        """``(shard number, position in the shard)`` of global sample ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} is out of range for {len(self)} samples")
        shard = bisect.bisect_right(self._offsets, i) - 1
        return shard, i - self._offsets[shard]

    def epoch_order(self, seed: int, epoch: int) -> torch.Tensor | None:
        """The epoch's sample order with ``shuffle_window``, by seed and epoch only; ``None`` without it
        (the trainer's plan then draws its global permutation)."""
        if self.shuffle_window is None:
            return None
        if self._order is not None and self._order[:2] == (seed, epoch):
            return self._order[2]
        order = window_order(self._offsets, seed, epoch, self.shuffle_window, self.shuffle_chunk)
        self._order = (seed, epoch, order)
        return order

    # -- reading ------------------------------------------------------------------ #
    def __getitem__(self, i: int) -> Any:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The samples at ``indices``: range-read records from the read-ahead when it holds them, the rest
        in one coalesced, concurrent ``cat_ranges`` call; Parquet and compressed records by block."""
        indices = [int(i) + len(self) if int(i) < 0 else int(i) for i in indices]
        ranged = self._range_records(indices)
        got: dict[Any, bytes] = {}
        if ranged:
            ahead = self._read_ahead()
            got = (ahead.take(indices) if ahead is not None else None) or {}
            missing = [record for record in ranged if record[0] not in got]
            if missing:
                got.update(self._read_spans(coalesce(missing)))
        where = [self.locate(i) for i in indices]
        records = [(key[0], key[1], got[key]) if key in got else self._from_block(*key) for key in where]
        return [self._decode(indices[out], rec) for out, rec in enumerate(records)]

    def follow_plan(self, batches: Iterable[Sequence[int]] | None) -> None:
        """Read ahead along ``batches``, every micro-batch a ``DataLoader`` will ask for, in order (the
        trainer passes its sampler); ``None`` stops. Each loader process then reads its next micro-batches
        in the background, up to ``read_ahead`` bytes (:class:`~unison.data.read_ahead.ReadAhead`)."""
        self._plan, self._ahead = batches, None

    def _read_ahead(self) -> ReadAhead | None:
        if self._plan is None or not self.read_ahead:
            return None
        if self._ahead is None or self._ahead_pid != os.getpid():
            self._ahead = ReadAhead(self._plan, self.read_ahead, self._range_records, self._read_spans)
            self._ahead_pid = os.getpid()
        return self._ahead

    def _range_records(self, indices: Sequence[int]) -> list[tuple[tuple[int, int], int, int, int]]:
        """``((shard, position), shard, start, end)`` of the range-read records among ``indices``."""
        out = []
        for i in indices:
            shard, pos = self.locate(int(i))
            index = self.shards[shard][1]
            if index.format in _RANGED:
                out.append(((shard, pos), shard, index.starts[pos], index.ends[pos]))
        return out

    def _check_version(self, shard: int) -> None:
        """Once per process and shard: the object is still the version that was indexed."""
        if shard in self._verified:
            return
        path, index = self.shards[shard]
        fs = self.filesystem()
        try:
            info = self._retrying("look up", index.url, lambda: fs.info(path))
        except FileNotFoundError:
            raise ShardError(f"{index.url}: shard not found (it was indexed, then removed)") from None
        if version_of(info) != index.version:
            raise ShardError(
                f"{index.url} changed since its index was built (was {index.version}, now {version_of(info)}): "
                "refusing to mix samples of two versions; build the dataset again to re-index it"
            )
        self._verified.add(shard)

    def _read_spans(self, spans: list[tuple[Any, int, int, list[Any]]]) -> dict[Any, bytes]:
        """The records of :func:`~unison.data.read_ahead.coalesce`'s spans: one request per span, all in one
        ``cat_ranges`` call (concurrent in s3fs)."""
        for shard in sorted({span[0] for span in spans}):
            self._check_version(shard)
        paths = [self.shards[shard][0] for shard, *_ in spans]
        starts, ends = [span[1] for span in spans], [span[2] for span in spans]
        fs = self.filesystem()
        first_url = self.shards[spans[0][0]][1].url
        try:
            blobs = self._retrying("read", first_url, lambda: fs.cat_ranges(paths, starts, ends, on_error="raise"))
        except FileNotFoundError:
            missing = [self.shards[s][1].url for s in {span[0] for span in spans} if not fs.exists(self.shards[s][0])]
            gone = ", ".join(missing) or first_url
            raise ShardError(f"{gone}: shard not found (it was indexed, then removed)") from None
        self.stats.add(bytes=sum(len(blob) for blob in blobs), requests=len(blobs))
        records = {}
        for (shard, start, _, members), blob in zip(spans, blobs):
            index = self.shards[shard][1]
            for (_, pos), _, lo, hi in members:
                if hi - start > len(blob):
                    raise ShardError(f"{index.url}: record {pos} ends past the end of the shard (truncated)")
                records[shard, pos] = blob[lo - start : hi - start]
                # Every record, read ahead or not: the bytes indexed, or the run stops naming the shard.
                index.check(pos, records[shard, pos])
        return records

    def _from_block(self, shard: int, pos: int) -> Any:
        """A record of a Parquet row group or a decompressed shard, through this process's block cache."""
        self._check_version(shard)
        path, index = self.shards[shard]
        if index.format == "parquet":
            group, row = 0, pos
            while row >= index.row_groups[group]:
                row -= index.row_groups[group]
                group += 1
            key = (shard, group)
        else:
            key, row = (shard, -1), pos
        block = self._blocks.get(key)
        if block is None:
            block = self._retrying("read", index.url, lambda: self._load_block(path, index, key[1]))
            if index.format == "parquet":
                # A row group has no per-record CRC: the shard's version, checked after each row group read.
                self._verified.discard(shard)
                self._check_version(shard)
            self._blocks[key] = block
            while len(self._blocks) > self.cache_blocks:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(key)
        if index.format == "parquet":
            return (shard, pos, block[row])
        record = block[index.starts[pos] : index.ends[pos]]
        index.check(pos, record)
        return (shard, pos, record)

    def _load_block(self, path: str, index: ShardIndex, group: int) -> Any:
        fs = self.filesystem()
        self.stats.add(requests=1)
        if index.format == "parquet":
            import pyarrow.parquet as pq

            with fs.open(path, "rb", cache_type="none") as f:
                try:
                    table = pq.ParquetFile(f).read_row_group(group)
                except Exception as exc:  # pyarrow's ArrowInvalid and friends
                    raise ShardError(f"{index.url}: row group {group} is unreadable ({exc})") from None
            return table.to_pylist()
        data = fs.cat_file(path)
        self.stats.add(bytes=len(data))
        try:
            return decompressor(index.format)(data)
        except (OSError, EOFError, ValueError) as exc:
            raise ShardError(f"{index.url}: cannot decompress ({type(exc).__name__}: {exc})") from None

    def _decode(self, i: int, record: tuple[int, int, Any]) -> Any:
        shard, pos, raw = record
        index = self.shards[shard][1]
        where = f"{index.url}, record {pos} (sample {i})"
        if index.format == "tar":
            raw = {ext: raw[off : off + size] for ext, off, size in index.members[pos]}
        elif index.format != "parquet":
            try:
                raw = json.loads(raw)
            except ValueError as exc:
                raise ShardError(f"{where} at byte {index.starts[pos]} is not valid JSON: {exc}") from None
        if self.decode is None:
            return raw
        try:
            return self.decode(raw)
        except Exception as exc:
            raise ShardError(f"{where}: decode failed: {type(exc).__name__}: {exc}") from exc
