"""A typed facade over :class:`pluggy.PluginManager`.

Registration order, the same for every manager:

1. the hook specifications of :mod:`unison.hookspecs`;
2. every plugin published under the ``unison`` entry-point group, built-ins
   included (unison's own strategies are entry points of the ``unison``
   distribution: there is no second, import-side-effect path);
3. plugins given explicitly (a Trainer's callbacks and loggers);
4. :meth:`pluggy.PluginManager.check_pending`, so a hook implementation that
   matches no specification is an error, not a silently ignored function.

``UNISON_DISABLE_PLUGIN_AUTOLOAD=1`` skips third-party entry points (only the
``unison`` distribution's own load) and ``UNISON_PLUGINS=mod1,mod2`` then
names modules to load explicitly, as pytest does. ``UNISON_BLOCK_PLUGINS=a,b``
(or ``blocked=``) blocks plugins by name.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import os
from typing import Any, Iterable, Iterator

import pluggy

from unison import hookspecs
from unison.errors import PluginError
from unison.plugin import PROJECT_NAME
from unison.registry import PrecisionRegistry, StrategyRegistry

ENTRY_POINT_GROUP = "unison"
DISABLE_AUTOLOAD_ENV = "UNISON_DISABLE_PLUGIN_AUTOLOAD"
PLUGINS_ENV = "UNISON_PLUGINS"
BLOCK_ENV = "UNISON_BLOCK_PLUGINS"


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


class PluginManager:
    """The plugins of one Trainer (or one CLI command)."""

    def __init__(
        self,
        plugins: Iterable[Any] = (),
        *,
        autoload: bool | None = None,
        blocked: Iterable[str] = (),
    ) -> None:
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        for name in [*blocked, *_env_list(BLOCK_ENV)]:
            self._pm.set_blocked(name)
        if autoload is None:
            autoload = os.environ.get(DISABLE_AUTOLOAD_ENV, "") in ("", "0")
        self._load_entry_points(third_party=autoload)
        for module_name in _env_list(PLUGINS_ENV):
            self.register(importlib.import_module(module_name), name=module_name)
        for plugin in plugins:
            self.register(plugin)
        self.check_pending()
        self._strategies: StrategyRegistry | None = None
        self._precisions: PrecisionRegistry | None = None

    # -- registration ------------------------------------------------------ #
    def _load_entry_points(self, *, third_party: bool) -> None:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else None
            if not third_party and dist != PROJECT_NAME:
                continue
            if self._pm.is_blocked(ep.name) or self._pm.has_plugin(ep.name):
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # name the plugin that broke start-up
                raise PluginError(f"plugin {ep.name!r} (entry point {ep.value!r}) failed to import: {exc}") from exc
            self.register(plugin, name=ep.name)

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        """Register ``plugin``; a wrong hook signature is a :class:`PluginError`."""
        try:
            return self._pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(self._describe(exc)) from None
        except ValueError as exc:  # already registered
            raise PluginError(str(exc)) from None

    def unregister(self, plugin: Any) -> None:
        self._pm.unregister(plugin)

    def check_pending(self) -> None:
        """Reject ``unison_*`` implementations that match no hook specification."""
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(self._describe(exc)) from None

    def _describe(self, exc: pluggy.PluginValidationError) -> str:
        plugin_name = self._pm.get_name(exc.plugin) or getattr(exc.plugin, "__name__", None) or type(exc.plugin).__name__
        return f"plugin {plugin_name!r} does not match unison's hook specifications: {exc}"

    def list_plugins(self) -> list[tuple[str, Any]]:
        return [(name, plugin) for name, plugin in self._pm.list_name_plugin() if plugin is not None]

    def is_registered(self, plugin: Any) -> bool:
        return self._pm.is_registered(plugin)

    # -- typed access ------------------------------------------------------ #
    @property
    def hook(self) -> Any:
        """The pluggy hook relay (``pm.hook.unison_on_fit_start(trainer=...)``)."""
        return self._pm.hook

    def _collect(self, hook_name: str) -> list[tuple[str, list[Any]]]:
        caller = getattr(self._pm.hook, hook_name)
        collected = []
        for impl in caller.get_hookimpls():
            result = impl.function()
            collected.append((impl.plugin_name, list(result or [])))
        return collected

    @property
    def strategies(self) -> StrategyRegistry:
        if self._strategies is None:
            self._strategies = StrategyRegistry(self._collect("unison_strategies"))
        return self._strategies

    @property
    def precisions(self) -> PrecisionRegistry:
        if self._precisions is None:
            self._precisions = PrecisionRegistry(self._collect("unison_precisions"))
        return self._precisions

    @contextlib.contextmanager
    def record_hook_calls(self, prefix: str = "unison_on_") -> Iterator[list[str]]:
        """Record the names of hooks called while the context is open.

        Uses pluggy's hook-call monitoring, so it sees exactly what plugins see.
        """
        calls: list[str] = []

        def before(hook_name: str, hook_impls: Any, kwargs: Any) -> None:
            if hook_name.startswith(prefix):
                calls.append(hook_name)

        def after(outcome: Any, hook_name: str, hook_impls: Any, kwargs: Any) -> None:
            pass

        undo = self._pm.add_hookcall_monitoring(before, after)
        try:
            yield calls
        finally:
            undo()
