"""State helpers shared by strategies and the trainer: DCP model/optimizer state and RNG.

torch strategies store model and optimizer with ``torch.distributed.checkpoint``
(DCP) through the ``torch.distributed.checkpoint.state_dict`` API: keys are the
module's own parameter names (no ``module.`` or FSDP prefixes), optimizer state
is keyed by those names too, and a checkpoint written at one world size loads
at another, or in a plain single process. That one format is what makes a
checkpoint from any torch backend resume under any other.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

# torch.distributed.checkpoint (and the DTensor machinery it pulls in, about a second) is imported
# by the functions that save or load: listing or describing strategies never needs it.


def _run_dcp(fn: Any, state: dict[str, Any], directory: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        # DCP warns on every single-process call that it assumes no process
        # group; that is exactly the intent for the single strategy.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            fn(state, checkpoint_id=str(directory))
        except CheckpointException as exc:
            # DCP wraps whatever interrupted it, Ctrl-C included; an interrupt
            # must stay an interrupt (exit 130, not a failed save with exit 1).
            if any(isinstance(failure[0], KeyboardInterrupt) for failure in exc.failures.values()):
                raise KeyboardInterrupt from None
            raise


def canonical(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU copies, floating tensors in fp32: the canonical form of a full state."""
    return {k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu().clone() for k, v in state.items()}


def _dcp_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    # Default options on purpose: every rank contributes what it holds (whole
    # tensors for replicated strategies, DTensor shards for FSDP) and DCP
    # de-duplicates and reshards. ``full_state_dict=True`` would hand the state
    # to rank 0 only and leave the other ranks unloaded on resume.
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {
        "model": get_model_state_dict(module),
        "optim": get_optimizer_state_dict(module, optimizer),
    }


def dcp_save(module: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Save model and optimizer with DCP (collective when a process group exists)."""
    import torch.distributed.checkpoint as dcp

    _run_dcp(dcp.save, _dcp_state(module, optimizer), directory)


def dcp_load(module: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Load what :func:`dcp_save` wrote, at any world size, into every rank (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = _dcp_state(module, optimizer)
    _run_dcp(dcp.load, state, directory)
    set_model_state_dict(module, state["model"])
    set_optimizer_state_dict(module, optimizer, state["optim"])


def rng_state() -> dict[str, Any]:
    """Every RNG the trainer's randomness can come from, for exact resume."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
