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
``perf/flops_per_step``        FLOPs this rank executes per optimizer step, counted once, on
                               the fit's second step (:mod:`.mfu`), from then on
``perf/mfu``                   model FLOPs utilisation: ``flops_per_step / step_time / peak``,
                               the peak given (``peak_flops``) or known for the device
                               (:data:`.mfu.PEAK_TFLOPS`; on CPU a measured matrix product)
=============================  ==========================================================

FLOPs are counted on the second step, not the first: a forward that
``torch.compile`` first sees under a dispatch mode (the FLOP counter is one)
is never compiled (measured, torch 2.13), and the first step is where it
compiles. The counted step runs the counter's dispatch mode, a little slower,
and a profiler records each op of that step twice (the call, and inside it the
mode's re-dispatch; ``unison.conformance.profiling.Record.redispatched`` tells them apart).

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

from unison._upstream.torch import flop_counter
from unison.plugin import hookimpl

from .._timing import StepWindow
from .mfu import peak_flops


def peak_rss_mib() -> float:
    """Peak resident set size of this process in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024  # macOS: bytes; Linux: KiB


#: The step of each fit (counted from 0 in this callback) whose FLOPs are counted.
COUNTED_STEP = 1


class Throughput:
    """Logs step time, samples/s, tokens/s, peak memory, FLOPs per step and MFU every logging step.

    Args:
        peak_flops: the device's peak FLOP/s to compute MFU against; ``None``: :func:`.mfu.peak_flops`
            (a known accelerator's dense peak in the run's precision, or a measured CPU matrix product).
            No MFU is logged on a device with neither.
        count_flops: count FLOPs per step (and log MFU); ``False`` logs neither.
    """

    def __init__(self, peak_flops: float | None = None, count_flops: bool = True) -> None:
        self._window = StepWindow()
        self.peak_flops = peak_flops
        self.count_flops = count_flops
        #: FLOPs this rank executes per optimizer step, once counted in this fit.
        self.flops_per_step: float | None = None
        self._counter: Any = None
        self._steps = 0

    @hookimpl
    def unison_on_fit_start(self, trainer: Any) -> None:
        self._window.clear()
        self.flops_per_step, self._steps = None, 0

    @hookimpl
    def unison_on_train_step_start(self, trainer: Any) -> None:
        if self.count_flops and self._steps == COUNTED_STEP:
            self._counter = flop_counter()
            self._counter.__enter__()
        self._window.start()

    @hookimpl
    def unison_on_train_step_end(self, trainer: Any, step: int, output: Any) -> None:
        self._window.end(output)
        self._steps += 1
        if self._counter is not None:
            self._stop_counting()
        if (step + 1) % trainer.settings.log_every_n_steps:
            return
        rates = self._window.rates()
        metrics = {f"perf/{k}": v for k, v in rates.items()}
        self._window.clear()
        metrics["perf/peak_rss_mib"] = peak_rss_mib()
        device = trainer.env.device if trainer.env is not None else None
        if device is not None and device.type == "cuda":
            metrics["perf/cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated(device) / (1 << 20)
        if self.flops_per_step is not None and device is not None:
            metrics["perf/flops_per_step"] = self.flops_per_step
            peak = self.peak_flops if self.peak_flops is not None else peak_flops(device, trainer.settings.precision)
            if peak and rates.get("step_time"):
                metrics["perf/mfu"] = self.flops_per_step / rates["step_time"] / peak
        trainer.log(metrics)

    @hookimpl
    def unison_on_exception(self, trainer: Any, exception: BaseException) -> None:
        if self._counter is not None:  # never leave the dispatch mode on after a failed step
            self._stop_counting()

    def _stop_counting(self) -> None:
        assert self._counter is not None
        self._counter.__exit__(None, None, None)
        self.flops_per_step = float(self._counter.total)
        self._counter = None
