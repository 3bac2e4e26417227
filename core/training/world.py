"""The world a fit runs in: the process group, the control group, replicas made equal, the precision.

Runs once the checks of :mod:`unison.training.preflight` have passed, on
every rank: joins (or, for a distributed strategy in one process without a
launcher, makes) the process group, makes a CPU group for the loop's stop
decisions, broadcasts rank 0's weights when the strategy declares that the
trainer initialises replicas (:attr:`Ownership.replica_init
<unison.contract.ownership.Ownership.replica_init>`), and builds the
precision plugin for the rank's device as the strategy's declaration says.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from unison.contract.env import DistEnv, device_for, world_from_env
from unison.contract.ownership import PrecisionSupport
from unison.contract.precision import DelegatedPrecision, Precision
from unison.contract.settings import TrainerSettings
from unison.contract.strategy import Strategy
from unison.launch import messages
from unison.launch.lifecycle import init_process_group
from unison.plugin.manager import PluginManager

__all__ = ["World", "broadcast_module_state", "build_precision", "join_world"]


@dataclass(frozen=True)
class World:
    """This rank's place in the fit's world, and what ``fit`` must undo when it ends."""

    env: DistEnv
    #: ``fit`` made the process group (and destroys it at its end).
    owns_process_group: bool = False
    #: The CPU (gloo) group stop decisions travel on; ``None``: the default group (already gloo, or one rank).
    control_group: Any = None


def join_world(strategy: Strategy, settings: TrainerSettings, say: Callable[[str], None]) -> World:
    """The process group the strategy asks for (:meth:`Strategy.process_group_backend`), joined or made."""
    rank, world_size, local_rank = world_from_env()
    device = device_for(settings.accelerator, local_rank)
    backend = strategy.process_group_backend(device)
    dist = torch.distributed
    owns = False
    control_group = None
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    elif backend is not None:
        if "MASTER_ADDR" in os.environ:
            say(f"the process group ({backend}, world size {world_size}): waiting for every rank")
            init_process_group(backend)  # rendezvous fails in minutes, not the 10-minute default
            if world_size > 1:
                # Kept for the rest of the process (destroyed at exit), not destroyed when this fit ends: a
                # second fit in the same worker (a notebook, a hyper-parameter loop) joins it again. Made
                # anew, it would rendezvous again through torchrun's shared store, whose keys still hold the
                # first group's addresses (Gloo "Connection refused", or a hang).
                _keep_until_exit()
            else:
                owns = True  # one process: no peer to reconnect to; made and destroyed per fit, as before
        else:
            # A distributed strategy on one process without a launcher: a
            # real, private world of 1 (no network rendezvous needed), never silently.
            if settings.nproc is None:
                messages.say(
                    f"unison: strategy {settings.strategy!r} trains in 1 process: nothing launched more. "
                    "For N processes: Trainer(..., nproc=N), or `unison run --nproc N script.py`"
                )
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            owns = True  # a private world of 1: made and destroyed per fit
        rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        if dist.is_initialized() and world_size > 1:
            # Stop decisions travel on a CPU group: agreeing on them never
            # waits for the accelerator.
            control_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    except BaseException:
        if owns:  # fit never sees this world: undo the group made here
            dist.destroy_process_group()
        raise
    env = DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device)
    return World(env, owns, control_group)


_kept = False


def _keep_until_exit() -> None:
    """Destroy the launcher's process group at interpreter exit (once), after every fit of the process."""
    global _kept
    if not _kept:
        _kept = True
        atexit.register(_destroy_kept)


def _destroy_kept() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def build_precision(
    support: PrecisionSupport, settings: TrainerSettings, pm: PluginManager, strategy: Strategy, device: torch.device
) -> Precision:
    """The precision plugin when the trainer applies the precision; a :class:`DelegatedPrecision` otherwise.

    ``support`` is the strategy's declaration for ``settings.precision``, as preflight computed it
    (:attr:`unison.training.preflight.Declared.precision`; availability checked there too).
    """
    precision: Precision
    if support.applied_by_trainer:
        spec = pm.precisions.get(settings.precision)
        precision = spec.factory(device=device, grad_scaler=lambda: strategy.make_grad_scaler(device))
    else:
        precision = DelegatedPrecision(settings.precision)
    precision.support = support
    return precision


def broadcast_module_state(module: torch.nn.Module, src: int = 0) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s, in buckets of one dtype."""
    from unison._upstream.torch import flatten_dense_tensors, unflatten_dense_tensors

    tensors = [t.data for t in [*module.parameters(), *module.buffers()]]
    seen: set[int] = set()
    unique = []
    for t in tensors:  # tied weights once
        if id(t) not in seen:
            seen.add(id(t))
            unique.append(t)
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in unique:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    bucket_bytes = 64 << 20
    for group in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in [*group, None]:
            if t is not None:
                bucket.append(t)
                size += t.numel() * t.element_size()
            if bucket and (t is None or size >= bucket_bytes):
                flat = flatten_dense_tensors(bucket)
                torch.distributed.broadcast(flat, src=src)
                for dst, value in zip(bucket, unflatten_dense_tensors(flat, bucket)):
                    dst.copy_(value)
                bucket, size = [], 0
