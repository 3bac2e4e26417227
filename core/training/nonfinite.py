"""``nonfinite="raise"`` without a host synchronisation per step: the check is read one step late.

Whether a step was finite (its global grad norm and replica-averaged losses,
the same on every rank) is computed on the device. Reading it at once, before
the optimizer step, would make every step wait for the device (on CUDA, a
stream synchronisation that drains the launch queue). Instead the flag is
copied to pinned host memory without blocking (:meth:`NonFiniteCheck.record`)
and read by :meth:`NonFiniteCheck.resolve`:

* in the next step, once its forward and backward are queued (on CUDA it
  waits on the previous step's event only: the device stays busy with the
  queued step, and the host runs at most one step ahead of it);
* before anything that would keep or show the step's weights: a logging
  step's metrics, validation, every checkpoint save (``Trainer.save_checkpoint``)
  and the end of the loop, where the step blocks anyway.

So a non-finite step k raises :class:`NonFiniteError` naming step k, on every
rank at the same point, and no checkpoint ever holds weights it produced. What
the lag changes: step k's optimizer and scheduler steps have run (in memory
only), so ``progress.global_step`` and ``optimizer_steps`` count it, and the
hooks of step k (``before_optimizer_step`` … ``train_step_end``) have fired.

``nonfinite="skip"`` cannot be read late: whether to skip must be known on
the host before ``optimizer.step()`` runs (an arbitrary optimizer cannot be
masked on the device), so it costs one device-to-host read per step, as the
``16-mixed`` loss scaler's skip decision does (:meth:`TrainLoop.train_step`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from unison.contract.outputs import NonFiniteError

if TYPE_CHECKING:
    from unison.contract.env import DistEnv
    from unison.training.stopping import StopAgreement

__all__ = ["NonFiniteCheck"]


class NonFiniteCheck:
    """The lagged ``raise`` decision of one fit in the world ``env`` (``control_group``: where the error's
    per-rank gather runs)."""

    def __init__(self, env: DistEnv, stop: StopAgreement, control_group: Any) -> None:
        self.env, self.stop, self.control_group = env, stop, control_group
        self._host: torch.Tensor | None = None  # the pinned host copy of the flag (CUDA)
        #: ``(step, host flag, event, local losses, grad norm)`` of the recorded step, until resolved.
        self._pending: tuple[int, torch.Tensor, Any, torch.Tensor, torch.Tensor] | None = None

    def record(self, step: int, finite: torch.Tensor, local: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Start the flag's way to the host without waiting; the previous step's must be resolved first."""
        assert self._pending is None, "resolve() the previous step's flag before recording the next"
        event = None
        if finite.is_cuda:
            if self._host is None:
                self._host = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._host.copy_(finite, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            host = self._host
        elif finite.device.type == "cpu":
            host = finite
        else:  # another accelerator: a blocking copy
            host = finite.to("cpu")
        self._pending = (step, host, event, local, grad_norm)

    def resolve(self) -> None:
        """Read the recorded step's flag (waiting for that step's work only) and raise if it was not finite."""
        if self._pending is None:
            return
        step, host, event, local, grad_norm = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        if not bool(host):
            self.raise_nonfinite(step, local, grad_norm)

    def raise_nonfinite(self, step: int, local: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Raise on every rank, naming the first micro-batch and rank whose loss was non-finite."""
        env = self.env
        flags = [bool(torch.isfinite(v)) for v in local.cpu()]
        per_rank: list[Any] = [flags]
        if env.distributed and env.world_size > 1:
            self.stop.collect()  # no stop agreement in flight on the control group while this gather runs
            per_rank = [None] * env.world_size
            torch.distributed.all_gather_object(per_rank, flags, group=self.control_group)
        where = next(
            (f"micro-batch {m} on rank {r}" for m in range(len(flags)) for r, f in enumerate(per_rank) if not f[m]),
            None,
        )
        what = (
            f"the loss was non-finite first at {where}"
            if where is not None
            else f"the losses were finite but the global grad norm is {float(grad_norm)}"
        )
        raise NonFiniteError(
            f"step {step}: {what}; no checkpoint holds weights from it. Fix: check the data and the loss for NaN/inf "
            "(or pass nonfinite='skip' to skip such steps, or 'continue' to train on)"
        )
