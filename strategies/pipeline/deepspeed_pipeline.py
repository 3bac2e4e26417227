"""``deepspeed_pipeline``: DeepSpeed's ``PipelineModule`` and ``PipelineEngine`` (fp32 only).

Decisions, and why:

* The engine runs its own ``TrainSchedule`` (1F1B) for the forwards,
  backwards and the data-parallel gradient all-reduce (``ReduceGrads``),
  with ``gradient_accumulation_steps = accumulate_grad_batches`` so its
  backward divides each micro-batch loss by that count: gradients are the
  mean over micro-batches, as for every backend.
* Its ``OptimizerStep`` instruction is left out of the schedule
  (:func:`~unison._upstream.deepspeed.run_train_schedule_without_step`).
  ``train_batch()`` would clip, step and zero inside one call; the trainer
  must see the global norm, fire ``before_optimizer_step`` and step the
  client optimizer and scheduler itself, exactly once per step. Clipping,
  losses on every rank, validation and checkpoints are the shared pipeline
  base's (:mod:`.base`), because a ``PipelineModule`` registers each layer
  under its index in the layer list, that is, under the Sequential's own names.
* Ranks are laid out as for ``pipeline`` (``rank = replica * stages +
  stage``): the topology is ``ProcessTopology(axes=["data", "pipe"])``, and
  the pipeline and data-parallel groups are the engine's own (``engine.grid``).
* Only fp32: DeepSpeed applies bf16/fp16 through its own optimizer
  wrappers, whose step is the instruction this strategy leaves out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pydantic
import torch
import torch.distributed as dist

from unison._upstream.deepspeed import (
    forget_process_groups,
    import_deepspeed,
    run_train_schedule_without_step,
)
from unison.contract.ownership import (
    AccumulationOwner,
    Feature,
    GradAccumulation,
    LossNormalisation,
    Ownership,
    PrecisionOwner,
    PrecisionSupport,
)
from unison.contract.precision import Precision
from unison.contract.strategy import LossFn, OptimizerFactory
from unison.errors import ConfigurationError
from unison.strategies.pipeline.base import (
    PIPELINE_REFUSALS,
    PIPELINE_STATE,
    StagedStrategy,
    pipeline_world_sizes,
    split_pair,
)
from unison.strategies.pipeline.layout import ChunkLayout, check_model
from unison.strategies.pipeline.p2p import as_tensor


class DeepSpeedPipelineOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    stages: int = pydantic.Field(2, ge=1)
    """Pipeline stages per replica; the world size must be a multiple of it."""
    partition_method: str = "parameters"
    """DeepSpeed's own layer partitioning: ``parameters``, ``uniform`` or ``type:REGEX``."""


_UNSUPPORTED = (
    "DeepSpeed's pipeline engine applies {0} through its own optimizer wrapper, which steps inside the "
    "OptimizerStep instruction that deepspeed_pipeline leaves to the trainer; use strategy 'pipeline' for {0}"
)


class DeepSpeedPipelineStrategy(StagedStrategy):
    """DeepSpeed's ``PipelineModule`` and ``PipelineEngine`` (fp32 only; see the module doc)."""

    def __init__(self, **options: Any) -> None:
        self.options = DeepSpeedPipelineOptions(**options)
        super().__init__(ChunkLayout(self.options.stages))
        #: ``(loss_fn, record)`` while a schedule runs: the last stage's undivided losses go to ``record``.
        self._loss: tuple[LossFn, list[torch.Tensor]] | None = None
        self.engine: Any = None

    @property
    def ownership(self) -> Ownership:
        return Ownership(
            loss_normalisation=LossNormalisation(
                over=(
                    "each stage's data-parallel replicas: the engine's reduce averages "
                    "(its backward divides by gradient_accumulation_steps)"
                )
            ),
            grad_accumulation=GradAccumulation(
                AccumulationOwner.SCHEDULE,
                "DeepSpeed PipelineEngine TrainSchedule with gradient_accumulation_steps = accumulate_grad_batches "
                "(the engine divides each micro-batch loss by it) and its ReduceGrads data-parallel all-reduce; "
                "the OptimizerStep instruction is left out: the trainer clips (global norm over the pipeline) "
                "and steps the client optimizer",
            ),
            precision={
                "32-true": PrecisionSupport(PrecisionOwner.TRAINER, "fp32 parameters, activations and compute"),
                "bf16-mixed": PrecisionSupport.unsupported(_UNSUPPORTED.format("bf16")),
                "bf16-true": PrecisionSupport.unsupported(_UNSUPPORTED.format("bf16")),
                "16-mixed": PrecisionSupport.unsupported(_UNSUPPORTED.format("fp16 loss scaling")),
            },
            state_dict=PIPELINE_STATE,
            refuses={
                **PIPELINE_REFUSALS,
                Feature.ARBITRARY_MODULE: "DeepSpeed's PipelineModule takes a list of layers: pass an nn.Sequential "
                "(strategy 'pipeline' also accepts a module declaring pipeline_layers)",
                Feature.ACTIVATION_CHECKPOINTING: "DeepSpeed's PipelineModule runs the layers itself and unison does "
                "not drive its activation_checkpoint_interval: use strategy 'pipeline' for activation checkpointing",
            },
            world_sizes=pipeline_world_sizes(self.options.stages),
            notes=(
                "DeepSpeed partitions the Sequential's children (partition_method)",
                "inputs, targets and the activations between stages must be single tensors",
                "validation runs a plain forward through the stages (no schedule), one batch at a time",
            ),
        )

    def validate_model(self, model: torch.nn.Module, settings: Any) -> None:
        if not isinstance(model, torch.nn.Sequential):
            # PipelineModule takes a list of layers; declared split points
            # (pipeline_layers) are supported by `pipeline` only.
            raise ConfigurationError(
                "model",
                f"strategy 'deepspeed_pipeline' partitions an nn.Sequential's children, got {type(model).__name__}",
                "express the model as torch.nn.Sequential of its layers, or use strategy 'pipeline', which also "
                "accepts a module declaring pipeline_layers",
            )
        check_model(model, self.layout.chunks, None)

    def build(self, module: torch.nn.Module, make_optimizer: OptimizerFactory) -> tuple[Any, torch.optim.Optimizer]:
        # The engine wraps and builds the optimizer in one call (module on the device already).
        env, settings = self.env, self.settings
        assert env is not None and settings is not None
        deepspeed = import_deepspeed(env.device)
        from deepspeed.pipe import PipelineModule
        from deepspeed.runtime.pipe.topology import ProcessTopology

        S = self.layout.stages
        R = self.layout.replicas(env.world_size)
        # PipelineModule needs deepspeed.comm before the engine exists; it
        # wraps the trainer's process group.
        deepspeed.init_distributed(dist_backend=dist.get_backend())
        pipe_module = PipelineModule(
            layers=list(module.children()),
            loss_fn=self._ds_loss,
            topology=ProcessTopology(axes=["data", "pipe"], dims=[R, S]),
            partition_method=self.options.partition_method,
        )
        optimizer = make_optimizer(pipe_module.parameters())
        config = {
            "train_batch_size": settings.global_batch_size,
            "train_micro_batch_size_per_gpu": settings.micro_batch_size(R),
            "gradient_accumulation_steps": settings.accumulate_grad_batches,
            "gradient_clipping": 0.0,  # the trainer clips by the global norm
            "steps_per_print": 2**31 - 1,
        }
        self.engine, _, _, _ = deepspeed.initialize(model=pipe_module, optimizer=optimizer, config=config)
        stage = self.layout.stage_of(env.rank)
        assert self.engine.stage_id == stage, "DeepSpeed topology disagrees with the rank layout"
        self._place(
            env,
            module,
            {stage: pipe_module},
            pp_group=self.engine.grid.get_pipe_parallel_group(),
            dp_group=self.engine.grid.get_data_parallel_group(),
            micro_batches=settings.accumulate_grad_batches,
        )
        self.module = pipe_module  # what this rank trains: canonical names come from it
        return self.engine, optimizer

    def _ds_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss is not None
        loss_fn, record = self._loss
        loss, items = split_pair(loss_fn(output, target))
        # Undivided: the engine's backward divides by gradient_accumulation_steps (a pair's sum likewise).
        record.append((loss.detach(), items))
        return loss

    def forward_backward(
        self, micro_batches: Sequence[tuple[Any, Any]], loss_fn: LossFn, precision: Precision
    ) -> list[torch.Tensor]:
        n = len(micro_batches)
        self._check_micro_batch_count(n)
        record: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._loss = (loss_fn, record)
        try:
            batches = [(as_tensor(x, "inputs"), as_tensor(y, "targets")) for x, y in micro_batches]
            run_train_schedule_without_step(self.engine, batches)
        finally:
            self._loss = None
        return self._step_losses(record if self.is_last else None, n)

    def make_grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        raise NotImplementedError("deepspeed_pipeline supports fp32 only")

    def teardown(self) -> None:
        super().teardown()
        if self.engine is not None:
            forget_process_groups()  # the pipeline engine cloned the world's groups too
        self.engine = None


__all__ = ["DeepSpeedPipelineOptions", "DeepSpeedPipelineStrategy"]
