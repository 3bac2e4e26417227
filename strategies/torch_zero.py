"""``torch_zero``: DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO stage 1).

The strategy is :class:`~unison.strategies._sharded_optimizer.ShardedOptimizerStrategy`, shared with the
fairscale OSS strategies, given the ``ZeroRedundancyOptimizer`` component; this module picks it and
registers the strategy.
"""

from __future__ import annotations

from unison.plugin import hookimpl
from unison.plugin.registry import StrategySpec
from unison.strategies._sharded_optimizer import ShardedOptimizerStrategy, zero_redundancy_sharding


class TorchZeroStrategy(ShardedOptimizerStrategy):
    """``torch_zero``: DDP + ZeroRedundancyOptimizer (the class only picks the component)."""

    def __init__(self) -> None:
        super().__init__(zero_redundancy_sharding())


@hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="torch_zero",
            factory=TorchZeroStrategy,
            description="DDP + torch ZeroRedundancyOptimizer (optimizer state sharded over ranks)",
        )
    ]
