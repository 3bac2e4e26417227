"""A unison plugin (tests only) registering ``apex_distributed_fused_adam`` over the CPU stand-in.

The built-in ``apex_distributed_fused_adam`` is unavailable on a machine
without apex and CUDA. This registers the *same* strategy class under
:data:`STANDIN`, available, with small buckets by default (tiny test models
would otherwise sit in one 100 MB bucket per rank). Its ``build_optimizer`` hook
installs the stand-in under apex's module names first, so the strategy's own
``from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam``
finds it in spawned ranks; nothing is installed until a run sets up.
"""

from __future__ import annotations

from typing import Any

import pydantic

import apex_standin
from unison.plugin import hookimpl
from unison.plugin.registry import StrategySpec
from unison.strategies.apex import DistributedFusedAdamOptions, DistributedFusedAdamStrategy

STANDIN = "apex_distributed_fused_adam_standin"


class StandinOptions(DistributedFusedAdamOptions):
    bucket_cap_mb: float = pydantic.Field(0.002, gt=0)
    """About 512 fp32 elements per bucket: the test MLPs span several buckets, fragments cross bucket edges."""


class StandinStrategy(DistributedFusedAdamStrategy):
    """The built-in strategy, unchanged but for installing the stand-in before it builds its optimizer."""

    def build_optimizer(self, make_optimizer: Any) -> Any:
        apex_standin.install()
        return super().build_optimizer(make_optimizer)


@hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name=STANDIN,
            factory=StandinStrategy,
            options=StandinOptions,
            description="apex_distributed_fused_adam over a CPU stand-in of apex (tests only)",
        )
    ]
