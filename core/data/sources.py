"""What a dataset is to the loader: map-style or iterable, and the DataLoader options."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, default_convert

from unison.contract.settings import TrainerSettings
from unison.errors import ConfigurationError

CollateFn = Callable[[list[Any]], Any]


def is_map_style(source: Any) -> bool:
    """``len`` and ``__getitem__`` and not declared iterable-style."""
    return not isinstance(source, IterableDataset) and hasattr(source, "__getitem__") and hasattr(source, "__len__")


@dataclass(frozen=True)
class LoaderOptions:
    """How batches are loaded; never which samples they hold."""

    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    worker_init_fn: Callable[[int], None] | None = None
    multiprocessing_context: Any = None

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_workers": self.num_workers, "pin_memory": self.pin_memory}
        if self.num_workers:
            out.update(
                prefetch_factor=self.prefetch_factor,
                persistent_workers=self.persistent_workers,
                worker_init_fn=self.worker_init_fn,
                multiprocessing_context=self.multiprocessing_context,
            )
        return out


def resolve_source(
    data: Any, collate_fn: CollateFn | None, settings: TrainerSettings, *, what: str = "train_dataset"
) -> tuple[Any, CollateFn, LoaderOptions]:
    """``(dataset, collate_fn, loader options)`` for a dataset, iterable or ``DataLoader``.

    A ``DataLoader`` contributes its dataset, ``collate_fn`` and worker
    settings; its ``batch_size``, ``sampler`` and ``shuffle`` are replaced by
    the trainer's global-batch-invariant sampling (see the module doc).
    """
    options = LoaderOptions(
        settings.num_workers, settings.pin_memory, settings.prefetch_factor, settings.persistent_workers
    )
    if isinstance(data, DataLoader):
        if collate_fn is None and data.collate_fn is not default_collate and data.collate_fn is not default_convert:
            collate_fn = data.collate_fn
        options = LoaderOptions(
            data.num_workers,
            data.pin_memory,
            data.prefetch_factor if data.num_workers else None,
            data.persistent_workers,
            data.worker_init_fn,
            data.multiprocessing_context,
        )
        data = data.dataset
    if (
        data is None
        or isinstance(data, (str, bytes, torch.Tensor))
        or (not isinstance(data, Iterable) and not is_map_style(data))
    ):
        raise ConfigurationError(
            what,
            f"{type(data).__name__} is not a dataset",
            "pass a map-style dataset (len + __getitem__), an IterableDataset, a Hugging Face dataset or a DataLoader",
        )
    if not is_map_style(data) and iter(data) is data:
        raise ConfigurationError(
            what,
            f"{type(data).__name__} is a one-shot iterator: it can be read once, but resuming, validation of the "
            "first batch and every epoch need to read it again",
            "pass a re-iterable source: an IterableDataset whose __iter__ starts a new pass, or a list",
        )
    return data, collate_fn or default_collate, options
