"""The schema of a config file: one pydantic model per section, every field documented.

Unknown keys are refused (``extra="forbid"``); :mod:`unison.config.load` turns each
validation error into a located problem with the closest valid name.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import pydantic

from unison.contract.settings import TrainerSettings
from unison.errors import did_you_mean


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class FactoryConfig(_Strict):
    factory: str
    """``file.py:function`` relative to the config file, or ``module:function``."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments for the factory."""


class DataConfig(_Strict):
    """The datasets: a ``factory`` returning ``(train_dataset, val_dataset)``, or sharded files (``train``)."""

    factory: str | None = None
    """``file.py:function`` or ``module:function`` returning ``(train_dataset, val_dataset or None)``."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments for the factory."""
    train: str | list[str] | None = None
    """Shard files of the training set instead of a factory: URLs or globs, local (relative to the working
    directory) or any fsspec URL (``"s3://bucket/train/*.parquet"``), read by
    :class:`unison.data.shards.ShardedDataset`."""
    val: str | list[str] | None = None
    """Shard files of the validation set (with ``train``)."""
    decode: str | None = None
    """``file.py:function`` turning one sample as read (a JSON value, a Parquet row dict, a tar sample's
    ``{extension: bytes}``) into what the batch holds, e.g. ``(inputs, targets)`` tensors."""
    shuffle_window: int | None = pydantic.Field(None, ge=1)
    """``None``: the trainer's global permutation; a number: shard order + shuffle within windows of this
    many samples (see docs/data.md)."""
    shuffle_chunk: int = pydantic.Field(1, ge=1)
    """With ``shuffle_window``: runs of this many consecutive samples stay together (fewer range reads)."""
    read_ahead: int = pydantic.Field(32 << 20, ge=0)
    """Bytes of JSON-lines and tar records each loader process reads ahead along the trainer's plan
    (0: each micro-batch is read when the loader asks for it)."""
    index_dir: str | None = None
    """Where shard indexes are cached (a directory or fsspec URL); default ``$UNISON_DATA_CACHE`` or
    ``~/.cache/unison/shard-index``."""
    storage_options: dict[str, Any] = {}
    """fsspec file-system options for the shards (s3fs: ``endpoint_url``...); default: the ``AWS_*`` variables."""

    @pydantic.model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if (self.factory is None) == (self.train is None):
            raise ValueError("give exactly one of factory and train")
        if self.factory is not None:
            sharded = [
                name for name in ("val", "decode", "shuffle_window", "index_dir") if getattr(self, name) is not None
            ] + (["storage_options"] if self.storage_options else [])
            if sharded:
                raise ValueError(f"{', '.join(sharded)} go with train (sharded files), not with factory")
        elif self.kwargs:
            raise ValueError("kwargs go with factory, not with train")
        return self


class LossConfig(_Strict):
    factory: str
    """The loss function ``loss_fn(outputs, targets) -> mean loss``."""


class StepConfig(_Strict):
    factory: str
    """The step function ``training_step(model, batch) -> mean loss`` (batches of any structure)."""


class ClassConfig(_Strict):
    name: str
    """Optimizer: a ``torch.optim`` class, ``apex.NAME`` (apex's fused optimizers) or ``package.module:Class``;
    scheduler: a ``torch.optim.lr_scheduler`` class."""
    kwargs: dict[str, Any] = {}
    """Constructor keyword arguments."""


class MLflowConfig(_Strict):
    tracking_uri: str | None = None
    """Tracking server or store (``http://127.0.0.1:5000``, ``sqlite:///mlflow.db``); ``None``: MLflow's default."""
    experiment: str = "unison"
    """Experiment name (created when missing)."""
    run_name: str | None = None
    """MLflow run name; ``None``: the run directory's version (``tinylm/version_3``) or MLflow's own."""
    tags: dict[str, str] = {}
    """Extra tags on every run."""


class WandbConfig(_Strict):
    project: str = "unison"
    """W&B project."""
    mode: Literal["offline", "online", "disabled"] = "offline"
    """``offline`` writes files only (``wandb sync`` uploads them later)."""
    entity: str | None = None
    """W&B entity (team or user)."""
    tags: list[str] = []
    """Tags on every run."""


class PrometheusConfig(_Strict):
    port: int | None = pydantic.Field(9400, ge=1, le=65535)
    """First port to serve ``/metrics`` on (each rank adds its ``LOCAL_RANK``); ``None``: do not serve."""
    addr: str = "0.0.0.0"
    """Address to serve on."""
    pushgateway: str | None = None
    """Pushgateway URL to push to (``http://HOST:9091``), for jobs shorter than a scrape interval."""
    job: str = "unison"
    """The Pushgateway's ``job`` label."""
    push_every_s: float = pydantic.Field(15.0, ge=0)
    """Least seconds between two pushes during the fit (and one at its end)."""


class OpenTelemetryConfig(_Strict):
    endpoint: str | None = None
    """OTLP/HTTP metrics URL (``http://HOST:4318/v1/metrics``); ``None``: the ``OTEL_EXPORTER_OTLP_*`` variables."""
    export_every_s: float = pydantic.Field(10.0, gt=0)
    """Seconds between exports (and one at the end of the fit)."""
    service_name: str = "unison"
    """The ``service.name`` resource attribute."""


class LoggingConfig(_Strict):
    """Metric loggers; each fit writes into a new ``dir/version_N`` (see ``unison.plugins.loggers``)."""

    dir: str | None = None
    """Run directory root, relative to the working directory, or an ``s3://bucket/prefix`` URL; each fit gets
    ``dir/version_N``."""
    upload_every_s: float = pydantic.Field(30.0, ge=0)
    """With ``dir`` in object storage: upload the run's files at most this often while metrics are logged (and
    always at the end of the fit)."""
    jsonl: bool = False
    """Write ``version_N/metrics.jsonl`` (one JSON object per logging call)."""
    csv: bool = False
    """Write ``version_N/metrics.csv`` (one row per step)."""
    tensorboard: bool = False
    """Write TensorBoard event files into ``version_N/tensorboard`` (needs ``unison[tensorboard]``)."""
    mlflow: MLflowConfig | None = None
    """Log each fit as an MLflow run (a ``[logging.mlflow]`` table enables it; needs ``unison[mlflow]``)."""
    wandb: WandbConfig | None = None
    """Log each fit as a W&B run, offline by default (``[logging.wandb]``; needs ``unison[wandb]``)."""
    prometheus: PrometheusConfig | None = None
    """Every rank's metrics for Prometheus, served or pushed (``[logging.prometheus]``; ``unison[prometheus]``)."""
    otel: OpenTelemetryConfig | None = None
    """Every rank's metrics over OTLP/HTTP (``[logging.otel]``; needs ``unison[otel]``)."""

    @pydantic.model_validator(mode="after")
    def _file_loggers_need_dir(self) -> LoggingConfig:
        enabled = [n for n in ("jsonl", "csv", "tensorboard") if getattr(self, n)] + (["wandb"] if self.wandb else [])
        if enabled and self.dir is None:
            raise ValueError(f'{", ".join(enabled)} write into a run directory: set dir (e.g. dir = "runs/NAME")')
        return self


class ImportsConfig(_Strict):
    """The config's trust roots: what its factories and optimizer classes may load (see :mod:`unison.config.load`)."""

    allow: list[str] = []
    """Modules factories may name (each with its submodules), e.g. ``["transformers", "mypkg.models"]``;
    the modules of installed ``unison`` entry points are always allowed."""
    paths: list[str] = []
    """Directories, besides the config file's own, whose files factories may name (relative to the config
    file, or absolute)."""


class RunConfig(_Strict):
    trainer: TrainerSettings
    model: FactoryConfig
    data: DataConfig
    loss: LossConfig | None = None
    """The ``(inputs, targets)`` form; give this, ``[training_step]``, or neither (the model's own loss)."""
    training_step: StepConfig | None = None
    """The form for batches of any structure; give this, ``[loss]``, or neither (the model's own loss)."""
    optimizer: ClassConfig = ClassConfig(name="AdamW", kwargs={"lr": 1e-3})
    scheduler: ClassConfig | None = None
    logging: LoggingConfig = LoggingConfig()
    callbacks: list[FactoryConfig] = []
    """Plugins to register (built-in or third-party callbacks): ``factory(**kwargs)`` each."""
    imports: ImportsConfig = ImportsConfig()
    """What the config's factories may load besides the files in its own directory."""

    @pydantic.model_validator(mode="after")
    def _one_form(self) -> RunConfig:
        # Neither: the model's own loss (a Hugging Face model on dict batches with labels), checked by fit.
        if self.loss is not None and self.training_step is not None:
            raise ValueError("give at most one of the [loss] and [training_step] sections")
        return self


def _section_model(annotation: Any) -> type[pydantic.BaseModel] | None:
    """The pydantic model inside ``X``, ``X | None`` or ``list[X]``, if any."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list):
        for arg in typing.get_args(annotation):
            found = _section_model(arg)
            if found is not None:
                return found
    return None


def known_keys(loc: tuple[str | int, ...]) -> list[str]:
    """The valid key names of the table at ``loc`` (``()`` is the top level), or ``[]`` for free-form tables."""
    model: type[pydantic.BaseModel] | None = RunConfig
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        model = _section_model(field.annotation) if field is not None else None
    return list(model.model_fields) if model is not None else []


def unknown_key_hint(loc: tuple[str | int, ...]) -> tuple[str, str]:
    """``(problem, fix)`` for an unknown key: the closest valid name, or where a trainer option belongs."""
    name, parent = str(loc[-1]), loc[:-1]
    known = known_keys(parent)
    hint = did_you_mean(name, known)
    kind = "section" if not parent else "key"
    if hint:
        close = hint.split("'")[1]
        return f"unknown {kind}{hint}", f"remove or rename it to {close!r}"
    if not parent and name in TrainerSettings.model_fields:
        return "unknown section", f"trainer options go under [trainer]: write trainer.{name}"
    where = "sections" if not parent else "keys here"
    return f"unknown {kind}", f"remove or rename it (valid {where}: {', '.join(known)})"
