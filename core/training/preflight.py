"""Everything a fit checks and builds before any process group exists.

A bad option, model, loss or optimizer must fail in seconds, on every rank
alike, before a rendezvous or a strategy's setup. The settings are checked
against the strategy's declaration when the trainer is made
(:func:`unison.training.declaration.declare`); :func:`prepare_fit` checks the
rest in order (the loss form, the model built, seeded when given as a
factory, the optimizer and scheduler factories probed on the real parameters,
the first batch's shape, the resume request with its run directory and
checkpoint directory) and returns the fit's :class:`FitPlan`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from unison.checkpointing.admission import check_resume_step, resume_point
from unison.checkpointing.checkpointer import Checkpointer
from unison.checkpointing.resume import CkptPath, ResumeRequest
from unison.contract.ownership import Feature
from unison.contract.settings import TrainerSettings
from unison.contract.state import seed_everything
from unison.contract.strategy import LossFn, Strategy
from unison.contract.transforms import required_blocks
from unison.data.loader import TrainData
from unison.errors import ConfigurationError
from unison.launch.lifecycle import collective_timeout_s
from unison.launch.watchdog import check_stall_timeout
from unison.training import runs
from unison.training.declaration import Declared, build_strategy, declare, refuse
from unison.training.losses import check_huggingface_path, huggingface_training_step
from unison.training.validation import ValidationSource, resolve_validation

OptimizerArg = Callable[[Any], torch.optim.Optimizer]
SchedulerArg = Callable[[torch.optim.Optimizer], Any]
TrainingStep = Callable[[Any, Any], Any]  # the mean loss, or (loss_sum, num_items)

__all__ = [
    "Declared",
    "FitPlan",
    "OptimizerArg",
    "SchedulerArg",
    "TrainingStep",
    "build_model",
    "build_strategy",
    "check_loss_fn",
    "checked_optimizer",
    "declare",
    "prepare_fit",
    "probe_optimizer",
]


def check_callable(value: Any, option: str, shape: str, example: str, arity: int) -> None:
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


def check_loss_fn(loss_fn: Any) -> None:
    """The trainer calls ``loss_fn(outputs, targets)`` and nothing else, on every backend.

    Pipelines compute the loss on the last stage, which holds only the model's
    outputs and the targets; a loss that needs more (the inputs, the model)
    could never run there, so it is refused for every strategy alike.
    """
    check_callable(
        loss_fn,
        "loss_fn",
        "loss_fn(outputs, targets)",
        "torch.nn.functional.cross_entropy; compute anything that needs the inputs inside the model's forward, or "
        "use training_step=lambda model, batch: ... (a pipeline's last stage has only its outputs and the targets)",
        2,
    )


def build_model(model: Any, seed: int) -> torch.nn.Module:
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


def probe_optimizer(optimizer: Any, lr_scheduler: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Call the factories once on the real parameters, check what they return; return the probe optimizer."""
    check_callable(optimizer, "optimizer", "optimizer(params)", "lambda params: torch.optim.AdamW(params, lr=1e-3)", 1)
    if isinstance(optimizer, torch.optim.Optimizer):  # pragma: no cover - caught by the callable check above
        raise ConfigurationError("optimizer", "got an Optimizer instance", "pass a factory: lambda params: ...")
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = checked_optimizer(optimizer, trainable)
    if lr_scheduler is not None:
        check_callable(
            lr_scheduler,
            "lr_scheduler",
            "lr_scheduler(optimizer)",
            "lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)",
            1,
        )
        check_scheduler(lr_scheduler(opt))
    return opt


def checked_optimizer(factory: OptimizerArg, params: Any) -> torch.optim.Optimizer:
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


def check_scheduler(scheduler: Any) -> None:
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


# --------------------------------------------------------------------------- #
# One fit's checks, in the order fit makes them
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class FitPlan:
    """One fit as :func:`prepare_fit` checked it, before any process group: all a fit needs once the world is up.

    Each value is parsed once, here; the parts of the fit take what they need from it.
    """

    settings: TrainerSettings
    #: The strategy, its precision support and the step's sizes (:func:`declare`).
    declared: Declared
    #: ``ckpt_path`` parsed.
    resume: ResumeRequest
    #: The run directory and checkpointer (:func:`unison.training.runs.prepare`).
    place: runs.RunPlace
    model: torch.nn.Module
    data: TrainData
    validation: ValidationSource | None
    loss_fn: LossFn | None
    #: The fit's ``training_step``: the user's, the Hugging Face path's when neither form was given, or ``None``.
    training_step: TrainingStep | None

    @property
    def strategy(self) -> Strategy:
        return self.declared.strategy


def check_form(strategy: Strategy, loss_fn: LossFn | None, training_step: TrainingStep | None) -> None:
    """Exactly one of the two batch forms, callable as the trainer calls it, and taken by the strategy.

    Neither is the Hugging Face path (the model's own loss), checked by :func:`huggingface_form` once the
    model and the first batch exist.
    """
    if loss_fn is None and training_step is None:
        return
    if loss_fn is not None and training_step is not None:
        raise ConfigurationError(
            "loss_fn/training_step",
            "pass at most one of loss_fn and training_step (neither: the model's own loss, for dict batches "
            "with labels)",
            "loss_fn=... for (inputs, targets) batches, or training_step=lambda model, batch: ... for any batch",
        )
    if training_step is not None:
        check_callable(
            training_step,
            "training_step",
            "training_step(model, batch)",
            "lambda model, batch: model(**batch).loss",
            2,
        )
        refuse(strategy, Feature.TRAINING_STEP, "training_step", "use loss_fn=... with (inputs, targets) batches")
    else:
        check_loss_fn(loss_fn)
        refuse(strategy, Feature.LOSS_FN, "loss_fn", "use training_step=lambda model, batch: ...")


def check_resume(settings: TrainerSettings, strategy: Strategy, resume: ResumeRequest) -> None:
    """``auto``/``last`` need a directory to look in; any resume needs a strategy that declares it."""
    if resume.fresh:
        return
    if resume.newest and settings.checkpoint_dir is None and settings.root_dir is None:
        raise ConfigurationError(
            "ckpt_path",
            f"{str(resume)!r} needs a root_dir or checkpoint_dir",
            "set root_dir (or checkpoint_dir), or pass a path",
        )
    refuse(strategy, Feature.RESUME, "ckpt_path", "start without ckpt_path")


def check_model(
    model: Any, strategy: Strategy, settings: TrainerSettings, optimizer: Any, lr_scheduler: Any
) -> torch.nn.Module:
    """The model built (seeded), with something to train, and accepted by the strategy with its optimizer."""
    built = build_model(model, settings.seed)
    if not any(p.requires_grad for p in built.parameters()):
        raise ConfigurationError(
            "model",
            f"{type(built).__name__} has no trainable parameters",
            "pass a model with parameters that require grad",
        )
    # Model features (tied weights, buffers, ...) are refused by the
    # strategy's own check, which may be narrower than the feature (a
    # pipeline refuses weights tied *across stages*); the declaration says so.
    if settings.activation_checkpointing is not None:
        required_blocks(built, "activation_checkpointing")  # what to checkpoint, before any process group
    strategy.validate_model(built, settings)
    strategy.validate_optimizer(probe_optimizer(optimizer, lr_scheduler, built), settings)
    return built


def check_first_batch(batch: Any, loss_fn_form: bool) -> None:
    """The first collated batch has one batch dimension, and is a pair in the ``loss_fn`` form."""
    from unison.data.batch import batch_size

    batch_size(batch, where="batch")  # leaves must agree on the batch dimension
    if loss_fn_form and not (isinstance(batch, (list, tuple)) and len(batch) == 2):
        shape = (
            f"a {type(batch).__name__} with keys {list(batch)[:6]}"
            if isinstance(batch, Mapping)
            else f"a {type(batch).__name__}" + (f" of {len(batch)} items" if isinstance(batch, (list, tuple)) else "")
        )
        raise ConfigurationError(
            "loss_fn",
            f"the loss_fn form needs each batch to be (inputs, targets), but the collated batch is {shape}",
            "pass training_step=lambda model, batch: ... (e.g. model(**batch).loss) for batches of any "
            "structure, or make the dataset return (input, target) pairs",
        )


def prepare_checkpoints(
    settings: TrainerSettings, resume: ResumeRequest, world_size: int, checkpointer: Checkpointer | None
) -> runs.RunPlace:
    """The run directory and its checkpointer (:func:`unison.training.runs.prepare`); the checkpoint
    directory writable and not another run's; the resume point within ``max_steps``."""
    place = runs.prepare(settings, resume, world_size, checkpointer)
    if place.checkpointer is not None:
        # writable; the resume point exists, within max_steps
        place.checkpointer.admission.preflight(resume, settings.max_steps)
        place.checkpointer.admission.claim(resume)  # never write into another run's checkpoints
    elif resume.path is not None:
        check_resume_step(resume_point(resume.path), settings.max_steps)
    return place


def prepare_fit(
    settings: TrainerSettings,
    declared: Declared,
    model: Any,
    train_dataset: Any,
    *,
    loss_fn: LossFn | None,
    training_step: TrainingStep | None,
    optimizer: Any,
    lr_scheduler: Any,
    val_dataset: Any,
    collate_fn: Any,
    ckpt_path: CkptPath,
    count_tokens: Any,
    rank: int,
    world_size: int,
    checkpointer: Checkpointer | None = None,
) -> FitPlan:
    """Every check of :meth:`Trainer.fit <unison.training.trainer.Trainer.fit>` that needs no process group.

    Returns the fit's :class:`FitPlan`; creates nothing outside this process
    but the run directory (:func:`unison.training.runs.prepare`).
    ``checkpointer`` is the explicit ``checkpoint_dir``'s, if any.
    """
    s, strategy = settings, declared.strategy
    check_form(strategy, loss_fn, training_step)
    resume = ResumeRequest.parse(ckpt_path)
    check_resume(s, strategy, resume)
    built = check_model(model, strategy, s, optimizer, lr_scheduler)
    data = TrainData(
        train_dataset,
        collate_fn,
        s,
        sizes=declared.sizes,
        data_parallel_rank=strategy.data_parallel_rank(rank, world_size),
        token_counter=count_tokens,
    )
    first = data.first_micro_batch()
    check_first_batch(first, loss_fn is not None)
    if loss_fn is None and training_step is None:
        training_step = huggingface_form(strategy, built, first)
    validation = resolve_validation(val_dataset, collate_fn, s) if val_dataset is not None else None
    place = prepare_checkpoints(s, resume, world_size, checkpointer)
    check_stall_timeout(s.stall_timeout_s, collective_timeout_s())
    return FitPlan(s, declared, resume, place, built, data, validation, loss_fn, training_step)


def huggingface_form(strategy: Strategy, model: torch.nn.Module, first_batch: Any) -> TrainingStep:
    """Neither ``loss_fn`` nor ``training_step``: the model's own loss over the step's global label count.

    Refused before any process group when the batch holds no ``labels`` or the
    model's forward takes none, and when the strategy refuses the
    ``training_step`` form or item-weighted losses.
    """
    check_huggingface_path(model, first_batch)
    refuse(strategy, Feature.TRAINING_STEP, "training_step", "pass loss_fn=... with (inputs, targets) batches")
    refuse(
        strategy,
        Feature.ITEM_WEIGHTED_LOSS,
        "loss_fn/training_step",
        "pass training_step=lambda model, batch: model(**batch).loss (each micro-batch's own token mean)",
    )
    return huggingface_training_step
