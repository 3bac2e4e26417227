"""What the worlds of tests/test_pipeline_fsdp.py run: pipeline_fsdp at world 4 (2 dp replicas x 2 stages)."""

from __future__ import annotations

from typing import Any

from fsdp_worlds import Footprint, _fit
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
    # bf16-mixed (the sharding policy) and bf16-true (the trainer's cast before sharding).
    out["precision"] = {
        precision: train("pipeline_fsdp", record=False, precision=precision)["state"]
        for precision in ("bf16-mixed", "bf16-true")
    }
    # The other schedules: one chunk per rank (1f1b) and two (interleaved, looped BFS, zero bubble; V placement).
    out["schedules"] = {
        schedule: train("pipeline_fsdp", record=False, strategy_options={"schedule": schedule})["state"]
        for schedule in ("1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble")
    }
    # Collectives inside each step (the schedule's run) with 1 or 2 and 4 micro-batches, under GPipe (one
    # model chunk per rank) and interleaved 1F1B (two; its REDUCE_GRAD is an action of the lowered schedule).
    counts: dict[str, dict[int, list[dict[str, int]]]] = {}
    for schedule, micro_batches in (("gpipe", (1, 4)), ("interleaved_1f1b", (2, 4))):
        counts[schedule] = {}
        for accumulate in micro_batches:
            counter = CollectiveCounter()
            _fit("pipeline_fsdp", counter, model=mlp(), data=regression_data(), accumulate_grad_batches=accumulate,
                 global_batch_size=32, max_steps=3, strategy_options={"schedule": schedule})  # fmt: skip
            counts[schedule][accumulate] = counter.per_step
    out["collectives"] = counts
    # Memory: each stage's state is split over its 2 replicas, against pipeline's whole copies.
    out["footprint"] = {}
    for name in ("pipeline", "pipeline_fsdp"):
        footprint = Footprint()
        _fit(name, footprint, model=mlp(), data=regression_data(), global_batch_size=32, max_steps=1)
        out["footprint"][name] = footprint.value
    return out
