"""The data path: global-batch-invariant sampling, loading, collation, device move, position.

The trainer, not the strategy, decides which samples form optimizer step
``k``, so step ``k`` sees the same samples in the same order for every backend
and world size; that is what makes a single process on the full batch a valid
reference. :class:`TrainData` is the one object the trainer asks for step
``k``'s micro-batches.

Map-style datasets (``len`` and ``__getitem__``, Hugging Face ``datasets.Dataset``)
    A seeded permutation per epoch (by seed and epoch, never by rank; a source with
    ``epoch_order(seed, epoch)`` may give its own, e.g. a sharded source's window shuffle), cut into
    global batches of ``global_batch_size``; each global batch is cut into
    ``accumulate_grad_batches`` micro-batches, and data-parallel replica ``r``
    of ``D`` takes slice ``r`` of each micro-batch. The incomplete last global
    batch of an epoch is dropped. A ``torch.utils.data.DataLoader`` on a batch
    sampler that yields exactly those index lists does the loading, so
    ``num_workers``, ``pin_memory``, ``prefetch_factor`` and
    ``persistent_workers`` change the speed, never the samples. A source with
    ``follow_plan(batches)`` is handed that batch sampler before the loader
    starts (and ``None`` when it stops), so it can read ahead along the plan
    (:class:`unison.data.shards.ShardedDataset` does).

Iterable datasets (``IterableDataset``, Hugging Face streaming datasets, any re-iterable)
    The stream is read in order and cut the same way: global batch ``k`` of a
    pass is stream samples ``[k * G, (k + 1) * G)``, its micro-batches and
    rank slices as above. **Every rank reads the whole stream** and keeps its
    own slices (as Accelerate's ``IterableDatasetShard`` does): exact for any
    world size, at the price of reading the stream ``D`` times. Shuffling is
    the stream's own business (e.g. ``datasets``' ``shuffle(buffer_size)``);
    a source with ``set_epoch`` is told the epoch before each pass. With
    workers, worker ``w`` of ``W`` collates micro-batches ``w, w + W, ...``
    (all read the stream), and the loader's round-robin order puts them back
    in sequence. A pass that ends inside a global batch drops the remainder.

Resume
    The position is the global step: map-style data recomputes the sampler
    from it; iterable data re-reads (without collating) the samples of the
    steps already taken, so a resumed run continues with exactly the samples
    an uninterrupted run would have seen, mid-epoch and mid-stream.

Collation
    ``collate_fn`` (default ``torch.utils.data.default_collate``) turns a list
    of samples into a batch of any structure; a Hugging Face data collator
    works as is. It runs on each rank's slice of a micro-batch (in the loader
    workers when there are any).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from unison._upstream.torch import shutdown_loader_workers
from unison.contract.settings import TrainerSettings
from unison.data.batch import count_tokens
from unison.data.plan import (
    BatchPlan,
    StepSizes,
    local_slices,
)
from unison.data.read_ahead import ReadStats
from unison.data.sources import CollateFn, is_map_style, resolve_source
from unison.data.streams import MicroBatchSampler, StreamMicroBatches, stream_global_batches
from unison.errors import ConfigurationError


@dataclass
class StepBatch:
    """The micro-batches of one optimizer step on this replica, already on the device."""

    step: int
    epoch: int
    micro_batches: list[Any]
    #: Whether this is the last step of its epoch (the trainer fires ``epoch_end`` after it).
    last_in_epoch: bool
    #: Tokens in this replica's micro-batches by the token rule (``None``: unknown).
    tokens: int | None


class TrainData:
    """Sampler, loader, collation, device move and resumable position of the training data.

    Args:
        source: a map-style dataset, an iterable one, or a ``DataLoader``.
        collate_fn: list of samples -> batch (default ``default_collate``).
        settings: the trainer settings (batch sizes, seed, shuffle, loader options).
        data_parallel_size / data_parallel_rank: this replica's place.
        sizes: the step's sizes as the fit checked them (:class:`~unison.data.plan.StepSizes`); made from
            ``settings`` and ``data_parallel_size`` when not given.
        to_device: moves a collated batch to the rank's device (the strategy's ``to_device``).
        token_counter: the token rule (default :func:`unison.data.batch.count_tokens`).
    """

    def __init__(
        self,
        source: Any,
        collate_fn: CollateFn | None,
        settings: TrainerSettings,
        *,
        data_parallel_size: int | None = None,
        data_parallel_rank: int,
        sizes: StepSizes | None = None,
        to_device: Callable[..., Any] | None = None,
        token_counter: Callable[[Any], int | None] | None = None,
    ) -> None:
        self.settings = settings
        self.dataset, self.collate_fn, self.options = resolve_source(source, collate_fn, settings)
        self.map_style = is_map_style(self.dataset)
        if sizes is None:
            if data_parallel_size is None:
                raise TypeError("TrainData needs sizes or data_parallel_size")
            sizes = StepSizes(settings.global_batch_size, settings.accumulate_grad_batches, data_parallel_size)
        self.replicas, self.rank = sizes.data_parallel_size, data_parallel_rank
        self.plan = (
            BatchPlan(
                len(self.dataset),
                sizes.global_batch_size,
                sizes.accumulate_grad_batches,
                sizes.data_parallel_size,
                data_parallel_rank,
                settings.seed,
                settings.shuffle,
                getattr(self.dataset, "epoch_order", None),
            )
            if self.map_style
            else None
        )
        # The identity takes the keyword arguments a strategy's to_device does (non_blocking).
        self.to_device: Callable[..., Any] = to_device or (lambda batch, **_: batch)
        self.token_counter = token_counter or count_tokens
        #: Whether tokens are counted by the documented rule (no ``count_tokens`` given): a loss that reports its
        #: items then supplies the step's token count instead (the number it is normalised by).
        self.counts_tokens_by_default = token_counter is None
        self._iterator: Any = None

    # -- sizes ------------------------------------------------------------------ #
    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps per pass (``None`` for iterable data: unknown until read)."""
        return self.plan.steps_per_epoch if self.plan is not None else None

    def total_steps(self) -> int | None:
        """The step ``fit`` ends at, from ``max_steps`` or ``max_epochs`` (``None``: the stream decides)."""
        s = self.settings
        if s.max_steps is not None:
            return s.max_steps
        spe = self.steps_per_epoch
        return None if spe is None else spe * (s.max_epochs or 0)

    # -- checks before any process group ---------------------------------------- #
    def first_micro_batch(self) -> Any:
        """This replica's first micro-batch of step 0, collated on the host (reads the source).

        For iterable data this also proves the stream holds one global batch.
        """
        s = self.settings
        if self.plan is not None:
            indices = self.plan.local_micro_indices(0)[0]
            # As the DataLoader reads: one __getitems__ call where the source has one (a sharded
            # source reads the slice in one batch of range requests).
            getitems = getattr(self.dataset, "__getitems__", None)
            return self.collate_fn(getitems(indices) if getitems else [self.dataset[i] for i in indices])
        batches = stream_global_batches(self.dataset, s.global_batch_size, end_step=1)
        try:
            _, _, samples = next(batches)
        except ConfigurationError:
            raise ConfigurationError(
                "global_batch_size",
                f"the training iterable holds fewer samples than one global batch of {s.global_batch_size}",
                "use a smaller global_batch_size or a longer stream",
            ) from None
        except StopIteration:  # pragma: no cover - end_step/end_epoch are None
            raise
        return self.collate_fn(local_slices(samples, s.accumulate_grad_batches, self.replicas, self.rank)[0])

    # -- iteration ------------------------------------------------------------------ #
    def _loader(self, start_step: int, end_step: int | None) -> DataLoader:
        s = self.settings
        # A seeded generator: worker seeds (torch, random, numpy) are the same run to run.
        generator = torch.Generator().manual_seed(s.seed * 7_919 + start_step)
        kwargs = self.options.kwargs()
        if self.plan is not None:
            assert end_step is not None
            sampler = MicroBatchSampler(self.plan, start_step, end_step)
            follow = getattr(self.dataset, "follow_plan", None)
            if follow is not None:  # a source that reads ahead (ShardedDataset) learns what comes next
                follow(sampler)
            return DataLoader(
                self.dataset,
                batch_sampler=sampler,
                collate_fn=self.collate_fn,
                generator=generator,
                **kwargs,
            )
        stream = StreamMicroBatches(
            self.dataset,
            self.collate_fn,
            s.global_batch_size,
            s.accumulate_grad_batches,
            self.replicas,
            self.rank,
            start_step,
            end_step,
            s.max_epochs if s.max_steps is None else None,
        )
        return DataLoader(stream, batch_size=None, generator=generator, **kwargs)

    def steps(self, start_step: int) -> Iterator[StepBatch]:
        """Every remaining optimizer step's micro-batches, from ``start_step`` on.

        The loader runs one micro-batch ahead, which tells the last step of an
        epoch of iterable data without a second pass.
        """
        end = self.total_steps()
        if end is not None and start_step >= end:
            return
        self._iterator = iter(self._loader(start_step, end))
        items = self._items(start_step)
        pending = next(items, None)
        try:
            while pending is not None:
                step, epoch, batches = pending
                pending = next(items, None)
                if self.plan is not None:
                    last = (step + 1) % self.plan.steps_per_epoch == 0
                else:
                    last = pending is None or pending[1] != epoch
                counts = [self.token_counter(b) for b in batches]
                known = [c for c in counts if c is not None]
                tokens = sum(known) if len(known) == len(counts) else None
                pin = self.options.pin_memory
                yield StepBatch(
                    step,
                    epoch,
                    [self.to_device(b, non_blocking=pin) if pin else self.to_device(b) for b in batches],
                    last,
                    tokens,
                )
                del batches
        finally:
            self.close()

    def _items(self, start_step: int) -> Iterator[tuple[int, int, list[Any]]]:
        """``(step, epoch, micro-batches)`` read off the loader, step by step."""
        accumulate = self.settings.accumulate_grad_batches
        if self.plan is not None:
            step = start_step
            while True:
                batches = list(itertools.islice(self._iterator, accumulate))
                if not batches:
                    return
                yield step, step // self.plan.steps_per_epoch, batches
                step += 1
        else:
            while True:
                group = list(itertools.islice(self._iterator, accumulate))
                if not group:
                    return
                step, epoch = group[0][0], group[0][1]
                if [g[2] for g in group] != list(range(accumulate)) or any(g[0] != step for g in group):
                    raise RuntimeError(f"the loader returned micro-batches out of order at step {step}")
                yield step, epoch, [g[3] for g in group]

    def close(self) -> None:
        """Stop loader workers (also called when ``fit`` ends early)."""
        iterator, self._iterator = self._iterator, None
        if iterator is not None:
            shutdown_loader_workers(iterator)
        follow = getattr(self.dataset, "follow_plan", None)
        if follow is not None:
            follow(None)  # what was read ahead for a loader that is gone is dropped

    def read_retries(self) -> int | None:
        """Transient read errors retried so far by a source that counts them (a sharded dataset: this
        process and its loader workers, summed); ``None`` for other sources."""
        stats = getattr(self.dataset, "stats", None)
        return stats.retries if isinstance(stats, ReadStats) else None

    # -- position ------------------------------------------------------------------- #
    def state_dict(self, step: int) -> dict[str, Any]:
        """What a checkpoint records about the data position (the global step is the position)."""
        return {
            "step": step,
            "map_style": self.map_style,
            "dataset_size": len(self.dataset) if self.map_style else None,
        }

    def check_resume(self, state: dict[str, Any] | None) -> None:
        """Warn when a resumed run's data is not the data its checkpoint was trained on."""
        if not state or not self.map_style or state.get("dataset_size") in (None, len(self.dataset)):
            return
        warnings.warn(
            f"resuming a checkpoint trained on a dataset of {state['dataset_size']} samples with one of "
            f"{len(self.dataset)}: epochs are cut differently, so the resumed run does not see the samples an "
            "uninterrupted run would have seen",
            stacklevel=3,
        )
