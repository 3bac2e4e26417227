"""Deliberately wrong precision handling, a plugin module the precision conformance tests register by name.

Both are the plain data parallel of :mod:`conformance_broken_strategies` and
declare bf16-mixed supported, applied by their own engine (so the trainer
enters no autocast and leaves the precision to them):

* ``trains_fp32`` never applies it: the forward, the gradients and the update
  all stay in fp32 (a precision option read but never wired to the engine);
* ``bf16_no_masters`` casts the module to bf16 and steps the bf16 weights
  directly, with no fp32 master weights: every update below half a bf16 spacing
  of a weight is lost.

The conformance suite must refuse to certify both and name the cause
(``precision_not_applied``); ``ddp`` is the control.
"""

from __future__ import annotations

from typing import Any

import torch
from conformance_broken_strategies import _DataParallel

import unison
from unison import (
    AccumulationOwner,
    GradAccumulation,
    Ownership,
    PrecisionOwner,
    PrecisionSupport,
    StateDictDeclaration,
    StateDictKind,
    StrategySpec,
)

_PRECISION = {
    "32-true": PrecisionSupport(PrecisionOwner.TRAINER, "fp32"),
    "bf16-mixed": PrecisionSupport(
        PrecisionOwner.ENGINE, "the engine computes in bfloat16 and keeps fp32 master weights"
    ),
    "16-mixed": PrecisionSupport.unsupported("not implemented"),
    "bf16-true": PrecisionSupport.unsupported("not implemented"),
}


class _EngineBf16(_DataParallel):
    @property
    def ownership(self) -> Ownership:
        return Ownership(
            grad_accumulation=GradAccumulation(AccumulationOwner.TRAINER, "no_sync() defers one flattened all-reduce"),
            precision=_PRECISION,
            state_dict=StateDictDeclaration(StateDictKind.FULL, "DCP", True, "module.state_dict()"),
            replica_init=self.replica_init,
        )


class TrainsFp32(_EngineBf16):
    """Declares its engine applies bf16-mixed, but nothing ever does: it trains in fp32."""


class Bf16NoMasters(_EngineBf16):
    """Casts the module to bf16 and lets the optimizer step the bf16 weights (no fp32 masters)."""

    def configure_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module = super().configure_module(module)
        return module.to(torch.bfloat16) if self.precision.name == "bf16-mixed" else module

    def wrap_module(self, module: torch.nn.Module) -> Any:
        bf16 = self.precision.name == "bf16-mixed"

        def forward(inputs: torch.Tensor) -> torch.Tensor:
            return module(inputs.to(torch.bfloat16) if bf16 else inputs)

        return forward


BROKEN = {
    "trains_fp32": (TrainsFp32, "declares bf16-mixed applied by its engine, trains in fp32"),
    "bf16_no_masters": (Bf16NoMasters, "declares bf16-mixed, steps bf16 weights with no fp32 masters"),
}


@unison.hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [StrategySpec(name=name, factory=cls, description=text) for name, (cls, text) in BROKEN.items()]
