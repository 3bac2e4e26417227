"""What a failed save says: which rank failed with what, and whether the disk is full."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from unison.checkpointing.manifest import rank
from unison.checkpointing.storage import split_url


def describe_failure(exc: BaseException) -> str:
    """``rank R: Type: first line`` of a save failure, as every rank reports it."""
    return f"rank {rank()}: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def disk_full(root: Path, error: BaseException | None) -> int | None:
    """Free bytes on ``root``'s file system when ``error`` means it is full (ENOSPC, or nearly no space left).

    Writers do not all say ENOSPC (torch's zip writer raises ``unexpected
    pos``), so a failed write on a file system with less than 1 MiB (or 1 %)
    free counts as a full disk too. ``None``: not a full local disk.
    """
    if split_url(root) is not None:
        return None  # object storage: no local file system to judge (its staging errors name themselves)
    seen, enospc = error, False
    while seen is not None:
        enospc = enospc or getattr(seen, "errno", None) == errno.ENOSPC
        seen = seen.__cause__ or seen.__context__
    path = root
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    if enospc or usage.free < max(1 << 20, usage.total // 100):
        return usage.free
    return None
