"""Validation: when a fit validates, and the validation loop itself.

The :class:`Validator` owns its policy, so the training loop only asks it:
:meth:`Validator.should_validate` after each step (every
``val_every_n_steps``), and :meth:`Validator.should_validate_at_end` once
after the last step (always, unless that step just validated). Both need a
``val_dataset``. :meth:`Validator.validate` computes the mean loss over every
validation sample once, weighted by samples and reduced over data-parallel
replicas, so every rank and every backend reports the same number; a
``(loss_sum, num_items)`` loss is the global sum over the global item count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from unison.contract.settings import TrainerSettings
from unison.data.sources import is_map_style, resolve_source
from unison.data.validation import validation_stream
from unison.errors import ConfigurationError
from unison.training.losses import loss_value

if TYPE_CHECKING:
    from unison.contract.precision import Precision
    from unison.training.metrics import MetricsLog
    from unison.training.preflight import FitPlan
    from unison.training.trainer import Trainer

#: A resolved validation set: ``(source, collate_fn, loader options)``.
ValidationSource = tuple[Any, Any, Any]

__all__ = ["ValidationSource", "Validator", "resolve_validation"]


def resolve_validation(val_dataset: Any, collate_fn: Any, settings: TrainerSettings) -> ValidationSource:
    """``val_dataset`` as the loader reads it; an empty one is refused (before any process group)."""
    source, collate, options = resolve_source(val_dataset, collate_fn, settings, what="val_dataset")
    empty = len(source) == 0 if is_map_style(source) else next(iter(source), None) is None
    if empty:
        raise ConfigurationError(
            "val_dataset", "the validation dataset is empty", "pass a non-empty val_dataset, or none"
        )
    return source, collate, options


class Validator:
    """Validates the fit's model on its ``val_dataset`` (or another dataset on request).

    Created by ``fit`` once the strategy is set up, from the fit's values:
    its plan (settings, strategy, loss form, data layout: replicas, this
    rank), the precision built for the device and the world's device.
    ``trainer`` is what the validation hooks receive and where the documented
    result, ``last_validation``, is kept; the metrics go to the loggers
    through ``metrics``.
    """

    def __init__(
        self,
        trainer: Trainer,
        plan: FitPlan,
        precision: Precision,
        device: torch.device,
        metrics: MetricsLog,
    ) -> None:
        self._trainer = trainer
        self._plan, self._precision, self._device = plan, precision, device
        self._metrics = metrics
        self._source = plan.validation
        self._every_n_steps = plan.settings.val_every_n_steps
        #: The step the loop last validated at (``None``: not yet in this fit).
        self.last_validated: int | None = None

    def should_validate(self, step: int) -> bool:
        """Whether the loop validates after ``step`` optimizer steps (``val_every_n_steps``)."""
        every = self._every_n_steps
        if not every:
            return False
        return self._source is not None and step % every == 0

    def should_validate_at_end(self, step: int) -> bool:
        """Whether ``fit`` validates after its last step ``step``: always with a val_dataset, unless just done."""
        return self._source is not None and self.last_validated != step

    @torch.no_grad()
    def validate(self, dataset: Any = None) -> dict[str, float]:
        """Mean loss over the validation set (every sample once, reduced over replicas); on every rank.

        ``dataset`` replaces the fit's ``val_dataset`` for this call.
        """
        trainer, plan, precision = self._trainer, self._plan, self._precision
        s, strategy, data = plan.settings, plan.strategy, plan.data
        resolved = resolve_validation(dataset, None, s) if dataset is not None else self._source
        assert resolved is not None, "validate() needs a val_dataset (given to fit or here)"
        source, collate, options = resolved
        step = trainer.progress.global_step
        trainer.pm.unison_on_validation_start(trainer=trainer, step=step)
        model = strategy.module
        assert model is not None
        was_training = model.training
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self._device)
        per_forward = s.val_batch_size * data.replicas
        num_batches = -(-len(source) // per_forward) if is_map_style(source) else None  # for progress displays
        stream = validation_stream(source, collate, s.val_batch_size, data.replicas, data.rank, options, s.seed)
        for i, (batch, weight) in enumerate(stream):
            batch = strategy.to_device(batch)
            with precision.forward_context():
                if plan.training_step is not None:
                    value = loss_value(
                        plan.training_step(strategy.model, precision.convert_input(batch)), "training_step"
                    )
                else:
                    inputs, targets = batch
                    assert plan.loss_fn is not None  # checked before the fit: one batch form or the other
                    value = loss_value(
                        strategy.eval_loss(precision.convert_input(inputs), targets, plan.loss_fn), "loss_fn"
                    )
            if value.items is None:  # a mean over the batch's real samples: weighted by them
                part = [value.loss.detach().double() * weight, torch.full((), float(weight), device=total.device)]
            else:  # a sum over items: the global sum over the global items (a stand-in batch counts nothing)
                part = [value.loss.detach().double() * (weight > 0), value.items.to(total.device) * (weight > 0)]
            total += torch.stack([t.to(device=total.device, dtype=torch.float64) for t in part])
            trainer.pm.unison_validation_progress(trainer=trainer, step=step, batch_idx=i, num_batches=num_batches)
        model.train(was_training)
        total = strategy.reduce_sum(total)
        metrics = {"val/loss": float(total[0] / total[1].clamp(min=1))}
        trainer.last_validation = metrics
        trainer.pm.unison_on_validation_end(trainer=trainer, step=step, metrics=metrics)
        self._metrics.emit(metrics)
        return metrics
