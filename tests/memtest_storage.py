"""A third-party storage backend: ``memtest://bucket/key`` kept in a local directory.

Registered by name through ``UNISON_PLUGINS=memtest_storage`` (a distribution would use
an entry point), so every plugin manager a run creates finds it, exactly as it finds
the built-in ``s3`` backend. The directory is ``$MEMTEST_STORAGE_ROOT``. Every storage
method maps the URL path onto that directory and does the real file operation, so the
checkpointer's rules run unchanged against it; each call is counted in :data:`CALLS`.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import unison
from unison.checkpointing.remote_storage import RemotePath
from unison.checkpointing.storage import LocalStorage, StorageFactory, split_url

SCHEME = "memtest"
#: storage method name -> number of calls on a memtest:// path
CALLS: collections.Counter[str] = collections.Counter()


class DirectoryStorage(LocalStorage):
    """``memtest://KEY`` stored at ``base/KEY``; local paths (none here) pass through."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def local(self, path: Path, method: str) -> Path:
        url = split_url(path)
        if url is None:
            return Path(path)
        assert url[0] == SCHEME, path
        CALLS[method] += 1
        return self.base / url[1]

    def exists(self, path: Path) -> bool:
        return super().exists(self.local(path, "exists"))

    def is_dir(self, path: Path) -> bool:
        return super().is_dir(self.local(path, "is_dir"))

    def list_dir(self, path: Path) -> list[str]:
        return super().list_dir(self.local(path, "list_dir"))

    def list_files(self, path: Path) -> list[str]:
        return super().list_files(self.local(path, "list_files"))

    def size(self, path: Path) -> int:
        return super().size(self.local(path, "size"))

    def digest(self, path: Path, *, sync: bool = False) -> tuple[int, str]:
        return super().digest(self.local(path, "digest"), sync=sync)

    def open_read(self, path: Path) -> BinaryIO:
        return super().open_read(self.local(path, "open_read"))

    def read_text(self, path: Path) -> str:
        return super().read_text(self.local(path, "read_text"))

    def read_bytes(self, path: Path) -> bytes:
        return super().read_bytes(self.local(path, "read_bytes"))

    def make_dir(self, path: Path) -> None:
        super().make_dir(self.local(path, "make_dir"))

    def write_bytes(self, path: Path, data: bytes, *, sync: bool = True) -> None:
        super().write_bytes(self.local(path, "write_bytes"), data, sync=sync)

    def replace_file(self, path: Path, text: str) -> None:
        super().replace_file(self.local(path, "replace_file"), text)

    def commit_dir(self, src: Path, dst: Path) -> None:
        super().commit_dir(self.local(src, "commit_dir"), self.local(dst, "commit_dir"))

    def interrupted_commits(self, root: Path) -> list[str]:
        return super().interrupted_commits(self.local(root, "interrupted_commits"))

    def remove_file(self, path: Path) -> None:
        super().remove_file(self.local(path, "remove_file"))

    def remove_tree(self, path: Path) -> None:
        super().remove_tree(self.local(path, "remove_tree"))

    def read_versioned(self, path: Path) -> tuple[bytes, str] | None:
        return super().read_versioned(self.local(path, "read_versioned"))

    def write_if(self, path: Path, data: bytes, version: str | None) -> str | None:
        return super().write_if(self.local(path, "write_if"), data, version)

    def delete_if(self, path: Path, version: str) -> bool:
        return super().delete_if(self.local(path, "delete_if"), version)

    @contextlib.contextmanager
    def staged(self, directory: Path) -> Iterator[Path]:
        yield self.local(directory, "staged")

    def localize(self, path: Path) -> Path:
        return self.local(path, "localize")


def open_memtest(location: str, storage_options: dict[str, Any], option: str) -> tuple[Path, LocalStorage]:
    """``(root, storage)`` of a ``memtest://`` location; ``storage_options["base"]`` overrides the directory."""
    url = split_url(location)
    assert url is not None and url[0] == SCHEME, location
    base = Path(storage_options.get("base") or os.environ["MEMTEST_STORAGE_ROOT"])
    return RemotePath(f"{SCHEME}://{url[1]}"), DirectoryStorage(base)


@unison.hookimpl
def unison_storage_backends() -> dict[str, StorageFactory]:
    return {SCHEME: open_memtest}
