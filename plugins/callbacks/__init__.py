"""Built-in callbacks: pluggy plugins like any third party's.

Pass them as ``Trainer(callbacks=[...])`` or list them in a config file::

    [[callbacks]]
    factory = "unison.plugins.callbacks:EarlyStopping"
    kwargs = { monitor = "val/loss", patience = 3, min_delta = 0.001 }

* :class:`EarlyStopping` - stop when a monitored metric stops improving.
* :class:`ModelCheckpoint` - checkpoints every N steps and the best k by a metric.
* :class:`LearningRateMonitor` - learning rate (momentum, weight decay) per named param group.
* :class:`Throughput` - step time, samples/s, tokens/s, peak memory (on by default: ``throughput=False`` turns it off).
* :class:`Profiler` - a ``torch.profiler`` trace of a window of steps.
* :class:`StragglerReport` - min/median/max step time across ranks and the slowest rank named.

This module is the ``callbacks`` entry point: it adds the default
:class:`Throughput` through ``unison_default_plugins``.
"""

from __future__ import annotations

from typing import Any

from unison.plugin import hookimpl

from .early_stopping import EarlyStopping
from .lr_monitor import LearningRateMonitor
from .model_checkpoint import ModelCheckpoint
from .profiler import Profiler
from .stragglers import StragglerReport
from .throughput import Throughput, peak_rss_mib

__all__ = [
    "EarlyStopping",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "Profiler",
    "StragglerReport",
    "Throughput",
    "peak_rss_mib",
]


@hookimpl
def unison_default_plugins(settings: Any, plugins: list[Any]) -> list[Any]:
    if not settings.throughput or any(isinstance(p, Throughput) for p in plugins):
        return []
    return [Throughput()]
