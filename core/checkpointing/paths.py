"""Names inside a checkpoint root: committed step directories, the ``latest`` pointer, RNG files.

:func:`is_unison_name` tells the names unison writes, replaces or removes
directly under a root; a symbolic link at any of them is refused before a run
starts (:meth:`unison.checkpointing.checkpointer.Checkpointer.refuse_planted_links`).
"""

from __future__ import annotations

import re
from pathlib import Path

from unison.checkpointing.manifest import RNG_DIR

LATEST = "latest"
#: ``step-00000010`` or, for a re-save of that step, ``step-00000010.1``.
STEP_NAME = re.compile(r"^step-(\d{8,})(?:\.(\d+))?$")
#: The temporary of an atomic replace (:func:`unison.checkpointing.nofollow.temporary_name`),
#: left behind only by a process killed between writing and renaming it.
TEMPORARY = re.compile(r"^\..+\.\d+\.[0-9a-f]{8}\.tmp$")


def is_unison_name(name: str) -> bool:
    """Whether unison writes, replaces or removes ``name`` directly under a checkpoint root.

    Committed ``step-*`` directories, ``latest``, the lease record and its
    guard, ``.step-*.partial`` saves, temporaries (``.NAME...tmp``, also the
    fixed ``.latest.tmp`` of older versions) and ``.write-probe-*`` files.
    """
    if name == LATEST or STEP_NAME.match(name) or name.startswith((".unison-lease", ".write-probe-")):
        return True
    return name.startswith(".") and name.endswith((".partial", ".tmp"))


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rng_file(directory: Path, rank_: int) -> Path:
    return directory / RNG_DIR / f"rank-{rank_:05d}.pt"


def same_dir(a: Path, b: Path) -> bool:
    """Whether two paths name the same directory (``False`` when either cannot be resolved)."""
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False
