"""Batches of any structure: tensors nested in tuples, lists, dicts (``Mapping``), namedtuples.

The trainer never assumes a batch is ``(inputs, targets)`` except in the
``loss_fn`` form. Everything it does to a batch walks the structure:

* :func:`move_to_device` moves every tensor leaf (other leaves are kept), :func:`map_tensors` applies a
  function to each (both from :mod:`unison.contract.tensors`, the contract's own defaults use them);
* :func:`batch_size` finds the batch dimension: the first dimension of every
  tensor leaf with at least one dimension, which must agree (0-dim tensors and
  non-tensor leaves have none);
* :func:`split_batch` cuts every such leaf along that dimension;
* :func:`count_tokens` applies the documented token rule for throughput.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from unison.contract.tensors import map_tensors, move_to_device, tensor_leaves
from unison.errors import ConfigurationError

__all__ = ["batch_size", "count_tokens", "map_tensors", "move_to_device", "split_batch", "tensor_leaves"]


def batch_size(batch: Any, *, where: str = "batch") -> int | None:
    """The size of the batch dimension (dim 0), agreed by every tensor leaf that has one.

    Returns ``None`` for a batch without such a leaf. A leaf that disagrees is
    a :class:`ConfigurationError` naming it and the others' size.
    """
    size: int | None = None
    first = ""
    for path, tensor in tensor_leaves(batch, where):
        if tensor.dim() == 0:
            continue
        if size is None:
            size, first = tensor.shape[0], path
        elif tensor.shape[0] != size:
            raise ConfigurationError(
                "batch",
                f"{path} has {tensor.shape[0]} rows along dim 0 but {first} has {size}: every tensor leaf of a "
                "batch must hold the batch dimension first",
                "make the dataset/collate_fn return leaves of equal batch size (put per-batch constants in a "
                "0-dim tensor or a non-tensor value)",
            )
    return size


def split_batch(batch: Any, parts: int) -> list[Any]:
    """Cut ``batch`` into ``parts`` equal slices along the batch dimension of every leaf."""
    size = batch_size(batch)
    if size is None or size % parts:
        raise ConfigurationError(
            "batch", f"a batch of {size} rows does not split into {parts} equal parts", "use a divisible batch size"
        )
    step = size // parts

    def part(t: torch.Tensor, i: int) -> torch.Tensor:
        return t[i * step : (i + 1) * step] if t.dim() > 0 else t

    return [map_tensors(functools.partial(part, i=i), batch) for i in range(parts)]


def count_tokens(batch: Any) -> int | None:
    """Tokens in a (collated, host-side) batch, by the documented rule; ``None`` when it does not say.

    1. a mapping with an ``attention_mask`` tensor: its sum (padding excluded);
    2. else a mapping with an ``input_ids`` tensor: its number of elements;
    3. else an ``(inputs, targets)`` pair whose inputs are an integer tensor of
       at least 2 dimensions (token ids): its number of elements;
    4. else ``None`` (no tokens/s is reported).

    Pass ``fit(..., count_tokens=fn)`` to use another rule.
    """
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return int(mask.sum())
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids.numel()
        return None
    if isinstance(batch, (list, tuple)) and len(batch) == 2 and isinstance(batch[0], torch.Tensor):
        inputs = batch[0]
        if not inputs.is_floating_point() and not inputs.is_complex() and inputs.dim() >= 2:
            return inputs.numel()
    return None
