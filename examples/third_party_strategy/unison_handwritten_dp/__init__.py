"""Hand-written data parallel as a third-party strategy plugin (plugin API 2.0, public API only): the base
:class:`unison.contract.ReplicatedStrategy` gives setup, clipping and checkpoints; each class writes its all-reduce."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import unison
from unison import AccumulationOwner, ConfigurationError, GradAccumulation, GradSync, Ownership, PrecisionSupport
from unison.contract import DCP_FULL_STATE, TRAINER_PRECISION, ReplicatedStrategy

#: bf16-true refused: gradients are summed across ranks in their own dtype, and bf16 sums lose the low bits.
_PRECISION = {**TRAINER_PRECISION, "bf16-true": PrecisionSupport.unsupported("bf16 sums lose bits; use bf16-mixed")}


def _all_reduce_mean(grads: list[torch.Tensor], passes: int = 1) -> list[torch.Tensor]:
    """``grads`` summed over ranks in one flattened buffer, divided by the world size ``passes`` times."""
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size() ** passes)
    return _unflatten_dense_tensors(flat, grads)


def _ownership(how: str, sync: GradSync = GradSync.BOUNDARY) -> Ownership:
    """Trainer-owned accumulation synchronised as ``how`` says; trainer precisions; whole-replica DCP state."""
    return Ownership(GradAccumulation(AccumulationOwner.TRAINER, how, sync=sync), _PRECISION, DCP_FULL_STATE)


class HandwrittenDataParallel(ReplicatedStrategy):
    """Whole model on every rank; the trainer enters :meth:`no_sync` on every micro-step but the last,
    so gradients add up locally and are averaged across ranks once per optimizer step."""

    api_version = "2.0"
    #: How many times the all-reduced gradients are divided by the world size.
    averaging_passes = 1
    _sync = True

    @property
    def ownership(self) -> Ownership:
        return _ownership(
            "no_sync() defers the all-reduce; backward() of the boundary micro-batch all-reduces every "
            "gradient in one flattened buffer and divides by the world size"
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if self._sync and self.env.distributed and grads:
            for g, reduced in zip(grads, _all_reduce_mean(grads, self.averaging_passes)):
                g.copy_(reduced)


class DoubleAveragingDataParallel(HandwrittenDataParallel):
    """Deliberately wrong, so the suite can be seen failing: gradients averaged twice, and ``validate``
    refuses ``bf16-true`` although the declaration supports it (a declaration that lies)."""

    averaging_passes = 2

    @property
    def ownership(self) -> Ownership:
        return dataclasses.replace(super().ownership, precision=TRAINER_PRECISION)

    def validate(self, settings: Any, world_size: int) -> None:
        if settings.precision == "bf16-true":
            raise ConfigurationError("precision", "bf16-true is not implemented", "use bf16-mixed")


class EveryMicroStepDataParallel(ReplicatedStrategy):
    """Averages each micro-batch's gradient over ranks, then adds it to ``param.grad`` (averaging is linear:
    the same numbers). No ``no_sync()``: it declares ``GradSync.EVERY_MICRO_STEP``, so the trainer enters none."""

    api_version = "2.0"

    @property
    def ownership(self) -> Ownership:
        return _ownership(
            "backward() of every micro-batch all-reduces (mean) that micro-batch's gradient in one flattened "
            "buffer and adds it to the accumulated gradient",
            sync=GradSync.EVERY_MICRO_STEP,
        )

    def backward(self, loss: torch.Tensor) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not self.env.distributed:
            return loss.backward()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        pairs = [(p, g) for p, g in zip(params, grads) if g is not None]
        for (p, _), reduced in zip(pairs, _all_reduce_mean([g for _, g in pairs])):
            p.grad = reduced.clone() if p.grad is None else p.grad.add_(reduced)


_SPECS = {
    "handwritten_dp": (HandwrittenDataParallel, "hand-written data parallel: one flattened all-reduce per step"),
    "handwritten_dp_double_avg": (DoubleAveragingDataParallel, "deliberately wrong: averages gradients twice"),
    "handwritten_dp_every_step": (EveryMicroStepDataParallel, "hand-written data parallel, all-reduce per micro-step"),
}


@unison.hookimpl
def unison_strategies() -> list[unison.StrategySpec]:
    return [unison.StrategySpec(name, cls, text) for name, (cls, text) in _SPECS.items()]
