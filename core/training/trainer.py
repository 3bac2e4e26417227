"""The public :class:`Trainer`: its options, ``fit``, and what it exposes to callbacks.

``fit`` composes the parts of :mod:`unison.training` (checks before any
process group, the world, the loop, the validator and checkpoint manager
that own when to validate and to save, metrics). It never branches on a
strategy's class or name: where a backend differs it reads
:attr:`Strategy.ownership`. This module is longer than the project's usual
400 lines because the options' and ``fit``'s docstrings (about 140 lines)
are the API reference.

Order of one ``fit`` (see :mod:`unison.plugin.hookspecs` for the hooks)::

    checks, model build (seeded), data probe       no process group yet
    process group, replica sync, strategy.setup
    fit_start, (load_checkpoint)
    per step: epoch_start?, step_start, micro-batches, after_backward,
              before_optimizer_step, after_optimizer_step, step_end, log,
              epoch_end?, validation?, checkpoint?, agreed stop?
    final validation and checkpoint (unless that step just had them), fit_end
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from typing_extensions import Never  # typing.Never is 3.11+; unison supports 3.10

from unison.checkpointing.checkpointer import Checkpointer
from unison.checkpointing.resume import CkptPath
from unison.contract.env import DistEnv, world_from_env
from unison.contract.outputs import Progress
from unison.contract.ownership import ReplicaInit
from unison.contract.precision import Precision
from unison.contract.settings import TrainerSettings, parse_settings
from unison.contract.state import seed_everything
from unison.contract.strategy import LossFn, Strategy
from unison.data.loader import TrainData
from unison.errors import ConfigurationError
from unison.launch import collectives, messages
from unison.launch.lifecycle import RunGuard
from unison.launch.setup_report import SetupReport
from unison.launch.torchrun import check_nproc, start_workers
from unison.launch.watchdog import Watchdog, start_watchdog
from unison.plugin.manager import PluginManager
from unison.training import runs
from unison.training.checkpointing import CheckpointManager, DataPosition
from unison.training.loop import TrainLoop
from unison.training.metrics import MetricsLog
from unison.training.preflight import (
    OptimizerArg,
    SchedulerArg,
    TrainingStep,
    checked_optimizer,
    declare,
    prepare_fit,
)
from unison.training.record import FitRecord
from unison.training.validation import Validator
from unison.training.world import broadcast_module_state, build_precision, join_world

__all__ = ["Trainer"]


class Trainer:
    """Train a plain ``nn.Module`` with any registered strategy.

    Every option is a keyword argument with a type and a default (the fields
    of :class:`TrainerSettings`, which is also the ``[trainer]`` table of a
    config file), so editors complete them; the values are validated together
    and a bad one is a :class:`ConfigurationError` naming it.

    Args:
        strategy: registered strategy name (``unison strategies`` lists them).
        strategy_options: options of that strategy, validated by its own schema.
        precision: ``32-true``, ``bf16-mixed``, ``bf16-true``, ``16-mixed`` or a precision plugin's name.
        accumulate_grad_batches: micro-batches per optimizer step.
        global_batch_size: samples per optimizer step, all ranks together.
        max_steps: optimizer steps to train for (skipped fp16 steps count); set this or ``max_epochs``.
        max_epochs: passes over the training data to train for; set this or ``max_steps``.
        grad_clip_norm: clip by the global L2 norm over all shards; ``None`` only measures it.
        seed: seeds model construction (when ``fit`` gets a factory), data order and every RNG.
        shuffle: shuffle map-style data once per epoch (by seed and epoch, never by rank).
        log_every_n_steps: how often metrics go to loggers.
        val_every_n_steps: validate every N steps; with a val_dataset, always once at the end.
        val_batch_size: validation samples per rank per forward.
        root_dir: runs' home: each fit writes into a new ``root_dir/version_N`` (checkpoints, metrics).
            ``None``: metrics only, into ``runs/NAME/version_N`` under the working directory (see
            ``loggers``; NAME is the script's name, :func:`unison.training.runs.default_root`).
        checkpoint_dir: exactly where checkpoints go; ``None``: ``root_dir/version_N/checkpoints`` with a
            ``root_dir``, else none.
        checkpoint_every_n_steps: save every N steps (and always at the end when checkpoint_dir is set).
        keep_last_n_checkpoints: delete older committed checkpoints beyond this many.
        accelerator: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
        num_workers: DataLoader worker processes per rank (0: load in the training process).
        pin_memory: pin host batches so copies to the GPU are asynchronous.
        prefetch_factor: micro-batches each worker loads ahead (needs ``num_workers > 0``).
        persistent_workers: keep workers alive between epochs (needs ``num_workers > 0``).
        progress: progress display on rank 0: ``auto``, ``rich``, ``plain`` or ``off`` (``off`` also
            silences the run-directory and resume lines; warnings and errors still print).
        progress_every_n_steps: steps between plain progress lines; ``None`` prints about 20 per run.
        log_format: unison's messages (progress lines, setup, warnings, the failure report) as ``"text"``
            or ``"json"``, one object per line with time, level, rank, node, step, run id and message
            (:mod:`unison.launch.messages`); ``None``: ``UNISON_LOG_FORMAT`` (``--log-format``), else text.
        throughput: log step time, samples/s, tokens/s and peak memory (the default Throughput callback).
        nonfinite: a non-finite loss or grad norm in a precision without loss scaling: ``"raise"``
            (every rank raises :class:`NonFiniteError` naming that step; the check is read one step
            late, so no step waits for the device: the step's update has run in memory, but no
            checkpoint or validation uses it and no logger receives its metrics), ``"skip"`` (the step and the
            scheduler step are skipped, counted in ``progress.skipped_steps``; one device-to-host read
            per step, to decide before the update) or ``"continue"`` (no check).
        max_consecutive_skips: skipped steps in a row (fp16 overflows, or ``nonfinite="skip"``) after
            which training stops with :class:`NonFiniteError` instead of skipping forever.
        stall_timeout_s: seconds a rank's heartbeat may stop before every live rank names it, dumps its
            stacks and exits with code 3 (:mod:`unison.launch.watchdog`); ``None``: no watchdog.
        compile: ``torch.compile`` the model's forward before the strategy wraps it (per block under
            ``fsdp``, before sharding each): ``True`` with torch's defaults (inductor), or a dict of
            ``torch.compile`` keyword arguments. Names and state dicts do not change. A strategy that
            cannot declares it (``unison describe NAME``: ``refuses``) and the run is refused before any
            process group. The first steps include the compilation.
        activation_checkpointing: recompute the forward of the model's blocks in backward instead of
            keeping their activations: ``"full"`` (every block) or ``"selective:N"`` (every N-th); the
            blocks are the children of ``model.blocks`` (a ModuleList), or the split points of a pipeline
            (``pipeline_layers``, an ``nn.Sequential``'s children), those with parameters
            (:mod:`unison.contract.transforms`). Training is bit-for-bit the same; declared per strategy.
        nproc: processes on this node: ``python train.py`` then starts them itself (docs/launch.md);
            ``None``: as launched.
        callbacks: pluggy plugins (objects with ``@unison.hookimpl`` methods).
        loggers: also plugins; they implement ``unison_log_metrics``. None given: JSONL and CSV
            metrics in the run directory (``root_dir/version_N``, else ``runs/NAME/version_N``).
            ``False``: no metric logger at all, and no run directory without a ``root_dir``.
        plugin_manager: reuse a manager instead of building one (advanced).

    Every check that can be made before the process group starts is made here
    and at the start of :meth:`fit`.

    What a fit decided is read through read-only properties (``env``,
    ``run_dir``, ``checkpointer``, ``resumed_from``, ``precision``, ``data``,
    ``lr_scheduler``, ``loss_fn``, ``training_step``, ``control_group``,
    ``setup_started``), kept from the latest fit until the next one starts;
    a fit changes nothing else on the trainer but its documented results:
    ``progress``, ``last_validation``, ``should_stop`` and what
    :meth:`full_state_dict` returns (:mod:`unison.training.record`).
    """

    def __init__(
        self,
        *,
        strategy: str = "single",
        nproc: int | None = None,
        strategy_options: dict[str, Any] | None = None,
        precision: str = "32-true",
        accumulate_grad_batches: int = 1,
        global_batch_size: int = 32,
        max_steps: int | None = None,
        max_epochs: int | None = None,
        grad_clip_norm: float | None = None,
        seed: int = 0,
        shuffle: bool = True,
        log_every_n_steps: int = 1,
        val_every_n_steps: int | None = None,
        val_batch_size: int = 32,
        root_dir: str | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_every_n_steps: int | None = None,
        keep_last_n_checkpoints: int | None = None,
        accelerator: Literal["auto", "cpu", "cuda"] = "auto",
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        progress: Literal["auto", "rich", "plain", "off"] = "auto",
        progress_every_n_steps: int | None = None,
        log_format: Literal["text", "json"] | None = None,
        throughput: bool = True,
        nonfinite: Literal["raise", "skip", "continue"] = "raise",
        max_consecutive_skips: int = 25,
        stall_timeout_s: float | None = 300.0,
        compile: bool | dict[str, Any] = False,
        activation_checkpointing: str | None = None,
        callbacks: Iterable[Any] = (),
        loggers: Iterable[Any] | Literal[False] = (),
        plugin_manager: PluginManager | None = None,
        **unknown: Never,
    ) -> None:
        # ``unknown`` is typed Never so type checkers flag a misspelled option; at run time it is kept so
        # the typo is a ConfigurationError with the closest name (exit 2), not a bare TypeError.
        given = {name: value for name, value in locals().items() if name in TrainerSettings.model_fields}
        if strategy_options is None:
            given.pop("strategy_options")
        self.settings = parse_settings({**given, **unknown})
        # Before any message: this process and the workers it may start print in the chosen format.
        me = weakref.ref(self)  # the messages' context must not keep a finished trainer alive
        messages.configure(
            self.settings.log_format,
            step=lambda: t.global_step if (t := me()) is not None and t.env is not None else None,
            rank=lambda: t.env.rank if (t := me()) is not None and t.env is not None else None,
        )
        self.nonfinite, self.max_consecutive_skips = self.settings.nonfinite, self.settings.max_consecutive_skips
        if self.settings.root_dir is not None:
            runs.check_root(self.settings.root_dir)  # before the default loggers open it
        self.pm = plugin_manager or PluginManager()
        if loggers is True:
            raise ConfigurationError(
                "loggers",
                "True is not a list of loggers",
                "leave loggers out for the default JSONL and CSV metrics, pass loggers=[...], or loggers=False",
            )
        explicit = [*callbacks, *(loggers or ())]
        for plugin in explicit:
            self.pm.register(plugin)
        # Progress display, throughput and default metrics come from plugins, so the core never imports them.
        for plugin in self.pm.unison_default_plugins(settings=self.settings, plugins=explicit):
            if loggers is False and hasattr(plugin, "unison_log_metrics"):
                continue  # loggers=False: not even the default ones
            self.pm.register(plugin)
        self.pm.check_pending()
        _, world_size, _ = world_from_env()
        start_here = check_nproc(self.settings.nproc)  # nproc > 1 and no launcher: start the workers below
        if start_here:
            assert self.settings.nproc is not None  # check_nproc: nproc > 1
            world_size = self.settings.nproc
        #: The strategy, its precision support and the step's sizes, checked for this world (made once).
        self._declared = declare(self.settings, self.pm, world_size)
        self.strategy: Strategy = self._declared.strategy
        if start_here:
            start_workers(world_size)  # checked for that world; exits with the job's code
        self.ownership = self.strategy.ownership
        self.progress = Progress()
        #: Set by a plugin to end training after the current step. Every
        #: rank's flag is combined at the step boundary: one rank asking
        #: stops all ranks after the same step, in a world one step later
        #: (after step k+1 for a flag set during step k, unless step k
        #: validates or saves a checkpoint; :mod:`unison.training.stopping`).
        self.should_stop = False
        s = self.settings
        #: The explicit ``checkpoint_dir``'s checkpointer (a fit with a ``root_dir`` and none makes its own).
        self._given_checkpointer = (
            Checkpointer(s.checkpoint_dir, s.keep_last_n_checkpoints) if s.checkpoint_dir else None
        )
        #: The latest fit's values and parts (:mod:`unison.training.record`); ``None`` until its checks pass.
        self._fit: FitRecord | None = None
        #: Every metric's way to the loggers (trainer.log(), the step's, validation's).
        self._metrics = MetricsLog(self)
        #: Metrics of the most recent validation loop (``{"val/loss": mean loss over the whole
        #: validation set, weighted by samples, all ranks reduced}``, the same on every rank), or
        #: ``None`` before the first validation. ``fit`` validates at the end when given a val_dataset.
        self.last_validation: dict[str, float] | None = None
        self.pm.unison_on_trainer_init(trainer=self)

    # -- properties -------------------------------------------------------- #
    # What the latest fit decided, read from its record (:mod:`unison.training.record`); none has a
    # setter, so no part of a fit can assign into the trainer.
    @property
    def global_step(self) -> int:
        return self.progress.global_step

    @property
    def control_group(self) -> Any:
        """The CPU (gloo) process group for small host-side agreements during ``fit`` (``None``: the
        default group, which is gloo already, or no world); every rank must call a collective on it alike."""
        f = self._fit
        return f.world.control_group if f is not None and f.world is not None and f.active else None

    @property
    def setup_started(self) -> bool:
        """``False`` until ``fit`` has finished its checks and starts the process group and the strategy's
        setup (refusals only ever happen before)."""
        return self._fit is not None

    @property
    def env(self) -> DistEnv | None:
        """This rank's place in the fit's world (``None`` before a fit joins one; kept after it)."""
        f = self._fit
        return f.world.env if f is not None and f.world is not None else None

    @property
    def precision(self) -> Precision | None:
        """The fit's precision plugin (a :class:`~unison.contract.precision.DelegatedPrecision` when the
        strategy applies the precision), ``None`` before the strategy's setup."""
        return self._fit.precision if self._fit is not None else None

    @property
    def lr_scheduler(self) -> Any:
        """The fit's scheduler, built on the strategy's optimizer (``None`` without ``lr_scheduler``)."""
        return self._fit.lr_scheduler if self._fit is not None else None

    @property
    def data(self) -> TrainData | None:
        """The fit's training data (sampling, loading, position)."""
        return self._fit.plan.data if self._fit is not None else None

    @property
    def loss_fn(self) -> LossFn | None:
        """The fit's ``loss_fn`` (``None`` in the ``training_step`` form)."""
        return self._fit.plan.loss_fn if self._fit is not None else None

    @property
    def training_step(self) -> TrainingStep | None:
        """The fit's ``training_step``: the user's, the Hugging Face path's when neither form was given, or ``None``."""
        return self._fit.plan.training_step if self._fit is not None else None

    @property
    def run_dir(self) -> Path | None:
        """The fit's ``root_dir/version_N`` (``None`` without a ``root_dir``); see :mod:`unison.training.runs`."""
        return self._fit.place.run_dir if self._fit is not None else None

    @property
    def checkpointer(self) -> Checkpointer | None:
        """The checkpointer the fit writes with: ``checkpoint_dir``'s, or its run directory's ``checkpoints/``."""
        return self._fit.place.checkpointer if self._fit is not None else self._given_checkpointer

    @property
    def resumed_from(self) -> dict[str, Any] | None:
        """``{"step": N, "checkpoint": PATH}`` of the checkpoint the fit resumes from (its manifest's step
        until it is loaded, then the loaded one's), or ``None``."""
        f = self._fit
        if f is None:
            return None
        if f.checkpoints is not None and f.checkpoints.resumed_from is not None:
            return f.checkpoints.resumed_from
        return dict(f.place.resumed_from) if f.place.resumed_from is not None else None

    @property
    def is_global_zero(self) -> bool:
        return self.env is None or self.env.rank == 0

    @property
    def model(self) -> torch.nn.Module:
        """The user's module (unwrapped) as trained by the strategy."""
        assert self.strategy.module is not None, "fit() has not set up the model yet"
        return self.strategy.module

    # -- fit ----------------------------------------------------------------- #
    def fit(
        self,
        model: torch.nn.Module | Callable[[], torch.nn.Module],
        train_dataset: Any,
        *,
        loss_fn: LossFn | None = None,
        training_step: TrainingStep | None = None,
        optimizer: OptimizerArg,
        lr_scheduler: SchedulerArg | None = None,
        val_dataset: Any = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        ckpt_path: CkptPath = None,
        count_tokens: Callable[[Any], int | None] | None = None,
    ) -> Progress:
        """Train for ``max_steps`` optimizer steps or ``max_epochs`` passes.

        Args:
            model: an ``nn.Module``, or a zero-argument factory returning one
                (the trainer seeds with ``seed`` first, so reruns and ranks
                build identical weights). Either way every replica starts from
                global rank 0's weights (see ``Ownership.replica_init``).
            train_dataset: a map-style dataset, an ``IterableDataset``, a
                Hugging Face dataset (map-style or streaming) or a
                ``DataLoader`` (its dataset, collate_fn and worker settings are
                used; the trainer does the sampling). See :mod:`unison.data.loader`.
            loss_fn: the ``(inputs, targets)`` form: each batch is a pair and
                ``loss_fn(model(inputs), targets)`` returns the micro-batch's
                mean loss (a scalar tensor), or the pair ``(loss_sum,
                num_items)``: then the step trains on the global batch's sum over
                its global item count, whatever the world size or accumulation
                split (token-weighted losses; :mod:`unison.training.losses`).
            training_step: the form for batches of any structure:
                ``training_step(model, batch)`` returns the micro-batch's mean
                loss, e.g. ``lambda model, batch: model(**batch).loss``, or the
                pair as above. ``model`` is the strategy's forward callable (a
                DDP/FSDP/engine wrapper; ``trainer.model`` is the unwrapped
                module). At most one of ``loss_fn`` and ``training_step``;
                validation uses the same. Neither: dict batches holding
                ``labels`` train the model's own loss (a Hugging Face model)
                normalised by the step's global count of labels ``!= -100``, with
                ``num_items_in_batch`` passed where the forward accepts it.
            optimizer: ``params -> Optimizer`` (called with the parameters the
                strategy trains, or parameter groups).
            lr_scheduler: ``optimizer -> LRScheduler``; stepped once per
                optimizer step that was not skipped.
            val_dataset: validated every ``val_every_n_steps`` and at the end.
            collate_fn: list of samples -> batch (default ``default_collate``),
                e.g. a Hugging Face data collator; also used for validation.
            ckpt_path: where to resume from. ``"auto"``: the newest committed
                checkpoint in ``checkpoint_dir`` that verifies, or a fresh
                start when there is none (write a job once, restart it blindly);
                with a ``root_dir``, the newest run's, continued in its
                ``version_N`` (see :mod:`unison.training.runs`). ``"last"``: the newest
                committed one, which must exist and verify. A path: that
                checkpoint. ``None``: start fresh: a new ``version_N`` under
                ``root_dir``; an explicit ``checkpoint_dir`` must then hold no
                other run's checkpoints. A resume prints ``resuming from step
                N: PATH`` once (rank 0, stderr; not with ``progress="off"``).
                Parsed once into a :class:`~unison.checkpointing.resume.ResumeRequest`
                (also accepted here); anything else is a ``ConfigurationError``.
            count_tokens: batch -> tokens, replacing the rule of
                :func:`unison.data.batch.count_tokens` for throughput metrics.

        As it starts, and as each setup phase that can take long begins (the
        process group's rendezvous, the strategy's setup of the model, finding
        and loading a checkpoint to resume), ``fit`` prints one ``unison:
        setting up ...`` line (global rank 0, stderr; none with
        ``progress="off"``).

        On SIGTERM or SIGUSR1 every rank finishes the current optimizer step
        (in a world, the next one too, unless the current one validates or
        saves a checkpoint: the ranks agree without blocking, one step late), a
        checkpoint is committed (with ``checkpoint_dir``) and ``fit`` raises
        :class:`unison.launch.lifecycle.Preempted`, a ``SystemExit`` with code 75.

        Returns:
            :class:`Progress` (also ``trainer.progress``): the step counters,
            ``metrics`` (the latest value of every logged metric, e.g.
            ``train/loss`` and ``val/loss``), ``checkpoint`` (the newest
            committed checkpoint, or ``None``) and ``run_dir`` (where the
            metrics went: ``root_dir/version_N``, or by default
            ``runs/NAME/version_N``; see :class:`Progress`).
        """
        s = self.settings
        rank, world_size, _ = world_from_env()
        say = SetupReport(s.progress, rank)
        say(f"training with strategy {s.strategy!r}, world size {world_size}: checking model, data and options")
        self._fit = None  # a failed check leaves no earlier fit's record behind (setup_started is False)
        plan = prepare_fit(
            s,
            self._declared,
            model,
            train_dataset,
            loss_fn=loss_fn,
            training_step=training_step,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            val_dataset=val_dataset,
            collate_fn=collate_fn,
            ckpt_path=ckpt_path,
            count_tokens=count_tokens,
            rank=rank,
            world_size=world_size,
            checkpointer=self._given_checkpointer,
        )
        self.should_stop = False
        # From here on nothing is refused as bad input: failures are errors.
        guard = RunGuard()
        self._fit = fit = FitRecord(plan, say, guard, Watchdog(None, 0, 1), plan.place)
        try:
            with guard:  # SIGTERM/SIGUSR1 -> stop at a step boundary; first error to torchrun
                fit.world = world = join_world(self.strategy, s, say)
                fit.active = True
                fit.watchdog = guard.watch(start_watchdog(s.stall_timeout_s, world.env.rank, world.env.world_size))
                fit.place = runs.agree(s, plan.place, world.env.rank)  # a bare torchrun's ranks take rank 0's version
                if fit.place.checkpointer is not None:
                    # One writer per checkpoint directory: rank 0 takes the lease, every rank hears the
                    # outcome before any setup or step (unison.checkpointing.lease says why here and not earlier).
                    fit.place.checkpointer.admission.acquire(plan.resume)
                self._run_fit(fit, optimizer, lr_scheduler)
        except BaseException as exc:
            checkpointer = fit.place.checkpointer
            if isinstance(exc, KeyboardInterrupt) and checkpointer is not None and self.is_global_zero:
                # Ctrl-C stops at once (SIGTERM stops at a step boundary and saves): name what is committed.
                latest = checkpointer.latest()
                messages.say(
                    f"unison: interrupted after step {self.global_step}; last committed checkpoint: {latest}",
                    level="warning",
                )
            self.pm.unison_on_exception(trainer=self, exception=exc)
            raise
        finally:
            if fit.place.checkpointer is not None:
                fit.place.checkpointer.admission.release()
            plan.data.close()
            self.strategy.teardown()
            if fit.world is not None and fit.world.owns_process_group:
                torch.distributed.destroy_process_group()
            fit.active = False
        return self.progress

    def _run_fit(self, fit: FitRecord, optimizer: OptimizerArg, lr_scheduler: SchedulerArg | None) -> None:
        plan, s, hook, strategy = fit.plan, self.settings, self.pm, self.strategy
        assert fit.world is not None
        env, model, data = fit.world.env, plan.model, plan.data
        seed_everything(s.seed)
        if self.ownership.replica_init is ReplicaInit.TRAINER and env.distributed and env.world_size > 1:
            # Whatever the user passed, replicas never start apart.
            model = model.to(env.device)
            broadcast_module_state(model)
        fit.precision = precision = build_precision(plan.declared.precision, s, self.pm, strategy, env.device)
        module = precision.convert_module(model)
        fit.say(f"the model under strategy {s.strategy!r} ({type(model).__name__}, device {env.device})")
        # Bound before the call, not only by the template: a strategy that overrides setup as the 2.0
        # migration says (adding env=None) never binds them, and its hooks (to_device) need them.
        strategy.env, strategy.precision, strategy.settings = env, precision, s
        strategy.setup(
            module, lambda params: checked_optimizer(optimizer, params), env=env, precision=precision, settings=s
        )
        fit.lr_scheduler = lr_scheduler(strategy.optimizer) if lr_scheduler else None
        data.to_device = strategy.to_device
        if env.world_size > 1:  # the last collective each rank entered, for a stall report (assignments only)
            watchdog = fit.watchdog  # (not the record: the recorder outlives the fit, and must not keep it)
            collectives.install(lambda: watchdog.where)
        self.progress = Progress()
        # What a checkpoint holds besides the strategy's files and the RNG, by its name in trainer.pt.
        fit.checkpoints = checkpoints = CheckpointManager(
            self,
            fit.place.checkpointer,
            {
                "progress": self.progress,
                "scheduler": fit.lr_scheduler,
                "precision": precision,
                "data": DataPosition(data, self.progress),
            },
            settings=s,
            strategy=strategy,
            env=env,
        )
        fit.validator = validator = Validator(self, plan, precision, env.device, self._metrics)
        fit.loop = TrainLoop(
            self,
            validator,
            checkpoints,
            self._metrics,
            plan=plan,
            precision=precision,
            lr_scheduler=fit.lr_scheduler,
            env=env,
            guard=fit.guard,
            watchdog=fit.watchdog,
            control_group=fit.world.control_group,
        )

        hook.unison_on_fit_start(trainer=self)
        if not plan.resume.fresh:
            fit.watchdog.mark(0, "load_checkpoint")
            fit.say(f"the resume: finding and loading the checkpoint ({plan.resume})")
            checkpoints.load(plan.resume)

        self._metrics.fitting = True
        try:
            fit.loop.run()
        finally:
            self._metrics.fitting = False
        step = self.progress.global_step
        fit.watchdog.mark(step, "fit_end")
        # The end: validation and checkpoint once, unless the last step just had them.
        if validator.should_validate_at_end(step):
            self.validate()
        if checkpoints.should_save_at_end(step):
            self.save_checkpoint()
        self._metrics.flush()
        if fit.place.checkpointer is not None:
            latest = fit.place.checkpointer.latest()
            self.progress.checkpoint = str(latest) if latest is not None else None
        self.progress.run_dir = str(fit.place.run_dir) if fit.place.run_dir is not None else None
        # Kept so that full_state_dict() works after fit tore the strategy down.
        fit.final_state = self.strategy.full_state_dict()
        hook.unison_on_fit_end(trainer=self)
        if fit.place.checkpointer is not None and env.world_size > 1 and torch.distributed.is_initialized():
            # The lease is given back before fit returns on any rank: a next fit in this world (the same
            # processes, a loop of fits) reads it before any collective, and would find this fit's on a
            # rank that got there first (rank 0 gives it back). The release in fit's finally is then a no-op.
            fit.place.checkpointer.admission.release()
            torch.distributed.barrier(group=fit.world.control_group)

    # -- validation ------------------------------------------------------------ #
    def validate(self, dataset: Any = None) -> dict[str, float]:
        """Mean loss over the validation set (every sample once, reduced over replicas).

        Uses the fit's ``val_dataset`` unless ``dataset`` is given; called on every rank
        (see :class:`unison.training.validation.Validator`).
        """
        validator = self._fit.validator if self._fit is not None else None
        assert validator is not None, "validate() needs the model fit() set up"
        return validator.validate(dataset)

    # -- logging ------------------------------------------------------------------ #
    def log(self, metrics: Mapping[str, Any]) -> None:
        """Send user metrics to every logger (``unison_log_metrics``) at the current step.

        Usable from callbacks and from ``training_step``. Values may be numbers
        or 0-dim tensors; during a training step they are kept (the latest
        value per name) and sent with the step's own metrics at the next
        logging step, so logging from ``training_step`` costs no device sync
        on steps that are not logged. Values are sent as given on each rank
        (reduce them yourself if they differ per rank); file loggers write
        rank 0's.
        """
        self._metrics.log(metrics)

    # -- state ----------------------------------------------------------------- #
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Canonical model state: unsharded, fp32, on CPU, the model's own names.

        Collective (call on every rank while ``fit`` has set up the strategy, or
        after ``fit`` returns: the trainer keeps the last state). Returned on
        every rank.
        """
        if self.strategy.model is None:
            final = self._fit.final_state if self._fit is not None else None
            if final is None:
                raise RuntimeError("full_state_dict() needs a model: call fit() first")
            return final
        return self.strategy.full_state_dict()

    def save_checkpoint(self) -> Path:
        """Write and commit a checkpoint for the current step (collective, atomic, verified on load).

        What it holds: :mod:`unison.training.checkpointing`. A step whose non-finite
        check is still unread (``nonfinite="raise"`` reads it one step late) is
        read first: a non-finite one raises :class:`NonFiniteError` and nothing is written.
        """
        fit = self._fit
        assert fit is not None and fit.checkpoints is not None and fit.place.checkpointer is not None
        if fit.loop is not None:
            fit.loop.nonfinite.resolve()
        started = time.perf_counter()
        path = fit.checkpoints.save()
        # The save's wall time on this rank (written, hashed, committed) and the checkpoint's bytes; during a
        # fit they go with the next logging step's metrics (or the fit's last), outside one at once.
        saved = {"checkpoint/save_time_s": time.perf_counter() - started}
        checkpointer = fit.place.checkpointer
        if checkpointer.last_bytes is not None:
            saved["checkpoint/size_bytes"] = float(checkpointer.last_bytes)
        if fit.active:
            self._metrics.keep(saved)
        else:
            self.log(saved)
        retries = getattr(checkpointer.storage, "retries", None)
        if retries is not None:  # object storage: calls retried after transient failures, so far in this run
            self.log({"checkpoint/storage_retries": float(retries)})
        return path
