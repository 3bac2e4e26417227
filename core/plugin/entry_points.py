"""The installed entry points of a group, read once per change of what is installed.

:func:`importlib.metadata.entry_points` scans every distribution on ``sys.path`` on each call (tens of
milliseconds with a few hundred packages), and a process that runs many fits (a test session, a
conformance world) builds a plugin manager per fit. The scan is kept and reused while ``sys.path`` and
the modification times of its directories are unchanged: installing or removing a package adds or
removes its ``*.dist-info`` directory in one of them, which changes that directory's time, so a package
installed while the process runs is still found by the next manager.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

#: The entry-point group plugins register under (``[project.entry-points.unison]``).
ENTRY_POINT_GROUP = "unison"

_CACHE: dict[str, tuple[tuple[tuple[str, int], ...], tuple[importlib.metadata.EntryPoint, ...]]] = {}


def _installed_state() -> tuple[tuple[str, int], ...]:
    state = []
    for entry in sys.path:
        try:
            state.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            state.append((entry, -1))
    return tuple(state)


def entry_points(group: str) -> tuple[importlib.metadata.EntryPoint, ...]:
    """``importlib.metadata.entry_points(group=group)``, rescanned only when what is installed changed."""
    state = _installed_state()
    cached = _CACHE.get(group)
    if cached is not None and cached[0] == state:
        return cached[1]
    found = tuple(importlib.metadata.entry_points(group=group))
    _CACHE[group] = (state, found)
    return found
