"""The plugin manager: pluggy underneath, a typed facade on top.

Registration order, the same for every manager:

1. the hook specifications of :mod:`unison.plugin.hookspecs`;
2. every plugin published under the ``unison`` entry-point group, built-ins
   included (unison's own strategies are entry points of the ``unison``
   distribution: there is no second, import-side-effect path);
3. the modules named in ``UNISON_PLUGINS=mod1,mod2`` (a module already loaded
   through its entry point is not registered twice);
4. plugins given explicitly (a Trainer's callbacks and loggers);
5. :meth:`PluginManager.check_pending`, so a hook implementation that matches
   no specification is an error, not a silently ignored function.

``PluginManager(lazy=True)`` (what the ``unison`` command uses) defers step 2:
an entry point's module is imported the first time a hook it implements is
called, found by reading the module's source without importing it (a module
that does not name a hook is never imported for it; one whose source cannot
be read, or an entry point naming an attribute, is imported for every hook).
``unison --help`` then imports only the plugins that add commands, and
``unison describe ddp`` only those that register strategies, not torch's
checkpointing or a logger's library. :meth:`PluginManager.register`, the raw
:attr:`PluginManager.hook` relay and :meth:`PluginManager.list_plugins` load
every deferred entry point first, so entry points still come before explicit
plugins. A lazy manager reports a plugin that fails to import when it is
first needed rather than at construction.

``UNISON_CHECK_PLUGIN_RNG=1`` makes every lifecycle hook call check that its
plugins left the training RNG states alone (:mod:`unison.plugin.rng_guard`;
the conformance suite's runs set it).

``UNISON_DISABLE_PLUGIN_AUTOLOAD=1`` skips third-party entry points (only the
``unison`` distribution's own load), as ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``
does for pytest; ``UNISON_BLOCK_PLUGINS=a,b`` (or ``blocked=``) blocks plugins
by name.

Every hook goes through pluggy, registration hooks included: wrappers
(``@hookimpl(wrapper=True)``) and hook-call monitoring see every call. The
strategy and precision registries are built from the registration hooks on
first use and rebuilt after any :meth:`PluginManager.register` or
:meth:`PluginManager.unregister`, so a plugin registered late is found.

The trainer calls lifecycle hooks through the typed methods below (one per
hookspec, named after it, keyword arguments as in the spec), as tox 4 does:
a misspelt hook or argument is then an error in the caller's editor and at
import, not a hook call that silently reaches no implementation.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import pluggy

from unison.errors import PluginError
from unison.plugin import PROJECT_NAME, hookspecs
from unison.plugin.entry_points import ENTRY_POINT_GROUP, entry_points_with_distributions
from unison.plugin.registry import PrecisionRegistry, StrategyRegistry
from unison.plugin.rng_guard import CHECK_RNG_ENV
from unison.plugin.rng_guard import install as install_rng_guard
from unison.plugin.views import TrainerView

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unison.contract.cluster import ClusterEnvironment
    from unison.contract.outputs import StepOutput
    from unison.contract.spec import StorageFactory

DISABLE_AUTOLOAD_ENV = "UNISON_DISABLE_PLUGIN_AUTOLOAD"
PLUGINS_ENV = "UNISON_PLUGINS"
BLOCK_ENV = "UNISON_BLOCK_PLUGINS"


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def _hooks_named(ep: importlib.metadata.EntryPoint, hook_names: Iterable[str]) -> frozenset[str] | None:
    """The hooks whose names the entry point's module source mentions, read without importing it.

    ``None`` (implements anything, as far as is known) for an entry point
    naming an attribute, a module whose source cannot be read, or one that
    star-imports names it may re-export. Finding a submodule's source imports
    its parent packages, which unison keeps free of heavy imports.
    """
    if ep.attr:
        return None
    try:
        spec = importlib.util.find_spec(ep.module)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            return None
        with open(spec.origin, encoding="utf-8") as f:
            source = f.read()
    except (ImportError, OSError, ValueError, UnicodeDecodeError):
        return None
    if "import *" in source:
        return None
    return frozenset(name for name in hook_names if name in source)


class PluginManager:
    """The plugins of one Trainer (or one CLI command)."""

    def __init__(
        self,
        plugins: Iterable[Any] = (),
        *,
        autoload: bool | None = None,
        blocked: Iterable[str] = (),
        lazy: bool = False,
    ) -> None:
        """Register the hook specifications, then the plugins in the order of the module docstring.

        Args:
            plugins: plugin objects registered after the entry points and ``UNISON_PLUGINS``.
            autoload: load third-party entry points (default: unless ``UNISON_DISABLE_PLUGIN_AUTOLOAD`` is set).
            blocked: plugin names never registered (with those of ``UNISON_BLOCK_PLUGINS``).
            lazy: import each entry point's module only when a hook it implements is first called.
        """
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._strategies: StrategyRegistry | None = None
        self._precisions: PrecisionRegistry | None = None
        # Entry points not imported yet (lazy managers), each with the hooks its source names.
        self._deferred: list[tuple[importlib.metadata.EntryPoint, frozenset[str] | None]] = []
        self._lazy = lazy
        for name in [*blocked, *_env_list(BLOCK_ENV)]:
            self._pm.set_blocked(name)
        if autoload is None:
            autoload = os.environ.get(DISABLE_AUTOLOAD_ENV, "") in ("", "0")
        self._load_entry_points(third_party=autoload)
        self._load_env_plugins()
        for plugin in plugins:
            self.register(plugin)
        self.check_pending()
        if os.environ.get(CHECK_RNG_ENV, "") not in ("", "0"):
            install_rng_guard(self._pm)  # no lifecycle plugin may touch training's RNG (unison.plugin.rng_guard)

    # -- registration ------------------------------------------------------ #
    def _load_entry_points(self, *, third_party: bool) -> None:
        for ep, dist in entry_points_with_distributions(ENTRY_POINT_GROUP):
            if not third_party and dist != PROJECT_NAME:
                continue
            if self._pm.is_blocked(ep.name) or self._pm.has_plugin(ep.name):
                continue
            if self._lazy:
                self._deferred.append((ep, _hooks_named(ep, self._hook_names())))
            else:
                self._load_entry_point(ep)

    def _hook_names(self) -> list[str]:
        return [name for name in dir(hookspecs) if name.startswith(f"{PROJECT_NAME}_")]

    def _load_entry_point(self, ep: importlib.metadata.EntryPoint) -> None:
        try:
            plugin = ep.load()
        except Exception as exc:  # name the plugin that broke start-up
            raise PluginError(f"plugin {ep.name!r} (entry point {ep.value!r}) failed to import: {exc}") from exc
        if self._pm.is_registered(plugin):  # UNISON_PLUGINS named it first
            return
        self._register(plugin, name=ep.name)

    def _need(self, hook_name: str | None = None) -> None:
        """Import the deferred entry points implementing ``hook_name`` (every one for ``None``)."""
        if not self._deferred:
            return
        wanted = [
            (ep, hooks) for ep, hooks in self._deferred if hook_name is None or hooks is None or hook_name in hooks
        ]
        if not wanted:
            return
        self._deferred = [item for item in self._deferred if item not in wanted]
        for ep, _ in wanted:
            if not self._pm.is_blocked(ep.name) and not self._pm.has_plugin(ep.name):
                self._load_entry_point(ep)
        self.check_pending()

    def _load_env_plugins(self) -> None:
        for module_name in _env_list(PLUGINS_ENV):
            if self._pm.is_blocked(module_name):
                continue
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:
                raise PluginError(
                    f"plugin module {module_name!r} named in {PLUGINS_ENV} failed to import: {exc}"
                ) from exc
            # Named here and also installed: its entry point already registered
            # this very module, and registering an object twice is an error.
            self._need()  # (a lazy manager: the entry points first, as in an eager one)
            if self._pm.is_registered(module):
                continue
            self._register(module, name=module_name)

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        """Register ``plugin``; a wrong hook signature or a taken name is a :class:`PluginError`.

        Returns the name it was registered under, or ``None`` when the name is blocked.
        A lazy manager first imports every deferred entry point, so they keep
        their place before explicitly registered plugins.
        """
        self._need()
        return self._register(plugin, name)

    def _register(self, plugin: Any, name: str | None = None) -> str | None:
        try:
            registered = self._pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(self._describe(exc)) from None
        except ValueError as exc:  # the object or the name is already registered
            raise PluginError(str(exc)) from None
        self._invalidate()
        return registered

    def unregister(self, plugin: Any = None, name: str | None = None) -> Any:
        """Remove a plugin (by object or by name); its strategies and precisions disappear with it."""
        self._need()
        removed = self._pm.unregister(plugin, name=name)
        self._invalidate()
        return removed

    def _invalidate(self) -> None:
        # The registries are views of what the registered plugins return: any
        # change of plugins makes them stale.
        self._strategies = self._precisions = None

    def check_pending(self) -> None:
        """Reject ``unison_*`` implementations that match no hook specification."""
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(self._describe(exc)) from None

    def _describe(self, exc: pluggy.PluginValidationError) -> str:
        plugin = exc.plugin
        plugin_name = self._pm.get_name(plugin) or getattr(plugin, "__name__", None) or type(plugin).__name__
        return f"plugin {plugin_name!r} does not match unison's hook specifications: {exc}"

    def list_plugins(self) -> list[tuple[str, Any]]:
        """Every registered plugin with its name (a lazy manager imports its deferred entry points first)."""
        self._need()
        return [(name, plugin) for name, plugin in self._pm.list_name_plugin() if plugin is not None]

    def is_registered(self, plugin: Any) -> bool:
        return self._pm.is_registered(plugin)

    # -- registries -------------------------------------------------------- #
    @property
    def hook(self) -> Any:
        """The pluggy hook relay; prefer the typed methods below (a lazy manager loads every plugin first)."""
        self._need()
        return self._pm.hook

    def _collect(self, hook_name: str) -> list[tuple[str, list[Any]]]:
        """Each registering plugin's name with the specs it returns, in registration order.

        A duplicate name must be reported with *both* plugins, so results must
        stay attributable; one call of the relay returns an anonymous list.
        Each plugin's implementation is therefore called through
        ``subset_hook_caller`` with every *other* registering plugin removed:
        still a pluggy call, so every wrapper (``wrapper=True``) runs around it
        and hook-call monitoring records it, once per registering plugin.
        """
        return [
            (name, [spec for result in results for spec in (result or [])]) for name, results in self._each(hook_name)
        ]

    def _each(self, hook_name: str) -> list[tuple[str, list[Any]]]:
        """Each implementing plugin's name with what its implementation returned (see :meth:`_collect`)."""
        self._need(hook_name)
        caller = getattr(self._pm.hook, hook_name)
        providers = [impl for impl in caller.get_hookimpls() if not (impl.wrapper or impl.hookwrapper)]
        each = []
        for impl in providers:
            others = [other.plugin for other in providers if other.plugin is not impl.plugin]
            each.append((impl.plugin_name, self._pm.subset_hook_caller(hook_name, remove_plugins=others)()))
        return each

    @property
    def strategies(self) -> StrategyRegistry:
        """Every registered strategy name (built on first use, rebuilt after a (un)registration)."""
        if self._strategies is None:
            self._strategies = StrategyRegistry(self._collect("unison_strategies"))
        return self._strategies

    @property
    def precisions(self) -> PrecisionRegistry:
        """Every registered precision name (built on first use, rebuilt after a (un)registration)."""
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

        self._need()
        undo = self._pm.add_hookcall_monitoring(before, after)
        try:
            yield calls
        finally:
            undo()

    def _call(self, hook_name: str) -> Any:
        """The hook caller of ``hook_name``, its deferred implementations imported first."""
        self._need(hook_name)
        return getattr(self._pm.hook, hook_name)

    # -- typed facade: one method per hookspec of unison.plugin.hookspecs ------------ #
    # The registration hooks (unison_strategies, unison_precisions) are reached
    # through the registries above.
    def unison_add_cli_commands(self, *, cli: Any) -> None:
        self._call("unison_add_cli_commands")(cli=cli)

    def unison_plugins_from_config(self, *, config: Any) -> list[Any]:
        """The plugins every implementation built, flattened into one list."""
        return [plugin for plugins in self._call("unison_plugins_from_config")(config=config) for plugin in plugins]

    def unison_cluster_environments(self) -> list[ClusterEnvironment]:
        """Every plugin's cluster environments, flattened; a name registered twice is an error."""
        environments = [env for envs in self._call("unison_cluster_environments")() for env in envs or []]
        names = [env.name for env in environments]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise PluginError(f"cluster environment(s) registered twice: {', '.join(duplicates)}")
        return environments

    def unison_storage_backends(self) -> dict[str, StorageFactory]:
        """Every plugin's storage factories by URL scheme; a scheme registered twice names both plugins."""
        backends: dict[str, StorageFactory] = {}
        owners: dict[str, str] = {}
        for plugin_name, results in self._each("unison_storage_backends"):
            for result in results:
                for scheme, factory in (result or {}).items():
                    scheme = scheme.lower()
                    if scheme in owners:
                        raise PluginError(
                            f"storage scheme {scheme!r} registered by both {owners[scheme]!r} and {plugin_name!r}"
                        )
                    owners[scheme], backends[scheme] = plugin_name, factory
        return backends

    def unison_tensor_parallel_plan(self, *, module: torch.nn.Module) -> dict[str, str] | None:
        """The first plugin's plan for ``module`` (``firstresult``), or ``None`` when no plugin knows its type."""
        plan: dict[str, str] | None = self._call("unison_tensor_parallel_plan")(module=module)
        return plan

    def unison_on_fit_start(self, *, trainer: TrainerView) -> None:
        self._call("unison_on_fit_start")(trainer=trainer)

    def unison_on_fit_end(self, *, trainer: TrainerView) -> None:
        self._call("unison_on_fit_end")(trainer=trainer)

    def unison_on_exception(self, *, trainer: TrainerView, exception: BaseException) -> None:
        self._call("unison_on_exception")(trainer=trainer, exception=exception)

    def unison_on_train_epoch_start(self, *, trainer: TrainerView, epoch: int) -> None:
        self._call("unison_on_train_epoch_start")(trainer=trainer, epoch=epoch)

    def unison_on_train_epoch_end(self, *, trainer: TrainerView, epoch: int) -> None:
        self._call("unison_on_train_epoch_end")(trainer=trainer, epoch=epoch)

    def unison_on_train_step_start(self, *, trainer: TrainerView, step: int) -> None:
        self._call("unison_on_train_step_start")(trainer=trainer, step=step)

    def unison_on_after_backward(self, *, trainer: TrainerView, step: int) -> None:
        self._call("unison_on_after_backward")(trainer=trainer, step=step)

    def unison_on_before_optimizer_step(self, *, trainer: TrainerView, step: int, grad_norm: torch.Tensor) -> None:
        self._call("unison_on_before_optimizer_step")(trainer=trainer, step=step, grad_norm=grad_norm)

    def unison_on_after_optimizer_step(self, *, trainer: TrainerView, step: int, skipped: bool) -> None:
        self._call("unison_on_after_optimizer_step")(trainer=trainer, step=step, skipped=skipped)

    def unison_on_train_step_end(self, *, trainer: TrainerView, step: int, output: StepOutput) -> None:
        self._call("unison_on_train_step_end")(trainer=trainer, step=step, output=output)

    def unison_on_validation_start(self, *, trainer: TrainerView, step: int) -> None:
        self._call("unison_on_validation_start")(trainer=trainer, step=step)

    def unison_on_validation_end(self, *, trainer: TrainerView, step: int, metrics: dict[str, float]) -> None:
        self._call("unison_on_validation_end")(trainer=trainer, step=step, metrics=metrics)

    def unison_on_save_checkpoint(self, *, trainer: TrainerView, checkpoint: dict[str, Any]) -> None:
        self._call("unison_on_save_checkpoint")(trainer=trainer, checkpoint=checkpoint)

    def unison_on_load_checkpoint(self, *, trainer: TrainerView, checkpoint: dict[str, Any]) -> None:
        self._call("unison_on_load_checkpoint")(trainer=trainer, checkpoint=checkpoint)

    def unison_log_metrics(self, *, trainer: TrainerView, metrics: dict[str, float], step: int) -> None:
        self._call("unison_log_metrics")(trainer=trainer, metrics=metrics, step=step)

    def unison_default_plugins(self, *, settings: Any, plugins: list[Any]) -> list[Any]:
        """The default plugins every implementation returned, flattened into one list."""
        return [p for ps in self._call("unison_default_plugins")(settings=settings, plugins=plugins) for p in ps or []]

    def unison_on_trainer_init(self, *, trainer: TrainerView) -> None:
        self._call("unison_on_trainer_init")(trainer=trainer)

    def unison_validation_progress(
        self, *, trainer: TrainerView, step: int, batch_idx: int, num_batches: int | None
    ) -> None:
        self._call("unison_validation_progress")(
            trainer=trainer, step=step, batch_idx=batch_idx, num_batches=num_batches
        )
