"""What a plugin registers: :class:`StrategySpec` and :class:`PrecisionSpec`, one per name, and a
:data:`StorageFactory` per URL scheme.

A plugin's ``unison_strategies`` and ``unison_precisions`` hooks return these values;
:mod:`unison.plugin.registry` collects them (the plugin system sits above the contract, so the
values it collects are defined here, with the strategy and precision they build).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import pydantic

if TYPE_CHECKING:  # pragma: no cover
    from unison.contract.precision import Precision
    from unison.contract.strategy import Strategy

__all__ = ["NoOptions", "PrecisionSpec", "StorageFactory", "StrategySpec", "missing_modules"]

#: What a storage plugin registers per URL scheme (hook ``unison_storage_backends``):
#: ``factory(location, storage_options, option) -> (root, storage)``. ``location`` is the whole URL,
#: ``storage_options`` the user's backend options, ``option`` the setting errors name; ``storage`` is a
#: :class:`unison.checkpointing.storage.LocalStorage` (or a subclass: the interface every backend implements).
StorageFactory = Callable[[str, dict[str, Any], str], tuple[Path, Any]]


class NoOptions(pydantic.BaseModel):
    """Option schema of a strategy that takes none."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


def missing_modules(*modules: str) -> str | None:
    """Return a reason naming the first module that cannot be imported, or None.

    Uses ``find_spec`` so that listing strategies never imports heavy packages.
    """
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"python package {module!r} is not installed (pip install 'unison[{module.split('.')[0]}]')"
    return None


@dataclass(frozen=True)
class StrategySpec:
    """One strategy name as a plugin registers it."""

    name: str
    #: Called with the validated options as keyword arguments.
    factory: Callable[..., Strategy]
    description: str
    #: Pydantic model of the options; unknown options are rejected.
    options: type[pydantic.BaseModel] = NoOptions
    #: Other names for the same strategy, each with preset options
    #: (``{"zero3_offload": {"offload_optimizer": "cpu"}}``).
    aliases: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: ``None`` when the strategy can run here, otherwise why it cannot.
    unavailable: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "aliases", MappingProxyType({k: dict(v) for k, v in self.aliases.items()}))


@dataclass(frozen=True)
class PrecisionSpec:
    """One precision name as a plugin registers it."""

    name: str
    #: Called as ``factory(device=..., grad_scaler=...)`` where ``grad_scaler``
    #: is the strategy's :meth:`~unison.Strategy.make_grad_scaler`.
    factory: Callable[..., Precision]
    description: str
    unavailable: str | None = None
