"""``ddp``: torch ``DistributedDataParallel`` (gloo on CPU, nccl on CUDA)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import pydantic
import torch
from torch.nn.parallel import DistributedDataParallel

from unison.contract.env import DistEnv
from unison.contract.ownership import AccumulationOwner, GradAccumulation, LossNormalisation, Ownership, ReplicaInit
from unison.contract.replicated import DCP_FULL_STATE, TRAINER_PRECISION, ReplicatedStrategy
from unison.plugin import hookimpl
from unison.plugin.registry import StrategySpec


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


def distributed_data_parallel(module: torch.nn.Module, env: DistEnv, **options: Any) -> DistributedDataParallel:
    """``module`` wrapped in DistributedDataParallel on this rank's device (the wrapper of every DDP-based strategy).

    Its constructor broadcasts rank 0's parameters and buffers, so replicas start equal.
    """
    return DistributedDataParallel(
        module, device_ids=[env.device.index] if env.device.type == "cuda" else None, **options
    )


class DDPStrategy(ReplicatedStrategy):
    """DistributedDataParallel around whole replicas; the base's setup, clipping and DCP checkpoints."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = DDPOptions(**options)

    @property
    def ownership(self) -> Ownership:
        return Ownership(
            loss_normalisation=LossNormalisation(
                over=("the data-parallel replicas: DistributedDataParallel's all-reduce averages")
            ),
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

    def wrap_module(self, module: torch.nn.Module) -> DistributedDataParallel:
        assert self.env is not None
        return distributed_data_parallel(module, self.env, **self.options.model_dump())

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
