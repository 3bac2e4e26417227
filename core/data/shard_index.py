"""The per-shard sample index of a :class:`~unison.data.shards.ShardedDataset`: what each shard holds and where.

One index per shard file, built once by reading the shard through and cached as a small JSON object::

    {"format": "jsonl", "url": "s3://bucket/train/part-0.jsonl", "version": {"etag": "\\"9b2c...\\""},
     "count": 3, "starts": [0, 48, 97], "ends": [47, 96, 141], "crcs": [2781623318, 93385012, 4034717530]}

* ``jsonl`` (uncompressed): ``starts``/``ends`` are each record's byte range (its newline excluded, blank
  lines skipped), so one record is one range read.
* ``jsonl.gz`` / ``jsonl.zst``: the same ranges in the *decompressed* bytes; compressed streams have no
  random access, so such a shard is read whole when first touched (see the trade-off in ``docs/data.md``).
* ``tar`` (WebDataset layout: the files of one sample share their name up to the first dot of the
  base name, ``000017.json``, ``000017.png``): ``starts``/``ends`` span each sample's members, headers
  included, and ``members`` lists ``[extension, data offset within the span, size]`` per member.
* ``parquet``: ``row_groups`` is the row count of each row group (from the footer alone); a row group
  is the smallest unit Parquet can read.

``crcs`` is the CRC-32 of each record's bytes (JSON lines, tar samples, decompressed records), checked at
every read: a shard rewritten while a run reads it (even with the same size and mtime) is refused at its
first changed record, whatever the read-ahead, instead of yielding samples of two versions. Parquet row
groups have no per-record bytes: the shard's version is checked again after every row group read.

``version`` is the object's identity when the index was built: its ETag where the file system reports one
(S3), else its modification time and size. An index whose version is not the shard's current one is
stale: it is rebuilt or refused (``on_change``), never used, so samples of two versions of a shard are
never mixed. The cache file's name is a hash of the shard's URL; its content names the URL too.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: Read size while indexing (one sequential pass per shard).
SCAN_BLOCK = 8 << 20

FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "tar", "parquet")


class ShardError(RuntimeError):
    """A shard that cannot be used: missing, corrupt, changed since indexed, or of an unknown format."""


def shard_format(path: str) -> str:
    """A shard's format from its name: ``.jsonl``/``.ndjson``/``.json`` (optionally ``.gz``/``.zst``),
    ``.tar``, ``.parquet``."""
    name = path.lower()
    for compressed in ("gz", "zst"):
        for ext in (".jsonl", ".ndjson", ".json"):
            if name.endswith(f"{ext}.{compressed}"):
                return f"jsonl.{compressed}"
    if name.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    if name.endswith(".tar"):
        return "tar"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    raise ShardError(
        f"{path}: unknown shard format (known: .jsonl/.ndjson/.json, optionally .gz or .zst; .tar; .parquet)"
    )


def version_of(info: dict[str, Any]) -> dict[str, Any]:
    """The identity of an object from its fsspec ``info``: the ETag when there is one, else mtime and size."""
    for name in ("ETag", "etag", "e_tag"):
        if info.get(name):
            return {"etag": str(info[name])}
    mtime = info.get("mtime", info.get("LastModified", info.get("last_modified", info.get("created"))))
    return {"mtime": str(mtime), "size": int(info["size"])}


@dataclass
class ShardIndex:
    """What one shard holds: its sample count and where each sample lies."""

    format: str
    url: str
    version: dict[str, Any]
    count: int
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    members: list[list[list[Any]]] = field(default_factory=list)
    row_groups: list[int] = field(default_factory=list)
    crcs: list[int] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Whether it holds every record's CRC (an index cached by an earlier unison lacks them: rebuilt)."""
        return self.format == "parquet" or len(self.crcs) == self.count

    def check(self, pos: int, record: bytes | memoryview) -> None:
        """Refuse ``record`` (record ``pos``, as read now) unless it is the bytes that were indexed."""
        if self.crcs and zlib.crc32(record) != self.crcs[pos]:
            raise ShardError(
                f"{self.url} changed while this run read it: record {pos} (bytes {self.starts[pos]}-"
                f"{self.ends[pos]}) is not what the index read from its version {self.version}; refusing to mix "
                "samples of two versions (rewrite shards under new names, or build the dataset again to re-index)"
            )

    def to_json(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> ShardIndex:
        return cls(**json.loads(text))


def decompressor(fmt: str) -> Any:
    """``bytes -> bytes`` for a compressed JSON-lines format (zstd needs the ``zstandard`` package)."""
    if fmt == "jsonl.gz":
        return gzip.decompress
    if fmt == "jsonl.zst":
        try:
            import zstandard
        except ImportError:
            raise ShardError("zstd-compressed shards need the zstandard package: pip install zstandard") from None
        return lambda data: zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read()
    raise ValueError(fmt)


def line_ranges(data: bytes | Any, base: int = 0) -> tuple[list[int], list[int]]:
    """Byte ranges of the non-blank lines of ``data`` (a bytes object or a binary file read in blocks)."""
    starts: list[int] = []
    ends: list[int] = []
    reader = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    carry, offset = b"", base  # carry: the partial line at the end of the previous block
    while True:
        block = reader.read(SCAN_BLOCK)
        if not block:
            break
        chunk = carry + block
        pos = 0
        while True:
            nl = chunk.find(b"\n", pos)
            if nl < 0:
                break
            if chunk[pos:nl].strip():
                starts.append(offset + pos)
                ends.append(offset + nl)
            pos = nl + 1
        offset += pos
        carry = chunk[pos:]
    if carry.strip():
        starts.append(offset)
        ends.append(offset + len(carry))
    return starts, ends


def _tar_index(f: Any, url: str) -> tuple[list[int], list[int], list[list[list[Any]]]]:
    """Each sample's span (first header to last data byte) and members, reading the tar sequentially."""
    starts: list[int] = []
    ends: list[int] = []
    members: list[list[list[Any]]] = []
    key = None
    try:
        with tarfile.open(fileobj=f, mode="r|") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                base = member.name.rsplit("/", 1)[-1]
                stem, _, ext = base.partition(".")
                sample_key = member.name[: len(member.name) - len(base)] + stem
                if sample_key != key:
                    key = sample_key
                    starts.append(member.offset)
                    ends.append(member.offset)
                    members.append([])
                members[-1].append([ext, member.offset_data - starts[-1], member.size])
                ends[-1] = member.offset_data + member.size
    except tarfile.TarError as exc:
        raise ShardError(f"{url}: not a readable tar file after {len(starts)} samples ({exc})") from None
    return starts, ends, members


def build_index(fs: Any, path: str, url: str, fmt: str, version: dict[str, Any]) -> ShardIndex:
    """Read the shard at ``path`` once and index it."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with fs.open(path, "rb") as f:
            try:
                meta = pq.ParquetFile(f).metadata
            except Exception as exc:  # pyarrow's ArrowInvalid and friends
                raise ShardError(f"{url}: not a readable Parquet file ({exc})") from None
            groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        return ShardIndex(fmt, url, version, sum(groups), row_groups=groups)
    with fs.open(path, "rb", block_size=SCAN_BLOCK) as f:
        if fmt == "tar":
            starts, ends, members = _tar_index(f, url)
            f.seek(0)  # a second pass for the samples' CRCs (the tar reader streams past their bytes)
            crcs = _span_crcs(f, starts, ends)
            return ShardIndex(fmt, url, version, len(starts), starts, ends, members, crcs=crcs)
        if fmt == "jsonl":
            starts, ends = line_ranges(f)
            f.seek(0)
            crcs = _span_crcs(f, starts, ends)
        else:
            try:
                data = decompressor(fmt)(f.read())
            except (OSError, EOFError, ValueError) as exc:  # gzip.BadGzipFile is an OSError
                raise ShardError(f"{url}: cannot decompress ({type(exc).__name__}: {exc})") from None
            starts, ends = line_ranges(data)
            crcs = [zlib.crc32(data[a:b]) for a, b in zip(starts, ends)]
    return ShardIndex(fmt, url, version, len(starts), starts, ends, crcs=crcs)


def _span_crcs(f: Any, starts: list[int], ends: list[int]) -> list[int]:
    """The CRC-32 of each ``[start, end)`` span of the file ``f`` (sorted, non-overlapping), read sequentially."""
    crcs, offset, block = [], 0, b""
    for start, end in zip(starts, ends):
        while offset + len(block) < end:  # extend the window until it holds the span
            more = f.read(SCAN_BLOCK)
            if not more:
                break
            keep = max(0, start - offset)
            block, offset = block[keep:] + more, offset + keep
        crcs.append(zlib.crc32(block[start - offset : end - offset]))
    return crcs


class IndexCache:
    """Shard indexes stored as JSON under a directory (local, or any fsspec URL such as ``s3://``)."""

    def __init__(self, location: str, storage_options: dict[str, Any] | None = None) -> None:
        import fsspec

        self.location = location.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.location, **(storage_options or {}))
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    @staticmethod
    def default_location() -> str:
        """``$UNISON_DATA_CACHE``, else ``~/.cache/unison/shard-index``."""
        return os.environ.get("UNISON_DATA_CACHE") or os.path.join(
            os.path.expanduser("~"), ".cache", "unison", "shard-index"
        )

    def _path(self, url: str) -> str:
        return f"{self.root}/{hashlib.sha256(url.encode()).hexdigest()[:32]}.json"

    def load(self, url: str) -> ShardIndex | None:
        """The cached index of ``url`` (any version), or ``None`` when there is none or it is unreadable."""
        try:
            index = ShardIndex.from_json(self.fs.cat_file(self._path(url)))
        except (FileNotFoundError, ValueError, TypeError, KeyError):
            return None
        return index if index.url == url else None

    @contextlib.contextmanager
    def building(self, url: str) -> Iterator[None]:
        """Held while this process builds ``url``'s index: on a local (or NFS) cache directory an exclusive
        ``flock`` on a lock file beside the index, so the processes of one job that find no index (every
        rank, every loader) build it once; the others wait, then load it. An object-storage cache has no
        lock: each process that finds no index builds it (the same index; the last write wins)."""
        if not self.local:
            yield
            return
        import fcntl

        os.makedirs(self.root, exist_ok=True)
        with open(self._path(url) + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def store(self, index: ShardIndex) -> None:
        """Write atomically: a local file is renamed into place; an object PUT is atomic itself."""
        path = self._path(index.url)
        if not self.local:
            self.fs.pipe_file(path, index.to_json().encode())
            return
        os.makedirs(self.root, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            out.write(index.to_json())
        os.replace(tmp, path)
