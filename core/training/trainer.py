"""The Trainer: owns the loop, reads strategy declarations, calls hooks.

The loop never branches on a strategy's class or name. Where it behaves
differently per backend it reads :attr:`Strategy.ownership`:

* ``grad_accumulation`` picks how micro-batches are fed (see
  :mod:`unison.contract.strategy` for the three interfaces);
* ``precision[name].owner`` picks whether the trainer applies the precision
  (autocast, scaler, casts) or leaves it to the engine or sharding policy;
* ``replica_init`` says whether the trainer broadcasts rank 0's weights;
* ``refuses`` / ``world_sizes`` say what is refused before any process group.

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

import contextlib
import inspect
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Never

import torch

from unison.checkpointing.checkpointer import Checkpointer, check_resume_step, resume_point
from unison.contract.env import DistEnv, device_for, resolve_accelerator, world_from_env
from unison.contract.ownership import AccumulationOwner, Feature, GradSync, ReplicaInit
from unison.contract.precision import DelegatedPrecision, Precision
from unison.contract.settings import TrainerSettings, parse_settings
from unison.contract.state import rng_state, seed_everything, set_rng_state
from unison.contract.strategy import LossFn, Strategy, check_contract
from unison.data.loader import TrainData, check_divisible, is_map_style, resolve_source, validation_stream
from unison.errors import ConfigurationError, DeclaredRefusal, UnisonError
from unison.launch.lifecycle import RunGuard, collective_timeout_s, init_process_group
from unison.launch.setup_report import SetupReport
from unison.launch.torchrun import check_nproc, start_workers
from unison.launch.watchdog import Watchdog, check_stall_timeout, start_watchdog
from unison.plugin.manager import PluginManager
from unison.training import runs

OptimizerArg = Callable[[Any], torch.optim.Optimizer]
SchedulerArg = Callable[[torch.optim.Optimizer], Any]
TrainingStep = Callable[[Any, Any], torch.Tensor]

#: Steps kept in :attr:`Progress.history` (a bounded window; never saved in checkpoints).
HISTORY_LENGTH = 1000

__all__ = ["NonFiniteError", "Progress", "StepOutput", "Trainer", "TrainerSettings", "build_strategy"]


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
    ) -> None:
        self.step = step
        #: Every micro-batch's loss, averaged over data-parallel replicas (device tensor).
        self.micro_loss_tensor = micro_losses
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
        """The global-batch mean loss (0-dim device tensor)."""
        return self.micro_loss_tensor.mean()

    @property
    def micro_losses(self) -> list[float]:
        if "micro" not in self._cache:
            self._cache["micro"] = self.micro_loss_tensor.tolist()
        return self._cache["micro"]

    @property
    def loss(self) -> float:
        micro = self.micro_losses
        return sum(micro) / len(micro)

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
            self._cache["tokens"] = int(self._tokens)
        return self._cache["tokens"]

    _KEYS = ("step", "loss", "micro_losses", "grad_norm", "lr", "lrs", "skipped", "samples", "tokens")

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
            **{k: int(state.get(k, 0)) for k in ("global_step", "optimizer_steps", "scheduler_steps", "skipped_steps")}
        )


# --------------------------------------------------------------------------- #
# Checks before any process group
# --------------------------------------------------------------------------- #


def _refuse(strategy: Strategy, feature: Feature, option: str, fix: str) -> None:
    reason = strategy.ownership.refusal(feature)
    if reason is not None:
        raise DeclaredRefusal(
            option,
            f"strategy {strategy.name!r} declares it does not support {feature.description}: {reason}",
            fix + f" (see `unison describe {strategy.name}`)",
            feature=feature.value,
        )


def build_strategy(settings: TrainerSettings, pm: PluginManager, world_size: int) -> Strategy:
    """Create the strategy and check the settings against its declaration for ``world_size`` ranks.

    Everything here runs before any process group exists; launchers call it
    too so that bad input fails before workers start.
    """
    strategy = pm.strategies.create(settings.strategy, settings.strategy_options)
    check_contract(strategy)
    ownership = strategy.ownership
    support = ownership.precision_support(settings.precision)
    if not support.supported:
        raise DeclaredRefusal(
            "precision",
            f"strategy {settings.strategy!r} does not support precision {settings.precision!r}: {support.detail}",
            f"pick a precision the strategy supports (see `unison describe {settings.strategy}`)",
            feature=f"precision:{settings.precision}",
        )
    if support.applied_by_trainer:
        spec = pm.precisions.get(settings.precision)
        if spec.unavailable:
            raise ConfigurationError(
                "precision", f"{spec.name!r} is unavailable here: {spec.unavailable}", "pick another precision"
            )
    refused_world = ownership.world_sizes.refusal(world_size)
    if refused_world is not None:
        raise DeclaredRefusal(
            "world size",
            f"strategy {settings.strategy!r} cannot run here: {refused_world}",
            "launch a world size the strategy declares (see `unison describe " + settings.strategy + "`)",
            feature="world_size",
        )
    if settings.accumulate_grad_batches > 1:
        _refuse(strategy, Feature.GRADIENT_ACCUMULATION, "accumulate_grad_batches", "set accumulate_grad_batches=1")
    if settings.grad_clip_norm is not None:
        _refuse(strategy, Feature.GRADIENT_CLIPPING, "grad_clip_norm", "set grad_clip_norm=None")
    resolve_accelerator(settings.accelerator)
    strategy.validate(settings, world_size)
    check_divisible(
        settings.global_batch_size, settings.accumulate_grad_batches, strategy.data_parallel_size(world_size)
    )
    return strategy


def _check_callable(value: Any, option: str, shape: str, example: str, arity: int) -> None:
    if not callable(value):
        raise ConfigurationError(
            option, f"expected a callable {shape}, got {type(value).__name__}", f"pass e.g. {example}"
        )
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    try:
        signature.bind(*([object()] * arity))
    except TypeError as exc:
        raise ConfigurationError(
            option, f"{option}{signature} cannot be called as {shape} ({exc})", f"pass e.g. {example}"
        ) from None


def _check_loss_fn(loss_fn: Any) -> None:
    """The trainer calls ``loss_fn(outputs, targets)`` and nothing else, on every backend.

    Pipelines compute the loss on the last stage, which holds only the model's
    outputs and the targets; a loss that needs more (the inputs, the model)
    could never run there, so it is refused for every strategy alike.
    """
    _check_callable(
        loss_fn,
        "loss_fn",
        "loss_fn(outputs, targets)",
        "torch.nn.functional.cross_entropy; compute anything that needs the inputs inside the model's forward, or "
        "use training_step=lambda model, batch: ... (a pipeline's last stage has only its outputs and the targets)",
        2,
    )


def _build_model(model: Any, seed: int) -> torch.nn.Module:
    """The model, built after seeding when ``model`` is a zero-argument factory."""
    if isinstance(model, torch.nn.Module):
        return model
    if not callable(model):
        raise ConfigurationError(
            "model",
            f"expected an nn.Module or a zero-argument factory returning one, got {type(model).__name__}",
            "pass the model, or `lambda: MyModel(config)`",
        )
    # Seed first: reruns and every rank build identical weights.
    seed_everything(seed)
    built = model()
    if not isinstance(built, torch.nn.Module):
        raise ConfigurationError(
            "model",
            f"the model factory returned {type(built).__name__}, not a torch.nn.Module",
            "return the constructed module from the factory",
        )
    return built


def _probe_optimizer(optimizer: Any, lr_scheduler: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Call the factories once on the real parameters, check what they return; return the probe optimizer."""
    _check_callable(optimizer, "optimizer", "optimizer(params)", "lambda params: torch.optim.AdamW(params, lr=1e-3)", 1)
    if isinstance(optimizer, torch.optim.Optimizer):  # pragma: no cover - caught by the callable check above
        raise ConfigurationError("optimizer", "got an Optimizer instance", "pass a factory: lambda params: ...")
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = _checked_optimizer(optimizer, trainable)
    if lr_scheduler is not None:
        _check_callable(
            lr_scheduler,
            "lr_scheduler",
            "lr_scheduler(optimizer)",
            "lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)",
            1,
        )
        _check_scheduler(lr_scheduler(opt))
    return opt


def _checked_optimizer(factory: OptimizerArg, params: Any) -> torch.optim.Optimizer:
    """``factory(params)``, refused unless it is an Optimizer over every trainable parameter given."""
    params = list(params)
    opt = factory(params)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigurationError(
            "optimizer",
            f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer",
            "return e.g. torch.optim.AdamW(params, lr=1e-3) built on the params argument",
        )
    given = {id(p) for p in params if isinstance(p, torch.Tensor) and p.requires_grad}
    for group in params:
        if isinstance(group, Mapping):
            given |= {id(p) for p in group["params"] if p.requires_grad}
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    missing = given - held
    if missing:
        raise ConfigurationError(
            "optimizer",
            f"the optimizer holds {len(given) - len(missing)} of the {len(given)} trainable parameters it was given "
            "(a factory that ignores its argument trains nothing)",
            "build the optimizer on the params argument: lambda params: torch.optim.AdamW(params, lr=1e-3)",
        )
    return opt


def _check_scheduler(scheduler: Any) -> None:
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigurationError(
            "lr_scheduler",
            "ReduceLROnPlateau steps on a monitored metric, but the trainer steps the scheduler "
            "once per optimizer step without one",
            "use a step-based scheduler (e.g. CosineAnnealingLR, LambdaLR)",
        )
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise ConfigurationError(
            "lr_scheduler",
            f"the scheduler factory returned {type(scheduler).__name__}, not a torch LRScheduler",
            "return e.g. torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100) built on its argument",
        )


def _broadcast_module_state(module: torch.nn.Module, src: int = 0) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s, in buckets of one dtype."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    tensors = [t.data for t in [*module.parameters(), *module.buffers()]]
    seen: set[int] = set()
    unique = [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]  # tied weights once
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in unique:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    bucket_bytes = 64 << 20
    for group in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in [*group, None]:
            if t is not None:
                bucket.append(t)
                size += t.numel() * t.element_size()
            if bucket and (t is None or size >= bucket_bytes):
                flat = _flatten_dense_tensors(bucket)
                torch.distributed.broadcast(flat, src=src)
                for dst, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    dst.copy_(value)
                bucket, size = [], 0


# --------------------------------------------------------------------------- #
# The trainer
# --------------------------------------------------------------------------- #


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
        throughput: log step time, samples/s, tokens/s and peak memory (the default Throughput callback).
        nonfinite: a non-finite loss or grad norm in a precision without loss scaling: ``"raise"``
            (every rank stops at that step with :class:`NonFiniteError`, before the optimizer step, so
            no checkpoint holds non-finite weights; one device-to-host read per step), ``"skip"`` (the
            step and the scheduler step are skipped, counted in ``progress.skipped_steps``) or
            ``"continue"`` (no check).
        max_consecutive_skips: skipped steps in a row (fp16 overflows, or ``nonfinite="skip"``) after
            which training stops with :class:`NonFiniteError` instead of skipping forever.
        stall_timeout_s: seconds a rank's heartbeat may stop before every live rank names it, dumps its
            stacks and exits with code 3 (:mod:`unison.launch.watchdog`); ``None``: no watchdog.
        nproc: processes on this node: ``python train.py`` then starts them itself (docs/launch.md);
            ``None``: as launched.
        callbacks: pluggy plugins (objects with ``@unison.hookimpl`` methods).
        loggers: also plugins; they implement ``unison_log_metrics``. None given: JSONL and CSV
            metrics in the run directory (``root_dir/version_N``, else ``runs/NAME/version_N``).
            ``False``: no metric logger at all, and no run directory without a ``root_dir``.
        plugin_manager: reuse a manager instead of building one (advanced).

    Every check that can be made before the process group starts is made here
    and at the start of :meth:`fit`.
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
        throughput: bool = True,
        nonfinite: Literal["raise", "skip", "continue"] = "raise",
        max_consecutive_skips: int = 25,
        stall_timeout_s: float | None = 300.0,
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
        world_size = self.settings.nproc if start_here else world_size
        self.strategy: Strategy = build_strategy(self.settings, self.pm, world_size)
        if start_here:
            start_workers(world_size)  # checked for that world; exits with the job's code
        self.ownership = self.strategy.ownership
        self.progress = Progress()
        #: Set by a plugin to end training after the current step. Every
        #: rank's flag is combined at the step boundary: one rank asking
        #: stops all ranks at the same step.
        self.should_stop = False
        self.env: DistEnv | None = None
        self.precision: Precision | None = None
        self.lr_scheduler: Any = None
        self.data: TrainData | None = None
        s = self.settings
        self.checkpointer = Checkpointer(s.checkpoint_dir, s.keep_last_n_checkpoints) if s.checkpoint_dir else None
        #: This fit's ``root_dir/version_N`` (``None`` without a ``root_dir``); see :mod:`unison.training.runs`.
        self.run_dir: Path | None = None
        #: ``{"step": N, "checkpoint": PATH}`` of the checkpoint this fit resumes from, or ``None``.
        self.resumed_from: dict[str, Any] | None = None
        self._owns_process_group = False
        self._control_group: Any = None
        self._guard: RunGuard | None = None  # set for the duration of fit
        #: Where this rank is, (step, phase), for the stall watchdog; inert until fit starts one.
        self._watchdog = Watchdog(None, 0, 1)
        #: ``unison: setting up ...`` lines for fit's slow phases (set per fit: rank 0 only, quiet with progress off).
        self._say = SetupReport("off", 0)
        #: ``False`` until ``fit`` has finished its checks and starts the process
        #: group and the strategy's setup (refusals only ever happen before).
        self.setup_started = False
        self._final_state: dict[str, torch.Tensor] | None = None
        self._pending_metrics: dict[str, Any] = {}
        #: True inside the training loop: trainer.log() then waits for the next logging step.
        self._fitting = False
        self._consecutive_skips = 0
        self.loss_fn: LossFn | None = None
        self.training_step: TrainingStep | None = None
        #: Metrics of the most recent validation loop (``{"val/loss": mean loss over the whole
        #: validation set, weighted by samples, all ranks reduced}``, the same on every rank), or
        #: ``None`` before the first validation. ``fit`` validates at the end when given a val_dataset.
        self.last_validation: dict[str, float] | None = None
        self.pm.unison_on_trainer_init(trainer=self)

    # -- properties -------------------------------------------------------- #
    @property
    def global_step(self) -> int:
        return self.progress.global_step

    @property
    def is_global_zero(self) -> bool:
        return self.env is None or self.env.rank == 0

    @property
    def model(self) -> torch.nn.Module:
        """The user's module (unwrapped) as trained by the strategy."""
        assert self.strategy.module is not None, "fit() has not set up the model yet"
        return self.strategy.module

    # -- environment ------------------------------------------------------- #
    def _setup_environment(self) -> DistEnv:
        rank, world_size, local_rank = world_from_env()
        device = device_for(self.settings.accelerator, local_rank)
        backend = self.strategy.process_group_backend(device)
        dist = torch.distributed
        if dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        elif backend is not None:
            if "MASTER_ADDR" in os.environ:
                self._say(f"the process group ({backend}, world size {world_size}): waiting for every rank")
                init_process_group(backend)  # rendezvous fails in minutes, not the 10-minute default
            else:
                # A distributed strategy on one process without a launcher: a
                # real, private world of 1 (no network rendezvous needed), never silently.
                if self.settings.nproc is None:
                    print(
                        f"unison: strategy {self.settings.strategy!r} trains in 1 process: nothing launched more. "
                        "For N processes: Trainer(..., nproc=N), or `unison run --nproc N script.py`",
                        file=sys.stderr,
                        flush=True,
                    )
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            self._owns_process_group = True
            rank, world_size = dist.get_rank(), dist.get_world_size()
        if dist.is_initialized() and world_size > 1:
            # Stop decisions travel on a CPU group: agreeing on them never
            # waits for the accelerator.
            self._control_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device)

    def _build_precision(self, device: torch.device) -> Precision:
        support = self.ownership.precision_support(self.settings.precision)
        precision: Precision
        if support.applied_by_trainer:
            spec = self.pm.precisions.get(self.settings.precision)  # availability checked in build_strategy
            precision = spec.factory(device=device, grad_scaler=lambda: self.strategy.make_grad_scaler(device))
        else:
            precision = DelegatedPrecision(self.settings.precision)
        precision.support = support
        return precision

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
        ckpt_path: str | os.PathLike[str] | None = None,
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
                mean loss (a scalar tensor).
            training_step: the form for batches of any structure:
                ``training_step(model, batch)`` returns the micro-batch's mean
                loss, e.g. ``lambda model, batch: model(**batch).loss``.
                ``model`` is the strategy's forward callable (a DDP/FSDP/engine
                wrapper; ``trainer.model`` is the unwrapped module). Exactly one
                of ``loss_fn`` and ``training_step``; validation uses the same.
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
            count_tokens: batch -> tokens, replacing the rule of
                :func:`unison.data.batch.count_tokens` for throughput metrics.

        As it starts, and as each setup phase that can take long begins (the
        process group's rendezvous, the strategy's setup of the model, finding
        and loading a checkpoint to resume), ``fit`` prints one ``unison:
        setting up ...`` line (global rank 0, stderr; none with
        ``progress="off"``).

        On SIGTERM or SIGUSR1 every rank finishes the current optimizer step,
        a checkpoint is committed (with ``checkpoint_dir``) and ``fit`` raises
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
        self._say = SetupReport(s.progress, rank)
        self._say(f"training with strategy {s.strategy!r}, world size {world_size}: checking model, data and options")
        # -- everything below until the process group is checked up front ---- #
        if (loss_fn is None) == (training_step is None):
            raise ConfigurationError(
                "loss_fn/training_step",
                "pass exactly one of loss_fn and training_step",
                "loss_fn=... for (inputs, targets) batches, or training_step=lambda model, batch: ... for any batch",
            )
        if training_step is not None:
            _check_callable(
                training_step,
                "training_step",
                "training_step(model, batch)",
                "lambda model, batch: model(**batch).loss",
                2,
            )
            _refuse(
                self.strategy, Feature.TRAINING_STEP, "training_step", "use loss_fn=... with (inputs, targets) batches"
            )
        else:
            _check_loss_fn(loss_fn)
            _refuse(self.strategy, Feature.LOSS_FN, "loss_fn", "use training_step=lambda model, batch: ...")
        if ckpt_path is not None:
            if str(ckpt_path) in ("last", "auto") and self.checkpointer is None and s.root_dir is None:
                raise ConfigurationError(
                    "ckpt_path",
                    f"{str(ckpt_path)!r} needs a root_dir or checkpoint_dir",
                    "set root_dir (or checkpoint_dir), or pass a path",
                )
            _refuse(self.strategy, Feature.RESUME, "ckpt_path", "start without ckpt_path")
        model = _build_model(model, s.seed)
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigurationError(
                "model",
                f"{type(model).__name__} has no trainable parameters",
                "pass a model with parameters that require grad",
            )
        # Model features (tied weights, buffers, ...) are refused by the
        # strategy's own check, which may be narrower than the feature (a
        # pipeline refuses weights tied *across stages*); the declaration says so.
        self.strategy.validate_model(model, s)
        self.strategy.validate_optimizer(_probe_optimizer(optimizer, lr_scheduler, model), s)
        dp_size = self.strategy.data_parallel_size(world_size)
        data = TrainData(
            train_dataset,
            collate_fn,
            s,
            data_parallel_size=dp_size,
            data_parallel_rank=self.strategy.data_parallel_rank(rank, world_size),
            token_counter=count_tokens,
        )
        self._check_first_batch(data.first_micro_batch(), loss_fn is not None)
        val = self._resolve_validation(val_dataset, collate_fn) if val_dataset is not None else None
        runs.prepare(self, ckpt_path, world_size)  # the run directory; its checkpointer; what it resumes
        if self.checkpointer is not None:
            self.checkpointer.preflight(ckpt_path, s.max_steps)  # writable; the resume point exists, within max_steps
            self.checkpointer.claim(ckpt_path)  # never write into another run's checkpoints
        elif ckpt_path is not None:
            check_resume_step(resume_point(ckpt_path), s.max_steps)
        check_stall_timeout(s.stall_timeout_s, collective_timeout_s())

        self.loss_fn, self.training_step, self.data = loss_fn, training_step, data
        self._final_state = None
        self.should_stop = False
        # From here on nothing is refused as bad input: failures are errors.
        self.setup_started = True
        self._guard = RunGuard()
        try:
            with self._guard:  # SIGTERM/SIGUSR1 -> stop at a step boundary; first error to torchrun
                self.env = self._setup_environment()
                self._watchdog = self._guard.watch(
                    start_watchdog(s.stall_timeout_s, self.env.rank, self.env.world_size)
                )
                runs.agree(self)  # ranks of a bare torchrun take rank 0's fresh version
                if self.checkpointer is not None:
                    # One writer per checkpoint directory: rank 0 takes the lease, every rank hears the
                    # outcome before any setup or step (unison.checkpointing.lease says why here and not earlier).
                    self.checkpointer.acquire(ckpt_path)
                self._fit(model, optimizer, lr_scheduler, val, ckpt_path)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) and self.checkpointer is not None and self.is_global_zero:
                # Ctrl-C stops at once (SIGTERM stops at a step boundary and saves): name what is committed.
                latest = self.checkpointer.latest()
                print(
                    f"unison: interrupted after step {self.global_step}; last committed checkpoint: {latest}",
                    file=sys.stderr,
                    flush=True,
                )
            self.pm.unison_on_exception(trainer=self, exception=exc)
            raise
        finally:
            if self.checkpointer is not None:
                self.checkpointer.release()
            data.close()
            self.strategy.teardown()
            if self._owns_process_group:
                torch.distributed.destroy_process_group()
                self._owns_process_group = False
            self._control_group = None
        return self.progress

    def _check_first_batch(self, batch: Any, loss_fn_form: bool) -> None:
        from unison.data.batch import batch_size

        batch_size(batch, where="batch")  # leaves must agree on the batch dimension
        if loss_fn_form and not (isinstance(batch, (list, tuple)) and len(batch) == 2):
            shape = (
                f"a {type(batch).__name__} with keys {list(batch)[:6]}"
                if isinstance(batch, Mapping)
                else f"a {type(batch).__name__}"
                + (f" of {len(batch)} items" if isinstance(batch, (list, tuple)) else "")
            )
            raise ConfigurationError(
                "loss_fn",
                f"the loss_fn form needs each batch to be (inputs, targets), but the collated batch is {shape}",
                "pass training_step=lambda model, batch: ... (e.g. model(**batch).loss) for batches of any "
                "structure, or make the dataset return (input, target) pairs",
            )

    def _resolve_validation(self, val_dataset: Any, collate_fn: Any) -> tuple[Any, Any, Any]:
        source, collate, options = resolve_source(val_dataset, collate_fn, self.settings, what="val_dataset")
        empty = len(source) == 0 if is_map_style(source) else next(iter(source), None) is None
        if empty:
            raise ConfigurationError(
                "val_dataset", "the validation dataset is empty", "pass a non-empty val_dataset, or none"
            )
        return source, collate, options

    def _fit(
        self,
        model: torch.nn.Module,
        optimizer: OptimizerArg,
        lr_scheduler: SchedulerArg | None,
        val: tuple[Any, Any, Any] | None,
        ckpt_path: Any,
    ) -> None:
        s, env, hook, strategy = self.settings, self.env, self.pm, self.strategy
        assert env is not None and self.data is not None
        seed_everything(s.seed)
        if self.ownership.replica_init is ReplicaInit.TRAINER and env.distributed and env.world_size > 1:
            # Whatever the user passed, replicas never start apart.
            model = model.to(env.device)
            _broadcast_module_state(model)
        self.precision = precision = self._build_precision(env.device)
        module = precision.convert_module(model)
        strategy.env = env
        self._say(f"the model under strategy {s.strategy!r} ({type(model).__name__}, device {env.device})")
        strategy.setup(module, lambda params: _checked_optimizer(optimizer, params), precision=precision, settings=s)
        self.lr_scheduler = lr_scheduler(strategy.optimizer) if lr_scheduler else None
        self.data.to_device = strategy.to_device
        self.progress = Progress()
        self._consecutive_skips = 0
        self._val = val

        hook.unison_on_fit_start(trainer=self)
        if ckpt_path is not None:
            self._watchdog.mark(0, "load_checkpoint")
            self._say(f"the resume: finding and loading the checkpoint ({ckpt_path})")
            self._load_checkpoint(ckpt_path)

        self._fitting = True
        try:
            self._loop(val)
        finally:
            self._fitting = False
        self._watchdog.mark(self.progress.global_step, "fit_end")
        # The end: validation and checkpoint once, unless the last step just had them.
        if val is not None and self._last_validated != self.progress.global_step:
            self.validate()
        if self.checkpointer is not None and self.checkpointer.last_step != self.progress.global_step:
            self.save_checkpoint()  # (not when it was just saved, or resumed at the end: committed already)
        if self._pending_metrics:
            self._emit(self._pending_metrics)
            self._pending_metrics = {}
        if self.checkpointer is not None:
            latest = self.checkpointer.latest()
            self.progress.checkpoint = str(latest) if latest is not None else None
        self.progress.run_dir = str(self.run_dir) if self.run_dir is not None else None
        # Kept so that full_state_dict() works after fit tore the strategy down.
        self._final_state = self.strategy.full_state_dict()
        hook.unison_on_fit_end(trainer=self)

    def _loop(self, val: Any) -> None:
        s, hook = self.settings, self.pm
        assert self.data is not None
        epoch = None
        self._last_validated = None
        watchdog = self._watchdog
        for batch in self.data.steps(self.progress.global_step):
            step = batch.step
            watchdog.mark(step, "forward_backward")
            if batch.epoch != epoch:
                epoch = batch.epoch
                hook.unison_on_train_epoch_start(trainer=self, epoch=epoch)
            output = self._train_step(batch)
            self.progress.global_step = done = step + 1
            self.progress.history.append(output)
            watchdog.mark(step, "step_end")
            hook.unison_on_train_step_end(trainer=self, step=step, output=output)
            if done % s.log_every_n_steps == 0:
                self._log_step(output)
            if batch.last_in_epoch:
                hook.unison_on_train_epoch_end(trainer=self, epoch=epoch)
            if val is not None and s.val_every_n_steps and done % s.val_every_n_steps == 0:
                watchdog.mark(step, "validation")
                self.validate()
                self._last_validated = done
            if self.checkpointer and s.checkpoint_every_n_steps and done % s.checkpoint_every_n_steps == 0:
                watchdog.mark(step, "checkpoint")
                self.save_checkpoint()
            watchdog.mark(step, "stop_agreement")
            if self._agree_to_stop():
                break
            watchdog.mark(done, "data")

    def _agree_to_stop(self) -> bool:
        """Combine every rank's ``should_stop`` and stop request (signal) at the step boundary.

        Any rank stopping stops all, after the same optimizer step: one small
        all-reduce on the CPU control group carries both flags. A stop request
        (SIGTERM/SIGUSR1 on any rank) commits a checkpoint and raises
        :class:`~unison.launch.lifecycle.Preempted` on every rank.
        """
        env, guard = self.env, self._guard
        requested = guard.received if guard is not None else None
        if env is not None and env.distributed and env.world_size > 1:
            signum = guard.signum if guard is not None else 0
            flags = torch.tensor([float(self.should_stop), float(requested is not None), float(signum)])
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self._control_group)
            self.should_stop = bool(flags[0].item())
            if flags[1].item() and requested is None:
                # Every rank names the signal, whichever rank it reached first.
                shared = int(flags[2].item())
                requested = signal.Signals(shared).name if shared else "a stop request on another rank"
        if requested is not None and guard is not None:
            guard.preempt(self, requested)
        return self.should_stop

    # -- one optimizer step -------------------------------------------------- #
    def _train_step(self, batch: Any) -> StepOutput:
        s, hook, strategy, precision = self.settings, self.pm, self.strategy, self.precision
        assert precision is not None
        step = batch.step
        hook.unison_on_train_step_start(trainer=self, step=step)
        losses = self._forward_backward(batch.micro_batches)
        self._watchdog.mark(step, "optimizer_step")
        hook.unison_on_after_backward(trainer=self, step=step)

        # Every micro-batch's loss and the step's tokens, summed over replicas in one collective.
        local = torch.stack([loss.detach().float().reshape(()) for loss in losses])
        tokens = None
        if batch.tokens is not None:
            local = torch.cat([local, torch.tensor([float(batch.tokens)], device=local.device)])
        reduced = strategy.reduce_sum(local)
        replicas = strategy.data_parallel_size(self.env.world_size)  # type: ignore[union-attr]
        micro = reduced[: len(losses)] / replicas
        if batch.tokens is not None:
            tokens = reduced[len(losses)]

        precision.unscale_gradients(strategy.optimizer)
        grad_norm = strategy.clip_grad_norm(s.grad_clip_norm).detach()
        lrs = [float(g["lr"]) for g in strategy.optimizer.param_groups]  # type: ignore[union-attr]
        finite = True
        if precision.skips_overflow or self.nonfinite != "continue":
            # One device-to-host read: the global norm and the replica-averaged
            # losses are the same on every rank, so every rank decides alike.
            finite = bool(torch.isfinite(grad_norm) & torch.isfinite(micro).all())
            if not finite and not precision.skips_overflow and self.nonfinite == "raise":
                self._raise_nonfinite(step, local[: len(losses)], micro, grad_norm)
        hook.unison_on_before_optimizer_step(trainer=self, step=step, grad_norm=grad_norm)
        if finite or precision.skips_overflow:
            skipped = precision.step(strategy.optimizer_step, strategy.optimizer, finite)
        else:  # nonfinite == "skip"
            skipped = True
        if not skipped:
            self.progress.optimizer_steps += 1
            self._consecutive_skips = 0
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
                self.progress.scheduler_steps += 1
        else:
            self.progress.skipped_steps += 1
            self._consecutive_skips += 1
        strategy.zero_grad()
        hook.unison_on_after_optimizer_step(trainer=self, step=step, skipped=skipped)
        if self._consecutive_skips >= self.max_consecutive_skips:
            raise NonFiniteError(
                f"step {step}: {self._consecutive_skips} optimizer steps in a row were skipped (non-finite "
                "gradients: fp16 overflow or NaN/inf losses); training is not progressing. Fix: check the data and "
                "the loss for NaN/inf, lower the learning rate, or use bf16-mixed; max_consecutive_skips sets the limit"
            )
        return StepOutput(step, micro, grad_norm, lrs, skipped, s.global_batch_size, tokens)

    def _raise_nonfinite(self, step: int, local: torch.Tensor, micro: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Raise on every rank, naming the first micro-batch and rank whose loss was non-finite."""
        assert self.env is not None
        flags = [bool(torch.isfinite(v)) for v in local.cpu()]
        per_rank: list[Any] = [flags]
        if self.env.distributed and self.env.world_size > 1:
            per_rank = [None] * self.env.world_size
            torch.distributed.all_gather_object(per_rank, flags, group=self._control_group)
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
            f"step {step}: {what}; no optimizer step or checkpoint was taken from it. Fix: check the data and the loss "
            "for NaN/inf (or pass nonfinite='skip' to skip such steps, or 'continue' to train on)"
        )

    def _forward_backward(self, micro_batches: Sequence[Any]) -> list[torch.Tensor]:
        accumulation = self.ownership.grad_accumulation
        strategy, precision = self.strategy, self.precision
        assert precision is not None
        if accumulation.owner is AccumulationOwner.SCHEDULE:
            pairs = [tuple(b) for b in micro_batches]
            return strategy.forward_backward(pairs, self.loss_fn, precision)  # type: ignore[attr-defined]
        n = len(micro_batches)
        defer = accumulation.owner is AccumulationOwner.TRAINER and accumulation.sync is GradSync.BOUNDARY
        losses = []
        for i, batch in enumerate(micro_batches):
            last = i == n - 1
            # Trainer-owned, boundary sync: skip gradient sync until the last micro-step.
            sync = strategy.no_sync() if defer and not last else contextlib.nullcontext()  # type: ignore[attr-defined]
            with sync:
                with precision.forward_context():
                    loss = self._loss(batch)
                if accumulation.owner is AccumulationOwner.TRAINER:
                    # The one place the loss is divided for accumulation.
                    strategy.backward(precision.scale_loss(loss / n))
                else:
                    # Engine-owned: the engine scales by its own count.
                    strategy.backward(precision.scale_loss(loss))
                    if strategy.is_accumulation_boundary() != last:  # type: ignore[attr-defined]
                        raise RuntimeError(
                            f"strategy {strategy.name!r} owns accumulation but its boundary disagrees with the "
                            f"trainer's at micro-step {i + 1}/{n}: check its accumulation settings"
                        )
            losses.append(loss)
        return losses

    def _loss(self, batch: Any) -> torch.Tensor:
        """One micro-batch's mean loss in the fit's form, checked to be a scalar tensor."""
        precision = self.precision
        assert precision is not None
        if self.training_step is not None:
            loss = self.training_step(self.strategy.model, precision.convert_input(batch))
            name = "training_step"
        else:
            inputs, targets = batch
            loss = self.loss_fn(self.strategy.forward(precision.convert_input(inputs)), targets)  # type: ignore[misc]
            name = "loss_fn"
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ConfigurationError(
                name,
                f"{name} returned {got}; the trainer needs the micro-batch's mean loss as a scalar tensor",
                "return a 0-dim tensor that requires grad (e.g. reduce with .mean(); do not call .item())",
            )
        return loss

    # -- validation ------------------------------------------------------------ #
    @torch.no_grad()
    def validate(self, dataset: Any = None) -> dict[str, float]:
        """Mean loss over the validation set (every sample once, reduced over replicas).

        Uses the fit's ``val_dataset`` unless ``dataset`` is given; called on every rank.
        """
        assert self.env is not None and self.precision is not None and self.data is not None
        source, collate, options = self._resolve_validation(dataset, None) if dataset is not None else self._val
        step = self.progress.global_step
        self.pm.unison_on_validation_start(trainer=self, step=step)
        model = self.strategy.module
        was_training = model.training
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.env.device)
        per_forward = self.settings.val_batch_size * self.data.replicas
        num_batches = -(-len(source) // per_forward) if is_map_style(source) else None  # for progress displays
        for i, (batch, weight) in enumerate(
            validation_stream(
                source,
                collate,
                self.settings.val_batch_size,
                self.data.replicas,
                self.data.rank,
                options,
                self.settings.seed,
            )
        ):
            batch = self.strategy.to_device(batch)
            with self.precision.forward_context():
                if self.training_step is not None:
                    loss = self.training_step(self.strategy.model, self.precision.convert_input(batch))
                else:
                    inputs, targets = batch
                    loss = self.strategy.eval_loss(self.precision.convert_input(inputs), targets, self.loss_fn)
            total += torch.stack(
                [loss.detach().double() * weight, torch.tensor(float(weight), dtype=torch.float64, device=total.device)]
            )
            self.pm.unison_validation_progress(trainer=self, step=step, batch_idx=i, num_batches=num_batches)
        model.train(was_training)
        total = self.strategy.reduce_sum(total)
        metrics = {"val/loss": float(total[0] / total[1])}
        self.last_validation = metrics
        self.pm.unison_on_validation_end(trainer=self, step=step, metrics=metrics)
        self._emit(metrics)
        return metrics

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
        if self._fitting:
            self._pending_metrics.update(metrics)
        else:
            self._emit(dict(metrics))

    def _log_step(self, output: StepOutput) -> None:
        metrics: dict[str, Any] = {
            "train/loss": output.loss,
            "train/grad_norm": output.grad_norm,
            "train/lr": output.lrs[0],
            "train/skipped": float(output.skipped),
            "train/skipped_steps": float(self.progress.skipped_steps),
        }
        if len(output.lrs) > 1:
            metrics.update({f"train/lr-group{i}": lr for i, lr in enumerate(output.lrs)})
        metrics.update(self._pending_metrics)
        self._pending_metrics = {}
        self._emit(metrics)

    def _emit(self, metrics: dict[str, Any]) -> None:
        plain = {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        self.progress.metrics.update(plain)
        self.pm.unison_log_metrics(trainer=self, metrics=plain, step=self.progress.global_step)

    # -- state ----------------------------------------------------------------- #
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Canonical model state: unsharded, fp32, on CPU, the model's own names.

        Collective (call on every rank while ``fit`` has set up the strategy, or
        after ``fit`` returns: the trainer keeps the last state). Returned on
        every rank.
        """
        if self.strategy.model is None:
            if self._final_state is None:
                raise RuntimeError("full_state_dict() needs a model: call fit() first")
            return self._final_state
        return self.strategy.full_state_dict()

    def save_checkpoint(self) -> Path:
        """Write and commit a checkpoint for the current step (collective, atomic, verified on load)."""
        assert self.checkpointer is not None and self.env is not None
        env, checkpointer = self.env, self.checkpointer

        def write(directory: Path) -> dict[str, Any]:
            self.strategy.save_state(directory / "state")
            checkpointer.write_rng(directory, env.rank, rng_state())
            trainer_state: dict[str, Any] = {
                "progress": self.progress.state_dict(),
                "scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                "precision": self.precision.state_dict() if self.precision is not None else {},
                "data": self.data.state_dict(self.progress.global_step) if self.data is not None else None,
            }
            self.pm.unison_on_save_checkpoint(trainer=self, checkpoint=trainer_state)
            checkpointer.write_trainer_state(directory, trainer_state, write=env.rank == 0)
            return {
                "strategy": self.strategy.name,
                "world_size": env.world_size,
                "precision": self.settings.precision,
                "state_dict": self.ownership.to_dict()["state_dict"],
            }

        path = checkpointer.save(self.progress.global_step, write)
        retries = getattr(checkpointer.storage, "retries", None)
        if retries is not None:  # object storage: calls retried after transient failures, so far in this run
            self.log({"checkpoint/storage_retries": float(retries)})
        return path

    def _load_checkpoint(self, ckpt_path: str | os.PathLike[str]) -> None:
        assert self.env is not None
        checkpointer = self.checkpointer or Checkpointer(Path(ckpt_path).parent)
        found = checkpointer.select(ckpt_path)  # collective: verifies every file before anything is loaded
        if found is None:  # "auto" and nothing committed yet: a fresh start
            return
        path, meta = found.path, found.manifest
        assert meta is not None
        if meta.world_size != self.env.world_size and not meta.state_dict["reshardable"]:
            raise ConfigurationError(
                "ckpt_path",
                f"{path} was written by {meta.strategy!r} at world size {meta.world_size} in a format it "
                f"declares not reshardable; this run has world size {self.env.world_size}",
                f"resume at world size {meta.world_size}",
            )
        self.strategy.load_state(checkpointer.storage.localize(path / "state"))  # object storage: downloaded
        trainer_state = checkpointer.read_trainer_state(path)
        self.progress = Progress.from_state(trainer_state["progress"])
        if self.lr_scheduler is not None and trainer_state["scheduler"] is not None:
            self.lr_scheduler.load_state_dict(trainer_state["scheduler"])
        if self.precision is not None:
            self.precision.load_state_dict(trainer_state["precision"])
        if self.data is not None:
            self.data.check_resume(trainer_state.get("data"))
        rng = checkpointer.read_rng(path, self.env.rank) if meta.world_size == self.env.world_size else None
        if rng is not None:
            set_rng_state(rng)
        else:
            # Another world size: no saved RNG for this rank; derive one from
            # the seed and the step so the run stays deterministic.
            seed_everything(self.settings.seed + self.progress.global_step + 7919 * self.env.rank)
        self.pm.unison_on_load_checkpoint(trainer=self, checkpoint=trainer_state)
        self.resumed_from = {"step": self.progress.global_step, "checkpoint": str(path)}
        if self.env.rank == 0 and self.settings.progress != "off":  # an info line, like the progress display's
            print(f"unison: resuming from step {self.progress.global_step}: {path}", file=sys.stderr, flush=True)
