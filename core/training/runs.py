"""Run directories: every fit under ``root_dir`` owns a fresh ``root_dir/version_N``.

With ``root_dir`` set (``Trainer(root_dir="runs/tinylm")``, ``[trainer]
root_dir`` in a config file) each fit writes all of its files into one
directory::

    runs/tinylm/
      version_0/             the first run: run.json, metrics.jsonl, metrics.csv, tensorboard/
        checkpoints/         its checkpoints (unless checkpoint_dir names another place)
      version_1/             the next run (a rerun, another strategy, another --nproc)

Rules (why each exists):

* A fresh run never writes into an earlier run's directory, so rerunning a
  command or swapping the strategy keeps every earlier run's checkpoints and
  metrics, and nothing has to be refused.
* ``N`` is one more than the highest existing version and the directory is
  made with an exclusive ``mkdir`` (retried with the next number when it
  exists): two jobs starting together never share a version.
* ``ckpt_path="auto"`` (``--resume auto``) continues the newest version
  (highest ``N``) that holds a committed checkpoint, *in that version*: its
  metrics continue the same files, so a resumed run is one series without
  duplicate steps. With no checkpoint anywhere it starts a fresh version.
  ``"last"`` does the same but needs a checkpoint. A checkpoint path inside
  ``root_dir/version_K/checkpoints`` continues version ``K``; one elsewhere
  starts a fresh version.
* The version is chosen once per job, before any worker trains: ``unison
  train``'s launcher chooses it and hands it to its workers in
  ``UNISON_RUN_DIR``; a single process chooses it in ``fit``; ranks started by
  a bare ``torchrun`` take global rank 0's choice. Every rank then writes to
  that one resolved path.

``root_dir`` is a local path; runs in object storage are configured with
``checkpoint_dir`` and ``[logging] dir`` URLs instead.

Without a ``root_dir`` and without loggers of its own, a fit still records its
metrics: the default JSONL and CSV loggers write into a fresh
``runs/NAME/version_N`` under the working directory (:func:`default_root`;
``NAME`` is the script's name, ``train.py`` -> ``train``), and checkpoints stay
off unless ``checkpoint_dir`` is set. ``Trainer(loggers=False)`` writes no
metrics files at all.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unison.checkpointing.admission import resume_point
from unison.checkpointing.checkpointer import Checkpointer
from unison.checkpointing.nofollow import refuse_link
from unison.checkpointing.resume import ResumeKind, ResumeRequest
from unison.checkpointing.storage import split_url
from unison.errors import ConfigurationError

#: Environment variable through which a launcher hands its workers the run directory it chose.
RUN_DIR_ENV = "UNISON_RUN_DIR"
#: Environment variable naming the directory that holds default runs instead of ``./runs``.
DEFAULT_ROOT_ENV = "UNISON_RUNS_ROOT"
#: A run's checkpoints inside its version directory.
CHECKPOINTS = "checkpoints"
_VERSION = re.compile(r"version_(\d+)")

__all__ = [
    "CHECKPOINTS",
    "DEFAULT_ROOT_ENV",
    "RUN_DIR_ENV",
    "RunPlace",
    "agree",
    "check_root",
    "choose_for_workers",
    "default_root",
    "new_version",
    "plan_run",
    "prepare",
    "versions",
]


def check_root(root_dir: str) -> Path:
    """``root_dir`` as a local path; a URL is refused naming the settings that take one."""
    url = split_url(root_dir)
    if url is not None and url[0] != "file":
        raise ConfigurationError(
            "root_dir",
            f"{root_dir!r} is in object storage; root_dir is a local directory",
            "set checkpoint_dir and [logging] dir to the s3:// URL instead (each run still gets its own version_N "
            "for metrics), or use a local root_dir",
        )
    return Path("/" + url[1]) if url is not None else Path(root_dir)


def run_name(argv0: str | None = None) -> str:
    """The name of this program's default runs: the script's stem (``train.py``, ``python -m pkg.train``:
    ``train``; a package's ``__main__.py``: the package), ``"unison"`` without a script (``python -c``,
    an interactive session, a notebook kernel)."""
    arg = sys.argv[0] if argv0 is None and sys.argv else (argv0 or "")
    path = Path(arg)
    if not arg or arg.startswith("-") or path.stem in ("ipykernel_launcher", ""):
        return "unison"
    if path.stem == "__main__":
        return path.absolute().parent.name or "unison"
    return path.stem


def default_root() -> Path:
    """Where a fit without ``root_dir`` and without loggers of its own writes its metrics' versions:
    ``$UNISON_RUNS_ROOT/NAME`` when that variable is set, else ``./runs/NAME`` (absolute, made at the
    first fit; see :func:`run_name`)."""
    base = os.environ.get(DEFAULT_ROOT_ENV) or "runs"
    return (Path(base) / run_name()).absolute()


def versions(root: Path) -> list[tuple[int, Path]]:
    """``(N, root/version_N)`` for every version directory under ``root``, lowest ``N`` first.

    A ``version_N`` that is a symbolic link is refused (a PlantedLinkError naming it): unison makes
    every version with ``mkdir`` and never writes through a link (:mod:`unison.checkpointing.nofollow`).
    """
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if (m := _VERSION.fullmatch(p.name)) is not None:
            refuse_link(p, "root_dir")
            if p.is_dir():
                found.append((int(m.group(1)), p))
    return sorted(found)


def new_version(root: Path, taken: list[str] | tuple[str, ...] = ()) -> Path:
    """Create and return ``root/version_N`` with N above every existing version (race-free locally).

    ``taken`` adds names held elsewhere (the versions already in object storage).
    """
    root.mkdir(parents=True, exist_ok=True)
    names = [p.name for p in root.iterdir()] + list(taken)
    numbers = [int(m.group(1)) for name in names if (m := _VERSION.fullmatch(name))]
    n = max(numbers, default=-1) + 1
    while True:
        path = root / f"version_{n}"
        try:
            path.mkdir()  # exclusive: fails if a concurrent run took this number first
            return path
        except FileExistsError:
            n += 1


def plan_run(root_dir: str, request: ResumeRequest, checkpoints_inside: bool) -> Path | None:
    """The version directory a fit continues, or ``None`` for a fresh one (reads only; creates nothing).

    ``checkpoints_inside``: the run's checkpoints live in
    ``version_N/checkpoints`` (no explicit ``checkpoint_dir``), so a resume
    continues the version that holds its checkpoint; otherwise every fit
    gets a fresh version. A launcher's choice in :data:`RUN_DIR_ENV` wins
    when it lies under ``root_dir``.
    """
    root = check_root(root_dir).absolute()
    given = os.environ.get(RUN_DIR_ENV)
    if given and Path(given).parent == root:
        return Path(given)  # the launcher chose (and made) it; a restarted worker continues it
    if request.fresh or not checkpoints_inside:
        return None
    if request.newest:
        for _, version in reversed(versions(root)):
            if Checkpointer(version / CHECKPOINTS).latest() is not None:
                return version
        if request.kind is ResumeKind.LAST:
            raise ConfigurationError(
                "ckpt_path",
                f"'last' but no run under {root} holds a committed checkpoint",
                "use ckpt_path='auto' (`--resume auto`), which starts a fresh run when there is none",
            )
        return None
    path = request.local_path.absolute()
    inside = path.parent.name == CHECKPOINTS and path.parent.parent.parent == root
    return path.parent.parent if inside else None


def resume_step(checkpointer: Checkpointer, request: ResumeRequest) -> tuple[int, str] | None:
    """``(step, path)`` of the checkpoint a fit will resume from, from its manifest (unverified: read before
    any process group; ``None`` for a fresh start)."""
    if request.fresh:
        return None
    if request.newest:
        readable = [c for c in checkpointer.committed() if c.manifest is not None]
        return (readable[-1].manifest.step, str(readable[-1].path)) if readable else None  # type: ignore[union-attr]
    assert request.path is not None
    return resume_point(request.path), str(request)


@dataclass(frozen=True)
class RunPlace:
    """Where one fit writes: its run directory, the checkpointer that writes into it, and the checkpoint
    it resumes from as read before any process group (:func:`prepare`; ranks agree on it in :func:`agree`)."""

    #: ``root_dir/version_N``; ``None`` without a ``root_dir``, or until :func:`agree` names it.
    run_dir: Path | None = None
    checkpointer: Checkpointer | None = None
    #: ``{"step": N, "checkpoint": PATH}`` of the checkpoint a resume will load (from its manifest), or ``None``.
    resumed_from: Mapping[str, Any] | None = None


def prepare(settings: Any, request: ResumeRequest, world_size: int, checkpointer: Checkpointer | None) -> RunPlace:
    """Before the process group: choose (or find) the run directory and the checkpointer that writes into it.

    ``checkpointer`` is the explicit ``checkpoint_dir``'s, if any. The run
    directory is made now unless ranks of a bare ``torchrun`` must agree on it
    (then :func:`agree` makes it); the checkpointer writes into
    ``version_N/checkpoints`` without an explicit ``checkpoint_dir``.
    """
    s, run_dir = settings, None
    if s.root_dir is not None:
        inside = s.checkpoint_dir is None
        run_dir = plan_run(s.root_dir, request, inside)
        if run_dir is None and world_size == 1:
            run_dir = new_version(check_root(s.root_dir).absolute())
        if inside:
            # Until agree() names the version, the root stands in: writable, and it holds no step directories.
            where = run_dir / CHECKPOINTS if run_dir is not None else check_root(s.root_dir).absolute()
            if run_dir is not None:
                refuse_links_in(run_dir)
            checkpointer = Checkpointer(where, s.keep_last_n_checkpoints)
    found = resume_step(checkpointer, request) if checkpointer is not None else None
    return RunPlace(run_dir, checkpointer, {"step": found[0], "checkpoint": found[1]} if found else None)


def agree(settings: Any, place: RunPlace, rank: int) -> RunPlace:
    """After the process group: ranks of a bare ``torchrun`` take global rank 0's fresh version (collective
    when no version was chosen before it; ``place`` itself otherwise)."""
    s = settings
    if s.root_dir is None or place.run_dir is not None:
        return place
    from unison.checkpointing.manifest import broadcast

    chosen = str(new_version(check_root(s.root_dir).absolute())) if rank == 0 else None
    run_dir = Path(broadcast(chosen))
    checkpointer = place.checkpointer
    if s.checkpoint_dir is None:
        checkpointer = Checkpointer(run_dir / CHECKPOINTS, s.keep_last_n_checkpoints)
    return dataclasses.replace(place, run_dir=run_dir, checkpointer=checkpointer)


def refuse_links_in(version: Path) -> None:
    """Refuse a run directory that a fit continues when anything directly in it is a symbolic link.

    Everything in ``version_N`` (``run.json``, the metrics files, ``checkpoints/``) was made by unison,
    which makes no links; writing on through one would write outside the run's directories. Checked
    before training (a PlantedLinkError naming the link, exit code 2).
    """
    try:
        entries = sorted(os.scandir(version), key=lambda e: e.name)
    except OSError:
        return  # not made yet
    for entry in entries:
        refuse_link(entry.path, "root_dir")


def choose_for_workers(settings: Any, request: ResumeRequest) -> None:
    """In a launcher, before any worker starts: the checks and the choice of a single-node job's run directory.

    An explicit ``checkpoint_dir`` holding another run's checkpoints is
    refused here, once. With a ``root_dir`` the version is chosen (made) here
    and handed to the workers in :data:`RUN_DIR_ENV`, so every rank, and
    every restart of the job, writes to the same directory.
    """
    if settings.checkpoint_dir is not None:
        Checkpointer(settings.checkpoint_dir).admission.claim(request)
    if settings.root_dir is not None:
        path = plan_run(settings.root_dir, request, settings.checkpoint_dir is None)
        os.environ[RUN_DIR_ENV] = str(path or new_version(check_root(settings.root_dir).absolute()))
