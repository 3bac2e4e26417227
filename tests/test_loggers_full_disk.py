"""A metrics disk that fills during training: each logger reports it once and is disabled; training finishes.

The run's loggers (JSONL, CSV, TensorBoard, MLflow on a SQLite store) write to a real 16 MiB tmpfs
(room for MLflow's schema, which grows between MLflow releases) that a callback fills after step 5;
checkpoints go to an ordinary directory. The policy (docs/logging.md, "When a logger cannot write"):
one warning per logger naming it and where it writes, no raw traceback, the run ends with exit 0 and
its last checkpoint verifies. Mounting a tmpfs needs root; elsewhere the test is skipped with that reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from unison.checkpointing.checkpointer import Checkpointer

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import os, sys, torch, unison
from torch.utils.data import TensorDataset
from unison.plugins.loggers import CSVLogger, JSONLLogger, MLflowLogger, TensorBoardLogger

disk, ckpt = sys.argv[1], sys.argv[2]


class FillTheDisk:
    @unison.hookimpl
    def unison_on_train_step_end(self, step):
        if step == 5:  # the sixth step: every logger has written a few steps by now
            with open(os.path.join(disk, "filler"), "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"x" * 4096)
                except OSError:  # the disk is full
                    pass


run = disk + "/runs"
x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
trainer = unison.Trainer(
    strategy="single", global_batch_size=32, max_steps=40, log_every_n_steps=1, progress="off",
    checkpoint_dir=ckpt, checkpoint_every_n_steps=20, callbacks=[FillTheDisk()],
    loggers=[JSONLLogger(run), CSVLogger(run), TensorBoardLogger(run, flush_secs=1),
             MLflowLogger(run, tracking_uri=f"sqlite:///{disk}/mlflow.db")],
)
progress = trainer.fit(torch.nn.Linear(8, 1), TensorDataset(x, x.sum(dim=1, keepdim=True)),
                       loss_fn=torch.nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
print("finished at step", progress.global_step, flush=True)
"""


@pytest.fixture
def full_disk(tmp_path):
    """A 16 MiB tmpfs mounted at ``tmp_path/disk`` (unmounted afterwards)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here (needs root): {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_metrics_disk_disables_each_logger_once_and_training_finishes(full_disk, tmp_path):
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_EXPERIMENT_NAME": f"full-{uuid.uuid4().hex[:8]}"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(full_disk), str(ckpt)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    err = proc.stderr
    assert proc.returncode == 0, err[-4000:]
    assert "finished at step 40" in proc.stdout
    version = full_disk / "runs" / "version_0"
    where = {
        "JSONLLogger": str(version),
        "CSVLogger": str(version),
        "TensorBoardLogger": str(version / "tensorboard"),
        "MLflowLogger": f"the MLflow tracking store sqlite:///{full_disk}/mlflow.db",
    }
    for name, location in where.items():
        assert err.count(f"{name} could not write") == 1, err[-4000:]
        line = next(line for line in err.splitlines() if f"{name} could not write" in line)
        assert f"could not write to {location}" in line, line
        assert "it is disabled for the rest of this run and training goes on" in line, line
    assert "No space left on device" in err or "disk is full" in err
    assert "Traceback" not in err and "Exception in thread" not in err, err[-4000:]
    # The files hold the steps written before the disk filled, none torn.
    lines = (version / "metrics.jsonl").read_text().splitlines()
    assert 1 <= len(lines) < 40, len(lines)  # the steps up to the moment the disk was full
    assert [json.loads(line)["step"] for line in lines[:-1]] == list(range(1, len(lines)))
    # Checkpoints are what matter: both commits are there and verify.
    latest = Checkpointer(ckpt).latest()
    assert latest is not None and latest.name == "step-00000040"
    verified = subprocess.run(
        [sys.executable, "-m", "unison.cli", "checkpoint", "verify", str(ckpt)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
