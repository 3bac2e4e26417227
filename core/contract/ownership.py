"""Ownership declarations: who owns accumulation, precision, state_dict and replica init.

Every strategy returns one frozen :class:`Ownership` value. The trainer reads
it and never looks at the strategy's class or name; ``unison describe NAME``
prints it; the conformance suite verifies it instead of trusting it.

A composed strategy also declares its device mesh (:class:`~unison.contract.mesh.MeshLayout`:
named dimensions, sizes, which collective runs on which); the field is optional.

Everything a strategy may refuse is declared here too: a precision
(``precision[name]`` unsupported), a :class:`Feature` (``refuses``), a world
size (``world_sizes``). The trainer enforces the declaration before any
process group starts, and the conformance suite fails a strategy that refuses
something it declares supported.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

from unison.contract.mesh import MeshLayout
from unison.errors import did_you_mean

#: The precision names every strategy must answer for, supported or not.
STANDARD_PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")


class AccumulationOwner(str, enum.Enum):
    """Who decides the gradient-accumulation boundary and scales the loss."""

    #: The trainer runs each micro-batch's forward and backward, divides the
    #: loss by ``accumulate_grad_batches`` once, and enters the strategy's
    #: :meth:`~unison.Strategy.no_sync` context on non-boundary micro-steps so
    #: that gradients are synchronised once per optimizer step.
    TRAINER = "trainer"
    #: The engine counts micro-steps, scales the loss and decides the boundary
    #: (DeepSpeed). The trainer feeds each micro-batch with the *undivided* loss
    #: to :meth:`~unison.Strategy.backward` and checks at every micro-step that
    #: :meth:`~unison.Strategy.is_accumulation_boundary` agrees with its own.
    ENGINE = "engine"
    #: A schedule consumes all micro-batches of an optimizer step at once
    #: (pipelines): the trainer hands them to
    #: :meth:`~unison.Strategy.forward_backward` and gets one loss per micro-batch.
    SCHEDULE = "schedule"


class PrecisionOwner(str, enum.Enum):
    """Who applies a precision."""

    TRAINER = "trainer"  #: the trainer's precision plugin (autocast, GradScaler, casts)
    ENGINE = "engine"  #: the engine's own config (DeepSpeed ``bf16``/``fp16``)
    SHARDING_POLICY = "sharding-policy"  #: a sharding wrapper's policy (FSDP MixedPrecision)
    PLUGIN = "plugin"  #: a third-party precision plugin, registered by name through ``unison_precisions``
    UNSUPPORTED = "unsupported"  #: refused before training, with a reason


class StateDictKind(str, enum.Enum):
    FULL = "full"  #: each checkpoint holds whole, unsharded tensors
    SHARDED = "sharded"  #: each rank writes its own shard


class GradSync(str, enum.Enum):
    """When gradients are synchronised across replicas under trainer-owned accumulation."""

    #: Only at the last micro-step of an optimizer step: the strategy's
    #: ``no_sync()`` defers synchronisation on the others (DDP, FSDP).
    BOUNDARY = "boundary"
    #: At every micro-step (numerically the same result, more communication);
    #: the strategy has no ``no_sync()`` and the trainer enters none.
    EVERY_MICRO_STEP = "every-micro-step"


@dataclass(frozen=True)
class GradAccumulation:
    owner: AccumulationOwner
    #: How gradient sync is skipped or the boundary decided, in words.
    mechanism: str
    #: For ``owner=trainer``: when gradients are synchronised (the suite
    #: counts the collectives against it). Ignored for the other owners.
    sync: GradSync = GradSync.BOUNDARY


class Reduction(str, enum.Enum):
    """How a strategy combines the replicas' gradients at the boundary."""

    MEAN = "mean"  #: the average over the replicas (DDP's all-reduce, FSDP's reduce-scatter, ZeRO)
    SUM = "sum"  #: the plain sum


class LossDivisor(str, enum.Enum):
    """What each micro-batch's loss is divided by before its backward, by the accumulation owner."""

    #: The step's micro-batch count: the trainer's ``loss / A``, an engine's ``1 / gradient_accumulation_steps``,
    #: a schedule's ``loss / n_microbatches``.
    MICRO_BATCHES = "micro-batches"
    #: Nothing: the gradients are the sum over micro-batches.
    NONE = "none"


@dataclass(frozen=True)
class LossNormalisation:
    """How backward and the gradient reduction normalise a loss (plugin API 2.3).

    The trainer trains every loss form on the mean the user means: the
    micro-batch's mean loss (a scalar) as before, and a ``(loss_sum, num_items)``
    pair as ``sum over the global batch / num_items over the global batch``
    (every micro-batch, every replica). For the pair it backpropagates the
    sums as the declaration says they are divided (:attr:`divisor`) and
    reduced (:attr:`replicas`), then multiplies the gradients once by
    ``A**d * W**m / N`` before clipping (``A`` micro-batches, ``W``
    data-parallel replicas, ``N`` the step's global item count; ``d``, ``m``
    1 or 0 as declared), through :meth:`~unison.Strategy.scale_gradients`. So
    the scale comes from this value, never from a strategy's name; a
    declaration that misstates the reduction trains the wrong gradient scale,
    which the conformance suite's ``token_loss`` scenario sees in the grad norm.
    """

    #: What each micro-batch's loss is divided by before its backward.
    divisor: LossDivisor = LossDivisor.MICRO_BATCHES
    #: How the replicas' gradients are combined.
    replicas: Reduction = Reduction.MEAN
    #: Over which ranks, in words (mesh dimensions for a composed strategy).
    over: str = "the data-parallel replicas"
    #: Where the gradients of the pair form are scaled (``scale_gradients``), in words.
    scaled_by: str = "scale_gradients multiplies every local gradient (or shard) in place"

    def gradient_factor_numerator(self, micro_batches: int, replicas: int) -> int:
        """``A**d * W**m``: undoes what backward and the reduction divided by, before dividing by ``N``."""
        return (micro_batches if self.divisor is LossDivisor.MICRO_BATCHES else 1) * (
            replicas if self.replicas is Reduction.MEAN else 1
        )


#: What a strategy on the trainer's accumulation path normalises by when it declares nothing: the contract of
#: API 2.2 and before (``backward(loss / A)``, gradients averaged over the replicas).
DEFAULT_LOSS_NORMALISATION = LossNormalisation()


@dataclass(frozen=True)
class PrecisionSupport:
    owner: PrecisionOwner
    #: What applies it (``torch.autocast(bfloat16)``), or why it is unsupported.
    detail: str

    @property
    def supported(self) -> bool:
        return self.owner is not PrecisionOwner.UNSUPPORTED

    @property
    def applied_by_trainer(self) -> bool:
        """The trainer builds the registered precision plugin and drives it (trainer- or plugin-owned)."""
        return self.owner in (PrecisionOwner.TRAINER, PrecisionOwner.PLUGIN)

    @classmethod
    def unsupported(cls, reason: str) -> PrecisionSupport:
        return cls(PrecisionOwner.UNSUPPORTED, reason)


@dataclass(frozen=True)
class StateDictDeclaration:
    kind: StateDictKind
    #: The on-disk format of the strategy's own checkpoint files.
    format: str
    #: Whether a checkpoint written at one world size loads at another.
    reshardable: bool
    #: How the canonical full state dict is produced, in words.
    canonical_export: str


class ReplicaInit(str, enum.Enum):
    """Who makes every replica start from the same weights."""

    #: The trainer broadcasts global rank 0's parameters and buffers to every
    #: rank after the process group exists and before ``setup``.
    TRAINER = "trainer"
    #: The strategy's ``setup`` does it (DDP's constructor broadcasts rank 0's
    #: module state); the trainer does not. The conformance suite perturbs the
    #: weights of every rank but 0 to prove it.
    STRATEGY = "strategy"


class Feature(str, enum.Enum):
    """Things a run may ask of a strategy, each of which it may declare it refuses."""

    #: Batches ``(inputs, targets)`` trained with ``loss_fn(model(inputs), targets)``.
    LOSS_FN = "loss_fn"
    #: Batches of any structure trained with ``training_step(model, batch) -> loss``.
    TRAINING_STEP = "training_step"
    #: ``accumulate_grad_batches > 1``.
    GRADIENT_ACCUMULATION = "gradient_accumulation"
    #: ``grad_clip_norm`` set.
    GRADIENT_CLIPPING = "gradient_clipping"
    #: Resuming from a checkpoint (``ckpt_path``).
    RESUME = "resume"
    #: A model with a parameter reachable under two names (tied weights).
    TIED_WEIGHTS = "tied_weights"
    #: A model with parameters that do not require gradients.
    FROZEN_PARAMETERS = "frozen_parameters"
    #: A model with buffers (BatchNorm statistics, counters).
    BUFFERS = "buffers"
    #: A model that is not an ``nn.Sequential`` and declares no split points
    #: (``pipeline_layers = [child names in forward order]``).
    ARBITRARY_MODULE = "arbitrary_module"
    #: A model that declares no tensor-parallel plan (``tp_plan``, or Hugging Face's ``base_model_tp_plan``
    #: on the model or its ``config``: which submodules are split column-wise and row-wise) and whose
    #: blocks no plugin plans (``unison_tensor_parallel_plan``; :mod:`unison.contract.tensor_parallel`).
    NO_TENSOR_PARALLEL_PLAN = "no_tensor_parallel_plan"
    #: An optimizer of any class from the optimizer factory (a strategy that
    #: runs its own optimizer accepts only the classes its reason names).
    ANY_OPTIMIZER = "any_optimizer"
    #: ``compile`` set: ``torch.compile`` of the module's forward (per block
    #: where the strategy shards per block).
    COMPILE = "compile"
    #: ``activation_checkpointing`` set: the forward of the model's blocks
    #: recomputed in backward instead of keeping its activations.
    ACTIVATION_CHECKPOINTING = "activation_checkpointing"
    #: A ``loss_fn`` or ``training_step`` returning ``(loss_sum, num_items)`` (token-weighted losses), or the
    #: Hugging Face path: the step normalised by its global item count (API 2.3).
    ITEM_WEIGHTED_LOSS = "item_weighted_loss"

    @property
    def description(self) -> str:
        return _FEATURE_DESCRIPTIONS[self]


_FEATURE_DESCRIPTIONS = {
    Feature.LOSS_FN: "(inputs, targets) batches with loss_fn(outputs, targets)",
    Feature.TRAINING_STEP: "the training_step(model, batch) form",
    Feature.GRADIENT_ACCUMULATION: "gradient accumulation (accumulate_grad_batches > 1)",
    Feature.GRADIENT_CLIPPING: "gradient clipping (grad_clip_norm)",
    Feature.RESUME: "resuming from a checkpoint (ckpt_path)",
    Feature.TIED_WEIGHTS: "models with tied (shared) parameters",
    Feature.FROZEN_PARAMETERS: "models with frozen parameters (requires_grad=False)",
    Feature.BUFFERS: "models with buffers",
    Feature.ARBITRARY_MODULE: "models that are not an nn.Sequential and declare no split points (pipeline_layers)",
    Feature.NO_TENSOR_PARALLEL_PLAN: (
        "models that declare no tensor-parallel plan (tp_plan / base_model_tp_plan) and whose blocks no plugin "
        "plans (unison_tensor_parallel_plan)"
    ),
    Feature.ANY_OPTIMIZER: "any optimizer class from the optimizer factory",
    Feature.COMPILE: "torch.compile of the model (compile)",
    Feature.ACTIVATION_CHECKPOINTING: "activation checkpointing of the model's blocks (activation_checkpointing)",
    Feature.ITEM_WEIGHTED_LOSS: (
        "losses returned as (loss_sum, num_items), normalised by the step's global item count (token-weighted)"
    ),
}


@dataclass(frozen=True)
class WorldSizes:
    """The world sizes a configured strategy runs at: ``minimum`` and multiples of ``multiple_of``."""

    minimum: int = 1
    multiple_of: int = 1
    #: Why the restriction exists (shown by ``unison describe`` and in the error).
    reason: str = ""

    def refusal(self, world_size: int) -> str | None:
        """Why ``world_size`` is refused, or ``None``."""
        if world_size < self.minimum or world_size % self.multiple_of:
            rule = (
                f"at least {self.minimum}"
                if self.multiple_of == 1
                else (
                    f"a multiple of {self.multiple_of}"
                    + (f", at least {self.minimum}" if self.minimum > self.multiple_of else "")
                )
            )
            return f"world size {world_size} is not {rule}" + (f": {self.reason}" if self.reason else "")
        return None


@dataclass(frozen=True)
class Ownership:
    """The whole declaration of one configured strategy."""

    grad_accumulation: GradAccumulation
    precision: Mapping[str, PrecisionSupport]
    state_dict: StateDictDeclaration
    #: ``None`` when the strategy is believed to train like the single-process
    #: reference; otherwise the reason it does not (the conformance suite still
    #: runs it and shows the failure).
    non_conformant: str | None = None
    notes: tuple[str, ...] = field(default=())
    #: Who makes replicas start from rank 0's weights.
    replica_init: ReplicaInit = ReplicaInit.TRAINER
    #: Features this strategy refuses, each with the reason (every other
    #: :class:`Feature` is supported). Refused before any process group.
    refuses: Mapping[Feature, str] = field(default_factory=dict)
    #: The world sizes it runs at.
    world_sizes: WorldSizes = WorldSizes()
    #: The named device-mesh dimensions of a composed strategy (HSDP, FSDP x TP), each with its size
    #: and collectives (:mod:`unison.contract.mesh`); ``None``: a flat world, nothing to declare.
    mesh: MeshLayout | None = None
    #: How backward and the gradient reduction normalise a loss (API 2.3). ``None`` (a strategy written before
    #: 2.3): :data:`DEFAULT_LOSS_NORMALISATION` on the trainer's accumulation path, whose contract it is; an
    #: engine or a schedule that declares nothing refuses :attr:`Feature.ITEM_WEIGHTED_LOSS` (the trainer
    #: cannot know where such an engine keeps its gradients, or whether a schedule passes a pair through).
    loss_normalisation: LossNormalisation | None = None

    def __post_init__(self) -> None:
        missing = [p for p in STANDARD_PRECISIONS if p not in self.precision]
        if missing:
            raise ValueError(f"Ownership.precision must declare every standard precision; missing {missing}")
        # Freeze the mappings too: a declaration never changes after construction.
        object.__setattr__(self, "precision", MappingProxyType(dict(self.precision)))
        refuses = {Feature(k): str(v) for k, v in self.refuses.items()}
        if self.loss_normalisation is None and self.grad_accumulation.owner is not AccumulationOwner.TRAINER:
            refuses.setdefault(
                Feature.ITEM_WEIGHTED_LOSS,
                f"this {self.grad_accumulation.owner.value}-owned strategy declares no loss_normalisation (plugin "
                "API 2.3): the trainer cannot know how its engine or schedule divides and reduces a summed loss",
            )
        object.__setattr__(self, "refuses", MappingProxyType(refuses))

    @property
    def normalisation(self) -> LossNormalisation:
        """The declared :class:`LossNormalisation`, or the trainer path's default when none is declared."""
        return self.loss_normalisation or DEFAULT_LOSS_NORMALISATION

    def refusal(self, feature: Feature | str) -> str | None:
        """The declared reason this strategy refuses ``feature``, or ``None`` when it supports it."""
        return self.refuses.get(Feature(feature))

    def precision_support(self, name: str) -> PrecisionSupport:
        try:
            return self.precision[name]
        except KeyError:
            return PrecisionSupport.unsupported(
                f"precision {name!r} is not declared by this strategy{did_you_mean(name, self.precision)}; "
                f"declared: {sorted(self.precision)}"
            )

    def to_dict(self) -> dict[str, Any]:
        def plain(value: Any) -> Any:
            if isinstance(value, enum.Enum):
                return value.value
            if isinstance(value, Mapping):
                return {k: plain(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [plain(v) for v in value]
            return value

        return {
            "grad_accumulation": plain(asdict(self.grad_accumulation)),
            "precision": {k: plain(asdict(v)) for k, v in self.precision.items()},
            "state_dict": plain(asdict(self.state_dict)),
            "replica_init": self.replica_init.value,
            "refuses": {k.value: v for k, v in self.refuses.items()},
            "world_sizes": asdict(self.world_sizes),
            "mesh": None if self.mesh is None else self.mesh.to_dict(),
            "loss_normalisation": dict(plain(asdict(self.normalisation)), declared=self.loss_normalisation is not None),
            "non_conformant": self.non_conformant,
            "notes": list(self.notes),
        }
