"""Who may write into a checkpoint root, decided before any step: one run per directory, one job per lease.

:class:`Admission` holds the checks a run makes before any process group exists (the root is writable,
the resume point exists and lies within ``max_steps``, no other run's checkpoints would be replaced or
pruned) and the one-writer lease taken right after the process group is up
(:mod:`unison.checkpointing.lease`). Every :class:`~unison.checkpointing.checkpointer.Checkpointer` has one
(``checkpointer.admission``).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from unison.checkpointing.manifest import MANIFEST, CheckpointError, Manifest, barrier, broadcast, rank
from unison.checkpointing.paths import same_dir
from unison.checkpointing.resume import CkptPath, ResumeKind, ResumeRequest
from unison.checkpointing.storage import LocalStorage, open_storage
from unison.errors import ConfigurationError

if TYPE_CHECKING:
    from unison.checkpointing.checkpointer import Checkpointer


class Admission:
    """The checks and the lease that admit one run to write into ``checkpointer.root``."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self.checkpointer = checkpointer
        #: ``(run, resumes_it)`` as :meth:`preflight` found it, reused by :meth:`acquire`.
        self.lease_run: tuple[str, bool] | None = None

    def claim(self, ckpt_path: CkptPath) -> None:
        """Refuse to start a run that would write into another run's checkpoints.

        Called before any process group exists. ``"auto"`` and ``"last"`` take
        the directory over as a resume of its run; a checkpoint inside the
        root resumes that run too. Starting fresh (``None``), or from a
        checkpoint elsewhere, into a root that holds committed checkpoints is
        refused: its saves would replace and prune the other run's.
        """
        c = self.checkpointer
        request = ResumeRequest.parse(ckpt_path)
        if request.newest:
            return
        existing = c.committed()
        if not existing:
            return
        if self.inside_root(request):
            return
        newest = existing[-1].path.name
        asked = "starts fresh" if request.fresh else f"resumes from {request}, outside it,"
        raise ConfigurationError(
            "checkpoint_dir",
            f"{c.root} already holds {len(existing)} committed checkpoint(s) of another run (newest {newest}) "
            f"and this run {asked} so its saves would replace or prune them",
            "resume that run with ckpt_path='auto' (`unison train --resume auto`), or give this run its own "
            "checkpoint_dir, or delete the old checkpoints",
        )

    def preflight(self, ckpt_path: CkptPath, max_steps: int | None) -> None:
        """Checks a run makes before any process group exists (on every rank, local reads only).

        * the root can be created and written (a probe file is written and
          removed), so an unwritable ``checkpoint_dir`` fails now, not at the
          first save after training;
        * ``"last"`` needs a committed checkpoint (``"auto"`` is the form that
          starts fresh when there is none);
        * the checkpoint a run would resume from must not lie beyond
          ``max_steps`` (its manifest's step; verification comes later, on load).
        """
        c = self.checkpointer
        request = ResumeRequest.parse(ckpt_path)
        c.storage.check(c.root)  # object storage: refused credentials, no bucket, no endpoint, named
        run, own_run = self.lease_run = self.lease_identity(request)
        probe = c.root / f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            # Links planted at unison's names: named now, before anything is written (never followed later).
            c.refuse_planted_links()
            # (reading the lease makes its guard file: a root that cannot be a directory fails here, as unwritable)
            if c.lease.refuse_if_held(run if own_run else None):
                # Nobody live writes here, so what interrupted saves left is garbage: removed *before* the
                # probe, or a disk that a crashed save filled would refuse the very resume that cleans it.
                c.clean_partials()
            c.storage.make_root(c.root)
            try:
                c.storage.write_text(probe, "probe", sync=False)
            finally:
                c.storage.remove_file(probe)  # also when the write failed half-way
        except OSError as exc:
            raise ConfigurationError(
                "checkpoint_dir",
                f"{c.root} cannot be written ({type(exc).__name__}: {exc})",
                "choose a directory this process can create and write",
            ) from exc
        if request.fresh:
            return
        readable = [c for c in c.committed() if c.manifest is not None]
        if request.kind is ResumeKind.LAST and not readable:
            raise ConfigurationError(
                "ckpt_path",
                f"'last' but {c.root} holds no committed checkpoint",
                "use ckpt_path='auto' (`--resume auto`), which starts fresh when there is none",
            )
        if request.newest:
            resume_step = readable[-1].manifest.step if readable else None  # type: ignore[union-attr]
        else:
            resume_step = resume_point(request.local_path, c.storage)
        check_resume_step(resume_step, max_steps)

    def acquire(self, ckpt_path: CkptPath) -> None:
        """Take the one-writer lease on the root (collective: every rank, right after the process group is up).

        Rank 0 takes it (:meth:`unison.checkpointing.lease.Lease.acquire`) and broadcasts
        the outcome, so a refusal (another live job writes here) is the same
        :class:`ConfigurationError` on every rank at once; see
        :mod:`unison.checkpointing.lease` for why it is taken here.
        """
        c = self.checkpointer
        run, own_run = self.lease_run or self.lease_identity(ResumeRequest.parse(ckpt_path))
        outcome: tuple[str, ...] = ("ok",)
        # Every rank has read the lease in preflight before rank 0 takes it. Without this, a process group
        # that already existed before fit (the conformance suite's world, a user's own init) lets a slower
        # rank read the lease rank 0 just took for this very job and refuse alone, leaving the ranks
        # in different collectives.
        barrier()
        if rank() == 0:
            try:
                c.lease.acquire(run, own_run=own_run)
            except ConfigurationError as exc:
                outcome = ("refused", exc.option, exc.problem, exc.fix)
            except Exception as exc:
                outcome = ("error", f"{type(exc).__name__}: {exc}")
        outcome = broadcast(outcome)
        if outcome[0] == "refused":
            raise ConfigurationError(*outcome[1:])
        if outcome[0] == "error":
            raise CheckpointError(f"cannot take the lease on {c.root}: {outcome[1]}")
        if not own_run:
            c.run_id = run  # a fresh run: its commits carry the id its lease names

    def release(self) -> None:
        """Give the lease back (rank 0; a no-op elsewhere and when not held)."""
        c = self.checkpointer
        c.lease.release()

    def inside_root(self, request: ResumeRequest) -> bool:
        """A checkpoint path inside this root: its run is the root's own."""
        c = self.checkpointer
        return request.kind is ResumeKind.PATH and same_dir(request.local_path.parent, c.root)

    def lease_identity(self, request: ResumeRequest) -> tuple[str, bool]:
        """``(run, resumes_it)``: the run of the newest commit when this run continues the root's, else a new id."""
        c = self.checkpointer
        if request.newest or self.inside_root(request):
            readable = [c for c in c.committed() if c.manifest is not None]
            if readable:
                return readable[-1].manifest.run, True  # type: ignore[union-attr]
        return uuid.uuid4().hex[:16], False


def resume_point(ckpt_path: str | os.PathLike[str], storage: LocalStorage | None = None) -> int:
    """The step a checkpoint path resumes at, from its manifest; a ConfigurationError when it is no checkpoint.

    Read before any process group exists; the files are verified on load.
    """
    path = Path(ckpt_path)
    if storage is None:
        path, storage = open_storage(ckpt_path)  # a URL (s3://...) is read from its object storage
    if not storage.exists(path / MANIFEST):
        what = "does not exist" if not storage.exists(path) else f"is not a committed unison checkpoint (no {MANIFEST})"
        raise ConfigurationError(
            "ckpt_path",
            f"{path} {what}",
            "pass a committed step-NNNNNNNN directory (see `unison checkpoint inspect DIR`), or 'auto'",
        )
    try:
        return Manifest.read(storage, path).step
    except CheckpointError as exc:
        raise ConfigurationError("ckpt_path", f"{path}: {exc}", "pass another committed checkpoint, or 'auto'") from exc


def check_resume_step(resume_step: int | None, max_steps: int | None) -> None:
    """A run resumed at ``resume_step`` must have steps left (``max_steps`` at or beyond it)."""
    if resume_step is not None and max_steps is not None and resume_step > max_steps:
        raise ConfigurationError(
            "max_steps",
            f"the checkpoint resumes at step {resume_step}, beyond max_steps={max_steps}",
            f"set max_steps to at least {resume_step}, or start without ckpt_path",
        )
