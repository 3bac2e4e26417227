"""Where a process sits in the world: launcher variables, device, accelerator.

One place resolves the accelerator (``"auto"`` -> ``"cuda"`` when a GPU is
usable, else ``"cpu"``); the trainer and every strategy ask it instead of
re-deriving the rule.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from unison.errors import ConfigurationError


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the world, as the trainer found it.

    The trainer binds it to the strategy (``strategy.env``) before it calls
    ``setup``, and passes it as ``setup``'s ``env=`` too.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return torch.distributed.is_available() and torch.distributed.is_initialized()


def resolve_accelerator(accelerator: str) -> str:
    """``"auto"`` | ``"cpu"`` | ``"cuda"`` -> the device type this run trains on.

    ``"cuda"`` on a machine without a usable GPU is a :class:`ConfigurationError`
    (never a silent CPU run).
    """
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigurationError(
            "accelerator", f"accelerator='cuda' but {why}", "use accelerator='cpu' or 'auto', or run on a GPU machine"
        )
    return accelerator


def world_from_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from the launcher's ``env://`` variables (defaults: one process)."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def device_for(accelerator: str, local_rank: int) -> torch.device:
    """The device of this process: ``cuda:LOCAL_RANK`` (made current) or the CPU."""
    if resolve_accelerator(accelerator) == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
