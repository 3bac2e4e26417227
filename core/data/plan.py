"""Which samples form optimizer step ``k``: pure arithmetic on indices (property-tested).

The same for every backend and world size: a seeded permutation per epoch cut into global batches,
each cut into micro-batches, replica ``r`` of ``D`` taking slice ``r`` of each (see
:mod:`unison.data.loader` for the whole data path). A source may give the epoch's order itself
(``epoch_order(seed, epoch)``, e.g. :class:`unison.data.shards.ShardedDataset`'s shard-order + window
shuffle); it too depends on the seed and the epoch only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from unison.errors import ConfigurationError


@dataclass(frozen=True)
class StepSizes:
    """The sizes of one optimizer step, checked once where they are made: ``global_batch_size`` samples in
    ``accumulate_grad_batches`` micro-batches, each split over ``data_parallel_size`` replicas.

    A value that exists divides: a size that does not is a ConfigurationError naming ``global_batch_size``
    and the multiple that would. Made once per fit, from the settings and the strategy's data-parallel
    size (:func:`unison.training.preflight.declare`), and handed to the data path.
    """

    global_batch_size: int
    accumulate_grad_batches: int
    data_parallel_size: int

    def __post_init__(self) -> None:
        g, a, d = self.global_batch_size, self.accumulate_grad_batches, self.data_parallel_size
        if g % a:
            raise ConfigurationError(
                "global_batch_size",
                f"global_batch_size={g} does not divide into accumulate_grad_batches={a} micro-batches",
                "make global_batch_size a multiple of accumulate_grad_batches",
            )
        micro = g // a
        if micro % d:
            raise ConfigurationError(
                "global_batch_size",
                f"each micro-batch of {micro} samples (global_batch_size={g} / accumulate_grad_batches={a}) does "
                f"not split over {d} data-parallel replicas",
                f"make global_batch_size a multiple of accumulate_grad_batches * {d} "
                f"(e.g. {a * d * max(1, -(-micro // d))})",
            )


def check_divisible(global_batch_size: int, accumulate_grad_batches: int, data_parallel_size: int) -> None:
    """Raise a ConfigurationError naming the option when sizes do not divide (:class:`StepSizes`'s check)."""
    StepSizes(global_batch_size, accumulate_grad_batches, data_parallel_size)


@functools.lru_cache(maxsize=1)
def _epoch_permutation(dataset_size: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's sample order, drawn once per epoch: a fresh ``randperm`` per step costs
    milliseconds on a million samples (19 ms at 1.28M on one core) and would be paid every step.
    Callers only slice it."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(dataset_size, generator=generator)


def window_order(offsets: Sequence[int], seed: int, epoch: int, window: int, chunk: int = 1) -> torch.Tensor:
    """A shard-order + window shuffle of the samples of shards ``[offsets[s], offsets[s + 1])``.

    By seed and epoch only: shards in a seeded order, then runs of ``chunk`` consecutive samples
    permuted within consecutive windows of ``window`` samples (``chunk=1``: the samples themselves).
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    shard_order = torch.randperm(len(offsets) - 1, generator=generator).tolist()
    base = torch.cat([torch.arange(offsets[s], offsets[s + 1]) for s in shard_order])
    # Sort the chunks by (the window of the chunk's first sample + a uniform draw in [0, 1)), then
    # expand each chunk to its samples.
    size = len(base)
    chunks = -(-size // chunk)
    windows = torch.arange(chunks, dtype=torch.float64).mul_(chunk).div_(window).floor_()
    picked = torch.argsort(windows + torch.rand(chunks, generator=generator, dtype=torch.float64))
    positions = (picked[:, None] * chunk + torch.arange(chunk)).flatten()
    return base[positions[positions < size]]


@dataclass(frozen=True)
class BatchPlan:
    """Which samples of a map-style dataset form each micro-batch of each step, on one replica."""

    dataset_size: int
    global_batch_size: int
    accumulate_grad_batches: int
    data_parallel_size: int
    data_parallel_rank: int
    seed: int
    shuffle: bool = True
    #: ``(seed, epoch) -> permutation of range(dataset_size)`` or ``None``: the source's own epoch order
    #: (``None`` from it, or no function: the seeded global permutation).
    order: Callable[[int, int], torch.Tensor | None] | None = None

    def __post_init__(self) -> None:
        StepSizes(self.global_batch_size, self.accumulate_grad_batches, self.data_parallel_size)
        if self.dataset_size < self.global_batch_size:
            raise ConfigurationError(
                "global_batch_size",
                f"the training dataset has {self.dataset_size} samples, fewer than one global batch of "
                f"{self.global_batch_size}",
                "use a smaller global_batch_size or a larger dataset",
            )

    @property
    def steps_per_epoch(self) -> int:
        # The incomplete last global batch is dropped: every optimizer step
        # sees exactly global_batch_size samples on every backend.
        return self.dataset_size // self.global_batch_size

    def global_indices(self, step: int) -> list[int]:
        """The samples of optimizer step ``step``, all replicas together, in order."""
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.global_batch_size
        if not self.shuffle:
            return list(range(start, start + self.global_batch_size))
        order = self.order(self.seed, epoch) if self.order is not None else None
        if order is None:
            order = _epoch_permutation(self.dataset_size, self.seed, epoch)
        elif len(order) != self.dataset_size:
            raise ConfigurationError(
                "train_dataset",
                f"its epoch_order gave {len(order)} indices for {self.dataset_size} samples",
                "return a permutation of range(len(dataset))",
            )
        return order[start : start + self.global_batch_size].tolist()

    def local_micro_indices(self, step: int) -> list[list[int]]:
        """This replica's slice of each micro-batch of step ``step``."""
        return local_slices(
            self.global_indices(step), self.accumulate_grad_batches, self.data_parallel_size, self.data_parallel_rank
        )


def local_slices(global_batch: Sequence[Any], accumulate: int, replicas: int, rank: int) -> list[list[Any]]:
    """Cut one global batch into micro-batches and return replica ``rank``'s slice of each."""
    per_micro = len(global_batch) // accumulate
    per_rank = per_micro // replicas
    return [
        list(global_batch[m * per_micro + rank * per_rank : m * per_micro + (rank + 1) * per_rank])
        for m in range(accumulate)
    ]


def validation_slices(count: int, data_parallel_size: int, data_parallel_rank: int) -> tuple[int, int]:
    """``(start, size)`` of this replica's part of a validation chunk of ``count`` samples.

    Every sample is counted exactly once over all replicas; sizes differ by at most one.
    """
    base, extra = divmod(count, data_parallel_size)
    start = data_parallel_rank * base + min(data_parallel_rank, extra)
    return start, base + (1 if data_parallel_rank < extra else 0)


def validation_batches(
    dataset_size: int, batch_size: int, data_parallel_size: int, data_parallel_rank: int
) -> list[tuple[list[int], int]]:
    """This replica's validation batches of a map-style dataset as ``(indices, weight)``.

    Every sample is counted exactly once over all replicas, and every replica
    runs the same number of forwards (sharded models gather parameters inside
    forward, so an uneven count would hang). A replica whose slice of the last
    chunk is empty runs one duplicated sample with weight 0.
    """
    chunk = batch_size * data_parallel_size
    batches = []
    for start in range(0, dataset_size, chunk):
        lo, n = validation_slices(min(chunk, dataset_size - start), data_parallel_size, data_parallel_rank)
        batches.append((list(range(start + lo, start + lo + n)), n) if n else ([start], 0))
    return batches
