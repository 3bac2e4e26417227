"""The scenario catalogue: what "trains identically" means, one scenario at a time.

Each :class:`Scenario` fixes a tiny model, a dataset, an optimizer, the trainer
settings and a list of :class:`Run` values: the fits to execute under the
reference (``single``) and under the strategy being certified, and which runs
must agree with which. The runner executes the runs, the comparison applies the
checks; this module only *describes*.

Sizes scale with the world sizes involved (:class:`Sizing`): every micro-batch
holds ``4 * lcm(world_size, alt_world_size)`` samples, so it splits evenly
over the data-parallel ranks of the main world and of the world a reshardable
checkpoint is resumed at, and the single-process reference sees exactly the
same global batches.

Models (all tiny, all built from one seed; the ``replica_init`` scenarios then
perturb every rank but 0 on purpose):

* ``mlp``: three ``Linear`` layers with ``Tanh``; an ``nn.Sequential`` so that
  pipeline strategies can split it.
* ``batchnorm``: an MLP with a :class:`DriftingBatchNorm1d`, whose buffers
  (running statistics and a step counter) change at every training forward,
  identically on every rank and in the reference.
  Why not plain ``BatchNorm1d`` in training mode: each data-parallel rank would
  normalise with the statistics of its own slice of the micro-batch, which is
  not what one process on the full batch computes, so no strategy could match
  the reference (the divergence is a modelling choice, not a backend defect).
  ``SyncBatchNorm`` would fix that but refuses CPU tensors in torch 2.13 ("expected
  input tensor to be on GPU"), so it cannot run on gloo. The layer therefore
  normalises with its running statistics and updates them from a quantity every
  replica shares: its own parameters (see the class). A strategy that loses
  buffer updates, exports stale buffers or lets replicas' buffers drift apart
  changes both the outputs and the final state.
* ``frozen``: the MLP with its first layer frozen (``requires_grad=False``).
* ``tied``: an encoder/decoder pair sharing one weight matrix, plus a head.
* ``offset``: the MLP with its output bias at :data:`OUTPUT_OFFSET`, trained on
  targets moved there (``data="offset"``): bf16 rounds its predictions to whole
  numbers, so mixed precision visibly changes training (the precision scenario).
* ``groups``: the MLP trained with two parameter groups (matrices: one lr and
  weight decay; vectors: half the lr, no weight decay). Groups are formed by
  ``param.ndim`` because the optimizer factory receives the parameters a
  strategy trains, without names (DTensor parameters keep their global shape,
  so the split is the same for sharded strategies).

What a run asks of a strategy (:func:`needs`) is derived from the same
description: the batch form, accumulation, clipping, resume, the model's
features (:func:`unison.contract.strategy.model_features`) and the precision. The
comparison accepts a refusal only when one of those is declared refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.data import Dataset, TensorDataset

from unison.contract.ownership import Feature
from unison.contract.strategy import model_features

#: The precision each scenario trains in, and the precisions the suite knows tolerances for.
FP32, BF16_MIXED, FP16_MIXED = "32-true", "bf16-mixed", "16-mixed"

IN_FEATURES = 8
HIDDEN = 16
#: The value planted in the overflow sample's inputs: above fp16's largest
#: finite value (65504), so the cast to float16 inside autocast makes it ``inf``
#: in a real forward, on every backend, whatever the loss scale.
OVERFLOW_INPUT = 1.0e6
#: The offset of the ``offset`` data's targets and of the ``offset`` model's output bias. bf16 holds
#: 8 significant bits, so an output near 128 is rounded to a whole number (its spacing there is 1):
#: under bf16 every prediction moves by up to 0.5, against residuals of order 1, while fp32 keeps them
#: to 1e-5. The bf16 effect is therefore far larger than the rounding noise two backends of the same
#: precision differ by (that noise comes from sums over the batch, the effect from every prediction).
OUTPUT_OFFSET = 128.0


# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #


class DriftingBatchNorm1d(torch.nn.BatchNorm1d):
    """BatchNorm whose buffers change at every training forward, the same way on every rank.

    In training mode each forward first counts itself in ``num_batches_tracked``
    and moves the running statistics by ``momentum`` towards values computed
    from the layer's own parameters (``running_mean`` towards ``bias``,
    ``running_var`` towards ``1 + weight**2``). Parameters are equal on every
    replica and in the reference, and every rank runs the forward of every
    micro-batch (a slice of it), so the buffers evolve identically everywhere
    although each rank sees different samples. Then it normalises with the
    running statistics, as BatchNorm does in eval mode (see the module docstring
    for why batch statistics cannot be compared on CPU). Eval-mode forwards
    (validation) change nothing.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                m = self.momentum if self.momentum is not None else 0.1
                self.num_batches_tracked.add_(1)
                self.running_mean.mul_(1 - m).add_(self.bias.detach().to(self.running_mean.dtype), alpha=m)
                target_var = 1.0 + self.weight.detach().to(self.running_var.dtype).square()
                self.running_var.mul_(1 - m).add_(target_var, alpha=m)
        # Copies: the buffers change in place at the next micro-batch's forward,
        # while a pipeline schedule may still hold this graph for its backward.
        return torch.nn.functional.batch_norm(
            input, self.running_mean.clone(), self.running_var.clone(), self.weight, self.bias, False, 0.0, self.eps
        )


class TiedAutoencoder(torch.nn.Module):
    """``head(tanh(decoder(tanh(encoder(x)))))`` with ``decoder.weight is encoder.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(IN_FEATURES, IN_FEATURES)
        self.decoder = torch.nn.Linear(IN_FEATURES, IN_FEATURES)
        self.decoder.weight = self.encoder.weight  # the tie
        self.head = torch.nn.Linear(IN_FEATURES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.decoder(torch.tanh(self.encoder(x)))))


def _mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, 1),
    )


def _batchnorm() -> torch.nn.Sequential:
    model = torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN),
        DriftingBatchNorm1d(HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, 1),
    )
    bn = model[1]
    with torch.no_grad():
        # Non-trivial statistics and affine parameters: the drift targets
        # differ per feature, and a strategy that drops or re-initialises
        # buffers changes every output.
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
        bn.num_batches_tracked.fill_(7)
    return model


def _frozen() -> torch.nn.Sequential:
    model = _mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


def _frozen_batchnorm() -> torch.nn.Sequential:
    """The ``batchnorm`` model with its first layer frozen: resume checks buffers and frozen weights."""
    model = _batchnorm()
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


def _offset() -> torch.nn.Sequential:
    """The MLP whose output bias starts at :data:`OUTPUT_OFFSET` (the ``offset`` data's targets sit there)."""
    model = _mlp()
    with torch.no_grad():
        model[4].bias.add_(OUTPUT_OFFSET)
    return model


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "mlp": _mlp,
    "batchnorm": _batchnorm,
    "frozen": _frozen,
    "frozen_batchnorm": _frozen_batchnorm,
    "tied": TiedAutoencoder,
    "groups": _mlp,
    "offset": _offset,
}


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The scenario model ``name``, initialised from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    return MODELS[name]()


#: What ``replica_init`` scenarios perturb on every rank but 0.
Perturbation = Literal["weights", "buffers"]


def perturb(model: torch.nn.Module, what: Perturbation, rank: int) -> None:
    """Move rank ``rank``'s copy away from rank 0's before the model is handed to the trainer.

    The trained result must still equal the reference: whoever the declaration
    says makes replicas equal (``Ownership.replica_init``) must do it.
    """
    g = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        if what == "weights":
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        else:
            for b in model.buffers():
                if b.is_floating_point():
                    b.mul_(1.5).add_(0.25)  # stays a valid (positive) variance
                else:
                    b.add_(3 + rank)


# --------------------------------------------------------------------------- #
# Optimizers and schedulers (factories: the strategy calls them with its params)
# --------------------------------------------------------------------------- #


def _split_groups(params: Any) -> list[dict[str, Any]]:
    params = list(params)
    matrices = [p for p in params if p.ndim >= 2]
    vectors = [p for p in params if p.ndim < 2]
    return [
        {"params": matrices, "lr": 2e-2, "weight_decay": 0.1},
        {"params": vectors, "lr": 1e-2, "weight_decay": 0.0},
    ]


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    # SGD: an update proportional to the gradient, so a wrong gradient scale
    # (double averaging, a missed loss division) shows in the weights at once;
    # Adam would normalise most of it away.
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
    # Weight decay large enough that decaying a frozen parameter (one the strategy handed to the
    # optimizer with a zero gradient) shrinks it by lr * weight_decay = 4% per step: the next loss
    # moves ~100x its tolerance (0.1 moved it 3x).
    "adamw_decay": lambda params: torch.optim.AdamW(params, lr=2e-2, weight_decay=2.0),
    "adamw_groups": lambda params: torch.optim.AdamW(_split_groups(params)),
    # Per-parameter state other than Adam's (a running average of squared gradients and a momentum
    # buffer), created lazily at the first step like Adam's.
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-2, momentum=0.5),
    # Per-parameter state created eagerly, in the constructor (a sum of squared gradients started at
    # initial_accumulator_value, and a step count that lr_decay reads), where the others create theirs
    # at the first step; in two parameter groups (per-group lr and weight decay, as adamw_groups).
    "adagrad_groups": lambda params: torch.optim.Adagrad(
        _split_groups(params), lr_decay=0.05, initial_accumulator_value=0.1
    ),
}

#: The class each optimizer factory returns (named in what a run needs).
_OPTIMIZER_CLASSES = {
    "sgd": "torch.optim.SGD",
    "adamw": "torch.optim.AdamW",
    "adamw_decay": "torch.optim.AdamW",
    "adamw_groups": "torch.optim.AdamW",
    "rmsprop": "torch.optim.RMSprop",
    "adagrad_groups": "torch.optim.Adagrad",
}

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "warmup": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3)),
}


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error in fp32 (autocast outputs are cast up first)."""
    return torch.nn.functional.mse_loss(outputs.float(), targets.float())


def training_step(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The ``training_step`` form on dict batches: the same loss as :func:`loss_fn`."""
    return loss_fn(model(batch["x"]), batch["y"])


# --------------------------------------------------------------------------- #
# Data and sizes
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Sizing:
    """Batch sizes derived from the world sizes a scenario set runs at."""

    world_size: int
    alt_world_size: int

    @property
    def micro_batch(self) -> int:
        """Samples per micro-batch, all data-parallel ranks together."""
        return 4 * math.lcm(self.world_size, self.alt_world_size)

    @property
    def dataset_size(self) -> int:
        return 16 * self.micro_batch


def default_alt_world_size(world_size: int) -> int:
    """The world size a reshardable checkpoint is resumed at: 1, or 2 from a world of 1."""
    return 1 if world_size > 1 else 2


def regression_data(n: int, seed: int = 123) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN_FEATURES, generator=g)
    y = x @ torch.randn(IN_FEATURES, 1, generator=g) * 0.5 + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class DictRegression(Dataset):
    """The regression samples as ``{"x": ..., "y": ...}`` dicts (the ``training_step`` form)."""

    def __init__(self, n: int) -> None:
        self.x, self.y = regression_data(n).tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def overflow_data(n: int, poison_index: int, seed: int = 123) -> TensorDataset:
    """Regression data where sample ``poison_index`` has inputs beyond fp16's range.

    Targets are scaled down: with GradScaler's initial scale of 2**16, the
    scaled fp16 gradients of ordinary samples must stay far below 65504, or
    ordinary steps overflow too and the one forced overflow is no longer the
    only skip (the scenario's premise).
    """
    data = regression_data(n, seed)
    x, y = data.tensors
    x = x.clone()
    x[poison_index] = OVERFLOW_INPUT
    return TensorDataset(x, y * 0.05)


#: Optimizer steps forced to overflow at the start of the ``backoff`` data: each halves GradScaler's
#: scale, from its initial 2**16 to 2**12.
BACKOFF_STEPS = 4
#: How much the ``backoff`` data scales the regression targets. Measured (torch 2.13 CPU, mlp, SGD, world 2,
#: accumulation 2): the ordinary steps after the back-off stay finite up to a scale of 2**14 per rank of 2
#: (2**14 per rank of 4 too, 2**15 in one process) and overflow at 2**16 on the ranks: at the backed-off
#: 2**12 they train with a 4x margin, and a scaler restarted at 2**16 overflows again.
BACKOFF_TARGET_SCALE = 2.0


def backoff_data(n: int, global_batch_size: int, seed: int = 123) -> TensorDataset:
    """Regression data (targets times :data:`BACKOFF_TARGET_SCALE`) whose first :data:`BACKOFF_STEPS`
    optimizer steps each hold one sample beyond fp16's range (shuffle off): the loss scale backs off
    4 times, and the later, ordinary gradients are large enough that the scale matters."""
    x, y = regression_data(n, seed).tensors
    x = x.clone()
    for step in range(BACKOFF_STEPS):
        x[step * global_batch_size] = OVERFLOW_INPUT
    return TensorDataset(x, y * BACKOFF_TARGET_SCALE)


# --------------------------------------------------------------------------- #
# Scenarios
# --------------------------------------------------------------------------- #

Backend = Literal["reference", "strategy"]


@dataclass(frozen=True)
class Run:
    """One ``fit`` inside a scenario.

    ``twin`` names the reference run of the same shape (same steps, fresh or
    resumed): a strategy run must reproduce its hook sequence, step counts,
    per-step numbers and final canonical state. ``truth`` names an
    uninterrupted reference run whose per-step numbers (matched by step index:
    a resumed run covers only the steps after its checkpoint) and, when both
    end at the same step, final state this run must reproduce; reference runs
    with a truth are checked too (a strategy's checkpoint resumed under
    ``single`` is a reference-backend run). ``same_as`` names strategy runs
    this one must equal (save -> resume equals uninterrupted).

    ``resume_from`` names the run whose checkpoint this one resumes:
    ``"part"`` (same backend) or ``"reference:part"`` / ``"strategy:part"``.
    """

    id: str
    backend: Backend
    #: ``"main"``: the world being certified; ``"alt"``: the reshard world size.
    world: Literal["main", "alt"] = "main"
    max_steps: int | None = None
    #: Write a checkpoint at the end of this run (others resume from it).
    save: bool = False
    #: Resume from the checkpoint of this run (of the same scenario).
    resume_from: str | None = None
    truth: str | None = None
    twin: str | None = None
    same_as: tuple[str, ...] = ()
    #: Trainer settings this run changes (e.g. the unclipped control run).
    overrides: tuple[tuple[str, Any], ...] = ()
    #: Perturb this on every rank but 0 before handing the model to the trainer.
    perturb: Perturbation | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    model: str = "mlp"
    precision: str = FP32
    accumulate_grad_batches: int = 1
    grad_clip_norm: float | None = None
    optimizer: str = "adamw"
    scheduler: str | None = None
    max_steps: int = 6
    data: Literal["regression", "overflow", "dict", "offset", "backoff"] = "regression"
    #: The batch form: ``(inputs, targets)`` with ``loss_fn``, or dict batches with ``training_step``.
    form: Literal["loss_fn", "training_step"] = "loss_fn"
    shuffle: bool = True
    #: Save a checkpoint every N steps in every run; the canonical buffers are
    #: recorded at each one and compared with the reference's at the same step.
    checkpoint_every: int | None = None
    #: Validate every N steps (and at the end) on :func:`~unison.conformance.validation.validation_data`;
    #: ``val/loss`` is compared with the reference at every validation.
    val_every: int | None = None
    #: ``"train"``: runs with the trainer; ``"declarations"``: the precision
    #: declarations are checked by constructing trainers (no training at all).
    kind: Literal["train", "declarations"] = "train"
    #: Needs the strategy to declare a reshardable state_dict: its checkpoint
    #: resumes at another world size or under ``single`` (declared out, and not
    #: run, for a strategy that declares it not reshardable).
    requires_reshardable: bool = False
    #: Premises checked on the reference, so a scenario cannot pass vacuously:
    #: ``"clips"`` (the pre-clip norm exceeds the clip value at every step,
    #: and the reference ends far from its unclipped control run),
    #: ``"straddles_clip"`` (at least 3 steps above the clip value and 3 below
    #: it, and the reference ends far from its unclipped control run),
    #: ``"overflow"`` (exactly the poisoned step is skipped),
    #: ``"buffers_change"`` (every floating buffer moves at every recorded checkpoint).
    premises: tuple[str, ...] = ()
    #: Another scenario (same model, accumulation 1) whose gradient
    #: collectives per optimizer step this one must equal.
    same_sync_as: str | None = None
    runs: tuple[Run, ...] = (
        Run("main", "reference"),
        Run("main", "strategy", twin="main"),
    )

    def run(self, backend: Backend, run_id: str) -> Run:
        """The run ``run_id`` of ``backend`` (the tests execute single runs by name)."""
        for r in self.runs:
            if r.backend == backend and r.id == run_id:
                return r
        raise KeyError(f"scenario {self.name!r} has no {backend} run {run_id!r}")

    def steps_of(self, run: Run) -> int:
        return run.max_steps if run.max_steps is not None else self.max_steps

    def global_batch_size(self, sizing: Sizing) -> int:
        return self.accumulate_grad_batches * sizing.micro_batch

    def poison_step(self) -> int:
        """The optimizer step whose global batch holds the overflow sample (shuffle is off)."""
        return 2

    def dataset(self, sizing: Sizing) -> Dataset:
        n = sizing.dataset_size
        if self.data == "overflow":
            # With shuffle off, sample k*gbs is the first sample of step k:
            # rank 0's slice of the first micro-batch.
            return overflow_data(n, self.poison_step() * self.global_batch_size(sizing))
        if self.data == "dict":
            return DictRegression(n)
        if self.data == "offset":
            x, y = regression_data(n).tensors
            return TensorDataset(x, y + OUTPUT_OFFSET)
        if self.data == "backoff":
            return backoff_data(n, self.global_batch_size(sizing))
        return regression_data(n)

    def trainer_settings(self, sizing: Sizing, run: Run) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "global_batch_size": self.global_batch_size(sizing),
            "max_steps": self.steps_of(run),
            "grad_clip_norm": self.grad_clip_norm,
            "seed": 0,
            "shuffle": self.shuffle,
            "accelerator": "cpu",
            # The suite's runs print nothing: its report is the output.
            "progress": "off",
            **({"checkpoint_every_n_steps": self.checkpoint_every} if self.checkpoint_every else {}),
            **({"val_every_n_steps": self.val_every, "val_batch_size": 3} if self.val_every else {}),
            **dict(run.overrides),
        }


def needs(scenario: Scenario, run: Run) -> dict[str, str]:
    """What ``run`` asks of a strategy, each with why: :class:`~unison.contract.ownership.Feature` values and
    ``"precision:NAME"``. A strategy may refuse the run only if it declares one of these refused
    (or the run's world size, checked separately)."""
    out: dict[str, str] = {}
    if scenario.form == "loss_fn":
        out[Feature.LOSS_FN.value] = "the run trains (inputs, targets) batches with loss_fn"
    else:
        out[Feature.TRAINING_STEP.value] = "the run trains dict batches with training_step"
    if scenario.accumulate_grad_batches > 1:
        out[Feature.GRADIENT_ACCUMULATION.value] = f"accumulate_grad_batches={scenario.accumulate_grad_batches}"
    clip = dict(run.overrides).get("grad_clip_norm", scenario.grad_clip_norm)
    if clip is not None:
        out[Feature.GRADIENT_CLIPPING.value] = f"grad_clip_norm={clip}"
    if run.resume_from is not None:
        out[Feature.RESUME.value] = f"resumes the checkpoint of {run.resume_from}"
    for feature, evidence in model_features(build_model(scenario.model)).items():
        out[feature.value] = f"model {scenario.model!r}: {evidence}"
    out[f"precision:{scenario.precision}"] = f"precision={scenario.precision!r}"
    # Every run trains with an optimizer from the factory; a strategy that runs
    # its own optimizer may accept only some classes (its reason names them).
    out[Feature.ANY_OPTIMIZER.value] = f"optimizer {scenario.optimizer!r} ({_OPTIMIZER_CLASSES[scenario.optimizer]})"
    return out


RESUME_AT = 3


def _resume_runs(at: int = RESUME_AT) -> tuple[Run, ...]:
    """Uninterrupted, interrupted at step ``at`` and resumed, for both backends."""
    return (
        Run("full", "reference"),
        Run("part", "reference", max_steps=at, save=True),
        Run("resumed", "reference", resume_from="part", truth="full"),
        Run("full", "strategy", twin="full"),
        Run("part", "strategy", max_steps=at, save=True, twin="part"),
        Run("resumed", "strategy", resume_from="part", truth="full", twin="resumed", same_as=("full",)),
    )


def _clip_runs() -> tuple[Run, ...]:
    return (
        Run("main", "reference"),
        # The control: without clipping the reference must end elsewhere,
        # or "clipping" clipped nothing (the pre-clip norm alone cannot tell).
        Run("unclipped", "reference", overrides=(("grad_clip_norm", None),)),
        Run("main", "strategy", twin="main"),
    )


#: The id of a precision scenario's fp32 control run (a reference run of the same scenario in
#: ``32-true``): how far the reference moves from it is the effect the scenario exists to see
#: (:mod:`unison.conformance.sensitivity`).
PRECISION_CONTROL = "fp32"


def _precision_runs() -> tuple[Run, ...]:
    return (
        Run("main", "reference"),
        Run(PRECISION_CONTROL, "reference", overrides=(("precision", FP32),)),
        Run("main", "strategy", twin="main"),
    )


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "plain",
        "MLP, fp32, one micro-batch per step, SGD with momentum",
        model="mlp",
        optimizer="sgd",
    ),
    Scenario(
        "validation",
        "val/loss every 2 steps on 25 samples, 3 per replica per batch: a short last batch (zero-weight stand-ins "
        "on every rank but 0); the per-sample mean over all replicas at every validation",
        model="mlp",
        optimizer="sgd",
        val_every=2,
    ),
    Scenario(
        "accumulation",
        "MLP, 4 micro-batches per optimizer step: gradients synchronised as the strategy declares (at the "
        "boundary only, or at every micro-step)",
        model="mlp",
        optimizer="sgd",
        accumulate_grad_batches=4,
        same_sync_as="plain",
    ),
    Scenario(
        "training_step",
        "dict batches trained with training_step(model, batch), accumulation 2",
        model="mlp",
        optimizer="sgd",
        accumulate_grad_batches=2,
        data="dict",
        form="training_step",
    ),
    Scenario(
        "clipping",
        "MLP, clip by global norm at a value half the steps exceed (clipped) and half stay under (left "
        "unchanged: the coefficient is capped at 1), accumulation 2",
        model="mlp",
        optimizer="sgd",
        accumulate_grad_batches=2,
        # The reference's pre-clip norms: 2.63, 2.66, 1.68, 2.36, 1.02, 1.56, 1.85, 2.39.
        grad_clip_norm=2.0,
        max_steps=8,
        premises=("straddles_clip",),
        runs=_clip_runs(),
    ),
    Scenario(
        "tied_weights",
        "tied weights (one matrix under two names) clipped by global norm: the tie counted once",
        model="tied",
        optimizer="sgd",
        accumulate_grad_batches=2,
        grad_clip_norm=0.05,
        premises=("clips",),
        runs=_clip_runs(),
    ),
    Scenario(
        "lr_scheduler",
        "two parameter groups (lr, weight decay) under a StepLR schedule",
        model="groups",
        optimizer="adamw_groups",
        scheduler="step",
        accumulate_grad_batches=2,
    ),
    Scenario(
        "buffers",
        "BatchNorm buffers (running statistics, step counter) that change at every step, accumulation 2; "
        "compared at every checkpoint and at the end",
        model="batchnorm",
        optimizer="sgd",
        accumulate_grad_batches=2,
        checkpoint_every=2,
        premises=("buffers_change",),
    ),
    Scenario(
        "frozen",
        "first layer frozen, clipping on, accumulation 2, weight decay 2.0 (a frozen parameter decayed moves)",
        model="frozen",
        optimizer="adamw_decay",
        accumulate_grad_batches=2,
        grad_clip_norm=1.0,
    ),
    Scenario(
        "replica_init",
        "every rank but 0 starts from perturbed weights: replicas must still train like the reference "
        "(whoever the declaration says makes them equal)",
        model="mlp",
        optimizer="sgd",
        accumulate_grad_batches=2,
        runs=(Run("main", "reference"), Run("main", "strategy", twin="main", perturb="weights")),
    ),
    Scenario(
        "replica_init_buffers",
        "every rank but 0 starts from perturbed buffers (running statistics, step counter)",
        model="batchnorm",
        optimizer="sgd",
        accumulate_grad_batches=2,
        runs=(Run("main", "reference"), Run("main", "strategy", twin="main", perturb="buffers")),
    ),
    Scenario(
        "bf16_mixed",
        "bf16 autocast (or the engine's bf16), accumulation 2; targets near 128, where bf16 rounds every "
        "prediction to a whole number, so training in bf16 ends far (> 10x the tolerance) from its fp32 control run",
        # SGD, not Adam: Adam's first update is lr * sign(g), so a gradient
        # element near zero whose sign bf16 rounding flips (summation order
        # differs with the number of ranks) moves by 2 * lr and the
        # comparison measures the sign of noise, not the backend. SGD's update
        # is proportional to the gradient, so bf16 rounding stays bf16-sized.
        model="offset",
        data="offset",
        precision=BF16_MIXED,
        optimizer="sgd",
        accumulate_grad_batches=2,
        runs=_precision_runs(),
    ),
    Scenario(
        "fp16_overflow",
        "fp16 with loss scaling; one sample's inputs overflow fp16 in the forward: that step is skipped "
        "and the scheduler does not advance",
        model="mlp",
        precision=FP16_MIXED,
        optimizer="sgd",
        scheduler="warmup",
        accumulate_grad_batches=2,
        data="overflow",
        shuffle=False,
        premises=("overflow",),
        runs=_precision_runs(),
    ),
    Scenario(
        "resume",
        "save at step 3, resume to step 6: equals the uninterrupted run, buffers included (frozen layer, "
        "changing BatchNorm buffers, warmup)",
        model="frozen_batchnorm",
        optimizer="adamw",
        scheduler="warmup",
        accumulate_grad_batches=2,
        runs=_resume_runs(),
    ),
    Scenario(
        "resume_sgd",
        "save at step 3, resume to step 6 with SGD momentum under StepLR: the momentum buffers and the schedule "
        "are restored",
        model="mlp",
        optimizer="sgd",
        scheduler="step",
        accumulate_grad_batches=2,
        runs=_resume_runs(),
    ),
    Scenario(
        "resume_rmsprop",
        "save at step 3, resume to step 6 with RMSprop and momentum (per-parameter state other than Adam's), warmup",
        model="mlp",
        optimizer="rmsprop",
        scheduler="warmup",
        accumulate_grad_batches=2,
        runs=_resume_runs(),
    ),
    Scenario(
        "cross_resume",
        "a checkpoint of the strategy resumes under single, and a checkpoint of single under the strategy "
        "(parameter groups, StepLR; a world-size change, so declared reshardable)",
        model="groups",
        optimizer="adamw_groups",
        scheduler="step",
        accumulate_grad_batches=2,
        requires_reshardable=True,
        runs=(
            Run("full", "reference"),
            Run("part", "reference", max_steps=RESUME_AT, save=True),
            Run("resumed", "reference", resume_from="part", truth="full"),
            Run("part", "strategy", max_steps=RESUME_AT, save=True, twin="part"),
            # A reference-backend run from the strategy's checkpoint: it runs
            # after the strategy's world has written that checkpoint.
            Run("from_strategy", "reference", resume_from="strategy:part", truth="full"),
            Run("from_single", "strategy", resume_from="reference:part", truth="full", twin="resumed"),
        ),
    ),
    Scenario(
        "reshard",
        "save at the main world size, resume at another world size with the same strategy and with single "
        "(declared reshardable; changing buffers)",
        model="batchnorm",
        optimizer="adamw",
        scheduler="step",
        accumulate_grad_batches=2,
        requires_reshardable=True,
        runs=(
            Run("full", "reference"),
            Run("part", "reference", max_steps=RESUME_AT, save=True),
            Run("resumed", "reference", resume_from="part", truth="full"),
            Run("part", "strategy", max_steps=RESUME_AT, save=True, twin="part"),
            Run("resumed", "strategy", world="alt", resume_from="part", truth="full", twin="resumed"),
            # The same checkpoint in one process under single: a world-size
            # change every reshardable format must survive, and the check that
            # remains when the strategy itself cannot run at the other world
            # size (a 2-stage pipeline needs 2 ranks).
            Run("single_from_strategy", "reference", resume_from="strategy:part", truth="full"),
        ),
    ),
    Scenario(
        "unsupported_precision",
        "every precision declared unsupported raises a ConfigurationError naming it when the Trainer is "
        "built (before any process group); every precision declared supported is accepted",
        kind="declarations",
        runs=(),
    ),
    Scenario(
        "resume_adagrad",
        "save at step 3, resume to step 6 with Adagrad in two parameter groups (state created in its "
        "constructor: a sum of squared gradients from initial_accumulator_value, a step count read by lr_decay), "
        "warmup",
        model="groups",
        optimizer="adagrad_groups",
        scheduler="warmup",
        accumulate_grad_batches=2,
        runs=_resume_runs(),
    ),
    Scenario(
        "resume_fp16",
        f"fp16 with loss scaling: {BACKOFF_STEPS} forced overflows back the scale off from 2**16 to "
        f"2**{16 - BACKOFF_STEPS}, one step trains, save, resume to step 8; ordinary gradients here overflow at "
        "2**16, so a resume that loses the scaler's state skips steps the uninterrupted run takes",
        model="mlp",
        precision=FP16_MIXED,
        optimizer="sgd",
        accumulate_grad_batches=2,
        data="backoff",
        shuffle=False,
        max_steps=BACKOFF_STEPS + 4,
        runs=_resume_runs(at=BACKOFF_STEPS + 1),
    ),
)

SCENARIOS_BY_NAME: dict[str, Scenario] = {s.name: s for s in SCENARIOS}


def select(names: Sequence[str] | None) -> tuple[Scenario, ...]:
    """The scenarios named (all when ``names`` is empty), in catalogue order."""
    if not names:
        return SCENARIOS
    unknown = [n for n in names if n not in SCENARIOS_BY_NAME]
    if unknown:
        raise KeyError(f"unknown scenario(s) {unknown}; known: {sorted(SCENARIOS_BY_NAME)}")
    wanted = set(names)
    # Dependencies come along: a scenario comparing its sync pattern with
    # another needs that one's runs.
    for n in list(wanted):
        dep = SCENARIOS_BY_NAME[n].same_sync_as
        if dep:
            wanted.add(dep)
    return tuple(s for s in SCENARIOS if s.name in wanted)


__all__ = [
    "MODELS",
    "OPTIMIZERS",
    "OUTPUT_OFFSET",
    "PRECISION_CONTROL",
    "SCENARIOS",
    "SCENARIOS_BY_NAME",
    "SCHEDULERS",
    "DriftingBatchNorm1d",
    "Run",
    "Scenario",
    "Sizing",
    "build_model",
    "default_alt_world_size",
    "loss_fn",
    "needs",
    "perturb",
    "select",
    "training_step",
]
