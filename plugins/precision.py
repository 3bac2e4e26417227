"""Built-in precisions applied by the trainer: torch autocast, GradScaler, casts.

Used only where a strategy declares the precision applied by the ``trainer``;
engines and sharding policies apply their own (see each strategy's declaration).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from unison.contract.precision import Precision, cast_floating
from unison.plugin import hookimpl
from unison.plugin.registry import PrecisionSpec


class AutocastPrecision(Precision):
    """``torch.autocast`` around forward and loss; parameters stay fp32.

    With ``float16`` a :class:`torch.amp.GradScaler` (from the strategy, so
    sharded strategies reduce the overflow flag over shards) scales the loss;
    an overflow skips the optimizer step and backs the scale off.
    """

    def __init__(
        self,
        name: str,
        dtype: torch.dtype,
        device: torch.device,
        grad_scaler: Callable[[], torch.amp.GradScaler] | None,
    ) -> None:
        self.name, self.dtype, self.device = name, dtype, device
        self.scaler = grad_scaler() if grad_scaler is not None else None

    def forward_context(self) -> AbstractContextManager[Any]:
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    @property
    def skips_overflow(self) -> bool:  # type: ignore[override]  # a property over the base's class attribute
        return self.scaler is not None

    def step(self, optimizer_step: Callable[[], bool], optimizer: torch.optim.Optimizer, finite: bool) -> bool:
        if self.scaler is None:
            return bool(optimizer_step())
        # unscale_ recorded the overflow flag that update() reads; the global
        # norm is non-finite exactly when some shard overflowed.
        skipped = not finite
        if not skipped:
            skipped = bool(optimizer_step())
        self.scaler.update()
        return skipped

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


class TruePrecision(Precision):
    """Parameters, gradients, optimizer state and inputs all in ``dtype``."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(self.dtype)

    def convert_input(self, data: Any) -> Any:
        return cast_floating(data, self.dtype)


@hookimpl
def unison_precisions() -> list[PrecisionSpec]:
    return [
        PrecisionSpec("32-true", lambda device, grad_scaler: Precision(), "fp32 everywhere"),
        PrecisionSpec(
            "bf16-mixed",
            lambda device, grad_scaler: AutocastPrecision("bf16-mixed", torch.bfloat16, device, None),
            "torch.autocast(bfloat16); fp32 parameters; no loss scaling",
        ),
        PrecisionSpec(
            "16-mixed",
            lambda device, grad_scaler: AutocastPrecision("16-mixed", torch.float16, device, grad_scaler),
            "torch.autocast(float16) + GradScaler; overflow skips the step",
        ),
        PrecisionSpec(
            "bf16-true",
            lambda device, grad_scaler: TruePrecision("bf16-true", torch.bfloat16),
            "model, gradients, optimizer state and inputs in bfloat16",
        ),
    ]
