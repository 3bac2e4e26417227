"""Verified, atomic, resumable checkpoints.

Layout under ``checkpoint_dir``::

    step-00000010/           one committed checkpoint
      state/                 the strategy's model + optimizer files (its declared format)
      trainer.pt             rank 0: progress, scheduler, precision, plugin state (plain data)
      rng/rank-00000.pt      every rank's RNG state (plain data)
      manifest.json          written last: who wrote it, and every file's size and sha256
    latest                   names the newest commit (for people and scripts)
    .step-00000012.partial/  a save in progress, or one a crash interrupted (ignored, then removed)

Rules (why each exists):

* A checkpoint is written into ``.step-N.partial/``, its files hashed and
  flushed, ``manifest.json`` written last, and the directory renamed into
  place: a crash at any moment leaves either no checkpoint or a complete one,
  and the previous checkpoints untouched.
* Commits are numbered. "Newest" means the highest commit number, never the
  highest step or name, so resuming from step 10 in a directory that also holds
  step 20 continues correctly, and pruning never removes what was just saved.
* Re-saving a step commits the new copy under a fresh name first and only then
  removes the old one: some complete copy of that step exists at every moment.
* A directory belongs to one run. A run that was not asked to resume refuses a
  directory that already holds committed checkpoints, so nothing of another
  run is ever overwritten or pruned.
* Loading verifies every file against the manifest before any loader opens one
  (:mod:`unison.checkpointing.manifest`); ``ckpt_path="auto"`` falls back to the previous
  commit, with a warning, when the newest does not verify.
* unison's own files hold plain data only and load with
  ``weights_only=True`` (:mod:`unison.checkpointing.safe_io`).

Template method: the public methods (:meth:`Checkpointer.save`,
:meth:`Checkpointer.select`, and :class:`~unison.checkpointing.admission.Admission`) hold these rules and
never touch a file themselves; the ``_`` hooks and the :class:`LocalStorage`
seam do the I/O, so an object-storage backend replaces those and inherits
the rules unchanged.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unison.checkpointing.admission import Admission
from unison.checkpointing.failures import describe_failure, disk_full, interrupted
from unison.checkpointing.lease import Lease
from unison.checkpointing.manifest import (
    MANIFEST,
    TRAINER_STATE,
    CheckpointError,
    CorruptCheckpointError,
    Manifest,
    all_gather,
    broadcast,
    hash_files,
    rank,
    utc_now,
    verify,
)
from unison.checkpointing.nofollow import PlantedLinkError
from unison.checkpointing.paths import (
    LATEST,
    STEP_NAME,
    TEMPORARY,
    is_unison_name,
    rng_file,
    same_dir,
    step_dir_name,
)
from unison.checkpointing.resume import CkptPath, ResumeKind, ResumeRequest
from unison.checkpointing.safe_io import decode_rng, dumps, encode_rng, loads
from unison.checkpointing.storage import LocalStorage, open_storage

__all__ = ["CheckpointError", "Checkpointer", "Committed", "CorruptCheckpointError", "step_dir_name"]


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (e.g. ``auto`` fell back past one that does not verify)."""


@dataclass(frozen=True)
class Committed:
    """One committed checkpoint directory and its manifest (``None`` when unreadable)."""

    path: Path
    manifest: Manifest | None
    problem: str | None = None


class Checkpointer:
    """Writes, finds, verifies and prunes the checkpoints under one root directory."""

    def __init__(
        self, root: str | os.PathLike[str], keep_last_n: int | None = None, storage: LocalStorage | None = None
    ) -> None:
        if storage is None:
            # A URL picks its backend (s3:// -> object storage); an unknown scheme is refused here.
            self.root, self.storage = open_storage(root)
        else:
            self.root, self.storage = (root if isinstance(root, Path) else Path(root)), storage  # keeps a URL path
        self.keep_last_n = keep_last_n
        #: The run this checkpointer writes for; adopted from the checkpoint a
        #: run resumes from (within this root), otherwise made at the first save.
        self.run_id: str | None = None
        #: Step of the checkpoint this run last committed or resumed from in
        #: this root (a save at that step again would only rewrite it).
        self.last_step: int | None = None
        #: Bytes of the last checkpoint this process saved (on every rank: the file sizes are gathered).
        self.last_bytes: int | None = None
        #: The one-writer lease on the root (:mod:`unison.checkpointing.lease`); held by rank 0 between
        #: :meth:`Admission.acquire <unison.checkpointing.admission.Admission.acquire>` and ``release``.
        self.lease = Lease(self.storage, self.root)
        #: Who may write here: the pre-fit checks and the lease (:mod:`unison.checkpointing.admission`).
        self.admission = Admission(self)

    # ======================================================================= #
    # Public: the rules
    # ======================================================================= #
    def committed(self) -> list[Committed]:
        """Committed checkpoints under the root, oldest commit first.

        Those whose manifest cannot be read come first, with ``problem`` set;
        nothing is verified here.
        """
        good, bad = [], []
        for name in self.storage.list_dir(self.root):
            path = self.root / name
            if not STEP_NAME.match(name) or not self.storage.exists(path / MANIFEST):
                continue  # partial, foreign, or an older layout: never ours to touch
            try:
                good.append(Committed(path, Manifest.read(self.storage, path)))
            except (CheckpointError, OSError) as exc:
                bad.append(Committed(path, None, str(exc)))
        good.sort(key=lambda c: c.manifest.commit)  # type: ignore[union-attr]
        return bad + good

    def latest(self) -> Path | None:
        """The newest committed checkpoint (by commit), unverified; ``None`` when there is none."""
        readable = [c for c in self.committed() if c.manifest is not None]
        return readable[-1].path if readable else None

    def resolve(self, ckpt_path: CkptPath) -> Path:
        """``"last"``/``"auto"`` -> the newest committed checkpoint; a path -> itself, if committed (unverified)."""
        request = ResumeRequest.parse(ckpt_path)
        if request.newest:
            path = self.latest()
            if path is None:
                raise FileNotFoundError(f"ckpt_path={str(request)!r} but {self.root} holds no committed checkpoint")
            return path
        path = request.local_path
        if not self.storage.exists(path / MANIFEST):
            raise FileNotFoundError(f"{path} is not a committed unison checkpoint (no {MANIFEST})")
        return path

    def select(self, ckpt_path: CkptPath) -> Committed | None:
        """The checkpoint to resume from, verified (collective: call on every rank).

        * ``"auto"``: the newest commit that verifies; a newer one that does
          not is skipped with a warning; ``None`` when the root holds none
          (start fresh). If commits exist but none verifies, raises.
        * ``"last"``: the newest commit; raises if there is none or it fails.
        * a path: that checkpoint; raises if it is not committed or fails.

        Leftover ``.partial`` directories are removed once the choice is made.
        """
        request = ResumeRequest.parse(ckpt_path)
        auto = request.kind is ResumeKind.AUTO
        if request.newest:
            entries = self.committed()
            unreadable = [c for c in entries if c.manifest is None]
            candidates = [c.path for c in reversed(entries) if c.manifest is not None]
            if not auto:
                if unreadable and not candidates:
                    raise CheckpointError(unreadable[0].problem or "unreadable manifest")
                if not candidates:
                    raise FileNotFoundError(f"ckpt_path='last' but {self.root} holds no committed checkpoint")
                candidates = candidates[:1]
            for c in unreadable:
                self._warn(f"skipping {c.path}: {c.problem}")
            if auto and not candidates and not unreadable:
                if rank() == 0:
                    self.clean_partials()
                return None
        else:
            candidates = [self.resolve(request)]
        failures = []
        for path in candidates:
            try:
                manifest = verify(self.storage, path)
            except CorruptCheckpointError as exc:
                if not auto:
                    raise
                failures.append(str(exc))
                self._warn(f"{exc}; falling back to the previous committed checkpoint")
                continue
            if same_dir(path.parent, self.root):
                self.run_id = manifest.run  # continuing this directory's run
                self.last_step = manifest.step
                if rank() == 0:
                    self.clean_partials()
            return Committed(path, manifest)
        reasons = "; ".join(failures) or "all manifests unreadable"
        raise CheckpointError(
            f"no committed checkpoint under {self.root} verifies ({reasons}); "
            "inspect them with `unison checkpoint verify`, move them away to start fresh"
        )

    def save(self, step: int, write: Callable[[Path], dict[str, Any]]) -> Path:
        """Write and commit a checkpoint for ``step`` (collective: call on every rank).

        ``write(directory)`` writes this rank's files and returns the
        description the manifest records (``strategy``, ``world_size``,
        ``precision``, ``state_dict``; rank 0's is kept). Returns the committed
        directory on every rank.
        """
        partial = self.root / f".{step_dir_name(step)}.partial"
        self._on_rank_zero(lambda: self._begin(partial, step), "prepare the checkpoint directory")
        failure: BaseException | None = None
        try:
            description = self._write(partial, write)
        except (KeyboardInterrupt, SystemExit):
            raise  # an interrupt or a stop: the next start cleans the partial directory
        except BaseException as exc:  # torch's DCP CheckpointException is a BaseException
            if interrupted(exc):  # Ctrl-C inside a writer, reported by it as its own error: an interrupt
                raise KeyboardInterrupt from None
            failure = exc
        # Every rank's outcome (this doubles as the barrier: every rank's files are on disk).
        failed = [f for f in all_gather(None if failure is None else describe_failure(failure)) if f is not None]
        if failed:
            message = self._on_rank_zero(lambda: self._abandon(partial, step, failure, failed), "clean up")
            if failure is not None and not message.startswith("ENOSPC"):
                raise failure  # this rank's own error, as the writer raised it (its partial files are gone)
            raise CheckpointError(message) from failure
        files = hash_files(self.storage, partial, sync=True)
        self.last_bytes = sum(f.size for f in files.values())

        def commit() -> str:
            self.lease.check()  # another job took the directory over: never commit beside it
            try:
                self.storage.write_text(partial / MANIFEST, self._manifest(step, files, description).to_json())
            except Exception as exc:
                raise CheckpointError(self._abandon(partial, step, exc, [describe_failure(exc)])) from exc
            return self._publish(partial, step)

        final = self.root / self._on_rank_zero(commit, "commit the checkpoint")
        self.last_step = step
        return final

    def _manifest(self, step: int, files: dict[str, Any], description: dict[str, Any]) -> Manifest:
        entries = self.committed()
        self.run_id = self.run_id or uuid.uuid4().hex[:16]
        return Manifest(
            unison_version=_unison_version(),
            torch_version=torch.__version__,
            run=self.run_id,
            commit=max((c.manifest.commit for c in entries if c.manifest), default=0) + 1,
            step=step,
            created=utc_now(),
            files=files,
            **description,
        )

    def _publish(self, partial: Path, step: int) -> str:
        """The commit point and what follows it: rename into place, ``latest``, replaced copies, retention."""
        entries = self.committed()
        final = self._free_name(step)
        self._commit(partial, final)  # the commit point
        self._point_latest(final.name)
        # The older copies of this step of this run are now replaced.
        for c in entries:
            if c.manifest and c.manifest.step == step and c.manifest.run == self.run_id:
                self._remove(c.path)
        self._prune(keep=final)
        return final.name

    # ======================================================================= #
    # unison's own files: plain data only
    # ======================================================================= #
    def write_trainer_state(self, directory: Path, state: dict[str, Any], *, write: bool) -> None:
        """Serialise on every rank (so a state that cannot be saved fails on all ranks alike); ``write`` on one."""
        data = dumps(state, "the trainer state (unison_on_save_checkpoint)")
        if write:
            self.storage.write_bytes(directory / TRAINER_STATE, data, sync=False)

    def read_trainer_state(self, path: Path) -> dict[str, Any]:
        return loads(self.storage.read_bytes(path / TRAINER_STATE), str(path / TRAINER_STATE))

    def write_rng(self, directory: Path, rank_: int, state: dict[str, Any]) -> None:
        self.storage.write_bytes(rng_file(directory, rank_), dumps(encode_rng(state), "the RNG state"), sync=False)

    def read_rng(self, path: Path, rank_: int) -> dict[str, Any] | None:
        """This rank's RNG state, or ``None`` when the checkpoint has none for it (another world size)."""
        file = rng_file(path, rank_)
        if not self.storage.exists(file):
            return None
        return decode_rng(loads(self.storage.read_bytes(file), str(file)))

    # ======================================================================= #
    # Hooks: the I/O
    # ======================================================================= #
    def _begin(self, partial: Path, step: int) -> None:
        try:
            self.storage.make_root(self.root)
            self.clean_partials()  # leftovers of interrupted saves: never committed, and this run holds the lease
            self.storage.make_dir(partial)
        except OSError as exc:
            raise CheckpointError(self._abandon(partial, step, exc, [describe_failure(exc)])) from exc

    def _abandon(self, partial: Path, step: int, error: BaseException | None, failed: list[str]) -> str:
        """Remove a failed save's partial directory (rank 0) and say why it failed, in one message.

        A full disk is named as such (``ENOSPC``, the path, about how many
        bytes the save needed), whatever the writer raised: torch's zip writer
        reports it as ``unexpected pos``. The committed checkpoints are never
        touched.
        """
        written = self._bytes_under(partial)
        full = disk_full(self.root, error)  # judged before the partial files give their space back
        self._remove(partial)
        newest = next((c for c in reversed(self.committed()) if c.manifest is not None), None)
        kept = f"the last committed checkpoint {newest.path.name} is untouched" if newest else "nothing was committed"
        if full is not None:
            needed = max(written, newest.manifest.total_bytes if newest and newest.manifest else 0)
            return (
                f"ENOSPC: no space left on {self.root} ({full} bytes free), needed about {needed} bytes to save "
                f"step {step}; the partial save was removed and {kept}. Free space, then resume with "
                "--resume auto (ckpt_path='auto')"
            )
        reasons = "; ".join(failed)
        return f"saving step {step} into {self.root} failed ({reasons}); the partial save was removed and {kept}"

    def _bytes_under(self, path: Path) -> int:
        try:
            return sum(self.storage.size(path / name) for name in self.storage.list_files(path))
        except OSError:
            return 0

    def _write(self, directory: Path, write: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
        # Strategies write to a local directory; remote storage uploads this rank's files afterwards.
        with self.storage.staged(directory) as local:
            return write(local)

    def _free_name(self, step: int) -> Path:
        base = step_dir_name(step)
        path, n = self.root / base, 0
        while self.storage.exists(path):
            n += 1
            path = self.root / f"{base}.{n}"
        return path

    def _commit(self, partial: Path, final: Path) -> None:
        self.storage.commit_dir(partial, final)

    def _point_latest(self, name: str) -> None:
        self.storage.replace_file(self.root / LATEST, name + "\n")

    def _remove(self, path: Path) -> None:
        self.storage.remove_tree(path)

    def clean_partials(self) -> None:
        """Remove what interrupted saves left: ``.partial`` directories and unfinished object-storage commits."""
        for name in self.storage.list_dir(self.root):
            if name.startswith(".") and name.endswith(".partial"):
                self._remove(self.root / name)
            elif name.startswith(".write-probe-") or TEMPORARY.match(name):
                # a probe older versions left when its write failed; a replace's temporary a kill left
                self.storage.remove_file(self.root / name)
        for name in self.storage.interrupted_commits(self.root):
            self._remove(self.root / name)

    def refuse_planted_links(self) -> None:
        """Refuse (:class:`~unison.checkpointing.nofollow.PlantedLinkError`, exit 2) a symbolic link at any
        name unison writes, replaces or removes under the root (:func:`~unison.checkpointing.paths.is_unison_name`).

        Checked before a run starts, so a planted ``.step-N.partial`` or
        ``.latest.tmp`` is named at once; the storage's no-follow writes
        refuse one planted later. The link is not removed: unison did not
        make it.
        """
        links = self.storage.planted_links(self.root, is_unison_name)
        if links:
            raise PlantedLinkError(links[0])

    def _prune(self, keep: Path) -> None:
        """Keep the newest ``keep_last_n`` commits of this run; never ``keep`` nor ``latest``'s target."""
        if not self.keep_last_n:
            return
        mine = [c for c in self.committed() if c.manifest is not None and c.manifest.run == self.run_id]
        protected = {keep.name, self._latest_pointer()}
        for c in mine[: -self.keep_last_n]:
            if c.path.name not in protected:
                self._remove(c.path)

    def _latest_pointer(self) -> str | None:
        try:
            return self.storage.read_text(self.root / LATEST).strip()
        except FileNotFoundError:
            return None

    def _on_rank_zero(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` on rank 0 and hand its result, or its failure, to every rank.

        Without this a failure on rank 0 (a full disk) would leave the other
        ranks waiting in the next collective until the process-group timeout.
        """
        result: tuple[str, Any] = ("ok", None)
        error: BaseException | None = None
        if rank() == 0:
            try:
                result = ("ok", fn())
            except Exception as exc:
                error = exc
                result = ("error", f"{type(exc).__name__}: {exc}")
        status, value = broadcast(result)
        if error is not None:
            raise error
        if status == "error":
            raise CheckpointError(f"rank 0 failed to {what}: {value}")
        return value

    def _warn(self, message: str) -> None:
        if rank() == 0:
            warnings.warn(message, CheckpointWarning, stacklevel=3)


def _unison_version() -> str:
    from unison._version import __version__

    return __version__
