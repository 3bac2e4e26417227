"""The S3 server going away during a save (its own SeaweedFS instance, stopped and restarted on the same ports).

Stopped for a few seconds: the save succeeds after retries, counted in the
``checkpoint/storage_retries`` metric. Stopped for good: the job fails with one
message naming the object and the endpoint (no botocore traceback); once the
server is back ``ckpt_path="auto"`` resumes and ends equal to an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import s3_server
import storage_job
import torch

import unison
from unison.checkpointing.checkpointer import Checkpointer
from unison.checkpointing.lease import LeaseWarning

from helpers import max_abs_diff

HERE = Path(__file__).resolve().parent


class Server:
    """A SeaweedFS server that can be stopped and started again with its data and ports."""

    def __init__(self) -> None:
        self.s3 = s3_server.start()
        self.argv = Path(f"/proc/{self.s3.process.pid}/cmdline").read_bytes().split(b"\0")[:-1]

    def down(self) -> None:
        os.killpg(self.s3.process.pid, signal.SIGKILL)
        self.s3.process.wait(timeout=30)

    def up(self) -> None:
        log = open(self.s3.workdir / "weed.log", "ab")  # noqa: SIM115  (the server writes it until stopped)
        self.s3.process = subprocess.Popen(
            self.argv, cwd=self.s3.workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                self.s3.fs().ls(s3_server.BUCKET)
                return
            except Exception:
                time.sleep(0.3)
        raise RuntimeError("SeaweedFS did not come back")


@pytest.fixture
def server(monkeypatch):
    srv = Server()
    for name, value in srv.s3.env().items():
        monkeypatch.setenv(name, value)
    yield srv
    srv.s3.stop()


def _fit(url: str, callbacks=(), ckpt_path=None) -> unison.Trainer:
    trainer = unison.Trainer(
        strategy="single",
        global_batch_size=8,
        max_steps=6,
        checkpoint_dir=url,
        checkpoint_every_n_steps=2,
        callbacks=list(callbacks),
        progress="off",
    )
    trainer.fit(
        storage_job.model,
        storage_job.datasets()[0],
        loss_fn=storage_job.loss,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        ckpt_path=ckpt_path,
    )
    return trainer


class OutageDuringSave:
    """Stop the server while step ``step``'s files are being written; start it again ``seconds`` later."""

    def __init__(self, server: Server, step: int, seconds: float) -> None:
        self.server, self.step, self.seconds, self.metrics = server, step, seconds, []

    @unison.hookimpl
    def unison_on_save_checkpoint(self, trainer) -> None:
        if trainer.global_step == self.step:
            self.server.down()
            threading.Timer(self.seconds, self.server.up).start()

    @unison.hookimpl
    def unison_log_metrics(self, metrics) -> None:
        self.metrics.append(metrics)


@pytest.mark.timeout(240)
def test_a_short_outage_during_a_save_is_retried_and_the_save_succeeds(server):
    url = f"s3://{s3_server.BUCKET}/short-outage"
    outage = OutageDuringSave(server, step=4, seconds=3.0)
    trainer = _fit(url, [outage])
    assert trainer.checkpointer.storage.retries > 0
    counted = [m["checkpoint/storage_retries"] for m in outage.metrics if "checkpoint/storage_retries" in m]
    assert counted and counted[-1] == trainer.checkpointer.storage.retries
    assert [c.manifest.step for c in Checkpointer(url).committed()] == [2, 4, 6]
    assert Checkpointer(url).select("last").manifest.step == 6  # every file verifies


@pytest.mark.timeout(240)
def test_an_outage_fails_with_one_message_and_resume_is_correct_once_the_server_is_back(server, tmp_path):
    url = f"s3://{s3_server.BUCKET}/long-outage"
    job = subprocess.Popen(
        [sys.executable, str(HERE / "storage_job.py"), url, "6", "2", "0.3"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "UNISON_STORAGE_RETRY_S": "3", "PYTHONPATH": str(HERE)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    checkpointer = Checkpointer(url)
    deadline = time.monotonic() + 120
    while not checkpointer.committed() and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.2)
    server.down()  # the save of step 4 finds no server
    out = job.communicate(timeout=120)[0]
    assert job.returncode != 0
    assert f"object storage at {server.s3.endpoint} failed to" in out and f"s3://{s3_server.BUCKET}/long-outage" in out
    assert "botocore" not in out and "aiohttp" not in out, out  # one message, not the client's traceback
    server.up()
    assert [c.manifest.step for c in checkpointer.committed()] == [2]
    with pytest.warns(LeaseWarning, match=f"pid {job.pid} "):
        resumed = _fit(url, ckpt_path="auto")
    assert resumed.progress.history[0]["step"] == 2
    reference = _fit(str(tmp_path / "uninterrupted"))
    assert max_abs_diff(resumed.full_state_dict(), reference.full_state_dict()) == 0.0
