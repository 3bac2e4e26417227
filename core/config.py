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

    [data]                          # factory returns (train_dataset, val_dataset or None)
    factory = "tinylm.py:build_datasets"

    [loss]
    factory = "tinylm.py:loss_fn"   # the loss function itself, not a builder

    [optimizer]                     # a torch.optim class, "apex.FusedAdam", or "package.module:Class"
    name = "AdamW"
    kwargs = { lr = 3e-3 }

    [scheduler]                     # optional, a torch.optim.lr_scheduler class
    name = "CosineAnnealingLR"
    kwargs = { T_max = 200 }

    [logging]
    jsonl = "runs/tinylm/metrics.jsonl"
    progress = true
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import tomllib
from pathlib import Path
from typing import Any, Callable

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


class ClassConfig(_Strict):
    name: str
    """Optimizer: a ``torch.optim`` class, ``apex.NAME`` (apex's fused optimizers) or ``package.module:Class``;
    scheduler: a ``torch.optim.lr_scheduler`` class."""
    kwargs: dict[str, Any] = {}
    """Constructor keyword arguments."""


class LoggingConfig(_Strict):
    jsonl: str | None = None
    """Path of a JSONL metrics file (relative to the working directory)."""
    progress: bool = True
    """Show a progress display on rank 0."""


class RunConfig(_Strict):
    trainer: TrainerSettings
    model: FactoryConfig
    data: FactoryConfig
    loss: LossConfig
    optimizer: ClassConfig = ClassConfig(name="AdamW", kwargs={"lr": 1e-3})
    scheduler: ClassConfig | None = None
    logging: LoggingConfig = LoggingConfig()


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
            raise ConfigurationError(option, f"cannot import {name!r} ({type(exc).__name__}: {exc})",
                                     "write 'package.module:Class' naming an importable optimizer class") from None
    elif name.startswith("apex."):
        cls = _apex_optimizer(name.removeprefix("apex."))
    else:
        cls = getattr(torch.optim, name, None)
        if cls is None:
            raise ConfigurationError(option, f"torch.optim has no {name!r}",
                                     "use e.g. 'AdamW' or 'SGD', 'apex.FusedAdam', or 'package.module:Class'")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigurationError(option, f"{name!r} is not a torch.optim.Optimizer subclass",
                                 "name an optimizer class")
    return cls


def _apex_optimizer(attr: str) -> Any:
    """``apex.optimizers.<attr>``, or a ConfigurationError saying what is missing."""
    option, fix = "optimizer.name", (
        "build NVIDIA apex from https://github.com/NVIDIA/apex with its CUDA extensions, or use a torch.optim name "
        "such as 'AdamW'"
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
