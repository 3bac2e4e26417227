"""Global-batch-invariant sampling.

The trainer, not the strategy, decides which samples form optimizer step ``k``:
a seeded permutation of the dataset per epoch, cut into global batches of
``global_batch_size``; each global batch is cut into ``accumulate_grad_batches``
micro-batches, and data-parallel replica ``r`` of ``D`` takes slice ``r`` of
each micro-batch. So step ``k`` sees the same samples in the same order for
every backend and world size, which is what makes a single process on the
full batch a valid reference.

Unlike a ``DistributedSampler`` (which shuffles per replica and so changes the
data order with the device count), the permutation here depends only on the
seed and the epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.utils.data import Dataset, default_collate

from unison.errors import ConfigurationError


@dataclass(frozen=True)
class BatchPlan:
    dataset_size: int
    global_batch_size: int
    accumulate_grad_batches: int
    data_parallel_size: int
    data_parallel_rank: int
    seed: int
    shuffle: bool = True

    @staticmethod
    def check_divisible(global_batch_size: int, accumulate_grad_batches: int, data_parallel_size: int) -> None:
        """Raise a ConfigurationError naming the option when sizes do not divide."""
        if global_batch_size < 1 or accumulate_grad_batches < 1:
            raise ConfigurationError(
                "global_batch_size/accumulate_grad_batches", "both must be at least 1", "pass positive integers"
            )
        if global_batch_size % accumulate_grad_batches:
            raise ConfigurationError(
                "global_batch_size",
                f"global_batch_size={global_batch_size} does not divide into accumulate_grad_batches="
                f"{accumulate_grad_batches} micro-batches",
                "make global_batch_size a multiple of accumulate_grad_batches",
            )
        micro = global_batch_size // accumulate_grad_batches
        if micro % data_parallel_size:
            raise ConfigurationError(
                "global_batch_size",
                f"each micro-batch of {micro} samples (global_batch_size={global_batch_size} / "
                f"accumulate_grad_batches={accumulate_grad_batches}) does not split over "
                f"{data_parallel_size} data-parallel replicas",
                f"make global_batch_size a multiple of accumulate_grad_batches * {data_parallel_size} "
                f"(e.g. {accumulate_grad_batches * data_parallel_size * max(1, -(-micro // data_parallel_size))})",
            )

    def __post_init__(self) -> None:
        self.check_divisible(self.global_batch_size, self.accumulate_grad_batches, self.data_parallel_size)
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

    @property
    def micro_batch_size(self) -> int:
        """Samples per micro-batch on this replica."""
        return self.global_batch_size // self.accumulate_grad_batches // self.data_parallel_size

    def _permutation(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_size)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.dataset_size, generator=generator)

    def global_indices(self, step: int) -> list[int]:
        """The samples of optimizer step ``step``, all replicas together, in order."""
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.global_batch_size
        return self._permutation(epoch)[start : start + self.global_batch_size].tolist()

    def local_micro_indices(self, step: int) -> list[list[int]]:
        """This replica's slice of each micro-batch of step ``step``."""
        indices = self.global_indices(step)
        per_micro = self.global_batch_size // self.accumulate_grad_batches
        per_rank = per_micro // self.data_parallel_size
        out = []
        for m in range(self.accumulate_grad_batches):
            micro = indices[m * per_micro : (m + 1) * per_micro]
            out.append(micro[self.data_parallel_rank * per_rank : (self.data_parallel_rank + 1) * per_rank])
        return out


def collate(dataset: Dataset, indices: Sequence[int]) -> Any:
    return default_collate([dataset[i] for i in indices])


def validation_batches(
    dataset_size: int, batch_size: int, data_parallel_size: int, data_parallel_rank: int
) -> list[tuple[list[int], int]]:
    """This replica's validation batches as ``(indices, weight)``.

    Every sample is counted exactly once over all replicas, and every replica
    runs the same number of forwards (sharded models gather parameters inside
    forward, so an uneven count would hang). A replica whose slice of the last
    chunk is empty runs one duplicated sample with weight 0.
    """
    chunk = batch_size * data_parallel_size
    batches = []
    for start in range(0, dataset_size, chunk):
        size = min(chunk, dataset_size - start)
        base, extra = divmod(size, data_parallel_size)
        lo = start + data_parallel_rank * base + min(data_parallel_rank, extra)
        n = base + (1 if data_parallel_rank < extra else 0)
        batches.append((list(range(lo, lo + n)), n) if n else ([start], 0))
    return batches
