"""``unison: setting up ...``: fit says what it sets up as it starts and as each slow phase begins."""

from __future__ import annotations

import socket

import pytest

import unison

from helpers import fit, mlp

pytestmark = pytest.mark.timeout(120)


def _setup_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("unison: setting up ")]


def _fit(tmp_path, capsys, *, progress="plain", ckpt_path=None, strategy="ddp", max_steps=2):
    seen_when_building: list[str] = []

    def build():  # fit's first check builds the model: by then the first line is out
        seen_when_building.extend(_setup_lines(capsys.readouterr().err))
        return mlp()

    trainer = unison.Trainer(
        strategy=strategy,
        global_batch_size=16,
        max_steps=max_steps,
        root_dir=str(tmp_path),
        checkpoint_every_n_steps=2,
        progress=progress,
    )
    fit(trainer, model=build, ckpt_path=ckpt_path)
    return seen_when_building, capsys.readouterr().err


@pytest.fixture
def env_world_of_one(monkeypatch):
    """A launcher's env:// variables for a world of 1: fit joins it through the rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)


def test_fit_says_first_what_it_sets_up_then_each_phase(tmp_path, capsys, env_world_of_one):
    capsys.readouterr()
    first, err = _fit(tmp_path, capsys)
    assert first == ["unison: setting up training with strategy 'ddp', world size 1: checking model, data and options"]
    assert _setup_lines(err) == [
        "unison: setting up the process group (gloo, world size 1): waiting for every rank",
        "unison: setting up the model under strategy 'ddp' (Sequential, device cpu)",
    ], err
    # A resume: its own phase, before the "resuming from" line it leads to.
    first, err = _fit(tmp_path, capsys, ckpt_path="auto", max_steps=4)
    lines = _setup_lines(err)
    assert len(first) == 1 and lines[-1] == "unison: setting up the resume: finding and loading the checkpoint (auto)"
    resuming = err.index("unison: resuming from step 2: ")
    assert err.index(lines[-1]) < resuming, err


def test_progress_off_says_nothing_of_setup(tmp_path, capsys):
    capsys.readouterr()
    first, err = _fit(tmp_path, capsys, progress="off", strategy="single")
    assert first == [] and _setup_lines(err) == [], err
