"""What is installed, read once per change of what is installed: a group's entry points with the name of
the distribution each comes from, and the versions of named distributions.

:func:`importlib.metadata.entry_points` scans every distribution on ``sys.path`` on each call (tens of
milliseconds with a few hundred packages), and reading a distribution's name or version parses its whole
``METADATA`` file (about a millisecond each); a process that runs many fits (a test session, a
conformance world) builds a plugin manager and records the versions per fit. What was read is kept and
reused while ``sys.path`` and the modification times of its directories are unchanged: installing or
removing a package adds or removes its ``*.dist-info`` directory in one of them, which changes that
directory's time, so a package installed while the process runs is still found by the next manager.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

#: The entry-point group plugins register under (``[project.entry-points.unison]``).
ENTRY_POINT_GROUP = "unison"

_State = tuple[tuple[str, int], ...]
_CACHE: dict[str, tuple[_State, tuple[tuple[importlib.metadata.EntryPoint, str | None], ...]]] = {}
_VERSIONS: dict[tuple[str, ...], tuple[_State, dict[str, str]]] = {}


def _installed_state() -> _State:
    state = []
    for entry in sys.path:
        try:
            state.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            state.append((entry, -1))
    return tuple(state)


def entry_points_with_distributions(group: str) -> tuple[tuple[importlib.metadata.EntryPoint, str | None], ...]:
    """``importlib.metadata.entry_points(group=group)``, each with its distribution's name (``None``: none),
    rescanned only when what is installed changed."""
    state = _installed_state()
    cached = _CACHE.get(group)
    if cached is not None and cached[0] == state:
        return cached[1]
    found = tuple(
        (ep, ep.dist.name if ep.dist is not None else None) for ep in importlib.metadata.entry_points(group=group)
    )
    _CACHE[group] = (state, found)
    return found


def entry_points(group: str) -> tuple[importlib.metadata.EntryPoint, ...]:
    """``importlib.metadata.entry_points(group=group)``, rescanned only when what is installed changed."""
    return tuple(ep for ep, _ in entry_points_with_distributions(group))


def installed_versions(names: tuple[str, ...]) -> dict[str, str]:
    """``{name: importlib.metadata.version(name)}`` for the installed ones of ``names`` (a new dict each call),
    read again only when what is installed changed."""
    state = _installed_state()
    cached = _VERSIONS.get(names)
    if cached is None or cached[0] != state:
        versions = {}
        for name in names:
            try:
                versions[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
        cached = _VERSIONS[names] = (state, versions)
    return dict(cached[1])
