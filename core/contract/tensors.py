"""Tensor trees: a batch of any structure, walked leaf by leaf (tensors nested in tuples, lists,
dicts (``Mapping``), namedtuples).

The contract's defaults use them (:meth:`~unison.contract.strategy.Strategy.to_device` moves a batch with
:func:`move_to_device`, a precision casts one with :func:`map_tensors`); :mod:`unison.data.batch` builds
on them for sizes, splits and token counts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["map_tensors", "move_to_device", "tensor_leaves"]


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """Apply ``fn`` to every tensor leaf, keeping the containers (and their types)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if _is_namedtuple(batch):
        return type(batch)(*(map_tensors(fn, v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(fn, v) for v in batch)
    if isinstance(batch, Mapping):
        mapped = {k: map_tensors(fn, v) for k, v in batch.items()}
        try:
            # Keep the mapping's own type (e.g. transformers' BatchEncoding).
            rebuild: Any = type(batch)  # a concrete Mapping subclass, whose constructor takes a dict
            return rebuild(mapped)
        except Exception:  # a Mapping type that cannot be rebuilt from a dict
            return mapped
    return batch


def tensor_leaves(batch: Any, path: str = "batch") -> list[tuple[str, torch.Tensor]]:
    """Every tensor leaf with its path (``batch['input_ids']``, ``batch[0]``)."""
    if isinstance(batch, torch.Tensor):
        return [(path, batch)]
    if isinstance(batch, (list, tuple)):
        return [leaf for i, v in enumerate(batch) for leaf in tensor_leaves(v, f"{path}[{i}]")]
    if isinstance(batch, Mapping):
        return [leaf for k, v in batch.items() for leaf in tensor_leaves(v, f"{path}[{k!r}]")]
    return []


def move_to_device(batch: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """Every tensor leaf on ``device`` (``non_blocking`` for pinned host memory)."""
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), batch)
