"""What the worlds of tests/test_spawn.py run (importable by spawned ranks)."""

from __future__ import annotations

import os
import time

import torch.distributed as dist

#: Set by :func:`remember` in the rank that runs it; a later world must not see it.
REMEMBERED: str | None = None


def environment(name: str) -> tuple[int, str | None]:
    return dist.get_rank(), os.environ.get(name)


def remember(value: str) -> str | None:
    global REMEMBERED
    before, REMEMBERED = REMEMBERED, value
    return before


def recall() -> str | None:
    return REMEMBERED


def fail_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on cue")
    return os.getpid()


def hang_on_rank_1(pid_dir: str) -> None:
    with open(os.path.join(pid_dir, f"rank-{dist.get_rank()}"), "w") as f:
        f.write(str(os.getpid()))
    if dist.get_rank() == 1:
        time.sleep(600)
