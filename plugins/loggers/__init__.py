"""Built-in metric loggers: JSONL, CSV, TensorBoard, MLflow, Weights & Biases, Prometheus, OpenTelemetry.

Each logger is a pluggy plugin (``unison_log_metrics`` plus the fit hooks); pass
them as ``Trainer(loggers=[...])``, or enable them in a config file's
``[logging]`` table (this module is the ``loggers`` entry point that reads it)::

    [logging]
    dir = "runs/tinylm"          # each fit: runs/tinylm/version_N (or "s3://bucket/runs/tinylm")
    jsonl = true                 # version_N/metrics.jsonl
    csv = true                   # version_N/metrics.csv
    tensorboard = true           # version_N/tensorboard/
    [logging.mlflow]             # present = enabled
    tracking_uri = "http://127.0.0.1:5000"
    [logging.wandb]              # offline by default: version_N/wandb/
    project = "tinylm"
    [logging.prometheus]         # every rank's metrics on :9400+LOCAL_RANK/metrics (or pushgateway = URL)
    port = 9400
    [logging.otel]               # every rank's metrics over OTLP/HTTP
    endpoint = "http://127.0.0.1:4318/v1/metrics"

Loggers given the same directory share one version per fit; given the
trainer's ``root_dir``, they write into the trainer's own ``version_N`` (next
to its checkpoints). A Trainer with no logger of its own gets JSONL and CSV
metrics by default: in its ``root_dir/version_N``, or without a ``root_dir`` in
a fresh ``runs/NAME/version_N`` under the working directory (``NAME``: the
script's name; :func:`unison.training.runs.default_root`); ``Trainer(loggers=False)``
turns them off. Each fit prints its run directory once when it opens it
(global rank 0, stderr; not with ``progress="off"``). Global rank 0
writes (every rank receives the same, already reduced, metrics), at the
trainer's step, so every backend numbers them alike. A logger whose package
is missing raises :class:`~unison.ConfigurationError` naming the extra to
install, before training. A logger whose write fails while training (a full
disk) is reported once (:class:`LoggerWriteWarning`) and disabled for the rest of
the fit; training goes on (the policy and why: ``docs/logging.md``).
"""

from __future__ import annotations

from typing import Any

from unison.plugin import hookimpl
from unison.training.runs import default_root

from ._base import LoggerWriteWarning, RunLogger
from ._run import RunDirectory, new_version, run_metadata
from .csv_logger import CSVLogger, read_csv
from .jsonl import JSONLLogger, read_jsonl
from .mlflow_logger import MLflowLogger
from .otel import OpenTelemetryLogger
from .prometheus import PrometheusLogger
from .tensorboard_logger import TensorBoardLogger, read_scalars
from .wandb_logger import WandbLogger

__all__ = [
    "CSVLogger",
    "JSONLLogger",
    "LoggerWriteWarning",
    "MLflowLogger",
    "OpenTelemetryLogger",
    "PrometheusLogger",
    "RunDirectory",
    "TensorBoardLogger",
    "WandbLogger",
    "loggers_from_config",
    "new_version",
    "read_csv",
    "read_jsonl",
    "read_scalars",
    "run_metadata",
]


def loggers_from_config(config: Any) -> list[Any]:
    """The loggers a ``unison train`` config's ``[logging]`` table enables, sharing one run directory."""
    logging = config.logging
    run = (
        RunDirectory(logging.dir, config=config.model_dump(mode="json"), upload_every_s=logging.upload_every_s)
        if logging.dir is not None
        else None
    )
    loggers: list[Any] = []
    if logging.mlflow is not None:
        loggers.append(MLflowLogger(run, **logging.mlflow.model_dump()))
    if logging.prometheus is not None:  # every rank's own metrics; no run directory
        loggers.append(PrometheusLogger(**logging.prometheus.model_dump()))
    if logging.otel is not None:
        loggers.append(OpenTelemetryLogger(**logging.otel.model_dump()))
    if not (logging.jsonl or logging.csv or logging.tensorboard or logging.wandb is not None):
        return loggers
    assert run is not None  # LoggingConfig refuses file loggers without a dir
    if logging.jsonl:
        loggers.append(JSONLLogger(run))
    if logging.csv:
        loggers.append(CSVLogger(run))
    if logging.tensorboard:
        loggers.append(TensorBoardLogger(run))
    if logging.wandb is not None:
        loggers.append(WandbLogger(run, **logging.wandb.model_dump()))
    return loggers


@hookimpl
def unison_plugins_from_config(config: Any) -> list[Any]:
    return loggers_from_config(config)


@hookimpl
def unison_default_plugins(settings: Any, plugins: list[Any]) -> list[Any]:
    """JSONL and CSV metrics for a Trainer with no logger of its own: into its ``root_dir/version_N``, or
    without a ``root_dir`` into a fresh ``runs/NAME/version_N`` (:func:`unison.training.runs.default_root`).
    ``Trainer(loggers=False)`` drops them."""
    if any(isinstance(p, RunLogger) for p in plugins):
        return []
    run = RunDirectory.get(settings.root_dir if settings.root_dir is not None else default_root())
    return [JSONLLogger(run), CSVLogger(run)]
