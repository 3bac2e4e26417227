"""The import paths of unison 0.1 that 0.2 moved: each still imports, with a DeprecationWarning naming
the new home, until unison 0.3 (CHANGELOG 0.2.0).

Three kinds of old path, one table each:

* :data:`MODULES`: a flat module that became a module of a subpackage (``unison.strategy`` ->
  ``unison.contract.strategy``). ``import unison.strategy`` warns once and gives the new module itself,
  the same object, so anything set on one is seen through the other.
* :data:`COLLIDING`: the three flat modules whose names a new subpackage took (``unison.data``,
  ``unison.config``, ``unison.launch``). Their import is the package now, which the project uses, so it
  cannot warn; instead the package's ``__getattr__`` (PEP 562) resolves each name the old module had,
  lazily, from its home today, and warns at each use naming that home.
* :data:`MOVED_ON`: names an old module had that left its new module after the move (``StepOutput``
  from ``unison.trainer`` to ``unison.training.outputs``). Such an old path gives a forwarding module
  instead of the new module itself: every name of the new module, and these names from their homes,
  each with its warning. ``REMOTE_SCHEMES`` of ``unison.storage`` has no home any more (storage schemes
  are registered by plugins); the old path gives its 0.1 value, with the warning saying what replaced it.

A name of an old module is what it exported: its ``__all__`` where it had one, else every name it
defined without a leading underscore (tests/test_deprecated_paths.py lists them, read from the commit
before the move).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import inspect
import types
import warnings
from typing import Any

#: When the old paths stop importing.
REMOVED_IN = "0.3"

# Flat module (unison.<old>) -> the module it became (unison.<new>).
MODULES = {
    "strategy": "contract.strategy",
    "ownership": "contract.ownership",
    "precision": "contract.precision",
    "state": "contract.state",
    "env": "contract.env",
    "settings": "contract.settings",
    "hookspecs": "plugin.hookspecs",
    "manager": "plugin.manager",
    "registry": "plugin.registry",
    "data": "data.loader",
    "batch": "data.batch",
    "checkpoint": "checkpointing.checkpointer",
    "checkpoint_cli": "cli.checkpoint",
    "export": "checkpointing.export",
    "manifest": "checkpointing.manifest",
    "safe_io": "checkpointing.safe_io",
    "storage": "checkpointing.storage",
    "remote_storage": "checkpointing.remote_storage",
    "lease": "checkpointing.lease",
    "launch": "launch.torchrun",
    "launch_report": "launch.report",
    "lifecycle": "launch.lifecycle",
    "watchdog": "launch.watchdog",
    "worker": "launch.worker",
    "cluster": "launch.cluster",
    "setup_report": "launch.setup_report",
    "config": "config.load",
    "config_optim": "config.optim",
    "config_schema": "config.schema",
    "config_source": "config.source",
    "config_trust": "config.trust",
    "trainer": "training.trainer",
    "runs": "training.runs",
}

# The old modules a subpackage took the name of: each name they had -> the module that defines it today.
COLLIDING: dict[str, dict[str, str]] = {
    "data": {
        "BatchPlan": "data.plan",
        "CollateFn": "data.sources",
        "LoaderOptions": "data.sources",
        "StepBatch": "data.loader",
        "TrainData": "data.loader",
        "check_divisible": "data.plan",
        "is_map_style": "data.sources",
        "local_slices": "data.plan",
        "probe_batch_size": "data.validation",
        "resolve_source": "data.sources",
        "stream_global_batches": "data.streams",
        "validation_batches": "data.plan",
        "validation_slices": "data.plan",
        "validation_stream": "data.validation",
    },
    "config": {
        "APEX_NOT_INSTALLED": "config.optim",
        "ClassConfig": "config.schema",
        "ConfigErrors": "config.source",
        "FactoryConfig": "config.schema",
        "ImportsConfig": "config.schema",
        "LoggingConfig": "config.schema",
        "LossConfig": "config.schema",
        "MLflowConfig": "config.schema",
        "RunConfig": "config.schema",
        "StepConfig": "config.schema",
        "Trust": "config.trust",
        "WandbConfig": "config.schema",
        "build_callbacks": "config.load",
        "check_kwargs": "config.load",
        "load_config": "config.load",
        "optimizer_factory": "config.optim",
        "resolve_factory": "config.trust",
        "resolve_run": "config.load",
        "scheduler_factory": "config.optim",
    },
    "launch": {
        "WorldError": "launch.torchrun",
        "check_nproc": "launch.torchrun",
        "cluster_launch": "launch.torchrun",
        "free_port": "launch.torchrun",
        "run_script": "launch.torchrun",
        "spawn": "launch.torchrun",
        "start_workers": "launch.torchrun",
    },
}

# Names an old module had that its new module no longer holds -> where they live today.
MOVED_ON: dict[str, dict[str, str]] = {
    "trainer": {
        "NonFiniteError": "training.outputs",
        "StepOutput": "training.outputs",
        "build_strategy": "training.declaration",
    },
    "remote_storage": {"DEFAULT_RETRY_S": "checkpointing.retry", "retry_budget": "checkpointing.retry"},
    "storage": {"REMOTE_SCHEMES": ""},
}

# Names with no home today: their 0.1 value, and what replaced them.
GONE: dict[tuple[str, str], tuple[Any, str]] = {
    ("storage", "REMOTE_SCHEMES"): (
        types.MappingProxyType({"s3": "s3fs"}),
        "storage schemes are registered by plugins through the unison_storage_backends hook "
        "(unison.plugin.hookspecs); the built-in s3 one is unison.plugins.storage.s3",
    ),
}


def _warn(message: str, stacklevel: int) -> None:
    """Warn at the code that named the old path, ``stacklevel`` frames up from here."""
    caller = inspect.currentframe()
    for _ in range(stacklevel - 1):
        caller = caller.f_back if caller is not None else None
    if caller is not None and caller.f_code.co_name == "_handle_fromlist":
        # ``from unison.data import TrainData`` asks twice: the import system's hasattr, then the
        # statement itself; warn once, at the statement's line.
        return
    warnings.warn(f"{message} (the old path is removed in unison {REMOVED_IN})", DeprecationWarning, stacklevel)


def _resolve(old: str, name: str, home: str, depth: int) -> Any:
    """``name`` of the old module ``unison.<old>``, from ``unison.<home>``, warning that it moved there.

    ``depth``: frames between this function and the code that named the old path.
    """
    if not home:
        value, replaced = GONE[(old, name)]
        _warn(f"unison.{old}.{name} is gone: {replaced}; import nothing from unison.{old}", depth + 2)
        return value
    _warn(f"unison.{old}.{name} moved to unison.{home}.{name}; import it from unison.{home}", depth + 2)
    return getattr(importlib.import_module(f"unison.{home}"), name)


def old_name(package: str, name: str) -> Any:
    """A name of the 0.1 module a subpackage took the name of (``unison.data.TrainData``), from its home.

    The package's ``__getattr__`` calls this for every name it does not hold; anything else is the
    usual :class:`AttributeError`, so ``from unison.data import shards`` still imports the submodule.
    """
    old = package.rpartition(".")[2]
    home = COLLIDING[old].get(name)
    if home is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return _resolve(old, name, home, depth=3)  # here, the package's __getattr__, its caller


class _Forwarding(types.ModuleType):
    """An old path whose module lost names since the move: the new module's names, and those from their homes."""

    def __init__(self, old: str, new: types.ModuleType) -> None:
        super().__init__(f"unison.{old}", new.__doc__)
        self._old, self._new = old, new
        self.__file__ = getattr(new, "__file__", None)  # where the code is (inspect, tracebacks' readers)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        home = MOVED_ON[self._old].get(name)
        if home is not None:
            return _resolve(self._old, name, home, depth=2)  # here, its caller
        return getattr(self._new, name)

    def __dir__(self) -> list[str]:
        return sorted({*dir(self._new), *MOVED_ON[self._old]})


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``unison.<old>`` to the module now at ``unison.<new>``, warning that it moved.

    Appended to ``sys.meta_path``, so it only sees what no real module answers: the three old names a
    subpackage took are that subpackage (its ``__getattr__`` gives their old names, see :func:`old_name`).
    """

    def __init__(self) -> None:
        self._specs: dict[str, Any] = {}  # new module -> its own spec, restored after the import

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        prefix, _, old = fullname.partition(".")
        if prefix != "unison" or old not in MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        old = spec.name.partition(".")[2]
        new = f"unison.{MODULES[old]}"
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there (the old path is removed in unison {REMOVED_IN})",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self._specs[new] = module.__spec__
        # Where a name left the new module, the old path forwards (the same object otherwise).
        return _Forwarding(old, module) if old in MOVED_ON else module

    def exec_module(self, module: Any) -> None:
        """The module was executed under its new name already; give it back its own spec.

        The import system set ``__spec__`` to the old path's (it always does), which would make the new
        module claim the old name (``importlib.reload`` of it would then go through this finder).
        """
        if not isinstance(module, _Forwarding):
            module.__spec__ = self._specs[module.__name__]
