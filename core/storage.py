"""The file operations of the checkpointer, behind one small seam.

:class:`LocalStorage` is every read, write, listing, rename and delete the
checkpointer does, on a POSIX file system. An object-storage backend (fsspec,
S3) replaces this class and keeps the checkpointer's rules: the rules only ever
call these methods, so they never learn where the bytes live.

Strategies write their own state files into a *local* directory the
checkpointer hands them (``Checkpointer.save``'s ``write`` callback); a remote
backend stages that directory locally and uploads it in :meth:`commit_dir`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import BinaryIO

#: Bytes read at a time while hashing: large enough to keep sha256 busy.
_CHUNK = 1 << 20


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
            while chunk := f.read(_CHUNK):
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
    def make_dir(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)

    def write_bytes(self, path: Path, data: bytes, *, sync: bool = True) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())

    def write_text(self, path: Path, text: str, *, sync: bool = True) -> None:
        self.write_bytes(path, text.encode(), sync=sync)

    def replace_file(self, path: Path, text: str) -> None:
        """Write ``text`` to ``path`` atomically: readers see the old or the new content, never a mix."""
        tmp = path.with_name(f".{path.name}.tmp")
        self.write_text(tmp, text)
        os.replace(tmp, path)
        self._sync_dir(path.parent)

    def commit_dir(self, src: Path, dst: Path) -> None:
        """Publish the finished directory ``src`` as ``dst`` in one atomic step (``dst`` must not exist)."""
        if dst.exists():
            raise FileExistsError(f"refusing to commit over {dst}")
        os.rename(src, dst)
        self._sync_dir(dst.parent)

    def remove_file(self, path: Path) -> None:
        """Delete one file (missing is fine)."""
        path.unlink(missing_ok=True)

    def remove_tree(self, path: Path) -> None:
        """Delete a directory and everything under it (missing is fine)."""
        shutil.rmtree(path, ignore_errors=True)

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
