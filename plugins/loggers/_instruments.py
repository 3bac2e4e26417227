"""The instruments the Prometheus and OpenTelemetry loggers export, one table for both.

Each row maps a metric the trainer and its callbacks log (``train/loss``, ``perf/step_time``...) to its
Prometheus name (base units, ``unison_`` prefix, ``_seconds``/``_bytes`` suffixes, ``_total`` for
counters) and its OpenTelemetry name and unit. Both loggers run on every rank (each rank's own
values: its step time, its memory) and attach the same four identities: the job's run id, the
strategy, the rank and the node (labels in Prometheus, resource attributes in OpenTelemetry). A
metric that is not in the table (a user's ``trainer.log`` value, ``data/retries``) is exported as a
gauge named after it (:func:`prometheus_name`, :func:`otel_name`).
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from typing import Any

from unison.launch import messages
from unison.plugin import hookimpl


@dataclass(frozen=True)
class Instrument:
    """One exported metric: its trainer key, Prometheus and OpenTelemetry names, unit and meaning."""

    key: str
    prometheus: str
    otel: str
    unit: str
    description: str
    #: A counter (monotonic, ``_total``): the logged value is a running count, exported by its increase.
    counter: bool = False
    #: Multiplies the logged value into the base unit (MiB to bytes).
    scale: float = 1.0


_MIB = float(1 << 20)

#: Every named instrument; ``step`` is the logging call's step, ``restarts`` torchrun's restart count.
INSTRUMENTS: tuple[Instrument, ...] = (
    Instrument("step", "unison_step", "unison.step", "{step}", "Optimizer steps completed"),
    Instrument("train/loss", "unison_train_loss", "unison.train.loss", "1", "Global-batch mean training loss"),
    Instrument("val/loss", "unison_validation_loss", "unison.validation.loss", "1", "Mean validation loss"),
    Instrument("train/lr", "unison_learning_rate", "unison.learning_rate", "1", "Learning rate (first group)"),
    Instrument("train/grad_norm", "unison_grad_norm", "unison.grad_norm", "1", "Global gradient norm before clipping"),
    Instrument("perf/step_time", "unison_step_time_seconds", "unison.step.duration", "s", "This rank's step time"),
    Instrument("perf/samples_per_s", "unison_samples_per_second", "unison.samples.rate", "{sample}/s", "Samples/s"),
    Instrument("perf/tokens_per_s", "unison_tokens_per_second", "unison.tokens.rate", "{token}/s", "Tokens/s"),
    Instrument("perf/mfu", "unison_mfu_ratio", "unison.mfu", "1", "Model FLOPs utilisation"),
    Instrument(
        "perf/peak_rss_mib", "unison_peak_rss_bytes", "unison.memory.peak_rss", "By", "Peak resident memory", scale=_MIB
    ),
    Instrument(
        "perf/cuda_max_allocated_mib",
        "unison_cuda_peak_allocated_bytes",
        "unison.memory.cuda_peak_allocated",
        "By",
        "Peak CUDA memory allocated",
        scale=_MIB,
    ),
    Instrument(
        "train/skipped_steps", "unison_skipped_steps_total", "unison.skipped_steps", "{step}", "Skipped steps", True
    ),
    Instrument("restarts", "unison_restarts_total", "unison.restarts", "{restart}", "Worker-group restarts", True),
    Instrument(
        "checkpoint/save_time_s", "unison_checkpoint_save_seconds", "unison.checkpoint.duration", "s", "Last save"
    ),
    Instrument("checkpoint/size_bytes", "unison_checkpoint_size_bytes", "unison.checkpoint.size", "By", "Last save"),
    Instrument(
        "perf/step_time_min", "unison_step_time_min_seconds", "unison.step.duration.min", "s", "Fastest rank's step"
    ),
    Instrument(
        "perf/step_time_median",
        "unison_step_time_median_seconds",
        "unison.step.duration.median",
        "s",
        "Median step time over ranks",
    ),
    Instrument(
        "perf/step_time_max", "unison_step_time_max_seconds", "unison.step.duration.max", "s", "Slowest rank's step"
    ),
    Instrument("perf/wait_time", "unison_wait_seconds", "unison.wait.duration", "s", "Waiting in collectives/step"),
    Instrument("perf/compute_time", "unison_compute_seconds", "unison.compute.duration", "s", "Step time less waits"),
    Instrument("stragglers/slowest_rank", "unison_slowest_rank", "unison.stragglers.slowest_rank", "1", "Slowest"),
    Instrument(
        "stragglers/slowest_ratio",
        "unison_slowest_rank_ratio",
        "unison.stragglers.ratio",
        "1",
        "Slowest rank's compute time over the median",
    ),
    Instrument(
        "stragglers/flagged", "unison_straggler_flagged", "unison.stragglers.flagged", "1", "1: over the threshold"
    ),
)
BY_KEY = {i.key: i for i in INSTRUMENTS}
_TAKEN = {i.prometheus for i in INSTRUMENTS}


def prometheus_name(key: str) -> str | None:
    """The Prometheus name of ``key``: the table's, else ``unison_`` + the key with other characters as ``_``."""
    if key in BY_KEY:
        return BY_KEY[key].prometheus
    name = "unison_" + re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_").lower()
    return None if name in _TAKEN else name  # never a second series under a table name


def otel_name(key: str) -> str:
    """The OpenTelemetry name of ``key``: the table's, else ``unison.`` + the key with ``/`` as ``.``."""
    return BY_KEY[key].otel if key in BY_KEY else "unison." + re.sub(r"[^a-zA-Z0-9_.]", ".", key).strip(".")


def identity(trainer: Any) -> dict[str, str]:
    """``run_id``, ``strategy``, ``rank`` and ``node`` of this process in ``trainer``'s fit."""
    env = trainer.env
    return {
        "run_id": messages.run_id(),
        "strategy": trainer.strategy.name,
        "rank": str(env.rank if env is not None else 0),
        "node": messages.node(),
    }


def restarts() -> float:
    """Times torchrun restarted this worker group (``TORCHELASTIC_RESTART_COUNT``; 0 without torchrun)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return float(value) if value.isdigit() else 0.0


class Counts:
    """Turns running counts (skipped steps so far) into the increases a counter is given."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}

    def increase(self, key: str, value: float) -> float:
        before = self._seen.get(key, 0.0)
        self._seen[key] = value
        return max(0.0, value - before)


class FinishesAtFitEnd:
    """The end of a fit for an exporting logger: ``_finish`` (a last push or flush) after every other plugin's
    ``unison_on_fit_end``, and on an error too, where it warns instead of raising (the training error is the one
    to report)."""

    def _finish(self) -> None:
        raise NotImplementedError

    @hookimpl(trylast=True)
    def unison_on_fit_end(self, trainer: Any) -> None:
        self._finish()

    @hookimpl
    def unison_on_exception(self, trainer: Any, exception: BaseException) -> None:
        try:
            self._finish()
        except Exception as exc:  # this hook must not raise: the training error is the one to report
            warnings.warn(f"{type(self).__name__} could not finish: {exc}", stacklevel=2)
