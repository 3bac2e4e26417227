"""Trace recording: the hooks, numbers and collectives of one fit, as the suite compares them.

Every run produces a *trace* (a plain dict, JSON-able but for ``state``):

``steps``
    per optimizer step: ``loss``, ``micro_losses``, ``grad_norm``, ``lrs``
    (every parameter group), ``skipped`` — as the trainer reported them to
    ``unison_on_train_step_end`` — plus the grad norm the
    ``unison_on_before_optimizer_step`` hook saw.
``hooks``
    every ``unison_*`` hook called during ``fit``, in order, recorded with
    :meth:`unison.PluginManager.record_hook_calls` (pluggy's hook-call
    monitoring: exactly what plugins see).
``counts``
    the trainer's optimizer and scheduler step counts, and what really
    happened: the optimizer steps in which the optimizer the user's factory
    built was really stepped (an optimizer step post-hook, counted between
    ``unison_on_before_optimizer_step`` and ``unison_on_after_optimizer_step``)
    and the scheduler's ``last_epoch``.
``collectives``
    calls made on the real process group, counted from the profiler's
    records of the ``c10d::*`` dispatcher operations
    (:mod:`unison.conformance.profiling` says how and why).
``param_groups``
    the hyperparameters of each parameter group of ``strategy.optimizer`` at
    the run's first step (after a resume loaded its state), ``lr`` apart.
``saved_optimizer_state`` / ``loaded_optimizer_state``
    a summary of the user's optimizer's state (:func:`~unison.conformance.snapshots.optimizer_state_summary`)
    at every checkpoint written, and at the run's first step: a resume must
    give back what was written.
``boundaries``
    for engine-owned accumulation, what ``is_accumulation_boundary()``
    answered at every micro-step, read from the training loop's marks
    (:mod:`unison.training.marks`) in the run's profile; ``None`` in a run
    that is not profiled (one process).
``state``
    ``trainer.full_state_dict()`` after ``fit``, on every rank (so replicas
    that end apart are seen).
``precision_probe``
    in a ``*-mixed`` scenario's strategy runs: the dtypes of every ``Linear``
    output seen inside forward and of the parameters the optimizer updates
    (:class:`~unison.conformance.sensitivity.PrecisionProbe`).
``buffer_snapshots``
    ``{step: canonical buffers}`` taken from ``trainer.full_state_dict()``
    inside ``unison_on_save_checkpoint``, at every checkpoint the run writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import unison
from unison.conformance.profiling import STEP_MARK, process_groups
from unison.conformance.snapshots import group_hyperparameters, optimizer_state_summary


class TraceRecorder:
    """A plugin recording what the trainer reports at every optimizer step."""

    def __init__(self, buffer_names: Sequence[str] = ()) -> None:
        self.steps: list[dict[str, Any]] = []
        #: Canonical names of the model's buffers (recorded at every checkpoint).
        self.buffer_names = tuple(buffer_names)
        self.buffer_snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.hook_grad_norms: dict[int, float] = {}
        self.start_counts: dict[str, int] | None = None
        self._mark: Any = None
        #: True between ``before_optimizer_step`` and ``after_optimizer_step``:
        #: the only place a real optimizer update belongs. (Loading optimizer
        #: state through torch.distributed.checkpoint.state_dict runs one
        #: zero-lr ``step()`` to materialise the state; that is not an update.)
        self.in_update = False
        #: ``step()`` calls of the user's optimizer per optimizer step. An
        #: engine may call it more than once per update (DeepSpeed ZeRO steps
        #: it once per parameter group, narrowing ``param_groups``), so what is
        #: checked is whether it was called at all, per step.
        self.step_calls: dict[int, int] = {}
        self.current_step: int | None = None
        self.updates_outside_window = 0
        #: ``{"step", "loss"}`` of every validation (``val/loss``).
        self.validations: list[dict[str, Any]] = []
        #: The hyperparameters of every parameter group of the optimizer the strategy steps, at the run's
        #: first step (after a resume loaded its state), ``lr`` apart (compared at every step).
        self.param_groups: list[dict[str, Any]] | None = None
        #: The optimizers the user's factory built (set by the run; the last one is the one trained).
        self.optimizers: list[Any] = []
        #: ``{step: summary}`` of the optimizer's state at every checkpoint written, and its state at the
        #: run's first step (a resumed run: what the checkpoint restored); see
        #: :func:`~unison.conformance.snapshots.optimizer_state_summary`.
        self.saved_optimizer_state: dict[int, dict[str, Any]] = {}
        self.loaded_optimizer_state: dict[str, Any] | None = None
        #: The live process groups at the run's first step (flight-recorder name -> ranks).
        self.process_groups: dict[str, list[int]] = {}

    def count_update(self) -> None:
        if self.in_update and self.current_step is not None:
            self.step_calls[self.current_step] = self.step_calls.get(self.current_step, 0) + 1
        else:
            self.updates_outside_window += 1

    def close_mark(self) -> None:
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None

    @unison.hookimpl
    def unison_on_train_step_start(self, trainer: Any, step: int) -> None:
        if self.start_counts is None:
            # After a checkpoint load (which happens after fit_start), so a
            # resumed run's counts start where the checkpoint left them.
            self.start_counts = {
                "optimizer_steps": trainer.progress.optimizer_steps,
                "scheduler_steps": trainer.progress.scheduler_steps,
            }
            self.param_groups = group_hyperparameters(getattr(trainer.strategy, "optimizer", None))
            self.loaded_optimizer_state = optimizer_state_summary(self.optimizers[-1] if self.optimizers else None)
            self.process_groups = process_groups()
        self.close_mark()
        self._mark = torch.autograd.profiler.record_function(STEP_MARK)
        self._mark.__enter__()

    @unison.hookimpl
    def unison_on_after_backward(self, step: int) -> None:
        self.close_mark()

    @unison.hookimpl
    def unison_on_before_optimizer_step(self, step: int, grad_norm: float) -> None:
        self.hook_grad_norms[step] = float(grad_norm)
        self.in_update = True
        self.current_step = step

    @unison.hookimpl
    def unison_on_after_optimizer_step(self, step: int, skipped: bool) -> None:
        self.in_update = False

    @unison.hookimpl
    def unison_on_save_checkpoint(self, trainer: Any) -> None:
        summary = optimizer_state_summary(self.optimizers[-1] if self.optimizers else None)
        if summary is not None:
            self.saved_optimizer_state[trainer.progress.global_step] = summary
        # Collective (every rank writes the checkpoint): the canonical state,
        # as a user exporting it at that moment would get it.
        if self.buffer_names:
            state = trainer.full_state_dict()
            self.buffer_snapshots[trainer.progress.global_step] = {k: state[k] for k in self.buffer_names if k in state}

    @unison.hookimpl
    def unison_on_validation_end(self, step: int, metrics: dict[str, float]) -> None:
        self.validations.append({"step": step, "loss": float(metrics["val/loss"])})

    @unison.hookimpl
    def unison_on_train_step_end(self, step: int, output: Any) -> None:
        self.steps.append(
            {
                "step": step,
                "loss": float(output.loss),
                "micro_losses": [float(x) for x in output.micro_losses],
                "grad_norm": float(output.grad_norm),
                "hook_grad_norm": self.hook_grad_norms.get(step),
                "lrs": [float(x) for x in output.lrs],
                "skipped": bool(output.skipped),
                "optimizer_step_calls": self.step_calls.get(step, 0),
            }
        )
