"""The scenarios' data and sizes.

Sizes scale with the world sizes involved (:class:`Sizing`): every micro-batch
holds ``4 * lcm(world_size, alt_world_size)`` samples, so it splits evenly
over the data-parallel ranks of the main world and of the world a reshardable
checkpoint is resumed at, and the single-process reference sees exactly the
same global batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset, TensorDataset

from unison.conformance.models import IN_FEATURES, OVERFLOW_INPUT


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
