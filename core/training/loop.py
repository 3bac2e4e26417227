"""The training loop: optimizer steps until the data, ``max_steps`` or an agreed stop ends it.

One step (:meth:`TrainLoop.train_step`): the micro-batches' forward and
backward, fed as the strategy's accumulation declaration says
(:meth:`TrainLoop.forward_backward`, the one place that reads it), the
losses reduced over replicas, gradients unscaled and clipped by the global
norm, the non-finite check, the optimizer and scheduler steps. After each
step the loop logs, asks the :class:`~unison.training.validation.Validator`
and the :class:`~unison.training.checkpointing.CheckpointManager` whether to
validate and save, and every rank agrees whether to stop
(:class:`~unison.training.stopping.StopAgreement`: started after one step,
waited for after the next, so in a world a stop takes effect one step later,
or at once on a step that validates or saves; on the CPU, where the step's loss
all-reduce spans the world, the flags ride in the next step's loss all-reduce).
Hooks fire with the trainer, in the order :mod:`unison.plugin.hookspecs`
documents. Inside a profile, the strategy's sync points (``no_sync``, each
micro-step's ``backward``, ``clip_grad_norm``, an engine's boundary answers)
are marked with the ranges of :mod:`unison.training.marks`.

A step that logs nothing reads nothing from the device in fp32 and bf16 with
``nonfinite="raise"`` or ``"continue"``: the ``raise`` check is read one step
late (:class:`~unison.training.nonfinite.NonFiniteCheck`). ``"skip"`` and a
loss-scaling precision read one value per step: the skip decision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from unison.contract.env import DistEnv
from unison.contract.outputs import NonFiniteError, StepOutput
from unison.contract.ownership import AccumulationOwner, Feature, GradSync
from unison.errors import ConfigurationError
from unison.launch.collectives import RECORDER
from unison.training import marks
from unison.training.losses import LossValue, loss_value
from unison.training.nonfinite import NonFiniteCheck
from unison.training.stopping import StopAgreement

if TYPE_CHECKING:
    from unison.contract.precision import Precision
    from unison.launch.lifecycle import RunGuard
    from unison.launch.watchdog import Watchdog
    from unison.training.checkpointing import CheckpointManager
    from unison.training.metrics import MetricsLog
    from unison.training.preflight import FitPlan
    from unison.training.trainer import Trainer
    from unison.training.validation import Validator

__all__ = ["TrainLoop"]


class TrainLoop:
    """Runs one fit's steps on the values ``fit`` made: its plan (settings, strategy, data, loss form), the
    precision, the scheduler and this rank's world; ``trainer`` is what the hooks receive and holds the
    documented results (``progress``)."""

    def __init__(
        self,
        trainer: Trainer,
        validator: Validator,
        checkpoints: CheckpointManager,
        metrics: MetricsLog,
        *,
        plan: FitPlan,
        precision: Precision,
        lr_scheduler: Any,
        env: DistEnv,
        guard: RunGuard | None,
        watchdog: Watchdog,
        control_group: Any,
    ) -> None:
        self.trainer = trainer
        self.plan, self.settings, self.strategy, self.data = plan, plan.settings, plan.strategy, plan.data
        #: The strategy's declaration, read once for the fit: a strategy may build its ``ownership`` afresh at each
        #: read (a property), which costs more than a step's own bookkeeping on a millisecond step.
        self.ownership = self.strategy.ownership
        self.precision, self.lr_scheduler, self.env = precision, lr_scheduler, env
        self.validator = validator
        self.checkpoints = checkpoints
        self.metrics = metrics
        #: The fit's progress watchdog.
        self.watchdog = watchdog
        #: How the step's losses reach every rank, asked once (API 2.4): ``None``, ``reduce_sum`` over the replicas;
        #: a bool, one sum over the world counting this rank's numbers (``True``) or zeros (:meth:`_step_sum`).
        self.reports = self.strategy.reports_step_losses()
        #: Every rank's stop flags (``should_stop``, ``guard``'s stop requests), agreed over the CPU control group.
        self.stop = StopAgreement(trainer, guard, control_group, env, carried=self._loss_reduce_spans_world())
        #: ``nonfinite="raise"``: each step's finiteness, read one step late.
        self.nonfinite = NonFiniteCheck(env, self.stop, control_group)
        #: Optimizer steps skipped in a row; ``max_consecutive_skips`` of them stop training.
        self.consecutive_skips = 0

    def run(self) -> None:
        """Train from ``trainer.progress.global_step`` on (a resume's step, or 0)."""
        trainer = self.trainer
        s, hook, progress, watchdog = self.settings, trainer.pm, trainer.progress, self.watchdog
        epoch = None
        for batch in self.data.steps(progress.global_step):
            step = batch.step
            watchdog.mark(step, "forward_backward")
            if batch.epoch != epoch:
                epoch = batch.epoch
                hook.unison_on_train_epoch_start(trainer=trainer, epoch=epoch)
            output = self.train_step(batch)
            progress.global_step = done = step + 1
            progress.history.append(output)
            watchdog.mark(step, "step_end")
            hook.unison_on_train_step_end(trainer=trainer, step=step, output=output)
            if done % s.log_every_n_steps == 0:
                self.nonfinite.resolve()  # the metrics read the device anyway: a non-finite step is never logged
                self.metrics.log_step(output, retries=self.data.read_retries())
            if batch.last_in_epoch:
                hook.unison_on_train_epoch_end(trainer=trainer, epoch=epoch)
            watchdog.mark(step, "stop_agreement")
            self.stop.collect()  # the previous boundary's agreement: none in flight during validation or a save
            validated = self.validator.should_validate(done)
            if validated:
                watchdog.mark(step, "validation")
                self.nonfinite.resolve()
                trainer.validate()
                self.validator.last_validated = done
            saved = self.checkpoints.should_save(done)
            if saved:
                watchdog.mark(step, "checkpoint")
                trainer.save_checkpoint()  # resolves the non-finite check first
            watchdog.mark(step, "stop_agreement")
            # A step that validated or saved blocked anyway: agree at once there, so a stop decided from
            # validation (early stopping) ends every backend's fit after the same step as at world 1.
            if self.stop.agree(now=saved or validated):
                break
            watchdog.mark(done, "data")
        # Nothing left in flight: the last boundary's stop agreement (a request in it preempts), the last check.
        self.stop.finish()
        self.nonfinite.resolve()

    # -- one optimizer step -------------------------------------------------- #
    def train_step(self, batch: Any) -> StepOutput:
        """One optimizer step on ``batch`` (a step of :meth:`TrainData.steps`), on every rank alike."""
        trainer = self.trainer
        s, hook, strategy, precision = self.settings, trainer.pm, self.strategy, self.precision
        step = batch.step
        hook.unison_on_train_step_start(trainer=trainer, step=step)
        values = self.forward_backward(batch.micro_batches)
        self.watchdog.mark(step, "optimizer_step")
        hook.unison_on_after_backward(trainer=trainer, step=step)

        # Every micro-batch's loss (and item count, for pairs) and the step's tokens, summed over replicas in
        # one collective.
        n = len(values)
        pairs = values[0].items is not None
        parts = [torch.stack([v.loss.detach().float().reshape(()) for v in values])]
        if pairs:
            parts.append(torch.stack([v.items for v in values if v.items is not None]).to(parts[0].device))
        if batch.tokens is not None:
            # torch.full: the count is a kernel argument, not a host-to-device copy (which would synchronise).
            parts.append(torch.full((1,), float(batch.tokens), device=parts[0].device))
        stop = self.stop
        if stop.carried:  # the last boundary's stop flags ride along (unison.training.stopping)
            parts.append(stop.outgoing().to(parts[0].dtype))
        numbers = torch.cat(parts)
        if self.reports is False:  # another rank of this replica reports the numbers (a pipeline's last stage)
            numbers[: numbers.numel() - (2 if stop.carried else 0)] = 0  # this rank's flags still count
        reduced = self._step_sum(numbers)
        if stop.carried:
            stop.incoming(reduced[-2:])
            reduced = reduced[:-2]
        replicas = strategy.data_parallel_size(self.env.world_size)
        tokens = reduced[-1] if batch.tokens is not None else None
        items = None
        precision.unscale_gradients(strategy.optimizer)
        if pairs:
            items = reduced[n : 2 * n]
            micro, tokens = self._normalise(reduced[:n], items, tokens, replicas)
        else:
            micro = reduced[:n] / replicas

        with marks.mark(marks.CLIP_GRAD_NORM):
            grad_norm = strategy.clip_grad_norm(s.grad_clip_norm).detach()
        lrs = [float(g["lr"]) for g in strategy.optimizer.param_groups]  # type: ignore[union-attr]
        finite = True
        if precision.skips_overflow or s.nonfinite == "skip":
            # One device-to-host read: whether to skip must be known before the optimizer step. The global
            # norm and the replica-averaged losses are the same on every rank, so every rank decides alike.
            finite = bool(torch.isfinite(grad_norm) & torch.isfinite(micro).all())
        elif s.nonfinite == "raise":
            # No read now: the previous step's flag is read (naming its step) while this step's work is queued.
            self.nonfinite.resolve()
            finite_now = torch.isfinite(grad_norm) & torch.isfinite(micro).all()
            self.nonfinite.record(step, finite_now, parts[0], grad_norm)
        hook.unison_on_before_optimizer_step(trainer=trainer, step=step, grad_norm=grad_norm)
        if finite or precision.skips_overflow:
            skipped = precision.step(strategy.optimizer_step, strategy.optimizer, finite)
        else:  # nonfinite == "skip"
            skipped = True
        self._count(skipped)
        strategy.zero_grad()
        hook.unison_on_after_optimizer_step(trainer=trainer, step=step, skipped=skipped)
        if self.consecutive_skips >= s.max_consecutive_skips:
            raise NonFiniteError(
                f"step {step}: {self.consecutive_skips} optimizer steps in a row were skipped (non-finite "
                "gradients: fp16 overflow or NaN/inf losses); training is not progressing. Fix: check the data and "
                "the loss for NaN/inf, lower the learning rate, or use bf16-mixed; max_consecutive_skips sets the limit"
            )
        return StepOutput(step, micro, grad_norm, lrs, skipped, s.global_batch_size, tokens, items=items)

    def _normalise(
        self, sums: torch.Tensor, items: torch.Tensor, tokens: torch.Tensor | None, replicas: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scale the summed gradients to the global batch's sum over its global item count; the micro losses.

        The gradients were summed as the declaration says backward divides and
        the replicas reduce; one factor turns them into that mean. A schedule
        that broadcasts its last stage's losses marks a mean loss with items
        -1 (its other stages cannot know the form without reading the device):
        the same arithmetic then leaves a mean loss as it is, decided on the
        device (a factor of exactly 1; on the CPU, where reading the marker
        synchronises nothing, ``scale_gradients`` is not called for it). With the default token rule, the step's
        tokens are its items: tokens/s counts what the loss is normalised by.
        """
        total = items.sum()
        mean = total < 0
        micro = torch.where(mean, sums / replicas, sums / items.clamp(min=1))
        numerator = self.ownership.normalisation.gradient_factor_numerator(len(sums), replicas)
        one = torch.ones((), device=total.device)
        # A mean loss's factor is exactly 1. On the CPU, reading that costs no synchronisation, so a schedule's
        # mean losses skip a pass over every gradient; an accelerator keeps the decision on the device.
        if total.device.type != "cpu" or not bool(mean):
            self.strategy.scale_gradients(torch.where(mean, one, numerator / total.clamp(min=1)))
        if self.data.counts_tokens_by_default:
            tokens = torch.where(mean, tokens if tokens is not None else -one, total)
        return micro, tokens

    def _step_sum(self, numbers: torch.Tensor) -> torch.Tensor:
        """The step's numbers summed over the data-parallel replicas, on every rank: by the strategy's
        ``reduce_sum``, or, where it reports its losses on some ranks only (``self.reports`` a bool), by one
        all-reduce over the world in which the other ranks' numbers are zeros (exact: adding zero rounds
        nothing)."""
        if self.reports is None:
            return self.strategy.reduce_sum(numbers)
        out = numbers.detach().to(self.env.device)
        if self.env.distributed and self.env.world_size > 1:
            torch.distributed.all_reduce(out)  # out is the step's own tensor (torch.cat made it)
        return out

    def _loss_reduce_spans_world(self) -> bool:
        """Whether each step's loss all-reduce sums over every rank of the world on the CPU, at every step:
        then it carries the stop flags (:class:`StopAgreement`). ``reduce_sum`` sums over the data-parallel
        replicas (the contract), so it spans the world where the strategy declares the world's ranks its
        replicas; a strategy that reports its losses on some ranks (:meth:`_step_sum`) sums over the world
        whatever its replicas. A strategy whose replicas are not the whole world and that reports nothing
        (tensor parallelism, a 2.3 pipeline) keeps the agreement's own all-reduce."""
        env = self.env
        return (
            env.distributed
            and env.world_size > 1
            and env.device.type == "cpu"
            and (self.reports is not None or self.strategy.data_parallel_size(env.world_size) == env.world_size)
        )

    def _count(self, skipped: bool) -> None:
        """The progress counters after an optimizer step; the scheduler steps only with the optimizer."""
        trainer = self.trainer
        progress = trainer.progress
        if not skipped:
            progress.optimizer_steps += 1
            self.consecutive_skips = 0
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
                progress.scheduler_steps += 1
        else:
            progress.skipped_steps += 1
            self.consecutive_skips += 1

    def forward_backward(self, micro_batches: Sequence[Any]) -> list[LossValue]:
        """Forward and backward over one step's micro-batches, fed as the strategy's accumulation declares.

        The one place the declaration is read: a schedule (pipeline) takes
        them all at once; trainer-owned accumulation divides each loss by the
        micro-batch count and, with boundary sync, skips gradient sync until
        the last micro-step; an engine scales by its own count and its
        boundary must agree with the trainer's. A ``(loss_sum, num_items)``
        pair is backpropagated the same way (its sum), and scaled once after
        the last micro-step (:meth:`train_step`).
        """
        accumulation = self.ownership.grad_accumulation
        strategy, precision = self.strategy, self.precision
        assert precision is not None
        if accumulation.owner is AccumulationOwner.SCHEDULE:
            pairs = [tuple(b) for b in micro_batches]
            loss_fn = self.plan.loss_fn
            if self.ownership.refusal(Feature.ITEM_WEIGHTED_LOSS) is not None:
                loss_fn = _RefusePairs(loss_fn, self._refuse_pairs)  # the schedule could not pass a pair through
            RECORDER.enter("forward_backward (pipeline schedule)", None)  # for a stall report: assignments only
            out = strategy.forward_backward(pairs, loss_fn, precision)  # type: ignore[attr-defined]
            return self._checked([loss_value(v, "loss_fn") for v in out])
        n = len(micro_batches)
        defer = accumulation.owner is AccumulationOwner.TRAINER and accumulation.sync is GradSync.BOUNDARY
        values = []
        for i, batch in enumerate(micro_batches):
            last = i == n - 1
            # Trainer-owned, boundary sync: skip gradient sync until the last micro-step.
            skip_sync = defer and not last
            sync = strategy.no_sync() if skip_sync else contextlib.nullcontext()  # type: ignore[attr-defined]
            with marks.mark(marks.NO_SYNC, skip_sync), sync:
                with precision.forward_context():
                    value = self.loss(batch)
                loss = value.loss
                # For a stall report (assignments only): which micro-step, and whether this backward syncs.
                RECORDER.micro_step()
                if not (defer and not last):
                    RECORDER.enter("backward (gradient sync)", None)
                if accumulation.owner is AccumulationOwner.TRAINER:
                    # The one place the loss is divided for accumulation.
                    with marks.mark(marks.BACKWARD):
                        strategy.backward(precision.scale_loss(loss / n))
                else:
                    # Engine-owned: the engine scales by its own count.
                    with marks.mark(marks.BACKWARD):
                        strategy.backward(precision.scale_loss(loss))
                    answer = bool(strategy.is_accumulation_boundary())  # type: ignore[attr-defined]
                    marks.boundary(answer)
                    if answer != last:
                        raise RuntimeError(
                            f"strategy {strategy.name!r} owns accumulation but its boundary disagrees with the "
                            f"trainer's at micro-step {i + 1}/{n}: check its accumulation settings"
                        )
            values.append(value)
        return self._checked(values)

    def loss(self, batch: Any) -> LossValue:
        """One micro-batch's loss in the fit's form: a mean (0-dim tensor) or a ``(loss_sum, num_items)`` pair."""
        precision = self.precision
        assert precision is not None
        if self.plan.training_step is not None:
            value = self.plan.training_step(self.strategy.model, precision.convert_input(batch))
            name = "training_step"
        else:
            inputs, targets = batch
            value = self.plan.loss_fn(self.strategy.forward(precision.convert_input(inputs)), targets)  # type: ignore[misc]
            name = "loss_fn"
        loss = loss_value(value, name)
        if loss.items is not None:
            self._refuse_pairs()
        return loss

    def _refuse_pairs(self) -> None:
        """A pair for a strategy that refuses them: the same error on every rank, at the first micro-step."""
        reason = self.ownership.refusal(Feature.ITEM_WEIGHTED_LOSS)
        if reason is not None:
            raise ConfigurationError(
                "loss_fn/training_step",
                f"strategy {self.strategy.name!r} refuses {Feature.ITEM_WEIGHTED_LOSS.description}: {reason}",
                "return the micro-batch's mean loss, or use a strategy that takes (loss_sum, num_items) "
                "(unison describe NAME shows its loss normalisation)",
            )

    @staticmethod
    def _checked(values: list[LossValue]) -> list[LossValue]:
        """Every micro-batch of a step in one form: a mix would weigh means and sums against each other."""
        if len({v.items is None for v in values}) > 1:
            raise ConfigurationError(
                "loss_fn/training_step",
                "some micro-batches returned a mean loss and others a (loss_sum, num_items) pair",
                "return the same form for every batch",
            )
        return values


class _RefusePairs:
    """A ``loss_fn`` for a schedule that declares no pairs: a pair from the user's function is refused by name."""

    def __init__(self, loss_fn: Any, refuse: Any) -> None:
        self.loss_fn, self.refuse = loss_fn, refuse

    def __call__(self, outputs: Any, targets: Any) -> Any:
        value = self.loss_fn(outputs, targets)
        if isinstance(value, (tuple, list)):
            self.refuse()
        return value
