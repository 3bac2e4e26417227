"""What one 2-rank ddp world runs for tests/test_ddp.py: every scenario in one process group."""

from __future__ import annotations

import tempfile
import time
from typing import Any

import torch

import unison

from helpers import overflow_data, regression_data, train


def gradient_allreduces(accumulate: int, *, broken_no_sync: bool = False, steps: int = 3) -> int:
    """All-reduces issued on the process group while ddp trains, seen where DDP's C++ reducer issues them.

    The reducer calls the ProcessGroup from C++ and never passes through the
    Python ``torch.distributed.all_reduce``, so the count comes from the
    ``c10d::allreduce_`` dispatcher ops recorded by ``torch.profiler`` (the
    conformance suite's method), which every collective goes through.
    ``broken_no_sync`` replaces the strategy's ``no_sync()`` with one that
    defers nothing: the count must then grow, or this counter could not see a
    broken ``no_sync``.
    """
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    import unison

    from helpers import mlp

    trainer = unison.Trainer(
        strategy="ddp", accumulate_grad_batches=accumulate, global_batch_size=32, max_steps=steps, grad_clip_norm=0.5
    )
    if broken_no_sync:
        trainer.strategy.no_sync = contextlib.nullcontext
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.fit(
            mlp(),
            regression_data(),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        )
    from unison.conformance.profiling import records

    return sum(1 for r in records(prof) if r.name == "c10d::allreduce_" and not r.redispatched)


class SlowFitEndOnRank0:
    """Rank 0 takes a second longer to end its fit (a slow logger's flush, a busy core)."""

    @unison.hookimpl
    def unison_on_fit_end(self, trainer: Any) -> None:
        if trainer.is_global_zero:
            time.sleep(1.0)


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
    # Rank 0 holds the checkpoint directory's lease and is slowed at the first fit's end: the second fit's
    # preflight on rank 1 (no collective yet) must not find the first fit's lease still held.
    train("ddp", max_steps=10, checkpoint_dir=root[0], callbacks=(SlowFitEndOnRank0(),))
    out["resumed"] = train("ddp", max_steps=20, checkpoint_dir=root[0], ckpt_path="last")
    out["ckpt_dir"] = root[0]
    # Gradient sync really skipped on non-boundary micro-steps: the all-reduces
    # of accumulation 4 equal those of accumulation 1, and a no_sync that
    # defers nothing adds one per extra micro-step.
    out["allreduce_counts"] = {
        1: gradient_allreduces(1),
        4: gradient_allreduces(4),
        "broken": gradient_allreduces(4, broken_no_sync=True),
    }
    return out
