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
import sys
from typing import TYPE_CHECKING, Any

from unison import _moved
from unison._version import __version__ as __version__

# Public name -> the submodule that defines it.
_EXPORTS = {
    "DistEnv": "contract.env",
    "ConfigurationError": "errors",
    "DeclaredRefusal": "errors",
    "PluginError": "errors",
    "UnisonError": "errors",
    "UnknownStrategyError": "errors",
    "PluginManager": "plugin.manager",
    "AccumulationOwner": "contract.ownership",
    "Feature": "contract.ownership",
    "GradAccumulation": "contract.ownership",
    "GradSync": "contract.ownership",
    "Ownership": "contract.ownership",
    "PrecisionOwner": "contract.ownership",
    "PrecisionSupport": "contract.ownership",
    "ReplicaInit": "contract.ownership",
    "StateDictDeclaration": "contract.ownership",
    "StateDictKind": "contract.ownership",
    "WorldSizes": "contract.ownership",
    "hookimpl": "plugin",
    "Precision": "contract.precision",
    "PrecisionSpec": "contract.spec",
    "StrategySpec": "contract.spec",
    "TrainerSettings": "contract.settings",
    "DeferredGradSync": "contract.strategy",
    "EngineAccumulation": "contract.strategy",
    "ScheduleAccumulation": "contract.strategy",
    "Strategy": "contract.strategy",
    "NonFiniteError": "contract.outputs",
    "Progress": "contract.outputs",
    "StepOutput": "contract.outputs",
    "Trainer": "training.trainer",
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
    from unison.contract.env import DistEnv
    from unison.contract.outputs import NonFiniteError, Progress, StepOutput
    from unison.contract.ownership import (
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
    from unison.contract.precision import Precision
    from unison.contract.settings import TrainerSettings
    from unison.contract.spec import PrecisionSpec, StrategySpec
    from unison.contract.strategy import DeferredGradSync, EngineAccumulation, ScheduleAccumulation, Strategy
    from unison.errors import ConfigurationError, DeclaredRefusal, PluginError, UnisonError, UnknownStrategyError
    from unison.plugin import hookimpl
    from unison.plugin.manager import PluginManager
    from unison.training.trainer import Trainer


# Modules that moved into subpackages in 0.2 (core grouped by concern: contract, plugin, data,
# checkpointing, launch, config, training): the old paths still import, with a DeprecationWarning
# naming the new home, until 0.3 (unison._moved holds the tables).
sys.meta_path.append(_moved.MovedModuleFinder())


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'unison' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"unison.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
