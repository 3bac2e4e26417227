"""What the spawned pipeline worlds run for tests/test_pipeline.py: every scenario in one process group."""

from __future__ import annotations

import tempfile
from typing import Any

import torch

import unison

from helpers import overflow_data, regression_data, train

#: Schedules with two model chunks per rank (the mlp's 5 layers cut into 4 chunks).
MULTI_CHUNK_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble")


def validation_data() -> torch.utils.data.TensorDataset:
    # 100 samples: the last validation chunk is uneven on every data-parallel size.
    return regression_data(n=100, seed=7)


def _shared_dir(prefix: str) -> str:
    root = [tempfile.mkdtemp(prefix=prefix) if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(root)
    return root[0]


class MetricLog:
    """A logger plugin keeping what the trainer logs (validation loss included)."""

    def __init__(self) -> None:
        self.metrics: list[tuple[int, dict[str, float]]] = []

    @unison.hookimpl
    def unison_log_metrics(self, metrics, step):
        self.metrics.append((step, dict(metrics)))

    def val_losses(self) -> list[tuple[int, float]]:
        return [(step, m["val/loss"]) for step, m in self.metrics if "val/loss" in m]


def batchnorm_model() -> torch.nn.Sequential:
    """An MLP with a real BatchNorm1d (batch statistics, running statistics, num_batches_tracked)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    )


def batchnorm_run(strategy: str) -> dict[str, Any]:
    # 2 stages and no data parallelism: every BatchNorm sees whole micro-batches, as in one process.
    return train(strategy, model=batchnorm_model(), max_steps=3)


def with_validation(strategy: str, **settings: Any) -> dict[str, Any]:
    log = MetricLog()
    run = train(strategy, val=validation_data(), val_every_n_steps=10, loggers=[log], **settings)
    run["val_losses"] = log.val_losses()
    return run


def mixed_precision_runs(strategy: str, **settings: Any) -> dict[str, Any]:
    return {
        "bf16-mixed": train(strategy, precision="bf16-mixed", **settings),
        "bf16-true": train(strategy, precision="bf16-true", **settings),
        "overflow": train(strategy, precision="16-mixed", data=overflow_data(), max_steps=8, **settings),
    }


def pipeline_world_scenarios() -> dict[str, Any]:
    """Run on every rank of a world of 2 (2 stages) or 4 (2 stages x 2 replicas)."""
    world = torch.distributed.get_world_size()
    out: dict[str, Any] = {"world_size": world}
    out["gpipe"] = train("pipeline", strategy_options={"schedule": "gpipe"})
    for schedule in MULTI_CHUNK_SCHEDULES:
        out[schedule] = train("pipeline", strategy_options={"schedule": schedule})
    out["1f1b"] = with_validation("pipeline", strategy_options={"schedule": "1f1b"})
    if world == 2:
        out.update(mixed_precision_runs("pipeline"))
        out["batchnorm"] = batchnorm_run("pipeline")
    # Checkpoints: pipeline -> ddp and ddp -> pipeline, 10 steps under one, 10 under the other.
    a = _shared_dir("unison-pp-to-ddp-")
    train("pipeline", max_steps=10, checkpoint_dir=a)
    out["pipeline_to_ddp"] = train("ddp", max_steps=20, checkpoint_dir=a, ckpt_path="last")
    b = _shared_dir("unison-ddp-to-pp-")
    train("ddp", max_steps=10, checkpoint_dir=b, strategy_options={})
    out["ddp_to_pipeline"] = train(
        "pipeline", max_steps=20, checkpoint_dir=b, ckpt_path="last", strategy_options={"schedule": "1f1b"}
    )
    # and into the V placement, where rank 0 holds the first and the last chunk
    out["ddp_to_pipeline_zbv"] = with_validation(
        "pipeline",
        max_steps=20,
        checkpoint_dir=b,
        ckpt_path=f"{b}/step-00000010",
        strategy_options={"schedule": "zbv_zero_bubble"},
    )
    # deepspeed_pipeline: the same parity, and checkpoints both ways with the torch pipeline / ddp.
    out["deepspeed_pipeline"] = with_validation("deepspeed_pipeline")
    out["ddp_to_deepspeed_pipeline"] = train(
        "deepspeed_pipeline", max_steps=20, checkpoint_dir=b, ckpt_path=f"{b}/step-00000010"
    )
    c = _shared_dir("unison-ds-to-pp-")
    train("deepspeed_pipeline", max_steps=10, checkpoint_dir=c)
    out["deepspeed_pipeline_to_pipeline"] = train("pipeline", max_steps=20, checkpoint_dir=c, ckpt_path="last")
    out["tmp_dirs"] = [a, b, c]
    # Left for the parent to resume under `single` (another world size).
    out["pipeline_ckpt_dir"] = a
    return out
