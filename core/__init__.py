"""unison: a PyTorch trainer whose distributed backends are pluggy plugins.

Swap the backend by name (``Trainer(strategy="ddp")``); every strategy
declares who owns gradient accumulation, precision and state_dict
(:class:`Ownership`), and the conformance suite proves they train alike.
"""

from unison.errors import ConfigurationError, PluginError, UnisonError, UnknownStrategyError
from unison.manager import PluginManager
from unison.ownership import (
    AccumulationOwner,
    GradAccumulation,
    Ownership,
    PrecisionOwner,
    PrecisionSupport,
    StateDictDeclaration,
    StateDictKind,
)
from unison.plugin import hookimpl
from unison.precision import Precision
from unison.registry import PrecisionSpec, StrategySpec
from unison.strategy import DistEnv, Strategy
from unison.trainer import Progress, StepOutput, Trainer, TrainerSettings

__version__ = "0.1.0"

__all__ = [
    "AccumulationOwner",
    "ConfigurationError",
    "DistEnv",
    "GradAccumulation",
    "Ownership",
    "PluginError",
    "PluginManager",
    "Precision",
    "PrecisionOwner",
    "PrecisionSpec",
    "PrecisionSupport",
    "Progress",
    "StateDictDeclaration",
    "StateDictKind",
    "StepOutput",
    "Strategy",
    "StrategySpec",
    "Trainer",
    "TrainerSettings",
    "UnisonError",
    "UnknownStrategyError",
    "hookimpl",
]
