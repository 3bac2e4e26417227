"""``manifest.json``: what a checkpoint is, and proof that its files are intact.

Every committed checkpoint ends with a manifest, written after every other
file: the unison and torch versions, the strategy, world size, step and
precision that wrote it, the run it belongs to and its commit number (the
order in which checkpoints of a directory were committed), and every file
under the checkpoint with its size and sha256.

Loading verifies the manifest *before* any file is opened by a loader, so a
truncated, altered or swapped file is refused with its name instead of
resuming into a wrong model. Hashing is shared out over the ranks of the world
(rank ``r`` hashes files ``r, r + world, ...``) and the results are gathered,
so every rank reaches the same verdict and a large checkpoint costs
``size / world`` of reading per rank.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pydantic
import torch

from unison.checkpointing.safe_io import check_pickles
from unison.checkpointing.storage import LocalStorage
from unison.errors import UnisonError

MANIFEST = "manifest.json"
#: unison's own files in a checkpoint (plain data, loaded with weights_only=True).
TRAINER_STATE = "trainer.pt"
RNG_DIR = "rng"
#: The layout version; a reader refuses a manifest of a format it does not know.
FORMAT = "unison-checkpoint/1"


class CheckpointError(UnisonError):
    """A checkpoint that cannot be trusted or used; the message names the checkpoint (and file)."""


class CorruptCheckpointError(CheckpointError):
    """A file of a checkpoint is missing, truncated, altered or unexpected.

    ``path`` is the checkpoint, ``file`` the offending file relative to it.
    """

    def __init__(self, path: Path, file: str, problem: str) -> None:
        self.path, self.file, self.problem = path, file, problem
        super().__init__(f"checkpoint {path} is corrupt: {file}: {problem}; refusing to load it")


class FileEntry(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    size: int = pydantic.Field(ge=0)
    """Bytes."""
    sha256: str = pydantic.Field(pattern=r"^[0-9a-f]{64}$")
    """Hex digest of the whole file."""


class Manifest(pydantic.BaseModel):
    """The contents of ``manifest.json``."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    format: str = FORMAT
    """Layout version of the checkpoint."""
    unison_version: str
    """unison that wrote it."""
    torch_version: str
    """torch that wrote it."""
    run: str
    """Id of the run the checkpoint belongs to (kept across resumes)."""
    commit: int = pydantic.Field(ge=1)
    """Commit number within its directory: later commits have larger numbers."""
    step: int = pydantic.Field(ge=0)
    """Optimizer steps completed when it was written."""
    strategy: str
    """Strategy name that wrote it."""
    world_size: int = pydantic.Field(ge=1)
    """Processes that wrote it."""
    precision: str
    """Precision of the run that wrote it."""
    state_dict: dict[str, Any]
    """The strategy's state_dict declaration (kind, format, reshardable)."""
    created: str
    """UTC time of the commit, ISO 8601."""
    files: dict[str, FileEntry]
    """Every file of the checkpoint except this manifest, by POSIX path relative to it."""

    @classmethod
    def read(cls, storage: LocalStorage, path: Path) -> Manifest:
        """Parse ``path/manifest.json``; a malformed one is a :class:`CorruptCheckpointError`."""
        try:
            raw = json.loads(storage.read_text(path / MANIFEST))
        except FileNotFoundError:
            raise
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptCheckpointError(path, MANIFEST, f"unreadable ({exc})") from None
        if isinstance(raw, dict) and raw.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {path} has format {raw.get('format')!r}; this unison reads {FORMAT!r}")
        try:
            return cls.model_validate(raw)
        except pydantic.ValidationError as exc:
            raise CorruptCheckpointError(path, MANIFEST, f"invalid ({exc.errors()[0]['msg']})") from None

    def to_json(self) -> str:
        return json.dumps(self.model_dump(), indent=2, sort_keys=True) + "\n"

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------- #
# Collectives that also work without a process group (world of one).
# --------------------------------------------------------------------------- #
def _dist_on() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank() -> int:
    return torch.distributed.get_rank() if _dist_on() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if _dist_on() else 1


def barrier() -> None:
    if _dist_on():
        torch.distributed.barrier()


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not _dist_on():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, by rank, on every rank."""
    if not _dist_on():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


# --------------------------------------------------------------------------- #
# Hashing and verification (collective).
# --------------------------------------------------------------------------- #
def hash_files(storage: LocalStorage, directory: Path, *, sync: bool) -> dict[str, FileEntry]:
    """Size and sha256 of every file under ``directory`` (collective; same result on every rank).

    Rank 0 lists the directory (after the caller's barrier, so every rank's
    files are there) and the ranks share the hashing.
    """
    files: list[str] = broadcast(storage.list_files(directory) if rank() == 0 else None)
    mine = {}
    for name in files[rank() :: world_size()]:
        size, sha = storage.digest(directory / name, sync=sync)
        mine[name] = {"size": size, "sha256": sha}
    merged: dict[str, FileEntry] = {}
    for part in all_gather(mine):
        merged.update({k: FileEntry(**v) for k, v in part.items()})
    return {k: merged[k] for k in sorted(merged)}


def _check_files(storage: LocalStorage, path: Path, manifest: Manifest, names: list[str]) -> list[tuple[str, str]]:
    problems = []
    for name in names:
        entry = manifest.files[name]
        file = path / name
        if not storage.exists(file):
            problems.append((name, "missing"))
            continue
        try:
            size = storage.size(file)
            if size != entry.size:
                problems.append((name, f"size {size} bytes, the manifest says {entry.size} (truncated or altered)"))
                continue
            _, sha = storage.digest(file)
        except OSError as exc:  # reported like any other problem, so no rank leaves the collective early
            problems.append((name, f"unreadable ({exc})"))
            continue
        if sha != entry.sha256:
            problems.append(
                (name, f"sha256 {sha[:16]}... does not match the manifest's {entry.sha256[:16]}... (altered)")
            )
    return problems


def verify(storage: LocalStorage, path: Path) -> Manifest:
    """Check every file of the checkpoint at ``path`` against its manifest (collective).

    Then, once the bytes are known to be the committed ones, check that no
    file would run code when its loader unpickles it
    (:func:`unison.checkpointing.safe_io.check_pickles`). Returns the manifest. Raises
    :class:`CorruptCheckpointError` naming the first bad file (in path order,
    the same on every rank), or ``FileNotFoundError`` when ``path`` holds no
    manifest.
    """
    manifest = Manifest.read(storage, path)
    names = sorted(manifest.files)
    problems = _check_files(storage, path, manifest, names[rank() :: world_size()])
    if rank() == 0:
        # Files nobody vouched for: an interrupted write or a planted file.
        listed = set(manifest.files) | {MANIFEST}
        problems += [(n, "not listed in the manifest") for n in storage.list_files(path) if n not in listed]
    found = sorted(p for part in all_gather(problems) for p in part)
    if not found and rank() == 0:
        own = {n for n in names if n == TRAINER_STATE or n.startswith(RNG_DIR + "/")}
        found = check_pickles(path, names, storage, own)
    if world_size() > 1:
        found = broadcast(found)
    if found:
        name, problem = found[0]
        raise CorruptCheckpointError(path, name, problem)
    return manifest
