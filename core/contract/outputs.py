"""What training reports: :class:`StepOutput` per optimizer step, :class:`Progress` per fit, and
:class:`NonFiniteError`.

These are values, free of the loop that fills them, so callbacks, loggers
and the conformance suite read them without touching the trainer's internals; they sit in the
contract, below the plugin system whose hooks receive them and the loop that fills them
(:mod:`unison.training.outputs` gives the same names).
:class:`Progress` is also the step counters a checkpoint holds: it is
``Stateful`` (``state_dict``/``load_state_dict``) and handed to the fit's
:class:`~unison.training.checkpointing.CheckpointManager` as such.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from unison.errors import UnisonError

#: Steps kept in :attr:`Progress.history` (a bounded window; never saved in checkpoints).
HISTORY_LENGTH = 1000

__all__ = ["HISTORY_LENGTH", "NonFiniteError", "Progress", "StepOutput"]


class NonFiniteError(UnisonError, FloatingPointError):
    """The loss or the global grad norm was not finite (raised on every rank at the same step)."""


class StepOutput:
    """What one optimizer step produced; the same numbers on every rank and every backend.

    Values live on the rank's device until read: ``loss``, ``micro_losses``,
    ``grad_norm`` and ``tokens`` materialise (one device-to-host read) on first
    access, so a step nobody looks at costs no synchronisation. The ``*_tensor``
    attributes give the device values. Also readable as a mapping
    (``output["loss"]``; ``"lr"`` is the first group's learning rate).
    """

    def __init__(
        self,
        step: int,
        micro_losses: torch.Tensor,
        grad_norm: torch.Tensor,
        lrs: list[float],
        skipped: bool,
        samples: int,
        tokens: torch.Tensor | None,
        items: torch.Tensor | None = None,
    ) -> None:
        self.step = step
        #: Every micro-batch's loss over the data-parallel replicas (device tensor): the mean of the replicas'
        #: means, or for a ``(loss_sum, num_items)`` loss the micro-batch's summed loss over its items.
        self.micro_loss_tensor = micro_losses
        #: For a ``(loss_sum, num_items)`` loss: every micro-batch's item count over the replicas (device
        #: tensor); ``None`` for a mean loss.
        self.items_tensor = items
        #: The global pre-clip L2 grad norm (0-dim device tensor).
        self.grad_norm_tensor = grad_norm
        #: Every parameter group's learning rate used by this step.
        self.lrs = lrs
        #: Whether the optimizer update (and the scheduler step) was skipped.
        self.skipped = skipped
        #: Samples in the global batch.
        self.samples = samples
        self._tokens = tokens
        self._cache: dict[str, Any] = {}

    @property
    def loss_tensor(self) -> torch.Tensor:
        """The global batch's loss (0-dim device tensor): the mean over micro-batches, or the sum over items."""
        if self.items_tensor is None:
            return self.micro_loss_tensor.mean()
        total = self.items_tensor.sum()
        # Negative items: a schedule's mark for a mean loss (decided on the device, see TrainLoop._normalise).
        weighted = (self.micro_loss_tensor * self.items_tensor).sum() / total.clamp(min=1)
        return torch.where(total < 0, self.micro_loss_tensor.mean(), weighted)

    @property
    def micro_losses(self) -> list[float]:
        if "micro" not in self._cache:
            self._cache["micro"] = self.micro_loss_tensor.tolist()
        return self._cache["micro"]

    @property
    def loss(self) -> float:
        """The global batch's loss: what the step trained on (for a pair, its summed loss over its items)."""
        micro = self.micro_losses
        if self.items_tensor is None:
            return sum(micro) / len(micro)
        if "loss" not in self._cache:
            self._cache["loss"] = float(self.loss_tensor)
        return self._cache["loss"]

    @property
    def num_items(self) -> int | None:
        """For a ``(loss_sum, num_items)`` loss, the global batch's item count the step was normalised by."""
        if self.items_tensor is None:
            return None
        if "items" not in self._cache:
            total = int(self.items_tensor.sum())
            self._cache["items"] = total if total >= 0 else None  # negative: a mean loss (see loss_tensor)
        return self._cache["items"]

    @property
    def grad_norm(self) -> float:
        if "norm" not in self._cache:
            self._cache["norm"] = float(self.grad_norm_tensor)
        return self._cache["norm"]

    @property
    def tokens(self) -> int | None:
        """Tokens in the global batch, all ranks (``None`` when the batch does not say)."""
        if self._tokens is None:
            return None
        if "tokens" not in self._cache:
            tokens = int(self._tokens)
            self._cache["tokens"] = tokens if tokens >= 0 else None  # negative: the batches did not say
        return self._cache["tokens"]

    _KEYS = ("step", "loss", "micro_losses", "grad_norm", "lr", "lrs", "skipped", "samples", "tokens", "num_items")

    def __getitem__(self, key: str) -> Any:
        if key == "lr":
            return self.lrs[0]
        if key not in self._KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def keys(self) -> tuple[str, ...]:
        return self._KEYS

    def as_dict(self) -> dict[str, Any]:
        return {k: self[k] for k in self._KEYS}

    def __repr__(self) -> str:
        return f"StepOutput(step={self.step}, skipped={self.skipped}, samples={self.samples})"


@dataclass
class Progress:
    """Where training stands: ``trainer.progress``, and what :meth:`Trainer.fit` returns.

    The step counters are saved in checkpoints and restored on resume;
    ``metrics``, ``checkpoint`` and ``run_dir`` describe the fit that
    returned (on every rank; file loggers write rank 0's metrics).
    """

    global_step: int = 0
    """Optimizer steps attempted (global batches consumed)."""
    optimizer_steps: int = 0
    """Optimizer updates that happened (a skipped step is not one)."""
    scheduler_steps: int = 0
    skipped_steps: int = 0
    """Steps skipped (fp16 overflow, or a non-finite step under ``nonfinite='skip'``)."""
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY_LENGTH), repr=False, compare=False)
    """The last steps' :class:`StepOutput` values (bounded; not saved in checkpoints)."""
    metrics: dict[str, Any] = field(default_factory=dict, compare=False)
    """The latest value of every metric sent to the loggers (``train/loss``, ``val/loss``, throughput, yours)."""
    checkpoint: str | None = field(default=None, compare=False)
    """The newest checkpoint committed when ``fit`` returned (``None`` without checkpoints)."""
    run_dir: str | None = field(default=None, compare=False)
    """This fit's ``root_dir/version_N``; without a ``root_dir``, the directory its file loggers wrote
    (the default ``runs/NAME/version_N``) on global rank 0, else ``None``."""

    def state_dict(self) -> dict[str, int]:
        return {
            "global_step": self.global_step,
            "optimizer_steps": self.optimizer_steps,
            "scheduler_steps": self.scheduler_steps,
            "skipped_steps": self.skipped_steps,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Progress:
        return cls(
            global_step=int(state.get("global_step", 0)),
            optimizer_steps=int(state.get("optimizer_steps", 0)),
            scheduler_steps=int(state.get("scheduler_steps", 0)),
            skipped_steps=int(state.get("skipped_steps", 0)),
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the step counters from a checkpoint (``metrics``, ``history`` and the paths stay as they are)."""
        restored = Progress.from_state(state)
        self.global_step, self.optimizer_steps = restored.global_step, restored.optimizer_steps
        self.scheduler_steps, self.skipped_steps = restored.scheduler_steps, restored.skipped_steps
