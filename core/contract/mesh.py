"""The device-mesh declaration of a composed strategy: named dimensions, their sizes and collectives.

A strategy that arranges its ranks on a multi-dimensional ``DeviceMesh``
(HSDP: replicate x shard; FSDP x tensor parallel: dp x tp) declares the
arrangement in :attr:`Ownership.mesh <unison.contract.ownership.Ownership.mesh>`
as a frozen :class:`MeshLayout`. ``unison describe NAME`` prints it, and the
strategy builds its mesh *from* it (:meth:`MeshLayout.shape`), so the
declaration and the process groups cannot disagree.

The field is optional: a strategy on a flat world (``ddp``, ``fsdp``, any
third-party strategy written before it existed) declares nothing and is
described as before.

Sizes depend on the world size, which a declaration does not know (``unison
describe`` runs without a world): at most one dimension may leave its size to
the world (``size=None``, torchtitan's ``-1``), and :meth:`MeshLayout.shape`
resolves it, refusing a world the fixed sizes do not divide.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class MeshDim:
    """One named dimension of the mesh."""

    #: The dimension's name in the ``DeviceMesh`` (``"replicate"``, ``"shard"``, ``"dp"``, ``"tp"``).
    name: str
    #: Ranks along it; ``None``: whatever the world size leaves after the other dimensions.
    size: int | None
    #: What is split along it (``"parameters, gradients, optimizer state"``), or ``"nothing"`` for replicas.
    shards: str
    #: Which collective runs along it and when, in words (``"gradient all-reduce once per optimizer step"``).
    collectives: str

    def __post_init__(self) -> None:
        if self.size is not None and self.size < 1:
            raise ValueError(f"mesh dimension {self.name!r}: size {self.size} is not positive")


@dataclass(frozen=True)
class MeshLayout:
    """The mesh's dimensions, outermost first (the order of ``init_device_mesh``'s shape)."""

    dims: tuple[MeshDim, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(self.dims))
        names = [d.name for d in self.dims]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"MeshLayout needs distinct dimension names, got {names}")
        if sum(d.size is None for d in self.dims) > 1:
            raise ValueError("at most one mesh dimension may leave its size to the world (size=None)")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    @property
    def fixed(self) -> int:
        """The product of the declared sizes: every world size must be a multiple of it."""
        return math.prod(d.size for d in self.dims if d.size is not None)

    def shape(self, world_size: int) -> tuple[int, ...]:
        """Each dimension's size in a world of ``world_size`` ranks; ``ValueError`` when it does not fit."""
        if world_size % self.fixed:
            raise ValueError(f"world size {world_size} is not a multiple of {self.fixed} ({self.describe_shape()})")
        rest = world_size // self.fixed
        sizes = tuple(rest if d.size is None else d.size for d in self.dims)
        if math.prod(sizes) != world_size:
            raise ValueError(f"mesh {self.describe_shape()} does not cover a world of {world_size} ranks")
        return sizes

    def describe_shape(self) -> str:
        """``"replicate=world/2 x shard=2"``: the sizes as declared, before a world is known."""
        return " x ".join(f"{d.name}={'world/' + str(self.fixed) if d.size is None else d.size}" for d in self.dims)

    def to_dict(self) -> dict[str, Any]:
        return {"dims": [asdict(d) for d in self.dims], "shape": self.describe_shape()}
