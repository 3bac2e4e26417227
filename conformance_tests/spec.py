"""What a scenario and a run are, and what a run asks of a strategy.

Each :class:`Scenario` fixes a tiny model (:mod:`unison.conformance.models`), a
dataset (:mod:`unison.conformance.data`), an optimizer, the trainer settings and
a list of :class:`Run` values: the fits to execute under the reference
(``single``) and under the strategy being certified, and which runs must agree
with which. The suite executes the runs, the comparison applies the checks;
this module only *describes*.

What a run asks of a strategy (:func:`needs`) is derived from the same
description: the batch form, accumulation, clipping, resume, the model's
features (:func:`unison.contract.strategy.model_features`) and the precision. The
comparison accepts a refusal only when one of those is declared refused.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Literal

from torch.utils.data import Dataset, TensorDataset

from unison.conformance.data import DictRegression, Sizing, backoff_data, overflow_data, regression_data
from unison.conformance.models import _OPTIMIZER_CLASSES, OUTPUT_OFFSET, Perturbation, build_model
from unison.conformance.workloads import TokenDicts, token_pairs, transformers_missing
from unison.contract.ownership import Feature
from unison.contract.strategy import model_features
from unison.plugin.manager import PluginManager

#: The precision each scenario trains in, and the precisions the suite knows tolerances for.
FP32, BF16_MIXED, FP16_MIXED = "32-true", "bf16-mixed", "16-mixed"


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

    ``exact_as`` names runs of the same backend this one must equal bit for bit
    (every per-step number and the final state, tolerance 0): what may change
    nothing at all (default plugins on or off, a resume in a new process).
    """

    id: str
    backend: Backend
    #: ``"main"``: the world being certified; ``"alt"``: the reshard world size; ``"fresh"``: a new world of
    #: the main size, started after the main world ended (new processes: nothing cached in them).
    world: Literal["main", "alt", "fresh"] = "main"
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
    #: Bit-for-bit equal runs of the same backend (see the class).
    exact_as: tuple[str, ...] = ()
    #: The loss this run trains instead of the scenario's (a control run: ``"token_slice_mean"``).
    loss: str | None = None
    #: The Trainer's default callbacks, loggers and progress display on (every other run has them off).
    defaults: bool = False


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    model: str = "mlp"
    precision: str = FP32
    accumulate_grad_batches: int = 1
    grad_clip_norm: float | None = None
    #: ``(micro-batch size, clip value)`` pairs: larger global batches average more noise away and have
    #: smaller gradient norms, so a clip value chosen to straddle one batch size's norms does not
    #: straddle another's. :meth:`sized` picks the entry of the suite's micro-batch (the nearest size
    #: when none matches; the ``straddles_clip`` premise then says whether it still straddles).
    grad_clip_norm_at: tuple[tuple[int, float], ...] = ()
    optimizer: str = "adamw"
    scheduler: str | None = None
    max_steps: int = 6
    data: Literal["regression", "overflow", "dict", "offset", "backoff", "tokens", "token_dicts"] = "regression"
    #: The batch form: ``(inputs, targets)`` with ``loss_fn``, dict batches with ``training_step``, or dict
    #: batches holding ``labels`` with neither (the Hugging Face path: the model's own loss).
    form: Literal["loss_fn", "training_step", "huggingface"] = "loss_fn"
    #: The loss: ``"mse"`` (:func:`~unison.conformance.models.loss_fn`), ``"token"`` (the pair form
    #: ``(loss_sum, num_items)``, :func:`~unison.conformance.workloads.token_loss`) or ``"token_slice_mean"``.
    loss: Literal["mse", "token", "token_slice_mean"] = "mse"
    #: ``(reference run id, what it changes)``: a control run of the reference the main reference run must
    #: end far from (effect >= 10x the tolerance, :mod:`unison.conformance.sensitivity`), or the scenario is
    #: inconclusive. Precision scenarios have theirs built in (their fp32 run).
    control: tuple[str, str] | None = None
    #: A reference run at accumulation 1 (one micro-batch of the whole global batch): the strategy's per-step
    #: loss and grad norm and its final state must equal it too (a split-independent loss).
    full_batch: str | None = None
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
    #: A module feature the strategy's runs ask for (in their ``overrides``) whose application a probe
    #: checks (:mod:`unison.conformance.feature_probes`): ``"compile"`` or ``"activation_checkpointing"``.
    probe: Literal["compile", "activation_checkpointing"] | None = None
    runs: tuple[Run, ...] = (
        Run("main", "reference"),
        Run("main", "strategy", twin="main"),
    )

    def unavailable(self) -> str | None:
        """Why this scenario cannot run on this machine (a library it needs is missing), or ``None``."""
        return transformers_missing() if self.model == "llama" else None

    def run(self, backend: Backend, run_id: str) -> Run:
        """The run ``run_id`` of ``backend`` (the tests execute single runs by name)."""
        for r in self.runs:
            if r.backend == backend and r.id == run_id:
                return r
        raise KeyError(f"scenario {self.name!r} has no {backend} run {run_id!r}")

    def sized(self, sizing: Sizing) -> Scenario:
        """This scenario as it runs at ``sizing``: the clip value of its micro-batch size."""
        if not self.grad_clip_norm_at:
            return self
        _, clip = min(self.grad_clip_norm_at, key=lambda entry: abs(entry[0] - sizing.micro_batch))
        return dataclasses.replace(self, grad_clip_norm=clip)

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
        if self.data == "tokens":
            return token_pairs(n)
        if self.data == "token_dicts":
            return TokenDicts(n)
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
            # The suite's runs print nothing (its report is the output), but a run with the defaults on.
            **({} if run.defaults else {"progress": "off"}),
            **({"checkpoint_every_n_steps": self.checkpoint_every} if self.checkpoint_every else {}),
            **({"val_every_n_steps": self.val_every, "val_batch_size": 3} if self.val_every else {}),
            **dict(run.overrides),
        }


@functools.cache
def _installed_plugins() -> PluginManager:
    """The installed plugins (lazy: an entry point is imported only for a hook it names), asked for the
    tensor-parallel plans they register for the models' blocks (the ``block`` model's comes from one)."""
    return PluginManager(lazy=True)


def needs(scenario: Scenario, run: Run) -> dict[str, str]:
    """What ``run`` asks of a strategy, each with why: :class:`~unison.contract.ownership.Feature` values and
    ``"precision:NAME"``. A strategy may refuse the run only if it declares one of these refused
    (or the run's world size, checked separately)."""
    out: dict[str, str] = {}
    if scenario.form == "loss_fn":
        out[Feature.LOSS_FN.value] = "the run trains (inputs, targets) batches with loss_fn"
    elif scenario.form == "huggingface":
        out[Feature.TRAINING_STEP.value] = (
            "the run trains dict batches with labels through the Hugging Face path (the model's own loss, "
            "a training_step of the trainer's)"
        )
    else:
        out[Feature.TRAINING_STEP.value] = "the run trains dict batches with training_step"
    if (run.loss or scenario.loss) == "token" or scenario.form == "huggingface":
        out[Feature.ITEM_WEIGHTED_LOSS.value] = "the loss is a (loss_sum, num_items) pair over padded token batches"
    if scenario.accumulate_grad_batches > 1:
        out[Feature.GRADIENT_ACCUMULATION.value] = f"accumulate_grad_batches={scenario.accumulate_grad_batches}"
    clip = dict(run.overrides).get("grad_clip_norm", scenario.grad_clip_norm)
    if clip is not None:
        out[Feature.GRADIENT_CLIPPING.value] = f"grad_clip_norm={clip}"
    if run.resume_from is not None:
        out[Feature.RESUME.value] = f"resumes the checkpoint of {run.resume_from}"
    overrides = dict(run.overrides)
    if overrides.get("compile", False) is not False:
        out[Feature.COMPILE.value] = f"compile={overrides['compile']!r}"
    if overrides.get("activation_checkpointing") is not None:
        policy = overrides["activation_checkpointing"]
        out[Feature.ACTIVATION_CHECKPOINTING.value] = f"activation_checkpointing={policy!r}"
    features = {} if scenario.unavailable() else model_features(build_model(scenario.model), _installed_plugins())
    for feature, evidence in features.items():
        out[feature.value] = f"model {scenario.model!r}: {evidence}"
    out[f"precision:{scenario.precision}"] = f"precision={scenario.precision!r}"
    # Every run trains with an optimizer from the factory; a strategy that runs
    # its own optimizer may accept only some classes (its reason names them).
    out[Feature.ANY_OPTIMIZER.value] = f"optimizer {scenario.optimizer!r} ({_OPTIMIZER_CLASSES[scenario.optimizer]})"
    return out
