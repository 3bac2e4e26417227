"""The file operations of the checkpointer, behind one small seam.

:class:`LocalStorage` is every read, write, listing, rename and delete the
checkpointer does, on a POSIX file system. A backend for a URL scheme
(the built-in ``s3://`` one, :class:`unison.checkpointing.remote_storage.FsspecStorage` through
s3fs, or a third party's) subclasses it and keeps the checkpointer's rules: the rules only ever call these
methods, so they never learn where the bytes live.

Strategies write their own state files into a *local* directory and read them
back from one (DCP's and DeepSpeed's writers want a file system). Two methods
bridge that: :meth:`LocalStorage.staged` hands each rank a local directory to
write into (a remote backend uploads what the rank wrote when it is done), and
:meth:`LocalStorage.localize` gives the local directory of a committed
checkpoint (a remote backend downloads it). On a local file system both are
the path itself.

:func:`open_storage` turns a location (a path, a ``file://`` URL, or a URL of
a scheme a plugin registered through the ``unison_storage_backends`` hook,
``s3://`` among them) into its root path and storage; an unregistered scheme
is a :class:`~unison.errors.ConfigurationError` naming the registered ones,
before anything is written.

Symbolic links. No write or delete of :class:`LocalStorage` follows a link:
new files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (temporaries
under a fresh random name, then ``os.replace``-d onto the final name, which
replaces the name itself), existing files are opened with ``O_NOFOLLOW``, and
a directory it makes, commits or removes must be a real directory. A link
found at such a name is refused with a
:class:`~unison.checkpointing.nofollow.PlantedLinkError` that names
it and its target; unison deletes neither the link nor its target (it did not
make the link, so the person who did decides). The one link followed is the
root itself (``checkpoint_dir``, the run directory's root): a name the user
gave, see :meth:`LocalStorage.make_root`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from unison.checkpointing.nofollow import (
    open_nofollow,
    refuse_link,
    replace_atomically,
)
from unison.contract.spec import StorageFactory as StorageFactory  # the plugins name it here too
from unison.errors import ConfigurationError, UnisonError

if TYPE_CHECKING:  # pragma: no cover
    from unison.plugin.manager import PluginManager


class StorageUnavailableError(UnisonError):
    """Object storage did not answer within unison's retry budget; the message names the object and endpoint."""


class StorageWarning(UserWarning):
    """A clean-up that could not finish (a directory that could not be removed); training goes on."""


#: Bytes read at a time while hashing: large enough to keep sha256 busy.
#: Bytes read at a time when hashing or copying a file.
CHUNK = 1 << 20


class LocalStorage:
    """A checkpoint root on a local or shared POSIX file system."""

    # -- queries ------------------------------------------------------------ #
    def exists(self, path: Path) -> bool:
        return path.exists()

    def is_dir(self, path: Path) -> bool:
        return path.is_dir()

    def list_dir(self, path: Path) -> list[str]:
        """Names directly under ``path`` (sorted); empty when it does not exist."""
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def list_files(self, path: Path) -> list[str]:
        """Every file under ``path``, recursively, as sorted POSIX paths relative to it."""
        out = []
        for dirpath, _, filenames in os.walk(path):
            for name in filenames:
                out.append((Path(dirpath) / name).relative_to(path).as_posix())
        return sorted(out)

    def size(self, path: Path) -> int:
        return path.stat().st_size

    def digest(self, path: Path, *, sync: bool = False) -> tuple[int, str]:
        """``(size, sha256 hex)`` of one file; with ``sync`` also flush it to stable storage.

        Hashing reads every byte anyway; syncing the same descriptor then makes
        the file durable before the manifest that vouches for it is written.
        """
        h = hashlib.sha256()
        size = 0
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                size += len(chunk)
            if sync:
                os.fsync(f.fileno())
        return size, h.hexdigest()

    def open_read(self, path: Path) -> BinaryIO:
        return open(path, "rb")

    def read_text(self, path: Path) -> str:
        return path.read_text()

    def read_bytes(self, path: Path) -> bytes:
        return path.read_bytes()

    # -- writes ------------------------------------------------------------- #
    def make_root(self, path: Path) -> None:
        """Make the root the user named (``checkpoint_dir``); a symbolic link there is theirs and is followed.

        Every directory *under* the root is made with :meth:`make_dir`, which
        refuses links.
        """
        if os.path.islink(path) and os.path.isdir(path):
            return
        self.make_dir(path)

    def make_dir(self, path: Path) -> None:
        """Make ``path`` (and its parents); an existing real directory is fine, a symbolic link is refused."""
        refuse_link(path)
        path.mkdir(parents=True, exist_ok=True)
        refuse_link(path)  # (planted between the check and the mkdir, which accepts it)

    def write_bytes(self, path: Path, data: bytes, *, sync: bool = True) -> None:
        """Write a file (made or truncated); its directory is made if missing; a link at ``path`` is refused."""
        if not path.parent.is_dir():
            self.make_dir(path.parent)
        with os.fdopen(open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())

    def write_text(self, path: Path, text: str, *, sync: bool = True) -> None:
        self.write_bytes(path, text.encode(), sync=sync)

    def replace_file(self, path: Path, text: str) -> None:
        """Write ``text`` to ``path`` atomically: readers see the old or the new content, never a mix.

        The temporary is a fresh random name made exclusively (:func:`replace_atomically`);
        a link at ``path`` itself is refused.
        """
        replace_atomically(path, text.encode())
        self._sync_dir(path.parent)

    def commit_dir(self, src: Path, dst: Path) -> None:
        """Publish the finished directory ``src`` as ``dst`` in one atomic step (``dst`` must not exist).

        ``src`` must be a real directory: a link planted at a partial name is
        refused, never renamed into place.
        """
        refuse_link(src)
        if not src.is_dir():
            raise NotADirectoryError(f"{src} is not a directory; nothing to commit")
        if os.path.lexists(dst):
            refuse_link(dst)
            raise FileExistsError(f"refusing to commit over {dst}")
        os.rename(src, dst)
        self._sync_dir(dst.parent)

    def interrupted_commits(self, root: Path) -> list[str]:
        """Names under ``root`` left by a commit that never finished (here none: a commit is one rename)."""
        return []

    def remove_file(self, path: Path) -> None:
        """Delete one file (missing is fine); a link there is refused, neither it nor its target is deleted."""
        refuse_link(path)
        path.unlink(missing_ok=True)

    def remove_tree(self, path: Path) -> None:
        """Delete a directory and everything under it (missing is fine).

        A link at ``path`` is refused (:class:`PlantedLinkError`): neither it
        nor its target is deleted. Links *inside* the tree are unlinked, never
        followed (``shutil.rmtree``). Anything else that cannot be removed is
        a :class:`StorageWarning` naming it, and the caller goes on: a
        leftover directory costs space, not correctness.
        """
        refuse_link(path)
        failures: list[str] = []

        def failed(function: Any, name: str, exc_info: Any) -> None:
            if not isinstance(exc_info[1], FileNotFoundError):
                failures.append(f"{name}: {exc_info[1]}")

        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=lambda function, name, exc: failed(function, name, (None, exc, None)))
        else:
            shutil.rmtree(path, onerror=failed)
        if failures:
            warnings.warn(f"could not remove all of {path}: {'; '.join(failures[:3])}", StorageWarning, stacklevel=2)

    def planted_links(self, root: Path, names: Callable[[str], bool]) -> list[Path]:
        """Entries directly under ``root`` for which ``names(name)`` holds and that are symbolic links."""
        try:
            entries = list(os.scandir(root))
        except OSError:
            return []  # missing, or not a local directory
        return sorted(root / e.name for e in entries if names(e.name) and e.is_symlink())

    # -- conditional writes (the lease, :mod:`unison.checkpointing.lease`) ----------------- #
    # A version is an opaque token for one content of a file: here its sha256;
    # object storage uses the ETag. Each read-compare-write runs under flock on
    # a sibling guard file, so two processes never both win.
    def read_versioned(self, path: Path) -> tuple[bytes, str] | None:
        """``(content, version)`` of a small file, ``None`` when it does not exist."""
        with self._guard(path):
            return self._read_versioned(path)

    def write_if(self, path: Path, data: bytes, version: str | None) -> str | None:
        """Write ``data`` if the file is at ``version`` (``None``: does not exist); its new version, or ``None``."""
        with self._guard(path):
            current = self._read_versioned(path)
            if (current[1] if current else None) != version:
                return None
            replace_atomically(path, data)
            self._sync_dir(path.parent)
            return hashlib.sha256(data).hexdigest()

    def delete_if(self, path: Path, version: str) -> bool:
        """Delete the file if it is at ``version``; whether it was deleted."""
        with self._guard(path):
            current = self._read_versioned(path)
            if current is None or current[1] != version:
                return False
            path.unlink()
            return True

    def _read_versioned(self, path: Path) -> tuple[bytes, str] | None:
        # (O_NOFOLLOW: a link planted at the record's name is refused, not read and then replaced)
        try:
            fd = open_nofollow(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        return data, hashlib.sha256(data).hexdigest()

    @contextlib.contextmanager
    def _guard(self, path: Path) -> Iterator[None]:
        self.make_root(path.parent)
        fd = open_nofollow(path.with_name(path.name + ".guard"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    # -- the strategies' local directories ---------------------------------- #
    @contextlib.contextmanager
    def staged(self, directory: Path) -> Iterator[Path]:
        """A local directory in which this rank writes its files of ``directory`` (here: ``directory`` itself)."""
        yield directory

    def localize(self, path: Path) -> Path:
        """A local directory holding the files under ``path`` (here: ``path`` itself)."""
        return path

    def check(self, root: Path) -> None:
        """Fail early, with a clear message, when ``root`` cannot be used (local paths: nothing to check)."""

    def _sync_dir(self, path: Path) -> None:
        # A rename is durable only once its directory entry is flushed.
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:  # some file systems refuse fsync on directories
            pass
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- #
# Locations
# --------------------------------------------------------------------------- #
#: ``scheme://rest``; also the ``scheme:/rest`` that ``Path("s3://b/k")`` collapses
#: it to. Two letters at least, so a Windows drive (``C:/``) is never a scheme.
#: ``scheme://rest``: a location another storage backend serves.
URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/+(.*)$")


def split_url(location: str | os.PathLike[str]) -> tuple[str, str] | None:
    """``(scheme, "bucket/key")`` for a URL (either spelling), ``None`` for a plain path."""
    match = URL.match(str(location))
    return (match.group(1).lower(), match.group(2).rstrip("/")) if match else None


def open_storage(
    location: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    option: str = "checkpoint_dir",
    *,
    plugins: PluginManager | None = None,
) -> tuple[Path, LocalStorage]:
    """The root path and storage for a checkpoint (or run directory) location.

    * a path or ``file://`` URL: that directory, :class:`LocalStorage`;
    * any other URL: the factory registered for its scheme through the
      ``unison_storage_backends`` hook, given the URL, ``storage_options``
      and ``option``. The built-in ``s3`` backend (:mod:`unison.plugins.storage.s3`)
      is an S3 bucket through s3fs, configured the standard way
      (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``,
      ``AWS_ENDPOINT_URL``, fsspec's ``FSSPEC_S3_*`` variables) or by
      ``storage_options`` (s3fs's keyword arguments);
    * a scheme nobody registered: a :class:`ConfigurationError` naming the
      registered ones. A URL is never taken as a local directory named after it.

    ``option`` is the setting errors name (``checkpoint_dir``, ``logging.dir``).
    ``plugins`` is the manager whose plugins are asked; by default a lazy
    :class:`~unison.plugin.manager.PluginManager` of the installed plugins
    (entry points and ``UNISON_PLUGINS``), which imports only the plugin
    modules that implement the hook. Local paths never reach a plugin.
    """
    url = split_url(location)
    if url is None:
        return Path(location), LocalStorage()
    scheme, rest = url
    if scheme == "file":
        return Path("/" + rest), LocalStorage()
    if plugins is None:
        from unison.plugin.manager import PluginManager

        plugins = PluginManager(lazy=True)
    backends = plugins.unison_storage_backends()
    factory = backends.get(scheme)
    if factory is None:
        registered = ", ".join(f"{name}://" for name in ["file", *sorted(backends)])
        raise ConfigurationError(
            option,
            f"{str(location)!r} uses the URL scheme {scheme!r}, which no storage backend is registered for "
            f"(registered: {registered})",
            "give a local path or a URL of a registered scheme; a plugin adds a scheme through the "
            "unison_storage_backends hook",
        )
    return factory(str(location), storage_options or {}, option)
