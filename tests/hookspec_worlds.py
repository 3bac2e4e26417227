"""A plugin implementing every hookspec, recording each call (for tests/test_hookspecs.py).

Registered by name through ``UNISON_PLUGINS=hookspec_worlds``, so every
PluginManager a run creates (the CLI makes several) loads it. Its functions are
generated from :mod:`unison.plugin.hookspecs` with the specs' own argument names, so a
new hookspec is covered without editing this file.
"""

from __future__ import annotations

import collections
import inspect

import unison
from unison.plugin import hookspecs

#: hook name -> number of calls
CALLS: collections.Counter[str] = collections.Counter()


def specs() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if name.startswith("unison_")
    }


def _make(name: str, params: list[str]):
    namespace: dict = {"CALLS": CALLS}
    exec(f"def {name}({', '.join(params)}):\n    CALLS[{name!r}] += 1\n", namespace)  # the spec's exact arguments
    return unison.hookimpl(namespace[name])


for _name, _signature in specs().items():
    globals()[_name] = _make(_name, list(_signature.parameters))
