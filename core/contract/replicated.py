"""The public base of data-parallel strategies that keep whole parameters on every rank.

:class:`ReplicatedStrategy` is what ``ddp``, ``single``, ``torch_zero`` and the
fairscale OSS strategies build on, and what a third-party strategy imports
(``from unison.contract import ReplicatedStrategy``): subclass it, declare
:attr:`~unison.contract.strategy.Strategy.ownership`, and implement only what
differs (a wrapper in ``wrap_module``, a gradient all-reduce in ``backward`` or
``no_sync``). It gives ``setup`` (the base's template: module to the device,
optimizer over it), global-norm clipping, the canonical state and DCP
checkpoints in the layout every torch strategy shares, so checkpoints cross
backends. :data:`TRAINER_PRECISION` and :data:`DCP_FULL_STATE` are the
declarations such a strategy usually makes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from unison.contract.ownership import (
    STANDARD_PRECISIONS,
    PrecisionOwner,
    PrecisionSupport,
    StateDictDeclaration,
    StateDictKind,
)
from unison.contract.state import canonical, dcp_load, dcp_save
from unison.contract.strategy import Strategy

#: Every standard precision, applied by the trainer (autocast, GradScaler, module casts).
TRAINER_PRECISION = {
    "32-true": PrecisionSupport(PrecisionOwner.TRAINER, "fp32 parameters and compute"),
    "bf16-mixed": PrecisionSupport(PrecisionOwner.TRAINER, "torch.autocast(bfloat16) by the trainer"),
    "bf16-true": PrecisionSupport(PrecisionOwner.TRAINER, "module.to(bfloat16) and bf16 inputs by the trainer"),
    "16-mixed": PrecisionSupport(PrecisionOwner.TRAINER, "torch.autocast(float16) + GradScaler by the trainer"),
}
assert set(TRAINER_PRECISION) == set(STANDARD_PRECISIONS)

#: Whole replicas checkpointed with torch.distributed.checkpoint, reshardable to any world size.
DCP_FULL_STATE = StateDictDeclaration(
    kind=StateDictKind.FULL,
    format="torch.distributed.checkpoint (DCP), keys = module parameter names, optimizer state keyed by name",
    reshardable=True,
    canonical_export="module.state_dict() of the unwrapped module on every rank, cast to fp32, on CPU",
)


class ReplicatedStrategy(Strategy):
    """Every rank holds whole parameters and, at the boundary, whole, equal gradients.

    The subclass makes the gradients equal (a DDP wrapper, a hand-written
    all-reduce); clipping relies on it: the local norm is then the global one.
    """

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        assert self.module is not None
        # One walk over the module's parameters per step (it visits every submodule).
        params = [p for p in self.module.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        # Gradients are already synchronised, so the local norm is the global one.
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if max_norm is not None:
            # clip_grads_with_norm_ takes the parameters (it scales p.grad);
            # given the gradient tensors it finds no .grad and clips nothing.
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        assert self.module is not None
        # Every rank holds the whole model, so every rank returns it (no gather).
        return canonical(self.module.state_dict())

    def save_state(self, directory: Path) -> None:
        assert self.module is not None and self.optimizer is not None
        dcp_save(self.module, self.optimizer, directory)

    def load_state(self, directory: Path) -> None:
        assert self.module is not None and self.optimizer is not None
        dcp_load(self.module, self.optimizer, directory)
