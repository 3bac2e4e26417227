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

    [optimizer]                     # a torch.optim class, "apex.FusedAdam", or "package.module:Class"
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

import difflib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pydantic
import tomllib
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

    @pydantic.model_validator(mode="after")
    def _file_loggers_need_dir(self) -> LoggingConfig:
        enabled = [n for n in ("jsonl", "csv", "tensorboard") if getattr(self, n)] + (["wandb"] if self.wandb else [])
        if enabled and self.dir is None:
            raise ValueError(f'{", ".join(enabled)} write into a run directory: set dir (e.g. dir = "runs/NAME")')
        return self


class RunConfig(_Strict):
    trainer: TrainerSettings
    model: FactoryConfig
    data: FactoryConfig
    loss: LossConfig | None = None
    """The ``(inputs, targets)`` form; give this or ``[training_step]``."""
    training_step: StepConfig | None = None
    """The form for batches of any structure; give this or ``[loss]``."""
    optimizer: ClassConfig = ClassConfig(name="AdamW", kwargs={"lr": 1e-3})
    scheduler: ClassConfig | None = None
    logging: LoggingConfig = LoggingConfig()
    callbacks: list[FactoryConfig] = []
    """Plugins to register (built-in or third-party callbacks): ``factory(**kwargs)`` each."""

    @pydantic.model_validator(mode="after")
    def _one_form(self) -> RunConfig:
        if (self.loss is None) == (self.training_step is None):
            raise ValueError("give exactly one of the [loss] and [training_step] sections")
        return self


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> tuple[RunConfig, Path]:
    """Read and validate a config file; ``overrides`` replace ``[trainer]`` keys."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigurationError(str(path), f"cannot read the config file ({exc.strerror})", "check the path") from None
    try:
        raw = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib's message ends with "(at line L, column C)".
        raise ConfigurationError(str(path), f"TOML syntax error: {exc}", "fix the file at that line") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigurationError(
            str(path), f"YAML syntax error{where}: {getattr(exc, 'problem', exc)}", "fix the file at that line"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigurationError(str(path), "the config is not a table of sections", "see unison.config for the layout")
    if overrides:
        raw.setdefault("trainer", {}).update(overrides)
    try:
        return RunConfig(**raw), path.parent.resolve()
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        fix = "remove or rename it" if err["type"] == "extra_forbidden" else "see the documented keys in unison.config"
        got = f" (got {err['input']!r})" if err["loc"] and err["type"] != "missing" else ""
        raise ConfigurationError(
            f"config key {key} in {path}", err["msg"].removeprefix("Value error, ") + got, fix
        ) from None


def resolve_factory(spec: str, base: Path, key: str = "factory") -> Callable[..., Any]:
    """``file.py:name`` (relative to ``base``) or ``module:name`` -> the object; ``key`` names it in errors."""
    target, sep, attr = spec.rpartition(":")
    if not sep:
        raise ConfigurationError(key, f"{spec!r} has no ':name' part", "write 'file.py:function' or 'module:function'")
    if target.endswith(".py"):
        file = (base / target).resolve()
        if not file.is_file():
            raise ConfigurationError(key, f"{spec!r}: no file {file}", "give the path relative to the config file")
        name = f"unison_config_{file.stem}"
        if name not in sys.modules:
            module_spec = importlib.util.spec_from_file_location(name, file)
            if module_spec is None or module_spec.loader is None:
                raise ConfigurationError(key, f"cannot load {file}", "check the path")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]  # a fixed file can be loaded again
                raise
        module = sys.modules[name]
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise ConfigurationError(
                key, f"{spec!r}: no module {exc.name!r}", "check the module name, or install it"
            ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        close = difflib.get_close_matches(attr, [n for n in dir(module) if not n.startswith("_")], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigurationError(key, f"{target} has no {attr!r}{hint}", "check the name after ':'") from None


def check_kwargs(factory: Callable[..., Any], kwargs: dict[str, Any], key: str) -> None:
    """Refuse keyword arguments ``factory`` does not take, naming the config key and the valid ones."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        params = [n for n, p in signature.parameters.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        unknown = [k for k in kwargs if k not in signature.parameters]
        close = difflib.get_close_matches(unknown[0], params, n=1) if unknown else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigurationError(
            key, f"{exc}{hint}", f"use the factory's keywords: {', '.join(params) or 'none'}"
        ) from None


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


#: Why ``apex.*`` optimizer names fail on a machine without NVIDIA apex.
APEX_NOT_INSTALLED = "NVIDIA apex is not installed (the PyPI package named apex is unrelated)"


def optimizer_factory(config: ClassConfig) -> Callable[[Any], torch.optim.Optimizer]:
    """The ``[optimizer]`` section as a factory ``params -> Optimizer``.

    ``name`` is one of

    * a class of ``torch.optim`` (``"AdamW"``);
    * ``"apex.NAME"``: NVIDIA apex's fused optimizer ``apex.optimizers.NAME``
      (``"apex.FusedAdam"``, ``"apex.FusedLAMB"``); apex is imported here, and a
      missing apex is a :class:`ConfigurationError` (its fused kernels are
      CUDA-only: apex itself raises when they are not built);
    * ``"package.module:Class"``: any importable ``torch.optim.Optimizer`` subclass.
    """
    cls = _optimizer_class(config.name)
    return lambda params: cls(params, **config.kwargs)


def _optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    option = "optimizer.name"
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigurationError(
                option,
                f"cannot import {name!r} ({type(exc).__name__}: {exc})",
                "write 'package.module:Class' naming an importable optimizer class",
            ) from None
    elif name.startswith("apex."):
        cls = _apex_optimizer(name.removeprefix("apex."))
    else:
        cls = getattr(torch.optim, name, None)
        if cls is None:
            raise ConfigurationError(
                option,
                f"torch.optim has no {name!r}",
                "use e.g. 'AdamW' or 'SGD', 'apex.FusedAdam', or 'package.module:Class'",
            )
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigurationError(option, f"{name!r} is not a torch.optim.Optimizer subclass", "name an optimizer class")
    return cls


def _apex_optimizer(attr: str) -> Any:
    """``apex.optimizers.<attr>``, or a ConfigurationError saying what is missing."""
    option, fix = (
        "optimizer.name",
        (
            "build NVIDIA apex from https://github.com/NVIDIA/apex with its CUDA extensions, or use a torch.optim name "
            "such as 'AdamW'"
        ),
    )
    try:
        installed = importlib.util.find_spec("apex") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        raise ConfigurationError(option, f"'apex.{attr}' needs NVIDIA apex: {APEX_NOT_INSTALLED}", fix)
    try:
        module = importlib.import_module("apex.optimizers")
    except Exception as exc:  # a partial build can raise more than ImportError
        problem = f"'apex.optimizers' fails to import ({type(exc).__name__}: {exc})"
        raise ConfigurationError(option, problem, fix) from None
    cls = getattr(module, attr, None)
    if cls is None:
        known = sorted(n for n in dir(module) if n.startswith("Fused"))
        raise ConfigurationError(option, f"apex.optimizers has no {attr!r}", f"use one of {known}")
    return cls


def scheduler_factory(config: ClassConfig | None) -> Callable[[Any], Any] | None:
    if config is None:
        return None
    cls = getattr(torch.optim.lr_scheduler, config.name, None)
    if cls is None:
        raise ConfigurationError(
            "scheduler.name", f"torch.optim.lr_scheduler has no {config.name!r}", "use e.g. 'CosineAnnealingLR'"
        )
    return lambda optimizer: cls(optimizer, **config.kwargs)


def resolve_run(config: RunConfig, base: Path) -> dict[str, Any]:
    """Every factory a config names, resolved and checked against its kwargs (nothing is built yet).

    Returns the pieces ``unison train`` hands to ``fit``; a missing file or
    name, or a keyword the factory does not take, is a ConfigurationError
    naming the config key (so it fails before any worker starts).
    """
    model = resolve_factory(config.model.factory, base, "model.factory")
    check_kwargs(model, config.model.kwargs, "model.kwargs")
    data = resolve_factory(config.data.factory, base, "data.factory")
    check_kwargs(data, config.data.kwargs, "data.kwargs")
    if config.loss is not None:
        form = {"loss_fn": resolve_factory(config.loss.factory, base, "loss.factory")}
    else:
        assert config.training_step is not None
        form = {"training_step": resolve_factory(config.training_step.factory, base, "training_step.factory")}

    def build_model() -> Any:
        try:
            return model(**config.model.kwargs)
        except TypeError as exc:
            # A factory taking **kwargs is checked only when called.
            if "keyword argument" not in str(exc) and "required positional" not in str(exc):
                raise
            raise ConfigurationError("model.kwargs", str(exc), "use the keywords the model factory takes") from None

    return {
        "model": build_model,
        "data": data,
        "form": form,
        "optimizer": optimizer_factory(config.optimizer),
        "lr_scheduler": scheduler_factory(config.scheduler),
    }
