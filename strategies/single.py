"""``single``: one process, one device, no process group. The conformance reference."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch

from unison.contract.ownership import AccumulationOwner, GradAccumulation, LossNormalisation, Ownership
from unison.contract.replicated import DCP_FULL_STATE, TRAINER_PRECISION, ReplicatedStrategy
from unison.errors import ConfigurationError
from unison.plugin import hookimpl
from unison.plugin.registry import StrategySpec


class SingleStrategy(ReplicatedStrategy):
    """Plain ``model(x)``, ``loss.backward()``, ``optimizer.step()``."""

    @property
    def ownership(self) -> Ownership:
        return Ownership(
            loss_normalisation=LossNormalisation(over="one process: nothing to reduce"),
            grad_accumulation=GradAccumulation(
                AccumulationOwner.TRAINER, "gradients add up in param.grad; there is nothing to synchronise"
            ),
            precision=TRAINER_PRECISION,
            state_dict=DCP_FULL_STATE,
        )

    def process_group_backend(self, device: torch.device) -> str | None:
        return None

    def validate(self, settings: Any, world_size: int) -> None:
        if world_size > 1:
            raise ConfigurationError(
                "strategy",
                f"'single' trains in one process but this launch has WORLD_SIZE={world_size}",
                "use strategy='ddp' (or another distributed strategy), or launch one process",
            )

    def no_sync(self) -> AbstractContextManager[Any]:
        # One process: no gradient synchronisation exists to skip.
        return contextlib.nullcontext()


@hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(name="single", factory=SingleStrategy, description="one process, no process group (the reference)")
    ]
