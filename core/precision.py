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
from typing import Any, Callable, ContextManager

import torch


class Precision:
    """Base class: full fp32 behaviour. Subclasses override what they change."""

    #: The registered name, e.g. ``"bf16-mixed"``.
    name: str = "32-true"

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def convert_input(self, data: Any) -> Any:
        return data

    def forward_context(self) -> ContextManager[Any]:
        # fp32 has nothing to enter; subclasses return autocast.
        return contextlib.nullcontext()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def step(self, optimizer_step: Callable[[], bool], optimizer: torch.optim.Optimizer, grad_norm: float) -> bool:
        """Run ``optimizer_step`` unless this precision skips it; return ``skipped``.

        ``grad_norm`` is the global, unscaled norm the strategy measured, so a
        loss-scaling precision decides on the same number on every rank.
        ``optimizer_step`` returns ``True`` when the strategy's engine skipped.
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
    """Cast every floating-point tensor in a (nested) batch to ``dtype``."""
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if data.is_floating_point() else data
    if isinstance(data, (list, tuple)):
        return type(data)(cast_floating(d, dtype) for d in data)
    if isinstance(data, dict):
        return {k: cast_floating(v, dtype) for k, v in data.items()}
    return data
