"""``torch_zero``: DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO stage 1).

The strategy lives in :mod:`unison.strategies._sharded_optimizer`, shared with
the fairscale OSS strategies; this module only registers it.
"""

from __future__ import annotations

from unison.plugin import hookimpl
from unison.plugin.registry import StrategySpec
from unison.strategies._sharded_optimizer import TorchZeroStrategy


@hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="torch_zero",
            factory=TorchZeroStrategy,
            description="DDP + torch ZeroRedundancyOptimizer (optimizer state sharded over ranks)",
        )
    ]
