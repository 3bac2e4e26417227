"""What the ``DataLoader`` runs: a batch sampler over a map-style dataset's index lists, and an
iterable wrapper that cuts a stream into the same global batches and micro-batches.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, Sampler

from unison._upstream.torch import hidden_loader_worker
from unison.data.plan import (
    BatchPlan,
    local_slices,
)
from unison.data.sources import CollateFn
from unison.errors import ConfigurationError


class MicroBatchSampler(Sampler[list[int]]):
    """Yields this replica's index list of every micro-batch from ``start_step`` to ``end_step``."""

    def __init__(self, plan: BatchPlan, start_step: int, end_step: int) -> None:
        self.plan, self.start_step, self.end_step = plan, start_step, end_step

    def __len__(self) -> int:
        return (self.end_step - self.start_step) * self.plan.accumulate_grad_batches

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.end_step):
            yield from self.plan.local_micro_indices(step)


class StreamMicroBatches(IterableDataset):
    """Runs in each loader worker: reads the stream, yields ``(step, epoch, micro_index, batch)``.

    Steps before ``start_step`` are read but not collated (exact resume).
    """

    def __init__(
        self,
        source: Any,
        collate_fn: CollateFn,
        global_batch_size: int,
        accumulate: int,
        replicas: int,
        rank: int,
        start_step: int,
        end_step: int | None,
        end_epoch: int | None,
    ) -> None:
        self.source, self.collate_fn = source, collate_fn
        self.global_batch_size, self.accumulate, self.replicas, self.rank = (
            global_batch_size,
            accumulate,
            replicas,
            rank,
        )
        self.start_step, self.end_step, self.end_epoch = start_step, end_step, end_epoch

    def __iter__(self) -> Iterator[tuple[int, int, int, Any]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # Sources such as Hugging Face's IterableDataset shard themselves by loader worker when they
        # see one; every worker must read the whole stream here to keep the global order (checked by
        # the tests with a real Hugging Face streaming dataset and 2 workers).
        with hidden_loader_worker():
            for step, epoch, samples in stream_global_batches(
                self.source, self.global_batch_size, self.end_step, self.end_epoch
            ):
                if step < self.start_step:
                    continue
                for m, part in enumerate(local_slices(samples, self.accumulate, self.replicas, self.rank)):
                    if (step * self.accumulate + m) % workers == worker:
                        yield step, epoch, m, self.collate_fn(part)


def stream_global_batches(
    source: Any, global_batch_size: int, end_step: int | None = None, end_epoch: int | None = None
) -> Iterator[tuple[int, int, list[Any]]]:
    """``(step, epoch, samples)`` for every complete global batch of the stream, pass after pass."""
    step = 0
    for epoch in itertools.count():
        if (end_epoch is not None and epoch >= end_epoch) or (end_step is not None and step >= end_step):
            return
        if hasattr(source, "set_epoch"):
            source.set_epoch(epoch)
        buffer: list[Any] = []
        steps_in_pass = 0
        for sample in source:
            buffer.append(sample)
            if len(buffer) == global_batch_size:
                yield step, epoch, buffer
                buffer = []
                step += 1
                steps_in_pass += 1
                if end_step is not None and step >= end_step:
                    return
        if steps_in_pass == 0:
            raise ConfigurationError(
                "train_dataset",
                f"pass {epoch} over the iterable yielded {len(buffer)} samples, fewer than one global batch of "
                f"{global_batch_size}",
                "use a smaller global_batch_size or a longer stream",
            )
