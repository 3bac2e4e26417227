"""Atomic, resumable checkpoints.

Layout under ``checkpoint_dir``::

    step-00000010/           one committed checkpoint
      state/                 the strategy's model + optimizer files (its declared format)
      trainer.pt             rank 0: progress, scheduler, precision, plugin state
      rng/rank-00000.pt      every rank's RNG state
      meta.json              written last: strategy, world size, step, format
    latest                   text file naming the newest committed checkpoint

Template method: the public :meth:`Checkpointer.save` holds the rules that must
never vary (write into a ``.partial`` directory, barrier, commit with one
``rename``, then move ``latest`` with ``os.replace``) and :meth:`Checkpointer.resolve`
finds only committed checkpoints; the ``_write``, ``_point_latest`` and ``_prune``
hooks do the I/O. The rules live in one place because a crash at any point must
leave the previous checkpoint, and ``latest``, untouched.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

LATEST = "latest"
META = "meta.json"


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _is_zero() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) or torch.distributed.get_rank() == 0


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


class Checkpointer:
    """Writes and finds checkpoints under one root directory."""

    def __init__(self, root: str | os.PathLike[str], keep_last_n: int | None = None) -> None:
        self.root = Path(root)
        self.keep_last_n = keep_last_n

    # -- public: the rules --------------------------------------------------- #
    def save(self, step: int, write: Callable[[Path], dict[str, Any]]) -> Path:
        """Write a checkpoint for ``step`` atomically; collective on every rank.

        ``write(directory)`` writes the files of this rank and returns the
        metadata dict (only rank 0's is kept).
        """
        final = self.root / step_dir_name(step)
        partial = self.root / f".{step_dir_name(step)}.partial"
        if _is_zero():
            self.root.mkdir(parents=True, exist_ok=True)
            if partial.exists():  # left by a crash: never committed, safe to drop
                shutil.rmtree(partial)
            partial.mkdir()
        _barrier()
        meta = self._write(partial, write)
        _barrier()
        if _is_zero():
            (partial / META).write_text(json.dumps(meta, indent=2, sort_keys=True))
            if final.exists():  # re-saving the same step: replace it as a whole
                shutil.rmtree(final)
            os.rename(partial, final)  # the commit point
            self._point_latest(final.name)
            self._prune()
        _barrier()
        return final

    def resolve(self, ckpt_path: str | os.PathLike[str]) -> Path:
        """``"last"`` -> the newest committed checkpoint; a path -> itself, checked."""
        if str(ckpt_path) == "last":
            pointer = self.root / LATEST
            if not pointer.exists():
                raise FileNotFoundError(f"ckpt_path='last' but {self.root} holds no committed checkpoint")
            path = self.root / pointer.read_text().strip()
        else:
            path = Path(ckpt_path)
        if not (path / META).exists():
            raise FileNotFoundError(f"{path} is not a committed unison checkpoint (no {META})")
        return path

    def latest(self) -> Path | None:
        try:
            return self.resolve("last")
        except FileNotFoundError:
            return None

    @staticmethod
    def read_meta(path: Path) -> dict[str, Any]:
        return json.loads((path / META).read_text())

    # -- hooks: the I/O ---------------------------------------------------- #
    def _write(self, directory: Path, write: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
        return write(directory)

    def _point_latest(self, name: str) -> None:
        tmp = self.root / f".{LATEST}.tmp"
        tmp.write_text(name + "\n")
        os.replace(tmp, self.root / LATEST)

    def _prune(self) -> None:
        if not self.keep_last_n:
            return
        committed = sorted(p for p in self.root.glob("step-*") if (p / META).exists())
        for old in committed[: -self.keep_last_n]:
            shutil.rmtree(old, ignore_errors=True)
