"""What one 2-rank ddp world runs for tests/test_ddp.py: every scenario in one process group."""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from helpers import regression_data, train


class AllReduceCounter:
    """Counts all_reduce calls on the real process group while installed."""

    def __init__(self) -> None:
        self.count = 0
        self._orig = torch.distributed.all_reduce

    def __enter__(self) -> AllReduceCounter:
        def counting(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return self._orig(*args, **kwargs)

        torch.distributed.all_reduce = counting
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.distributed.all_reduce = self._orig


def overflow_data() -> torch.utils.data.TensorDataset:
    """Regression data where one sample's inputs overflow fp16 inside the model."""
    data = regression_data()
    x, y = data.tensors
    x = x.clone()
    x[3] = 7e4  # beyond fp16's max (65504) after the first Linear
    return torch.utils.data.TensorDataset(x, y)


def ddp_scenarios() -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["fp32"] = train("ddp", val=regression_data(n=51, seed=7), val_every_n_steps=10)
    out["bf16-mixed"] = train("ddp", precision="bf16-mixed")
    out["16-mixed"] = train("ddp", precision="16-mixed")
    out["overflow"] = train("ddp", precision="16-mixed", data=overflow_data(), global_batch_size=32, max_steps=8)
    # Resume: 10 steps with a checkpoint, then resume to 20; compare with uninterrupted.
    rank = torch.distributed.get_rank()
    root = [tempfile.mkdtemp(prefix="unison-ddp-ckpt-") if rank == 0 else None]
    torch.distributed.broadcast_object_list(root)
    train("ddp", max_steps=10, checkpoint_dir=root[0])
    out["resumed"] = train("ddp", max_steps=20, checkpoint_dir=root[0], ckpt_path="last")
    out["ckpt_dir"] = root[0]
    # Gradient sync really skipped on non-boundary micro-steps: the bucket
    # all-reduces of accumulation 4 equal those of accumulation 1.
    counts = {}
    for accumulate in (1, 4):
        with AllReduceCounter() as counter:
            train("ddp", accumulate_grad_batches=accumulate, max_steps=3, record=False)
        counts[accumulate] = counter.count
    out["allreduce_counts"] = counts
    return out
