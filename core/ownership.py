"""Ownership declarations: who owns accumulation, precision and state_dict.

Every strategy returns one frozen :class:`Ownership` value. The trainer reads
it and never looks at the strategy's class or name; ``unison describe NAME``
prints it; the conformance suite verifies it instead of trusting it.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

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
    PLUGIN = "plugin"  #: a third-party precision plugin (apex)
    UNSUPPORTED = "unsupported"  #: refused before training, with a reason


class StateDictKind(str, enum.Enum):
    FULL = "full"  #: each checkpoint holds whole, unsharded tensors
    SHARDED = "sharded"  #: each rank writes its own shard


@dataclass(frozen=True)
class GradAccumulation:
    owner: AccumulationOwner
    #: How gradient sync is skipped or the boundary decided, in words.
    mechanism: str


@dataclass(frozen=True)
class PrecisionSupport:
    owner: PrecisionOwner
    #: What applies it (``torch.autocast(bfloat16)``), or why it is unsupported.
    detail: str

    @property
    def supported(self) -> bool:
        return self.owner is not PrecisionOwner.UNSUPPORTED

    @classmethod
    def unsupported(cls, reason: str) -> "PrecisionSupport":
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

    def __post_init__(self) -> None:
        missing = [p for p in STANDARD_PRECISIONS if p not in self.precision]
        if missing:
            raise ValueError(f"Ownership.precision must declare every standard precision; missing {missing}")
        # Freeze the mapping too: a declaration never changes after construction.
        object.__setattr__(self, "precision", MappingProxyType(dict(self.precision)))

    def precision_support(self, name: str) -> PrecisionSupport:
        try:
            return self.precision[name]
        except KeyError:
            return PrecisionSupport.unsupported(
                f"precision {name!r} is not declared by this strategy; declared: {sorted(self.precision)}"
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
            "non_conformant": self.non_conformant,
            "notes": list(self.notes),
        }
