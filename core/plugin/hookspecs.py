"""Every hook unison calls, in one place, grouped by phase.

One file on purpose, past the project's 400 lines: a plugin author reads every hook and its
conventions here, top to bottom (each docstring says who calls it, when, on which ranks and what a
return value means).

Conventions (shared by all hooks below):

* Hooks are called through :class:`unison.plugin.manager.PluginManager`; a plugin
  implements any subset, decorated with :data:`unison.hookimpl`, and may accept
  any subset of a spec's arguments.
* "Every rank" means the hook runs in every process of the world, in the same
  order; a hook that does collective work must do the same work on every rank.
* ``step`` is the 0-based index of the optimizer step being built (the global
  batch index); it is the same number on every backend and world size.
* Lifecycle hooks return ``None``; their return values are ignored. Hooks with
  a meaningful result say so under "Returns".

The order of one ``fit`` call, identical for every strategy. A bracketed
line fires only when the condition beside it holds (all of its hooks, in that
order); ``each optimizer step:`` repeats its indented block once per optimizer
step. ``tests/test_hook_order.py`` checks a real run against this block, and
docs/hooks.md repeats it::

    unison_on_fit_start
    [unison_on_load_checkpoint]                  resuming (ckpt_path given)
    each optimizer step:
      [unison_on_train_epoch_start]              first step of an epoch, or of a resumed run
      unison_on_train_step_start
      unison_on_after_backward                   once, after the last micro-batch
      unison_on_before_optimizer_step            once, with the global grad norm
      unison_on_after_optimizer_step             once; says whether the update was skipped
      unison_on_train_step_end
      [unison_log_metrics]                       every log_every_n_steps
      [unison_on_train_epoch_end]                last step of an epoch
      [unison_on_validation_start, unison_on_validation_end, unison_log_metrics]
                                                 every val_every_n_steps (with a val_dataset)
      [unison_on_save_checkpoint]                every checkpoint_every_n_steps (with a checkpoint_dir)
    [unison_on_validation_start, unison_on_validation_end, unison_log_metrics]
                                                 with a val_dataset, unless the last step validated
    [unison_on_save_checkpoint]                  with a checkpoint_dir, unless the last step saved
    [unison_log_metrics]                         trainer.log() values not yet sent
    unison_on_fit_end

Outside this order: ``unison_default_plugins`` and ``unison_on_trainer_init``
run once, in ``Trainer(...)``; ``unison_tensor_parallel_plan`` is asked by a
tensor-parallel strategy, before any process group, about a model without a
plan; ``unison_validation_progress`` ticks after each validation batch
between ``unison_on_validation_start`` and ``unison_on_validation_end`` (its
count depends on the data-parallel size, so it is not part of the order every
backend shares).

A plugin that sets ``trainer.should_stop`` ends the loop after the current
step's validation and checkpoint; the final validation and checkpoint then do
not run again for that step. The flag may be set on any subset of ranks (a
per-rank wall-clock limit sets it on one): the trainer combines every rank's
flag (logical OR, on a CPU process group), so all ranks stop after the same
step. In a world that is one step later: the flags of step k's boundary are
all-reduced without blocking and read at step k+1's, so the loop ends after
step k+1, unless step k validates or saves a checkpoint, which agrees at once
(:mod:`unison.training.stopping`). Stop decisions the trainer makes itself (a
non-finite loss or gradient, preemption) are agreed the same way or computed
from values identical on every rank. When ``fit`` fails, ``unison_on_exception``
fires instead of the rest, on the failing rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unison.plugin import hookspec
from unison.plugin.views import TrainerView

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from unison.contract.cluster import ClusterEnvironment
    from unison.contract.outputs import StepOutput
    from unison.contract.spec import StorageFactory
    from unison.plugin.registry import PrecisionSpec, StrategySpec


# --------------------------------------------------------------------------- #
# Registration: called by the plugin manager when a registry is first needed.
# --------------------------------------------------------------------------- #


@hookspec
def unison_strategies() -> list[StrategySpec]:
    """Register strategies by name.

    Called by :class:`~unison.plugin.manager.PluginManager` through pluggy when its
    strategy registry is first needed and again after any plugin is registered
    or unregistered (on any rank, before any process group): once per
    implementing plugin, each call wrapped by every ``wrapper=True``
    implementation, so the specs stay attributable to their plugin.

    Returns:
        A list of :class:`~unison.plugin.registry.StrategySpec`, each naming one
        strategy, its aliases, and whether it is available on this machine
        (with the reason when not). Names must be unique across all plugins;
        a duplicate is an error naming both plugins.
    """


@hookspec
def unison_precisions() -> list[PrecisionSpec]:
    """Register precision plugins by name (``"bf16-mixed"``, or a third party's own name).

    Called by :class:`~unison.plugin.manager.PluginManager` like
    :func:`unison_strategies` (on any rank, before any process group, once
    per registering plugin), for its precision registry. The trainer uses a
    registered precision only when the strategy declares the precision
    applied by the trainer or a plugin.

    Returns:
        A list of :class:`~unison.plugin.registry.PrecisionSpec`.
    """


@hookspec
def unison_add_cli_commands(cli: Any) -> None:
    """Add subcommands to the ``unison`` command line.

    Called once by :func:`unison.cli.main` before parsing arguments (in the
    launching process, before any rank exists), with the root :class:`click.Group`; add commands with
    ``cli.add_command(...)``. The
    conformance suite adds ``unison conformance`` this way, so the core never
    imports it. Return value ignored.
    """


@hookspec
def unison_plugins_from_config(config: Any) -> list[Any]:
    """Build plugins (loggers, callbacks) that a config file asks for.

    Called by ``unison train`` once per process (every rank, and the launcher
    to check the config before it starts workers), after the config file was
    validated and before the Trainer is built, with the
    :class:`~unison.config.load.RunConfig`. The JSONL logger and the progress
    display read ``config.logging`` this way, so the core never imports them.

    Returns:
        Plugin objects to register on the run's Trainer (may be empty).
    """


@hookspec
def unison_cluster_environments() -> list[ClusterEnvironment]:
    """Register cluster environments: how torchrun on this node joins a job of several nodes.

    Called by ``unison run`` and ``unison train`` (:func:`unison.launch.torchrun.run_script`
    and the check before it) in the launching process of each node, before
    torchrun starts and before any rank exists. Every environment's ``detect``
    is then asked about this process's variables; the detected one of highest
    ``priority`` derives torchrun's multi-node options
    (:class:`~unison.launch.cluster.NodeLaunch`). Built-ins: ``torchrun`` (default),
    ``slurm``, ``kubernetes`` (:mod:`unison.plugins.cluster`).

    Returns:
        A list of :class:`~unison.launch.cluster.ClusterEnvironment` instances; names
        must be unique across plugins.
    """


@hookspec
def unison_storage_backends() -> dict[str, StorageFactory]:
    """Register checkpoint and run-directory storage by URL scheme (``s3`` for ``s3://bucket/prefix``).

    Called by :func:`unison.checkpointing.storage.open_storage` each time it
    opens a URL location whose scheme is not ``file`` (local paths and
    ``file://`` never reach a plugin): ``checkpoint_dir`` when a Trainer is
    built (on every rank, before any process group) and when its
    checkpointer opens a ``ckpt_path`` URL, a logger's ``dir``, and the
    ``unison checkpoint`` commands (in the launching process). Nothing is
    cached between calls, so a plugin registered later is found. The
    built-in ``s3`` backend registers here too (:mod:`unison.plugins.storage.s3`).

    Returns:
        A dict mapping a lowercase URL scheme (without ``://``) to a
        :data:`~unison.contract.spec.StorageFactory`:
        ``factory(location, storage_options, option) -> (root, storage)``,
        called with the whole URL, the user's ``storage_options`` (a dict,
        empty when none were given) and the setting name for error messages
        (``checkpoint_dir``, ``logging.dir``). ``root`` is the path the
        checkpointer joins names onto; ``storage`` a
        :class:`~unison.checkpointing.storage.LocalStorage` subclass doing
        every read, write, listing and commit for paths under ``root``.
        A factory raises :class:`~unison.ConfigurationError` for a location
        it cannot use (a missing client library, a refused credential). A
        scheme registered by two plugins is a :class:`~unison.PluginError`
        naming both.
    """


# --------------------------------------------------------------------------- #
# The user's model: asked by strategies, before any process group.
# --------------------------------------------------------------------------- #


@hookspec(firstresult=True)
def unison_tensor_parallel_plan(module: torch.nn.Module) -> dict[str, str] | None:
    """The tensor-parallel plan of a block whose type this plugin knows (a class it ships or supports).

    Called by :func:`unison.contract.tensor_parallel.tensor_parallel_plan` (the tensor-parallel
    strategies' ``validate_model``, on every rank before any process group, and again when they
    shard the model after it; :func:`~unison.contract.strategy.model_features`) for a model that
    declares no plan of its own (no ``tp_plan`` nor Hugging Face ``base_model_tp_plan``: the
    model's plan always wins). It is asked about the model and each submodule, outermost first,
    except inside a block already answered for. Must not do collective work.

    ``module`` is the model or one of its submodules; answer only for types you know (by class),
    and ``None`` for anything else.

    Returns:
        ``{submodule name or pattern relative to module: style}`` (``"colwise"`` or ``"rowwise"``,
        Hugging Face's names; ``*`` matches one name segment), e.g. ``{"mlp.up": "colwise",
        "mlp.down": "rowwise"}``; the caller prefixes each key with the block's qualified name
        (``layers.0.mlp.up``) and composes every block's plan into the model's. ``{}``: a known
        block with nothing to split. ``None``: not a type this plugin knows.

    ``firstresult``: one plugin plans a block, whole, because a plan's colwise and rowwise layers
    pair up (two plugins' partial plans merged could split a layer without its partner). The first
    non-``None`` answer wins, in pluggy's order: the plugin registered last is asked first, so a
    user's plugin overrides a built-in plan for the same type (``tryfirst``/``trylast`` adjust).
    """


# --------------------------------------------------------------------------- #
# Fit lifecycle: called by Trainer.fit on every rank.
# --------------------------------------------------------------------------- #


@hookspec
def unison_on_fit_start(trainer: TrainerView) -> None:
    """After the strategy set up model and optimizer, before the first step.

    Called by :meth:`Trainer.fit` on every rank, once per ``fit``.
    ``trainer.strategy.model`` and ``trainer.strategy.optimizer`` exist.
    """


@hookspec
def unison_on_fit_end(trainer: TrainerView) -> None:
    """After the last optimizer step and final checkpoint, on every rank.

    Called by :meth:`Trainer.fit` once, when training ended normally
    (``max_steps`` reached or ``trainer.should_stop`` set by a plugin).
    """


@hookspec
def unison_on_exception(trainer: TrainerView, exception: BaseException) -> None:
    """When ``fit`` is leaving because of an exception, on the failing rank.

    Called by :meth:`Trainer.fit` before the exception propagates. No
    checkpoint is written: the last good one stays untouched. A stop request
    (SIGTERM/SIGUSR1) ends ``fit`` with :class:`unison.launch.lifecycle.Preempted`
    after its checkpoint was committed; it arrives here too, on every rank.
    Must not raise.
    """


@hookspec
def unison_on_train_epoch_start(trainer: TrainerView, epoch: int) -> None:
    """Before the first optimizer step of an epoch (a pass over the dataset).

    Called by :meth:`Trainer.fit` on every rank; ``epoch`` is 0-based. When a
    run resumes mid-epoch, it is called for the resumed epoch too.
    """


@hookspec
def unison_on_train_epoch_end(trainer: TrainerView, epoch: int) -> None:
    """After the last optimizer step of an epoch, on every rank.

    Called by :meth:`Trainer.fit` after that step's ``unison_on_train_step_end``
    and metrics, before that step's validation and checkpoint; not called for
    an epoch cut short by ``max_steps`` or ``should_stop``.
    """


@hookspec
def unison_on_train_step_start(trainer: TrainerView, step: int) -> None:
    """Before the first micro-batch of optimizer step ``step``, on every rank.

    Called by :meth:`Trainer.fit` once per optimizer step, on every backend,
    before the step's micro-batches are loaded.
    """


@hookspec
def unison_on_after_backward(trainer: TrainerView, step: int) -> None:
    """Once per optimizer step, after the backward of its last micro-batch.

    Called by :meth:`Trainer.fit` on every rank, on every backend exactly once
    per optimizer step, whoever owns accumulation: gradients are accumulated
    and synchronised, not yet unscaled or clipped. Where the strategy's
    gradients are sharded (FSDP, ZeRO-2/3), ``param.grad`` holds this rank's
    shard or nothing; use strategy methods, not ``param.grad``, to inspect them.
    """


@hookspec
def unison_on_before_optimizer_step(trainer: TrainerView, step: int, grad_norm: torch.Tensor) -> None:
    """Once per optimizer step, after clipping, before the optimizer update.

    Called by :meth:`Trainer.fit` on every rank, exactly once per optimizer
    step on every backend. ``grad_norm`` is the *global* L2 norm of all
    gradients across all shards and stages, before clipping, after unscaling
    (``inf``/``nan`` when fp16 overflowed; the step will then be skipped).
    It is a 0-dim tensor on the strategy's device, equal on every rank:
    ``float(grad_norm)`` reads it, which is a device-to-host synchronisation,
    so a plugin that runs every step should read it only when it needs it.
    """


@hookspec
def unison_on_after_optimizer_step(trainer: TrainerView, step: int, skipped: bool) -> None:
    """Once per optimizer step, after the update and the scheduler step.

    Called by :meth:`Trainer.fit` on every rank, after ``zero_grad``. ``skipped`` is ``True`` when the update did not
    happen (fp16 overflow); the LR scheduler was then not advanced either.
    """


@hookspec
def unison_on_train_step_end(trainer: TrainerView, step: int, output: StepOutput) -> None:
    """After optimizer step ``step`` is complete, on every rank.

    Called by :meth:`Trainer.fit` once per optimizer step, after
    ``unison_on_after_optimizer_step`` and before metrics are logged.

    ``output`` holds the global-batch mean loss, each micro-batch's loss (the
    same numbers on every rank), the grad norm, the learning rates and whether
    the step was skipped. A plugin may set ``trainer.should_stop = True`` here
    (on one rank or on all) to end training after this step on every rank (in
    a world after the next step, unless this one saves a checkpoint).
    """


# --------------------------------------------------------------------------- #
# Validation: called by Trainer.fit when a val_dataset is given.
# --------------------------------------------------------------------------- #


@hookspec
def unison_on_validation_start(trainer: TrainerView, step: int) -> None:
    """Before the validation loop that follows optimizer step ``step``, on every rank.

    Called by :meth:`Trainer.validate`: every ``val_every_n_steps`` and once at
    the end of ``fit`` when a ``val_dataset`` is given (unless the last step
    was just validated). The model is put in eval mode right after this hook.
    """


@hookspec
def unison_on_validation_end(trainer: TrainerView, step: int, metrics: dict[str, float]) -> None:
    """After the validation loop, on every rank.

    Called by :meth:`Trainer.validate`, before the metrics go to
    ``unison_log_metrics``; ``step`` is the number of optimizer steps completed.

    ``metrics["val/loss"]`` is the mean loss over the whole validation set,
    reduced across ranks (the same value on every rank and every backend).
    """


# --------------------------------------------------------------------------- #
# Checkpoints: called by the trainer's checkpointer.
# --------------------------------------------------------------------------- #


@hookspec
def unison_on_save_checkpoint(trainer: TrainerView, checkpoint: dict[str, Any]) -> None:
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
def unison_on_load_checkpoint(trainer: TrainerView, checkpoint: dict[str, Any]) -> None:
    """When ``fit`` resumes, after model, optimizer and progress were restored.

    Called by :meth:`Trainer.fit` (given ``ckpt_path``) after
    ``unison_on_fit_start``, on every rank; ``checkpoint`` is the dict rank 0
    saved (see :func:`unison_on_save_checkpoint`).
    """


# --------------------------------------------------------------------------- #
# Logging: called by the trainer; loggers implement it.
# --------------------------------------------------------------------------- #


@hookspec
def unison_log_metrics(trainer: TrainerView, metrics: dict[str, float], step: int) -> None:
    """Deliver metrics to loggers.

    Called by the trainer on every rank (the same metrics everywhere, already
    reduced); loggers that write files should write on
    ``trainer.is_global_zero`` only. ``step`` is the number of optimizer steps
    completed (1-based), the x-axis of every plot.
    """


# --------------------------------------------------------------------------- #
# Observability: default plugins, settings checks, validation progress.
# --------------------------------------------------------------------------- #


@hookspec
def unison_default_plugins(settings: Any, plugins: list[Any]) -> list[Any]:
    """Plugins every Trainer gets unless its settings turn them off.

    Called by :class:`~unison.Trainer` once, in its constructor (on every
    rank, before any process group exists), after the plugins passed as
    ``callbacks=``/``loggers=`` were registered. This is how the Python API
    gets a progress display (``settings.progress``), throughput metrics
    (``settings.throughput``) and, with no logger of its own, JSONL and CSV
    metrics in its run directory (``root_dir/version_N``, else
    ``runs/NAME/version_N``), without the core importing any plugin. With
    ``Trainer(loggers=False)`` the Trainer drops the returned plugins that
    implement ``unison_log_metrics``.

    Args:
        settings: the Trainer's :class:`~unison.TrainerSettings`.
        plugins: the plugins the Trainer was given explicitly; an
            implementation returns nothing for a kind the user already passed
            (their own ``ProgressBar(...)`` replaces the default one).

    Returns:
        Plugin objects to register on this Trainer (may be empty).
    """


@hookspec
def unison_on_trainer_init(trainer: TrainerView) -> None:
    """Check, before any process group exists, what a plugin needs from the settings.

    Called by :class:`~unison.Trainer` once, at the end of its constructor, on
    every rank, after every plugin (default ones included) is registered and
    the strategy is built. ``trainer.settings`` and ``trainer.ownership`` are
    final; there is no model, optimizer or process group yet. A plugin raises
    :class:`~unison.ConfigurationError` here for settings it cannot work with
    (``ModelCheckpoint`` without ``checkpoint_dir``), so bad input fails
    before any worker starts training. Return value ignored.
    """


@hookspec
def unison_validation_progress(trainer: TrainerView, step: int, batch_idx: int, num_batches: int | None) -> None:
    """After each validation forward, for progress displays.

    Called by :meth:`Trainer.validate` on every rank, after batch
    ``batch_idx`` (0-based) of the validation loop that follows optimizer step
    ``step``, between :func:`unison_on_validation_start` and
    :func:`unison_on_validation_end`. ``num_batches`` is the number of
    forwards this rank runs in the loop (``None`` when the dataset does not
    say). ``val_batch_size`` counts samples per replica, so the number of
    calls depends on the data-parallel size: this hook is a progress report,
    not part of the lifecycle sequence that is identical on every backend
    (hence no ``on_`` in its name). Must not do collective work. Return value
    ignored.
    """
