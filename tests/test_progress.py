"""The progress display: a live rich bar in a terminal, plain lines otherwise, off by a setting.

The Python API gets it by default (through ``unison_default_plugins``), not only ``unison train``.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

import unison
from unison.plugins.progress import ProgressBar

import helpers
from helpers import adamw
from observability_worlds import TokenModel, token_data

ROOT = Path(__file__).resolve().parents[1]


class Slow:
    """Makes steps and validation batches take real time, so rates, elapsed time and ETA are non-zero."""

    @unison.hookimpl
    def unison_on_train_step_end(self) -> None:
        time.sleep(0.04)

    @unison.hookimpl
    def unison_validation_progress(self) -> None:
        time.sleep(0.15)


def fit(trainer: unison.Trainer, steps_val: bool = True) -> None:
    """helpers.fit on the token model (cross-entropy, AdamW), validating on held-out tokens unless not ``steps_val``."""
    helpers.fit(
        trainer,
        model=TokenModel(),
        data=token_data(),
        loss_fn=torch.nn.functional.cross_entropy,
        optimizer=adamw(),
        val_dataset=token_data(n=64, seed=3) if steps_val else None,
    )


def test_rich_bar_shows_step_loss_lr_throughput_elapsed_and_eta():
    console = Console(record=True, force_terminal=True, width=200, file=io.StringIO())
    bar = ProgressBar(console=console, refresh_per_second=50)
    trainer = unison.Trainer(
        strategy="single",
        global_batch_size=16,
        max_steps=30,
        val_every_n_steps=15,
        val_batch_size=16,
        callbacks=[bar, Slow()],
    )
    fit(trainer)
    frames = console.export_text()
    train = re.findall(
        r"train .*? (\d+)/30 loss (\d+\.\d{4}) \| lr 1\.00e-02 \| ([\d.]+k?) samples/s \| "
        r"([\d.]+k?) tokens/s elapsed (\d:\d\d:\d\d) eta (\d:\d\d:\d\d)",
        frames,
    )
    assert train, frames[-2000:]
    steps = [int(s) for s, *_ in train]
    assert steps == sorted(steps) and steps[-1] == 30
    # 16 samples of 8 tokens per step: tokens/s is 8x samples/s; < 25 steps/s with the 40 ms sleep
    samples, tokens = train[-1][2], train[-1][3]
    as_number = lambda text: float(text[:-1]) * 1000 if text.endswith("k") else float(text)  # noqa: E731
    assert 0 < as_number(samples) < 16 * 25 and as_number(tokens) == pytest.approx(8 * as_number(samples), rel=0.05)
    assert any(eta != "0:00:00" for *_, eta in train[:5])  # a real remaining-time estimate early on
    assert train[-1][4] >= "0:00:01"  # 30 steps x 40 ms: over a second elapsed
    # validation progress: a "val" bar counting its batches (64 samples / 16 per forward), then the result
    assert re.search(r"val .*? [1-4]/4 ", frames), frames[-2000:]
    assert re.search(r"val step 15: val/loss \d+\.\d{4} \| 4 batches in \d:\d\d:\d\d", frames)
    assert re.search(r"val step 30: val/loss", frames)


def test_default_progress_in_a_log_file_prints_plain_periodic_lines(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import unison
        from observability_worlds import TokenModel, token_data
        trainer = unison.Trainer(strategy="single", global_batch_size=16, max_steps=40, val_every_n_steps=20,
                                 progress=sys.argv[1])
        trainer.fit(TokenModel(), token_data(), loss_fn=torch.nn.functional.cross_entropy,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2), val_dataset=token_data(n=64, seed=3))
        print("done", trainer.global_step)
    """)
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(script), "auto"], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    train = [line for line in lines if line.startswith("train step")]
    # about 20 lines per run: every 40 // 20 = 2 steps
    assert [int(re.match(r"train step (\d+)/40", line).group(1)) for line in train] == list(range(2, 41, 2))
    pattern = (
        r"train step \d+/40 \| loss \d+\.\d{4} \| lr 1\.00e-02 \| [\d.]+k? samples/s \| [\d.]+k? tokens/s \| "
        r"elapsed \d:\d\d:\d\d \| eta \d:\d\d:\d\d"
    )
    assert all(re.fullmatch(pattern, line) for line in train), train
    assert sum(line.startswith("val step 20: val/loss") for line in lines) == 1
    assert "\x1b[" not in out.stdout  # no terminal control codes in a log file
    assert lines[-1] == "done 40"

    off = subprocess.run([sys.executable, str(script), "off"], capture_output=True, text=True, env=env, timeout=180)
    assert off.returncode == 0, off.stderr[-3000:]
    assert off.stdout.splitlines() == ["done 40"]


def test_a_given_progress_bar_replaces_the_default_and_off_registers_none():
    mine = ProgressBar(mode="plain", every_n_steps=5)
    trainer = unison.Trainer(strategy="single", max_steps=3, callbacks=[mine])
    bars = [p for _, p in trainer.pm.list_plugins() if isinstance(p, ProgressBar)]
    assert bars == [mine]
    default = unison.Trainer(strategy="single", max_steps=3)
    assert sum(isinstance(p, ProgressBar) for _, p in default.pm.list_plugins()) == 1
    off = unison.Trainer(strategy="single", max_steps=3, progress="off")
    assert not any(isinstance(p, ProgressBar) for _, p in off.pm.list_plugins())


def test_plain_mode_on_a_console_prints_every_n_steps(capsys):
    trainer = unison.Trainer(
        strategy="single", global_batch_size=16, max_steps=6, progress="plain", progress_every_n_steps=3
    )
    fit(trainer, steps_val=False)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("train step")]
    assert [line.split(" | ")[0] for line in lines] == ["train step 3/6", "train step 6/6"]


def test_plain_lines_count_to_the_end_of_max_epochs(capsys):
    # 256 samples / 16 per step = 16 steps per epoch; 2 epochs end at step 32
    trainer = unison.Trainer(
        strategy="single", global_batch_size=16, max_epochs=2, progress="plain", progress_every_n_steps=16
    )
    fit(trainer, steps_val=False)
    lines = [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("train step")]
    assert lines == ["train step 16/32", "train step 32/32"]
