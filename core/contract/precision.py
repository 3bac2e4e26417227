"""The precision contract the trainer drives when it applies a precision.

When a strategy declares a precision applied by the ``trainer`` (or a
``plugin``), the trainer builds the registered :class:`Precision` of that name
and calls it at fixed points of every step:

=====================  =====================================================
``convert_module``     once, before the strategy wraps the model
``convert_input``      on each micro-batch's inputs
``forward_context``    around each micro-batch's forward and loss
``scale_loss``         on each micro-batch's loss before backward
``unscale_gradients``  once per optimizer step, before clipping
``step``               once per optimizer step, with the global grad norm;
                       returns whether the update was skipped
=====================  =====================================================

When the engine or a sharding policy applies the precision, the trainer uses
:class:`DelegatedPrecision`, which does nothing on purpose: the strategy has
already configured its engine or policy for that precision in ``setup``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from unison.contract.ownership import PrecisionSupport


class Precision:
    """Base class: full fp32 behaviour. Subclasses override what they change.

    The trainer hands strategies one precision object; they read
    :attr:`name` and :attr:`support` (the strategy's own declaration for that
    name) and nothing else about precision.
    """

    #: The registered name, e.g. ``"bf16-mixed"``.
    name: str = "32-true"
    #: The strategy's declared support for :attr:`name` (set by the trainer).
    support: PrecisionSupport | None = None

    @property
    def applied_by_trainer(self) -> bool:
        """Whether the trainer applies this precision (autocast, scaler, casts) rather than the backend."""
        return self.support is None or self.support.applied_by_trainer

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def convert_input(self, data: Any) -> Any:
        return data

    def forward_context(self) -> AbstractContextManager[Any]:
        # fp32 has nothing to enter; subclasses return autocast.
        return contextlib.nullcontext()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    #: Whether this precision skips steps whose gradients overflowed (loss scaling).
    skips_overflow: bool = False

    def step(self, optimizer_step: Callable[[], bool], optimizer: torch.optim.Optimizer, finite: bool) -> bool:
        """Run ``optimizer_step`` unless this precision skips it; return ``skipped``.

        ``finite`` says whether the global, unscaled grad norm the strategy
        measured is finite (the same answer on every rank), so a loss-scaling
        precision skips the same steps everywhere. ``optimizer_step`` returns
        ``True`` when the strategy's engine skipped.
        """
        return bool(optimizer_step())

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class DelegatedPrecision(Precision):
    """Used when the engine or a sharding policy owns the precision.

    Every method is the identity: the strategy applied the precision in its
    own setup (DeepSpeed config, FSDP ``MixedPrecisionPolicy``).
    """

    def __init__(self, name: str) -> None:
        self.name = name


def cast_floating(data: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor of a batch of any structure to ``dtype``; integer leaves (token ids) stay."""
    from unison.contract.tensors import map_tensors

    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, data)
