"""DeepSpeed ZeRO: the ``zero1``, ``zero2`` and ``zero3`` strategies (alias ``zero3_offload``).

One plugin (entry point ``deepspeed``), split by concern:

* :mod:`.config` – the DeepSpeed config generated from unison's settings and
  merged with the user's, with every conflict refused: plain functions, no
  DeepSpeed import, unit-tested alone.
* :mod:`.conversion` – ZeRO partitions <-> the canonical layout (full state
  dict, DCP checkpoints every torch strategy reads).
* :mod:`.engine` – :class:`~.engine.DeepSpeedStrategy`: the engine's setup, hot
  path (engine-owned accumulation and precision) and checkpoints.

The pipeline engine (``deepspeed_pipeline``) lives with the other pipeline in
:mod:`unison.strategies.pipeline`. DeepSpeed internals are reached only
through :mod:`unison._upstream.deepspeed`.
"""

from __future__ import annotations

import functools

from unison.plugin import hookimpl
from unison.plugin.registry import StrategySpec, missing_modules
from unison.strategies.deepspeed.config import DeepSpeedOptions
from unison.strategies.deepspeed.engine import BF16_TOLERANCE, DeepSpeedStrategy

_SHARDED = {1: "optimizer state", 2: "optimizer state and gradients", 3: "optimizer state, gradients and parameters"}


@hookimpl
def unison_strategies() -> list[StrategySpec]:
    unavailable = missing_modules("deepspeed")
    return [
        StrategySpec(
            name=f"zero{stage}",
            factory=functools.partial(DeepSpeedStrategy, stage),
            description=f"DeepSpeed ZeRO-{stage} ({_SHARDED[stage]} sharded); engine-owned accumulation and "
            "precision, client optimizer, DeepSpeed checkpoints",
            options=DeepSpeedOptions,
            # ZeRO-Infinity-style CPU offload is the one preset worth a name.
            aliases={"zero3_offload": {"offload_optimizer": "cpu", "offload_param": "cpu"}} if stage == 3 else {},
            unavailable=unavailable,
        )
        for stage in (1, 2, 3)
    ]


__all__ = ["BF16_TOLERANCE", "DeepSpeedOptions", "DeepSpeedStrategy"]
