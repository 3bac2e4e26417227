"""Pipeline parallelism: the ``pipeline`` and ``deepspeed_pipeline`` strategies.

One plugin (entry point ``pipeline``), split by concern:

* :mod:`.layout` – pure functions: the model as a chain of layers, the cut into
  model chunks (balanced by parameter count), the placement of chunks on ranks,
  the micro-batch counts a schedule can run. No process group; unit-tested alone.
* :mod:`.p2p` – point-to-point activations for validation.
* :mod:`.base` – :class:`~.base.StagedStrategy`, what both strategies share
  after their schedule: losses on every rank, global clipping, validation,
  canonical state and DCP checkpoints under the model's own names.
* :mod:`.torch_pipeline` – ``pipeline`` (``torch.distributed.pipelining``).
* :mod:`.deepspeed_pipeline` – ``deepspeed_pipeline`` (DeepSpeed's pipeline engine).
"""

from __future__ import annotations

from unison.plugin import hookimpl
from unison.plugin.registry import StrategySpec, missing_modules
from unison.strategies.pipeline.deepspeed_pipeline import DeepSpeedPipelineOptions, DeepSpeedPipelineStrategy
from unison.strategies.pipeline.layout import (
    SCHEDULES,
    ChunkLayout,
    as_layers,
    balance_by_parameters,
    check_micro_batches,
    check_model,
    split_sequential,
)
from unison.strategies.pipeline.torch_pipeline import PipelineOptions, PipelineStrategy


@hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="pipeline",
            factory=PipelineStrategy,
            description="torch.distributed.pipelining (GPipe, 1F1B, interleaved, zero-bubble) over an nn.Sequential "
            "or a module declaring pipeline_layers; schedule-owned accumulation",
            options=PipelineOptions,
        ),
        StrategySpec(
            name="deepspeed_pipeline",
            factory=DeepSpeedPipelineStrategy,
            description="DeepSpeed PipelineModule + PipelineEngine over an nn.Sequential (fp32); "
            "schedule-owned accumulation",
            options=DeepSpeedPipelineOptions,
            unavailable=missing_modules("deepspeed"),
        ),
    ]


__all__ = [
    "SCHEDULES",
    "ChunkLayout",
    "DeepSpeedPipelineOptions",
    "DeepSpeedPipelineStrategy",
    "PipelineOptions",
    "PipelineStrategy",
    "as_layers",
    "balance_by_parameters",
    "check_micro_batches",
    "check_model",
    "split_sequential",
]
