"""The strategy checked against the settings, before any process group: :func:`declare`.

The strategy is created by name, its contract checked, and every setting it
declares refused (precision, world size, accumulation, clipping, compile,
activation checkpointing) is refused here, naming the option and the fix.
What the declaration decided for these settings is kept in one value,
:class:`Declared`: the precision support (who applies the precision) and the
step's sizes over the strategy's data-parallel replicas, each computed and
checked once. Launchers run it too (:func:`build_strategy`), so bad input
fails before workers start.
"""

from __future__ import annotations

from dataclasses import dataclass

from unison.contract.env import resolve_accelerator
from unison.contract.ownership import Feature, PrecisionSupport
from unison.contract.settings import TrainerSettings
from unison.contract.strategy import Strategy, check_contract
from unison.contract.transforms import compile_options
from unison.data.plan import StepSizes
from unison.errors import ConfigurationError, DeclaredRefusal
from unison.plugin.manager import PluginManager

__all__ = ["Declared", "build_strategy", "declare", "refuse"]


def refuse(strategy: Strategy, feature: Feature, option: str, fix: str) -> None:
    reason = strategy.ownership.refusal(feature)
    if reason is not None:
        raise DeclaredRefusal(
            option,
            f"strategy {strategy.name!r} declares it does not support {feature.description}: {reason}",
            fix + f" (see `unison describe {strategy.name}`)",
            feature=feature.value,
        )


@dataclass(frozen=True)
class Declared:
    """The strategy built for a world size, and what its declaration decided for the settings (:func:`declare`)."""

    strategy: Strategy
    #: Who applies ``settings.precision`` and how (computed once here; the fit's precision is built from it).
    precision: PrecisionSupport
    #: The step's sizes over the strategy's data-parallel replicas (checked once here).
    sizes: StepSizes


def declare(settings: TrainerSettings, pm: PluginManager, world_size: int) -> Declared:
    """Create the strategy and check the settings against its declaration for ``world_size`` ranks.

    Everything here runs before any process group exists; launchers call it
    too (through :func:`build_strategy`) so that bad input fails before workers start.
    """
    strategy = pm.strategies.create(settings.strategy, settings.strategy_options)
    strategy.plugins = pm  # the hooks it asks about the model (a tensor-parallel plan) see this run's plugins
    check_contract(strategy)
    ownership = strategy.ownership
    support = ownership.precision_support(settings.precision)
    if not support.supported:
        raise DeclaredRefusal(
            "precision",
            f"strategy {settings.strategy!r} does not support precision {settings.precision!r}: {support.detail}",
            f"pick a precision the strategy supports (see `unison describe {settings.strategy}`)",
            feature=f"precision:{settings.precision}",
        )
    if support.applied_by_trainer:
        spec = pm.precisions.get(settings.precision)
        if spec.unavailable:
            raise ConfigurationError(
                "precision", f"{spec.name!r} is unavailable here: {spec.unavailable}", "pick another precision"
            )
    refused_world = ownership.world_sizes.refusal(world_size)
    if refused_world is not None:
        raise DeclaredRefusal(
            "world size",
            f"strategy {settings.strategy!r} cannot run here: {refused_world}",
            "launch a world size the strategy declares (see `unison describe " + settings.strategy + "`)",
            feature="world_size",
        )
    if settings.accumulate_grad_batches > 1:
        refuse(strategy, Feature.GRADIENT_ACCUMULATION, "accumulate_grad_batches", "set accumulate_grad_batches=1")
    if settings.grad_clip_norm is not None:
        refuse(strategy, Feature.GRADIENT_CLIPPING, "grad_clip_norm", "set grad_clip_norm=None")
    if settings.compile is not False:
        refuse(strategy, Feature.COMPILE, "compile", "set compile=False")
        compile_options(settings.compile)  # torch.compile's keyword arguments only
    if settings.activation_checkpointing is not None:
        refuse(
            strategy, Feature.ACTIVATION_CHECKPOINTING, "activation_checkpointing", "set activation_checkpointing=None"
        )
    resolve_accelerator(settings.accelerator)
    strategy.validate(settings, world_size)
    sizes = StepSizes(
        settings.global_batch_size, settings.accumulate_grad_batches, strategy.data_parallel_size(world_size)
    )
    return Declared(strategy, support, sizes)


def build_strategy(settings: TrainerSettings, pm: PluginManager, world_size: int) -> Strategy:
    """The strategy of :func:`declare`, for a launcher that only needs its checks to pass."""
    return declare(settings, pm, world_size).strategy
