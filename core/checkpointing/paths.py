"""Names inside a checkpoint root: committed step directories, the ``latest`` pointer, RNG files."""

from __future__ import annotations

import re
from pathlib import Path

from unison.checkpointing.manifest import RNG_DIR

LATEST = "latest"
#: ``step-00000010`` or, for a re-save of that step, ``step-00000010.1``.
STEP_NAME = re.compile(r"^step-(\d{8,})(?:\.(\d+))?$")


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
