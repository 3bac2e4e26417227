"""The config trust model: what a config file's factories may load.

A config is code: its factories run when the run starts. unison runs only
code within the config's *trust roots*:

* ``file.py:name`` names a file under the config file's directory, or under a
  directory listed in ``[imports] paths`` (``..`` and symlinks are resolved
  first, so ``"../../etc/passwd:x"`` is refused);
* ``package.module:name`` names a module listed in ``[imports] allow`` (or a
  submodule of one), or the module of an installed ``unison`` entry point
  (``unison.plugins.callbacks:EarlyStopping``). Any other module, ``os`` or
  ``subprocess`` included, is refused before it is imported.

The check is made on the name alone, before anything is imported or called,
so a refused factory never runs. Reading a config's ``[imports]`` tells what
it may run; Python callers of :class:`unison.Trainer` are outside this model.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unison.errors import ConfigurationError
from unison.plugin.entry_points import ENTRY_POINT_GROUP
from unison.plugin.entry_points import entry_points as installed_entry_points

_FORMS = "write 'file.py:function' (a file under the config's directory) or 'module:function'"


def entry_point_modules() -> tuple[str, ...]:
    """The modules installed ``unison`` entry points name (built-in and third-party plugins)."""
    return tuple(sorted({ep.module for ep in installed_entry_points(ENTRY_POINT_GROUP)}))


@dataclass(frozen=True)
class Trust:
    """The roots a config's factories may load from."""

    roots: tuple[Path, ...]
    """Directories whose files may be named (resolved)."""
    modules: tuple[str, ...]
    """Modules that may be named, each with its submodules."""

    @classmethod
    def for_config(cls, base: Path, allow: list[str], paths: list[str]) -> Trust:
        """The config directory ``base`` plus its ``[imports]`` table."""
        roots = (base.resolve(), *((base / p).resolve() for p in paths))
        return cls(roots, (*allow, *entry_point_modules()))

    def module_allowed(self, name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in self.modules)

    def check(self, spec: str, key: str) -> None:
        """Refuse ``spec`` unless it names a file under a root or an allowed module; imports nothing."""
        target, sep, attr = spec.rpartition(":")
        if not sep or not target or not attr:
            raise ConfigurationError(key, f"{spec!r} has no 'target:name' form", _FORMS)
        if is_path(target):
            file = self.file(target)
            if not any(file.is_relative_to(root) for root in self.roots):
                raise ConfigurationError(
                    key,
                    f"{spec!r} is outside the config's trust roots ({', '.join(map(str, self.roots))})",
                    "move the file beside the config, or list its directory in [imports] paths",
                )
            if not target.endswith(".py"):
                raise ConfigurationError(key, f"{spec!r} is not a Python file", "name a .py file: 'file.py:function'")
            if not file.is_file():
                raise ConfigurationError(key, f"{spec!r}: no file {file}", "give the path relative to the config file")
        elif not all(part.isidentifier() for part in target.split(".")):
            raise ConfigurationError(key, f"{target!r} is neither a module name nor a .py file", _FORMS)
        elif not self.module_allowed(target):
            raise ConfigurationError(
                key,
                f"module {target!r} is not allowed by the config (nothing was imported)",
                f'list it in [imports] allow = ["{target.split(".")[0]}"] if you trust it, or use a file beside '
                "the config",
            )

    def file(self, target: str) -> Path:
        return (self.roots[0] / target).resolve()


def is_path(target: str) -> bool:
    """Whether a factory's target names a file (``x.py``, ``dir/x.py``, ``../x``) rather than a module."""
    return target.endswith(".py") or "/" in target or "\\" in target or target.startswith(".")


def resolve_factory(spec: str, base: Path, key: str = "factory", trust: Trust | None = None) -> Callable[..., Any]:
    """``file.py:name`` (relative to ``base``) or ``module:name`` -> the object; ``key`` names it in errors.

    With ``trust``, the spec is checked against it first (see the module docstring).
    """
    if trust is not None:
        trust.check(spec, key)
    target, sep, attr = spec.rpartition(":")
    if not sep or not target:
        raise ConfigurationError(key, f"{spec!r} has no ':name' part", _FORMS)
    if is_path(target):
        module = _load_file((base / target).resolve(), spec, key)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise ConfigurationError(
                key, f"{spec!r}: no module {exc.name!r}", "check the module name, or install it"
            ) from None
        except TypeError as exc:  # a relative name such as ".mod"
            raise ConfigurationError(key, f"{spec!r}: {exc}", _FORMS) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        close = difflib.get_close_matches(attr, [n for n in dir(module) if not n.startswith("_")], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigurationError(key, f"{target} has no {attr!r}{hint}", "check the name after ':'") from None


def _load_file(file: Path, spec: str, key: str) -> Any:
    if not file.is_file():
        raise ConfigurationError(key, f"{spec!r}: no file {file}", "give the path relative to the config file")
    # Named by stem and path: two configs' factories.py are different modules.
    name = f"unison_config_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:10]}"
    if name not in sys.modules:
        module_spec = importlib.util.spec_from_file_location(name, file)
        if module_spec is None or module_spec.loader is None:
            raise ConfigurationError(key, f"cannot load {file}", "check the path")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]  # a fixed file can be loaded again
            raise
    return sys.modules[name]


def is_plugin(obj: Any) -> bool:
    """An object pluggy can register as a unison plugin: an instance with ``@unison.hookimpl`` methods."""
    if isinstance(obj, type) or obj is None or isinstance(obj, int | float | str | bytes | bool):
        return False
    names = [n for n in dir(obj) if n.startswith("unison_")]
    return any(callable(getattr(obj, n, None)) and hasattr(getattr(obj, n), "unison_impl") for n in names)
