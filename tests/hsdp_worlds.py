"""What the worlds of tests/test_hsdp.py run: hsdp at world 4 (2 replicas x 2 shards), and zero3 at world 2
resuming hsdp's checkpoint."""

from __future__ import annotations

import collections
from typing import Any

from torch.profiler import ProfilerActivity, profile

import unison
from unison.conformance.profiling import records

from fsdp_worlds import Footprint, _fit, wide_mlp
from helpers import mlp, regression_data, train


class CollectiveCounter:
    """Counts the c10d collectives of each step's micro-steps (step start .. after backward) by kind.

    A real plugin on the torch profiler, like fsdp_worlds.ReduceScatterCounter; the window ends
    before the clip's own all-reduce.
    """

    def __init__(self) -> None:
        self.per_step: list[dict[str, int]] = []
        self._prof: Any = None

    @unison.hookimpl
    def unison_on_train_step_start(self) -> None:
        self._prof = profile(activities=[ProfilerActivity.CPU])
        self._prof.__enter__()

    @unison.hookimpl
    def unison_on_after_backward(self) -> None:
        self._prof.__exit__(None, None, None)
        counts: collections.Counter[str] = collections.Counter()
        for r in records(self._prof):
            if not r.name.startswith("c10d::") or r.redispatched:
                continue
            if "reduce_scatter" in r.name:
                counts["reduce_scatter"] += 1
            elif "allreduce" in r.name or "all_reduce" in r.name:
                counts["all_reduce"] += 1
        self.per_step.append(dict(counts))


def hsdp_world(ckpt_root: str) -> dict[str, Any]:
    """World 4: parity, own resume, fsdp -> hsdp, collectives per step, memory per rank."""
    out: dict[str, Any] = {}
    # Parity: 20 steps, accumulation 4, clipping at 0.5 that clips, StepLR (helpers.train).
    out["fp32"] = train("hsdp")
    # Save at step 10 (kept for single and zero3 to resume), resume to 20.
    own = f"{ckpt_root}/hsdp"
    train("hsdp", max_steps=10, checkpoint_dir=own, record=False)
    out["resumed"] = train("hsdp", max_steps=20, checkpoint_dir=own, ckpt_path="last")
    # fsdp (1-D, 4 shards) -> hsdp (2 x 2).
    train("fsdp", max_steps=10, checkpoint_dir=f"{ckpt_root}/fsdp", record=False)
    out["from_fsdp"] = train("hsdp", max_steps=20, ckpt_path=f"{ckpt_root}/fsdp/step-00000010", record=False)
    # Collectives inside the micro-steps with accumulation 1 and 4: deferred on both dimensions.
    counts = {}
    for accumulate in (1, 4):
        counter = CollectiveCounter()
        _fit("hsdp", counter, model=mlp(), data=regression_data(), accumulate_grad_batches=accumulate,
             global_batch_size=32, max_steps=3)  # fmt: skip
        counts[accumulate] = counter.per_step
    out["collectives"] = counts
    # Memory per rank of a ~1.09M-parameter MLP under hsdp, fsdp and ddp.
    wide = regression_data(n=64, d=32)
    footprints = {}
    for name in ("hsdp", "fsdp", "ddp"):
        fp = Footprint()
        _fit(name, fp, model=wide_mlp(), data=wide, global_batch_size=8, max_steps=1)
        footprints[name] = fp.value
    out["footprint"] = footprints
    out["n_params"] = sum(p.numel() for p in wide_mlp().parameters())
    return out


def zero3_from(checkpoint: str) -> dict[str, Any]:
    """World 2: zero3 resumes a checkpoint written by another strategy and trains to step 20."""
    return train("zero3", max_steps=20, ckpt_path=checkpoint, record=False)
