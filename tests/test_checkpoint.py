"""Checkpoints are atomic: a crash while saving never corrupts the last good one."""

from __future__ import annotations

import functools

import pytest

import unison
from unison.checkpointing.checkpointer import Checkpointer

import helpers
from helpers import adamw, max_abs_diff, regression_data, train


class CrashOnSecondSave:
    def __init__(self):
        self.saves = 0
        self.exceptions = []

    @unison.hookimpl
    def unison_on_exception(self, trainer, exception):
        self.exceptions.append((trainer.global_step, str(exception)))

    @unison.hookimpl
    def unison_on_save_checkpoint(self, checkpoint):
        self.saves += 1
        if self.saves == 2:
            raise RuntimeError("disk full (simulated in a real save)")


#: helpers.fit on 512 samples with AdamW
fit = functools.partial(helpers.fit, data=regression_data(), optimizer=adamw())


def test_crash_during_save_keeps_previous_checkpoint_latest(tmp_path):
    crash = CrashOnSecondSave()
    trainer = unison.Trainer(
        strategy="single",
        global_batch_size=16,
        accumulate_grad_batches=2,
        max_steps=10,
        checkpoint_dir=str(tmp_path),
        checkpoint_every_n_steps=4,
        callbacks=[crash],
    )
    with pytest.raises(RuntimeError, match="disk full"):
        fit(trainer)
    assert crash.exceptions == [(8, "disk full (simulated in a real save)")]  # unison_on_exception fired once
    ckpt = Checkpointer(tmp_path)
    assert ckpt.latest() == tmp_path / "step-00000004"
    assert not (tmp_path / "step-00000008").exists()
    # The failed save removed its own partial directory; the committed checkpoints are untouched.
    assert not (tmp_path / ".step-00000008.partial").exists()
    resumed = unison.Trainer(
        strategy="single",
        global_batch_size=16,
        accumulate_grad_batches=2,
        max_steps=10,
        checkpoint_dir=str(tmp_path),
        checkpoint_every_n_steps=4,
    )
    progress = fit(resumed, ckpt_path="last")
    assert progress.global_step == 10 and progress.history[0]["step"] == 4 and len(progress.history) == 6
    assert ckpt.latest() == tmp_path / "step-00000010"
    assert not (tmp_path / ".step-00000008.partial").exists()  # re-saved cleanly over the leftover


def test_keep_last_n_prunes_only_committed_older_checkpoints(tmp_path):
    trainer = unison.Trainer(
        strategy="single",
        global_batch_size=16,
        accumulate_grad_batches=2,
        max_steps=9,
        checkpoint_dir=str(tmp_path),
        checkpoint_every_n_steps=2,
        keep_last_n_checkpoints=2,
    )
    fit(trainer)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000008", "step-00000009"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000009"


def test_single_resume_is_bitwise(tmp_path):
    full = train("single")
    train("single", max_steps=10, checkpoint_dir=str(tmp_path))
    resumed = train("single", max_steps=20, checkpoint_dir=str(tmp_path), ckpt_path="last")
    assert max_abs_diff(full["state"], resumed["state"]) == 0.0
    assert resumed["history"] == full["history"][10:]
    assert ("load_checkpoint", resumed["hooks"][1][1]) == resumed["hooks"][1]


def test_resume_from_a_path_that_is_not_a_checkpoint(tmp_path):
    trainer = unison.Trainer(strategy="single", global_batch_size=16, max_steps=2)
    with pytest.raises(unison.ConfigurationError, match=r"ckpt_path: .* is not a committed unison checkpoint"):
        fit(trainer, ckpt_path=str(tmp_path))
    assert not trainer.setup_started
