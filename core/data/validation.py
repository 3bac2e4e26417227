"""Validation batches: every sample once, spread over the data-parallel replicas, each with its
weight so the mean is per sample (a short last batch included).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from unison.data.batch import batch_size
from unison.data.plan import (
    validation_batches,
    validation_slices,
)
from unison.data.sources import CollateFn, LoaderOptions, is_map_style


def validation_stream(
    source: Any, collate_fn: CollateFn, batch_size: int, replicas: int, rank: int, options: LoaderOptions, seed: int
) -> Iterator[tuple[Any, int]]:
    """This replica's ``(batch, weight)`` validation batches; every replica yields the same count.

    Weight is the number of real samples in the batch (0 for the one-sample
    stand-in a replica runs when its slice of the last chunk is empty).
    """
    if is_map_style(source):
        plan = validation_batches(len(source), batch_size, replicas, rank)
        if not plan:
            return
        loader = DataLoader(
            source,
            batch_sampler=[indices for indices, _ in plan],
            collate_fn=collate_fn,
            generator=torch.Generator().manual_seed(seed),
            **options.kwargs(),
        )
        for (_, weight), batch in zip(plan, loader):
            yield batch, weight
        return
    chunk: list[Any] = []
    first: Any = None
    for sample in source:
        if first is None:
            first = sample
        chunk.append(sample)
        if len(chunk) == batch_size * replicas:
            yield _validation_part(chunk, collate_fn, replicas, rank)
            chunk = []
    if chunk:
        yield _validation_part(chunk, collate_fn, replicas, rank)


def _validation_part(chunk: list[Any], collate_fn: CollateFn, replicas: int, rank: int) -> tuple[Any, int]:
    start, size = validation_slices(len(chunk), replicas, rank)
    if size == 0:
        return collate_fn(chunk[:1]), 0
    return collate_fn(chunk[start : start + size]), size


def probe_batch_size(batch: Any, where: str) -> int | None:
    """The batch dimension of a collated batch (raises when leaves disagree)."""
    return batch_size(batch, where=where)
