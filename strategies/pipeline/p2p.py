"""Point-to-point tensors between pipeline ranks, outside a schedule (validation).

A schedule's communication buffers are sized for training micro-batches;
validation batches differ in size, so a stage sends each activation with a
small header (dtype, rank, shape) ahead of it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool]


def as_tensor(value: Any, what: str) -> torch.Tensor:
    """``value`` itself when it is a tensor; a pipeline passes single tensors between stages."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"strategy 'pipeline' needs {what} to be a single tensor, got {type(value).__name__}")
    return value


def send_tensor(t: torch.Tensor, dst: int) -> None:
    """Send ``t`` of any shape and dtype to global rank ``dst`` (pairs with :func:`recv_tensor`)."""
    header = torch.tensor([_DTYPES.index(t.dtype), t.dim(), *t.shape], dtype=torch.int64, device=t.device)
    dist.send(torch.tensor([header.numel()], dtype=torch.int64, device=t.device), dst)
    dist.send(header, dst)
    dist.send(t.contiguous(), dst)


def recv_tensor(src: int, device: torch.device) -> torch.Tensor:
    """Receive what :func:`send_tensor` sent from global rank ``src``."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src)
    header = torch.zeros(int(size), dtype=torch.int64, device=device)
    dist.recv(header, src)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    out = torch.empty([int(v) for v in header[2 : 2 + ndim]], dtype=dtype, device=device)
    dist.recv(out, src)
    return out


__all__ = ["as_tensor", "recv_tensor", "send_tensor"]
