"""Deliberately wrong optimizer-side state on resume, a plugin module the conformance tests register by name.

Like :mod:`conformance_broken_strategies` (whose correct data-parallel strategy these reuse), each
strategy has exactly one defect; ``restores_scaler`` is the correct control and must be certified.

* ``forgets_scaler_state``: the fp16 loss scaler it supplies (``Strategy.make_grad_scaler``: a sharded
  strategy supplies its own) ignores the checkpoint's state, so a resumed run starts again from
  GradScaler's initial scale (2**16) and growth tracker (0). The ``resume_fp16`` scenario must see it.
"""

from __future__ import annotations

from typing import Any

import torch
from conformance_broken_strategies import _DataParallel

import unison
from unison import StrategySpec


class _ScalerWithoutState(torch.amp.GradScaler):
    """A GradScaler whose ``load_state_dict`` keeps its own (initial) scale and growth tracker."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class ForgetsScalerState(_DataParallel):
    """Correct data parallel whose loss scaler does not restore its state on resume."""

    def make_grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        return _ScalerWithoutState(device.type)


class RestoresScaler(_DataParallel):
    """The control: the same data parallel with torch's own GradScaler (certified)."""


BROKEN = {
    "forgets_scaler_state": (ForgetsScalerState, "its fp16 loss scaler ignores the checkpoint's scale on resume"),
    "restores_scaler": (RestoresScaler, "correct; torch's GradScaler restores scale and growth tracker"),
}


@unison.hookimpl
def unison_strategies() -> list[StrategySpec]:
    return [StrategySpec(name=name, factory=cls, description=text) for name, (cls, text) in BROKEN.items()]
