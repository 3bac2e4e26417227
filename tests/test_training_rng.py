"""No default changes training: the default plugins on or off, and a resume in a new process, train alike.

Each run is its own process (``spawn``), as a user's job or a restarted one
is: a plugin's one-time draw from the global generator (the MFU probe used to
make one after the fit's second step) then happens in every run that has the
plugin, which is what made defaults and resume differ.
"""

from __future__ import annotations

import pytest
import torch

import unison
from unison.launch.torchrun import spawn

import rng_worlds as r


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_default_plugins_on_or_off_train_the_same_dropout_model():
    on = spawn(r.train, 1, "single", True, timeout=300)[0]
    off = spawn(r.train, 1, "single", False, timeout=300)[0]
    assert equal(on, off)


@pytest.mark.parametrize(("strategy", "nproc"), [("single", 1), ("ddp", 2)])
def test_a_resume_in_a_new_process_equals_the_uninterrupted_run(tmp_path, strategy, nproc):
    straight = spawn(r.train, nproc, strategy, True, timeout=300)[0]
    ckpt = str(tmp_path / "ckpt")
    spawn(_first_half, nproc, strategy, ckpt, timeout=300)
    resumed = spawn(r.resume, nproc, strategy, ckpt, timeout=300)
    assert equal(resumed[0], straight)
    assert equal(resumed[-1], straight)


def _first_half(strategy: str, ckpt: str) -> None:
    r.train(strategy, True, r.HALF, checkpoint_dir=ckpt)


class DrawsFromTheGlobalGenerator:
    """A callback that changes training: it draws a random number after every step."""

    @unison.hookimpl
    def unison_on_train_step_end(self, trainer, step, output):
        torch.rand(1)


def test_a_plugin_that_draws_from_the_training_rng_is_refused_by_the_check(monkeypatch):
    monkeypatch.setenv("UNISON_CHECK_PLUGIN_RNG", "1")
    trainer = unison.Trainer(
        strategy="single", global_batch_size=16, max_steps=2, seed=0, callbacks=[DrawsFromTheGlobalGenerator()]
    )
    with pytest.raises(unison.PluginError, match=r"unison_on_train_step_end \(torch \(CPU\) generator\).*DrawsFrom"):
        trainer.fit(r.dropout_mlp, r.data(), loss_fn=torch.nn.functional.mse_loss, optimizer=torch.optim.SGD)


def test_the_default_plugins_pass_the_check(monkeypatch):
    monkeypatch.setenv("UNISON_CHECK_PLUGIN_RNG", "1")
    # Every default: Throughput (with its MFU probe), the default loggers, progress.
    trainer = unison.Trainer(strategy="single", global_batch_size=16, max_steps=3, seed=0, val_every_n_steps=2)
    trainer.fit(
        r.dropout_mlp,
        r.data(),
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        val_dataset=r.data(),
    )
    assert trainer.global_step == 3
