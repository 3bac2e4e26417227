"""Config files for ``unison train``: TOML or YAML, validated by pydantic.

Every problem in a file is reported at once, each with its file and line (or
the ``--set`` override that gave it), its key and the fix: unknown keys with
the closest valid name, wrong types, optimizer and scheduler keywords the class
does not take, NaN or negative learning rates, factories outside the trust
roots. Factories are ``"file.py:function"`` (relative to the config file) or
``"package.module:function"``; any key can be overridden on the command line
(``unison train CONFIG --set optimizer.kwargs.lr=3e-4``)::

    [trainer]                       # unison.TrainerSettings
    strategy = "ddp"
    max_steps = 200

    [model]
    factory = "tinylm.py:build_model"
    kwargs = { d_model = 64 }

    [data]                          # factory returns (train_dataset, val_dataset or None);
                                    # each a map-style dataset, an iterable one or a DataLoader
    factory = "tinylm.py:build_datasets"
    # or sharded files, local or in object storage (unison.data.shards.ShardedDataset):
    # train = "s3://bucket/train/*.parquet"
    # val = "s3://bucket/val/*.parquet"
    # decode = "tinylm.py:decode"     # one sample as read -> what a batch holds

    [loss]
    factory = "tinylm.py:loss_fn"   # the loss function itself, not a builder
    # or, for batches of any structure (dicts, Hugging Face models):
    # [training_step]
    # factory = "hf_causal_lm.py:training_step"
    # or neither section: a Hugging Face model's own loss on dict batches with labels,
    # normalised by the step's global count of labels != -100

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

    [imports]                       # optional: trust roots beyond the config's directory
    allow = ["transformers"]        # modules factories may name (with their submodules)
    paths = ["../shared"]           # directories whose files factories may name

Trust model: a config is code within its trust roots (:mod:`unison.config.trust`):
factories name files under the config's directory or ``[imports] paths``, and
modules in ``[imports] allow`` or of installed ``unison`` entry points; anything
else (``os:system``, ``"../../etc/passwd:x"``) is refused, by name, before it is
imported. A ``[[callbacks]]`` factory must return a plugin object.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pydantic
import torch

from unison.config.optim import (
    APEX_NOT_INSTALLED,
    check_optimizer,
    check_scheduler,
    keyword_problems,
    optimizer_factory,
    scheduler_factory,
)
from unison.config.schema import (
    ClassConfig,
    DataConfig,
    FactoryConfig,
    ImportsConfig,
    LoggingConfig,
    LossConfig,
    MLflowConfig,
    RunConfig,
    StepConfig,
    WandbConfig,
    unknown_key_hint,
)
from unison.config.source import ConfigErrors, Problem, Source, apply_overrides, read_source
from unison.config.trust import Trust, is_plugin, resolve_factory
from unison.errors import ConfigurationError

__all__ = [
    "APEX_NOT_INSTALLED",
    "ClassConfig",
    "ConfigErrors",
    "DataConfig",
    "FactoryConfig",
    "ImportsConfig",
    "LoggingConfig",
    "LossConfig",
    "MLflowConfig",
    "RunConfig",
    "StepConfig",
    "Trust",
    "WandbConfig",
    "build_callbacks",
    "check_kwargs",
    "load_config",
    "optimizer_factory",
    "resolve_factory",
    "resolve_run",
    "scheduler_factory",
]


def load_config(
    path: str | Path, overrides: dict[str, Any] | None = None, sets: Sequence[str] = ()
) -> tuple[RunConfig, Path]:
    """Read, override and check a config file; return it with the config's directory.

    ``overrides`` replace ``[trainer]`` keys; ``sets`` are ``KEY=VALUE``
    overrides of any key (``optimizer.kwargs.lr=3e-4``, ``callbacks.0.kwargs.patience=5``), applied in
    order. Everything that can be checked without training is checked here (the
    schema, the trust roots, every factory's name and keywords, the optimizer
    and scheduler arguments), and every problem found is raised together as one
    :class:`ConfigErrors`.
    """
    source = read_source(path)
    for key, value in (overrides or {}).items():
        source.raw.setdefault("trainer", {})[key] = value
        source.places["trainer", key] = f"override trainer.{key}"
    overridden = {item.split("=", 1)[0].split(".")[0].strip() for item in sets}
    for name, field in RunConfig.model_fields.items():
        # An override inside a section the file leaves at its default (optimizer.kwargs.lr) edits that default.
        if name in overridden and name not in source.raw and isinstance(field.default, pydantic.BaseModel):
            source.raw[name] = field.default.model_dump()
    apply_overrides(source, sets)
    base = source.path.parent.resolve()
    config, problems = _validate(source)
    sections = _valid_sections(source, problems)
    imports = sections.get("imports", ImportsConfig())
    trust = Trust.for_config(base, imports.allow, imports.paths)
    problems += _factory_problems(sections, base, trust)
    if "optimizer" in sections:
        problems += check_optimizer(sections["optimizer"], trust)
    if sections.get("scheduler") is not None:
        problems += check_scheduler(sections["scheduler"])
    source.raise_if(problems)
    assert config is not None
    return config, base


def _validate(source: Source) -> tuple[RunConfig | None, list[Problem]]:
    try:
        return RunConfig(**source.raw), []
    except pydantic.ValidationError as exc:
        return None, [_problem(err) for err in exc.errors()]


def _problem(err: Any) -> Problem:
    loc = tuple(err["loc"])
    if err["type"] == "extra_forbidden":
        problem, fix = unknown_key_hint(loc)
        return Problem(loc, problem, fix)
    if err["type"] == "missing":
        what = f"[{loc[0]}] section" if len(loc) == 1 else "key"
        return Problem(loc, f"missing {what}", "add it (see unison.config.load for the layout)")
    got = f" (got {_short(err['input'])})" if loc else ""
    return Problem(loc, err["msg"].removeprefix("Value error, ") + got, "see the documented keys in unison.config.load")


def _short(value: Any, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters: a wrong value may be a large structure."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = limit
    text = short.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _valid_sections(source: Source, problems: list[Problem]) -> dict[str, Any]:
    """Each section without a schema problem, validated on its own (so later checks still run on it)."""
    bad = {p.loc[0] for p in problems if p.loc}
    if any(not p.loc for p in problems):
        bad.add("loss")  # a whole-config problem ([loss] vs [training_step]): leave both unchecked
        bad.add("training_step")
    sections: dict[str, Any] = {}
    for name, field in RunConfig.model_fields.items():
        if name in bad:
            continue
        value = source.raw.get(name, field.default)
        try:
            annotation: Any = field.annotation  # every RunConfig field is annotated
            sections[name] = pydantic.TypeAdapter(annotation).validate_python(value)
        except pydantic.ValidationError:
            continue
    return sections


def _factory_problems(sections: dict[str, Any], base: Path, trust: Trust) -> list[Problem]:
    """Every factory a config names: inside the trust roots, found, and taking the given keywords."""
    specs: list[tuple[tuple[str | int, ...], str, dict[str, Any] | None]] = []
    for name in ("model", "data"):
        if sections.get(name) is not None and sections[name].factory is not None:
            specs.append(((name,), sections[name].factory, sections[name].kwargs))
    if sections.get("data") is not None and sections["data"].decode is not None:
        specs.append((("data", "decode"), sections["data"].decode, None))
    for name in ("loss", "training_step"):
        if sections.get(name) is not None:
            specs.append(((name,), sections[name].factory, None))
    for i, spec in enumerate(sections.get("callbacks", [])):
        specs.append((("callbacks", i), spec.factory, spec.kwargs))
    problems = []
    for loc, spec, kwargs in specs:
        try:
            factory = resolve_factory(spec, base, ".".join(map(str, loc)) + ".factory", trust)
        except ConfigurationError as exc:
            problems.append(Problem((*loc, "factory"), exc.problem, exc.fix))
            continue
        if not callable(factory):
            problems.append(Problem((*loc, "factory"), f"{spec!r} is not callable", "name a function or class"))
        elif kwargs is not None:
            problems += keyword_problems(factory, kwargs, (*loc, "kwargs"), spec)
    return problems


def check_kwargs(factory: Callable[..., Any], kwargs: dict[str, Any], key: str) -> None:
    """Refuse keyword arguments ``factory`` does not take, naming the config key and the valid ones."""
    problems = keyword_problems(factory, kwargs, (key,), getattr(factory, "__name__", key))
    if problems:
        raise ConfigurationError(key, problems[0].problem, problems[0].fix)


def _trust(config: RunConfig, base: Path) -> Trust:
    return Trust.for_config(base, config.imports.allow, config.imports.paths)


def build_callbacks(config: RunConfig, base: Path) -> list[Any]:
    """The ``[[callbacks]]`` of a config: each ``factory(**kwargs)``, which must return a plugin object."""
    plugins = []
    trust = _trust(config, base)
    for i, spec in enumerate(config.callbacks):
        key = f"callbacks[{i}] ({spec.factory})"
        factory = resolve_factory(spec.factory, base, key, trust)
        try:
            plugin = factory(**spec.kwargs)
        except TypeError as exc:
            raise ConfigurationError(key, str(exc), "check its kwargs") from None
        if not is_plugin(plugin):
            raise ConfigurationError(
                key,
                f"returned {type(plugin).__name__} {plugin!r:.60}, not a plugin object",
                "name a factory that returns an object with @unison.hookimpl methods",
            )
        plugins.append(plugin)
    return plugins


def _data_factory(data: DataConfig, base: Path, trust: Trust) -> Callable[[], Any]:
    """``() -> (train, val)``: the ``[data]`` factory with its kwargs, or the sharded datasets it names."""
    if data.factory is not None:
        factory = resolve_factory(data.factory, base, "data.factory", trust)
        check_kwargs(factory, data.kwargs, "data.kwargs")
        return lambda: factory(**data.kwargs)
    decode = resolve_factory(data.decode, base, "data.decode", trust) if data.decode is not None else None

    def sharded() -> tuple[Any, Any]:
        from unison.data.shards import ShardedDataset

        def open_shards(urls: str | list[str], **shuffle: Any) -> ShardedDataset:
            return ShardedDataset(
                urls,
                decode,
                storage_options=data.storage_options,
                index_dir=data.index_dir,
                read_ahead=data.read_ahead,
                **shuffle,
            )

        assert data.train is not None
        train = open_shards(data.train, shuffle_window=data.shuffle_window, shuffle_chunk=data.shuffle_chunk)
        return train, open_shards(data.val) if data.val else None

    return sharded


def resolve_run(config: RunConfig, base: Path) -> dict[str, Any]:
    """Every factory a config names, resolved and checked against its kwargs (nothing is built yet).

    Returns the pieces ``unison train`` hands to ``fit``; a missing file or
    name, or a keyword the factory does not take, is a ConfigurationError
    naming the config key (so it fails before any worker starts).
    """
    trust = _trust(config, base)
    model = resolve_factory(config.model.factory, base, "model.factory", trust)
    check_kwargs(model, config.model.kwargs, "model.kwargs")
    data = _data_factory(config.data, base, trust)
    form: dict[str, Any] = {}
    if config.loss is not None:
        form = {"loss_fn": resolve_factory(config.loss.factory, base, "loss.factory", trust)}
    elif config.training_step is not None:
        form = {"training_step": resolve_factory(config.training_step.factory, base, "training_step.factory", trust)}
    # Neither: fit trains the model's own loss (a Hugging Face model on dict batches with labels).

    def build_model() -> Any:
        try:
            built = model(**config.model.kwargs)
        except TypeError as exc:
            # A factory taking **kwargs is checked only when called.
            if "keyword argument" not in str(exc) and "required positional" not in str(exc):
                raise
            raise ConfigurationError("model.kwargs", str(exc), "use the keywords the model factory takes") from None
        if not isinstance(built, torch.nn.Module):
            raise ConfigurationError(
                "model.factory", f"returned {type(built).__name__}, not a torch.nn.Module", "return the model"
            )
        return built

    def build_data() -> tuple[Any, Any]:
        built = data()
        if not (isinstance(built, tuple | list) and len(built) == 2):
            raise ConfigurationError(
                "data.factory", f"returned {type(built).__name__}, not a pair", "return (train_dataset, val_dataset)"
            )
        return built[0], built[1]

    return {
        "model": build_model,
        "data": build_data,
        "form": form,
        "optimizer": optimizer_factory(config.optimizer, trust),
        "lr_scheduler": scheduler_factory(config.scheduler),
    }
