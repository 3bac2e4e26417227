"""Strategies and precisions, registered by name through hooks.

A plugin's ``unison_strategies`` hook returns :class:`StrategySpec` values;
:class:`StrategyRegistry` holds them for every registered plugin (built-in
and third-party alike), resolves aliases, validates options with the spec's
pydantic model and builds the :class:`~unison.contract.strategy.Strategy`.
:class:`~unison.plugin.manager.PluginManager` calls the hooks (through pluggy, so
wrappers and hook monitoring see them) and rebuilds both registries whenever
a plugin is registered or unregistered.

An unknown name is an error listing every registered name and suggesting the
closest one (``"dpp"`` -> ``did you mean 'ddp'?``).

Collecting the specs checks each strategy class against the plugin API
(:func:`unison.contract.version.check_strategy_class`): a class written for an
older, incompatible API is refused here with the migration to make, and a
contract method whose signature does not match is named with both signatures,
instead of either failing every run later. A factory that is not a class (a
function) is checked on the class it builds, in :meth:`StrategyRegistry.create`,
still before any process group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pydantic

from unison.contract.spec import NoOptions, PrecisionSpec, StrategySpec, missing_modules
from unison.errors import (
    ConfigurationError,
    PluginError,
    StrategyUnavailableError,
    UnknownStrategyError,
    did_you_mean,
)

if TYPE_CHECKING:  # pragma: no cover
    from unison.contract.strategy import Strategy

__all__ = ["NoOptions", "PrecisionRegistry", "PrecisionSpec", "StrategyRegistry", "StrategySpec", "missing_modules"]


class StrategyRegistry:
    """All strategy names known to one plugin manager."""

    def __init__(self, specs_by_plugin: list[tuple[str, list[StrategySpec]]]) -> None:
        from unison.contract.version import check_strategy_class, strategy_class

        self._specs: dict[str, StrategySpec] = {}
        self._plugin: dict[str, str] = {}
        self._aliases: dict[str, tuple[str, Mapping[str, Any]]] = {}
        owner: dict[str, str] = {}
        for plugin_name, specs in specs_by_plugin:
            for spec in specs:
                for name in (spec.name, *spec.aliases):
                    if name in owner:
                        raise PluginError(
                            f"strategy name {name!r} is registered by both plugin {owner[name]!r} "
                            f"and plugin {plugin_name!r}; block one with UNISON_BLOCK_PLUGINS"
                        )
                    owner[name] = plugin_name
                cls = strategy_class(spec.factory)
                if cls is not None:
                    check_strategy_class(cls, plugin=plugin_name)
                self._specs[spec.name] = spec
                self._plugin[spec.name] = plugin_name
                for alias, preset in spec.aliases.items():
                    self._aliases[alias] = (spec.name, preset)

    def names(self) -> list[str]:
        """Every registered name, aliases included, sorted."""
        return sorted([*self._specs, *self._aliases])

    def specs(self) -> list[StrategySpec]:
        return [self._specs[n] for n in sorted(self._specs)]

    def resolve(self, name: str, options: Mapping[str, Any] | None = None) -> tuple[StrategySpec, pydantic.BaseModel]:
        """Find the spec for ``name`` and validate ``options`` against it.

        Raises :class:`UnknownStrategyError` listing the available names, and
        :class:`ConfigurationError` naming each bad option.
        """
        preset: Mapping[str, Any] = {}
        if name in self._aliases:
            target, preset = self._aliases[name]
            spec = self._specs[target]
        elif name in self._specs:
            spec = self._specs[name]
        else:
            available = ", ".join(self.names()) or "(none: is plugin autoload disabled?)"
            raise UnknownStrategyError(
                "strategy",
                f"unknown strategy {name!r}{did_you_mean(name, self.names())}",
                f"use one of: {available}; or install the plugin that provides it",
            )
        merged = {**preset, **(options or {})}
        try:
            validated = spec.options.model_validate(merged, strict=True)
        except pydantic.ValidationError as exc:
            details = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '(options)'}: {err['msg']}" for err in exc.errors()
            )
            fields = ", ".join(spec.options.model_fields) or "none"
            raise ConfigurationError(
                f"strategy_options for {name!r}", details, f"valid options of {spec.name!r}: {fields}"
            ) from None
        return spec, validated

    def create(self, name: str, options: Mapping[str, Any] | None = None) -> Strategy:
        """Build the strategy (no process group is touched)."""
        spec, validated = self.resolve(name, options)
        if spec.unavailable:
            raise StrategyUnavailableError(
                "strategy",
                f"strategy {name!r} is unavailable here: {spec.unavailable}",
                "install what is missing or pick another strategy",
            )
        strategy = spec.factory(**validated.model_dump())
        from unison.contract.version import check_strategy_class, strategy_class

        if strategy_class(spec.factory) is None:
            check_strategy_class(type(strategy), plugin=self._plugin[spec.name])
        strategy.name = name
        return strategy


class PrecisionRegistry:
    """All precision plugins known to one plugin manager."""

    def __init__(self, specs_by_plugin: list[tuple[str, list[PrecisionSpec]]]) -> None:
        self._specs: dict[str, PrecisionSpec] = {}
        owner: dict[str, str] = {}
        for plugin_name, specs in specs_by_plugin:
            for spec in specs:
                if spec.name in owner:
                    raise PluginError(
                        f"precision {spec.name!r} is registered by both plugin {owner[spec.name]!r} and {plugin_name!r}"
                    )
                owner[spec.name] = plugin_name
                self._specs[spec.name] = spec

    def names(self) -> list[str]:
        return sorted(self._specs)

    def specs(self) -> list[PrecisionSpec]:
        return [self._specs[n] for n in sorted(self._specs)]

    def get(self, name: str) -> PrecisionSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise ConfigurationError(
                "precision",
                f"no precision plugin provides {name!r}{did_you_mean(name, self.names())}",
                f"use one of: {', '.join(self.names())}",
            ) from None
