"""What :func:`unison.launch.torchrun.spawn`'s fork server imports once, before it forks any rank.

Each import here is seconds a rank no longer spends: torch and unison's plugin system always (what a rank
imports of the layers above ``launch`` stays the rank's own, about a fifth of a second), DeepSpeed where it
imports (its own import takes seconds more). A library that fails to import is left to fail again where a
rank imports it, with that rank's traceback; the server itself must start.
"""

from __future__ import annotations

import contextlib

import torch.distributed  # noqa: F401

import unison.plugin.manager  # noqa: F401

with contextlib.suppress(Exception):
    import deepspeed  # noqa: F401
