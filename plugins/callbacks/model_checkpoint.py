"""Checkpoints every N steps and the best k by a monitored metric.

Every checkpoint is written by the trainer's atomic checkpointer
(``trainer.save_checkpoint()``: collective, committed by one rename), so a
``ModelCheckpoint`` checkpoint resumes like any other. The callback adds:

* ``every_n_steps``: a checkpoint after every N-th optimizer step (the
  trainer's own ``checkpoint_every_n_steps`` saves are not repeated);
* ``monitor`` (e.g. ``"val/loss"``): the step at which the metric is logged
  gets a checkpoint (saved at the next step boundary unless the trainer just
  saved that step), scored by the metric;
* ``save_top_k``: after each save, delete this run's committed checkpoints that
  are neither among the ``k`` best scored ones nor the newest commit (nor the
  one ``latest`` names). The newest committed checkpoint is never deleted, so
  resuming always continues from where training stopped. Checkpoints of other
  runs in the same directory are never touched. This replaces
  ``keep_last_n_checkpoints`` (the two together are refused).

The monitored metric must be logged on every rank (the trainer's own metrics
are): saving is collective. Deleting happens on global rank 0. The scores
travel in the checkpoint, so a resumed run keeps ranking the older ones.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, Literal

from unison.errors import ConfigurationError
from unison.plugin import hookimpl


# -- the checkpointer's listing and removal, in one place ---------------------------------- #
def _committed(checkpointer: Any) -> list[tuple[Path, int]]:
    """``(path, step)`` of this run's committed checkpoints, oldest commit first."""
    if hasattr(checkpointer, "committed"):
        # Manifest layout: commit order; another run's checkpoints (or unreadable ones) are never ours.
        return [
            (c.path, c.manifest.step)
            for c in checkpointer.committed()
            if c.manifest is not None and c.manifest.run == checkpointer.run_id
        ]
    entries = []  # meta.json layout: one run per directory, step order is commit order
    for path in checkpointer.root.glob("step-*"):
        if (path / "meta.json").exists():
            entries.append((path, int(json.loads((path / "meta.json").read_text())["step"])))
    return sorted(entries, key=lambda e: e[1])


def _remove(checkpointer: Any, path: Path) -> None:
    storage = getattr(checkpointer, "storage", None)
    if storage is not None:
        storage.remove_tree(path)  # through the checkpointer's storage (local disk or object store)
    else:
        shutil.rmtree(path, ignore_errors=True)


class ModelCheckpoint:
    """Save every ``every_n_steps`` and/or when ``monitor`` is logged; keep the best ``save_top_k``.

    Args:
        every_n_steps: save after every N-th optimizer step.
        monitor: metric that scores checkpoints, e.g. ``"val/loss"``.
        mode: ``"min"`` (lower is better) or ``"max"``.
        save_top_k: keep this many best-scored checkpoints (plus the newest); ``None`` deletes nothing.
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        save_top_k: int | None = None,
    ) -> None:
        if every_n_steps is None and monitor is None:
            raise ConfigurationError(
                "ModelCheckpoint",
                "neither every_n_steps nor monitor is set",
                "pass every_n_steps=N, monitor='val/loss', or both",
            )
        if every_n_steps is not None and every_n_steps < 1:
            raise ConfigurationError("ModelCheckpoint.every_n_steps", f"got {every_n_steps}", "pass 1 or more")
        if mode not in ("min", "max"):
            raise ConfigurationError("ModelCheckpoint.mode", f"got {mode!r}", "use 'min' or 'max'")
        if save_top_k is not None and (save_top_k < 1 or monitor is None):
            raise ConfigurationError(
                "ModelCheckpoint.save_top_k",
                f"save_top_k={save_top_k} with monitor={monitor!r}",
                "pass save_top_k >= 1 together with a monitor",
            )
        self.every_n_steps, self.monitor, self.mode, self.save_top_k = every_n_steps, monitor, mode, save_top_k
        #: Score of each scored checkpoint, by step.
        self.scores: dict[int, float] = {}
        #: Steps this run saved (by this callback or by the trainer).
        self.saved: set[int] = set()
        self._pending: tuple[int, float] | None = None
        self._last_saved: int | None = None
        self._unpruned = False

    # -- checks ---------------------------------------------------------------- #
    @hookimpl
    def unison_on_trainer_init(self, trainer: Any) -> None:
        s = trainer.settings
        if s.checkpoint_dir is None:
            raise ConfigurationError(
                "checkpoint_dir",
                "ModelCheckpoint saves through the trainer's checkpointer, and no checkpoint_dir is set",
                "set checkpoint_dir",
            )
        if self.save_top_k is not None and s.keep_last_n_checkpoints is not None:
            raise ConfigurationError(
                "keep_last_n_checkpoints",
                f"it would delete checkpoints ModelCheckpoint(save_top_k={self.save_top_k}) keeps as the best",
                "unset keep_last_n_checkpoints; ModelCheckpoint keeps the best k and the newest",
            )

    # -- when to save ---------------------------------------------------------- #
    @hookimpl
    def unison_on_fit_start(self, trainer: Any) -> None:
        self.scores, self.saved, self._pending, self._last_saved, self._unpruned = {}, set(), None, None, False

    @hookimpl
    def unison_on_train_step_end(self, trainer: Any, step: int) -> None:
        done, s = step + 1, trainer.settings
        if self.every_n_steps is None or done % self.every_n_steps:
            return
        last = trainer.data.total_steps() if trainer.data is not None else s.max_steps
        # The trainer saves on its own schedule and at the end: never the same step twice.
        trainer_saves = (s.checkpoint_every_n_steps and done % s.checkpoint_every_n_steps == 0) or done == last
        if not trainer_saves:
            trainer.save_checkpoint()

    @hookimpl
    def unison_log_metrics(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        # Only noted here: a metric may be logged mid-step (trainer.log from training_step); the
        # checkpoint is taken at the next step boundary, where the state is complete on every rank.
        if self.monitor is not None and self.monitor in metrics:
            self._pending = (step, float(metrics[self.monitor]))

    @hookimpl
    def unison_on_train_step_start(self, trainer: Any) -> None:
        self._at_boundary(trainer)

    @hookimpl
    def unison_on_fit_end(self, trainer: Any) -> None:
        self._at_boundary(trainer)

    def _at_boundary(self, trainer: Any) -> None:
        """Between steps: save the pending scored step if nobody did, then prune after any save."""
        if self._pending is not None:
            step, score = self._pending
            self._pending = None
            if step == trainer.global_step:  # else: logged for a step whose state is gone (never in a fit)
                self.scores[step] = score
                if self._last_saved != step:
                    trainer.save_checkpoint()  # collective: every rank logged the metric
        if self._unpruned:
            self._unpruned = False
            self._prune(trainer)

    # -- bookkeeping ------------------------------------------------------------ #
    @hookimpl
    def unison_on_save_checkpoint(self, trainer: Any, checkpoint: dict[str, Any]) -> None:
        step = trainer.global_step
        self._last_saved = step
        self.saved.add(step)
        scores = dict(self.scores)
        if self._pending is not None and self._pending[0] == step:
            scores[step] = self._pending[1]
        checkpoint[self._key] = {"scores": [[k, v] for k, v in sorted(scores.items())]}
        # Prune at the next step boundary: this checkpoint is not committed yet.
        self._unpruned = True

    @hookimpl
    def unison_on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(self._key)
        if state is not None:
            self.scores = {int(k): float(v) for k, v in state["scores"]}

    @property
    def _key(self) -> str:
        return f"model_checkpoint:{self.monitor}"

    # -- retention -------------------------------------------------------------- #
    def best_steps(self) -> list[int]:
        """Scored steps, best first (a NaN score ranks last; a tie keeps the newer first)."""
        sign = 1.0 if self.mode == "min" else -1.0

        def key(step: int) -> tuple[bool, float, int]:
            score = self.scores[step]
            return (math.isnan(score), sign * score if not math.isnan(score) else 0.0, -step)

        return sorted(self.scores, key=key)

    def _prune(self, trainer: Any) -> None:
        if self.save_top_k is None or not trainer.is_global_zero:
            return
        checkpointer = trainer.checkpointer
        committed = _committed(checkpointer)
        if not committed:
            return
        present = {step for _, step in committed}
        keep = set([step for step in self.best_steps() if step in present][: self.save_top_k])
        protected = {committed[-1][0], checkpointer.latest()}  # the newest commit and what `latest` names
        mine = self.saved | set(self.scores)
        for path, step in committed:
            if step in mine and step not in keep and path not in protected:
                _remove(checkpointer, path)
