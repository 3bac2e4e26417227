"""Writing and deleting inside a directory without ever following a symbolic link.

unison writes only inside the directories the user named. A link planted at
one of the names it writes (``.latest.tmp`` pointing to a file elsewhere,
``.step-00000010.partial`` pointing to a directory elsewhere) would otherwise
carry its writes, or its deletes, outside them. The rules, used by
:class:`~unison.checkpointing.storage.LocalStorage` and by the run and metric
files of :mod:`unison.plugins.loggers`:

* a new file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW``
  (:func:`create_new`): never an existing file, never through a link;
* a whole file is replaced by writing a *fresh, random* temporary name that
  way and ``os.replace``-ing it onto the final name (:func:`replace_atomically`):
  nobody can plant the temporary in advance, and a rename never writes
  through a link;
* an existing file is opened with ``O_NOFOLLOW`` (:func:`open_nofollow`);
* a link found where unison would write, replace or remove is refused with a
  :class:`PlantedLinkError` (exit code 2) naming the link and its target.
  Neither the link nor its target is deleted: unison made no link, so the
  person who did decides what it is for.

The one link that is followed is a root the user named (``checkpoint_dir``,
``root_dir``, ``[logging] dir``): that is their choice of where files go.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from pathlib import Path

from unison.errors import ConfigurationError


class PlantedLinkError(ConfigurationError):
    """A symbolic link at a name unison writes, replaces or removes; unison never writes through one.

    Exit code 2. ``link`` is the path of the link. The link was not made by
    unison (it makes none), so it is neither followed nor deleted: the message
    asks the person who can tell what it is for to remove it.
    """

    def __init__(self, link: str | os.PathLike[str], option: str = "checkpoint_dir") -> None:
        self.link = Path(link)
        try:
            target = f" (pointing to {os.readlink(link)})"
        except OSError:
            target = ""
        super().__init__(
            option,
            f"{self.link} is a symbolic link{target} at a name unison writes or removes; unison never writes or "
            "deletes through a link",
            f"remove the link {self.link} (unison did not make it), or give this run another directory",
        )


def refuse_link(path: str | os.PathLike[str], option: str = "checkpoint_dir") -> None:
    """Raise :class:`PlantedLinkError` when ``path`` itself is a symbolic link (its parents may be)."""
    if os.path.islink(path):
        raise PlantedLinkError(path, option)


def create_new(path: str | os.PathLike[str], option: str = "checkpoint_dir") -> int:
    """A write descriptor of a *new* file at ``path``: never an existing file, never through a link.

    ``O_EXCL`` makes the name ours; ``O_NOFOLLOW`` (and ``O_EXCL`` itself)
    refuses a link planted there, which is raised as :class:`PlantedLinkError`.
    """
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        refuse_link(path, option)
        raise


def open_nofollow(path: str | os.PathLike[str], flags: int, option: str = "checkpoint_dir") -> int:
    """``os.open(path, flags | O_NOFOLLOW)``; a link at ``path`` is a :class:`PlantedLinkError`."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise PlantedLinkError(path, option) from None
        raise


def temporary_name(path: Path) -> Path:
    """A fresh hidden sibling of ``path`` for an atomic replace (random: nobody can plant it in advance)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def replace_atomically(path: Path, data: bytes, option: str = "checkpoint_dir", *, sync: bool = True) -> None:
    """Write ``data`` to ``path``: a new temporary made with :func:`create_new`, then renamed onto ``path``.

    Readers see the old content or the new, never a mix. A link at ``path``
    is refused (the rename would replace the link itself, never write
    through it, but a link where unison keeps a file is not unison's).
    """
    refuse_link(path, option)
    tmp = temporary_name(path)
    fd = create_new(tmp, option)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
