"""unison: a PyTorch trainer whose distributed backends are pluggy plugins.

Swap the backend by name (``Trainer(strategy="ddp")``); every strategy
declares who owns gradient accumulation, precision and state_dict
(:class:`Ownership`), and the conformance suite proves they train alike.
"""

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

__version__ = "0.1.0"

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
