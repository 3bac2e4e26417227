"""What the worlds of tests/test_pipeline_fsdp.py run: pipeline_fsdp at world 4 (2 dp replicas x 2 stages)."""

from __future__ import annotations

from typing import Any

from fsdp_worlds import _fit
from helpers import mlp, regression_data, train
from hsdp_worlds import CollectiveCounter


def pipeline_fsdp_world(ckpt_root: str) -> dict[str, Any]:
    """World 4: parity, own resume, fsdp -> pipeline_fsdp, collectives per step."""
    out: dict[str, Any] = {}
    # Parity: 20 steps, accumulation 4, clipping at 0.5 that clips, StepLR (helpers.train).
    out["fp32"] = train("pipeline_fsdp")
    # Save at step 10 (kept for single and zero3 to resume), resume to 20.
    own = f"{ckpt_root}/pipeline_fsdp"
    train("pipeline_fsdp", max_steps=10, checkpoint_dir=own, record=False)
    out["resumed"] = train("pipeline_fsdp", max_steps=20, checkpoint_dir=own, ckpt_path="last")
    # fsdp (1-D, 4 shards) -> pipeline_fsdp (2 x 2).
    train("fsdp", max_steps=10, checkpoint_dir=f"{ckpt_root}/fsdp", record=False)
    out["from_fsdp"] = train("pipeline_fsdp", max_steps=20, ckpt_path=f"{ckpt_root}/fsdp/step-00000010", record=False)
    # Collectives inside each step (the schedule's run) with 1 and 4 micro-batches.
    counts = {}
    for accumulate in (1, 4):
        counter = CollectiveCounter()
        _fit("pipeline_fsdp", counter, model=mlp(), data=regression_data(), accumulate_grad_batches=accumulate,
             global_batch_size=32, max_steps=3)  # fmt: skip
        counts[accumulate] = counter.per_step
    out["collectives"] = counts
    return out
