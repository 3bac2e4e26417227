"""Checkpoints in object storage (S3 through s3fs), behind the checkpointer's storage seam.

The ``s3`` URL scheme reaches this module through the storage plugin
:mod:`unison.plugins.storage.s3` (hook ``unison_storage_backends``), which checks that
s3fs is installed and builds an :class:`FsspecStorage`.

:class:`FsspecStorage` implements every method of
:class:`unison.checkpointing.storage.LocalStorage` on an fsspec file system, so the
checkpointer's rules (atomic commit, manifest last, ``latest`` after,
verification on load, retention, auto-resume) apply unchanged.

Design: stage locally, upload, commit by writing the manifest last.

* Strategies write through file-system APIs (DCP's ``FileSystemWriter``,
  DeepSpeed's ``save_checkpoint``, ``torch.save``). Each rank gets a *private*
  local staging directory (:meth:`FsspecStorage.staged`) and uploads exactly
  the files it wrote under the save's temporary prefix
  ``ROOT/.step-N.partial/``. Every rank uploads its own shards in parallel,
  so it works when the nodes share no file system.
* Every object of a save goes up as a multipart upload (:mod:`unison.checkpointing.uploads`), so a
  request the client gave up on and retried can never land after the save returned: the lease is
  released with every upload finished or cancelled.
* The manifest is hashed from the bytes *in the bucket* (the ranks share the
  reading), so it vouches for what was stored, not for a local copy.
* Object stores have no rename. The commit copies every object of the
  temporary prefix to ``ROOT/step-N/`` on the server (no bytes through this
  host), ``manifest.json`` last: a checkpoint is committed exactly when its
  manifest exists, which is what the checkpointer looks for. ``latest`` is a
  single PUT afterwards (atomic in S3), then the temporary prefix is deleted.
  A kill at any moment leaves the previous checkpoints untouched and at most
  a ``.partial`` prefix or a ``step-N/`` prefix without a manifest (never
  treated as a checkpoint); both are removed by the next save or resume of
  the run (:meth:`FsspecStorage.interrupted_commits`).
* Loading downloads the checkpoint to a per-process cache
  (:meth:`FsspecStorage.localize`); the files a rank hashed to verify it are
  kept there, keyed by their ETag, so each rank downloads each file once.
* Listings are never cached: other ranks and other runs write the bucket.
* Local disk: staging directories and the download cache live under
  ``$TMPDIR``; a staging directory is deleted once uploaded, the cache when
  the process exits. Each rank needs room for the files it writes and, when
  resuming, for one copy of the checkpoint.

Configuration is s3fs's and botocore's own: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL``, fsspec's
``FSSPEC_S3_*`` variables (e.g. ``FSSPEC_S3_ENDPOINT_URL``), or explicit
``storage_options`` passed to :func:`unison.checkpointing.storage.open_storage`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from unison.checkpointing.retry import first_line, precondition_failed, retried
from unison.checkpointing.storage import CHUNK, URL, LocalStorage, split_url
from unison.checkpointing.uploads import abort_uploads, in_partial, put_files, put_object
from unison.errors import ConfigurationError

#: The manifest's file name (kept here too: unison.checkpointing.manifest imports this package's seam).
_MANIFEST = "manifest.json"


class RemotePath(type(Path())):  # type: ignore[misc]  # the concrete Path class of this platform
    """A path in object storage; prints as its URL (``s3://bucket/key``).

    A :class:`~pathlib.Path` so the checkpointer's path arithmetic (``/``,
    ``.name``, ``.parent``) works unchanged; only :class:`FsspecStorage`
    ever does I/O with it.
    """

    def __str__(self) -> str:
        text = super().__str__()
        match = URL.match(text)
        return f"{match.group(1)}://{match.group(2)}" if match else text


class FsspecStorage(LocalStorage):
    """A checkpoint root in object storage; local paths (staging, caches) still go to the local file system."""

    def __init__(self, scheme: str, storage_options: dict[str, Any], option: str = "checkpoint_dir") -> None:
        #: The setting errors name (``checkpoint_dir``, ``logging.dir``).
        self.option = option
        import fsspec

        self.scheme = scheme
        options = dict(storage_options)
        # unison retries transient failures itself (bounded, counted, one clear message at the end):
        # the client library's own retry loops are cut to one try so the two do not multiply.
        options.setdefault("config_kwargs", {}).setdefault("retries", {"max_attempts": 1, "mode": "standard"})
        # Listings are never cached (other ranks and runs write the bucket) and
        # the instance is private (its options are this run's).
        self.fs = fsspec.filesystem(scheme, use_listings_cache=False, skip_instance_cache=True, **options)
        if hasattr(self.fs, "retries"):
            self.fs.retries = 1  # s3fs's own loop (a class attribute, 5 tries)
        #: Object-storage calls retried after a transient failure, since this storage was opened.
        self.retries = 0
        self._cache_dir = Path(tempfile.mkdtemp(prefix="unison-objects-"))
        self._cached: dict[str, str] = {}  # local cache file -> ETag of the object it holds
        weakref.finalize(self, shutil.rmtree, self._cache_dir, True)

    @property
    def endpoint(self) -> str:
        """The server this storage talks to, for messages."""
        return str(getattr(self.fs, "endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3")

    def root_path(self, rest: str) -> Path:
        return RemotePath(f"{self.scheme}://{rest}")

    def _key(self, path: Path | str) -> str | None:
        """``bucket/key`` of a path in this storage, ``None`` for a local path."""
        url = split_url(path)
        if url is None:
            return None
        if url[0] != self.scheme:
            raise ValueError(f"{path} is not in {self.scheme}:// storage")
        return url[1]

    # -- preflight ---------------------------------------------------------- #
    def check(self, root: Path) -> None:
        """List the bucket and write then delete a probe object under ``root``.

        A refused signature or unknown key, a missing bucket, an unreachable
        endpoint or a read-only credential all become a
        :class:`ConfigurationError` here, before any process group or
        training step.
        """
        key = self._key(root)
        assert key is not None
        bucket = key.split("/", 1)[0]
        url = f"{self.scheme}://{key}"
        fix_credentials = (
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to credentials the server accepts, "
            "and AWS_ENDPOINT_URL for a server other than AWS"
        )
        probe = f"{key}/.unison-probe-{uuid.uuid4().hex}"  # unique: every rank of every node probes at once
        try:
            self.fs.ls(bucket, detail=False)
            self.fs.pipe_file(probe, b"unison write probe\n")
            self.fs.rm_file(probe)
        except PermissionError as exc:
            raise ConfigurationError(
                self.option, f"the object store refused access to {url}: {first_line(exc)}", fix_credentials
            ) from None
        except FileNotFoundError:
            raise ConfigurationError(
                self.option, f"the bucket {bucket!r} of {url} does not exist", "create it, or name another"
            ) from None
        except Exception as exc:  # connection refused, DNS, TLS...: botocore's many error types
            raise ConfigurationError(
                self.option,
                f"cannot use {url}: {type(exc).__name__}: {first_line(exc)}",
                "check AWS_ENDPOINT_URL (or the endpoint_url storage option) and the network; " + fix_credentials,
            ) from None

    # -- queries ------------------------------------------------------------ #
    @retried("look up")
    def exists(self, path: Path) -> bool:
        """An object, or a prefix with an object under it (S3's meaning; some servers keep empty directories)."""
        key = self._key(path)
        if key is None:
            return super().exists(path)
        if self.fs.isfile(key):
            return True
        # find() answers an empty prefix with its own directory entry on such servers: count objects only.
        return any(info.get("type") != "directory" for info in self.fs.find(key, detail=True).values())

    @retried("look up")
    def is_dir(self, path: Path) -> bool:
        key = self._key(path)
        return super().is_dir(path) if key is None else self.fs.isdir(key)

    @retried("list")
    def list_dir(self, path: Path) -> list[str]:
        key = self._key(path)
        if key is None:
            return super().list_dir(path)
        try:
            entries = self.fs.ls(key, detail=False)
        except FileNotFoundError:
            return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != key})

    @retried("list")
    def list_files(self, path: Path) -> list[str]:
        key = self._key(path)
        if key is None:
            return super().list_files(path)
        return sorted(f[len(key) + 1 :] for f in self.fs.find(key))

    @retried("stat")
    def size(self, path: Path) -> int:
        key = self._key(path)
        return super().size(path) if key is None else int(self.fs.info(key)["size"])

    @retried("read")
    def digest(self, path: Path, *, sync: bool = False) -> tuple[int, str]:
        key = self._key(path)
        if key is None:
            return super().digest(path, sync=sync)
        if any(part.endswith(".partial") for part in Path(key).parts):
            # A save in progress: hash the stored bytes as they stream past (nothing kept).
            h, size = hashlib.sha256(), 0
            with self.fs.open(key, "rb", block_size=CHUNK, cache_type="none") as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    size += len(chunk)
            return size, h.hexdigest()
        # A committed checkpoint: verification precedes loading, so keep the bytes for it.
        return super().digest(self._fetch(key))

    def open_read(self, path: Path) -> BinaryIO:
        key = self._key(path)
        return super().open_read(path) if key is None else open(self._fetch(key), "rb")

    def read_text(self, path: Path) -> str:
        return self.read_bytes(path).decode()

    @retried("read")
    def read_bytes(self, path: Path) -> bytes:
        key = self._key(path)
        return super().read_bytes(path) if key is None else self.fs.cat_file(key)

    # -- writes ------------------------------------------------------------- #
    def make_dir(self, path: Path) -> None:
        if self._key(path) is None:
            super().make_dir(path)
        # Object stores have no directories: a prefix exists once an object is under it.

    def write_bytes(self, path: Path, data: bytes, *, sync: bool = True) -> None:
        key = self._key(path)
        if key is None:
            super().write_bytes(path, data, sync=sync)
        elif in_partial(key):
            put_object(self, key, data)  # a save's object: nothing of it can land after this returns (uploads.py)
        else:
            self._put(key, data)

    @retried("write")
    def _put(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(key, data)  # durable once the PUT returns

    @retried("write")
    def replace_file(self, path: Path, text: str) -> None:
        key = self._key(path)
        if key is None:
            super().replace_file(path, text)
        else:
            self.fs.pipe_file(key, text.encode())  # one PUT: readers see the old object or the new one

    def commit_dir(self, src: Path, dst: Path) -> None:
        """Copy ``src``'s objects to ``dst`` on the server, the manifest last, then delete ``src``.

        The manifest's arrival under ``dst`` is the commit point.
        """
        src_key, dst_key = self._key(src), self._key(dst)
        if src_key is None or dst_key is None:
            return super().commit_dir(src, dst)
        if self.exists(dst):
            raise FileExistsError(f"refusing to commit over {dst}")
        names = self.list_files(src)
        if _MANIFEST not in names:
            raise FileNotFoundError(f"{src} has no {_MANIFEST}: nothing to commit")
        for name in [n for n in names if n != _MANIFEST] + [_MANIFEST]:
            self._copy_object(f"{src_key}/{name}", f"{dst_key}/{name}")
        self.remove_tree(src)

    def interrupted_commits(self, root: Path) -> list[str]:
        """``step-*`` prefixes under ``root`` without a manifest: copies a kill stopped before the manifest.

        Only :meth:`commit_dir` writes ``step-*`` prefixes and it writes the
        manifest last, so such a prefix was never a checkpoint. Called when the
        lease is held and before any save: the unfinished multipart uploads
        of ``.partial`` prefixes (a killed save's; they hold no object, so no
        listing shows them) are aborted here too.
        """
        key = self._key(root)
        if key is not None:
            abort_uploads(self, key)
        names = [n for n in self.list_dir(root) if n.startswith("step-")]
        return [n for n in names if not self.exists(root / n / _MANIFEST) and self.exists(root / n)]

    @retried("copy")
    def _copy_object(self, src: str, dst: str) -> None:
        self.fs.copy(src, dst)  # server-side copy

    @retried("delete")
    def remove_file(self, path: Path) -> None:
        key = self._key(path)
        if key is None:
            return super().remove_file(path)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(key)

    @retried("delete")
    def remove_tree(self, path: Path) -> None:
        key = self._key(path)
        if key is None:
            return super().remove_tree(path)
        if in_partial(key):
            abort_uploads(self, key)  # uploads a killed save left unfinished (invisible, but stored)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(key, recursive=True)

    # -- conditional writes (the lease): the version is the object's ETag -- #
    @retried("read")
    def read_versioned(self, path: Path) -> tuple[bytes, str] | None:
        key = self._key(path)
        if key is None:
            return super().read_versioned(path)
        try:
            info = self.fs.info(key)
            data = self.fs.cat_file(key)
        except FileNotFoundError:
            return None
        # The ETag read with the bytes: a write between the two makes the next conditional write fail, as it should.
        return data, str(info.get("ETag") or info.get("etag"))

    @retried("write")
    def write_if(self, path: Path, data: bytes, version: str | None) -> str | None:
        """A PUT with ``If-None-Match: "*"`` (create) or ``If-Match: version``; the new ETag, ``None`` if refused."""
        key = self._key(path)
        if key is None:
            return super().write_if(path, data, version)
        try:
            if version is None:
                out = self.fs.pipe_file(key, data, mode="create")
            else:
                out = self.fs.pipe_file(key, data, IfMatch=version)
        except OSError as exc:
            if precondition_failed(exc):
                return None
            raise
        etag = out.get("ETag") if isinstance(out, dict) else None
        return str(etag or self.fs.info(key).get("ETag"))

    @retried("delete")
    def delete_if(self, path: Path, version: str) -> bool:
        key = self._key(path)
        if key is None:
            return super().delete_if(path, version)
        bucket, name = key.split("/", 1)
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=name, IfMatch=version)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if precondition_failed(exc):
                return False
            raise
        return True

    # -- the strategies' local directories ---------------------------------- #
    @contextlib.contextmanager
    def staged(self, directory: Path) -> Iterator[Path]:
        """A private local directory for this rank's files of ``directory``, uploaded when the block ends.

        Private per rank, so a rank never uploads a file another rank is still
        writing; on an exception nothing is uploaded. The local copy is
        deleted either way.
        """
        key = self._key(directory)
        if key is None:
            yield directory
            return
        local = Path(tempfile.mkdtemp(prefix="unison-stage-"))
        try:
            yield local
            self.upload(local, directory, LocalStorage.list_files(self, local))
        finally:
            shutil.rmtree(local, ignore_errors=True)

    def upload(self, local: Path, path: Path, names: list[str]) -> None:
        """Copy the files ``names`` (relative POSIX paths) of local directory ``local`` to ``path/name``.

        As multipart uploads, several at once, each finished or aborted when this returns
        (:mod:`unison.checkpointing.uploads` says why); every call is retried on transient errors.
        """
        key = self._key(path)
        assert key is not None, f"{path} is not in {self.scheme}:// storage"
        put_files(self, local, key, names)

    def localize(self, path: Path) -> Path:
        """Download every object under ``path`` (those already cached at the same ETag are kept); the local dir."""
        key = self._key(path)
        if key is None:
            return path
        found = self.fs.find(key, detail=True)
        local_root = self._cache_dir / key
        wanted = set()
        for name, info in found.items():
            wanted.add(self._fetch(name, info))
        # The local copy holds exactly what the prefix holds: nothing left from an earlier download.
        if local_root.exists():
            for file in [p for p in local_root.rglob("*") if p.is_file()]:
                if str(file) not in wanted:
                    file.unlink()
        local_root.mkdir(parents=True, exist_ok=True)
        return local_root

    @retried("download")
    def _fetch(self, key: str, info: dict[str, Any] | None = None) -> str:
        """The local cache file holding object ``key``, downloaded unless cached at its current ETag."""
        info = info or self.fs.info(key)
        etag = str(info.get("ETag") or info.get("etag") or "") + f":{info['size']}"
        local = self._cache_dir / key
        if self._cached.get(str(local)) != etag or not local.exists():
            local.parent.mkdir(parents=True, exist_ok=True)
            tmp = local.with_name(f".{local.name}.download")
            self.fs.get_file(key, str(tmp))
            os.replace(tmp, local)
            self._cached[str(local)] = etag
        return str(local)
