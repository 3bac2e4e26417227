"""The Trainer: owns the loop, reads strategy declarations, calls hooks.

The loop never branches on a strategy's class or name. The only places it
behaves differently per backend read :attr:`Strategy.ownership`:

* ``grad_accumulation.owner`` picks how micro-batches are fed (see
  :mod:`unison.strategy` for the three forms);
* ``precision[name].owner`` picks whether the trainer applies the precision
  (autocast, scaler, casts) or leaves it to the engine or sharding policy.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Sequence

import pydantic
import torch
from torch.utils.data import Dataset

from unison.checkpoint import Checkpointer
from unison.data import BatchPlan, collate, validation_batches
from unison.errors import ConfigurationError
from unison.lifecycle import RunGuard, init_process_group
from unison.manager import PluginManager
from unison.ownership import AccumulationOwner, PrecisionOwner
from unison.precision import DelegatedPrecision, Precision
from unison.state import rng_state, seed_everything, set_rng_state
from unison.strategy import DistEnv, LossFn, Strategy

OptimizerArg = Callable[[Any], torch.optim.Optimizer]
SchedulerArg = Callable[[torch.optim.Optimizer], Any]


class TrainerSettings(pydantic.BaseModel):
    """Everything that configures a Trainer; the ``[trainer]`` table of a config file."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    strategy: str = "single"
    """Registered strategy name (``unison strategies`` lists them)."""
    strategy_options: dict[str, Any] = {}
    """Options of that strategy, validated by its own schema."""
    precision: str = "32-true"
    """``32-true`` | ``bf16-mixed`` | ``bf16-true`` | ``16-mixed`` | a plugin's name."""
    accumulate_grad_batches: int = pydantic.Field(1, ge=1)
    """Micro-batches per optimizer step."""
    global_batch_size: int = pydantic.Field(32, ge=1)
    """Samples per optimizer step, all ranks together."""
    max_steps: int = pydantic.Field(100, ge=0)
    """Optimizer steps to train for (skipped fp16 steps count)."""
    grad_clip_norm: float | None = pydantic.Field(None, gt=0)
    """Clip by the global L2 norm over all shards; ``None`` only measures it."""
    seed: int = 0
    """Seeds model init, data order and every RNG."""
    shuffle: bool = True
    """Shuffle the dataset once per epoch (by seed and epoch, never by rank)."""
    log_every_n_steps: int = pydantic.Field(1, ge=1)
    """How often metrics go to loggers."""
    val_every_n_steps: int | None = pydantic.Field(None, ge=1)
    """Validate every N steps; with a val_dataset, always once at the end."""
    val_batch_size: int = pydantic.Field(32, ge=1)
    """Validation samples per rank per forward."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; ``None`` writes none."""
    checkpoint_every_n_steps: int | None = pydantic.Field(None, ge=1)
    """Save every N steps (and always at the end when checkpoint_dir is set)."""
    keep_last_n_checkpoints: int | None = pydantic.Field(None, ge=1)
    """Delete older committed checkpoints beyond this many."""
    accelerator: Literal["auto", "cpu", "cuda"] = "auto"
    """Device kind; ``auto`` takes CUDA when available."""


@dataclass
class StepOutput:
    """What one optimizer step produced, identical on every rank."""

    step: int
    loss: float
    micro_losses: list[float]
    grad_norm: float
    lrs: list[float]
    skipped: bool


@dataclass
class Progress:
    global_step: int = 0
    """Optimizer steps attempted (global batches consumed)."""
    optimizer_steps: int = 0
    """Optimizer updates that happened (fp16 overflow skips one)."""
    scheduler_steps: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


def build_strategy(settings: TrainerSettings, pm: PluginManager, world_size: int) -> Strategy:
    """Create the strategy and check the settings against it for ``world_size`` ranks.

    Everything here runs before any process group exists; launchers call it
    too so that bad input fails before workers start.
    """
    strategy = pm.strategies.create(settings.strategy, settings.strategy_options)
    support = strategy.ownership.precision_support(settings.precision)
    if not support.supported:
        raise ConfigurationError(
            "precision",
            f"strategy {settings.strategy!r} does not support precision {settings.precision!r}: {support.detail}",
            f"pick a precision the strategy supports (see `unison describe {settings.strategy}`)",
        )
    if support.owner in (PrecisionOwner.TRAINER, PrecisionOwner.PLUGIN):
        spec = pm.precisions.get(settings.precision)
        if spec.unavailable:
            raise ConfigurationError(
                "precision", f"{spec.name!r} is unavailable here: {spec.unavailable}", "pick another precision"
            )
    strategy.validate(settings, world_size)
    BatchPlan.check_divisible(
        settings.global_batch_size, settings.accumulate_grad_batches, strategy.data_parallel_size(world_size)
    )
    return strategy


def _check_loss_fn(loss_fn: Any) -> None:
    """The trainer calls ``loss_fn(outputs, targets)`` and nothing else, on every backend.

    Pipelines compute the loss on the last stage, which holds only the model's
    outputs and the targets; a loss that needs more (the inputs, the model)
    could never run there, so it is refused for every strategy alike.
    """
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    try:
        signature.bind(object(), object())
    except TypeError as exc:
        raise ConfigurationError(
            "loss_fn",
            f"loss_fn{signature} cannot be called as loss_fn(outputs, targets) ({exc})",
            "take exactly (outputs, targets); compute anything that needs the inputs inside the model's forward "
            "(a pipeline's last stage has only its outputs and the targets)",
        ) from None


def _world_from_env() -> tuple[int, int, int]:
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


class Trainer:
    """Train a plain ``nn.Module`` with any registered strategy.

    Args:
        callbacks: pluggy plugins (objects with ``@unison.hookimpl`` methods).
        loggers: also plugins; they implement ``unison_log_metrics``.
        plugin_manager: reuse a manager instead of building one (advanced).
        **settings: the fields of :class:`TrainerSettings`.

    All validation happens here and at the start of :meth:`fit`, before any
    process group is created.
    """

    def __init__(
        self,
        *,
        callbacks: Iterable[Any] = (),
        loggers: Iterable[Any] = (),
        plugin_manager: PluginManager | None = None,
        **settings: Any,
    ) -> None:
        try:
            self.settings = TrainerSettings(**settings)
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            option = ".".join(str(p) for p in err["loc"])
            raise ConfigurationError(option, err["msg"], "see unison.TrainerSettings for valid values") from None
        self.pm = plugin_manager or PluginManager()
        for plugin in [*callbacks, *loggers]:
            self.pm.register(plugin)
        self.pm.check_pending()
        _, world_size, _ = _world_from_env()
        self.strategy: Strategy = build_strategy(self.settings, self.pm, world_size)
        self.ownership = self.strategy.ownership
        self._precision_support = self.ownership.precision_support(self.settings.precision)
        self.progress = Progress()
        self.should_stop = False
        self.env: DistEnv | None = None
        self.precision: Precision | None = None
        self.lr_scheduler: Any = None
        s = self.settings
        self.checkpointer = Checkpointer(s.checkpoint_dir, s.keep_last_n_checkpoints) if s.checkpoint_dir else None
        self._owns_process_group = False
        self._final_state: dict[str, torch.Tensor] | None = None
        #: Metrics of the most recent validation loop, or ``None``.
        self.last_validation: dict[str, float] | None = None

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
    def _device(self, local_rank: int) -> torch.device:
        kind = self.settings.accelerator
        if kind == "auto":
            kind = "cuda" if torch.cuda.is_available() else "cpu"
        if kind == "cuda":
            torch.cuda.set_device(local_rank)
            return torch.device("cuda", local_rank)
        return torch.device("cpu")

    def _setup_environment(self) -> DistEnv:
        rank, world_size, local_rank = _world_from_env()
        device = self._device(local_rank)
        backend = self.strategy.process_group_backend(device)
        dist = torch.distributed
        if dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        elif backend is not None:
            if "MASTER_ADDR" in os.environ:
                init_process_group(backend)  # rendezvous fails in minutes, not the 10-minute default
            else:
                # A distributed strategy on one process without a launcher: a
                # real, private world of 1 (no network rendezvous needed).
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            self._owns_process_group = True
            rank, world_size = dist.get_rank(), dist.get_world_size()
        return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device)

    def _build_precision(self, device: torch.device) -> Precision:
        if self._precision_support.owner in (PrecisionOwner.TRAINER, PrecisionOwner.PLUGIN):
            spec = self.pm.precisions.get(self.settings.precision)  # availability checked in build_strategy
            return spec.factory(device=device, grad_scaler=lambda: self.strategy.make_grad_scaler(device))
        return DelegatedPrecision(self.settings.precision)

    # -- fit ----------------------------------------------------------------- #
    def fit(
        self,
        model: torch.nn.Module,
        train_dataset: Dataset,
        *,
        loss_fn: LossFn,
        optimizer: OptimizerArg,
        lr_scheduler: SchedulerArg | None = None,
        val_dataset: Dataset | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> Progress:
        """Train ``model`` for ``max_steps`` optimizer steps.

        Args:
            model: a plain ``nn.Module``; ``loss_fn(model(inputs), targets)``
                must return the mean loss of a micro-batch.
            train_dataset: map-style; items are ``(input, target)``.
            optimizer: ``params -> Optimizer`` (called by the strategy with the
                parameters it trains, or parameter groups).
            lr_scheduler: ``optimizer -> scheduler``; stepped once per
                optimizer step that was not skipped.
            ckpt_path: where to resume from. ``"auto"``: the newest committed
                checkpoint in ``checkpoint_dir`` that verifies, or a fresh
                start when there is none (write a job once, restart it blindly).
                ``"last"``: the newest committed one, which must exist and
                verify. A path: that checkpoint. ``None``: start fresh, which
                ``checkpoint_dir`` must allow (it holds no other run's
                checkpoints).

        On SIGTERM or SIGUSR1 every rank finishes the current optimizer step,
        a checkpoint is committed (with ``checkpoint_dir``) and ``fit`` raises
        :class:`unison.lifecycle.Preempted`, a ``SystemExit`` with code 75.
        """
        s = self.settings
        _, world_size, _ = _world_from_env()
        _check_loss_fn(loss_fn)
        self.strategy.validate_model(model, s)
        # Fails on a too-small dataset before any process group starts.
        self._batch_plan(len(train_dataset), rank=0, world_size=world_size)
        if ckpt_path is not None and str(ckpt_path) in ("last", "auto") and self.checkpointer is None:
            raise ConfigurationError("ckpt_path", f"{str(ckpt_path)!r} needs a checkpoint_dir",
                                     "set checkpoint_dir or pass a path")
        if self.checkpointer is not None:
            self.checkpointer.claim(ckpt_path)  # never write into another run's checkpoints

        self.env = self._setup_environment()
        self._final_state = None
        self._guard = RunGuard()
        try:
            with self._guard:  # SIGTERM/SIGUSR1 -> stop at a step boundary; first error to torchrun
                self._fit(model, train_dataset, loss_fn, optimizer, lr_scheduler, val_dataset, ckpt_path)
        except BaseException as exc:
            self.pm.hook.unison_on_exception(trainer=self, exception=exc)
            raise
        finally:
            self.strategy.teardown()
            if self._owns_process_group:
                torch.distributed.destroy_process_group()
                self._owns_process_group = False
        return self.progress

    def _batch_plan(self, dataset_size: int, *, rank: int, world_size: int) -> BatchPlan:
        s = self.settings
        return BatchPlan(
            dataset_size=dataset_size,
            global_batch_size=s.global_batch_size,
            accumulate_grad_batches=s.accumulate_grad_batches,
            data_parallel_size=self.strategy.data_parallel_size(world_size),
            data_parallel_rank=self.strategy.data_parallel_rank(rank, world_size),
            seed=s.seed,
            shuffle=s.shuffle,
        )

    def _fit(self, model, train_dataset, loss_fn, optimizer, lr_scheduler, val_dataset, ckpt_path) -> None:
        s, env, hook = self.settings, self.env, self.pm.hook
        assert env is not None
        seed_everything(s.seed)
        self.plan = self._batch_plan(len(train_dataset), rank=env.rank, world_size=env.world_size)
        self.precision = precision = self._build_precision(env.device)
        module = precision.convert_module(model)
        self.strategy.env = env
        self.strategy.setup(module, optimizer, precision=precision, env=env, settings=s)
        self.lr_scheduler = lr_scheduler(self.strategy.optimizer) if lr_scheduler else None
        self.loss_fn = loss_fn
        self.progress = Progress()
        self.should_stop = False

        hook.unison_on_fit_start(trainer=self)
        if ckpt_path is not None:
            self._load_checkpoint(ckpt_path)

        epoch = None
        for step in range(self.progress.global_step, s.max_steps):
            step_epoch = step // self.plan.steps_per_epoch
            if step_epoch != epoch:
                epoch = step_epoch
                hook.unison_on_train_epoch_start(trainer=self, epoch=epoch)
            output = self._train_step(step, train_dataset)
            self.progress.global_step = step + 1
            self.progress.history.append(
                {"step": step, "loss": output.loss, "grad_norm": output.grad_norm, "lr": output.lrs[0], "skipped": output.skipped}
            )
            hook.unison_on_train_step_end(trainer=self, step=step, output=output)
            done = step + 1
            if done % s.log_every_n_steps == 0:
                self._log({"train/loss": output.loss, "train/grad_norm": output.grad_norm,
                           "train/lr": output.lrs[0], "train/skipped": float(output.skipped)})
            if done % self.plan.steps_per_epoch == 0:
                hook.unison_on_train_epoch_end(trainer=self, epoch=epoch)
            if val_dataset is not None and s.val_every_n_steps and done % s.val_every_n_steps == 0 and done != s.max_steps:
                self.validate(val_dataset)
            if self.checkpointer and s.checkpoint_every_n_steps and done % s.checkpoint_every_n_steps == 0 and done != s.max_steps:
                self.save_checkpoint()
            self._guard.stop_if_requested(self)  # collective: commit a checkpoint and raise Preempted
            if self.should_stop:
                break
        if val_dataset is not None:
            self.validate(val_dataset)
        if self.checkpointer is not None and self.checkpointer.last_step != self.progress.global_step:
            self.save_checkpoint()  # (not when resumed at the end: that step is committed already)
        # Kept so that full_state_dict() works after fit tore the strategy down.
        self._final_state = self.strategy.full_state_dict()
        hook.unison_on_fit_end(trainer=self)

    # -- one optimizer step -------------------------------------------------- #
    def _train_step(self, step: int, dataset: Dataset) -> StepOutput:
        s, hook, strategy, precision = self.settings, self.pm.hook, self.strategy, self.precision
        assert precision is not None
        hook.unison_on_train_step_start(trainer=self, step=step)
        micro_batches = [collate(dataset, idx) for idx in self.plan.local_micro_indices(step)]
        losses = self._forward_backward(micro_batches)
        hook.unison_on_after_backward(trainer=self, step=step)

        precision.unscale_gradients(strategy.optimizer)
        grad_norm = float(strategy.clip_grad_norm(s.grad_clip_norm))
        hook.unison_on_before_optimizer_step(trainer=self, step=step, grad_norm=grad_norm)
        skipped = precision.step(strategy.optimizer_step, strategy.optimizer, grad_norm)
        if not skipped:
            self.progress.optimizer_steps += 1
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
                self.progress.scheduler_steps += 1
        strategy.zero_grad()
        hook.unison_on_after_optimizer_step(trainer=self, step=step, skipped=skipped)

        # Every micro-batch's loss, averaged over data-parallel replicas: the
        # same numbers on every rank and every backend.
        micro = strategy.reduce_mean(torch.stack([l.detach().float().reshape(()) for l in losses]))
        micro_losses = micro.tolist()
        return StepOutput(
            step=step,
            loss=sum(micro_losses) / len(micro_losses),
            micro_losses=micro_losses,
            grad_norm=grad_norm,
            lrs=[g["lr"] for g in strategy.optimizer.param_groups],
            skipped=skipped,
        )

    def _forward_backward(self, micro_batches: Sequence[tuple[Any, Any]]) -> list[torch.Tensor]:
        owner = self.ownership.grad_accumulation.owner
        strategy, precision = self.strategy, self.precision
        assert precision is not None
        if owner is AccumulationOwner.SCHEDULE:
            return strategy.forward_backward(micro_batches, self.loss_fn, precision)
        n = len(micro_batches)
        losses = []
        for i, (inputs, targets) in enumerate(micro_batches):
            last = i == n - 1
            # Trainer-owned: skip gradient sync until the boundary micro-step.
            sync = contextlib.nullcontext() if last or owner is not AccumulationOwner.TRAINER else strategy.no_sync()
            with sync:
                with precision.forward_context():
                    outputs = strategy.forward(precision.convert_input(inputs))
                    loss = self.loss_fn(outputs, targets)
                if owner is AccumulationOwner.TRAINER:
                    # The one place the loss is divided for accumulation.
                    strategy.backward(precision.scale_loss(loss / n))
                else:
                    # Engine-owned: the engine scales by its own count.
                    strategy.backward(precision.scale_loss(loss))
                    if strategy.is_accumulation_boundary() != last:
                        raise RuntimeError(
                            f"strategy {strategy.name!r} owns accumulation but its boundary disagrees with the "
                            f"trainer's at micro-step {i + 1}/{n}: check its accumulation settings"
                        )
            losses.append(loss)
        return losses

    # -- validation ------------------------------------------------------------ #
    @torch.no_grad()
    def validate(self, dataset: Dataset) -> dict[str, float]:
        """Mean loss over ``dataset``, every sample once, reduced over replicas."""
        assert self.env is not None and self.precision is not None
        step = self.progress.global_step
        self.pm.hook.unison_on_validation_start(trainer=self, step=step)
        model = self.strategy.module
        was_training = model.training
        model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        for indices, weight in validation_batches(
            len(dataset), self.settings.val_batch_size, self.plan.data_parallel_size, self.plan.data_parallel_rank
        ):
            inputs, targets = collate(dataset, indices)
            with self.precision.forward_context():
                loss = self.strategy.eval_loss(self.precision.convert_input(inputs), targets, self.loss_fn)
            total += torch.tensor([float(loss) * weight, weight], dtype=torch.float64)
        model.train(was_training)
        total = self.strategy.reduce_sum(total)
        metrics = {"val/loss": float(total[0] / total[1])}
        self.last_validation = metrics
        self.pm.hook.unison_on_validation_end(trainer=self, step=step, metrics=metrics)
        self._log(metrics)
        return metrics

    def _log(self, metrics: dict[str, float]) -> None:
        self.pm.hook.unison_log_metrics(trainer=self, metrics=metrics, step=self.progress.global_step)

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
                "progress": {k: v for k, v in vars(self.progress).items()},
                "scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                "precision": self.precision.state_dict() if self.precision is not None else {},
            }
            self.pm.hook.unison_on_save_checkpoint(trainer=self, checkpoint=trainer_state)
            checkpointer.write_trainer_state(directory, trainer_state, write=env.rank == 0)
            return {
                "strategy": self.strategy.name,
                "world_size": env.world_size,
                "precision": self.settings.precision,
                "state_dict": self.ownership.to_dict()["state_dict"],
            }

        return checkpointer.save(self.progress.global_step, write)

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
        self.strategy.load_state(path / "state")
        trainer_state = checkpointer.read_trainer_state(path)
        self.progress = Progress(**trainer_state["progress"])
        if self.lr_scheduler is not None and trainer_state["scheduler"] is not None:
            self.lr_scheduler.load_state_dict(trainer_state["scheduler"])
        if self.precision is not None:
            self.precision.load_state_dict(trainer_state["precision"])
        rng = checkpointer.read_rng(path, self.env.rank) if meta.world_size == self.env.world_size else None
        if rng is not None:
            set_rng_state(rng)
        else:
            # Another world size: no saved RNG for this rank; derive one from
            # the seed and the step so the run stays deterministic.
            seed_everything(self.settings.seed + self.progress.global_step + 7919 * self.env.rank)
        self.pm.hook.unison_on_load_checkpoint(trainer=self, checkpoint=trainer_state)
