"""unison: a PyTorch trainer whose distributed backends are pluggy plugins.

Swap the backend by name (``Trainer(strategy="ddp")``); every strategy
declares who owns gradient accumulation, precision and state_dict
(:class:`Ownership`), and the conformance suite proves they train alike.

The names below are imported on first use (PEP 562), so ``import unison``
and the ``unison`` command's start do not pay for torch until a name that
needs it is touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the submodule that defines it.
_EXPORTS = {
    "DistEnv": "env",
    "ConfigurationError": "errors",
    "DeclaredRefusal": "errors",
    "PluginError": "errors",
    "UnisonError": "errors",
    "UnknownStrategyError": "errors",
    "PluginManager": "manager",
    "AccumulationOwner": "ownership",
    "Feature": "ownership",
    "GradAccumulation": "ownership",
    "GradSync": "ownership",
    "Ownership": "ownership",
    "PrecisionOwner": "ownership",
    "PrecisionSupport": "ownership",
    "ReplicaInit": "ownership",
    "StateDictDeclaration": "ownership",
    "StateDictKind": "ownership",
    "WorldSizes": "ownership",
    "hookimpl": "plugin",
    "Precision": "precision",
    "PrecisionSpec": "registry",
    "StrategySpec": "registry",
    "TrainerSettings": "settings",
    "DeferredGradSync": "strategy",
    "EngineAccumulation": "strategy",
    "ScheduleAccumulation": "strategy",
    "Strategy": "strategy",
    "NonFiniteError": "trainer",
    "Progress": "trainer",
    "StepOutput": "trainer",
    "Trainer": "trainer",
}

__all__ = [
    "AccumulationOwner",
    "ConfigurationError",
    "DeclaredRefusal",
    "DeferredGradSync",
    "DistEnv",
    "EngineAccumulation",
    "Feature",
    "GradAccumulation",
    "GradSync",
    "NonFiniteError",
    "Ownership",
    "PluginError",
    "PluginManager",
    "Precision",
    "PrecisionOwner",
    "PrecisionSpec",
    "PrecisionSupport",
    "Progress",
    "ReplicaInit",
    "ScheduleAccumulation",
    "StateDictDeclaration",
    "StateDictKind",
    "StepOutput",
    "Strategy",
    "StrategySpec",
    "Trainer",
    "TrainerSettings",
    "UnisonError",
    "UnknownStrategyError",
    "WorldSizes",
    "hookimpl",
]

if TYPE_CHECKING:  # pragma: no cover - what editors and type checkers see
    from unison.env import DistEnv
    from unison.errors import ConfigurationError, DeclaredRefusal, PluginError, UnisonError, UnknownStrategyError
    from unison.manager import PluginManager
    from unison.ownership import (
        AccumulationOwner,
        Feature,
        GradAccumulation,
        GradSync,
        Ownership,
        PrecisionOwner,
        PrecisionSupport,
        ReplicaInit,
        StateDictDeclaration,
        StateDictKind,
        WorldSizes,
    )
    from unison.plugin import hookimpl
    from unison.precision import Precision
    from unison.registry import PrecisionSpec, StrategySpec
    from unison.settings import TrainerSettings
    from unison.strategy import DeferredGradSync, EngineAccumulation, ScheduleAccumulation, Strategy
    from unison.trainer import NonFiniteError, Progress, StepOutput, Trainer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'unison' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"unison.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
