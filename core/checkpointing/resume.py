"""What a fit resumes from: ``ckpt_path`` parsed once into a :class:`ResumeRequest`.

``ckpt_path`` (``Trainer.fit(ckpt_path=...)``, ``unison train --resume``)
takes four forms, and every part of unison that cares (the trainer's checks,
the run directories of :mod:`unison.training.runs`, the
:class:`~unison.checkpointing.checkpointer.Checkpointer`, the CLI) reads the
parsed kind instead of comparing strings, so the forms are spelled in this
module only:

* ``None`` -> :attr:`ResumeKind.FRESH`: start from step 0;
* ``"auto"`` -> :attr:`ResumeKind.AUTO`: the newest committed checkpoint that
  verifies, or a fresh start when there is none (a job can be restarted blindly);
* ``"last"`` -> :attr:`ResumeKind.LAST`: the newest committed checkpoint,
  which must exist and verify;
* any other string or ``os.PathLike`` -> :attr:`ResumeKind.PATH`: that
  checkpoint directory (a local path or an object-storage URL). A path
  whose text is ``auto`` or ``last`` reads as that form (pass ``./auto``
  for a directory of that name).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path

from unison.errors import ConfigurationError

__all__ = ["CkptPath", "ResumeKind", "ResumeRequest"]


class ResumeKind(enum.Enum):
    FRESH = "fresh"
    AUTO = "auto"
    LAST = "last"
    PATH = "path"


@dataclass(frozen=True)
class ResumeRequest:
    """A parsed ``ckpt_path``; build it with :meth:`parse`."""

    kind: ResumeKind
    #: The checkpoint directory for :attr:`ResumeKind.PATH` (as given: a URL stays a string), else ``None``.
    path: str | os.PathLike[str] | None = None

    @classmethod
    def parse(cls, ckpt_path: CkptPath) -> ResumeRequest:
        """``ckpt_path`` as a request; a request is returned as it is (parsing twice changes nothing).

        Raises:
            ConfigurationError: naming ``ckpt_path`` and the accepted forms, for
                anything but ``None``, a non-empty string or an ``os.PathLike``.
        """
        if isinstance(ckpt_path, ResumeRequest):
            return ckpt_path
        if ckpt_path is None:
            return cls(ResumeKind.FRESH)
        if isinstance(ckpt_path, (str, os.PathLike)) and str(ckpt_path):
            text = str(ckpt_path)
            if text in ("auto", "last"):  # also as a Path: the forms are read from the text, as always
                return cls(ResumeKind(text))
            return cls(ResumeKind.PATH, ckpt_path)
        raise ConfigurationError(
            "ckpt_path",
            f"got {ckpt_path!r} ({type(ckpt_path).__name__})",
            "pass None (start fresh), 'auto' (the newest checkpoint, or fresh when there is none), "
            "'last' (the newest checkpoint, which must exist) or a checkpoint directory (a path or URL)",
        )

    @property
    def fresh(self) -> bool:
        """No checkpoint: start from step 0."""
        return self.kind is ResumeKind.FRESH

    @property
    def newest(self) -> bool:
        """``"auto"`` or ``"last"``: the newest committed checkpoint of the run's own directory."""
        return self.kind in (ResumeKind.AUTO, ResumeKind.LAST)

    @property
    def local_path(self) -> Path:
        """The :attr:`path` of a :attr:`ResumeKind.PATH` request as a ``Path``."""
        if self.path is None:
            raise ValueError(f"a {self.kind.value!r} resume request names no path")
        return Path(self.path)

    def __str__(self) -> str:
        """The form as given: ``"auto"``, ``"last"``, the path; ``"None"`` for a fresh start (for messages)."""
        if self.kind is ResumeKind.PATH:
            return str(self.path)
        return "None" if self.fresh else self.kind.value


#: What ``ckpt_path`` arguments accept: the four forms, or a request already parsed.
CkptPath = str | os.PathLike | ResumeRequest | None
