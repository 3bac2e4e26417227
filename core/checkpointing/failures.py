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


def interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is the fallout of a ``KeyboardInterrupt`` or ``SystemExit`` raised inside a writer.

    Ctrl-C landing inside ``torch.save`` surfaces as the zip writer's ``unexpected pos`` RuntimeError (raised
    while the interrupt unwinds it), which ``torch.distributed.checkpoint`` then wraps in a
    ``CheckpointException`` holding each rank's exception: the interrupt is in the chain of causes and
    contexts, or in the wrapped per-rank exceptions.
    """
    pending: list[BaseException] = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, (KeyboardInterrupt, SystemExit)):
            return True
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
        failures = getattr(current, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            for wrapped in failures.values():
                first = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
                if isinstance(first, BaseException):
                    pending.append(first)
    return False


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
