"""Run directories and the metadata every logger records once per run.

A *run* is one ``Trainer.fit`` call. Its files go into a fresh
``ROOT/version_N`` directory, never into an earlier run's: N is one more than
the highest existing version, and the directory is created with a plain
``mkdir`` (no ``exist_ok``) in a loop, so two runs starting at the same moment
under the same root get different versions instead of sharing one.

When ROOT is the trainer's ``root_dir``, the loggers write into the
trainer's own ``version_N`` instead (:mod:`unison.training.runs` chose it, next to the
run's checkpoints); a run that resumes it continues its files after the
resumed step (:attr:`RunDirectory.resume_step`) and ``run.json`` keeps its
first start and lists every resume.

Every logger of a run shares one :class:`RunDirectory` (loggers given the same
root string share it too), so ``metrics.jsonl``, ``metrics.csv`` and the
TensorBoard events of one fit land side by side in the same version.
Directories are made on global rank 0 only, at ``unison_on_fit_start``.

A root in object storage (``s3://bucket/prefix``, configured like checkpoint
locations: the standard AWS variables) is checked (list the bucket, write and
delete a probe object) when the :class:`RunDirectory` is made, before
training, and every problem is a :class:`~unison.ConfigurationError` naming
``logging.dir``. The loggers then write into a local staging copy of
``version_N`` (loggers append to open files; objects cannot be appended to),
and the run's files are uploaded to ``ROOT/version_N/``: ``run.json`` at
once (which claims the version number), the rest at most every
``upload_every_s`` seconds when metrics are logged, and all of it when the
fit ends or fails. A failed upload is a warning and is retried at the next
one; after a failed final upload the local copy is kept and its path given.
A process killed outright loses what was logged since the last upload.
Version numbers in object storage are not reserved atomically: two runs
started at the same moment under one URL root may take the same number.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, ClassVar

import torch

from unison.checkpointing.nofollow import refuse_link, replace_atomically
from unison.checkpointing.storage import LocalStorage, open_storage, split_url
from unison.errors import ConfigurationError
from unison.launch import messages
from unison.plugin.entry_points import installed_versions
from unison.training.runs import DEFAULT_ROOT_ENV, new_version

RUN_FILE = "run.json"
#: Distributions whose versions are recorded when installed (read from metadata, never imported).
_PACKAGES = (
    "unison",
    "torch",
    "pluggy",
    "pydantic",
    "numpy",
    "deepspeed",
    "fairscale",
    "apex",
    "transformers",
    "datasets",
    "tensorboard",
    "mlflow",
    "wandb",
    "rich",
)


class RunDirectory:
    """``root/version_N``: a new version for every fit, shared by the loggers holding this object.

    Loggers call :meth:`open` at the start of a fit and :meth:`close` at its
    end; the first ``open`` of a fit creates the version (and writes
    ``run.json``), later ones return the same directory until every logger
    closed it. Use :meth:`get` (what loggers do with a plain path) to share one
    object per root within a process.

    ``root`` is a local path, a ``file://`` URL or an ``s3://bucket/prefix``
    URL (see the module docstring); ``storage_options`` are s3fs's keyword
    arguments for the latter, ``upload_every_s`` how often metrics reach it.
    """

    _shared: ClassVar[weakref.WeakValueDictionary[str, RunDirectory]] = weakref.WeakValueDictionary()

    def __init__(
        self,
        root: str | os.PathLike[str],
        config: dict[str, Any] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        upload_every_s: float = 30.0,
    ) -> None:
        if isinstance(upload_every_s, bool) or not isinstance(upload_every_s, (int, float)) or upload_every_s < 0:
            raise ConfigurationError("logging.upload_every_s", f"got {upload_every_s!r}", "pass seconds >= 0")
        url = split_url(root)
        #: Where the versions are kept when that is object storage (``None``: ``root`` on this machine).
        self.remote: Path | None = None
        self._storage: Any = None
        if url is not None and url[0] != "file":
            self.remote, self._storage = open_storage(root, storage_options, option="logging.dir")
            self._storage.check(self.remote)  # credentials, bucket, write access: before training
            staging = Path(tempfile.mkdtemp(prefix="unison-run-"))
            self._cleanup = weakref.finalize(self, shutil.rmtree, staging, True)
            #: The local directory the loggers write into (a staging copy for a remote root).
            self.root = staging / (self.remote.name or "run")
        else:
            self.root = Path("/" + url[1]) if url is not None else Path(root)
        #: The resolved configuration to record (a ``unison train`` config); ``None``: the trainer's settings.
        self.config = config
        self.upload_every_s = float(upload_every_s)
        self.path: Path | None = None
        self.metadata: dict[str, Any] | None = None
        #: The step the open run resumed from when it continues its own version's files, else ``None``:
        #: file loggers then keep the rows up to it and append.
        self.resume_step: int | None = None
        self._users = 0
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._last_upload = 0.0
        self._upload_warned = False

    def check_local(self) -> None:
        """A local root can be made: its nearest existing ancestor is a writable directory (before training;
        a :class:`~unison.ConfigurationError` otherwise). Object storage was checked when this was made."""
        if self.remote is not None:
            return
        existing = self.root.absolute()
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if existing.is_dir() and os.access(existing, os.W_OK):
            return
        raise ConfigurationError(
            "loggers",
            f"the run directory {self.root.absolute()} cannot be made: {existing} is not a writable directory",
            f"give root_dir (or the loggers) a writable directory; without either, set {DEFAULT_ROOT_ENV} (where "
            "the default runs/ goes), or pass loggers=False for no metric files",
        )

    @classmethod
    def get(cls, root: str | os.PathLike[str] | RunDirectory) -> RunDirectory:
        """The process-wide :class:`RunDirectory` for ``root`` (``root`` itself when it is one)."""
        if isinstance(root, RunDirectory):
            return root
        key = str(root) if split_url(root) is not None else str(Path(root).absolute())
        run = cls._shared.get(key)
        if run is None:
            run = cls._shared[key] = cls(root)
        return run

    @property
    def name(self) -> str:
        """``ROOT_NAME/version_N`` of the open run (for loggers that name runs, e.g. MLflow)."""
        assert self.path is not None, "the run directory is not open"
        return f"{self.root.name}/{self.path.name}"

    @property
    def location(self) -> str:
        """Where the open (or last) run's files are kept: its local path, or its URL in object storage."""
        assert self.path is not None, "the run directory is not open"
        return str(self.remote / self.path.name) if self.remote is not None else str(self.path)

    def open(self, trainer: Any) -> Path:
        """The current fit's version directory, created (with ``run.json``) by the first caller, who prints
        ``unison: run directory: LOCATION`` on stderr (unless the trainer's ``progress`` is ``"off"``)."""
        if self._users == 0:
            run_dir = getattr(trainer, "run_dir", None)
            resumed = getattr(trainer, "resumed_from", None)
            self.resume_step = None
            if self.remote is None and run_dir is not None and Path(run_dir).parent == self.root.absolute():
                # The trainer's own run directory (root_dir): one version holds the run's checkpoints and metrics.
                self.path = Path(run_dir)
                refuse_link(self.path, "root_dir")  # a version directory is made by unison, never a link
                self.path.mkdir(parents=True, exist_ok=True)
                previous = _read_run_file(self.path)
                if previous is not None and resumed is not None:
                    self.resume_step = int(resumed["step"])  # continuing this run: its series goes on
            else:
                previous = None
                taken = self._storage.list_dir(self.remote) if self.remote is not None else []
                self.path = new_version(self.root, taken)
            self.metadata = run_metadata(trainer, self.config, run=self.path.name)
            self.metadata["resumed_from"] = resumed
            if previous is not None:
                # One record per run: its first start stays; each resume is appended.
                self.metadata["started"] = previous.get("started", self.metadata["started"])
                self.metadata["resumes"] = [
                    *previous.get("resumes", []),
                    {**(resumed or {}), "at": run_metadata_time(), "command": sys.argv},
                ]
            # A fresh temporary renamed onto run.json: never written through a link (unison.checkpointing.nofollow).
            text = json.dumps(self.metadata, indent=2, sort_keys=True, default=str) + "\n"
            replace_atomically(self.path / RUN_FILE, text.encode(), "logging.dir", sync=False)
            self._uploaded = {}
            self.upload(final=True)  # claims version_N in object storage before anything is logged
            if getattr(trainer.settings, "progress", "off") != "off":  # an info line: progress="off" silences it
                messages.say(f"unison: run directory: {self.location}")
        self._users += 1
        assert self.path is not None
        return self.path

    def close(self) -> None:
        """One logger is done with the fit; the next ``open`` after the last close starts a new version.

        The last close uploads every file of the run to object storage (when the root is there).
        """
        self._users = max(0, self._users - 1)
        if self._users == 0 and self.path is not None and not self.upload(final=True):
            self._cleanup.detach()  # a remote root whose files did not all arrive: keep the only copy
            warnings.warn(
                f"the run's files did not all reach {self.location}; they are kept in {self.path}", stacklevel=2
            )

    def upload(self, final: bool = False) -> bool:
        """Copy the run's new and changed files to object storage; ``True`` when everything is there.

        Without ``final`` at most once every ``upload_every_s`` seconds (a
        no-op for a local root). Errors are warnings: training goes on.
        """
        if self.remote is None or self.path is None:
            return True
        now = time.monotonic()
        if not final and now - self._last_upload < self.upload_every_s:
            return True
        self._last_upload = now
        changed, signatures = [], {}
        for name in LocalStorage().list_files(self.path):
            stat = (self.path / name).stat()
            signatures[name] = (stat.st_size, stat.st_mtime_ns)
            if self._uploaded.get(name) != signatures[name]:
                changed.append(name)
        try:
            self._storage.upload(self.path, self.remote / self.path.name, changed)
        except Exception as exc:  # the network or the server: metrics must not stop training
            if final or not self._upload_warned:
                warnings.warn(
                    f"uploading the run's files to {self.location} failed ({type(exc).__name__}: {exc}); "
                    + ("" if final else "retrying at the next upload"),
                    stacklevel=2,
                )
                self._upload_warned = True
            return False
        self._uploaded.update({name: signatures[name] for name in changed})
        return True


def _read_run_file(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None


def run_metadata_time() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), **installed_versions(_PACKAGES)}
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    return versions


def run_metadata(trainer: Any, config: dict[str, Any] | None = None, run: str | None = None) -> dict[str, Any]:
    """What a run records once at its start: its config, the strategy's declaration, versions.

    ``config`` is the resolved ``unison train`` config when there is one;
    otherwise the trainer's settings stand for it.
    """
    env = getattr(trainer, "env", None)
    return {
        "run": run,
        "started": run_metadata_time(),
        "config": config if config is not None else {"trainer": trainer.settings.model_dump(mode="json")},
        "strategy": {"name": trainer.strategy.name, "ownership": trainer.ownership.to_dict()},
        "world_size": env.world_size if env is not None else 1,
        "versions": package_versions(),
        "command": sys.argv,
    }


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists become JSON text), for key/value stores."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out if out or not prefix else {prefix[:-1]: "{}"}
    if isinstance(tree, (list, tuple)):
        return {prefix[:-1]: json.dumps(tree, default=str)}
    return {prefix[:-1]: tree}
