"""``ddp``: torch ``DistributedDataParallel`` (gloo on CPU, nccl on CUDA)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import pydantic
import torch
from torch.nn.parallel import DistributedDataParallel

from unison.contract.ownership import AccumulationOwner, GradAccumulation, Ownership, ReplicaInit
from unison.contract.strategy import OptimizerFactory
from unison.plugin import hookimpl
from unison.plugin.registry import StrategySpec
from unison.strategies._torch import DCP_FULL_STATE, TRAINER_PRECISION, ReplicatedStrategy


class DDPOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    bucket_cap_mb: float = pydantic.Field(25.0, gt=0)
    """Gradient bucket size for the all-reduce."""
    find_unused_parameters: bool = False
    """Set when some parameters get no gradient in a forward."""
    gradient_as_bucket_view: bool = False
    """Let gradients alias the communication buckets (saves memory)."""
    static_graph: bool = False
    """Promise DDP the graph never changes between iterations."""
    forward_sync_buffers: bool = True
    """Broadcast rank 0's buffers (BatchNorm statistics) at every forward."""


class DDPStrategy(ReplicatedStrategy):
    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = DDPOptions(**options)

    @property
    def ownership(self) -> Ownership:
        return Ownership(
            grad_accumulation=GradAccumulation(
                AccumulationOwner.TRAINER,
                "DistributedDataParallel.no_sync() on non-boundary micro-steps: one all-reduce per optimizer step",
            ),
            precision=TRAINER_PRECISION,
            state_dict=DCP_FULL_STATE,
            # DistributedDataParallel's constructor broadcasts rank 0's
            # parameters and buffers; the trainer need not do it again.
            replica_init=ReplicaInit.STRATEGY,
        )

    def setup(
        self, module: torch.nn.Module, make_optimizer: OptimizerFactory, *, precision: Any, settings: Any
    ) -> None:
        env = self.env
        assert env is not None
        module = module.to(env.device)
        self.module = module
        self.model = DistributedDataParallel(
            module,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            **self.options.model_dump(),
        )
        self.optimizer = make_optimizer(module.parameters())

    def no_sync(self) -> AbstractContextManager[Any]:
        return self.model.no_sync()


@hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="ddp",
            factory=DDPStrategy,
            description="torch DistributedDataParallel; trainer-owned accumulation through no_sync()",
            options=DDPOptions,
        )
    ]
