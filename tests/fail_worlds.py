"""Stop decisions that one rank makes, agreed by every rank (importable by spawned ranks)."""

from __future__ import annotations

import math
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

import unison
from unison.launch.lifecycle import Preempted
from unison.strategies.pipeline.torch_pipeline import PipelineOptions, PipelineStrategy

from helpers import mlp, regression_data


def _shared_dir(prefix: str) -> str:
    name = [tempfile.mkdtemp(prefix=prefix) if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(name, src=0)
    return name[0]


def nan_on_rank_1(strategy: str) -> dict[str, Any]:
    """Sample 37 is NaN: step 2 (samples 32..47), micro-batch 0 (32..39), rank 1's half (36..39)."""
    x, y = regression_data(n=64).tensors
    x = x.clone()
    x[37] = math.nan
    root = _shared_dir("unison-nan-")
    trainer = unison.Trainer(
        strategy=strategy,
        global_batch_size=16,
        accumulate_grad_batches=2,
        max_steps=4,
        shuffle=False,
        checkpoint_dir=root,
        checkpoint_every_n_steps=1,
    )
    try:
        trainer.fit(
            mlp(),
            TensorDataset(x, y),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
        )
        error = None
    except unison.NonFiniteError as exc:
        error = str(exc)
    return {
        "error": error,
        "global_step": trainer.progress.global_step,
        "optimizer_steps": trainer.progress.optimizer_steps,
        "root": root,
    }


class StopOnRank1:
    """A per-rank decision (think: a wall-clock limit) taken on rank 1 only, at step 3."""

    @unison.hookimpl
    def unison_on_train_step_end(self, trainer: Any, step: int) -> None:
        if trainer.env.rank == 1 and step == 3:
            trainer.should_stop = True


def stop_from_one_rank(strategy: str) -> dict[str, Any]:
    root = _shared_dir("unison-stop-")
    trainer = unison.Trainer(
        strategy=strategy,
        global_batch_size=16,
        accumulate_grad_batches=2,
        max_steps=10,
        checkpoint_dir=root,
        checkpoint_every_n_steps=2,
        callbacks=[StopOnRank1()],
    )
    progress = trainer.fit(
        mlp(),
        regression_data(n=64),
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
    )
    return {"global_step": progress.global_step, "root": root, "latest": str(trainer.checkpointer.latest())}


def fail_world(strategies: tuple[str, ...]) -> dict[str, Any]:
    return {name: {"nan": nan_on_rank_1(name), "stop": stop_from_one_rank(name)} for name in strategies}


class AtStep:
    """On one rank, at the end of one step: set ``should_stop``, or send this process SIGUSR1."""

    def __init__(self, rank: int, step: int, what: str) -> None:
        self.rank, self.step, self.what = rank, step, what
        #: Whether the fit's loss all-reduce carried the stop flags (unison.training.stopping).
        self.carried: bool | None = None

    @unison.hookimpl
    def unison_on_fit_start(self, trainer: Any) -> None:
        self.carried = trainer._fit.loop.stop.carried  # the fit's TrainLoop (unison.training.record)

    @unison.hookimpl
    def unison_on_train_step_end(self, trainer: Any, step: int) -> None:
        if trainer.env.rank == self.rank and step == self.step:
            if self.what == "should_stop":
                trainer.should_stop = True
            else:
                os.kill(os.getpid(), signal.SIGUSR1)


class BroadcastPipeline(PipelineStrategy):
    """``pipeline`` as plugin API 2.3 had it: it reports no losses (``None``), so its last stage's losses are
    broadcast over the pipeline and summed with ``reduce_sum``; its replicas are not the world, so the stop
    agreement keeps its own all-reduce on the CPU (what a third-party pipeline or tensor-parallel strategy
    written for 2.3 gets)."""

    def reports_step_losses(self) -> bool | None:
        return None


class BroadcastPipelinePlugin:
    @unison.hookimpl
    def unison_strategies(self) -> list[unison.StrategySpec]:
        return [
            unison.StrategySpec(
                name="pipeline_broadcast", factory=BroadcastPipeline, description="test", options=PipelineOptions
            )
        ]


def stop_run(strategy: str, what: str, rank: int, step: int, every: int) -> dict[str, Any]:
    """Ten steps at most, a checkpoint every ``every`` steps; ``what`` happens on ``rank`` at ``step``."""
    root = _shared_dir("unison-stop-")
    trainer = unison.Trainer(
        plugin_manager=unison.PluginManager(plugins=[BroadcastPipelinePlugin()]),
        strategy=strategy,
        global_batch_size=16,
        accumulate_grad_batches=2,
        max_steps=10,
        checkpoint_dir=root,
        checkpoint_every_n_steps=every,
        progress="off",
        callbacks=[at := AtStep(rank, step, what)],
    )
    preempted = None
    try:
        trainer.fit(
            mlp(),
            regression_data(n=64),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
        )
    except Preempted as exc:
        preempted = {"step": exc.step, "signal": exc.signal_name, "checkpoint": exc.checkpoint}
    return {
        "root": root,
        "preempted": preempted,
        "global_step": trainer.progress.global_step,
        "steps": [h.step for h in trainer.progress.history],
        "losses": [[float(v) for v in h.micro_losses] for h in trainer.progress.history],
        "grad_norms": [float(h.grad_norm) for h in trainer.progress.history],
        "checkpoints": sorted(p.name for p in Path(root).glob("step-*")),
        "carried": at.carried,
    }


def stop_world(strategies: tuple[str, ...]) -> dict[str, Any]:
    return {
        name: {
            "should_stop": stop_run(name, "should_stop", rank=1, step=2, every=5),
            "signal": stop_run(name, "signal", rank=0, step=2, every=5),
            "signal_at_save": stop_run(name, "signal", rank=1, step=3, every=2),
            "signal_in_last_step": stop_run(name, "signal", rank=1, step=9, every=4),
        }
        for name in strategies
    }
