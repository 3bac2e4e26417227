"""Pipeline parallelism: the ``pipeline``, ``pipeline_fsdp`` and ``deepspeed_pipeline`` strategies.

One plugin (entry point ``pipeline``) registering three strategies, split by concern:

* :mod:`.layout` – pure functions: the model as a chain of layers, the cut into
  model chunks (balanced by parameter count), the placement of chunks on ranks,
  the micro-batch counts a schedule can run. No process group; unit-tested alone.
* :mod:`.p2p` – point-to-point activations for validation.
* :mod:`.base` – :class:`~.base.StagedStrategy`, what both strategies share
  after their schedule: losses on every rank, global clipping, validation,
  canonical state and DCP checkpoints under the model's own names.
* :mod:`.torch_pipeline` – ``pipeline`` (``torch.distributed.pipelining``).
* :mod:`.pipeline_fsdp` – ``pipeline_fsdp`` (the same schedules, each stage sharded with FSDP2 over ``dp``).
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
from unison.strategies.pipeline.pipeline_fsdp import PipelineFSDPOptions, PipelineFSDPStrategy
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
            name="pipeline_fsdp",
            factory=PipelineFSDPStrategy,
            description="pipeline's stages and schedules on a pp mesh dimension, each stage sharded with FSDP2 "
            "fully_shard on dp; schedule-owned accumulation, one reduce-scatter per step",
            options=PipelineFSDPOptions,
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
    "PipelineFSDPOptions",
    "PipelineFSDPStrategy",
    "PipelineOptions",
    "PipelineStrategy",
    "as_layers",
    "balance_by_parameters",
    "check_micro_batches",
    "check_model",
    "split_sequential",
]
