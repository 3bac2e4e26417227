"""Deliberately wrong strategies and plugins for the workload scenarios, a plugin module the suite registers.

Each is ``ddp`` (correct) with exactly one defect that only the ``token_loss``, ``default_plugins`` or
``fresh_resume`` scenarios can see; ``ddp`` itself is the control and must be certified.

* ``misstates_replica_reduction``: declares ``LossNormalisation(replicas=Reduction.SUM)`` while
  DistributedDataParallel averages the replicas' gradients. Scalar losses never read the declaration; the
  ``(loss_sum, num_items)`` pair is scaled from it, so its gradients end 1/world size of the reference's.
* ``callback_draws_rng``: ``ddp`` with a callback (registered for it through ``unison_default_plugins``) that
  picks a random sample of steps to log with ``torch.rand``, from the global generator: it shifts every
  dropout mask after it. The suite's runs set ``UNISON_CHECK_PLUGIN_RNG=1``, so its hook raises.
* ``once_per_process_draw``: ``ddp`` that draws from the global generator once per process, at the first
  backward the process runs (a lazily built random projection, cached per process, as the MFU probe once
  did). In the process that saved, the draw happened long before; after a restart it happens again, after
  the checkpoint's RNG states were restored: only a resume in new processes (``fresh_resume``) sees it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import unison
from unison import Ownership, StrategySpec
from unison.contract.ownership import LossNormalisation, Reduction
from unison.strategies.ddp import DDPStrategy


class MisstatesReplicaReduction(DDPStrategy):
    """DDP whose declaration says the replicas' gradients are summed; DistributedDataParallel averages them."""

    @property
    def ownership(self) -> Ownership:
        return dataclasses.replace(
            super().ownership,
            loss_normalisation=LossNormalisation(replicas=Reduction.SUM, over="the data-parallel replicas (summed)"),
        )


class CallbackDrawsRng(DDPStrategy):
    """Correct DDP; the module registers :class:`SampledLogging` for it (see :func:`unison_default_plugins`)."""


class SampledLogging:
    """Logs a random tenth of the steps: the draw comes from the global generator (the defect)."""

    @unison.hookimpl
    def unison_on_train_step_end(self, step: int, output: Any) -> None:
        if float(torch.rand(())) < 0.1:
            pass  # a logger would write here


#: Whether this process has drawn yet (once per process, like a cached probe).
_DRAWN = False


class OncePerProcessDraw(DDPStrategy):
    """DDP whose first backward in each process draws from the global generator (a cached random projection)."""

    def backward(self, loss: torch.Tensor) -> None:
        global _DRAWN
        if not _DRAWN:
            _DRAWN = True
            torch.randn(4, 4)  # the defect: the global generator, once per process
        super().backward(loss)


BROKEN = {
    "misstates_replica_reduction": (
        MisstatesReplicaReduction,
        "declares its replicas' gradients summed (LossNormalisation replicas=sum); DDP averages them",
    ),
    "callback_draws_rng": (CallbackDrawsRng, "ddp with a callback that draws from the global RNG"),
    "once_per_process_draw": (OncePerProcessDraw, "ddp drawing from the global RNG once per process"),
}


@unison.hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [StrategySpec(name=name, factory=cls, description=text) for name, (cls, text) in BROKEN.items()]


@unison.hookimpl
def unison_default_plugins(settings: Any, plugins: list[Any]) -> list[Any]:
    """The sampled-logging callback, for ``callback_draws_rng`` only."""
    return [SampledLogging()] if settings.strategy == "callback_draws_rng" else []
