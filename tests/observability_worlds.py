"""Shared by the observability tests: a token model, a metrics recorder, the 2-rank backend world,
each logger's reader, and a real MLflow tracking server.

DeepSpeed picks its accelerator at first import, so ``DS_ACCELERATOR=cpu`` is
set here, before anything imports deepspeed in a spawned rank.
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_SILENT", "true")

import json
import math
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

import unison
from unison.plugins.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from unison.plugins.loggers import (
    CSVLogger,
    JSONLLogger,
    MLflowLogger,
    RunDirectory,
    TensorBoardLogger,
    WandbLogger,
    read_csv,
    read_jsonl,
    read_scalars,
)

VOCAB, SEQ = 32, 8
BACKENDS = ["ddp", "fsdp", "zero2"]


class TokenModel(torch.nn.Module):
    """Token ids (B, T) -> class logits (B, VOCAB): an embedding, mean-pooled, and a linear head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens).mean(dim=1)))


def token_data(n: int = 256, seed: int = 5) -> TensorDataset:
    """Integer token batches (so the trainer counts tokens): class c draws its ids from [8c, 8c + 8)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = y[:, None] * 8 + torch.randint(0, 8, (n, SEQ), generator=g)
    return TensorDataset(x, y)


def shifted_val() -> TensorDataset:
    """Validation data with every third label moved to the next class: its loss falls, then rises."""
    x, y = token_data(n=40, seed=9).tensors
    y = y.clone()
    y[::3] = (y[::3] + 1) % 4
    return TensorDataset(x, y)


class MetricsRecorder:
    """What the trainer handed to loggers (every ``unison_log_metrics`` call), merged per step."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []

    @unison.hookimpl
    def unison_log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((step, dict(metrics)))

    def by_step(self) -> dict[int, dict[str, float]]:
        merged: dict[int, dict[str, float]] = {}
        for step, metrics in self.calls:
            merged.setdefault(step, {}).update(metrics)
        return merged


SETTINGS = dict(
    global_batch_size=16,
    accumulate_grad_batches=2,
    max_steps=16,
    log_every_n_steps=2,
    val_every_n_steps=2,
    grad_clip_norm=1.0,
    seed=0,
    progress="off",
)


def fit(
    strategy: str,
    callbacks: Any = (),
    loggers: Any = (),
    lr: float = 0.08,
    gamma: float = 0.9,
    val: Any = None,
    **settings: Any,
) -> unison.Trainer:
    """Train TokenModel with AdamW and StepLR; the default validation set's loss is U-shaped (best at step 8)."""
    trainer = unison.Trainer(
        strategy=strategy, callbacks=list(callbacks), loggers=list(loggers), **{**SETTINGS, **settings}
    )
    trainer.fit(
        TokenModel(),
        token_data(),
        loss_fn=torch.nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=gamma),
        val_dataset=val if val is not None else shifted_val(),
    )
    return trainer


def logged_run(strategy: str, root: str, tracking_uri: str | None) -> dict[str, Any]:
    """A run with every logger, LearningRateMonitor and best-2 ModelCheckpoint; what rank 0 saw."""
    recorder = MetricsRecorder()
    run = RunDirectory(Path(root) / "runs")
    loggers = [JSONLLogger(run), CSVLogger(run), TensorBoardLogger(run), WandbLogger(run, project="backends")]
    mlflow = None
    if tracking_uri is not None:
        mlflow = MLflowLogger(run, tracking_uri=tracking_uri, experiment="backends", run_name=strategy)
    checkpoint = ModelCheckpoint(monitor="val/loss", save_top_k=2)
    trainer = fit(
        strategy,
        callbacks=[recorder, LearningRateMonitor(), checkpoint],
        loggers=loggers + ([mlflow] if mlflow else []),
        checkpoint_dir=str(Path(root) / "ckpt"),
    )
    return {
        "metrics": recorder.by_step(),
        "calls": recorder.calls,
        "run_dir": str(loggers[0].path) if loggers[0].path else None,
        "mlflow_run_id": mlflow.run_id if mlflow else None,
        "ownership": trainer.ownership.to_dict(),
        "ckpt_root": str(Path(root) / "ckpt"),
        "scores": checkpoint.scores,
        "history": [dict(step=h["step"], loss=h["loss"]) for h in trainer.progress.history],
    }


def early_stopped_run(strategy: str) -> dict[str, Any]:
    """EarlyStopping on a validation loss that keeps improving, ever more slowly (it stops at step 26)."""
    stopper = EarlyStopping(monitor="val/loss", patience=2, min_delta=0.05)
    recorder = MetricsRecorder()
    trainer = fit(
        strategy, callbacks=[stopper, recorder], max_steps=40, lr=0.05, gamma=0.7, val=token_data(n=40, seed=9)
    )
    return {
        "global_step": trainer.global_step,
        "stopped_step": stopper.stopped_step,
        "val": {s: m["val/loss"] for s, m in recorder.by_step().items() if "val/loss" in m},
    }


def backend_world(root: str, tracking_uri: str | None) -> dict[str, Any]:
    """Every rank: the logged run and the early-stopped run under each backend, in one process group."""
    rank = torch.distributed.get_rank()
    out: dict[str, Any] = {}
    for strategy in BACKENDS:
        # Rank 0 writes; the other ranks get the same directory for checkpoints (saving is collective).
        out[strategy] = logged_run(strategy, str(Path(root) / strategy), tracking_uri)
        out[strategy]["early"] = early_stopped_run(strategy)
        out[strategy]["rank"] = rank
    return out


# --------------------------------------------------------------------------- #
# Reading each logger's output back through its own reader
# --------------------------------------------------------------------------- #
Metrics = dict[int, dict[str, float]]


def jsonl_metrics(run_dir: Path) -> Metrics:
    merged: Metrics = {}
    for record in read_jsonl(run_dir / "metrics.jsonl"):
        step = record.pop("step")
        record.pop("time")
        merged.setdefault(step, {}).update(record)
    return merged


def csv_metrics(run_dir: Path) -> Metrics:
    rows = read_csv(run_dir / "metrics.csv")
    steps = [row["step"] for row in rows]
    assert len(steps) == len(set(steps)), "one CSV row per step"
    return {row.pop("step"): {k: v for k, v in row.items() if k != "time"} for row in rows}


def tensorboard_metrics(run_dir: Path) -> Metrics:
    """Through tensorboard's EventAccumulator.Scalars (float32 values: compare with :func:`as_float32`)."""
    merged: Metrics = {}
    for tag, events in read_scalars(run_dir / "tensorboard").items():
        for step, value in events:
            merged.setdefault(step, {})[tag] = value
    return merged


def wandb_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of the offline run, through W&B's own reader (``wandb leet inspect --json``)."""
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(files[0])],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def wandb_metrics(run_dir: Path) -> Metrics:
    merged: Metrics = {}
    for record in wandb_records(run_dir):
        if record["type"] == "history":
            item = record["history"]["item"]
            merged.setdefault(int(item["_step"]), {}).update({k: v for k, v in item.items() if not k.startswith("_")})
    return merged


def wandb_config(run_dir: Path) -> dict[str, Any]:
    run = next(r for r in wandb_records(run_dir) if r["type"] == "run")
    return run["run"]["config"]["update"]


def mlflow_metrics(client: Any, run_id: str) -> Metrics:
    """Through MLflow's client, from the tracking server."""
    merged: Metrics = {}
    for key in client.get_run(run_id).data.metrics:
        for m in client.get_metric_history(run_id, key):
            merged.setdefault(m.step, {})[key] = m.value
    return merged


def as_float32(metrics: Metrics) -> Metrics:
    """Every value rounded to float32, as TensorBoard's scalar summary stores it (exact, not a tolerance)."""
    return {step: {k: float(np.float32(v)) for k, v in m.items()} for step, m in metrics.items()}


def same(a: Metrics, b: Metrics) -> None:
    """Exactly the same steps, names and values (inf/nan compared as such)."""
    assert sorted(a) == sorted(b)
    for step in a:
        assert sorted(a[step]) == sorted(b[step]), step
        for key, value in a[step].items():
            other = b[step][key]
            assert value == other or (math.isnan(value) and math.isnan(other)), (step, key, value, other)


# -- a real MLflow tracking server, on 127.0.0.1, in its own temporary directory ------------ #
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def mlflow_server(timeout: float = 180) -> Iterator[str]:
    """Start ``mlflow server`` (sqlite backend, artifacts in a temp dir) and yield its URI; stop it after."""
    with tempfile.TemporaryDirectory(prefix="unison-mlflow-") as tmp, open(Path(tmp) / "server.log", "w") as log:
        port = _free_port()
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no background job workers
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{tmp}/mlflow.db",
                "--artifacts-destination",
                f"{tmp}/artifacts",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        uri = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mlflow server did not start: {(Path(tmp) / 'server.log').read_text()[-3000:]}")
                time.sleep(0.5)
            yield uri
        finally:
            # The server and its uvicorn worker share the session we started it in.
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
