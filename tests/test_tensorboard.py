"""TensorBoard as users see it: the scalars dashboard of a real ``tensorboard`` server, and EventAccumulator.

One short fit writes the event files; a ``tensorboard --logdir`` server with
default options (the default loader) must list the scalar tags and serve
every logged step of ``train/loss`` over its HTTP API, and
``EventAccumulator(...).Scalars("train/loss")`` must return the same series.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

import unison
from unison.plugins.loggers import TensorBoardLogger

from observability_worlds import MetricsRecorder, TokenModel, token_data

pytest.importorskip("tensorboard")
TENSORBOARD = Path(sys.executable).with_name("tensorboard")
pytestmark = pytest.mark.timeout(240)
RUN = "version_0/tensorboard"  # TensorBoard names a run by its directory under --logdir


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict[int, dict[str, float]]]:
    """A 6-step fit logging every 2 steps, validating at 3 and 6: (runs root, what the trainer logged)."""
    root = tmp_path_factory.mktemp("tb") / "runs"
    recorder = MetricsRecorder()
    trainer = unison.Trainer(
        strategy="single",
        global_batch_size=16,
        max_steps=6,
        log_every_n_steps=2,
        val_every_n_steps=3,
        progress="off",
        callbacks=[recorder],
        loggers=[TensorBoardLogger(root)],
    )
    trainer.fit(
        TokenModel(),
        token_data(),
        loss_fn=torch.nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        val_dataset=token_data(n=40, seed=9),
    )
    return root, recorder.by_step()


def _series(logged: dict[int, dict[str, float]], tag: str) -> list[tuple[int, float]]:
    """The trainer's values of ``tag``, rounded to float32 as TensorBoard's scalar summary holds them."""
    return [(step, float(np.float32(m[tag]))) for step, m in sorted(logged.items()) if tag in m]


def test_event_accumulator_scalars_return_every_logged_step(run):
    from tensorboard.backend.event_processing import event_accumulator

    root, logged = run
    acc = event_accumulator.EventAccumulator(str(root / "version_0" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert {"train/loss", "val/loss", "train/lr"} <= set(acc.Tags()["scalars"])
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [step for step, _ in loss] == [2, 4, 6]
    assert loss == _series(logged, "train/loss")
    assert [(e.step, e.value) for e in acc.Scalars("val/loss")] == _series(logged, "val/loss") != []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_tensorboard_server_shows_the_scalars_with_default_options(run, tmp_path):
    root, logged = run
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with open(tmp_path / "tensorboard.log", "w") as log:
        server = subprocess.Popen(
            [str(TENSORBOARD), "--logdir", str(root), "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
        try:
            # The server answers before it has read the logdir: wait until the run's tags are listed.
            deadline, tags = time.monotonic() + 120, {}
            while time.monotonic() < deadline:
                assert server.poll() is None, (tmp_path / "tensorboard.log").read_text()[-3000:]
                try:
                    tags = _get(f"{base}/data/plugin/scalars/tags")
                except OSError:
                    tags = {}
                if tags.get(RUN, {}).get("train/loss") is not None:
                    break
                time.sleep(0.5)
            assert RUN in tags, (tags, (tmp_path / "tensorboard.log").read_text()[-3000:])
            assert {"train/loss", "val/loss", "train/lr"} <= set(tags[RUN])
            query = urllib.parse.urlencode({"run": RUN, "tag": "train/loss"})
            series = _get(f"{base}/data/plugin/scalars/scalars?{query}")
            # each point is [wall_time, step, value]
            assert [(step, value) for _, step, value in series] == _series(logged, "train/loss")
        finally:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
