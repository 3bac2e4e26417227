"""Config files for ``unison train``: TOML or YAML, validated by pydantic.

Unknown keys are rejected with their full path (``trainer.max_stepz``).
Factories are ``"file.py:function"`` (relative to the config file) or
``"package.module:function"``::

    [trainer]                       # unison.TrainerSettings
    strategy = "ddp"
    max_steps = 200

    [model]
    factory = "tinylm.py:build_model"
    kwargs = { d_model = 64 }

    [data]                          # factory returns (train_dataset, val_dataset or None);
                                    # each a map-style dataset, an iterable one or a DataLoader
    factory = "tinylm.py:build_datasets"

    [loss]
    factory = "tinylm.py:loss_fn"   # the loss function itself, not a builder
    # or, for batches of any structure (dicts, Hugging Face models):
    # [training_step]
    # factory = "hf_causal_lm.py:training_step"

    [optimizer]                     # a torch.optim class
    name = "AdamW"
    kwargs = { lr = 3e-3 }

    [scheduler]                     # optional, a torch.optim.lr_scheduler class
    name = "CosineAnnealingLR"
    kwargs = { T_max = 200 }

    [logging]                       # unison.plugins.loggers; each fit writes runs/tinylm/version_N
    dir = "runs/tinylm"
    jsonl = true
    csv = true
    tensorboard = true

    [[callbacks]]                   # any plugin object: factory + kwargs, like [model]
    factory = "unison.plugins.callbacks:EarlyStopping"
    kwargs = { monitor = "val/loss", patience = 3 }
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import tomllib
from pathlib import Path
from typing import Any, Callable, Literal

import pydantic
import torch
import yaml

from unison.errors import ConfigurationError
from unison.settings import TrainerSettings


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class FactoryConfig(_Strict):
    factory: str
    """``file.py:function`` relative to the config file, or ``module:function``."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments for the factory."""


class LossConfig(_Strict):
    factory: str
    """The loss function ``loss_fn(outputs, targets) -> mean loss``."""


class StepConfig(_Strict):
    factory: str
    """The step function ``training_step(model, batch) -> mean loss`` (batches of any structure)."""


class ClassConfig(_Strict):
    name: str
    """Class name in ``torch.optim`` (optimizer) or ``torch.optim.lr_scheduler`` (scheduler)."""
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


class LoggingConfig(_Strict):
    """Metric loggers; each fit writes into a new ``dir/version_N`` (see ``unison.plugins.loggers``)."""

    dir: str | None = None
    """Run directory root, relative to the working directory; each fit gets ``dir/version_N``."""
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

    @pydantic.model_validator(mode="after")
    def _file_loggers_need_dir(self) -> "LoggingConfig":
        enabled = [n for n in ("jsonl", "csv", "tensorboard") if getattr(self, n)] + (["wandb"] if self.wandb else [])
        if enabled and self.dir is None:
            raise ValueError(f"{', '.join(enabled)} write into a run directory: set dir (e.g. dir = \"runs/NAME\")")
        return self


class RunConfig(_Strict):
    trainer: TrainerSettings
    model: FactoryConfig
    data: FactoryConfig
    loss: LossConfig | None = None
    """The ``(inputs, targets)`` form; give this or ``[training_step]``."""
    training_step: StepConfig | None = None
    """The form for batches of any structure; give this or ``[loss]``."""

    @pydantic.model_validator(mode="after")
    def _one_form(self) -> "RunConfig":
        if (self.loss is None) == (self.training_step is None):
            raise ValueError("give exactly one of the [loss] and [training_step] sections")
        return self
    optimizer: ClassConfig = ClassConfig(name="AdamW", kwargs={"lr": 1e-3})
    scheduler: ClassConfig | None = None
    logging: LoggingConfig = LoggingConfig()
    callbacks: list[FactoryConfig] = []
    """Plugins to register (built-in or third-party callbacks): ``factory(**kwargs)`` each."""


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> tuple[RunConfig, Path]:
    """Read and validate a config file; ``overrides`` replace ``[trainer]`` keys."""
    path = Path(path)
    text = path.read_text()
    raw = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    if not isinstance(raw, dict):
        raise ConfigurationError(str(path), "the config is not a table of sections", "see unison.config for the layout")
    if overrides:
        raw.setdefault("trainer", {}).update(overrides)
    try:
        return RunConfig(**raw), path.parent.resolve()
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        fix = "remove or rename it" if err["type"] == "extra_forbidden" else "see the documented keys in unison.config"
        raise ConfigurationError(f"config key {key} in {path}", err["msg"], fix) from None


def resolve_factory(spec: str, base: Path) -> Callable[..., Any]:
    """``file.py:name`` (relative to ``base``) or ``module:name`` -> the object."""
    target, sep, attr = spec.rpartition(":")
    if not sep:
        raise ConfigurationError("factory", f"{spec!r} has no ':name' part", "write 'file.py:function' or 'module:function'")
    if target.endswith(".py"):
        file = (base / target).resolve()
        name = f"unison_config_{file.stem}"
        if name not in sys.modules:
            module_spec = importlib.util.spec_from_file_location(name, file)
            if module_spec is None or module_spec.loader is None:
                raise ConfigurationError("factory", f"cannot load {file}", "check the path")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
        module = sys.modules[name]
    else:
        module = importlib.import_module(target)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigurationError("factory", f"{target} has no {attr!r}", "check the name after ':'") from None


def build_callbacks(config: RunConfig, base: Path) -> list[Any]:
    """The ``[[callbacks]]`` of a config: each ``factory(**kwargs)``, bad arguments named by their index."""
    plugins = []
    for i, spec in enumerate(config.callbacks):
        factory = resolve_factory(spec.factory, base)
        try:
            plugins.append(factory(**spec.kwargs))
        except TypeError as exc:
            raise ConfigurationError(f"callbacks[{i}] ({spec.factory})", str(exc), "check its kwargs") from None
    return plugins


def optimizer_factory(config: ClassConfig) -> Callable[[Any], torch.optim.Optimizer]:
    cls = getattr(torch.optim, config.name, None)
    if cls is None:
        raise ConfigurationError("optimizer.name", f"torch.optim has no {config.name!r}", "use e.g. 'AdamW' or 'SGD'")
    return lambda params: cls(params, **config.kwargs)


def scheduler_factory(config: ClassConfig | None) -> Callable[[Any], Any] | None:
    if config is None:
        return None
    cls = getattr(torch.optim.lr_scheduler, config.name, None)
    if cls is None:
        raise ConfigurationError(
            "scheduler.name", f"torch.optim.lr_scheduler has no {config.name!r}", "use e.g. 'CosineAnnealingLR'"
        )
    return lambda optimizer: cls(optimizer, **config.kwargs)
