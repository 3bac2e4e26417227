"""Run directories and the metadata every logger records once per run.

A *run* is one ``Trainer.fit`` call. Its files go into a fresh
``ROOT/version_N`` directory, never into an earlier run's: N is one more than
the highest existing version, and the directory is created with a plain
``mkdir`` (no ``exist_ok``) in a loop, so two runs starting at the same moment
under the same root get different versions instead of sharing one.

Every logger of a run shares one :class:`RunDirectory` (loggers given the same
root string share it too), so ``metrics.jsonl``, ``metrics.csv`` and the
TensorBoard events of one fit land side by side in the same version.
Directories are made on global rank 0 only, at ``unison_on_fit_start``.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import sys
import weakref
from pathlib import Path
from typing import Any, ClassVar

import torch

from unison.errors import ConfigurationError
from unison.storage import split_url

RUN_FILE = "run.json"
_VERSION = re.compile(r"version_(\d+)")
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
    """

    _shared: ClassVar[weakref.WeakValueDictionary[Path, RunDirectory]] = weakref.WeakValueDictionary()

    def __init__(self, root: str | os.PathLike[str], config: dict[str, Any] | None = None) -> None:
        url = split_url(root)
        if url is not None and url[0] != "file":
            # Run directories are local (loggers append to open files); never a local directory named "s3:".
            raise ConfigurationError(
                "logging.dir",
                f"{str(root)!r} is a {url[0]}:// URL; run directories are written on a local file system",
                "give a local path (copy it to object storage afterwards, e.g. `aws s3 sync`)",
            )
        self.root = Path("/" + url[1]) if url is not None else Path(root)
        #: The resolved configuration to record (a ``unison train`` config); ``None``: the trainer's settings.
        self.config = config
        self.path: Path | None = None
        self.metadata: dict[str, Any] | None = None
        self._users = 0

    @classmethod
    def get(cls, root: str | os.PathLike[str] | RunDirectory) -> RunDirectory:
        """The process-wide :class:`RunDirectory` for ``root`` (``root`` itself when it is one)."""
        if isinstance(root, RunDirectory):
            return root
        key = Path(root).absolute()
        run = cls._shared.get(key)
        if run is None:
            run = cls._shared[key] = cls(root)
        return run

    @property
    def name(self) -> str:
        """``ROOT_NAME/version_N`` of the open run (for loggers that name runs, e.g. MLflow)."""
        assert self.path is not None, "the run directory is not open"
        return f"{self.root.name}/{self.path.name}"

    def open(self, trainer: Any) -> Path:
        """The current fit's version directory, created (with ``run.json``) by the first caller."""
        if self._users == 0:
            self.path = new_version(self.root)
            self.metadata = run_metadata(trainer, self.config, run=self.path.name)
            (self.path / RUN_FILE).write_text(json.dumps(self.metadata, indent=2, sort_keys=True, default=str) + "\n")
        self._users += 1
        assert self.path is not None
        return self.path

    def close(self) -> None:
        """One logger is done with the fit; the next ``open`` after the last close starts a new version."""
        self._users = max(0, self._users - 1)


def new_version(root: Path) -> Path:
    """Create and return ``root/version_N`` with N above every existing version (race-free)."""
    root.mkdir(parents=True, exist_ok=True)
    taken = [int(m.group(1)) for p in root.iterdir() if (m := _VERSION.fullmatch(p.name))]
    n = max(taken, default=-1) + 1
    while True:
        path = root / f"version_{n}"
        try:
            path.mkdir()  # fails if a concurrent run took this number first
            return path
        except FileExistsError:
            n += 1


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
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
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
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
