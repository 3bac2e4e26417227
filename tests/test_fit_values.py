"""A fit is values passed down: the parts never assign into the ``Trainer``.

``fit`` keeps one record of the fit (:mod:`unison.training.record`): the frozen values of the checks
before any process group (``FitPlan``), of the world (``World``) and of the run's place (``RunPlace``),
and the parts built from them. What a user reads on the trainer (``env``, ``run_dir``,
``checkpointer``, ``resumed_from``, ``precision``, ``data``, ...) are read-only properties over that
record. These tests run real fits (checkpoints, validation, a resume) with a callback that looks at the
trainer's attributes at every hook.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import unison

import helpers
from helpers import adamw, mlp, regression_data


def attributes(trainer: unison.Trainer) -> dict[str, int]:
    """Every attribute of the trainer object, by identity (a reassignment changes it, even to an equal value)."""
    return {name: id(value) for name, value in vars(trainer).items()}


class Watcher:
    """Snapshots the trainer's attributes at every hook of a fit."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, int]]] = []
        self.resumed: dict[str, object] = {}

    def _look(self, hook: str, trainer: unison.Trainer) -> None:
        self.seen.append((hook, attributes(trainer)))

    @unison.hookimpl
    def unison_on_fit_start(self, trainer):
        self._look("fit_start", trainer)
        self.resumed["fit_start"] = trainer.resumed_from

    @unison.hookimpl
    def unison_on_train_step_start(self, trainer, step):
        self._look("train_step_start", trainer)

    @unison.hookimpl
    def unison_on_after_backward(self, trainer, step):
        self._look("after_backward", trainer)

    @unison.hookimpl
    def unison_on_train_step_end(self, trainer, step, output):
        self._look("train_step_end", trainer)

    @unison.hookimpl
    def unison_on_validation_end(self, trainer, step, metrics):
        self._look("validation_end", trainer)

    @unison.hookimpl
    def unison_on_save_checkpoint(self, trainer, checkpoint):
        self._look("save_checkpoint", trainer)

    @unison.hookimpl
    def unison_on_load_checkpoint(self, trainer, checkpoint):
        self._look("load_checkpoint", trainer)

    @unison.hookimpl
    def unison_on_fit_end(self, trainer):
        self._look("fit_end", trainer)
        self.resumed["fit_end"] = trainer.resumed_from


def make_trainer(tmp_path, watcher: Watcher, max_steps: int) -> unison.Trainer:
    return unison.Trainer(
        strategy="ddp",  # a real (private, one-rank) process group: the world is made and torn down by fit
        global_batch_size=16,
        accumulate_grad_batches=2,
        max_steps=max_steps,
        grad_clip_norm=1.0,
        val_every_n_steps=2,
        val_batch_size=16,
        checkpoint_every_n_steps=2,
        root_dir=str(tmp_path / "runs"),
        progress="off",
        stall_timeout_s=None,
        callbacks=[watcher],
    )


#: helpers.fit with the model built by the fit (a factory), a scheduler and validation
fit = functools.partial(
    helpers.fit,
    model=lambda: mlp(),
    data=regression_data(128),
    optimizer=adamw(),
    lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0),
    val_dataset=regression_data(32, seed=7),
)


def changed(before: dict[str, int], after: dict[str, int]) -> set[str]:
    return {name for name in before.keys() | after.keys() if before.get(name) != after.get(name)}


def test_a_fit_changes_only_its_record_and_the_documented_results(tmp_path):
    watcher = Watcher()
    trainer = make_trainer(tmp_path, watcher, max_steps=4)
    before = attributes(trainer)
    progress = fit(trainer)
    assert progress.global_step == 4 and trainer.last_validation is not None

    # Across the whole fit, from fit_start to fit_end: no part assigned into the trainer, but for the
    # documented results (validation sets last_validation).
    hooks = [hook for hook, _ in watcher.seen]
    assert {"fit_start", "train_step_start", "after_backward", "validation_end", "save_checkpoint"} <= set(hooks)
    start = watcher.seen[0][1]
    for hook, seen in watcher.seen:
        assert changed(start, seen) <= {"last_validation"}, f"{hook}: {changed(start, seen)}"
    # Before fit against after it: the record and the documented results, nothing else.
    assert changed(before, attributes(trainer)) == {"_fit", "progress", "last_validation"}

    # What the fit decided is read through the record, and nothing can assign it.
    assert trainer.run_dir is not None and trainer.run_dir.name == "version_0"
    assert trainer.checkpointer is not None and trainer.checkpointer.root == trainer.run_dir / "checkpoints"
    assert progress.run_dir == str(trainer.run_dir) and trainer.env is not None and trainer.env.world_size == 1
    for name in ("env", "run_dir", "checkpointer", "resumed_from", "precision", "data", "lr_scheduler"):
        with pytest.raises(AttributeError):
            setattr(trainer, name, None)
    record = trainer._fit
    for value, field in ((record.plan, "resume"), (record.place, "run_dir"), (record.world, "env")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, None)
    assert trainer.control_group is None  # the world is gone after fit; env is kept for reading


def test_a_resumed_fit_reads_its_resume_point_from_its_values(tmp_path):
    first = make_trainer(tmp_path, Watcher(), max_steps=4)
    fit(first)
    committed = str(first.checkpointer.latest())  # step 4's, in the first fit's version
    watcher = Watcher()
    trainer = make_trainer(tmp_path, watcher, max_steps=6)
    before = attributes(trainer)
    fit(trainer, ckpt_path="auto")
    assert trainer.progress.global_step == 6
    # Read before any process group from the checkpoint's manifest, then the one loaded: the same step.
    assert watcher.resumed["fit_start"] == {"step": 4, "checkpoint": committed}
    assert watcher.resumed["fit_end"] == {"step": 4, "checkpoint": committed}
    assert trainer.run_dir == first.run_dir  # --resume auto continues the version in place
    start = watcher.seen[0][1]
    assert "load_checkpoint" in [hook for hook, _ in watcher.seen]
    for hook, seen in watcher.seen:
        assert changed(start, seen) <= {"last_validation"}, f"{hook}: {changed(start, seen)}"
    assert changed(before, attributes(trainer)) == {"_fit", "progress", "last_validation"}


def test_a_refused_fit_leaves_no_record_and_no_earlier_one(tmp_path):
    trainer = make_trainer(tmp_path, Watcher(), max_steps=2)
    fit(trainer)
    assert trainer.setup_started and trainer.run_dir is not None
    with pytest.raises(unison.ConfigurationError, match="optimizer"):
        trainer.fit(lambda: mlp(), regression_data(128), loss_fn=torch.nn.functional.mse_loss, optimizer=object())
    # The refusal came before any process group; the earlier fit's values are not mistaken for this one's.
    assert not trainer.setup_started and trainer.run_dir is None and trainer.env is None
