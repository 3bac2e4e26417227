"""Every hook unison calls, in one place, grouped by phase.

Conventions (shared by all hooks below):

* Hooks are called through :class:`unison.manager.PluginManager`; a plugin
  implements any subset, decorated with :data:`unison.hookimpl`, and may accept
  any subset of a spec's arguments.
* "Every rank" means the hook runs in every process of the world, in the same
  order; a hook that does collective work must do the same work on every rank.
* ``step`` is the 0-based index of the optimizer step being built (the global
  batch index); it is the same number on every backend and world size.
* Lifecycle hooks return ``None``; their return values are ignored. Hooks with
  a meaningful result say so under "Returns".

The order of one ``fit`` call, identical for every strategy::

    unison_on_fit_start
    (unison_on_load_checkpoint)              # when resuming
    repeat per epoch:
      unison_on_train_epoch_start
      repeat per optimizer step:
        unison_on_train_step_start
        unison_on_after_backward             # once, after the last micro-batch
        unison_on_before_optimizer_step      # once, with the global grad norm
        unison_on_after_optimizer_step       # once; says whether it was skipped
        unison_on_train_step_end
        unison_log_metrics                   # every log_every_n_steps
        (unison_on_validation_start, unison_on_validation_end, unison_log_metrics)
        (unison_on_save_checkpoint)          # every checkpoint_every_n_steps
      unison_on_train_epoch_end
    (unison_on_save_checkpoint)              # final checkpoint, when a dir is set
    unison_on_fit_end
    (unison_on_exception)                    # instead of the rest, on a crash
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unison.plugin import hookspec

if TYPE_CHECKING:  # pragma: no cover
    from unison.registry import PrecisionSpec, StrategySpec
    from unison.trainer import StepOutput, Trainer


# --------------------------------------------------------------------------- #
# Registration: called once per plugin manager, before any Trainer exists.
# --------------------------------------------------------------------------- #


@hookspec
def unison_strategies() -> "list[StrategySpec]":
    """Register strategies by name.

    Called by :class:`~unison.registry.StrategyRegistry` when it is first
    built (on any rank, before any process group), once per plugin.

    Returns:
        A list of :class:`~unison.registry.StrategySpec`, each naming one
        strategy, its aliases, and whether it is available on this machine
        (with the reason when not). Names must be unique across all plugins;
        a duplicate is an error naming both plugins.
    """


@hookspec
def unison_precisions() -> "list[PrecisionSpec]":
    """Register precision plugins by name (``"bf16-mixed"``, ``"apex-O1"``...).

    Called by :class:`~unison.registry.PrecisionRegistry` when it is first
    built, once per plugin. The trainer uses a registered precision only when
    the strategy declares the precision applied by the trainer or a plugin.

    Returns:
        A list of :class:`~unison.registry.PrecisionSpec`.
    """


@hookspec
def unison_add_cli_commands(cli: Any) -> None:
    """Add subcommands to the ``unison`` command line.

    Called once by :func:`unison.cli.main` before parsing arguments, with the
    root :class:`click.Group`; add commands with ``cli.add_command(...)``. The
    conformance suite adds ``unison conformance`` this way, so the core never
    imports it. Return value ignored.
    """


@hookspec
def unison_plugins_from_config(config: Any) -> "list[Any]":
    """Build plugins (loggers, callbacks) that a config file asks for.

    Called by ``unison train`` once per process, after the config file was
    validated and before the Trainer is built, with the
    :class:`~unison.config.RunConfig`. The JSONL logger and the progress
    display read ``config.logging`` this way, so the core never imports them.

    Returns:
        Plugin objects to register on the run's Trainer (may be empty).
    """


# --------------------------------------------------------------------------- #
# Fit lifecycle: called by Trainer.fit on every rank.
# --------------------------------------------------------------------------- #


@hookspec
def unison_on_fit_start(trainer: "Trainer") -> None:
    """After the strategy set up model and optimizer, before the first step.

    Called by :meth:`Trainer.fit` on every rank, once per ``fit``.
    ``trainer.strategy.model`` and ``trainer.strategy.optimizer`` exist.
    """


@hookspec
def unison_on_fit_end(trainer: "Trainer") -> None:
    """After the last optimizer step and final checkpoint, on every rank.

    Called by :meth:`Trainer.fit` once, when training ended normally
    (``max_steps`` reached or ``trainer.should_stop`` set by a plugin).
    """


@hookspec
def unison_on_exception(trainer: "Trainer", exception: BaseException) -> None:
    """When ``fit`` is leaving because of an exception, on the failing rank.

    Called by :meth:`Trainer.fit` before the exception propagates. No
    checkpoint is written: the last good one stays untouched. A stop request
    (SIGTERM/SIGUSR1) ends ``fit`` with :class:`unison.lifecycle.Preempted`
    after its checkpoint was committed; it arrives here too, on every rank.
    Must not raise.
    """


@hookspec
def unison_on_train_epoch_start(trainer: "Trainer", epoch: int) -> None:
    """Before the first optimizer step of an epoch (a pass over the dataset).

    Called by :meth:`Trainer.fit` on every rank; ``epoch`` is 0-based. When a
    run resumes mid-epoch, it is called for the resumed epoch too.
    """


@hookspec
def unison_on_train_epoch_end(trainer: "Trainer", epoch: int) -> None:
    """After the last optimizer step of an epoch, on every rank.

    Called by :meth:`Trainer.fit` after that step's ``unison_on_train_step_end``;
    not called for an epoch cut short by ``max_steps``.
    """


@hookspec
def unison_on_train_step_start(trainer: "Trainer", step: int) -> None:
    """Before the first micro-batch of optimizer step ``step``, on every rank.

    Called by :meth:`Trainer.fit` once per optimizer step, on every backend,
    before the step's micro-batches are loaded.
    """


@hookspec
def unison_on_after_backward(trainer: "Trainer", step: int) -> None:
    """Once per optimizer step, after the backward of its last micro-batch.

    Called by :meth:`Trainer.fit` on every rank, on every backend exactly once
    per optimizer step, whoever owns accumulation: gradients are accumulated
    and synchronised, not yet unscaled or clipped. Where the strategy's
    gradients are sharded (FSDP, ZeRO-2/3), ``param.grad`` holds this rank's
    shard or nothing; use strategy methods, not ``param.grad``, to inspect them.
    """


@hookspec
def unison_on_before_optimizer_step(trainer: "Trainer", step: int, grad_norm: float) -> None:
    """Once per optimizer step, after clipping, before the optimizer update.

    Called by :meth:`Trainer.fit` on every rank, exactly once per optimizer
    step on every backend. ``grad_norm`` is the *global* L2 norm of all
    gradients across all shards and stages, before clipping, after unscaling
    (``inf``/``nan`` when fp16 overflowed; the step will then be skipped).
    """


@hookspec
def unison_on_after_optimizer_step(trainer: "Trainer", step: int, skipped: bool) -> None:
    """Once per optimizer step, after the update and the scheduler step.

    Called by :meth:`Trainer.fit` on every rank, after ``zero_grad``. ``skipped`` is ``True`` when the update did not
    happen (fp16 overflow); the LR scheduler was then not advanced either.
    """


@hookspec
def unison_on_train_step_end(trainer: "Trainer", step: int, output: "StepOutput") -> None:
    """After optimizer step ``step`` is complete, on every rank.

    Called by :meth:`Trainer.fit` once per optimizer step, after
    ``unison_on_after_optimizer_step`` and before metrics are logged.

    ``output`` holds the global-batch mean loss, each micro-batch's loss (the
    same numbers on every rank), the grad norm, the learning rates and whether
    the step was skipped. A plugin may set ``trainer.should_stop = True`` here
    to end training after this step.
    """


# --------------------------------------------------------------------------- #
# Validation: called by Trainer.fit when a val_dataset is given.
# --------------------------------------------------------------------------- #


@hookspec
def unison_on_validation_start(trainer: "Trainer", step: int) -> None:
    """Before the validation loop that follows optimizer step ``step``, on every rank.

    Called by :meth:`Trainer.validate`: every ``val_every_n_steps`` and once at
    the end of ``fit`` when a ``val_dataset`` is given. The model is put in
    eval mode right after this hook.
    """


@hookspec
def unison_on_validation_end(trainer: "Trainer", step: int, metrics: "dict[str, float]") -> None:
    """After the validation loop, on every rank.

    Called by :meth:`Trainer.validate`, before the metrics go to
    ``unison_log_metrics``.

    ``metrics["val/loss"]`` is the mean loss over the whole validation set,
    reduced across ranks (the same value on every rank and every backend).
    """


# --------------------------------------------------------------------------- #
# Checkpoints: called by the trainer's checkpointer.
# --------------------------------------------------------------------------- #


@hookspec
def unison_on_save_checkpoint(trainer: "Trainer", checkpoint: "dict[str, Any]") -> None:
    """While a checkpoint is written, before it is committed, on every rank.

    Called by :meth:`Trainer.save_checkpoint` (every
    ``checkpoint_every_n_steps``, on a stop request and at the end of ``fit``)
    after the strategy wrote its files and before the checkpoint is committed;
    an exception here leaves the previous checkpoint as the latest.

    ``checkpoint`` is the trainer state rank 0 saves (progress, scheduler,
    scaler). A plugin may add its own entry under a key of its own name; it
    must be plain data (tensors, numbers, strings, ``None``, and lists, tuples
    or dicts of those), because checkpoints load with
    ``torch.load(weights_only=True)``: anything else fails the save with its
    type. It is returned to :func:`unison_on_load_checkpoint` on resume. Only
    rank 0's dict is saved.
    """


@hookspec
def unison_on_load_checkpoint(trainer: "Trainer", checkpoint: "dict[str, Any]") -> None:
    """When ``fit`` resumes, after model, optimizer and progress were restored.

    Called by :meth:`Trainer.fit` (given ``ckpt_path``) after
    ``unison_on_fit_start``, on every rank, with the dict rank 0 saved (see
    :func:`unison_on_save_checkpoint`).
    """


# --------------------------------------------------------------------------- #
# Logging: called by the trainer; loggers implement it.
# --------------------------------------------------------------------------- #


@hookspec
def unison_log_metrics(trainer: "Trainer", metrics: "dict[str, float]", step: int) -> None:
    """Deliver metrics to loggers.

    Called by the trainer on every rank (the same metrics everywhere, already
    reduced); loggers that write files should write on
    ``trainer.is_global_zero`` only. ``step`` is the number of optimizer steps
    completed (1-based), the x-axis of every plot.
    """
