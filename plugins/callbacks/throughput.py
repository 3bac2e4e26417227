"""Throughput and memory metrics, logged on logging steps.

On every ``log_every_n_steps``-th step it logs, through ``trainer.log``:

=============================  ==========================================================
``perf/step_time``             mean wall seconds per optimizer step since the last log
                               (``unison_on_train_step_start`` to ``_end``: data, forward,
                               backward, optimizer; not validation or checkpoints)
``perf/samples_per_s``         samples of those global batches / their wall time
``perf/tokens_per_s``          tokens likewise, when every batch counted its tokens
                               (``StepOutput.tokens``; see the trainer's token rule)
``perf/peak_rss_mib``          peak resident memory of this process (``getrusage``)
``perf/cuda_max_allocated_mib``  ``torch.cuda.max_memory_allocated`` when training on CUDA
=============================  ==========================================================

Times and memory are global rank 0's (what file loggers write); the step
boundaries are synchronised by the strategy's collectives, so rank 0's wall
time is the world's. Nothing here synchronises with the device per step:
samples and tokens are read when a log is written.

Every Trainer gets one unless ``throughput=False`` or it was given its own.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch

from unison.plugin import hookimpl

from .._timing import StepWindow


def peak_rss_mib() -> float:
    """Peak resident set size of this process in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024  # macOS: bytes; Linux: KiB


class Throughput:
    """Logs step time, samples/s, tokens/s and peak memory every logging step."""

    def __init__(self) -> None:
        self._window = StepWindow()

    @hookimpl
    def unison_on_fit_start(self, trainer: Any) -> None:
        self._window.clear()

    @hookimpl
    def unison_on_train_step_start(self, trainer: Any) -> None:
        self._window.start()

    @hookimpl
    def unison_on_train_step_end(self, trainer: Any, step: int, output: Any) -> None:
        self._window.end(output)
        if (step + 1) % trainer.settings.log_every_n_steps:
            return
        metrics = {f"perf/{k}": v for k, v in self._window.rates().items()}
        self._window.clear()
        metrics["perf/peak_rss_mib"] = peak_rss_mib()
        device = trainer.env.device if trainer.env is not None else None
        if device is not None and device.type == "cuda":
            metrics["perf/cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated(device) / (1 << 20)
        trainer.log(metrics)
